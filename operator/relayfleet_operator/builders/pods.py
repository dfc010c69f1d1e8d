"""Pod-spec pieces the workloads share: security contexts, resources, volumes and their
mounts, storage claims. Each returns a fresh dict, so a builder may extend what it gets."""

from __future__ import annotations

from collections.abc import Mapping

from relay.fleet.contract import Obj
from relayfleet_operator.spec import Resources


def pod_security(uid: int) -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def container_resources(res: Resources) -> Obj:
    return {kind: dict(values) for kind, values in res.items() if values}


def secret_volume(
    name: str,
    secret: str,
    files: Mapping[str, str] | None = None,
    *,
    mode: int | None = None,
    optional: bool = False,
) -> Obj:
    """A Secret as a volume; with `files` (key -> file name) only those keys are mounted."""
    source: Obj = {"secretName": secret}
    if files:
        source["items"] = [{"key": key, "path": path} for key, path in files.items()]
    if mode is not None:
        source["defaultMode"] = mode
    if optional:
        source["optional"] = True
    return {"name": name, "secret": source}


def config_map_volume(name: str, config_map: str, *, mode: int | None = None) -> Obj:
    source: Obj = {"name": config_map}
    if mode is not None:
        source["defaultMode"] = mode
    return {"name": name, "configMap": source}


def scratch_volume(name: str, size: str) -> Obj:
    """A size-capped emptyDir: the root filesystems are read-only."""
    return {"name": name, "emptyDir": {"sizeLimit": size}}


def mount(name: str, path: str, *, read_only: bool = False) -> Obj:
    out: Obj = {"name": name, "mountPath": path}
    if read_only:
        out["readOnly"] = True
    return out


def claim_spec(size: str | int, storage_class: str | None) -> Obj:
    """A ReadWriteOnce claim of `size` (the cluster's default class unless one is named)."""
    spec: Obj = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return spec
