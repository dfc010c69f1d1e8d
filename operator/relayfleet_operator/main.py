"""Process entry: `relayfleet operator [--namespace NS | --all-namespaces]`.

Uses KUBECONFIG (or ~/.kube/config) when present, else the in-cluster service account.
Environment:
  RELAYFLEET_OPERATOR_HEALTH_PORT   kopf liveness endpoint (default 8080, path /healthz)
  RELAYFLEET_OPERATOR_METRICS_PORT  Prometheus /metrics (default 9090; 0 disables)
  RELAYFLEET_OPERATOR_RESYNC_SECONDS     re-apply period of every RelayShard (drift correction; 30)
  RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS  step period of every RelayRebalance (2)
  RELAYFLEET_OPERATOR_RETRY_SECONDS      wait before retrying a failed or blocked step (15)
  RELAYFLEET_OPERATOR_CRDS_DIR           apply the CRD files there at start (guarded; see crds.py)
  RELAY_LOG_LEVEL                        DEBUG, INFO (default), WARNING, ERROR
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from relay.settings import env_value

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _port(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"{name} must be a port number, got {raw!r}")
    return int(raw)


def default_namespace() -> str:
    """The pod's own namespace in a cluster, else the kubeconfig context's, else 'default'."""
    if IN_CLUSTER_NAMESPACE.exists():
        return IN_CLUSTER_NAMESPACE.read_text().strip()
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()  # type: ignore[no-untyped-call]
        namespace = (context or {}).get("context", {}).get("namespace")
        if isinstance(namespace, str) and namespace:
            return namespace
    except Exception:  # no kubeconfig at all is fine here
        pass
    return "default"


def run(namespace: str | None, all_namespaces: bool) -> int:
    """Run the operator until SIGINT/SIGTERM. 0 on a clean stop, 1 on failure, 2 on bad input."""
    level = os.environ.get("RELAY_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if level != "DEBUG":
        # kopf logs every successful handler and timer tick at INFO: periodic noise.
        for noisy in ("kopf.objects", "kopf.activities.probe", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if namespace and all_namespaces:
        print("relayfleet: --namespace and --all-namespaces are exclusive", file=sys.stderr)
        return 2
    try:
        health_port = _port("RELAYFLEET_OPERATOR_HEALTH_PORT", 8080)
        metrics_port = _port("RELAYFLEET_OPERATOR_METRICS_PORT", 9090)
    except ValueError as exc:
        print(f"relayfleet: {exc}", file=sys.stderr)
        return 2
    try:
        import kopf

        from relayfleet_operator import handlers, metrics
    except ImportError as exc:
        print(f"relayfleet: the operator needs the [operator] extra ({exc.name} missing)", file=sys.stderr)
        return 1
    assert handlers  # imported for its registrations
    from relayfleet_operator.kube import Kube

    try:
        # Checked here, once, so a missing configuration is one clear line, not a retry loop.
        kube = Kube.from_config(os.environ.get("RELAYFLEET_OPERATOR_KUBECONFIG"))
    except Exception as exc:  # kubernetes raises several unrelated types here
        print(
            f"relayfleet: no usable Kubernetes configuration (KUBECONFIG or in-cluster): {exc}",
            file=sys.stderr,
        )
        return 1
    crds_dir = os.environ.get("RELAYFLEET_OPERATOR_CRDS_DIR")
    if crds_dir:
        from relayfleet_operator.crds import CRDError, install_from_dir
        from relayfleet_operator.kube import KubeError

        try:
            install_from_dir(kube, Path(crds_dir))
        except (CRDError, KubeError, OSError, ValueError) as exc:  # yaml errors are ValueErrors
            print(f"relayfleet: applying the CRDs from {crds_dir} failed: {exc}", file=sys.stderr)
            return 1
    scope = "all namespaces" if all_namespaces else f"namespace {namespace or default_namespace()}"
    logging.getLogger("relayfleet.operator").info("relayfleet operator watching %s", scope)
    try:
        if metrics_port:
            metrics.serve(metrics_port)
        kopf.run(
            clusterwide=all_namespaces,
            namespaces=() if all_namespaces else [namespace or default_namespace()],
            standalone=True,  # one replica (Recreate): no peering objects needed
            liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz",
            memo=kopf.Memo(kube=kube),
        )
    except OSError as exc:
        print(f"relayfleet: operator failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # one line for the user, not a traceback
        print(f"relayfleet: operator failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m relayfleet_operator` (same flags as `relayfleet operator`)."""
    parser = argparse.ArgumentParser(prog="relayfleet-operator")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        default=env_value("RELAYFLEET_OPERATOR_NAMESPACE"),  # RELAY_OPERATOR_NAMESPACE: deprecated
        help="watch this namespace only [env RELAYFLEET_OPERATOR_NAMESPACE; default none]",
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    args = parser.parse_args(argv)
    return run(args.namespace, args.all_namespaces)
