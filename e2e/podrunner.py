"""TEST-ONLY pod runner: a stand-in kubelet for one fake node of a kwok cluster.

kwok's nodes run no containers. For the end-to-end tests this process registers a node of
its own (not managed by kwok: it keeps the node's Lease and Ready condition itself), and for
every Pod of one namespace bound to that node starts the matching local process:

* ``redis-server ...``        -> /usr/bin/redis-server with the Pod's mounted config
* ``relayfleet ...``          -> the venv's ``relayfleet`` with the Pod's env and args
* ``.../spark-submit ... local:///app/spark_jobs/X.py ARGS`` -> ``python -m spark_jobs.X ARGS
  --master local[2]`` (the driver runs here; no executor pods)

Volumes become directories (Secrets and ConfigMaps written as files and refreshed, emptyDir
and PVCs as temp dirs, the service-account token from the TokenRequest API plus a kubeconfig
using it); paths, ports and 0.0.0.0 in args and env are rewritten to those directories, to a
free loopback port per containerPort, and to 127.0.0.1. Readiness probes run against the
process and are reported through the Pod's status; exits follow restartPolicy. Service names
resolve through a JSON address table (see e2e/podenv/sitecustomize.py) rebuilt from the
Services' selectors and the pods' readiness. Everything above the kubelet is the real control
plane. Never use this outside tests.

    python -m e2e.podrunner --kubeconfig K --namespace NS --node NODE --workdir DIR
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import ApiClient
from kubernetes.config import kube_config

from relay.fleet.contract import Obj

log = logging.getLogger("e2e.podrunner")

ROOT = Path(__file__).resolve().parent.parent
PODENV = Path(__file__).resolve().parent / "podenv"
VENV_BIN = Path(sys.executable).parent
REDIS_SERVER = "/usr/bin/redis-server"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The Spark image holds the repository at /app (charts/relayfleet values spark.appDir).
IMAGE_PATHS = {"/app": str(ROOT)}
LOOP_S = 0.5
PROBE_S = 1.0


# JSON {image: source tree}: pods of those images run that tree's code (the upgrade test runs
# the previous release's operator and relays from a `git archive` of it); others run ROOT's.
TREES_ENV = "RELAYFLEET_PODRUNNER_TREES"


def source_tree(image: str) -> Path:
    trees = json.loads(os.environ.get(TREES_ENV) or "{}")
    return Path(trees[image]) if image in trees else ROOT


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Api:
    """Raw JSON calls through the kubernetes client's configured transport."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig
        self.client: ApiClient = kube_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, persist_config=False
        )

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


@dataclass
class Container:
    proc: subprocess.Popen[bytes] | None
    ports: dict[str, int]  # containerPort (as text) and port name -> host port
    env: dict[str, str]
    cwd: str
    ready: bool = False
    restarts: int = 0
    started_at: str = ""
    exit_code: int | None = None
    last_probe: float = 0.0
    restart_at: float = 0.0
    failures: int = 0


@dataclass
class RunPod:
    uid: str
    name: str
    ip: str
    spec: Obj
    labels: dict[str, str]
    dir: Path
    mounts: dict[str, str] = field(default_factory=dict)  # mountPath -> host dir
    container: Container | None = None
    phase: str = "Pending"
    reported: str = ""
    deleting_since: float = 0.0
    error: str = ""


