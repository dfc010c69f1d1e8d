"""The Kubernetes API client of the project: the `kubernetes` package, configured here once.

Its blocking client serves the relay's shard-map ConfigMap (relay/fleet/configmap.py),
`relayfleet top --kube`, the Spark jobs (spark_jobs/shard_io.py) and the tests; its asyncio
client (`kubernetes.aio`, the same package) serves the operator (relayfleet_operator/kube.py).
docs/design-decisions.md says why this one. What this module adds to it:

- where the cluster is: an explicit kubeconfig, else the pod's service account, else
  $KUBECONFIG or ~/.kube/config (as kubectl);
- retries with backoff on transient errors — 429 (waiting Retry-After, at most
  `MAX_RETRY_AFTER_S`), 500/502/503/504 and connection errors — for every verb, by the
  project's policy `relay.retrying.KUBE_API`: the blocking client through urllib3's Retry
  (configured from it), the asyncio one through `retrying` (its own retry covers only
  idempotent verbs; our writes are server-side apply, merge patches, replaces carrying a
  resourceVersion and creates whose repeat answers 409);
- lists read page by page (`limit` / `continue`): `list_all`.

The package comes with the [operator] extra; `load_configuration` says so when it is missing.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from relay import retrying as policies
from relay.retrying import KUBE_API
from relay.settings import KUBECONFIG

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 30  # a server asking for longer gets this (the caller's own retry takes over)
PAGE = 500  # objects per list request


class KubeConfigError(RuntimeError):
    """No usable Kubernetes configuration (or the kubernetes package is missing)."""


class KubernetesMissing(KubeConfigError):
    """The kubernetes package is not installed (the [operator] extra)."""


def _kubernetes() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise KubernetesMissing(
            "talking to Kubernetes needs the kubernetes package: pip install 'relayfleet[operator]'"
        ) from None
    return kubernetes


def _unusable(exc: Exception) -> KubeConfigError:
    return KubeConfigError(f"no usable Kubernetes configuration (kubeconfig or in-cluster): {exc}")


def _kubeconfig(path: str | None) -> str:
    """The kubeconfig to load: `path`, else $KUBECONFIG (read now: the client's own default is
    fixed when it is imported), else ~/.kube/config; KubeConfigError when no such file exists
    (said here, in one line, rather than by the loader's log warning and its vaguer error)."""
    chosen = path or KUBECONFIG.read() or "~/.kube/config"
    if not any(os.path.exists(os.path.expanduser(p)) for p in chosen.split(os.pathsep) if p):
        raise KubeConfigError(f"no usable Kubernetes configuration (not in a pod, no kubeconfig at {chosen})")
    return chosen


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def load_configuration(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A `kubernetes.client.Configuration` with the retries above (see the module doc)."""
    from urllib3.util.retry import Retry

    k8s = _kubernetes()
    cfg = k8s.client.Configuration()
    try:
        if kubeconfig is None and _in_cluster():
            k8s.config.load_incluster_config(client_configuration=cfg)
        else:
            k8s.config.load_kube_config(
                config_file=_kubeconfig(kubeconfig),
                context=context,
                client_configuration=cfg,
                persist_config=False,
            )
    except (k8s.config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise _unusable(exc) from None
    assert KUBE_API.attempts is not None
    assert KUBE_API.factor == 2.0  # what urllib3's backoff does
    cfg.retries = Retry(
        total=KUBE_API.attempts - 1,
        allowed_methods=None,  # every verb (see the module doc)
        status_forcelist=RETRY_STATUSES,
        backoff_factor=KUBE_API.first_s,
        backoff_max=KUBE_API.cap_s,
        backoff_jitter=KUBE_API.jitter_s,
        respect_retry_after_header=True,
        retry_after_max=MAX_RETRY_AFTER_S,
        raise_on_status=False,  # the last answer becomes the ApiException
    )
    return cfg


def api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A blocking `kubernetes.client.ApiClient` configured by `load_configuration`."""
    return _kubernetes().client.ApiClient(load_configuration(kubeconfig, context))


async def load_aio_configuration(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A `kubernetes.aio.client.Configuration` for the same cluster; its calls are retried by
    `retrying`, not by the client (whose retry leaves out POST and PATCH)."""
    k8s = _kubernetes()
    from kubernetes import aio

    cfg = aio.client.Configuration()
    try:
        if kubeconfig is None and _in_cluster():
            aio.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            await aio.config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=_kubeconfig(kubeconfig),
                context=context,
                client_configuration=cfg,
                persist_config=False,
            )
    except (aio.config.ConfigException, k8s.config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise _unusable(exc) from None
    return cfg


T = TypeVar("T")


def transient(exc: BaseException) -> tuple[bool, str | None]:
    """Whether `exc` (from the asyncio client) is worth a retry, and the Retry-After it carried."""
    import aiohttp
    from kubernetes.aio.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        if exc.status not in RETRY_STATUSES:
            return False, None
        headers = exc.headers or {}
        return True, headers.get("Retry-After")
    # a request past its whole timeout is not repeated (the caller has waited long enough)
    return isinstance(exc, aiohttp.ClientConnectionError), None


def _wait_s(exc: BaseException, retry: int) -> float:
    """The server's Retry-After when it gave one (at most MAX_RETRY_AFTER_S), else the policy's."""
    retry_after = transient(exc)[1]
    if retry_after is not None and retry_after.strip().isdigit():
        return float(min(int(retry_after), MAX_RETRY_AFTER_S))
    return KUBE_API.wait_s(retry)


async def retrying(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, repeated on transient errors (see `transient`) by the KUBE_API policy."""
    result: T = await policies.retrying(KUBE_API, lambda exc: transient(exc)[0], wait=_wait_s)(call)
    return result


def list_all(list_call: Callable[..., Any], *args: Any, page: int = PAGE, **kwargs: Any) -> list[Any]:
    """Every item a list call returns, read `page` objects per request: a typed one (e.g.
    CoreV1Api.list_namespaced_config_map: models) or CustomObjectsApi's (dicts)."""
    items: list[Any] = []
    token: str | None = None
    while True:
        result = list_call(*args, limit=page, _continue=token, **kwargs)
        if isinstance(result, dict):
            items.extend(result.get("items") or ())
            token = (result.get("metadata") or {}).get("continue")
        else:
            items.extend(result.items or ())
            token = result.metadata._continue if result.metadata is not None else None
        if not token:
            return items
