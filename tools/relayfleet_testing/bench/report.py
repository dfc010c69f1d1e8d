"""Turns Results into the markdown written to docs/benchmarks.md, with machine facts.

The generated part sits between ``<!-- bench:<mode>:begin/end -->`` markers, so the hand-written
text around it survives every re-run. What it shows is what docs/benchmarks.md reads: each
target's verdict by the medians of the alternating rounds with every round's own ratio, each
side's medians, the before / after of --baseline, the generators' calibration and the relay's
own read + ack and fan-out figures.
"""

from __future__ import annotations

import argparse
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
# The targets (docs/benchmarks.md), relay ÷ nchan by the medians of the alternating rounds:
TARGET_RATE_VS_NCHAN = 1.0  # msg/s, at least
TARGET_CPU_VS_NCHAN = 1.0  # (relay + Redis) CPU per message ÷ (nginx + Redis)'s, at most: ≥ 1.0 x per core
# wake time, p50 and p99, at most: parity, within the spread of single rounds between the same two
# servers (0.77-1.18 in the quiet run of 2026-11-27)
TARGET_WAKE_VS_NCHAN = 1.1
Compared = tuple[float | None, float | None, list[float]]  # two medians and each round's ratio


def output_arguments(p: argparse.ArgumentParser) -> None:
    """Where a run's tables go: --output, --no-write, --json (both bench commands)."""
    p.add_argument(
        "--output",
        type=Path,
        help="markdown file to update (default: ./docs/benchmarks.md when it exists, else ./benchmarks.md)",
    )
    p.add_argument(
        "--no-write", action="store_true", help="print the tables instead of updating the markdown file"
    )
    p.add_argument("--json", type=Path, help="also write every figure as JSON here")


def default_output(cwd: Path | None = None) -> Path:
    """Where results go without --output: docs/benchmarks.md when run from a checkout (it exists
    under the current directory), else ./benchmarks.md — never next to the installed module."""
    base = Path.cwd() if cwd is None else cwd
    in_checkout = base / "docs" / "benchmarks.md"
    return in_checkout if in_checkout.is_file() else base / "benchmarks.md"


# -- machine facts ----------------------------------------------------------------------------


