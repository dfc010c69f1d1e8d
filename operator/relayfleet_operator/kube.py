"""The operator's Kubernetes calls: get, list, server-side apply, create, replace, patch, delete.

kopf watches and patches the custom resources through its own client; this one serves the
handlers' reads and writes of child objects. It is the `kubernetes` package's asyncio client
(`kubernetes.aio`), configured by relay/kubeapi.py (the one Kubernetes client of the project:
kubeconfig or in-cluster, retries with backoff on 429/5xx/connection errors, lists page by
page). Kinds are resolved by the API server's discovery (its dynamic client), so any kind the
server serves, CRDs included, needs no table here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from relay import kubeapi
from relay.fleet.contract import Obj
from relay.kubeapi import KubeConfigError
from relayfleet_operator.builders import MANAGER

_TIMEOUT_S = 30.0  # per request (the client's default is 5 minutes)

__all__ = ["Conflict", "Kube", "KubeConfigError", "KubeError", "NotFound"]


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


class Kube:
    """One cluster's API. The HTTP session belongs to the event loop of the first call after
    construction or `close` (the operator installs CRDs in one loop, then runs kopf's)."""

    def __init__(self, configuration: Any, page: int = kubeapi.PAGE) -> None:
        self._configuration = configuration
        self._page = page
        self._api: Any = None  # kubernetes.aio.client.ApiClient
        self._dynamic: Any = None  # kubernetes.aio.dynamic.DynamicClient over it

    @classmethod
    async def from_config(cls, kubeconfig: str | None = None, context: str | None = None) -> Kube:
        """The given kubeconfig file (OperatorSettings.kubeconfig: RELAYFLEET_OPERATOR_KUBECONFIG
        or KUBECONFIG), else the in-cluster service account, else ~/.kube/config;
        kubeapi.KubeConfigError when none is usable."""
        return cls(await kubeapi.load_aio_configuration(kubeconfig, context))

    async def close(self) -> None:
        api, self._api, self._dynamic = self._api, None, None
        if api is not None:
            await api.close()

    async def _client(self) -> Any:
        if self._dynamic is None:
            from kubernetes.aio import client, dynamic

            api = client.ApiClient(self._configuration)
            try:  # discovery's first requests: /version, /api, /apis
                self._dynamic = await dynamic.DynamicClient(api)  # type: ignore[no-untyped-call]
            except BaseException:
                await api.close()  # type: ignore[no-untyped-call]
                raise
            self._api = api
        return self._dynamic

    async def _call(
        self, api_version: str, kind: str, verb: str, subresource: str | None = None, **params: Any
    ) -> Obj:
        """The dynamic client's `verb` (get, create, replace, patch, server_side_apply, delete)
        on the kind's resource (or its `subresource`), with retries; API errors become KubeError."""
        from kubernetes.aio.client.exceptions import ApiException
        from kubernetes.aio.dynamic.exceptions import ResourceNotFoundError

        async def attempt() -> Obj:
            dyn = await self._client()
            resource = await dyn.resources.get(api_version=api_version, kind=kind)
            if subresource is not None:
                resource = resource.subresources[subresource]
            # The answer as json.loads gives it: the client's default wraps every answer in
            # ResourceInstance (a ResourceField per mapping) that _dict turned back into dicts,
            # three copies of each answer at once (docs/design-decisions.md, "Operator memory:
            # what a waiting reconcile holds").
            call = getattr(dyn, verb)
            return _dict(await call(resource, _request_timeout=_TIMEOUT_S, serializer=_as_is, **params))

        try:
            return await kubeapi.retrying(attempt)
        except ResourceNotFoundError:
            raise NotFound(404, "NotFound", f"the server serves no {kind} in {api_version}") from None
        except ApiException as exc:
            raise _error(exc.status or 0, exc.body or exc.reason or "") from None

    # --- verbs ----------------------------------------------------------------------

    async def version(self) -> Obj:
        """The server's /version (the liveness probe: the API answers our own client too)."""

        async def attempt() -> Obj:
            dyn = await self._client()
            return _dict(await dyn.request("get", "/version", serializer=_as_is, _request_timeout=_TIMEOUT_S))

        return await kubeapi.retrying(attempt)

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return await self._call(api_version, kind, "get", name=name, namespace=namespace)
        except NotFound:
            return None

    async def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[Obj]:
        """Every object of the kind (in `namespace`), read `page` objects per request."""
        items: list[Obj] = []
        token: str | None = None
        while True:
            page = await self._call(
                api_version,
                kind,
                "get",
                namespace=namespace,
                label_selector=label_selector,
                limit=self._page,
                _continue=token,
            )
            for item in page.get("items") or ():
                # a list's items carry no apiVersion and kind of their own; callers expect them
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
                items.append(item)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    async def apply(self, obj: Mapping[str, Any], force: bool = True) -> Obj:
        """Server-side apply as the operator's field manager: fields we own are reset to the
        desired values (drift corrected), fields others own are left alone."""
        meta = obj.get("metadata") or {}
        return await self._call(
            obj["apiVersion"],
            obj["kind"],
            "server_side_apply",
            body=dict(obj),
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=MANAGER,
            force_conflicts=force,
        )

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        """Conflict (409 AlreadyExists) also when a create whose answer was lost is retried."""
        meta = obj.get("metadata") or {}
        return await self._call(
            obj["apiVersion"],
            obj["kind"],
            "create",
            body=dict(obj),
            namespace=meta.get("namespace"),
            field_manager=MANAGER,
        )

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT with the object's resourceVersion: Conflict if someone wrote in between."""
        meta = obj.get("metadata") or {}
        return await self._call(
            obj["apiVersion"],
            obj["kind"],
            "replace",
            body=dict(obj),
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=MANAGER,
        )

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> Obj:
        return await self._call(
            api_version,
            kind,
            "patch",
            subresource,
            body=dict(patch),
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
            field_manager=MANAGER,
        )

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            await self._call(api_version, kind, "delete", name=name, namespace=namespace)
        except NotFound:
            return False
        return True


def _as_is(_client: Any, data: Any) -> Any:
    return data


def _dict(value: Any) -> Obj:
    if isinstance(value, dict):
        return value
    data = value.to_dict()
    if not isinstance(data, dict):
        raise TypeError("the API server answered something other than an object")
    return data


def _error(status: int, body: str) -> KubeError:
    reason, message = "", body[:500]
    try:
        doc = json.loads(body)
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
