"""`relayfleet dev` and `relayfleet demo` (entry points in the relayfleet.commands group).

Flags follow the relay CLI's rules (relay.cli): each names its variable and default in
--help, a bad value exits 2 with one line.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp

from relay import cli
from relay import settings as declared


def dev_main(argv: list[str]) -> int:
    p = cli.command_parser("relayfleet dev", "Local Redis shard(s) + relay, with a short demo.")
    cli.env_flag(p, declared.PORT)
    p.add_argument("--shards", type=int, default=1, help="local shards to start [no env; default 1]")
    p.add_argument("--redis-port", type=int, default=0, metavar="FIRST",
                   help="Redis ports FIRST, FIRST+1, ... [no env; default: free ports]")  # fmt: skip
    p.add_argument("--no-demo", action="store_true", help="skip the demo [no env; default off]")
    cli.env_flag(p, declared.AUTH)
    cli.log_level_flag(p)
    args = cli.parse_command(p, argv)
    from relayfleet_testing.devfleet.fleet import run_dev

    return run_dev(
        port=args.port, shards=args.shards, demo=not args.no_demo, auth=args.auth, redis_port=args.redis_port
    )


def demo_main(argv: list[str]) -> int:
    p = cli.command_parser(
        "relayfleet demo", "The short demo (two recipients, one long-polls) against a running relay."
    )
    cli.env_flag(p, declared.URL)
    cli.log_level_flag(p)
    args = cli.parse_command(p, argv)
    from relayfleet_testing.devfleet.demo import run_demo

    from relay.client import RelayClientError, check_base_url, wait_ready

    try:
        url = check_base_url(args.url)
    except ValueError as exc:
        print(f"relayfleet demo: --url: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(wait_ready(url, 10))
        asyncio.run(run_demo(url))
    except (OSError, TimeoutError, RelayClientError, aiohttp.ClientError) as exc:
        print(f"relayfleet demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
