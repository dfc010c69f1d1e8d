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
from relayfleet_testing.bench.targets import BASELINE

# The head to heads: this checkout's relay (and --baseline's) against nginx + nchan with Redis storage.
RELAYS = ("relay-1p", f"{BASELINE}-1p")
PEER = "nchan-redis"
HEAD_TO_HEAD_SIZES = (256, 4096, 65536)
# The targets (docs/benchmarks.md), relay ÷ nchan by the medians of the alternating rounds:
TARGET_RATE_VS_NCHAN = 1.0  # msg/s, at least
TARGET_CPU_VS_NCHAN = 1.0  # (relay + Redis) CPU per message ÷ (nginx + Redis)'s, at most: ≥ 1.0 x per core
# wake time, p50 and p99, at most: parity, within the spread of single rounds between the same two
# servers (0.77-1.18 in the quiet run of 2026-11-27)
TARGET_WAKE_VS_NCHAN = 1.1


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


def tree_commit(tree: Path) -> str:
    """The commit a checkout is at (short id), "not a git checkout" when git cannot say."""
    commit = _cmd(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"])
    return commit if re.fullmatch(r"[0-9a-f]{4,40}", commit) else "not a git checkout"


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
        "relay commit": tree_commit(repo),
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
    """Every enqueue run and redis-benchmark limit in one table: rate, latency, CPU per message
    (server and Redis), and a relay's msg/s as ratios to the peer, the ceiling and the limits."""
    runs = res.select("enqueue")
    limits = res.select("limit")
    if not runs and not limits:
        return []

    def ratios(r: Row) -> list[str]:
        if not r.target.startswith(("relay-", f"{BASELINE}-")):
            return ["-", "-", "-"]
        size, conns, rate = _int(r, "size"), _int(r, "conns"), r.values.get("rate")
        ceiling = f"aiohttp-{r.target.rsplit('-', 1)[-1]}"  # as many processes
        if res.find("enqueue", ceiling, size=size, conns=conns) is None:
            ceiling = "aiohttp-1p"
        return [
            _ratio(rate, res.value("enqueue", PEER, "rate", size=size, conns=conns)),
            _ratio(rate, res.value("enqueue", ceiling, "rate", size=size, conns=conns)),
            _ratio(rate, res.value("limit", "redis enqueue.lua", "rate", size=size)),
        ]

    def row(r: Row) -> list[str]:
        err = r.values.get("errors", 0.0)
        return [
            r.target,
            size_label(_int(r, "size")),
            str(r.params["conns"]),
            _num(r.values.get("rate")) + (f" ({_num(err)} err)" if err else ""),
            f"{_ms(r.values.get('p50_ms'))} / {_ms(r.values.get('p99_ms'))}",
            _num(r.values.get("server_cpu_us"), 1) if r.scenario == "enqueue" else "-",
            _num(r.values.get("redis_cpu_us"), 1),
            _num(r.values.get("cpu_us", r.values.get("redis_cpu_us", math.nan)), 1),
            *ratios(r),
        ]

    # the main connection count first (the runs the head to heads compare), then the sweep
    ordered = sorted(runs, key=lambda r: (_int(r, "conns") != main_conns, _int(r, "size"), _int(r, "conns")))
    lines = ["### Enqueue", ""]
    lines.append(
        "Messages stored per second (2xx answers), wrk with one thread per server process; p50 / p99 "
        "request latency under that load. CPU per message = utime + stime over the measured run ÷ "
        "its 2xx answers, of the server (relay process(es); nginx master + worker; the aiohttp "
        "ceiling) and of the redis-server every target shares (AOF fsync thread and rewrite forks "
        "included; flushed and its AOF rewritten before each run). `redis XADD` / `redis "
        "enqueue.lua` are redis-benchmark pipelined 16 deep (no HTTP), with Redis's CPU per command. "
        "÷ columns: a relay's msg/s divided by nchan-redis's, by the aiohttp empty handler's (as "
        "many processes) and by Redis running the relay's enqueue script."
    )
    lines.append("")
    lines += _table(
        [
            "target",
            "size",
            "conns",
            "msg/s",
            "p50 / p99 ms",
            "server µs/msg",
            "Redis µs/msg",
            "total µs/msg",
            "÷ nchan-redis",
            "÷ aiohttp",
            "÷ enqueue.lua",
        ],
        [row(r) for r in ordered + limits],
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


def _finite(values: dict[str, float], key: str) -> float | None:
    x = values.get(key)
    return None if x is None or math.isnan(x) else x


def _round(row: Row) -> int:
    return int(row.params.get("round", 0))


def _median(rows: list[Row], key: str) -> float | None:
    xs = [x for r in rows if (x := _finite(r.values, key)) is not None]
    return statistics.median(xs) if xs else None


def _compare(mine: list[Row], other: list[Row], key: str) -> tuple[float | None, float | None, list[float]]:
    """Medians of ``key`` over both sides' runs, and each round's own ratio (rounds both made)."""
    theirs = {_round(r): r for r in other}
    per_round = [
        a / b
        for r in sorted(mine, key=_round)
        if _round(r) in theirs
        and (a := _finite(r.values, key)) is not None
        and (b := _finite(theirs[_round(r)].values, key))
    ]
    return _median(mine, key), _median(other, key), per_round


def _per_round(ratios: list[float]) -> str:
    """Each round's own ratio; "-" for a single run (its ratio is the measured one)."""
    return ", ".join(f"{x:.2f}" for x in ratios) if len(ratios) > 1 else "-"


def _verdict_row(
    name: str, goal: float, better_low: bool, unit: str, cmp: tuple[float | None, float | None, list[float]]
) -> tuple[list[str], bool | None]:
    """A verdict table row, and whether the goal was met by the medians (None: not measured)."""
    a, b, per_round = cmp
    goal_text = f"{'≤' if better_low else '≥'} {goal:.1f} x by median"
    if a is None or not b:
        return [name, goal_text, "-", "-", "not measured"], None
    ratio = a / b
    ok = ratio <= goal if better_low else ratio >= goal
    digits = 2 if unit == "ms" else (1 if unit == "µs" else 0)
    return [
        name,
        goal_text,
        f"{ratio:.2f} ({_num(a, digits)} / {_num(b, digits)} {unit})",
        _per_round(per_round),
        "met" if ok else "missed",
    ], ok


def _head_to_head(res: Results, target: str, size: int) -> list[Row]:
    rows = [r for r in res.select("head_to_head") if r.target == target and r.params.get("size") == size]
    return sorted(rows, key=_round)


def _enqueue_runs(res: Results, target: str, size: int, main_conns: int) -> list[Row]:
    """The alternating runs of the head to head; without them (a run of the throughput phase only)
    the one enqueue run of that phase."""
    rows = _head_to_head(res, target, size)
    if rows:
        return rows
    row = res.find("enqueue", target, size=size, conns=main_conns)
    return [row] if row else []


def _enqueue_head_to_head(res: Results, main_conns: int) -> list[str]:
    rows: list[list[str]] = []
    met = measured = rounds = 0
    for relay in RELAYS:
        for size in HEAD_TO_HEAD_SIZES:
            mine = _enqueue_runs(res, relay, size, main_conns)
            peer = _enqueue_runs(res, PEER, size, main_conns)
            if not mine:
                continue
            rounds = max(rounds, len(mine))
            label = size_label(size)
            for row, ok in (
                _verdict_row(
                    f"enqueue {label}: {relay} / {PEER} msg/s",
                    TARGET_RATE_VS_NCHAN,
                    False,
                    "msg/s",
                    _compare(mine, peer, "rate"),
                ),
                _verdict_row(
                    f"enqueue {label}: ({relay} + Redis) / (nginx + Redis) CPU per message",
                    TARGET_CPU_VS_NCHAN,
                    True,
                    "µs",
                    _compare(mine, peer, "cpu_us"),
                ),
            ):
                rows.append(row)
                if ok is not None:
                    measured += 1
                    met += ok
    if not measured:
        return []
    how = (
        f"the median of {rounds} alternating runs per side and size (who runs first changes every "
        "round, a fresh nginx for each nchan run), so a drift of the machine's speed falls on every "
        "side alike; the per-round column gives each round's own ratio"
        if res.select("head_to_head")
        else "one run per side and size (this run made no alternating runs)"
    )
    lines = ["### Enqueue head to head with nginx + nchan", ""]
    lines.append(
        "The relay (one process) against nginx + nchan with Redis storage (one nginx worker), same "
        f"run, same redis-server, wrk with {main_conns} connections: {how}. msg/s counts 2xx answers "
        "of the measured run. CPU per message = utime + stime of the server's processes and of "
        "redis-server over the measured run ÷ its 2xx answers (relay + Redis against nginx master "
        "and worker + Redis): a CPU ratio ≤ 1.0 is ≥ 1.0 x nchan's messages per core, and holds on a "
        "loaded machine far better than a msg/s ratio."
    )
    lines.append("")
    lines += _table(["target", "goal", "measured (relay / nchan)", "per round", "verdict"], rows)
    lines += ["", f"{met} of {measured} measured enqueue targets met.", ""]
    return lines + _foreign_load(res)


def _foreign_load(res: Results) -> list[str]:
    """Each alternating round's load of other processes during the relay's and nchan's runs."""
    parts: list[str] = []
    for size in HEAD_TO_HEAD_SIZES:
        relay = {_round(r): r for r in _head_to_head(res, RELAYS[0], size)}
        loads = [
            f"{a:.2f} / {b:.2f}"
            for n in _head_to_head(res, PEER, size)
            if _round(n) in relay
            and (a := _finite(relay[_round(n)].values, "foreign_cores")) is not None
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


def _wake_runs(res: Results, target: str, mode: str, waiters: int) -> list[Row]:
    rows = [
        r
        for r in res.select("wake")
        if r.target == target and r.params.get("mode") == mode and r.params.get("waiters") == waiters
    ]
    return sorted(rows, key=_round)


def _wake_cases(res: Results) -> list[tuple[str, int]]:
    rows = res.select("wake")
    return [
        (mode, waiters)
        for mode in _unique(str(r.params["mode"]) for r in rows)
        for waiters in sorted({_int(r, "waiters") for r in rows if r.params["mode"] == mode})
    ]


def _wake_head_to_head(res: Results) -> list[str]:
    rows = res.select("wake")
    if not rows:
        return []
    verdicts: list[list[str]] = []
    detail: list[list[str]] = []
    met = measured = 0
    rounds = max(_round(r) for r in rows)
    probes = max(int(r.values.get("probes", 0)) for r in rows)
    for mode, waiters in _wake_cases(res):
        label = f"wake {WAKE_MODE_LABELS.get(mode, mode)}, {_num(float(waiters))} waiters"
        peer = _wake_runs(res, PEER, mode, waiters)
        for relay in RELAYS:
            mine = _wake_runs(res, relay, mode, waiters)
            if not mine:
                continue
            for key, what in (("p50_ms", "p50"), ("p99_ms", "p99")):
                row, ok = _verdict_row(
                    f"{label}: {relay} / {PEER} {what}",
                    TARGET_WAKE_VS_NCHAN,
                    True,
                    "ms",
                    _compare(mine, peer, key),
                )
                verdicts.append(row)
                if ok is not None:
                    measured += 1
                    met += ok
        for target in (PEER, *RELAYS):
            runs = _wake_runs(res, target, mode, waiters)
            if runs:
                detail.append(
                    [
                        WAKE_MODE_LABELS.get(mode, mode),
                        _num(float(waiters)),
                        target,
                        _ms(_median(runs, "p50_ms")),
                        _ms(_median(runs, "p99_ms")),
                        _num(_median(runs, "server_cpu_us")),
                        _num(_median(runs, "redis_cpu_us")),
                        _num(_median(runs, "rss_per_waiter_kib"), 1),
                    ]
                )
    lines = ["### Wake head to head with nginx + nchan", ""]
    lines.append(
        "The relay (one process) against nginx + nchan with Redis storage (one nginx worker), same "
        "client (`relayfleet_testing/bench/wake.py`), same redis-server. N idle waiters on N distinct "
        "queues (long-poll: relay `GET …/messages?wait=60` against nchan `/rsub/`; WebSocket: relay "
        f"`…/live` against nchan `/rws/`), then {_num(float(probes))} wakes one at a time, each a 256 B "
        "enqueue (nchan: a publish to `/rpub/`) to a waiter parked since the set-up: the time from "
        "sending the enqueue to the waiter's answer or frame. Measured = the medians of "
        f"{rounds} alternating rounds (each run on a freshly started server); parity = the relay's "
        f"median at most {TARGET_WAKE_VS_NCHAN:.1f} x nchan's. CPU µs/wake = utime + stime over the "
        "measured wakes ÷ the wakes, of the server's processes and, apart, of its redis-server "
        f"(10 ms clock ticks: ±{_num(10_000 / probes) if probes else '-'} µs per wake). RSS per "
        "waiter = (the server's RSS with all N parked - its RSS fresh, after one enqueue) ÷ N "
        "(nginx: its worker). The last table: each target's medians of the rounds."
    )
    lines.append("")
    lines += _table(["target", "goal", "measured (relay / nchan)", "per round", "verdict"], verdicts)
    lines += ["", f"{met} of {measured} measured wake targets met.", ""]
    lines += _table(
        [
            "mode",
            "waiters",
            "target",
            "p50 ms",
            "p99 ms",
            "CPU µs/wake",
            "its Redis CPU µs/wake",
            "RSS KiB/waiter",
        ],
        detail,
    )
    return [*lines, ""]


def _before_after(res: Results, main_conns: int) -> list[str]:
    """This checkout's relay against the baseline's, from the same alternating rounds."""
    now, before = RELAYS
    rows: list[list[str]] = []

    def add(what: str, unit: str, cmp: tuple[float | None, float | None, list[float]]) -> None:
        a, b, per_round = cmp
        if a is None or not b:
            return
        digits = 2 if unit == "ms" else (1 if unit == "µs" else 0)
        rows.append(
            [what, f"{a / b:.2f} ({_num(a, digits)} / {_num(b, digits)} {unit})", _per_round(per_round)]
        )

    for size in HEAD_TO_HEAD_SIZES:
        mine, base = _enqueue_runs(res, now, size, main_conns), _enqueue_runs(res, before, size, main_conns)
        add(f"enqueue {size_label(size)} msg/s", "msg/s", _compare(mine, base, "rate"))
        add(f"enqueue {size_label(size)} CPU per message", "µs", _compare(mine, base, "cpu_us"))
    for mode, waiters in _wake_cases(res):
        mine, base = _wake_runs(res, now, mode, waiters), _wake_runs(res, before, mode, waiters)
        label = f"wake {WAKE_MODE_LABELS.get(mode, mode)}, {_num(float(waiters))} waiters"
        add(f"{label} p50", "ms", _compare(mine, base, "p50_ms"))
        add(f"{label} p99", "ms", _compare(mine, base, "p99_ms"))
    if not rows:
        return []
    lines = ["### Before / after: this checkout's relay against the baseline's", ""]
    lines.append(
        f"{now} ÷ {before} (`--baseline`), medians of the same alternating rounds as the head to "
        "heads above (msg/s: higher is better; CPU and wake times: lower is better). The other "
        f"tables show {before} as a target of its own."
    )
    lines.append("")
    lines += _table(["figure", f"{now} / {before}", "per round"], rows)
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
        _before_after(res, main_conns),
        _calibration(res),
        _enqueue(res, main_conns),
        _read_ack(res),
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
