"""Side-by-side benchmarks: the relay against redis-benchmark, an aiohttp ceiling and nginx + nchan.

Entry point: :func:`main` (``relayfleet bench [--quick]`` / ``python -m relayfleet_testing.bench``).
CPU per enqueue across source trees: ``python -m relayfleet_testing.bench.cpu`` (bench/cpu.py).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    # imported lazily: `relayfleet --help` must not pay for the bench's imports
    from relayfleet_testing.bench.runner import main as run

    return run(argv)


__all__ = ["main"]
