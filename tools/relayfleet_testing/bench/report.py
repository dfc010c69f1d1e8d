"""Turns Results into the markdown written to docs/benchmarks.md, with machine facts.

The generated part sits between ``<!-- bench:<mode>:begin/end -->`` markers, so the
hand-written analysis around it survives every re-run.
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from relayfleet_testing.bench.results import Results, Row, size_label

# The standing targets, on this class of machine (2 cores, generator on the same machine).
TARGET_ENQUEUE_RATE = 15000.0
TARGET_ENQUEUE_VS_CEILING = 0.6
TARGET_ENQUEUE_VS_NCHAN = 1.0
TARGET_WAKE_P50_MS = 2.0
TARGET_WAKE_P99_MS = 10.0
TARGET_RSS_PER_POLL_KIB = 15.0
TARGET_READ_ACK_RATE = 100000.0
# The enqueue head to head, ratios within one run: relay-1p against nginx + nchan with Redis storage.
HEAD_TO_HEAD_SIZES = (256, 4096, 65536)
TARGET_RATE_VS_NCHAN = 1.0  # relay-1p msg/s ÷ nchan-redis msg/s, at least
TARGET_CPU_VS_NCHAN = 1.0  # (relay + Redis) CPU per message ÷ (nginx + Redis) CPU per message, at most


def _cmd(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "n/a"
    return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else "n/a"


def _pkg(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "n/a"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "n/a"


def _mem_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "n/a"


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine_facts(repo: Path) -> dict[str, str]:
    dpkg = ["dpkg-query", "-W", "-f", "${Version}"]
    return {
        "CPU": f"{_cpu_model()}, {os.cpu_count()} cores",
        "memory": _mem_gib(),
        "OS / kernel": f"{_os_name()} / {platform.release()}",
        "Python": platform.python_version(),
        "aiohttp / uvloop / redis-py / hiredis / orjson": " / ".join(
            _pkg(p) for p in ("aiohttp", "uvloop", "redis", "hiredis", "orjson")
        ),
        "redis-server": _cmd(["/usr/bin/redis-server", "--version"]).split(" sha=")[0],
        "nginx / nchan": _cmd(["/usr/sbin/nginx", "-v"]).split("/")[-1]
        + " / "
        + _cmd([*dpkg, "libnginx-mod-nchan"]),
        "wrk": _cmd([*dpkg, "wrk"]),
        "relay commit": _cmd(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"]),
    }


# -- formatting helpers ---------------------------------------------------------------------


def _num(v: float | None, digits: int = 0) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:,.{digits}f}"


def _ms(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _unique(values: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def _int(row: Row, key: str) -> int:
    return int(row.params[key])


# -- sections -------------------------------------------------------------------------------


def _calibration(res: Results) -> list[str]:
    rows = res.select("calibration")
    if not rows:
        return []
    lines = ["### Load generator calibration", ""]
    lines.append(
        "Each generator against a do-nothing endpoint on the same machine: the most it can drive. "
        "Throughput results well below a generator's own ceiling are not generator-bound."
    )
    lines.append("")
    lines += _table(
        ["generator", "server", "connections", "requests/s"],
        (
            [
                str(r.params["generator"]),
                f"{r.target} `{r.params['path']}`",
                str(r.params["conns"]),
                _num(r.values.get("rate")),
            ]
            for r in rows
        ),
    )
    return [*lines, ""]


def _enqueue(res: Results, main_conns: int) -> list[str]:
    rows = res.select("enqueue") + res.select("limit")
    if not rows:
        return []
    sizes = sorted({_int(r, "size") for r in rows})
    targets = _unique(r.target for r in rows if _int(r, "conns") == main_conns)
    lines = ["### Enqueue throughput", ""]
    lines.append(
        f"Messages stored per second (2xx answers only), {main_conns} connections, one wrk thread per "
        "server process; p50 / p99 request latency in ms under that load. `redis XADD` and "
        "`redis enqueue.lua` are redis-benchmark (pipelined 16 deep), not HTTP."
    )
    lines.append("")
    header = (
        ["target"]
        + [f"{size_label(s)} msg/s" for s in sizes]
        + [f"{size_label(s)} p50/p99 ms" for s in sizes]
    )
    body = []
    for t in targets:
        cells = [t]
        lat = []
        for s in sizes:
            row = next(
                (
                    r
                    for r in rows
                    if r.target == t and _int(r, "size") == s and _int(r, "conns") == main_conns
                ),
                None,
            )
            if row is None:
                cells.append("-")
                lat.append("-")
                continue
            err = row.values.get("errors", 0.0)
            cells.append(_num(row.values.get("rate")) + (f" ({_num(err)} err)" if err else ""))
            lat.append(f"{_ms(row.values.get('p50_ms'))} / {_ms(row.values.get('p99_ms'))}")
        body.append(cells + lat)
    lines += _table(header, body)
    other = [r for r in res.select("enqueue") if _int(r, "conns") != main_conns]
    if other:
        lines += ["", "Connection count sweep (256 B unless shown):", ""]
        lines += _table(
            ["target", "size", "connections", "msg/s", "p50 ms", "p99 ms"],
            (
                [
                    r.target,
                    size_label(_int(r, "size")),
                    str(r.params["conns"]),
                    _num(r.values.get("rate")),
                    _ms(r.values.get("p50_ms")),
                    _ms(r.values.get("p99_ms")),
                ]
                for r in sorted(other, key=lambda r: (r.target, _int(r, "conns")))
            ),
        )
    return [*lines, ""]


def _ratios(res: Results, main_conns: int) -> list[str]:
    relays = _unique(r.target for r in res.select("enqueue") if r.target.startswith("relay"))
    if not relays:
        return []
    sizes = sorted({_int(r, "size") for r in res.select("enqueue")})
    lines = ["### Ratios (enqueue)", ""]
    lines.append(
        "relay / limit = relay msg/s ÷ redis XADD; relay / script limit = ÷ redis running the relay's "
        "enqueue.lua; relay / aiohttp = ÷ the empty-handler ceiling with as many processes (1p falls "
        "back to aiohttp-1p); relay / nchan-redis = ÷ nginx + nchan with Redis storage."
    )
    lines.append("")
    body = []
    for t in relays:
        procs = t.split("-")[-1]
        for s in sizes:
            rate = res.value("enqueue", t, "rate", size=s, conns=main_conns)
            ceiling = res.value("enqueue", f"aiohttp-{procs}", "rate", size=s, conns=main_conns)
            ceiling_name = f"aiohttp-{procs}"
            if ceiling is None:
                ceiling = res.value("enqueue", "aiohttp-1p", "rate", size=s, conns=main_conns)
                ceiling_name = "aiohttp-1p"
            body.append(
                [
                    t,
                    size_label(s),
                    _num(rate),
                    _ratio(rate, res.value("limit", "redis XADD", "rate", size=s)),
                    _ratio(rate, res.value("limit", "redis enqueue.lua", "rate", size=s)),
                    f"{_ratio(rate, ceiling)} ({ceiling_name})",
                    _ratio(rate, res.value("enqueue", "nchan-redis", "rate", size=s, conns=main_conns)),
                ]
            )
    lines += _table(
        [
            "relay",
            "size",
            "msg/s",
            "relay / limit",
            "relay / script limit",
            "relay / aiohttp",
            "relay / nchan-redis",
        ],
        body,
    )
    return [*lines, ""]


def _enqueue_cpu(res: Results, main_conns: int) -> list[str]:
    rows = [r for r in res.select("enqueue") if "cpu_us" in r.values or "server_cpu_us" in r.values]
    limits = [r for r in res.select("limit") if "redis_cpu_us" in r.values]
    if not rows and not limits:
        return []
    lines = ["### Enqueue CPU per stored message", ""]
    lines.append(
        "utime + stime over the measured wrk run only (not its warm-up) ÷ the 2xx answers of that run. "
        "server = the relay process(es) / nginx master + worker / the aiohttp ceiling; Redis = the one "
        "redis-server all targets share (with its AOF fsync thread and rewrite forks), flushed and its "
        "AOF rewritten before each run, with any fork a run started waited for before its window "
        "closes. Read from /proc (clock ticks of 10 ms: ±0.01 s per window). `redis XADD` / "
        "`redis enqueue.lua` rows: Redis CPU per command under redis-benchmark."
    )
    lines.append("")
    body = [
        [
            r.target,
            size_label(_int(r, "size")),
            str(r.params["conns"]),
            _num(r.values.get("rate")),
            _num(r.values.get("server_cpu_us"), 1),
            _num(r.values.get("redis_cpu_us"), 1),
            _num(r.values.get("cpu_us"), 1),
        ]
        # the main connection count first (the runs the other tables show), then the sweep
        for r in sorted(
            rows, key=lambda r: (_int(r, "conns") != main_conns, _int(r, "size"), _int(r, "conns"))
        )
    ]
    body += [
        [
            r.target,
            size_label(_int(r, "size")),
            str(r.params["conns"]),
            _num(r.values.get("rate")),
            "-",
            _num(r.values.get("redis_cpu_us"), 1),
            _num(r.values.get("redis_cpu_us"), 1),
        ]
        for r in limits
    ]
    lines += _table(
        [
            "target",
            "size",
            "connections",
            "msg/s",
            "server CPU µs/msg",
            "Redis CPU µs/msg",
            "total µs/msg",
        ],
        body,
    )
    return [*lines, ""]


def _read_ack(res: Results) -> list[str]:
    rows = res.select("read_ack")
    if not rows:
        return []
    lines = ["### Read + ack throughput", ""]
    lines.append(
        "Queues prefilled through the relay's own enqueue script; readers loop `GET …/messages?limit=B"
        "&fromSeq=S` then `POST …/ack {upToSeq}` until every queue is empty (own generator). "
        "nchan has no batch read or ack: not compared."
    )
    lines.append("")
    lines += _table(
        ["target", "batch", "messages", "queues", "connections", "delivered msg/s", "HTTP req/s"],
        (
            [
                r.target,
                str(r.params["batch"]),
                _num(r.values.get("messages")),
                str(r.params["queues"]),
                str(r.params["conns"]),
                _num(r.values.get("rate")),
                _num(r.values.get("req_rate")),
            ]
            for r in rows
        ),
    )
    return [*lines, ""]


def _longpoll(res: Results) -> list[str]:
    rows = res.select("longpoll")
    if not rows:
        return []
    lines = ["### Long-poll wake latency and memory per idle long-poll", ""]
    lines.append(
        "Sequential probes on one server process while N other long-polls sit idle on it (each on its "
        "own queue). wake = enqueue answered → waiting reader answered (0 when the reader was answered "
        "first); e2e = enqueue sent → reader answered. RSS/poll = (RSS with N idle - RSS before) ÷ N, "
        "RSS with N idle sampled once the server reports all N waiting (the aiohttp ceiling: after 1 s)."
    )
    lines.append("")
    lines += _table(
        [
            "target",
            "idle polls",
            "probes",
            "wake p50 ms",
            "wake p99 ms",
            "wake p999 ms",
            "e2e p50 ms",
            "e2e p99 ms",
            "reader first",
            "RSS MiB",
            "RSS/poll KiB",
        ],
        (
            [
                r.target,
                _num(float(_int(r, "idle"))),
                _num(r.values.get("probes")),
                _ms(r.values.get("p50_ms")),
                _ms(r.values.get("p99_ms")),
                _ms(r.values.get("p999_ms")),
                _ms(r.values.get("e2e_p50_ms")),
                _ms(r.values.get("e2e_p99_ms")),
                _num(r.values.get("reader_first")),
                _num(r.values.get("rss_kib", math.nan) / 1024, 1),
                _num(r.values.get("rss_per_poll_kib"), 1),
            ]
            for r in rows
        ),
    )
    return [*lines, ""]


def _live(res: Results) -> list[str]:
    rows = res.select("live")
    if not rows:
        return []
    lines = ["### Live WebSocket delivery", ""]
    lines.append("Enqueue answered → frame received on an open WebSocket for that queue (client acks each).")
    lines.append("")
    lines += _table(
        ["target", "probes", "p50 ms", "p99 ms", "p999 ms"],
        (
            [
                r.target,
                _num(r.values.get("probes")),
                _ms(r.values.get("p50_ms")),
                _ms(r.values.get("p99_ms")),
                _ms(r.values.get("p999_ms")),
            ]
            for r in rows
        ),
    )
    return [*lines, ""]


def _fanout(res: Results) -> list[str]:
    rows = res.select("fanout")
    if not rows:
        return []
    lines = ["### Fan-out", ""]
    lines.append(
        "`POST /v1/messages` with 100 recipients per request (wrk); per-recipient errors are counted "
        "from the 200 answers' result lists. nchan publishes to one channel per request: not compared."
    )
    lines.append("")
    lines += _table(
        [
            "target",
            "size",
            "recipients",
            "connections",
            "requests/s",
            "recipient msg/s",
            "p50 ms",
            "p99 ms",
            "errors",
        ],
        (
            [
                r.target,
                size_label(_int(r, "size")),
                str(r.params["recipients"]),
                str(r.params["conns"]),
                _num(r.values.get("rate")),
                _num(r.values.get("msg_rate")),
                _ms(r.values.get("p50_ms")),
                _ms(r.values.get("p99_ms")),
                _num(r.values.get("errors", 0.0) + r.values.get("inner_errors", 0.0)),
            ]
            for r in rows
        ),
    )
    return [*lines, ""]


def _verdict(value: float | None, ok: bool) -> str:
    if value is None:
        return "not measured"
    return "met" if ok else "missed"


def _finite(values: dict[str, float], key: str) -> float | None:
    x = values.get(key)
    return None if x is None or math.isnan(x) else x


def _head_to_head(res: Results, target: str, size: int) -> list[Row]:
    rows = [r for r in res.select("head_to_head") if r.target == target and r.params.get("size") == size]
    return sorted(rows, key=lambda r: int(r.params.get("round", 0)))


def _median_values(rows: list[Row], keys: Iterable[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in keys:
        xs = [x for r in rows if (x := _finite(r.values, key)) is not None]
        if xs:
            out[key] = statistics.median(xs)
    return out


def _enqueue_head_to_head(res: Results, main_conns: int) -> list[str]:
    rows: list[list[str]] = []
    met = measured = 0
    rounds = 0
    for size in HEAD_TO_HEAD_SIZES:
        label = size_label(size)
        relay_runs, nchan_runs = _head_to_head(res, "relay-1p", size), _head_to_head(res, "nchan-redis", size)
        per_round: dict[str, list[float]] = {}
        if relay_runs and nchan_runs:  # the alternating runs, when the bench made them
            rounds = max(rounds, len(relay_runs))
            rv = _median_values(relay_runs, ("rate", "cpu_us"))
            nv = _median_values(nchan_runs, ("rate", "cpu_us"))
            for key in ("rate", "cpu_us"):
                pairs = zip(relay_runs, nchan_runs, strict=False)
                per_round[key] = [
                    a / b
                    for r, n in pairs
                    if (a := _finite(r.values, key)) is not None and (b := _finite(n.values, key))
                ]
        else:
            relay = res.find("enqueue", "relay-1p", size=size, conns=main_conns)
            nchan = res.find("enqueue", "nchan-redis", size=size, conns=main_conns)
            rv = relay.values if relay else {}
            nv = nchan.values if nchan else {}
        for name, key, goal, shown_unit, better_low in (
            (f"enqueue {label}: relay-1p / nchan-redis msg/s", "rate", TARGET_RATE_VS_NCHAN, "msg/s", False),
            (
                f"enqueue {label}: (relay + Redis) / (nginx + Redis) CPU per message",
                "cpu_us",
                TARGET_CPU_VS_NCHAN,
                "µs",
                True,
            ),
        ):
            a, b = _finite(rv, key), _finite(nv, key)
            ratio = a / b if a is not None and b else None
            ok = ratio is not None and (ratio <= goal if better_low else ratio >= goal)
            goal_text = f"{'≤' if better_low else '≥'} {goal:.1f} x"
            if ratio is None:
                rows.append([name, goal_text, "-", "not measured"])
                continue
            measured += 1
            met += ok
            digits = 1 if key == "cpu_us" else 0
            rounds_text = ", ".join(f"{x:.2f}" for x in per_round.get(key, []))
            rows.append(
                [
                    name,
                    goal_text,
                    f"{ratio:.2f} ({_num(a, digits)} / {_num(b, digits)} {shown_unit})",
                    rounds_text or "-",
                    "met" if ok else "missed",
                ]
            )
    if not measured:
        return []
    how = (
        f"the median of {rounds} alternating runs per side and size (who runs first switches every "
        "round, a fresh nginx for each nchan run), so a drift of the machine's speed falls on both "
        "sides alike; the last column gives each round's own ratio"
        if rounds
        else "one run per side and size (this run made no alternating runs)"
    )
    lines = ["### Enqueue head to head with nginx + nchan", ""]
    lines.append(
        "relay-1p against nginx + nchan with Redis storage (one nginx worker), same run, same "
        f"redis-server, wrk with {main_conns} connections: {how}. msg/s counts 2xx answers of the "
        "measured run. CPU per message = (utime + stime of the server's processes + of redis-server "
        "over the measured run) ÷ its 2xx answers: relay process + Redis against nginx master and "
        "worker + Redis (the split is in “Enqueue CPU per stored message”). A ratio of CPU per "
        "message holds on a loaded machine far better than one of msg/s. Reproduce with the command "
        "above; compare source trees, or repeat the CPU figure in alternating rounds, with "
        "`python -m relayfleet_testing.bench.cpu --nchan --size 256,4096,65536`."
    )
    lines.append("")
    lines += _table(["target", "goal", "measured (relay / nchan)", "per round", "verdict"], rows)
    lines += ["", f"{met} of {measured} measured head-to-head targets met.", ""]
    return lines + _foreign_load(res)


def _foreign_load(res: Results) -> list[str]:
    """Each alternating round's load of other processes during its two runs, relay / nchan."""
    parts: list[str] = []
    for size in HEAD_TO_HEAD_SIZES:
        relay, nchan = _head_to_head(res, "relay-1p", size), _head_to_head(res, "nchan-redis", size)
        loads = [
            f"{a:.2f} / {b:.2f}"
            for r, n in zip(relay, nchan, strict=False)
            if (a := _finite(r.values, "foreign_cores")) is not None
            and (b := _finite(n.values, "foreign_cores")) is not None
        ]
        if loads:
            parts.append(f"{size_label(size)} {', '.join(loads)}")
    if not parts:
        return []
    return [
        "Other processes' load during each round's measured runs, relay / nchan, in cores kept busy "
        f"on average (busy time of the machine less that of the server, Redis and wrk): {'; '.join(parts)}. "
        "A round whose two runs differ here by a few tenths of a core is decided by the neighbours "
        "on this shared machine, not by the servers.",
        "",
    ]


