"""Log hygiene: no payload, inbox id, key or header value in any log line, at any level.

Our own log statements name only types, counts and configured names. Two things
would still carry request bytes into the log, so `install()` filters them:
- third-party loggers (aiohttp's parser errors and access lines, asyncio's callback
  and transport reports) format request-derived values into their messages: their
  records keep the fixed message text, lose their arguments and exception;
- an exception's message (a decode error quotes the bytes it choked on, a KeyError
  its key): every record's traceback is replaced by its type and frames only.
"""

from __future__ import annotations

import logging
import traceback
from types import TracebackType

# Loggers whose arguments or messages can carry request bytes.
_THIRD_PARTY = (
    "aiohttp.access",
    "aiohttp.server",
    "aiohttp.web",
    "aiohttp.websocket",
    "aiohttp.internal",
    "aiohttp.client",
    "asyncio",
)
_MAX_TEXT = 160


def describe(exc: BaseException | None, tb: TracebackType | None = None) -> str:
    """`TypeName at file:line in function <- ...` (innermost first): never the message."""
    if exc is None:
        return "no exception"
    frames = traceback.extract_tb(tb if tb is not None else exc.__traceback__)[-4:]
    where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}" + (f" at {where}" if where else "")


def _safe_exception(record: logging.LogRecord) -> None:
    info = record.exc_info
    if info and info[1] is not None:
        record.exc_text = f"exception (message withheld): {describe(info[1], info[2])}"
    record.exc_info = None
    record.stack_info = None


class _WithholdArguments(logging.Filter):
    """For third-party records: the message text without its arguments (they are
    request-derived: peer, request line, header values), exception by type only."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if record.name == "asyncio":
            # asyncio builds one string from reprs of handles/protocols/exceptions: keep its
            # fixed lead ("Exception in callback", "Fatal error on transport", ...)
            text = text.split("\n", 1)[0].split("<", 1)[0].split(":", 1)[0].strip()
        record.msg = text[:_MAX_TEXT]
        record.args = ()
        _safe_exception(record)
        return True


class _WithholdExceptionText(logging.Filter):
    """On handlers: any record's traceback becomes its type and frames (no message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.stack_info:
            _safe_exception(record)
        return True


_ARGUMENTS = _WithholdArguments("")
_EXCEPTION_TEXT = _WithholdExceptionText("")


def install() -> None:
    """Filter the third-party loggers and the root logger's handlers (idempotent)."""
    for name in _THIRD_PARTY:
        logger = logging.getLogger(name)
        if _ARGUMENTS not in logger.filters:
            logger.addFilter(_ARGUMENTS)
    for handler in logging.getLogger().handlers:
        if _EXCEPTION_TEXT not in handler.filters:
            handler.addFilter(_EXCEPTION_TEXT)
