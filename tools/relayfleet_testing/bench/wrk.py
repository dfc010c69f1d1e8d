"""wrk as the enqueue load generator: Lua script generation, one run, result parsing.

Each script pre-formats its requests once (paths rotate over a recipient pool, so the relay's
per-queue rate limit never binds) and prints one ``WRKJSON`` line from ``done()``, so nothing
depends on wrk's human-readable output.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

from relayfleet_testing.bench.procs import BenchError, Procs, wait_exit

WRK = "/usr/bin/wrk"

# The table of pre-formatted requests stays under this many bytes.
PREFORMAT_BUDGET = 16 * 1024 * 1024


def _lua_str(data: bytes) -> str:
    """A Lua string literal for any bytes: printable ASCII as is, the rest as decimal escapes."""
    out = ['"']
    for b in data:
        out.append(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:03d}")
    out.append('"')
    return "".join(out)


def lua_script(method: str, paths: list[str], headers: dict[str, str], filler_size: int = 0) -> str:
    """A wrk script cycling over ``paths``; with ``filler_size`` > 0 every request carries a body
    of that many bytes, built in Lua (no huge literal in the file)."""
    if not paths:
        raise ValueError("at least one path")
    lines = ["local paths = {", *(f"  {_lua_str(p.encode())}," for p in paths), "}", "local body = nil"]
    if filler_size > 0:
        # the bytes scenarios.filler makes: printable, not compressible by run-length tricks
        lines.append(
            f"do local s = string.rep('relayfleet-bench-0123456789abcdef', {filler_size // 33 + 1}) "
            f"body = string.sub(s, 1, {filler_size}) end"
        )
    hdr = ", ".join(f"[ {_lua_str(k.encode())} ] = {_lua_str(v.encode())}" for k, v in headers.items())
    lines.append(f"local headers = {{ {hdr} }}")
    lines.append(f"local method = {_lua_str(method.encode())}")
    lines.append(
        """
local reqs = {}
local i = 0
function init(args)
  for k = 1, #paths do reqs[k] = wrk.format(method, paths[k], headers, body) end
  i = 7919 % #reqs
end
function request()
  i = i % #reqs + 1
  return reqs[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,' ..
    '"timeout":%d,"p50_us":%d,"p99_us":%d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""
    )
    return "\n".join(lines)


def pool_size(body_size: int, wanted: int) -> int:
    """How many distinct paths to pre-format so the table stays within budget."""
    return max(16, min(wanted, PREFORMAT_BUDGET // max(1, body_size + 256)))


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    errors: int  # socket errors + non-2xx/3xx responses
    p50_ms: float
    p99_ms: float

    @property
    def ok_rate(self) -> float:
        ok = max(0, self.requests - self.errors)
        return ok / self.seconds if self.seconds > 0 else 0.0


def parse_output(text: str) -> WrkResult:
    for line in text.splitlines():
        if line.startswith("WRKJSON "):
            p = json.loads(line[len("WRKJSON ") :])
            errors = sum(p[k] for k in ("connect", "read", "write", "status", "timeout"))
            return WrkResult(
                p["requests"], p["duration_us"] / 1e6, errors, p["p50_us"] / 1000, p["p99_us"] / 1000
            )
    raise BenchError("wrk printed no result line (did the script fail?)")


async def run(
    procs: Procs, url: str, script: str, connections: int, seconds: float, name: str = "wrk"
) -> WrkResult:
    """One wrk thread with ``connections`` connections against ``url`` for ``seconds``."""
    binary = shutil.which(WRK) or shutil.which("wrk")
    if not binary:
        raise BenchError("wrk is not installed (Debian: apt-get install wrk)")
    path = procs.workdir / f"{name}.lua"
    path.write_text(script)
    argv = [binary, "-t", "1", "-c", str(connections), "-d", f"{max(1, round(seconds))}s", "--timeout", "10s"]
    child = procs.start(name, [*argv, "-s", str(path), url], capture=True)
    try:
        await wait_exit(child, seconds + 30)
        if child.popen.returncode != 0:
            raise BenchError(f"wrk failed ({child.popen.returncode}): {child.log_tail(5)}")
        return parse_output(child.output())
    finally:
        procs.stop(child)