class Runner:
    def __init__(self, api: Api, namespace: str, node: str, workdir: Path) -> None:
        self.api, self.ns, self.node, self.workdir = api, namespace, node, workdir
        self.pods: dict[str, RunPod] = {}
        self.ip_seq = 0
        self.addresses = workdir / "addresses.json"
        self.addresses_text = ""
        self.last_heartbeat = 0.0
        self.last_refresh = 0.0
        self.last_provision = 0.0
        self.volumes: list[str] = []
        self.stopping = False

    # --- the node ------------------------------------------------------------------------

    def register_node(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {
                    "kubernetes.io/hostname": self.node,
                    "kubernetes.io/os": "linux",
                    "relayfleet.dev/e2e-podrunner": "true",
                },
            },
        }
        self.api.try_call("POST", "/api/v1/nodes", body)
        self.heartbeat(force=True)

    def heartbeat(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_heartbeat < 10:
            return
        self.last_heartbeat = time.monotonic()
        stamp = now()
        capacity = {"cpu": "32", "memory": "128Gi", "pods": "250", "ephemeral-storage": "100Gi"}
        status = {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "nodeInfo": {"kubeletVersion": "relayfleet-e2e-podrunner", "operatingSystem": "linux"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "relayfleet e2e pod runner",
                        "lastHeartbeatTime": stamp,
                        "lastTransitionTime": stamp,
                    }
                ],
            }
        }
        self.api.try_call(
            "PATCH", f"/api/v1/nodes/{self.node}/status", status, "application/strategic-merge-patch+json"
        )
        micro = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.node, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": micro},
        }
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        if self.api.merge_patch(path, {"spec": lease["spec"]}) is None:
            self.api.try_call("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def unregister_node(self) -> None:
        self.api.try_call("DELETE", f"/api/v1/nodes/{self.node}")
        for name in self.volumes:
            self.api.try_call("DELETE", f"/api/v1/persistentvolumes/{name}")

    # --- storage ---------------------------------------------------------------------------

    def provision(self) -> None:
        """A PersistentVolume for every pending claim (the scheduler waits for bound claims);
        the pod sees it as the directory workdir/pvc/<claim>."""
        if time.monotonic() - self.last_provision < 1:
            return
        self.last_provision = time.monotonic()
        claims = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims") or {}
        for claim in claims.get("items") or []:
            name = claim["metadata"]["name"]
            pv = f"{self.ns}-{name}"[:63]
            if (claim.get("status") or {}).get("phase") != "Pending" or pv in self.volumes:
                continue
            spec = claim["spec"]
            volume = {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": pv, "labels": {"relayfleet.dev/e2e-podrunner": self.node}},
                "spec": {
                    "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                    "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": spec.get("storageClassName") or "",
                    "hostPath": {"path": str(self.workdir / "pvc" / name)},
                    "claimRef": {"namespace": self.ns, "name": name, "uid": claim["metadata"]["uid"]},
                },
            }
            if self.api.try_call("POST", "/api/v1/persistentvolumes", volume) is not None:
                self.volumes.append(pv)
                log.info("claim %s: volume %s", name, pv)

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        self.register_node()
        while not self.stopping:
            self.heartbeat()
            listed = self.api.try_call(
                "GET", f"/api/v1/namespaces/{self.ns}/pods?fieldSelector=spec.nodeName%3D{self.node}"
            )
            self.provision()
            if listed is not None:
                self.sync(listed.get("items") or [])
                self.write_addresses()
            time.sleep(LOOP_S)
        for pod in list(self.pods.values()):
            self.kill(pod, grace=5)

    def sync(self, items: list[Obj]) -> None:
        seen = set()
        refresh = time.monotonic() - self.last_refresh > 2
        if refresh:
            self.last_refresh = time.monotonic()
        for item in items:
            meta = item["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            pod = self.pods.get(uid)
            if pod is None:
                if (item.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                pod = self.admit(item)
            if meta.get("deletionTimestamp"):
                # As endpoints would: out of the Service first, then SIGTERM a moment later.
                if pod.deleting_since == 0.0:
                    pod.deleting_since = time.monotonic()
                    if pod.container is not None:
                        pod.container.ready = False
                    self.report(pod)
                    continue
                if time.monotonic() - pod.deleting_since < 1.5:
                    continue
                self.kill(pod, grace=min(int(meta.get("deletionGracePeriodSeconds") or 30), 20))
                self.api.try_call(
                    "DELETE",
                    f"/api/v1/namespaces/{self.ns}/pods/{pod.name}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                )
                continue
            if refresh and pod.container is not None:
                self.mount_volumes(pod, refresh_only=True)
            self.supervise(pod)
            self.report(pod)
        for uid in list(self.pods):
            if uid not in seen:
                self.kill(self.pods.pop(uid), grace=5)

    # --- starting a pod ------------------------------------------------------------------

    def admit(self, item: Obj) -> RunPod:
        meta = item["metadata"]
        self.ip_seq += 1
        ip = f"10.244.{self.ip_seq // 250}.{self.ip_seq % 250 + 2}"
        pod = RunPod(
            uid=meta["uid"],
            name=meta["name"],
            ip=ip,
            spec=item["spec"],
            labels=meta.get("labels") or {},
            dir=self.workdir / "pods" / f"{meta['name']}-{meta['uid'][:8]}",
        )
        pod.dir.mkdir(parents=True, exist_ok=True)
        self.pods[pod.uid] = pod
        try:
            self.mount_volumes(pod)
            self.start(pod)
        except RunnerError as exc:
            pod.error, pod.phase = str(exc), "Failed"
            log.warning("pod %s cannot run: %s", pod.name, exc)
        return pod

    def mount_volumes(self, pod: RunPod, refresh_only: bool = False) -> None:
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
                content = self.rewrite_text(content.decode(), pod).encode()
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

    # --- rewriting the container's view of the world -------------------------------------

    def rewrite_path(self, value: str, pod: RunPod) -> str:
        for quote in ('"', "'"):
            if len(value) > 1 and value[0] == quote and value.endswith(quote):
                return quote + self.rewrite_path(value[1:-1], pod) + quote
        table = {**IMAGE_PATHS, **pod.mounts}
        for prefix in sorted(table, key=len, reverse=True):
            for lead in ("", "="):
                probe = lead + prefix
                i = value.find(probe) if lead else (0 if value.startswith(prefix) else -1)
                if i < 0:
                    continue
                end = i + len(probe)
                if end == len(value) or value[end] == "/":
                    return value[: i + len(lead)] + table[prefix] + value[end:]
        return value

    def rewrite_text(self, text: str, pod: RunPod) -> str:
        """Paths inside mounted config files (redis.conf's dir and include lines)."""
        out = []
        for line in text.splitlines():
            out.append(" ".join(self.rewrite_path(w, pod) for w in line.split(" ")))
        return "\n".join(out) + ("\n" if text.endswith("\n") else "")

    def rewrite(self, value: str, pod: RunPod, ports: dict[str, int]) -> str:
        if value in ports and value.isdigit():
            return str(ports[value])
        if value == "0.0.0.0":
            return "127.0.0.1"
        return self.rewrite_path(value, pod)

    def env(self, pod: RunPod, container: Obj, ports: dict[str, int]) -> dict[str, str]:
        out: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            kind = "secrets" if "secretRef" in src else "configmaps"
            ref = src.get("secretRef") or src.get("configMapRef") or {}
            obj = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/{kind}/{ref.get('name')}") or {}
            for k, v in (obj.get("data") or {}).items():
                out[src.get("prefix", "") + k] = base64.b64decode(v).decode() if kind == "secrets" else v
        for item in container.get("env") or []:
            if "value" in item:
                out[item["name"]] = expand(item["value"], out)
                continue
            value = self.value_from(pod, item.get("valueFrom") or {})
            if value is not None:
                out[item["name"]] = value
        return {k: self.rewrite(v, pod, ports) for k, v in out.items()}

    def value_from(self, pod: RunPod, src: Obj) -> str | None:
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            fields = {
                "metadata.name": pod.name,
                "metadata.namespace": self.ns,
                "metadata.uid": pod.uid,
                "status.podIP": pod.ip,
                "status.hostIP": "127.0.0.1",
                "spec.nodeName": self.node,
                "spec.serviceAccountName": pod.spec.get("serviceAccountName") or "default",
            }
            m = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            return pod.labels.get(m.group(1)) if m else fields.get(path)
        for key, kind in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if key in src:
                ref = src[key]
                obj = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/{kind}/{ref['name']}") or {}
                raw = (obj.get("data") or {}).get(ref["key"])
                if raw is None:
                    return None
                return base64.b64decode(raw).decode() if kind == "secrets" else str(raw)
        return None

    def command(self, container: Obj, env: dict[str, str], pod: RunPod, ports: dict[str, int]) -> list[str]:
        argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not argv:
            raise RunnerError(f"image {container.get('image')} has no command this runner knows")
        argv = [self.rewrite(a, pod, ports) for a in argv]
        exe = os.path.basename(argv[0])
        if exe == "relayfleet":
            return [str(VENV_BIN / "relayfleet"), *argv[1:]]
        if exe == "redis-server":
            port = next(iter(ports.values()), free_port())
            return [REDIS_SERVER, *argv[1:], "--port", str(port), "--bind", "127.0.0.1"]
        if exe == "spark-submit":
            app = next((i for i, a in enumerate(argv) if a.startswith("local://")), None)
            if app is None:
                raise RunnerError("spark-submit without a local:// application")
            module = "spark_jobs." + os.path.basename(argv[app]).removesuffix(".py")
            # Client mode with executors as pods needs a real kubelet; the driver runs locally.
            return [sys.executable, "-m", module, *argv[app + 1 :], "--master", "local[2]"]
        raise RunnerError(f"command {argv[0]!r} has no local stand-in")

    def start(self, pod: RunPod) -> None:
        containers = pod.spec["containers"]
        if len(containers) != 1:
            raise RunnerError("only single-container pods are supported")
        container = containers[0]
        ports: dict[str, int] = {}
        for p in container.get("ports") or []:
            host = free_port()
            ports[str(p["containerPort"])] = host
            if p.get("name"):
                ports[p["name"]] = host
        env = self.env(pod, container, ports)
        argv = self.command(container, env, pod, ports)
        full = {
            "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(pod.dir),
            "LANG": "C.UTF-8",
            "HOSTNAME": pod.name,
            **{k: v for k, v in os.environ.items() if k in ("JAVA_HOME", "SPARK_LOCAL_IP", "TMPDIR")},
            **env,
            "RELAYFLEET_E2E_ADDRESSES": str(self.addresses),
        }
        tree = source_tree(str(container.get("image") or ""))
        full["PYTHONPATH"] = os.pathsep.join(
            [
                str(PODENV),
                str(tree),
                str(tree / "operator"),  # else the venv's editable install answers for the operator
                *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p],
            ]
        )
        kubeconfig = self.pod_kubeconfig(pod)
        if kubeconfig:
            full["KUBECONFIG"] = kubeconfig
        full.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        cwd = pod.mounts.get(container.get("workingDir") or "", str(pod.dir))
        pod.container = Container(None, ports, full, cwd)
        self.spawn(pod, argv)

    def spawn(self, pod: RunPod, argv: list[str] | None = None) -> None:
        c = pod.container
        assert c is not None
        if argv is None:
            argv = json.loads((pod.dir / "argv.json").read_text())
        (pod.dir / "argv.json").write_text(json.dumps(argv))
        with (pod.dir / "log").open("ab") as out:
            out.write(f"--- start {now()}: {shlex.join(argv)}\n".encode())
            out.flush()
            c.proc = subprocess.Popen(
                argv,
                env=c.env,
                cwd=c.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        c.started_at, c.ready, c.exit_code = now(), False, None
        pod.phase = "Running"
        log.info("pod %s: started pid %d (%s)", pod.name, c.proc.pid, os.path.basename(argv[0]))

    # --- running ---------------------------------------------------------------------------

    def supervise(self, pod: RunPod) -> None:
        c = pod.container
        if c is None or pod.phase != "Running" or pod.deleting_since:
            return
        if c.proc is None:
            if c.restart_at and time.monotonic() >= c.restart_at:
                c.restart_at = 0.0
                self.spawn(pod)
            return
        code = c.proc.poll()
        if code is not None:
            c.exit_code, c.ready = code, False
            log.info("pod %s: exited %d", pod.name, code)
            policy = pod.spec.get("restartPolicy", "Always")
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                c.restarts += 1
                c.restart_at = time.monotonic() + min(5.0, 0.5 * c.restarts)  # a kubelet's back-off
            else:
                pod.phase = "Succeeded" if code == 0 else "Failed"
            c.proc = None
            return
        if time.monotonic() - c.last_probe >= PROBE_S:
            c.last_probe = time.monotonic()
            probe = pod.spec["containers"][0].get("readinessProbe")
            if probe is None:
                c.ready = True
            elif self.probe(probe, c):
                c.failures = 0
                c.ready = True
            else:
                # As a kubelet: ready until failureThreshold probes in a row fail.
                c.failures += 1
                if not c.ready or c.failures >= int(probe.get("failureThreshold", 3)):
                    c.ready = False

    def probe(self, probe: Obj, c: Container) -> bool:
        try:
            if "httpGet" in probe:
                port = c.ports[str(probe["httpGet"]["port"])]
                url = f"http://127.0.0.1:{port}{probe['httpGet'].get('path', '/')}"
                with urllib.request.urlopen(url, timeout=2) as resp:
                    return 200 <= int(resp.status) < 400
            if "tcpSocket" in probe:
                with socket.create_connection(("127.0.0.1", c.ports[str(probe["tcpSocket"]["port"])]), 2):
                    return True
            if "exec" in probe:
                argv = [self.port_words(a, c.ports) for a in probe["exec"]["command"]]
                done = subprocess.run(argv, env=c.env, cwd=c.cwd, capture_output=True, timeout=5, check=False)
                return done.returncode == 0
        except (OSError, KeyError, subprocess.TimeoutExpired, ValueError):
            return False
        return False

    @staticmethod
    def port_words(text: str, ports: dict[str, int]) -> str:
        for container_port, host in ports.items():
            if container_port.isdigit():
                text = re.sub(rf"\b{container_port}\b", str(host), text)
        return text

    def kill(self, pod: RunPod, grace: int) -> None:
        c = pod.container
        if c is None or c.proc is None or c.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGTERM)
        try:
            c.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait(5)
        log.info("pod %s: stopped", pod.name)

    def report(self, pod: RunPod) -> None:
        c = pod.container
        ready = bool(c and c.ready and pod.phase == "Running")
        stamp = now()
        name = pod.spec["containers"][0]["name"]
        image = pod.spec["containers"][0].get("image", "")
        state: Obj
        if pod.phase in ("Succeeded", "Failed") and c is not None:
            code = c.exit_code if c.exit_code is not None else 1
            reason = "Completed" if code == 0 else "Error"
            state = {
                "terminated": {
                    "exitCode": code,
                    "reason": reason,
                    "startedAt": c.started_at,
                    "finishedAt": stamp,
                }
            }
        elif c is not None and c.proc is None:
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"exited {c.exit_code}"}}
        elif c is not None:
            state = {"running": {"startedAt": c.started_at}}
        else:
            state = {"waiting": {"reason": "RunnerError", "message": pod.error}}
        key = json.dumps([pod.phase, ready, c.restarts if c else 0, list(state)])
        if key == pod.reported:
            return
        flag = "True" if ready else "False"
        conditions = [
            {"type": t, "status": s, "lastTransitionTime": stamp}
            for t, s in (
                ("PodReadyToStartContainers", "True"),
                ("Initialized", "True"),
                ("ContainersReady", flag),
                ("Ready", flag),
                ("PodScheduled", "True"),
            )
        ]
        status: Obj = {
            "phase": pod.phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "startTime": (c.started_at if c else stamp),
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": name,
                    "image": image,
                    "imageID": image,
                    "containerID": f"relayfleet-e2e://{c.proc.pid if c and c.proc else 0}",
                    "ready": ready,
                    "started": pod.phase == "Running",
                    "restartCount": c.restarts if c else 0,
                    "state": state,
                }
            ],
        }
        if pod.error:
            status["message"] = pod.error
        if self.api.merge_patch(f"/api/v1/namespaces/{self.ns}/pods/{pod.name}/status", {"status": status}):
            pod.reported = key

    # --- Service names -> loopback ports ---------------------------------------------------

    def write_addresses(self) -> None:
        services = self.api.try_call("GET", f"/api/v1/namespaces/{self.ns}/services")
        if services is None:
            return
        table: dict[str, list[str]] = {}
        running = [p for p in self.pods.values() if p.container is not None and p.phase == "Running"]
        for pod in running:
            assert pod.container is not None
            for container_port, host in pod.container.ports.items():
                if container_port.isdigit():
                    table[f"{pod.ip}:{container_port}"] = [f"127.0.0.1:{host}"]
        for svc in services.get("items") or []:
            name = svc["metadata"]["name"]
            selector = svc["spec"].get("selector") or {}
            if not selector:
                continue
            members = [
                p
                for p in running
                if p.container is not None
                and p.container.ready
                and all(p.labels.get(k) == v for k, v in selector.items())
            ]
            names = [
                name,
                f"{name}.{self.ns}",
                f"{name}.{self.ns}.svc",
                f"{name}.{self.ns}.svc.cluster.local",
            ]
            if svc["spec"].get("clusterIP") not in (None, "None"):
                names.append(svc["spec"]["clusterIP"])
            for port in svc["spec"].get("ports") or []:
                target = str(port.get("targetPort", port["port"]))
                hosts = [
                    f"127.0.0.1:{p.container.ports[target]}"
                    for p in members
                    if p.container is not None and target in p.container.ports
                ]
                if hosts:
                    for n in names:
                        table[f"{n}:{port['port']}"] = hosts
        text = json.dumps(table, sort_keys=True)
        if text != self.addresses_text:
            tmp = self.addresses.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.addresses)
            self.addresses_text = text


class ApiError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class RunnerError(Exception):
    """A pod this runner cannot stand in for (reported through the Pod's status)."""


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references; $$(VAR) stays literal."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.podrunner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        runner = Runner(Api(args.kubeconfig), args.namespace, args.node, workdir)
    except Exception as exc:  # a bad kubeconfig: one line, not a traceback
        print(f"podrunner: cannot use {args.kubeconfig}: {exc}", file=sys.stderr)
        return 1

    def stop(_sig: int, _frame: Any) -> None:
        runner.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        runner.run()
    finally:
        runner.unregister_node()
    return 0


if __name__ == "__main__":
    sys.exit(main())
