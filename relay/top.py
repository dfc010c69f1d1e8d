"""`relayfleet top`: the fleet's live figures in a terminal, read from the relays' /metrics.

Rates and latency percentiles come from the difference between two reads (counters and
histogram buckets), so even `--once` reads twice, a second apart. Per-shard figures are the
relays' shard gauges (every relay reports every shard; the freshest read wins).
"""

from __future__ import annotations

import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TextIO
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

REFRESH_S = 2.0
_TIMEOUT_S = 2.0
# The relays read shard load every RELAY_SHARD_STATS_INTERVAL_S (30 s by default) and only
# after a scrape; figures older than that plus one health round (5 s) are marked stale.
STATS_INTERVAL_S = 30.0
STALE_S = STATS_INTERVAL_S + 5.0
ONCE_WAIT_S = 10.0  # --once: how long to wait for the relays' first load read

Labels = tuple[tuple[str, str], ...]


@dataclass
class Scrape:
    """One relay's /metrics: samples by (name, labels), or why it could not be read."""

    url: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    error: str | None = None
    at: float = 0.0

    def total(self, name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return sum(v for (n, labels), v in self.samples.items() if n == name and where(dict(labels)))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out


def _metrics_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/metrics") else base + "/metrics"


def check_url(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"not an http(s) URL: {url!r}"
    return None


Fetch = Callable[[str], str]


def http_fetch(url: str) -> str:
    """A relay's /metrics text, straight over HTTP."""
    with urllib.request.urlopen(_metrics_url(url), timeout=_TIMEOUT_S) as resp:
        text: str = resp.read().decode("utf-8", "replace")
        return text


def scrape(url: str, fetch: Fetch = http_fetch) -> Scrape:
    out = Scrape(url, at=time.monotonic())
    try:
        text = fetch(url)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        out.error = str(getattr(exc, "reason", None) or exc)[:80]
    return out


def scrape_all(urls: list[str], fetch: Fetch = http_fetch) -> list[Scrape]:
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(lambda u: scrape(u, fetch), urls))


class RelaySource(Protocol):
    """Where the relays are, asked again before every read (pods come and go): `--kube`."""

    def urls(self) -> list[str]: ...

    def fetch(self, url: str) -> str: ...


def _rate(
    name: str, before: list[Scrape], after: list[Scrape], where: Callable[[dict[str, str]], bool]
) -> float:
    total = 0.0
    for b, a in zip(before, after, strict=True):
        if a.error or b.error:
            continue
        dt = a.at - b.at
        if dt > 0:
            total += max(0.0, a.total(name, where) - b.total(name, where)) / dt  # a restart resets counters
    return total


def quantile(q: float, name: str, before: list[Scrape], after: list[Scrape]) -> float | None:
    """The q-quantile of a histogram over the interval between the reads (linear in the bucket)."""
    buckets: dict[float, float] = {}
    for b, a in zip(before, after, strict=True):
        if a.error or b.error:
            continue
        for (n, labels), v in a.samples.items():
            if n == f"{name}_bucket":
                le = float(dict(labels)["le"])
                buckets[le] = buckets.get(le, 0.0) + max(0.0, v - b.samples.get((n, labels), 0.0))
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            span = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / span if span else 1.0)
        prev_bound, prev_count = bound, count
    return None


def _status(prefix: str) -> Callable[[dict[str, str]], bool]:
    return lambda labels: labels.get("status", "").startswith(prefix)


def _op(op: str) -> Callable[[dict[str, str]], bool]:
    return lambda labels: labels.get("op") == op


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