def _cmd(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "n/a"
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else "n/a"


def _pkg(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "n/a"


def _proc_field(path: str, prefix: str) -> str | None:
    """The rest of the first line of ``path`` that starts with ``prefix``; None without one."""
    try:
        return next(
            (line[len(prefix) :] for line in Path(path).read_text().splitlines() if line.startswith(prefix)),
            None,
        )
    except OSError:
        return None


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def tree_commit(tree: Path) -> str:
    """The commit a checkout is at (short id), "not a git checkout" when git cannot say."""
    commit = _cmd(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"])
    return commit if re.fullmatch(r"[0-9a-f]{4,40}", commit) else "not a git checkout"


def cpu_model() -> str:
    model = _proc_field("/proc/cpuinfo", "model name")
    name = model.split(":", 1)[-1].strip() if model else platform.processor() or "n/a"
    return f"{name}, {os.cpu_count()} cores"


def machine_facts(repo: Path) -> dict[str, str]:
    dpkg = ["dpkg-query", "-W", "-f", "${Version}"]
    mem = _proc_field("/proc/meminfo", "MemTotal:")
    os_name = _proc_field("/etc/os-release", "PRETTY_NAME=")
    return {
        "CPU": cpu_model(),
        "memory": f"{int(mem.split()[0]) / (1 << 20):.1f} GiB" if mem else "n/a",
        "OS / kernel": f"{os_name.strip(chr(34)) if os_name else platform.system()} / {platform.release()}",
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


# -- figures ----------------------------------------------------------------------------------


def _num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:,.{digits}f}"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _finite(row: Row, key: str) -> float | None:
    x = row.values.get(key)
    return None if x is None or math.isnan(x) else x


def _round(row: Row) -> int:
    return int(row.params.get("round", 0))


def _median(rows: list[Row], key: str) -> float | None:
    xs = [x for r in rows if (x := _finite(r, key)) is not None]
    return statistics.median(xs) if xs else None


def _compare(mine: list[Row], other: list[Row], key: str) -> Compared:
    """Medians of ``key`` over both sides' runs, and each round's own ratio (rounds both made)."""
    theirs = {_round(r): r for r in other}
    per_round = [
        a / b
        for r in sorted(mine, key=_round)
        if _round(r) in theirs
        and (a := _finite(r, key)) is not None
        and (b := _finite(theirs[_round(r)], key))
    ]
    return _median(mine, key), _median(other, key), per_round


def _measured(cmp: Compared, unit: str) -> str | None:
    """ "ratio (a / b unit)" of two medians; None when either is missing."""
    a, b, _ = cmp
    if a is None or not b:
        return None
    digits = 2 if unit == "ms" else (1 if unit == "µs" else 0)
    return f"{a / b:.2f} ({_num(a, digits)} / {_num(b, digits)} {unit})"


def _per_round(cmp: Compared) -> str:
    """Each round's own ratio; "-" for a single run (its ratio is the measured one)."""
    return ", ".join(f"{x:.2f}" for x in cmp[2]) if len(cmp[2]) > 1 else "-"


# What each head to head judges, relay ÷ nchan: (value, what, goal, lower is better, unit) ...
JUDGED = {
    "head_to_head": (
        ("rate", "msg/s", TARGET_RATE_VS_NCHAN, False, "msg/s"),
        ("cpu_us", "CPU per message (server + its Redis)", TARGET_CPU_VS_NCHAN, True, "µs"),
    ),
    "wake": (
        ("p50_ms", "p50", TARGET_WAKE_VS_NCHAN, True, "ms"),
        ("p99_ms", "p99", TARGET_WAKE_VS_NCHAN, True, "ms"),
    ),
}
# ... and each side's medians it shows: (column, value, digits)
MEDIANS = {
    "head_to_head": (("msg/s", "rate", 0), ("server CPU µs/msg", "server_cpu_us", 1),
                     ("its Redis CPU µs/msg", "redis_cpu_us", 1)),
    "wake": (("p50 ms", "p50_ms", 2), ("p99 ms", "p99_ms", 2), ("CPU µs/wake", "server_cpu_us", 0),
             ("its Redis CPU µs/wake", "redis_cpu_us", 0), ("RSS KiB/waiter", "rss_per_waiter_kib", 1)),
}  # fmt: skip


def _cases(res: Results, scenario: str) -> list[tuple[str, dict[str, int | str]]]:
    """Each case of a head to head, in the order it ran: a label and the params that pick its runs
    (the enqueue's sizes; the wake's modes and waiter counts)."""
    if scenario == "head_to_head":
        sizes = sorted({int(r.params["size"]) for r in res.select(scenario)})
        return [(f"enqueue {size_label(size)}", {"size": size}) for size in sizes]
    cases = dict.fromkeys((str(r.params["mode"]), int(r.params["waiters"])) for r in res.select(scenario))
    labels = {"longpoll": "long-poll", "websocket": "WebSocket"}
    return [(f"wake {labels[m]}, {w:,} waiters", {"mode": m, "waiters": w}) for m, w in cases]


def _runs(res: Results, scenario: str, target: str, params: dict[str, int | str]) -> list[Row]:
    rows = [r for r in res.select(scenario, target) if all(r.params.get(k) == v for k, v in params.items())]
    return sorted(rows, key=_round)


def _head_to_head(res: Results, scenario: str, what: str) -> list[str]:
    """A head to head's verdict table (each target met or missed by the medians, with every
    round's own ratio) and each side's medians."""
    verdicts: list[list[str]] = []
    medians: list[list[str]] = []
    met = measured = 0
    for label, params in _cases(res, scenario):
        peer = _runs(res, scenario, PEER, params)
        for relay in RELAYS:
            if not (mine := _runs(res, scenario, relay, params)):
                continue
            for key, name, goal, lower_is_better, unit in JUDGED[scenario]:
                cmp = _compare(mine, peer, key)
                row = [
                    f"{label}: {relay} / {PEER} {name}",
                    f"{'≤' if lower_is_better else '≥'} {goal:.1f} x by median",
                ]
                if (shown := _measured(cmp, unit)) is None or cmp[0] is None or not cmp[1]:
                    verdicts.append([*row, "-", "-", "not measured"])
                    continue
                ok = cmp[0] / cmp[1] <= goal if lower_is_better else cmp[0] / cmp[1] >= goal
                verdicts.append([*row, shown, _per_round(cmp), "met" if ok else "missed"])
                measured, met = measured + 1, met + ok
        for target in (PEER, *RELAYS):
            if runs := _runs(res, scenario, target, params):
                medians.append(
                    [label, target, *(_num(_median(runs, key), d) for _, key, d in MEDIANS[scenario])]
                )
    lines = _table(["target", "goal", "measured (relay / nchan)", "per round", "verdict"], verdicts)
    lines += [f"{met} of {measured} measured {what} targets met.", ""]
    return lines + _table(["case", "target", *(c for c, _, _ in MEDIANS[scenario])], medians)


def _enqueue(res: Results) -> list[str]:
    rows = res.select("head_to_head")
    if not rows:
        return []
    lines = ["### Enqueue head to head with nginx + nchan", ""]
    lines.append(
        f"wrk with {rows[0].params['conns']} connections; measured = the medians of "
        f"{max(map(_round, rows))} alternating runs per side and size; CPU per message = utime + "
        "stime of the server's processes and of redis-server over the measured run ÷ its 2xx "
        'answers (docs/benchmarks.md, "What runs").'
    )
    return [*lines, "", *_head_to_head(res, "head_to_head", "enqueue"), *_foreign_load(res)]


def _foreign_load(res: Results) -> list[str]:
    """Each alternating round's load of other processes during the relay's and nchan's runs."""
    parts: list[str] = []
    for label, params in _cases(res, "head_to_head"):
        relay = {_round(r): r for r in _runs(res, "head_to_head", RELAYS[0], params)}
        loads = [
            f"{a:.2f} / {b:.2f}"
            for n in _runs(res, "head_to_head", PEER, params)
            if _round(n) in relay
            and (a := _finite(relay[_round(n)], "foreign_cores")) is not None
            and (b := _finite(n, "foreign_cores")) is not None
        ]
        if loads:
            parts.append(f"{label.removeprefix('enqueue ')} {', '.join(loads)}")
    if not parts:
        return []
    return [
        "Other processes' load during each round's measured runs, relay / nchan, in cores kept busy "
        f"on average (busy time of the machine less that of the server, Redis and wrk): {'; '.join(parts)}. "
        "A round whose two runs differ here by a few tenths of a core is decided by the neighbours "
        "on this shared machine, not by the servers.",
        "",
    ]


def _wake(res: Results) -> list[str]:
    rows = res.select("wake")
    if not rows:
        return []
    probes = max(int(r.values.get("probes", 0)) for r in rows)
    lines = ["### Wake head to head with nginx + nchan", ""]
    lines.append(
        f"{probes:,} wakes one at a time to N idle waiters, each a 256 B enqueue: the time from sending "
        f"it to the waiter's answer or frame; measured = the medians of {max(map(_round, rows))} "
        f"alternating rounds; parity = at most {TARGET_WAKE_VS_NCHAN:.1f} x nchan's. CPU µs/wake over "
        f"the measured wakes (10 ms clock ticks: ±{_num(10_000 / probes) if probes else '-'} µs); "
        'RSS per waiter = (RSS with all N parked - RSS fresh) ÷ N (docs/benchmarks.md, "What runs").'
    )
    return [*lines, "", *_head_to_head(res, "wake", "wake")]


def _before_after(res: Results) -> list[str]:
    """This checkout's relay against the baseline's, from the same alternating rounds."""
    now, before = RELAYS
    rows: list[list[str]] = []
    compared = [
        (
            f"{label} {name}",
            unit,
            _compare(_runs(res, scenario, now, params), _runs(res, scenario, before, params), key),
        )
        for scenario in JUDGED
        for label, params in _cases(res, scenario)
        for key, name, _, _, unit in JUDGED[scenario]
    ]
    compared += [
        (what, "msg/s", _compare(res.select(scenario, now), res.select(scenario, before), key))
        for scenario, key, what in (
            ("read_ack", "rate", "read + ack msg/s"),
            ("fanout", "msg_rate", "fan-out recipient msg/s"),
        )
    ]
    for what, unit, cmp in compared:
        if (shown := _measured(cmp, unit)) is not None:
            rows.append([what, shown, _per_round(cmp)])
    if not rows:
        return []
    lines = ["### Before / after: this checkout's relay against the baseline's", ""]
    lines.append(
        f"{now} ÷ {before} (`--baseline`), medians of the same alternating rounds as the head to "
        "heads above (msg/s: higher is better; CPU and wake times: lower is better); read + ack and "
        f"fan-out: one run each, {now} first. The other tables show {before} as a target of its own."
    )
    return [*lines, "", *_table(["figure", f"{now} / {before}", "per round"], rows)]


def _throughput(res: Results) -> list[str]:
    """The calibration line and the relay's own read + ack and fan-out."""
    lines: list[str] = []
    for r in res.select("calibration"):
        lines.append(
            f"Generators against nginx's `{r.params['path']}` ({r.params['conns']} connections), the most "
            f"either drives here: wrk {_num(r.values.get('wrk_rate'))} requests/s, the bench's own "
            f"(uvloop) {_num(r.values.get('own_rate'))}; every figure above is far below both or says so."
        )
        lines.append("")
    rows = [
        [r.target, f"{_num(r.values.get('rate'))} msg/s ({_num(r.values.get('req_rate'))} requests/s)",
         _num(_median(res.select("fanout", r.target), "msg_rate"))]
        for r in res.select("read_ack")
    ]  # fmt: skip
    if rows:
        first = res.select("read_ack")[0].params
        lines.append(
            f"The relay's own (nchan has no batch read, ack or fan-out): queues prefilled through its "
            f"enqueue script read by `GET …/messages?limit={first['batch']}&fromSeq=S` + `POST …/ack` "
            f"until empty ({first['conns']} connections, the own generator); `POST /v1/messages` "
            "of 256 B to 100 recipients a request."
        )
        lines.append("")
        lines += _table(["target", f"read + ack, batch {first['batch']}", "fan-out recipient msg/s"], rows)
    return ["### Calibration, read + ack, fan-out", "", *lines] if lines else []


def _skips(res: Results) -> list[str]:
    noted = [r for r in res.rows if r.note]
    if not res.skips and not noted:
        return []
    lines = ["### Skipped, failed or noted", ""]
    lines += [f"- {s.scenario} / {s.target}: {s.reason}" for s in res.skips]
    params = (", ".join(f"{k}={v}" for k, v in r.params.items()) for r in noted)
    lines += [f"- {r.scenario} / {r.target} ({p}): {r.note}" for r, p in zip(noted, params, strict=True)]
    return [*lines, ""]


def render(
    res: Results,
    mode: str,
    command: str,
    facts: dict[str, str],
    started: str,
    seconds: float,
    notes: list[str],
) -> str:
    lines = [f"_Generated by `{command}` on {started}, took {seconds:.0f} s ({mode} mode)._", ""]
    lines += _table(["machine", ""], ([k, v] for k, v in facts.items()))
    lines += [f"- {n}" for n in notes] + [""]
    for section in (_enqueue, _wake, _before_after, _throughput, _skips):
        lines += section(res)
    return "\n".join(lines).rstrip() + "\n"


_HEADER = """# Benchmarks

The relay measured side by side with nginx + nchan, in one run on one machine (`relayfleet
bench --quick`, about 70 s); each run rewrites only its own generated section below.
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
