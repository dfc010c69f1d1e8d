"""A pod's volumes as directories: Secrets and ConfigMaps written as files (paths inside them
rewritten) and refreshed, emptyDir as a directory of the pod, claims as a directory of the
runner that outlives the pod, projected service-account tokens from the TokenRequest API, and
a kubeconfig using that token (so the pod's RBAC stays the real one)."""

from __future__ import annotations

import base64
import contextlib
from pathlib import Path

import yaml

from e2e.podrunner.kube import Api
from e2e.podrunner.pods import RunnerError, RunPod
from e2e.podrunner.translate import rewrite_text
from relay.fleet.contract import Obj

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class Volumes:
    def __init__(self, api: Api, namespace: str, workdir: Path) -> None:
        self.api, self.ns, self.workdir = api, namespace, workdir

    def mount(self, pod: RunPod, refresh_only: bool = False) -> None:
        volumes = {v["name"]: v for v in pod.spec.get("volumes") or []}
        container = pod.spec["containers"][0]
        for mount in container.get("volumeMounts") or []:
            vol = volumes.get(mount["name"])
            if vol is None:
                continue
            host = pod.dir / "volumes" / mount["name"]
            if "persistentVolumeClaim" in vol:
                # A claim outlives its pod (a restarted Redis keeps its data).
                host = self.workdir / "pvc" / vol["persistentVolumeClaim"]["claimName"]
            host.mkdir(parents=True, exist_ok=True)
            if mount.get("subPath"):
                host = host / mount["subPath"]
            pod.mounts[mount["mountPath"]] = str(host)
        if pod.spec.get("volumes") is None:
            return
        for vol in pod.spec["volumes"]:
            host = pod.dir / "volumes" / vol["name"]
            if "secret" in vol:
                src = vol["secret"]
                obj = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/secrets/{src['secretName']}")
                data = {k: base64.b64decode(v) for k, v in ((obj or {}).get("data") or {}).items()}
                self.write_items(host, data, src.get("items"), pod)
            elif "configMap" in vol:
                src = vol["configMap"]
                obj = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/configmaps/{src['name']}")
                data = {k: v.encode() for k, v in ((obj or {}).get("data") or {}).items()}
                self.write_items(host, data, src.get("items"), pod)
            elif "projected" in vol and not refresh_only:
                self.project(pod, host, vol["projected"])

    def write_items(self, host: Path, data: dict[str, bytes], items: list[Obj] | None, pod: RunPod) -> None:
        host.mkdir(parents=True, exist_ok=True)
        chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
        for key, rel in chosen.items():
            if key not in data:
                continue
            content = data[key]
            with contextlib.suppress(UnicodeDecodeError):
                content = rewrite_text(content.decode(), pod).encode()
            target = host / rel
            if target.exists() and target.read_bytes() == content:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(content)
            tmp.chmod(0o600)
            tmp.replace(target)

    def project(self, pod: RunPod, host: Path, projected: Obj) -> None:
        host.mkdir(parents=True, exist_ok=True)
        account = pod.spec.get("serviceAccountName") or "default"
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                request = {
                    "apiVersion": "authentication.k8s.io/v1",
                    "kind": "TokenRequest",
                    "spec": {
                        "expirationSeconds": 3600,
                        "boundObjectRef": {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": pod.name,
                            "uid": pod.uid,
                        },
                    },
                }
                got = self.api.try_call(
                    "POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{account}/token", request
                )
                if not got:
                    raise RunnerError(f"no token for service account {account}")
                (host / source["serviceAccountToken"]["path"]).write_text(got["status"]["token"])
            elif "configMap" in source:
                cm = self.api.try_call(
                    "GET", f"/api/v1/namespaces/{self.ns}/configmaps/{source['configMap']['name']}"
                )
                for item in source["configMap"].get("items") or []:
                    value = ((cm or {}).get("data") or {}).get(item["key"])
                    if value is not None:
                        (host / item["path"]).write_text(value)
            elif "downwardAPI" in source:
                for item in source["downwardAPI"].get("items") or []:
                    if item.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                        (host / item["path"]).write_text(self.ns)

    def pod_kubeconfig(self, pod: RunPod) -> str | None:
        """A kubeconfig with the pod's own service-account token: RBAC stays the real one."""
        sa = pod.mounts.get(SA_DIR)
        if sa is None or not (Path(sa) / "token").exists():
            return None
        cfg = self.api.client.configuration
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "c", "cluster": {"server": cfg.host, "certificate-authority": cfg.ssl_ca_cert}}
            ],
            "users": [{"name": "u", "user": {"tokenFile": str(Path(sa) / "token")}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": self.ns}}],
            "current-context": "c",
        }
        path = pod.dir / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return str(path)
