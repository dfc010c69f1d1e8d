"""The Lua scripts as loaded objects: source (prelude + file) and SHA1, computed once.

Each script gets the prelude's definitions it uses (by name, transitively), not all of them:
Redis runs a script's whole text on every call, so each unused `local function` was a closure
created and collected per call (~5,000 instructions of enqueue.lua's ~310,000 for nine).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


_DEFINES = re.compile(r"local (?:function )?(\w+)")
_WORD = re.compile(r"\w+")


def prelude_parts(text: str) -> list[tuple[str, str]]:
    """The prelude's top-level definitions in order: (name, its text with the comment above it).
    A definition is a column-0 `local`; its body is indented and closes with a column-0 `end`."""
    parts: list[tuple[str, str]] = []
    pending: list[str] = []  # comments and blank lines: they belong to the next definition
    for line in text.splitlines(keepends=True):
        defined = _DEFINES.match(line)
        if defined and line[defined.end() :].lstrip().startswith(","):
            raise ValueError(f"lua/_prelude.lua: one name per definition: {line.rstrip()!r}")
        if defined:
            parts.append((defined.group(1), "".join(pending) + line))
            pending = []
        elif parts and ((line[:1] in (" ", "\t") and line.strip() != "") or line.rstrip() == "end"):
            parts[-1] = (parts[-1][0], parts[-1][1] + line)
        elif line.startswith("--") or not line.strip():
            pending.append(line)
        else:
            raise ValueError(f"lua/_prelude.lua: not a top-level definition: {line.rstrip()!r}")
    return parts


def prelude_for(body: str, parts: list[tuple[str, str]]) -> str:
    """The definitions `body` names, and those they name, in the prelude's order."""
    defined = {name for name, _ in parts}
    texts = dict(parts)
    needed = defined & set(_WORD.findall(body))
    todo = list(needed)
    while todo:
        for name in defined & set(_WORD.findall(texts[todo.pop()])):
            if name not in needed:
                needed.add(name)
                todo.append(name)
    return "".join(text for name, text in parts if name in needed)


def _load(name: str, prelude: list[tuple[str, str]]) -> Script:
    body = resources.files("relay.storage").joinpath(f"lua/{name}.lua").read_text("utf-8")
    source = prelude_for(body, prelude) + "\n" + body
    return Script(name, source, hashlib.sha1(source.encode("utf-8")).hexdigest())


_PRELUDE = prelude_parts(resources.files("relay.storage").joinpath("lua/_prelude.lua").read_text("utf-8"))

ENQUEUE = _load("enqueue", _PRELUDE)
READ = _load("read", _PRELUDE)
DRAIN = _load("drain", _PRELUDE)
ACK = _load("ack", _PRELUDE)
STATUS = _load("status", _PRELUDE)
NONCE = _load("nonce", _PRELUDE)
TRIM = _load("trim", _PRELUDE)
# Retention for a page of one slot's queues in one call (the Spark job's sweep).
TRIM_SLOT = _load("trim_slot", _PRELUDE)
# Per-recipient quotas: the records in the recipient's home slot (keys.slot_recipients).
RCPT_ADMIT = _load("rcpt_admit", _PRELUDE)
RCPT_REFUND = _load("rcpt_refund", _PRELUDE)
RCPT_SETTLE = _load("rcpt_settle", _PRELUDE)
# The DIDComm mediator's records (relay/didcomm/records.py).
DC_GET = _load("dc_get", _PRELUDE)
DC_SET = _load("dc_set", _PRELUDE)
DC_CLAIM = _load("dc_claim", _PRELUDE)
DC_LIST = _load("dc_list", _PRELUDE)
DC_STAMP = _load("dc_stamp", _PRELUDE)
DC_SWAP = _load("dc_swap", _PRELUDE)
# Their periodic idle-expiry sweep over a batch of slots (relay/didcomm/sweep.py).
DC_EXPIRE = _load("dc_expire", _PRELUDE)

# Fleet-wide presence leases of live sockets and waiting long-polls (relay/presence.py).
PRESENCE = _load("presence", _PRELUDE)

# The slots' load statistics in batches (relay.shard_health through a relay's bulk lane,
# relay.storage.maintenance through script_runner).
SLOT_SWEEP = _load("slot_sweep", _PRELUDE)

ALL: tuple[Script, ...] = (
    ENQUEUE,
    READ,
    DRAIN,
    ACK,
    STATUS,
    NONCE,
    TRIM,
    TRIM_SLOT,
    RCPT_ADMIT,
    RCPT_REFUND,
    RCPT_SETTLE,
    DC_GET,
    DC_SET,
    DC_CLAIM,
    DC_LIST,
    DC_STAMP,
    DC_SWAP,
    DC_EXPIRE,
    SLOT_SWEEP,
    PRESENCE,
)

# Migration steps (relay.fleet.migration); relays never run them, so not in ALL.
SLOT_STATE = _load("slot_state", _PRELUDE)
SLOT_DROP = _load("slot_drop", _PRELUDE)
IMPORT_STAMP = _load("import_stamp", _PRELUDE)

# The boot mark (relay.storage.boot), run as a plain EVAL without the prelude: it writes
# the key the prelude reads.
BOOT_MARK = _load("boot_mark", [])

# After `relayfleet restore` (relay.backup); relays never run it.
RESTORE_EPOCH = _load("restore_epoch", _PRELUDE)
