"""The `relayfleet` command line (DESIGN §3 contract). Exit 0 ok, 2 bad arguments, 1 failure."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from relay.fleet.sharding import ShardMapError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line, exit 2 (the contract), instead of argparse's usage dump
        self.exit(2, f"relayfleet: {message}\n")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _add_relay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("RELAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("RELAY_PORT", "8080") or 8080))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--redis-url", default=_env("RELAY_REDIS_URL"))
    src.add_argument("--shard-map", default=_env("RELAY_SHARD_MAP"), metavar="FILE")
    src.add_argument("--shard-map-configmap", default=_env("RELAY_SHARD_MAP_CONFIGMAP"), metavar="NS/NAME")
    p.add_argument("--auth", choices=["ed25519", "none"], default=_env("RELAY_AUTH", "ed25519"))
    p.add_argument("--log-level", default=_env("RELAY_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--didcomm-seed-file",
        default=_env("RELAY_DIDCOMM_SEED_FILE"),
        metavar="FILE",
        help="turn the DIDComm mediator on: its 32-byte seed (raw, hex or base64; a Secret mount, the "
        "same for the whole fleet) [env RELAY_DIDCOMM_SEED_FILE]",
    )
    p.add_argument(
        "--public-url",
        default=_env("RELAY_PUBLIC_URL"),
        metavar="URL",
        help="the URL agents reach the fleet at, for the mediator's invitation and DID "
        "(default http://HOST:PORT) [env RELAY_PUBLIC_URL]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="relayfleet", description="Sharded store-and-forward relay for E2EE messaging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_relay_args(sub.add_parser("relay", help="run a relay process"))
    dev = sub.add_parser("dev", help="local Redis shard(s) + relay, with a short demo")
    dev.add_argument("--port", type=int, default=int(_env("RELAY_PORT", "8080") or 8080))
    dev.add_argument("--shards", type=int, default=1)
    dev.add_argument("--no-demo", action="store_true")
    dev.add_argument("--auth", choices=["ed25519", "none"], default=_env("RELAY_AUTH", "ed25519"))
    mig = sub.add_parser("migrate", help="move slots to a shard, online")
    mig.add_argument("--shard-map", required=True, metavar="FILE")
    mig.add_argument("--slots", required=True, metavar="A-B")
    mig.add_argument("--to", required=True, metavar="SHARD")
    sub.add_parser("plan", help="rebalance plan without Spark (JSON on stdout): --shard-map FILE")
    sub.add_parser("keygen", help="print a new Ed25519 key pair")
    op = sub.add_parser("operator", help="run the kopf operator")
    scope = op.add_mutually_exclusive_group()
    scope.add_argument("--namespace", default=_env("RELAY_OPERATOR_NAMESPACE"))
    scope.add_argument("--all-namespaces", action="store_true")
    sub.add_parser("bench", help="side-by-side benchmarks: [--quick]")
    sub.add_parser("backup", help="snapshot a shard's Redis into a backup directory (see backup --help)")
    sub.add_parser("restore", help="restore a shard from a backup, with new epochs (see restore --help)")
    top = sub.add_parser("top", help="live figures of a fleet from its relays' /metrics")
    top.add_argument("urls", nargs="*", default=[_env("RELAY_URL", "http://127.0.0.1:8080")])
    top.add_argument("--once", action="store_true")
    # --kube: find the relays through the Kubernetes API instead of URLs (see relay/top_kube.py)
    top.add_argument(
        "--kube", action="store_true", help="discover the fleet's relays through the Kubernetes API"
    )
    top.add_argument("--namespace", help="with --kube: the fleet's namespace (default: the kubeconfig's)")
    top.add_argument("--fleet", help="with --kube: only this fleet (default: every fleet in the namespace)")
    top.add_argument(
        "--kubeconfig", default=_env("KUBECONFIG"), help="with --kube: kubeconfig (env KUBECONFIG)"
    )
    top.add_argument(
        "--direct", action="store_true", help="with --kube: read pod IPs directly, not via the API proxy"
    )
    return parser


# Subcommands with a parser of their own get their arguments untouched.
_PASSTHROUGH = {
    "bench": ("relay.bench", "main"),
    "plan": ("spark_jobs.planning", "plan_main"),
    "backup": ("relay.backup", "backup_main"),
    "restore": ("relay.backup", "restore_main"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        import importlib

        module, func = _PASSTHROUGH[argv[0]]
        entry = getattr(importlib.import_module(module), func)
        return int(entry(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _dispatch(args)
    except ShardMapError as exc:
        print(f"relayfleet: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "relay":
        return _relay(args)
    if cmd == "dev":
        from relay.dev import run_dev

        return run_dev(port=args.port, shards=args.shards, demo=not args.no_demo, auth=args.auth)
    if cmd == "keygen":
        from relay.api.auth import keypair
        from relay.api.params import b64encode

        public, private = keypair()
        print(json.dumps({"public": b64encode(public), "private": b64encode(private)}))
        return 0
    if cmd == "migrate":
        from relay.fleet.migration import migrate_main

        return migrate_main(args.shard_map, args.slots, args.to)
    if cmd == "operator":
        try:
            from relayfleet_operator.main import run
        except ImportError as exc:
            print(
                f"relayfleet: the operator needs the [operator] extra ({exc.name} missing)", file=sys.stderr
            )
            return 1
        return run(args.namespace, args.all_namespaces)
    if cmd == "top":
        from relay.top import top_main

        if not args.kube:
            return int(top_main(args.urls, once=args.once))
        from relay.top_kube import KubeDiscoveryError, KubeRelays, default_namespace

        try:
            ns = args.namespace or default_namespace(args.kubeconfig)
            relays = KubeRelays(ns, args.fleet, direct=args.direct, kubeconfig=args.kubeconfig)
            return int(top_main([], once=args.once, source=relays))
        except KubeDiscoveryError as exc:
            print(f"relayfleet top: {exc}", file=sys.stderr)
            return 1
    raise AssertionError(cmd)


def _relay(args: argparse.Namespace) -> int:
    from relay.app import serve
    from relay.fleet import routing
    from relay.settings import Settings, enqueue_tokens_from_env, env_int, env_secret, limits_from_env

    if args.redis_url:
        shard_map = routing.single_shard_map(args.redis_url, os.environ.get("RELAY_FLEET", "default"))
        source = None
    elif args.shard_map:
        try:
            shard_map = routing.load_file(args.shard_map)
        except OSError as exc:
            print(f"relayfleet: cannot read shard map {args.shard_map}: {exc.strerror}", file=sys.stderr)
            return 2
        source = routing.file_source(args.shard_map)
    elif args.shard_map_configmap:
        from relay.fleet.configmap import configmap_source

        namespace, _, name = args.shard_map_configmap.partition("/")
        if not namespace or not name:
            print("relayfleet: --shard-map-configmap must be NAMESPACE/NAME", file=sys.stderr)
            return 2
        source = configmap_source(namespace, name)
        first = asyncio.run(source())
        if first is None:
            print(f"relayfleet: ConfigMap {args.shard_map_configmap} holds no shard map", file=sys.stderr)
            return 1
        shard_map = first
    else:
        print(
            "relayfleet: one of --redis-url, --shard-map or --shard-map-configmap is required",
            file=sys.stderr,
        )
        return 2
    tokens = enqueue_tokens_from_env()
    settings = Settings(
        host=args.host,
        port=args.port,
        auth=args.auth,
        enqueue_tokens=tokens,
        max_payload=env_int("RELAY_MAX_PAYLOAD", 5_242_880),
        limits=limits_from_env(),
        max_waiters=env_int("RELAY_MAX_WAITERS", 20_000),
        push_webhook=env_secret("RELAY_PUSH_WEBHOOK"),
        didcomm_seed_file=args.didcomm_seed_file,
        public_url=args.public_url,
    )
    _run(serve(settings, shard_map, source, drain_delay_s=env_int("RELAY_SHUTDOWN_DELAY_SECONDS", 0)))
    return 0


def _run(coro: object) -> None:
    import uvloop

    uvloop.run(coro)  # type: ignore[arg-type]
