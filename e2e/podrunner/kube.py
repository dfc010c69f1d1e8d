"""Raw JSON calls to the API server through the kubernetes client's configured transport."""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from kubernetes.client import ApiClient

from relay import kubeapi
from relay.fleet.contract import Obj

log = logging.getLogger("e2e.podrunner")


def now() -> str:
    """A Kubernetes timestamp (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class Api:
    """Raw JSON calls through the kubernetes client's configured transport."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig
        # the project's one client setup (relay/kubeapi.py): retries on transient errors
        self.client: ApiClient = kubeapi.api_client(kubeconfig)

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        # param_serialize adds the host and the bearer token; client certificates live in the pool.
        params = self.client.param_serialize(
            method,
            path,
            header_params={"Content-Type": ctype, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.client.call_api(*params, _request_timeout=30)
        resp.read()  # type: ignore[no-untyped-call]
        data: bytes = resp.data or b""
        if not 200 <= resp.status < 300:
            raise ApiError(resp.status, f"{method} {path}: {resp.status} {data[:300]!r}")
        return json.loads(data) if data else None

    def try_call(self, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
        try:
            return self.call(method, path, body, ctype)
        except Exception as exc:  # the API error types vary; the runner just retries next loop
            status = getattr(exc, "status", None)
            log.debug("%s %s failed: %s", method, path, status or exc)
            return None

    def merge_patch(self, path: str, body: Obj) -> Any:
        return self.try_call("PATCH", path, body, "application/merge-patch+json")