WAKE_MODE_LABELS = {"longpoll": "long-poll", "websocket": "WebSocket"}
TARGET_WAKE_VS_NCHAN = 1.0  # relay wake time ÷ nchan-redis wake time, at most, in every round


def _round(row: Row) -> int:
    return int(row.params.get("round", 0))


def _wake_runs(res: Results, target: str, mode: str, waiters: int) -> list[Row]:
    rows = [
        r
        for r in res.select("wake")
        if r.target == target and r.params.get("mode") == mode and r.params.get("waiters") == waiters
    ]
    return sorted(rows, key=_round)


def _wake_head_to_head(res: Results) -> list[str]:
    rows = res.select("wake")
    if not rows:
        return []
    verdicts: list[list[str]] = []
    detail: list[list[str]] = []
    met = measured = 0
    rounds = probes = 0
    for mode in _unique(str(r.params["mode"]) for r in rows):
        for waiters in sorted({_int(r, "waiters") for r in rows if r.params["mode"] == mode}):
            relay = _wake_runs(res, "relay-1p", mode, waiters)
            nchan = _wake_runs(res, "nchan-redis", mode, waiters)
            nchan_by_round = {_round(r): r for r in nchan}
            pairs = [(r, nchan_by_round[_round(r)]) for r in relay if _round(r) in nchan_by_round]
            rounds = max(rounds, len(pairs))
            probes = max([probes, *(int(r.values.get("probes", 0)) for r in relay + nchan)])
            label = f"wake {WAKE_MODE_LABELS.get(mode, mode)}, {_num(float(waiters))} waiters"
            for r, n in pairs:
                detail.append(
                    [
                        WAKE_MODE_LABELS.get(mode, mode),
                        _num(float(waiters)),
                        str(r.params.get("round", "-")),
                        *(_ms(x.values.get(k)) for x in (r, n) for k in ("p50_ms", "p99_ms")),
                        _ratio(r.values.get("p50_ms"), n.values.get("p50_ms")),
                        _ratio(r.values.get("p99_ms"), n.values.get("p99_ms")),
                        *(_num(x.values.get(k)) for k in ("server_cpu_us", "redis_cpu_us") for x in (r, n)),
                    ]
                )
            for key, what in (("p50_ms", "p50"), ("p99_ms", "p99")):
                name = f"{label}: relay-1p / nchan-redis {what}"
                goal = f"≤ {TARGET_WAKE_VS_NCHAN:.1f} x in every round"
                per_round = [
                    a / b
                    for r, n in pairs
                    if (a := _finite(r.values, key)) is not None and (b := _finite(n.values, key))
                ]
                if not per_round:
                    verdicts.append([name, goal, "-", "-", "not measured"])
                    continue
                a = statistics.median(x for r, _ in pairs if (x := _finite(r.values, key)) is not None)
                b = statistics.median(x for _, n in pairs if (x := _finite(n.values, key)) is not None)
                ok_rounds = sum(x <= TARGET_WAKE_VS_NCHAN for x in per_round)
                ok = ok_rounds == len(per_round)
                measured += 1
                met += ok
                verdicts.append(
                    [
                        name,
                        goal,
                        f"{a / b:.2f} ({_ms(a)} / {_ms(b)} ms)" if b else "-",
                        ", ".join(f"{x:.2f}" for x in per_round),
                        "met" if ok else f"missed ({ok_rounds} of {len(per_round)} rounds met)",
                    ]
                )
    lines = ["### Wake head to head with nginx + nchan", ""]
    lines.append(
        "relay-1p against nginx + nchan with Redis storage (one nginx worker), same client "
        "(`relayfleet_testing/bench/wake.py`: one asyncio process, times stamped where the bytes "
        "arrive), same redis-server. N idle waiters on N distinct queues (long-poll: relay "
        "`GET …/messages?wait=60` against nchan `/rsub/`; WebSocket: relay `…/live` against nchan "
        "`/rws/`, a WebSocket subscriber with Redis storage), then "
        f"{_num(float(probes))} wakes one at a time, each a 256 B enqueue (nchan: a publish to `/rpub/`) "
        "to a waiter parked since the set-up, sent after the previous wake arrived: the time from "
        "sending the enqueue to the waiter's answer or frame. A woken waiter polls again from its "
        "answer's position (relay `fromSeq`, nchan Etag) or acks (relay live). "
        f"Measured = the medians of {rounds} alternating rounds (who runs first switches every "
        "round, each run on a freshly started server); per round = each round's ratio, relay / nchan. "
        "CPU µs/wake = utime + stime over the measured wakes alone (not the set-up or warm-up wakes; "
        "the gaps between wakes and the idle waiters' upkeep included) ÷ the wakes, of the server's "
        "own processes (relay process; nginx master + worker) and, apart, of the redis-server, read "
        f"from /proc in 10 ms clock ticks (±{_num(10_000 / probes) if probes else '-'} µs per wake at "
        f"{_num(float(probes))} wakes)."
    )
    lines.append("")
    lines += _table(["target", "goal", "measured (relay / nchan)", "per round", "verdict"], verdicts)
    lines += ["", f"{met} of {measured} measured wake targets met in every round.", ""]
    lines += _table(
        [
            "mode",
            "waiters",
            "round",
            "relay p50 ms",
            "relay p99 ms",
            "nchan p50 ms",
            "nchan p99 ms",
            "p50 relay / nchan",
            "p99 relay / nchan",
            "relay CPU µs/wake",
            "nchan CPU µs/wake",
            "relay's Redis CPU µs/wake",
            "nchan's Redis CPU µs/wake",
        ],
        detail,
    )
    return [*lines, ""]


