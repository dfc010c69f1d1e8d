"""`relayfleet top --kube`: the fleet's relays found through the Kubernetes API.

The relays are the ready endpoints of each fleet Service the operator made (label
app.kubernetes.io/component=fleet; one per fleet, or only --fleet's), read from its
EndpointSlices before every refresh, so pods that come and go are followed. Each relay's
/metrics is read through the API server's pod proxy (works from a laptop with a kubeconfig;
needs `get` on pods/proxy), or with --direct straight from the pod IP (from inside the
cluster network).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from relay import kubeapi
from relay.top import http_fetch

FLEET_SERVICES = "app.kubernetes.io/managed-by=relayfleet-operator,app.kubernetes.io/component=fleet"
IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_PROXY = "pod/"
_TIMEOUT_S = 2.0


class KubeDiscoveryError(RuntimeError):
    """No usable Kubernetes configuration, or the API refused to list the fleet."""


class KubeConfigError(KubeDiscoveryError):
    """No usable Kubernetes configuration (or client): a configuration error, exit 2."""


def default_namespace(kubeconfig: str | None) -> str:
    """The namespace kubectl would use: the kubeconfig context's, in a pod its own, else default."""
    try:
        from kubernetes import config
    except ImportError:
        raise KubeConfigError(
            "--kube needs the kubernetes package: pip install 'relayfleet[operator]'"
        ) from None
    try:
        _, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        ns = (active or {}).get("context", {}).get("namespace")
        if ns:
            return str(ns)
    except (config.ConfigException, OSError, TypeError, ValueError):
        if os.path.exists(IN_CLUSTER_NAMESPACE):
            with open(IN_CLUSTER_NAMESPACE, encoding="utf-8") as f:
                return f.read().strip() or "default"
    return "default"


@dataclass
class KubeRelays:
    """A RelaySource for relay.top: the relays of one namespace (and fleet), asked anew each time."""

    namespace: str
    fleet: str | None = None
    direct: bool = False
    kubeconfig: str | None = None

    def __post_init__(self) -> None:
        try:
            api = kubeapi.api_client(self.kubeconfig)
        except kubeapi.KubeConfigError as exc:  # no configuration, or no kubernetes package
            raise KubeConfigError(str(exc)) from None
        from kubernetes import client

        self.core: Any = client.CoreV1Api(api)
        self.discovery: Any = client.DiscoveryV1Api(api)

    def services(self) -> list[str]:
        selector = FLEET_SERVICES + (f",relayfleet.dev/fleet={self.fleet}" if self.fleet else "")
        found = self._list(self.core.list_namespaced_service, self.namespace, label_selector=selector)
        return sorted(s.metadata.name for s in found)

    def urls(self) -> list[str]:
        """One URL per ready relay endpoint: pod/<name>:<port> (proxy) or http://<ip>:<port>."""
        out: list[str] = []
        for service in self.services():
            slices = self._list(
                self.discovery.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=f"kubernetes.io/service-name={service}",
            )
            for eps in slices:
                ports = {p.name: p.port for p in eps.ports or () if p.port}
                port = ports.get("http") or next(iter(ports.values()), None)
                if port is None:
                    continue
                for ep in eps.endpoints or ():
                    if ep.conditions is not None and ep.conditions.ready is False:
                        continue
                    ref = ep.target_ref
                    if self.direct or ref is None or ref.kind != "Pod":
                        address = ep.addresses[0]
                        host = f"[{address}]" if ":" in address else address
                        out.append(f"http://{host}:{port}")
                    else:
                        out.append(f"{_PROXY}{ref.name}:{port}")
        return sorted(set(out))

    def fetch(self, url: str) -> str:
        if not url.startswith(_PROXY):
            return http_fetch(url)
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            resp = self.core.connect_get_namespaced_pod_proxy_with_path(
                url[len(_PROXY) :],
                self.namespace,
                "metrics",
                _preload_content=False,
                _request_timeout=_TIMEOUT_S,
            )
            data: bytes = resp.data
        except ApiException as exc:
            raise OSError(f"pod proxy: {exc.status} {exc.reason}") from None
        except HTTPError as exc:
            raise OSError(f"pod proxy: {type(exc).__name__}") from None
        return data.decode("utf-8", "replace")

    def _list(self, method: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Every item of a list call, page by page (kubeapi.list_all)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return kubeapi.list_all(method, *args, _request_timeout=10, **kwargs)
        except ApiException as exc:
            raise KubeDiscoveryError(
                f"listing the fleet in {self.namespace}: {exc.status} {exc.reason}"
            ) from None
        except HTTPError as exc:
            raise KubeDiscoveryError(f"the Kubernetes API is unreachable: {type(exc).__name__}") from None