def render(before: list[Scrape], after: list[Scrape]) -> str:
    up = [s for s in after if not s.error]
    lines = [f"relayfleet top: {len(up)}/{len(after)} relays answering   {time.strftime('%H:%M:%S')}", ""]

    def rate(name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return _rate(name, before, after, where)

    lines.append(
        f"enqueued {rate('relayfleet_messages_total', _op('enqueued')):8.1f}/s   "
        f"delivered {rate('relayfleet_messages_total', _op('delivered')):8.1f}/s   "
        f"drained {rate('relayfleet_messages_total', _op('drained')):8.1f}/s   "
        f"acked {rate('relayfleet_messages_total', _op('acked')):8.1f}/s"
    )
    lines.append(
        f"requests {rate('relayfleet_http_requests_total'):8.1f}/s   "
        f"4xx {rate('relayfleet_http_requests_total', _status('4')):7.1f}/s   "
        f"5xx {rate('relayfleet_http_requests_total', _status('5')):7.1f}/s   "
        f"429 {rate('relayfleet_rate_limited_total'):7.1f}/s"
    )
    req, wake = "relayfleet_http_request_duration_seconds", "relayfleet_wakeup_latency_seconds"
    req_p50, req_p99 = quantile(0.5, req, before, after), quantile(0.99, req, before, after)
    wake_p50, wake_p99 = quantile(0.5, wake, before, after), quantile(0.99, wake, before, after)
    lines.append(
        f"request p50 {_ms(req_p50)}  p99 {_ms(req_p99)}   wakeup p50 {_ms(wake_p50)}  p99 {_ms(wake_p99)}"
    )
    lines.append("")
    lines.append(f"{'RELAY':<40} {'STATE':<8} {'WAITERS':>8} {'LIVE':>6} {'MAP EPOCH':>9}")
    for s in after:
        if s.error:
            lines.append(f"{s.url[:40]:<40} {'down':<8} {s.error}")
            continue
        lines.append(
            f"{s.url[:40]:<40} {'up':<8} {s.total('relayfleet_waiters'):8.0f} "
            f"{s.total('relayfleet_live_connections'):6.0f} {s.total('relayfleet_shard_map_epoch'):9.0f}"
        )
    lines.append("")
    lines.extend(shard_table(up))
    return "\n".join(lines)


def shard_table(up: Iterable[Scrape], now: float | None = None) -> list[str]:
    # The freshest relay's view of each shard; 'up' is down if any relay says so. Load figures
    # not read yet show "-", figures older than STALE_S are marked "*" in the AGE column.
    now = time.time() if now is None else now
    columns = (
        ("messages", "relayfleet_shard_messages"),
        ("bytes", "relayfleet_shard_bytes"),
        ("queues", "relayfleet_shard_queues"),
        ("enq/min", "relayfleet_shard_enqueues_per_minute"),
        ("slots", "relayfleet_shard_slots"),
        ("migr", "relayfleet_shard_slots_migrating"),
        ("mem", "relayfleet_shard_memory_used_bytes"),
        ("maxmem", "relayfleet_shard_memory_max_bytes"),
        ("read_at", "relayfleet_shard_stats_last_success_timestamp_seconds"),
    )
    shards: dict[str, dict[str, float]] = {}
    for s in up:
        for name, value in s.by("relayfleet_shard_up", "shard").items():
            row = shards.setdefault(name, {"up": 1.0})
            row["up"] = min(row["up"], value)
        for col, metric in columns:
            for name, value in s.by(metric, "shard").items():
                shards.setdefault(name, {"up": 1.0})[col] = value
    header = f"{'SHARD':<16} {'REDIS':<6} {'MESSAGES':>10} {'BYTES':>10} {'QUEUES':>8} {'ENQ/MIN':>8} "
    header += f"{'SLOTS':>6} {'MIGR':>5} {'AGE':>5} {'MEMORY':>18}"
    out = [header]
    unread = stale = False
    for name in sorted(shards):
        r = shards[name]
        mem = _bytes(r.get("mem", 0.0)) if "mem" in r else "-"
        if r.get("maxmem"):
            mem += f"/{_bytes(r['maxmem'])}"

        if "read_at" in r:
            age_s = max(0.0, now - r["read_at"])
            age = f"{age_s:.0f}s" + ("*" if age_s > STALE_S else "")
            stale = stale or age_s > STALE_S
        else:
            age, unread = "-", True
        nbytes = _bytes(r["bytes"]) if "bytes" in r else "-"
        out.append(
            f"{name[:16]:<16} {'up' if r['up'] else 'DOWN':<6} {_cell(r, 'messages'):>10} {nbytes:>10} "
            f"{_cell(r, 'queues'):>8} {_cell(r, 'enq/min'):>8} {_cell(r, 'slots'):>6} "
            f"{_cell(r, 'migr'):>5} {age:>5} {mem:>18}"
        )
    if not shards:
        out.append("(no shard figures yet)")
    if unread:
        out.append(f"- not read yet: relays read shard load every {STATS_INTERVAL_S:.0f} s, after a scrape")
    if stale:
        out.append(f"* stale: read more than {STALE_S:.0f} s ago (the relay exporting it may be gone)")
    return out


def _cell(row: dict[str, float], col: str) -> str:
    return f"{row[col]:.0f}" if col in row else "-"


def _load_unread(scrapes: Iterable[Scrape]) -> bool:
    """Whether some shard a relay reports has no load figures yet."""
    shards: set[str] = set()
    read: set[str] = set()
    for s in scrapes:
        if not s.error:
            shards |= set(s.by("relayfleet_shard_up", "shard"))
            read |= set(s.by("relayfleet_shard_stats_last_success_timestamp_seconds", "shard"))
    return bool(shards - read)


def top_main(
    urls: list[str],
    once: bool,
    out: TextIO | None = None,
    refresh_s: float = REFRESH_S,
    source: RelaySource | None = None,
) -> int:
    stream = out or sys.stdout
    if source is None:
        if not urls:
            print("relayfleet top: give at least one relay URL", file=sys.stderr)
            return 2
        for url in urls:
            if (problem := check_url(url)) is not None:
                print(f"relayfleet top: {problem}", file=sys.stderr)
                return 2

    def scrape_now() -> list[Scrape]:
        if source is None:
            return scrape_all(urls)
        return scrape_all(source.urls(), source.fetch)

    try:
        before = scrape_now()
        if once:
            if not before:
                print("relayfleet top: the Kubernetes API lists no relay", file=sys.stderr)
                return 1
            time.sleep(1.0)
            after = scrape_now()
            deadline = time.monotonic() + ONCE_WAIT_S
            while _load_unread(after) and time.monotonic() < deadline:
                time.sleep(1.0)  # the first scrape made the relays read it: wait for them
                after = scrape_now()
            print(render(before, after), file=stream)
            if all(s.error for s in after):
                print("relayfleet top: no relay answered", file=sys.stderr)
                return 1
            return 0
        while True:
            time.sleep(refresh_s)
            after = scrape_now()
            print("\x1b[H\x1b[2J" + render(before, after), file=stream, flush=True)
            before = after
    except KeyboardInterrupt:
        return 0
