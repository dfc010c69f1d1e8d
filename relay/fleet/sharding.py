"""Slot function and shard map: which shard owns which queue (docs/api.md, "Shard map").

Pure and stdlib-only so the operator, the Spark jobs and the relay share it.
"""

from __future__ import annotations

import binascii
import bisect
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

SLOT_COUNT = 16384


def crc16(data: bytes) -> int:
    """CRC16-XMODEM, the checksum Redis Cluster uses for key slots (binascii does it in C)."""
    return binascii.crc_hqx(data, 0)


def slot_of(recipient: bytes, channel: bytes = b"") -> int:
    return crc16(recipient + channel) % SLOT_COUNT


class ShardMapError(ValueError):
    """A shard map that breaks the contract; the message says exactly where."""


@dataclass(frozen=True)
class SlotRange:
    start: int
    end: int  # inclusive
    shard: str

    @property
    def size(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True)
class ShardMap:
    fleet: str
    epoch: int
    shards: Mapping[str, str]  # shard name -> redis URL, or a Sentinel target's URL (see below)
    ranges: tuple[SlotRange, ...]
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(r.start for r in self.ranges))

    def shard_for_slot(self, slot: int) -> str:
        if not 0 <= slot < SLOT_COUNT:
            raise ValueError(f"slot {slot} outside 0..{SLOT_COUNT - 1}")
        return self.ranges[bisect.bisect_right(self._starts, slot) - 1].shard

    def shard_for(self, recipient: bytes, channel: bytes = b"") -> str:
        return self.shard_for_slot(slot_of(recipient, channel))

    def slots_of(self, shard: str) -> list[int]:
        return [s for r in self.ranges if r.shard == shard for s in range(r.start, r.end + 1)]

    def slot_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.shards, 0)
        for r in self.ranges:
            counts[r.shard] += r.size
        return counts

    def with_slots(self, slots: Iterable[int], shard: str) -> ShardMap:
        """A new map (epoch + 1) in which `slots` belong to `shard`."""
        if shard not in self.shards:
            raise ShardMapError(f"unknown shard {shard!r}")
        owner = [self.shard_for_slot(s) for s in range(SLOT_COUNT)]
        for s in slots:
            owner[s] = shard
        return ShardMap(self.fleet, self.epoch + 1, dict(self.shards), _compress(owner))

    def to_json(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "epoch": self.epoch,
            "shards": {name: shard_entry(url) for name, url in self.shards.items()},
            "slots": [[r.start, r.end, r.shard] for r in self.ranges],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"


def _compress(owner: list[str]) -> tuple[SlotRange, ...]:
    ranges: list[SlotRange] = []
    start = 0
    for s in range(1, SLOT_COUNT + 1):
        if s == SLOT_COUNT or owner[s] != owner[start]:
            ranges.append(SlotRange(start, s - 1, owner[start]))
            start = s
    return tuple(ranges)


def even_split(fleet: str, shards: Mapping[str, str], epoch: int = 1) -> ShardMap:
    """Contiguous, near-equal ranges in the order the shards are given."""
    names = list(shards)
    if not names:
        raise ShardMapError("a shard map needs at least one shard")
    ranges = []
    for i, name in enumerate(names):
        start = SLOT_COUNT * i // len(names)
        end = SLOT_COUNT * (i + 1) // len(names) - 1
        ranges.append(SlotRange(start, end, name))
    return ShardMap(fleet, epoch, dict(shards), tuple(ranges))


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShardMapError(f"{where} must be an integer, got {value!r}")
    return value


def parse_shard_map(doc: object) -> ShardMap:
    """Validate a decoded shard-map document and build the lookup structure."""
    if not isinstance(doc, dict):
        raise ShardMapError("shard map must be a JSON object")
    fleet = doc.get("fleet")
    if not isinstance(fleet, str) or not fleet:
        raise ShardMapError("'fleet' must be a non-empty string")
    epoch = _int(doc.get("epoch"), "'epoch'")
    if epoch < 0:
        raise ShardMapError("'epoch' must be >= 0")
    raw_shards = doc.get("shards")
    if not isinstance(raw_shards, dict) or not raw_shards:
        raise ShardMapError("'shards' must be a non-empty object")
    shards: dict[str, str] = {}
    for name, spec in raw_shards.items():
        if isinstance(spec, dict) and "sentinels" in spec:
            shards[name] = SentinelTarget.from_entry(spec, f"shard {name!r}").url()
            continue
        if not isinstance(spec, dict) or not isinstance(spec.get("redis"), str) or not spec["redis"]:
            raise ShardMapError(f"shard {name!r} needs a 'redis' URL string or 'sentinels' and 'service'")
        if spec["redis"].startswith(SENTINEL_SCHEME + "://"):
            parse_sentinel_url(spec["redis"], f"shard {name!r}")
        elif not spec["redis"].startswith(tuple(f"{s}://" for s in NODE_SCHEMES)):
            raise ShardMapError(f"shard {name!r} has an unsupported redis URL scheme")
        shards[name] = spec["redis"]
    raw_slots = doc.get("slots")
    if not isinstance(raw_slots, list) or not raw_slots:
        raise ShardMapError("'slots' must be a non-empty list of [start, end, shard]")
    ranges = []
    for i, item in enumerate(raw_slots):
        if not isinstance(item, list) or len(item) != 3:
            raise ShardMapError(f"slots[{i}] must be [start, end, shard]")
        start, end = _int(item[0], f"slots[{i}][0]"), _int(item[1], f"slots[{i}][1]")
        shard = item[2]
        if not isinstance(shard, str) or shard not in shards:
            raise ShardMapError(f"slots[{i}] names unknown shard {shard!r}")
        if not 0 <= start <= end < SLOT_COUNT:
            raise ShardMapError(f"slots[{i}] range {start}-{end} must satisfy 0 <= start <= end <= 16383")
        ranges.append(SlotRange(start, end, shard))
    ranges.sort(key=lambda r: r.start)
    expected = 0
    for r in ranges:
        if r.start < expected:
            raise ShardMapError(f"slot {r.start} is covered more than once")
        if r.start > expected:
            raise ShardMapError(f"slots {expected}-{r.start - 1} are not covered")
        expected = r.end + 1
    if expected != SLOT_COUNT:
        raise ShardMapError(f"slots {expected}-{SLOT_COUNT - 1} are not covered")
    return ShardMap(fleet, epoch, shards, tuple(ranges))


def loads_shard_map(text: str | bytes) -> ShardMap:
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ShardMapError(f"shard map is not valid JSON: {exc}") from None
    return parse_shard_map(doc)


def parse_slot_range(text: str) -> tuple[int, int]:
    """'A-B' or 'A' into (A, B), inclusive; ShardMapError with the contract's text otherwise."""
    lo, _, hi = text.strip().partition("-")
    try:
        start, end = int(lo), int(hi or lo)
    except ValueError:
        raise ShardMapError(f"bad slot range {text!r}: expected A-B") from None
    if not 0 <= start <= end < SLOT_COUNT:
        raise ShardMapError(f"bad slot range {text!r}: must be within 0-16383 and A <= B")
    return start, end


def parse_slot_spec(spec: str) -> list[int]:
    """'A-B' or 'A' or 'A-B,C' into a sorted list of slots."""
    slots: set[int] = set()
    for part in spec.split(","):
        a, b = parse_slot_range(part.strip())
        slots.update(range(a, b + 1))
    return sorted(slots)


# -- Sentinel-managed shards -------------------------------------------------------
#
# A shard entry may name a Sentinel-managed primary instead of one URL (docs/api.md, "Shard map"):
#   {"sentinels": ["10.0.0.7:26379", ...], "service": "shard-a", "password": "..."?,
#    "minReplicas": 1?, "username": "..."?, "db": 0?, "sentinelPassword": "..."?}
# Everything that passes shard addresses around (credentials files, the operator's map
# edits, migration, Spark) keeps handling one string per shard, so such an entry is held
# as a URL of its own scheme:
#   redis+sentinel://[user:password@]host:port,host:port/service?db=0&minReplicas=1
# and written back as the entry it came from. Only code that opens connections reads it.

SENTINEL_SCHEME = "redis+sentinel"
NODE_SCHEMES = ("redis", "rediss", "unix")  # one Redis node (relay.storage.connection opens them)


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    password: str | None = None  # the data nodes' (primary and replicas)
    username: str | None = None
    db: int = 0
    min_replicas: int = 0  # >= 1: writes answered only after WAIT confirms this many replicas
    sentinel_password: str | None = None  # when the Sentinels themselves require AUTH

    @classmethod
    def from_entry(cls, spec: Mapping[str, Any], where: str) -> SentinelTarget:
        known = {"sentinels", "service", "password", "username", "db", "minReplicas", "sentinelPassword"}
        if unknown := sorted(set(spec) - known):
            raise ShardMapError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
        raw = spec.get("sentinels")
        if not isinstance(raw, list) or not raw or not all(isinstance(a, str) for a in raw):
            raise ShardMapError(f"{where}: 'sentinels' must be a non-empty list of 'host:port' strings")
        sentinels = tuple(_host_port(a, f"{where}: sentinel {a!r}") for a in raw)
        service = spec.get("service")
        if not isinstance(service, str) or not service or any(c in service for c in "/?#@, "):
            raise ShardMapError(f"{where}: 'service' must be a Sentinel master name (no / ? # @ , or space)")
        texts: dict[str, str | None] = {}
        for key in ("password", "username", "sentinelPassword"):
            value = spec.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ShardMapError(f"{where}: {key!r} must be a non-empty string")
            texts[key] = value
        db = _int(spec.get("db", 0), f"{where}: 'db'")
        min_replicas = _int(spec.get("minReplicas", 0), f"{where}: 'minReplicas'")
        if db < 0 or not 0 <= min_replicas <= 16:
            raise ShardMapError(f"{where}: 'db' must be >= 0 and 'minReplicas' within 0..16")
        return cls(
            sentinels,
            service,
            texts["password"],
            texts["username"],
            db,
            min_replicas,
            texts["sentinelPassword"],
        )

    def entry(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sentinels": [_join_host_port(h, p) for h, p in self.sentinels]}
        out["service"] = self.service
        if self.password is not None:
            out["password"] = self.password
        if self.username is not None:
            out["username"] = self.username
        if self.db:
            out["db"] = self.db
        if self.min_replicas:
            out["minReplicas"] = self.min_replicas
        if self.sentinel_password is not None:
            out["sentinelPassword"] = self.sentinel_password
        return out

    def url(self) -> str:
        auth = ""
        if self.password is not None:
            user = quote(self.username, safe="") if self.username else ""
            auth = f"{user}:{quote(self.password, safe='')}@"
        hosts = ",".join(_join_host_port(h, p) for h, p in self.sentinels)
        query = [f"db={self.db}"] if self.db else []
        if self.min_replicas:
            query.append(f"minReplicas={self.min_replicas}")
        if self.sentinel_password is not None:
            query.append(f"sentinelPassword={quote(self.sentinel_password, safe='')}")
        return f"{SENTINEL_SCHEME}://{auth}{hosts}/{self.service}" + ("?" + "&".join(query) if query else "")

    def redacted(self) -> str:
        """For log lines and errors: where, never the password."""
        return f"sentinel {self.service} via " + ",".join(_join_host_port(h, p) for h, p in self.sentinels)


def is_sentinel_url(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str, where: str = "sentinel URL") -> SentinelTarget:
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ShardMapError(f"{where}: not a {SENTINEL_SCHEME}:// URL")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    spec: dict[str, Any] = {"sentinels": hosts.split(",") if hosts else [], "service": parts.path.lstrip("/")}
    if userinfo:
        user, _, password = userinfo.partition(":")
        if user:
            spec["username"] = unquote(user)
        if password:
            spec["password"] = unquote(password)
    for key, values in parse_qs(parts.query, keep_blank_values=True).items():
        value = values[-1]
        if key in ("db", "minReplicas"):
            if not value.isdigit():
                raise ShardMapError(f"{where}: {key} must be a whole number")
            spec[key] = int(value)
        elif key == "sentinelPassword":
            spec[key] = value  # parse_qs has unquoted it
        else:
            raise ShardMapError(f"{where}: unknown parameter {key!r}")
    return SentinelTarget.from_entry(spec, where)


def shard_entry(url: str) -> dict[str, Any]:
    """A shard's entry in the map's JSON: {"redis": url}, or the Sentinel fields."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).entry()
    return {"redis": url}


def min_replicas_of(url: str) -> int:
    """How many replicas must confirm a write on this shard (0: answer without waiting)."""
    return parse_sentinel_url(url).min_replicas if is_sentinel_url(url) else 0


def _host_port(text: str, where: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardMapError(f"{where} must be host:port")
    return host, int(port)


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
