"""Side-by-side benchmarks: the relay against redis-benchmark, an aiohttp ceiling and nginx + nchan.

Entry point: :func:`main` (``relayfleet bench [--quick]`` / ``python -m relay.bench``).
CPU per enqueue across source trees: ``python -m relay.bench.cpu`` (relay/bench/cpu.py).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    # imported lazily: `relayfleet --help` must not pay for the bench's imports
    from relay.bench.runner import main as run

    return run(argv)


__all__ = ["main"]
