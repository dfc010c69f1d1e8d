"""Side-by-side benchmarks: the relay against nginx + nchan, both storing into one redis-server.

Entry point: :func:`main` (``relayfleet bench [--quick] [--baseline DIR]`` /
``python -m relayfleet_testing.bench``); ``--baseline`` puts an older checkout's relay beside this
one's in the same rounds (before / after in one run).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    # imported lazily: `relayfleet --help` must not pay for the bench's imports
    from relayfleet_testing.bench.runner import main as run

    return run(argv)


__all__ = ["main"]
