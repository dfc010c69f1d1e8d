"""The `relayfleet` command line (docs/api.md). Exit 0 ok, 2 bad arguments, 1 failure."""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib.metadata import EntryPoint, entry_points
from typing import NoReturn

from relay import gc_tuning
from relay import settings as declared
from relay.envconfig import EnvHelpParser, add_flag, epilog, flag_help, resolve_flags
from relay.fleet.sharding import ShardMapError, is_sentinel_url, parse_sentinel_url
from relay.settings import ConfigError, Settings
from relay.storage.connection import RedisURLError


class _Parser(EnvHelpParser):  # every flag: its env and default
    def error(self, message: str) -> NoReturn:
        # one line, exit 2 (the contract), instead of argparse's usage dump; named by the
        # command it is about ("relayfleet migrate: ...")
        self.exit(2, f"{self.prog}: {message}\n")


def _add_relay_args(p: argparse.ArgumentParser) -> None:
    add_flag(p, declared.HOST)
    add_flag(p, declared.PORT)
    src = p.add_mutually_exclusive_group()
    for where in (declared.REDIS_URL, declared.SHARD_MAP, declared.SHARD_MAP_CONFIGMAP):
        add_flag(p, where, to=src)
    for setting in (declared.AUTH, declared.LOG_LEVEL, declared.DIDCOMM_SEED_FILE, declared.PUBLIC_URL):
        add_flag(p, setting)


def _add_map_args(p: argparse.ArgumentParser) -> None:
    """Where the shard map is, as `relay` reads it: a file, or the ConfigMap the relays watch
    (one of them is required)."""
    src = p.add_mutually_exclusive_group()
    add_flag(p, declared.SHARD_MAP, to=src)
    add_flag(p, declared.SHARD_MAP_CONFIGMAP, to=src)


def _configmap_name(value: str) -> tuple[str, str]:
    namespace, _, name = value.partition("/")
    if not namespace or not name or "/" in name:
        raise ConfigError(f"--shard-map-configmap must be NAMESPACE/NAME, got {value!r}")
    return namespace, name


def _log_level(p: argparse.ArgumentParser) -> None:
    add_flag(p, declared.LOG_LEVEL)


def _operator_epilog() -> str:
    # the operator declares its settings (and reads them once, in OperatorSettings.from_env)
    from relayfleet_operator.config import env_help

    return env_help()


def _add_operator_args(p: argparse.ArgumentParser) -> None:
    # the same flags as `python -m relayfleet_operator`, from the operator's declarations
    from relayfleet_operator.config import add_arguments

    add_arguments(p)


