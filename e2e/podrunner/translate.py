"""A pod's container spec -> the argv and environment of a local stand-in process.

Commands map to local binaries (redis-server, the venv's relayfleet, spark-submit's
application as `python -m spark_jobs.X`); paths under a mountPath or the image's /app become
host directories, containerPorts free loopback ports, and 0.0.0.0 127.0.0.1, in args, env and
mounted config files alike. Env follows Kubernetes: envFrom, $(VAR) expansion, valueFrom's
fieldRef / secretKeyRef / configMapKeyRef."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import sys
from pathlib import Path

from e2e.podrunner.kube import Api
from e2e.podrunner.pods import Container, RunnerError, RunPod
from relay.fleet.contract import Obj

ROOT = Path(__file__).resolve().parents[2]
PODENV = ROOT / "e2e" / "podenv"
VENV_BIN = Path(sys.executable).parent
REDIS_SERVER = "/usr/bin/redis-server"
# The Spark image holds the repository at /app (charts/relayfleet values spark.appDir).
IMAGE_PATHS = {"/app": str(ROOT)}


# JSON {image: source tree}: pods of those images run that tree's code (the upgrade test runs
# the previous release's operator and relays from a `git archive` of it); others run ROOT's.
TREES_ENV = "RELAYFLEET_PODRUNNER_TREES"


def source_tree(image: str) -> Path:
    trees = json.loads(os.environ.get(TREES_ENV) or "{}")
    return Path(trees[image]) if image in trees else ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references; $$(VAR) stays literal."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$?\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


def rewrite_path(value: str, pod: RunPod) -> str:
    for quote in ('"', "'"):
        if len(value) > 1 and value[0] == quote and value.endswith(quote):
            return quote + rewrite_path(value[1:-1], pod) + quote
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


def rewrite_text(text: str, pod: RunPod) -> str:
    """Paths inside mounted config files (redis.conf's dir and include lines)."""
    out = []
    for line in text.splitlines():
        out.append(" ".join(rewrite_path(w, pod) for w in line.split(" ")))
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def rewrite(value: str, pod: RunPod, ports: dict[str, int]) -> str:
    if value in ports and value.isdigit():
        return str(ports[value])
    if value == "0.0.0.0":
        return "127.0.0.1"
    return rewrite_path(value, pod)


def port_words(text: str, ports: dict[str, int]) -> str:
    """containerPort numbers in a shell command (an exec probe) -> their host ports."""
    for container_port, host in ports.items():
        if container_port.isdigit():
            text = re.sub(rf"\b{container_port}\b", str(host), text)
    return text


class Translator:
    """Reads the Secrets and ConfigMaps a container's env names; `addresses` is the address
    table every process is pointed at (RELAYFLEET_E2E_ADDRESSES, read by e2e/podenv)."""

    def __init__(self, api: Api, namespace: str, node: str, addresses: Path) -> None:
        self.api, self.ns, self.node, self.addresses = api, namespace, node, addresses

    def process(self, pod: RunPod) -> tuple[Container, list[str]]:
        """The pod's one container as a process not yet started: its ports, env, cwd and argv."""
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
        full.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        cwd = pod.mounts.get(container.get("workingDir") or "", str(pod.dir))
        return Container(None, ports, full, cwd), argv

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
        return {k: rewrite(v, pod, ports) for k, v in out.items()}

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
        argv = [rewrite(a, pod, ports) for a in argv]
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
