"""Process entry: `relayfleet operator [--namespace NS | --all-namespaces]`, or
`python -m relayfleet_operator` with the same flags.

Uses RELAYFLEET_OPERATOR_KUBECONFIG or KUBECONFIG when set, else the pod's service account,
else ~/.kube/config (relay/kubeapi.py).
The environment is read once, by OperatorSettings.from_env() (config.py), before anything
starts; `--help` lists every variable with its default.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from pathlib import Path

from relay.envconfig import ConfigError, EnvHelpParser, resolve_flags
from relayfleet_operator.config import OperatorSettings, add_arguments, configure_logging, env_help

OPERATOR_EXTRA = frozenset({"kopf", "kubernetes", "yaml"})  # pyproject's [operator] extra
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace(kubeconfig: str | None = None) -> str:
    """The pod's own namespace in a cluster, else the kubeconfig context's, else 'default'."""
    if IN_CLUSTER_NAMESPACE.exists():
        return IN_CLUSTER_NAMESPACE.read_text().strip()
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        namespace = (context or {}).get("context", {}).get("namespace")
        if isinstance(namespace, str) and namespace:
            return namespace
    except Exception:  # no kubeconfig at all is fine here
        pass
    return "default"


def run(namespace: str | None, all_namespaces: bool, settings: OperatorSettings | None = None) -> int:
    """Run the operator until SIGINT/SIGTERM. 0 on a clean stop, 1 on failure, 2 on bad input.
    Without `settings`, they are read from the environment here."""
    if settings is None:
        try:
            settings = OperatorSettings.from_env()
        except ConfigError as exc:
            print(f"relayfleet operator: {exc}", file=sys.stderr)
            return 2
    configure_logging(settings)
    if namespace and all_namespaces:
        print("relayfleet operator: --namespace and --all-namespaces are exclusive", file=sys.stderr)
        return 2
    try:
        import kopf

        from relayfleet_operator import handlers, metrics
    except ImportError as exc:
        if exc.name not in OPERATOR_EXTRA:
            raise  # a broken install of our own modules is a bug, not a missing extra
        print(
            f"relayfleet operator: the operator needs the [operator] extra ({exc.name} missing)",
            file=sys.stderr,
        )
        return 1
    from relayfleet_operator.kube import Kube, KubeConfigError

    try:
        # Checked here, once, so a missing configuration is one clear line, not a retry loop.
        kube = asyncio.run(Kube.from_config(settings.kubeconfig))
    except KubeConfigError as exc:
        print(f"relayfleet operator: {exc}", file=sys.stderr)
        return 2  # a configuration error (docs/api.md, "Command line")
    crds_dir = settings.crds_dir
    if crds_dir:
        from relayfleet_operator.crds import CRDError, install_from_dir
        from relayfleet_operator.kube import KubeError

        try:
            install_from_dir(kube, crds_dir)
        except (CRDError, KubeError, OSError, ValueError) as exc:  # yaml errors are ValueErrors
            print(f"relayfleet operator: applying the CRDs from {crds_dir} failed: {exc}", file=sys.stderr)
            return 1
    watched = None if all_namespaces else namespace or default_namespace(settings.kubeconfig)
    scope = "all namespaces" if watched is None else f"namespace {watched}"
    logging.getLogger("relayfleet.operator").info("relayfleet operator watching %s", scope)
    try:
        if settings.metrics_port:
            metrics.serve(settings.metrics_port)
        # kopf's default registry: it already holds kopf's own login handlers (kubeconfig,
        # in-cluster); a fresh registry would start without credentials
        registry = kopf.get_default_registry()
        handlers.register(registry, settings)
        kopf.run(
            registry=registry,
            clusterwide=all_namespaces,
            namespaces=() if watched is None else [watched],
            standalone=True,  # one replica (Recreate): no peering objects needed
            liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz",
            memo=kopf.Memo(kube=kube, settings=settings),
        )
    except OSError as exc:
        print(f"relayfleet operator: operator failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # one line for the user, not a traceback
        print(f"relayfleet operator: operator failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m relayfleet_operator` (same flags as `relayfleet operator`)."""
    parser = EnvHelpParser(
        prog="relayfleet-operator",
        description="The relayfleet Kubernetes operator (RelayShard, RelayRebalance).",
        epilog=env_help(),
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        resolve_flags(args)
        settings = OperatorSettings.from_env()
    except ConfigError as exc:
        print(f"relayfleet operator: {exc}", file=sys.stderr)
        return 2
    namespace = args.namespace or (None if args.all_namespaces else settings.namespace)
    settings = dataclasses.replace(settings, namespace=namespace, log_level=args.log_level)
    return run(namespace, args.all_namespaces, settings)