def _targets(res: Results, main_conns: int) -> list[str]:
    rate = res.value("enqueue", "relay-1p", "rate", size=256, conns=main_conns)
    ceiling = res.value("enqueue", "aiohttp-1p", "rate", size=256, conns=main_conns)
    nchan = res.value("enqueue", "nchan-redis", "rate", size=256, conns=main_conns)
    polls = [r for r in res.select("longpoll") if r.target == "relay-1p"]
    top = max(polls, key=lambda r: _int(r, "idle")) if polls else None
    ra = res.value("read_ack", "relay-1p", "rate", batch=100)
    rows: list[list[str]] = []

    def add(name: str, goal: str, value: float | None, shown: str, ok: bool, by: str) -> None:
        verdict = _verdict(value, ok)
        rows.append(
            [
                name,
                goal,
                shown if value is not None else "-",
                verdict + (f" ({by})" if verdict == "missed" else ""),
            ]
        )

    add(
        "enqueue 256 B, relay-1p",
        f"≥ {_num(TARGET_ENQUEUE_RATE)} msg/s",
        rate,
        _num(rate),
        rate is not None and rate >= TARGET_ENQUEUE_RATE,
        f"at {_ratio(rate, TARGET_ENQUEUE_RATE)} of goal",
    )
    vs_c = rate / ceiling if rate and ceiling else None
    add(
        "enqueue vs aiohttp-1p",
        f"≥ {TARGET_ENQUEUE_VS_CEILING} x",
        vs_c,
        _num(vs_c, 2),
        vs_c is not None and vs_c >= TARGET_ENQUEUE_VS_CEILING,
        f"{_num(vs_c, 2)} x",
    )
    vs_n = rate / nchan if rate and nchan else None
    add(
        "enqueue vs nchan-redis",
        f"≥ {TARGET_ENQUEUE_VS_NCHAN} x",
        vs_n,
        _num(vs_n, 2),
        vs_n is not None and vs_n >= TARGET_ENQUEUE_VS_NCHAN,
        f"{_num(vs_n, 2)} x",
    )
    if top is not None:
        idle = _num(float(_int(top, "idle")))
        p50, p99 = top.values.get("p50_ms"), top.values.get("p99_ms")
        per = top.values.get("rss_per_poll_kib")
        add(
            f"wake p50, {idle} idle polls",
            f"≤ {TARGET_WAKE_P50_MS} ms",
            p50,
            _ms(p50),
            p50 is not None and p50 <= TARGET_WAKE_P50_MS,
            f"{_ms(p50)} ms",
        )
        add(
            f"wake p99, {idle} idle polls",
            f"≤ {TARGET_WAKE_P99_MS} ms",
            p99,
            _ms(p99),
            p99 is not None and p99 <= TARGET_WAKE_P99_MS,
            f"{_ms(p99)} ms",
        )
        add(
            f"RSS per idle poll ({idle})",
            f"≤ {TARGET_RSS_PER_POLL_KIB} KiB",
            per,
            _num(per, 1),
            per is not None and per <= TARGET_RSS_PER_POLL_KIB,
            f"{_num(per, 1)} KiB",
        )
    add(
        "read+ack, batch 100, relay-1p",
        f"≥ {_num(TARGET_READ_ACK_RATE)} msg/s",
        ra,
        _num(ra),
        ra is not None and ra >= TARGET_READ_ACK_RATE,
        f"at {_ratio(ra, TARGET_READ_ACK_RATE)} of goal",
    )
    if all(r[2] == "-" for r in rows):
        return []  # a run of other phases (--only): nothing of these was measured
    lines = [
        "### Standing targets",
        "",
        "Absolute goals on this class of machine, kept to show regressions:",
        "",
    ]
    lines += _table(["target", "goal", "measured", "verdict"], rows)
    return [*lines, ""]


