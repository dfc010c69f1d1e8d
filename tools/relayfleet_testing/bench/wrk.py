"""wrk as the throughput load generator: Lua script generation, runs, result parsing.

Each script pre-formats its requests once (paths rotate over a recipient pool,
so the relay's per-queue rate limit never binds) and prints one ``WRKJSON``
line from ``done()``, so nothing depends on wrk's human-readable output.
Several wrk instances may run side by side (one per server port); their
results are summed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relayfleet_testing.bench.procs import BenchError, Procs, wait_exit

WRK = "/usr/bin/wrk"

# The per-thread table of pre-formatted requests stays under this many bytes.
PREFORMAT_BUDGET = 16 * 1024 * 1024


def wrk_binary() -> str:
    found = WRK if Path(WRK).exists() else shutil.which("wrk")
    if not found:
        raise BenchError("wrk is not installed (Debian: apt-get install wrk)")
    return found


def _lua_str(data: bytes) -> str:
    """A Lua string literal for any bytes: printable ASCII as is, the rest as decimal escapes."""
    out = ['"']
    for b in data:
        out.append(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:03d}")
    out.append('"')
    return "".join(out)


def lua_script(
    method: str,
    paths: Sequence[str],
    bodies: Sequence[bytes],
    headers: dict[str, str],
    filler_size: int = 0,
    count_inner_errors: bool = False,
) -> str:
    """Build a wrk script.

    ``bodies`` are used round-robin with ``paths``; with ``filler_size`` > 0
    every body is instead that many bytes built in Lua (no huge literal in the file).
    ``count_inner_errors`` scans 2xx bodies for per-item 4xx/5xx statuses (fan-out).
    """
    if not paths:
        raise ValueError("at least one path")
    lines = ["local paths = {"]
    lines += [f"  {_lua_str(p.encode())}," for p in paths]
    lines.append("}")
    lines.append("local bodies = {")
    lines += [f"  {_lua_str(b)}," for b in bodies]
    lines.append("}")
    if filler_size > 0:
        # printable, not compressible by run-length tricks anywhere on the path
        lines.append(
            f"do local s = string.rep('relayfleet-bench-0123456789abcdef', {filler_size // 33 + 1}) "
            f"bodies = {{ string.sub(s, 1, {filler_size}) }} end"
        )
    hdr = ", ".join(f"[ {_lua_str(k.encode())} ] = {_lua_str(v.encode())}" for k, v in headers.items())
    lines.append(f"local headers = {{ {hdr} }}")
    lines.append(f"local method = {_lua_str(method.encode())}")
    lines.append(
        """
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
local reqs = {}
local i = 0
local n = 0
inner = 0
function init(args)
  for k = 1, #paths do
    local body = nil
    if #bodies > 0 then body = bodies[(k - 1) % #bodies + 1] end
    reqs[k] = wrk.format(method, paths[k], headers, body)
  end
  n = #reqs
  i = ((tid or 1) * 7919) % n
end
function request()
  i = i % n + 1
  return reqs[i]
end
"""
    )
    if count_inner_errors:
        lines.append(
            """
function response(status, headers, body)
  if status >= 200 and status < 300 and body then
    for _ in string.gmatch(body, '"status":[45]') do inner = inner + 1 end
  end
end
"""
        )
    lines.append(
        """
function done(summary, latency, requests)
  local inner_total = 0
  for _, t in ipairs(threads) do inner_total = inner_total + (t:get("inner") or 0) end
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"inner":%d}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, inner_total))
end
"""
    )
    return "\n".join(lines)


def pool_size(body_size: int, wanted: int) -> int:
    """How many distinct paths to pre-format so one thread's table stays within budget."""
    return max(16, min(wanted, PREFORMAT_BUDGET // max(1, body_size + 256)))


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    errors: int  # socket errors + non-2xx/3xx responses
    inner_errors: int
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def ok_rate(self) -> float:
        ok = max(0, self.requests - self.errors)
        return ok / self.seconds if self.seconds > 0 else 0.0


def parse_output(text: str) -> dict[str, int]:
    for line in text.splitlines():
        if line.startswith("WRKJSON "):
            parsed: dict[str, int] = json.loads(line[len("WRKJSON ") :])
            return parsed
    raise BenchError("wrk printed no result line (did the script fail?)")


def combine(parts: Sequence[dict[str, int]]) -> WrkResult:
    """Sum side-by-side instances: requests add up, latency is the worst instance's."""
    requests = sum(p["requests"] for p in parts)
    seconds = max(p["duration_us"] for p in parts) / 1e6
    errors = sum(p["connect"] + p["read"] + p["write"] + p["status"] + p["timeout"] for p in parts)
    return WrkResult(
        requests=requests,
        seconds=seconds,
        errors=errors,
        inner_errors=sum(p["inner"] for p in parts),
        p50_ms=max(p["p50_us"] for p in parts) / 1000,
        p99_ms=max(p["p99_us"] for p in parts) / 1000,
    )


async def run(
    procs: Procs,
    urls: Sequence[str],
    scripts: Sequence[str],
    connections: int,
    threads: int,
    seconds: float,
    name: str = "wrk",
) -> WrkResult:
    """Run one wrk per url at the same time; ``connections`` and ``threads`` are split evenly."""
    if len(urls) != len(scripts):
        raise ValueError("one script per url")
    k = len(urls)
    if connections < k or threads < k:
        raise ValueError("at least one connection and thread per url")
    binary = wrk_binary()
    children = []
    for idx, (url, script) in enumerate(zip(urls, scripts, strict=True)):
        path = procs.workdir / f"{name}-{idx}.lua"
        path.write_text(script)
        t = threads // k
        c = max(t, connections // k)
        argv = [binary, "-t", str(t), "-c", str(c), "-d", f"{max(1, round(seconds))}s", "--timeout", "10s"]
        argv += ["-s", str(path), url]
        children.append(procs.start(name, argv, capture=True))
    parts = []
    try:
        for child in children:
            await wait_exit(child, seconds + 30)
            out = child.output()
            if child.popen.returncode != 0:
                raise BenchError(f"wrk failed ({child.popen.returncode}): {child.log_tail(5)}")
            parts.append(parse_output(out))
    finally:
        for child in children:
            procs.stop(child)
    return combine(parts)
