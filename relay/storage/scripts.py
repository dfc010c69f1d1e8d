"""The Lua scripts as loaded objects: source (prelude + file) and SHA1, computed once."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    source: str
    sha: str


def _load(name: str, prelude: str) -> Script:
    body = resources.files("relay.storage").joinpath(f"lua/{name}.lua").read_text("utf-8")
    source = prelude + "\n" + body
    return Script(name, source, hashlib.sha1(source.encode("utf-8")).hexdigest())


_PRELUDE = resources.files("relay.storage").joinpath("lua/_prelude.lua").read_text("utf-8")

ENQUEUE = _load("enqueue", _PRELUDE)
READ = _load("read", _PRELUDE)
DRAIN = _load("drain", _PRELUDE)
ACK = _load("ack", _PRELUDE)
STATUS = _load("status", _PRELUDE)
NONCE = _load("nonce", _PRELUDE)
TRIM = _load("trim", _PRELUDE)
# The DIDComm mediator's records (relay/didcomm/records.py).
DC_GET = _load("dc_get", _PRELUDE)
DC_SET = _load("dc_set", _PRELUDE)
DC_CLAIM = _load("dc_claim", _PRELUDE)
DC_LIST = _load("dc_list", _PRELUDE)

ALL: tuple[Script, ...] = (ENQUEUE, READ, DRAIN, ACK, STATUS, NONCE, TRIM, DC_GET, DC_SET, DC_CLAIM, DC_LIST)

# The slots' load statistics in batches (relay.shard_health, relay.storage.maintenance): a
# background read through script_runner, never on the hot path, so not in ALL.
SLOT_SWEEP = _load("slot_sweep", _PRELUDE)

# Migration steps (relay.fleet.migration); relays never run them, so not in ALL.
SLOT_STATE = _load("slot_state", _PRELUDE)
SLOT_DROP = _load("slot_drop", _PRELUDE)
IMPORT_STAMP = _load("import_stamp", _PRELUDE)

# The boot mark (relay.storage.boot), run as a plain EVAL without the prelude: it writes
# the key the prelude reads.
BOOT_MARK = _load("boot_mark", "")

# After `relayfleet restore` (relay.backup); relays never run it.
RESTORE_EPOCH = _load("restore_epoch", _PRELUDE)
