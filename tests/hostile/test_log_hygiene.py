"""Log hygiene, in process: what aiohttp and asyncio would log about a hostile request
keeps its fixed text and loses its arguments; any record's traceback keeps its type and
frames but never the exception's message. (The subprocess attacks grep the relay's real
DEBUG log for the same planted secrets: see harness.Relay.assert_log_clean.)
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from relay.http import logsafe
from tests.hostile.harness import SECRET_HEADER, SECRET_INBOX_ID, SECRET_KEY, SECRET_PAYLOAD

SECRET = SECRET_PAYLOAD.decode()


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    logsafe.install()
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def _raise(text: str) -> BaseException:
    try:
        raise ValueError(text)
    except ValueError as exc:
        return exc


def test_third_party_records_lose_their_arguments(captured: io.StringIO) -> None:
    exc = _raise(f"Invalid header value char {SECRET_HEADER}")
    logging.getLogger("aiohttp.server").error(
        "Error handling request from %s: %s", SECRET_INBOX_ID, SECRET, exc_info=exc
    )
    logging.getLogger("aiohttp.access").info('%s "%s" %s', "127.0.0.1", f"GET /v1/queues/{SECRET_KEY}", 200)
    logging.getLogger("asyncio").error(
        f"Exception in callback <Handle data_received(b'{SECRET}')>\nprotocol: {SECRET}"
    )
    text = captured.getvalue()
    for secret in (SECRET, SECRET_HEADER, SECRET_INBOX_ID, SECRET_KEY):
        assert secret not in text, text
    assert "Error handling request from" in text
    assert "ValueError" in text  # the type survives
    assert "Exception in callback" in text


def test_our_tracebacks_lose_exception_messages(captured: io.StringIO) -> None:
    logging.getLogger("relay.test").error("handler failed", exc_info=_raise(f"cannot decode {SECRET}"))
    text = captured.getvalue()
    assert SECRET not in text
    assert "ValueError" in text
    assert "test_log_hygiene.py" in text  # where it was raised is kept
