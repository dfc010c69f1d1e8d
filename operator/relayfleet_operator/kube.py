"""A small async Kubernetes API client: get, list, server-side apply, create, replace, patch.

kopf watches and patches the custom resources through its own client; this one serves the
handlers' writes of child objects. It borrows only configuration loading (kubeconfig or the
in-cluster service account) from the `kubernetes` package and talks HTTP with aiohttp, so
handlers never block the event loop.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from relay.fleet.contract import Obj
from relayfleet_operator.builders import MANAGER

_PLURALS: dict[str, str] = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "Event": "events",
    "Pod": "pods",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "CronJob": "cronjobs",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "RelayShard": "relayshards",
    "RelayRebalance": "relayrebalances",
    "CustomResourceDefinition": "customresourcedefinitions",
}
_CLUSTER_SCOPED = {"CustomResourceDefinition", "Namespace"}


class KubeError(Exception):
    """The API server refused a request; `status` is the HTTP status, `reason` its Status reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    """409: AlreadyExists on create, or a stale resourceVersion on replace."""


def object_path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    try:
        plural = _PLURALS[kind]
    except KeyError:
        raise ValueError(f"kind {kind!r} is unknown to relayfleet_operator.kube") from None
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base if kind in _CLUSTER_SCOPED or namespace is None else f"{base}/namespaces/{namespace}"
    path = f"{path}/{plural}"
    if name:
        path = f"{path}/{name}"
        if subresource:
            path = f"{path}/{subresource}"
    return path


def _obj_path(obj: Mapping[str, Any], subresource: str | None = None) -> str:
    meta = obj.get("metadata") or {}
    return object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)


class Kube:
    def __init__(
        self,
        host: str,
        ssl_context: ssl.SSLContext | bool,
        authorization: Callable[[], str | None] = lambda: None,
        timeout: float = 30.0,
    ) -> None:
        self.host = host.rstrip("/")
        self._ssl = ssl_context
        self._authorization = authorization
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    # --- construction ----------------------------------------------------------------

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, context: str | None = None) -> Kube:
        """The given kubeconfig file (OperatorSettings.kubeconfig: RELAYFLEET_OPERATOR_KUBECONFIG
        or KUBECONFIG), else ~/.kube/config when present, else the in-cluster service account."""
        from kubernetes import client, config  # only configuration loading

        cfg = client.Configuration()
        path = kubeconfig
        default = os.path.expanduser("~/.kube/config")
        if path or os.path.exists(default):
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=path or default, context=context, client_configuration=cfg, persist_config=False
            )
        else:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        ctx: ssl.SSLContext | bool
        if not cfg.verify_ssl:
            ctx = False
        else:
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)

        def authorization() -> str | None:
            token: str | None = cfg.get_api_key_with_prefix("BearerToken")
            return token

        return cls(cfg.host, ctx, authorization)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    # --- transport ------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: object = None,
        content_type: str = "application/json",
    ) -> Obj:
        headers = {"Accept": "application/json"}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        async with self._client().request(
            method, self.host + path, params=params, data=data, headers=headers, ssl=self._ssl
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise _error(resp.status, text)
            if not text:
                return {}
            result = json.loads(text)
            return result if isinstance(result, dict) else {"items": result}

    # --- verbs ----------------------------------------------------------------------

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return await self.request("GET", object_path(api_version, kind, namespace, name))
        except NotFound:
            return None

    async def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", object_path(api_version, kind, namespace), params=params)
        items: list[Obj] = result.get("items") or []
        return items

    async def apply(self, obj: Mapping[str, Any], force: bool = True) -> Obj:
        """Server-side apply as the operator's field manager: fields we own are reset to the
        desired values (drift corrected), fields others own are left alone."""
        params = {"fieldManager": MANAGER, "force": "true" if force else "false"}
        return await self.request(
            "PATCH", _obj_path(obj), params=params, body=obj, content_type="application/apply-patch+yaml"
        )

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj.get("metadata") or {}
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self.request("POST", path, params={"fieldManager": MANAGER}, body=obj)

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT with the object's resourceVersion: Conflict if someone wrote in between."""
        return await self.request("PUT", _obj_path(obj), params={"fieldManager": MANAGER}, body=obj)

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> Obj:
        return await self.request(
            "PATCH",
            object_path(api_version, kind, namespace, name, subresource),
            params={"fieldManager": MANAGER},
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            await self.request("DELETE", object_path(api_version, kind, namespace, name))
        except NotFound:
            return False
        return True


def _error(status: int, text: str) -> KubeError:
    reason, message = "", text[:500]
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            reason = str(doc.get("reason", ""))
            message = str(doc.get("message", message))
    except ValueError:
        pass
    if status == 404:
        return NotFound(status, reason or "NotFound", message)
    if status == 409:
        return Conflict(status, reason or "Conflict", message)
    return KubeError(status, reason, message)