def _relay_epilog() -> str:
    return epilog(
        "environment (no flag; read once at start):", declared.RELAY_ENV_ONLY, removed=declared.REMOVED_ENV
    )


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def subcommand_parsers() -> dict[str, EnvHelpParser]:
    """Each built-in subcommand's parser by name, as `build_parser` makes them (for tests)."""
    return _build_parsers()[1]


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, EnvHelpParser]]:
    parser = _Parser(prog="relayfleet", description="Sharded store-and-forward relay for E2EE messaging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_relay_args(sub.add_parser("relay", help="run a relay process", epilog=_relay_epilog()))
    mig = sub.add_parser("migrate", help="move slots to a shard, online")
    _add_map_args(mig)
    mig.add_argument("--slots", required=True, metavar="A-B", help="slot range to move [no env; required]")
    mig.add_argument("--to", required=True, metavar="SHARD", help="target shard [no env; required]")
    _log_level(mig)
    # the relayfleet distribution's own entry point (pyproject.toml), listed where it always was
    sub.add_parser("plan", help=PRODUCT_COMMANDS["plan"])
    sub.add_parser("keygen", help="print a new Ed25519 key pair")
    _add_operator_args(sub.add_parser("operator", help="run the kopf operator", epilog=_operator_epilog()))
    sub.add_parser("backup", help="snapshot a shard's Redis into a backup directory (see backup --help)")
    sub.add_parser("restore", help="restore a shard from a backup, with new epochs (see restore --help)")
    top = sub.add_parser("top", help="live figures of a fleet from its relays' /metrics")
    top.add_argument("urls", nargs="*", help=flag_help(declared.URL, "relay base URLs"))
    top.add_argument("--once", action="store_true", help="print one screen and exit [no env; default off]")
    # --kube: find the relays through the Kubernetes API instead of URLs (see relay/top_kube.py)
    top.add_argument(
        "--kube",
        action="store_true",
        help="find relays via the Kubernetes API [no env; default off]",
    )
    top.add_argument("--namespace", help="with --kube: namespace [no env; default: the kubeconfig's]")
    top.add_argument("--fleet", help="with --kube: only this fleet [no env; default: all]")
    add_flag(top, declared.KUBECONFIG)
    top.add_argument(
        "--direct",
        action="store_true",
        help="with --kube: pod IPs, not the API proxy [no env; default off]",
    )
    # commands of other distributions: listed here, parsed by their own main (see --help there)
    plugins = _plugin_commands()
    for name, text in TOOL_COMMANDS.items():
        sub.add_parser(name, help=text + ("" if name in plugins else f" (needs {TOOLS_DIST})"))
    for name, ep in sorted(plugins.items()):
        if name not in TOOL_COMMANDS and name not in sub.choices:
            sub.add_parser(name, help=f"from {ep.dist.name if ep.dist else ep.value} (see {name} --help)")
    return parser, dict(sub.choices)


# -- commands of other distributions and packages -------------------------------------------------
# An entry point in COMMANDS_GROUP names a `main(argv: list[str]) -> int`; `relayfleet NAME ARGS`
# calls it with ARGS. The relay never imports those packages by name (import-linter contracts
# "tools" and "relay-no-spark"): the benchmarks and the local dev fleet are relayfleet-testing's
# (tools/pyproject.toml), not part of the relayfleet wheel or image; the planner is the Spark
# jobs' (registered by the relayfleet distribution itself, pyproject.toml).
COMMANDS_GROUP = "relayfleet.commands"
TOOLS_DIST = "relayfleet-testing"
# the relayfleet distribution's own commands from other packages, named in --help
PRODUCT_COMMANDS = {
    "plan": "rebalance plan without Spark (JSON; --rebalance-yaml writes a RelayRebalance)",
}
# relayfleet-testing's commands, named in --help (and in the one-line hint) even when absent
TOOL_COMMANDS = {
    "bench": "side-by-side benchmarks: [--quick]",
    "dev": "local Redis shard(s) + relay, with a short demo",
    "demo": "the short demo against a running relay",
}


def _plugin_commands() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _run_plugin(name: str, argv: list[str]) -> int | None:
    """Run the command `name` of another distribution; None when no distribution provides it."""
    ep = _plugin_commands().get(name)
    if ep is None:
        if name in TOOL_COMMANDS:
            print(
                f"relayfleet: `{name}` comes with the tools: pip install {TOOLS_DIST} "
                "(in a checkout: make venv, or pip install -e tools)",
                file=sys.stderr,
            )
            return 2
        if name in PRODUCT_COMMANDS:  # a checkout on sys.path without the installed metadata
            print(
                f"relayfleet: `{name}` is registered by the relayfleet distribution's entry points: "
                "install it (in a checkout: make venv, or pip install -e .)",
                file=sys.stderr,
            )
            return 2
        return None
    command: Callable[[list[str]], int] = ep.load()
    return int(command(argv))


# For those commands' own parsers: the same flag, env and exit-2 rules as the built-in ones.
def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return _Parser(prog=prog, description=description)


env_flag = add_flag
log_level_flag = _log_level


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse `argv`, fill every flag not given from its variable and set up logging, as `main`
    does for the built-in commands; a bad value exits 2 with one line."""
    args = parser.parse_args(argv)
    try:
        resolve_flags(args)
    except ConfigError as exc:
        parser.exit(2, f"relayfleet: {exc}\n")
    _log_setup(args)
    return args


def _log_setup(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=getattr(args, "log_level", None) or "INFO",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# Subcommands with a parser of their own get their arguments untouched. Each is
# imported only when run (plain imports, so mypy and import-linter see them): backup
# needs only Redis.
def _backup(argv: list[str]) -> int:
    from relay.backup.command import backup_main

    return backup_main(argv)


def _restore(argv: list[str]) -> int:
    from relay.backup.command import restore_main

    return restore_main(argv)


_PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {
    "backup": _backup,
    "restore": _restore,
}


_BUILTIN = frozenset({"relay", "migrate", "keygen", "operator", "backup", "restore", "top"})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        return int(_PASSTHROUGH[argv[0]](argv[1:]))
    if argv and argv[0] not in _BUILTIN and not argv[0].startswith("-"):
        code = _run_plugin(argv[0], argv[1:])
        if code is not None:
            return code
    args, extra = build_parser().parse_known_args(argv)
    name = f"relayfleet {args.command}"
    if extra:  # named by the subcommand they were given to, as its own parser's errors are
        print(f"{name}: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    try:
        resolve_flags(args)
    except ConfigError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    _log_setup(args)
    try:
        return _dispatch(args)
    except (ShardMapError, ConfigError, RedisURLError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # a runtime failure: one line, exit 1 (the traceback at DEBUG)
        logging.getLogger("relay.cli").debug("%s failed", name, exc_info=True)
        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "relay":
        return _relay(args)
    if cmd == "keygen":
        from relay.protocol import b64encode, keypair

        public, private = keypair()
        print(json.dumps({"public": b64encode(public), "private": b64encode(private)}))
        return 0
    if cmd == "migrate":
        from relay.fleet.migration.command import file_place, migrate_main

        if args.shard_map_configmap:
            from relay.fleet.configmap import configmap_place

            place = configmap_place(*_configmap_name(args.shard_map_configmap))
        elif args.shard_map:
            place = file_place(args.shard_map)
        else:
            raise ConfigError("one of --shard-map or --shard-map-configmap is required")
        return migrate_main(place, args.slots, args.to)
    if cmd == "operator":
        from relayfleet_operator.config import OperatorSettings
        from relayfleet_operator.main import run

        # read once, before anything starts: a ConfigError is one line, exit 2 (main);
        # the flags, resolved with their variables already, win over what the settings read
        settings = replace(OperatorSettings.from_env(), namespace=args.namespace, log_level=args.log_level)
        return run(args.namespace, args.all_namespaces, settings)
    if cmd == "top":
        from relay.top import top_main

        if not args.kube:
            urls = args.urls or [declared.URL.read()]
            return int(top_main(urls, once=args.once))
        from relay.top_kube import KubeConfigError, KubeDiscoveryError, KubeRelays, default_namespace

        try:
            ns = args.namespace or default_namespace(args.kubeconfig)
            relays = KubeRelays(ns, args.fleet, direct=args.direct, kubeconfig=args.kubeconfig)
            return int(top_main([], once=args.once, source=relays))
        except KubeConfigError as exc:
            print(f"relayfleet top: {exc}", file=sys.stderr)
            return 2
        except KubeDiscoveryError as exc:
            print(f"relayfleet top: {exc}", file=sys.stderr)
            return 1
    raise AssertionError(cmd)


def _relay(args: argparse.Namespace) -> int:
    from relay.app import serve
    from relay.fleet import routing
    from relay.storage.connection import RedisTarget

    if (reason := _cannot_listen(args.host, args.port)) is not None:
        # before connecting to anything: one line, exit 2 (the bind below is the backstop)
        print(f"relayfleet relay: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2
    settings = Settings.from_env(
        host=args.host,
        port=args.port,
        auth=args.auth,
        didcomm_seed_file=args.didcomm_seed_file,
        public_url=args.public_url,
    )
    if args.redis_url:
        # a bad URL or TLS option: exit 2 now, not at connect (a redis+sentinel:// URL names
        # Sentinels, not a node: checked as a shard map entry)
        if is_sentinel_url(args.redis_url):
            parse_sentinel_url(args.redis_url)
        else:
            RedisTarget.from_url(args.redis_url)

    if args.redis_url:
        shard_map = routing.single_shard_map(args.redis_url, settings.fleet)
        source = None
    elif args.shard_map:
        try:
            shard_map = routing.load_file(args.shard_map)
        except OSError as exc:
            print(
                f"relayfleet relay: cannot read shard map {args.shard_map}: {exc.strerror}", file=sys.stderr
            )
            return 2
        source = routing.file_source(args.shard_map)
    elif args.shard_map_configmap:
        from relay.fleet.configmap import configmap_source

        source = configmap_source(*_configmap_name(args.shard_map_configmap))
        first = asyncio.run(source())
        if first is None:
            print(
                f"relayfleet relay: ConfigMap {args.shard_map_configmap} holds no shard map", file=sys.stderr
            )
            return 1
        shard_map = first
    else:
        print(
            "relayfleet relay: one of --redis-url, --shard-map or --shard-map-configmap is required",
            file=sys.stderr,
        )
        return 2
    gc_tuning.tune(settings.gc_young_threshold)  # after the imports above: they are frozen
    try:
        _run(serve(settings, shard_map, source, drain_delay_s=settings.shutdown_delay_s))
    except OSError as exc:
        if exc.errno not in _CANNOT_LISTEN:
            raise
        # a configuration error (port taken, address not ours): one line, exit 2
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        print(f"relayfleet relay: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2
    return 0


_CANNOT_LISTEN = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the relay could not listen on host:port (taken, not an address of this machine),
    or None. Binds the way the server does (SO_REUSEADDR), so a port in TIME_WAIT passes."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return str(exc.strerror)
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno in _CANNOT_LISTEN:
                    return os.strerror(exc.errno) if exc.errno else str(exc)
    return None


def _run(coro: object) -> None:
    import uvloop

    uvloop.run(coro)  # type: ignore[arg-type]