def _skips(res: Results) -> list[str]:
    noted = [r for r in res.rows if r.note]
    if not res.skips and not noted:
        return []
    lines = ["### Skipped, failed or noted", ""]
    lines += [f"- {s.scenario} / {s.target}: {s.reason}" for s in res.skips]
    lines += [f"- {r.scenario} / {r.target} ({_params(r)}): {r.note}" for r in noted]
    return [*lines, ""]


def _params(row: Row) -> str:
    return ", ".join(size_label(int(v)) if k == "size" else f"{k}={v}" for k, v in row.params.items())


def render(
    res: Results,
    mode: str,
    command: str,
    facts: dict[str, str],
    started: str,
    seconds: float,
    main_conns: int,
    notes: list[str],
) -> str:
    lines = [f"_Generated by `{command}` on {started}, took {seconds:.0f} s ({mode} mode)._", ""]
    lines += _table(["machine", ""], ([k, v] for k, v in facts.items()))
    lines.append("")
    lines += [f"- {n}" for n in notes]
    lines.append("")
    for section in (
        _enqueue_head_to_head(res, main_conns),
        _wake_head_to_head(res),
        _targets(res, main_conns),
        _calibration(res),
        _enqueue(res, main_conns),
        _enqueue_cpu(res, main_conns),
        _ratios(res, main_conns),
        _read_ack(res),
        _longpoll(res),
        _live(res),
        _fanout(res),
        _skips(res),
    ):
        lines += section
    return "\n".join(lines).rstrip() + "\n"


_HEADER = """# Benchmarks

Side-by-side numbers for the relay, measured in one run on one machine against
the physical limit (redis-benchmark), the Python HTTP ceiling (aiohttp + uvloop
empty handlers) and the peer a user would pick instead (nginx + nchan). Run
`relayfleet bench` (a few minutes) or `relayfleet bench --quick` (about a minute);
each run rewrites only its own generated section below.
"""


def write(path: Path, mode: str, generated: str, title: str | None = None) -> None:
    """Replace this mode's generated section of ``path`` (created when missing, as ``title``)."""
    begin, end = f"<!-- bench:{mode}:begin -->", f"<!-- bench:{mode}:end -->"
    block = f"{begin}\n{generated}{end}"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        title = title or ("## Latest full run" if mode == "full" else "## Latest quick run")
        text = text.rstrip() + f"\n\n{title}\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
