"""A dynamic host-path volume provisioner for `make cluster`'s single node (docs/e2e.md).

    python -m relayfleet_testing.hostpath_provisioner --kubeconfig FILE --root DIR \\
        [--provisioner relayfleet.dev/hostpath] [--interval 1]

For every Pending PersistentVolumeClaim of a StorageClass whose provisioner is ours, it makes a
directory under --root and a PersistentVolume of the claim's size and access modes bound to that
claim (claimRef), so a StatefulSet's claims bind with no one creating volumes. The directory is
mode 0777: a hostPath volume ignores fsGroup, and any uid must be able to write it. When a volume
it made is Released (its claim deleted) under reclaimPolicy Delete, it removes the directory and
the volume. It runs on the node itself (hack/cluster.sh starts it): one node, so a hostPath is
the volume, and it needs no image. It polls (one list of each kind per --interval): a few
claims, a single node.

Environment: none; everything is a flag.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from relay import kubeapi

PROVISIONER = "relayfleet.dev/hostpath"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
log = logging.getLogger("hostpath-provisioner")

Obj = Mapping[str, Any]


def _get(obj: Obj, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)  # type: ignore[assignment]
    return obj


def our_classes(classes: Iterable[Obj], provisioner: str) -> dict[str, Obj]:
    """StorageClasses (by name) whose provisioner is this one."""
    return {_get(c, "metadata", "name"): c for c in classes if c.get("provisioner") == provisioner}


def volume_name(claim: Obj) -> str:
    return f"pvc-{_get(claim, 'metadata', 'uid')}"


def claims_to_provision(
    claims: Iterable[Obj], classes: Mapping[str, Obj], volumes: Iterable[Obj]
) -> list[Obj]:
    """Pending claims of our classes that have no volume yet (and ask for a filesystem)."""
    existing = {_get(v, "metadata", "name") for v in volumes}
    return [
        c
        for c in claims
        if _get(c, "status", "phase") == "Pending"
        and _get(c, "spec", "storageClassName") in classes
        and not _get(c, "spec", "volumeName")
        and (_get(c, "spec", "volumeMode") or "Filesystem") == "Filesystem"
        and volume_name(c) not in existing
    ]


def volume_for(claim: Obj, storage_class: Obj, path: Path, provisioner: str) -> dict[str, Any]:
    """The PersistentVolume for `claim`, bound to it, on the host directory `path`."""
    meta = claim["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume_name(claim), "annotations": {PROVISIONED_BY: provisioner}},
        "spec": {
            "capacity": {"storage": _get(claim, "spec", "resources", "requests", "storage")},
            "accessModes": list(_get(claim, "spec", "accessModes") or ["ReadWriteOnce"]),
            "persistentVolumeReclaimPolicy": storage_class.get("reclaimPolicy") or "Delete",
            "storageClassName": meta_name(storage_class),
            "volumeMode": "Filesystem",
            "hostPath": {"path": str(path), "type": "Directory"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


def meta_name(obj: Obj) -> str:
    return str(_get(obj, "metadata", "name"))


def volumes_to_delete(volumes: Iterable[Obj], provisioner: str) -> list[Obj]:
    """Our volumes whose claim is gone (Released, or Failed) under reclaimPolicy Delete."""
    return [
        v
        for v in volumes
        if _get(v, "metadata", "annotations", PROVISIONED_BY) == provisioner
        and _get(v, "spec", "persistentVolumeReclaimPolicy") == "Delete"
        and _get(v, "status", "phase") in ("Released", "Failed")
    ]


class Provisioner:
    """One reconcile pass per `run_once`: create the missing volumes, delete the released ones."""

    def __init__(self, api: client.ApiClient, root: Path, provisioner: str = PROVISIONER) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.storage = client.StorageV1Api(api)
        self.root = root.resolve()
        self.provisioner = provisioner

    def _plain(self, items: Any) -> list[Obj]:
        return [self.api.sanitize_for_serialization(i) for i in items]  # type: ignore[no-untyped-call]

    def run_once(self) -> None:
        classes = our_classes(self._plain(self.storage.list_storage_class().items), self.provisioner)
        volumes = self._plain(self.core.list_persistent_volume().items)
        if classes:
            claims = self._plain(self.core.list_persistent_volume_claim_for_all_namespaces().items)
            for claim in claims_to_provision(claims, classes, volumes):
                self._provision(claim, classes[_get(claim, "spec", "storageClassName")])
        for volume in volumes_to_delete(volumes, self.provisioner):
            self._delete(volume)

    def _provision(self, claim: Obj, storage_class: Obj) -> None:
        name = volume_name(claim)
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o777)  # not subject to the umask; hostPath ignores fsGroup
        body: Any = volume_for(claim, storage_class, path, self.provisioner)  # sent as it is
        try:
            self.core.create_persistent_volume(body)
        except ApiException as e:
            if e.status != 409:  # 409: made by an earlier pass
                raise
        meta = claim["metadata"]
        log.info("provisioned %s for %s/%s", name, meta["namespace"], meta["name"])

    def _delete(self, volume: Obj) -> None:
        name = meta_name(volume)
        path = Path(str(_get(volume, "spec", "hostPath", "path") or ""))
        if path.parent == self.root:  # never remove anything this provisioner did not make
            shutil.rmtree(path, ignore_errors=True)
        try:
            self.core.delete_persistent_volume(name)
        except ApiException as e:
            if e.status != 404:
                raise
        log.info("deleted %s (%s)", name, _get(volume, "status", "phase"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.hostpath_provisioner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--root", type=Path, required=True, help="where the volume directories go")
    parser.add_argument("--provisioner", default=PROVISIONER, help="the StorageClasses' provisioner")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.root.mkdir(parents=True, exist_ok=True)
    api = kubeapi.api_client(args.kubeconfig)  # the project's one client setup: retries on transient errors
    provisioner = Provisioner(api, args.root, args.provisioner)
    log.info("serving StorageClasses of %s; volumes under %s", args.provisioner, args.root)
    while True:
        try:
            provisioner.run_once()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            # the API server restarting, a full disk: the next pass tries again
            log.warning("pass failed: %s %s", type(e).__name__, getattr(e, "status", ""))
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
