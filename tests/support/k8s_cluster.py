"""Pytest plugin: real Kubernetes control planes for tests, built from source.

Register it from ``tests/conftest.py`` with ``pytest_plugins = ["tests.support.k8s_cluster"]``.

Fixtures (both give a :class:`KubeCluster`, one per process, started on first use):

``kube_apiserver``
    A bare etcd + kube-apiserver on free loopback ports, with self-generated
    certificates, ServiceAccount keys and a client-certificate admin
    kubeconfig. No controllers, no scheduler, no nodes: enough for CRDs,
    CEL validation, server-side apply and dry-run.

``kwok_cluster``
    ``kwokctl create cluster --runtime binary`` with the locally built
    kube-apiserver, kube-controller-manager, kube-scheduler, etcd and kwok
    (offline), plus fake kwok nodes, so Deployments get Running Pods.

If ``--kubeconfig PATH`` or ``RELAYFLEET_KUBECONFIG`` is set, both fixtures
yield that existing cluster instead and start nothing. Otherwise the binaries
come from ``hack/control-plane.sh`` (a no-op once built; see
docs/control-plane.md), which runs at collection time when any selected test
needs them, so a cold build does not eat into a test's timeout.

On a pytest-xdist worker a control plane is stopped as soon as the next test the worker runs
does not use it: the tests sharing one run there one after the other (a group, one work unit;
tests/conftest.py), and an idle API server, etcd and kwok's controllers, kept until the
session's end, used CPU the rest of the suite needed (the suite is bound by CPU on 2 cores). A
later test that asks again gets a new one. Run without xdist, it stays up until the end.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import urllib3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes.client import ApiClient
from relayfleet_testing import kwok as kwok_tools
from relayfleet_testing.kwok import tail as _tail

from relay import kubeapi

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "control-plane.sh"
KUBECONFIG_ENV = "RELAYFLEET_KUBECONFIG"
K8S_FIXTURES = frozenset({"kube_apiserver", "kwok_cluster"})

#: Fake nodes the kwok cluster gets.
KWOK_NODES = 2
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


# --------------------------------------------------------------------------- API


@dataclass(frozen=True)
class KubeCluster:
    """A reachable Kubernetes API server and how to talk to it."""

    kubeconfig: Path
    server: str
    #: Dir with kubectl, helm, kwokctl, ... from hack/control-plane.sh; None if
    #: the cluster is external and the binaries were never built.
    bin_dir: Path | None = None
    #: True when the cluster came from --kubeconfig / RELAYFLEET_KUBECONFIG.
    external: bool = False
    #: kwokctl cluster name, for kwok clusters started here.
    kwok_name: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def tool(self, name: str) -> str:
        """Path of a tool (kubectl, helm, ...): the pinned build first, then PATH."""
        if self.bin_dir is not None and (self.bin_dir / name).exists():
            return str(self.bin_dir / name)
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} is neither in {self.bin_dir} nor on PATH")
        return found

    def api_client(self) -> ApiClient:
        """A kubernetes.client.ApiClient for this cluster, configured as the product's
        (relay/kubeapi.py: retries on transient errors); use it as a context manager."""
        api: ApiClient = kubeapi.api_client(str(self.kubeconfig))
        return api

    def read(self, ns: str, kind: str, name: str) -> dict[str, Any] | None:
        """`kubectl -n NS get KIND NAME -o json` through this process's API client (None if
        there is no such object), for the kinds in `KIND_PATHS`: a test polling an object every
        half second paid a kubectl process each time (~60 ms of CPU, the API server's
        discovery answers besides), a GET here costs a few ms. An error other than the
        object's NotFound raises CalledProcessError, as the kubectl call did (`wait_for` takes
        it as "not yet")."""
        path = KIND_PATHS[kind].format(ns=ns, name=name)
        api = _api_client(self.kubeconfig)
        request = api.param_serialize(
            "GET", path, header_params={"Accept": "application/json"}, auth_settings=["BearerToken"]
        )
        try:
            response = api.call_api(*request)
            body: bytes = response.read()  # type: ignore[no-untyped-call]
        except (OSError, urllib3.exceptions.HTTPError) as exc:
            raise subprocess.CalledProcessError(1, ["GET", path], "", str(exc)) from None
        if response.status == 200:
            doc: dict[str, Any] = json.loads(body)
            return doc
        text = body.decode(errors="replace")
        if response.status == 404 and _names(text, name):
            return None
        raise subprocess.CalledProcessError(response.status, ["GET", path], "", text)

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; stdout/stderr are captured as text."""
        return subprocess.run(
            [self.tool("kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env={**os.environ, **self.env},
        )


#: kind (as the tests name it to kubectl) -> the object's API path, for `KubeCluster.read`
KIND_PATHS = {
    "configmap": "/api/v1/namespaces/{ns}/configmaps/{name}",
    "secret": "/api/v1/namespaces/{ns}/secrets/{name}",
    "service": "/api/v1/namespaces/{ns}/services/{name}",
    "persistentvolumeclaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}",
    "deployment": "/apis/apps/v1/namespaces/{ns}/deployments/{name}",
    "statefulset": "/apis/apps/v1/namespaces/{ns}/statefulsets/{name}",
    "networkpolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}",
    "rshard": "/apis/relayfleet.dev/v1alpha1/namespaces/{ns}/relayshards/{name}",
    "rrebalance": "/apis/relayfleet.dev/v1alpha1/namespaces/{ns}/relayrebalances/{name}",
}

#: kubeconfig -> this process's API client of that cluster (closed when the cluster stops)
_CLIENTS: dict[Path, ApiClient] = {}


def _api_client(kubeconfig: Path) -> ApiClient:
    if kubeconfig not in _CLIENTS:
        _CLIENTS[kubeconfig] = kubeapi.api_client(str(kubeconfig))
    return _CLIENTS[kubeconfig]


def _close_api_client(kubeconfig: Path) -> None:
    client = _CLIENTS.pop(kubeconfig, None)
    if client is not None:
        client.close()  # type: ignore[no-untyped-call]


def _names(status: str, name: str) -> bool:
    """Is this 404 body the NotFound Status of the object `name` (not a path the server does
    not serve, such as a custom resource whose definition is not established yet)?"""
    try:
        doc = json.loads(status)
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    return doc.get("reason") == "NotFound" and (doc.get("details") or {}).get("name") == name


class ControlPlaneError(RuntimeError):
    """A control-plane component failed to build or start."""


# ----------------------------------------------------------------------- options


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kubeconfig",
        action="store",
        default=None,
        help=f"use this existing cluster for k8s tests instead of starting one (or set {KUBECONFIG_ENV})",
    )


def external_kubeconfig(config: pytest.Config) -> Path | None:
    value = config.getoption("--kubeconfig") or os.environ.get(KUBECONFIG_ENV)
    if not value:
        return None
    path = Path(str(value)).expanduser().resolve()
    if not path.is_file():
        raise pytest.UsageError(f"kubeconfig {path} does not exist")
    return path


def pinned_kube_version() -> str:
    """The Kubernetes version hack/control-plane.sh pins (its single source of truth)."""
    match = re.search(r'^KUBE_VERSION="(v[0-9.]+)"$', BUILD_SCRIPT.read_text(), re.MULTILINE)
    if match is None:
        raise ControlPlaneError(f"no KUBE_VERSION pin in {BUILD_SCRIPT}")
    return match.group(1)


_build_result: Path | ControlPlaneError | None = None


def control_plane_bin_dir() -> Path:
    """Build (or find) the pinned binaries once per session; returns their directory.

    A failed build is remembered too, so every fixture reports it without
    building again.
    """
    global _build_result
    if _build_result is None:
        try:
            _build_result = _run_build_script()
        except ControlPlaneError as exc:
            _build_result = exc
    if isinstance(_build_result, ControlPlaneError):
        raise _build_result
    return _build_result


def _run_build_script(*args: str) -> Path:
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT), *args], capture_output=True, text=True, check=False, cwd=REPO_ROOT
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        command = " ".join(["bash", str(BUILD_SCRIPT), *args])
        raise ControlPlaneError(f"{command} failed (exit {proc.returncode}):\n{_tail(proc.stderr, 60)}")
    bin_dir = Path(lines[-1])
    if not (bin_dir / "kube-apiserver").exists():
        raise ControlPlaneError(f"{BUILD_SCRIPT} printed {bin_dir}, which has no kube-apiserver")
    return bin_dir


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before any test runs if a selected test needs them."""
    if session.config.option.collectonly or external_kubeconfig(session.config) is not None:
        return
    if any(K8S_FIXTURES.intersection(getattr(item, "fixturenames", ())) for item in session.items):
        # A failure is remembered and raised by the fixtures, failing only the tests that need them.
        with contextlib.suppress(ControlPlaneError):
            control_plane_bin_dir()


# -------------------------------------------------------------------- fixtures


@pytest.fixture
def kube_apiserver(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> KubeCluster:
    """A bare etcd + kube-apiserver (or the external cluster)."""
    return _cluster(request, tmp_path_factory, "kube_apiserver", "kube-apiserver", _bare_apiserver)


@pytest.fixture
def kwok_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> KubeCluster:
    """A kwokctl binary-runtime cluster with fake nodes (or the external cluster)."""
    return _cluster(request, tmp_path_factory, "kwok_cluster", "kwok", _kwok)


#: fixture name -> the control plane this process runs for it, and what stops it
_RUNNING: dict[str, tuple[KubeCluster, contextlib.ExitStack]] = {}


def _cluster(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    fixture: str,
    name: str,
    start: Callable[[Path, Path], contextlib.AbstractContextManager[KubeCluster]],
) -> KubeCluster:
    """The external cluster if one is given, else `start(bin_dir, workdir)` with the pinned
    binaries; the one already running for `fixture` if there is one."""
    if fixture not in _RUNNING:
        stack = contextlib.ExitStack()
        external = external_kubeconfig(request.config)
        if external is not None:
            cluster = external_cluster(external)
        else:
            cluster = stack.enter_context(start(control_plane_bin_dir(), tmp_path_factory.mktemp(name)))
        stack.callback(_close_api_client, cluster.kubeconfig)  # before the cluster stops
        _RUNNING[fixture] = (cluster, stack)
    return _RUNNING[fixture][0]


def _stop(fixture: str) -> None:
    _RUNNING.pop(fixture)[1].close()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures (namespaces, operators) are gone
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if not hasattr(item.config, "workerinput"):
        return  # one process in file order: the tests using a control plane are not together
    after = set(getattr(nextitem, "fixturenames", ())) if nextitem is not None else set()
    for fixture in [f for f in _RUNNING if f not in after]:
        _stop(fixture)


def pytest_sessionfinish() -> None:
    for fixture in list(_RUNNING):
        _stop(fixture)


# ------------------------------------------------------------------- external


def external_cluster(kubeconfig: Path) -> KubeCluster:
    bin_dir: Path | None = None
    with contextlib.suppress(ControlPlaneError):
        # The pinned kubectl/helm if already built; an external cluster never triggers a build.
        bin_dir = _run_build_script("--check")
    cluster = KubeCluster(kubeconfig=kubeconfig, server="", bin_dir=bin_dir, external=True)
    view = cluster.kubectl("config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}")
    return KubeCluster(kubeconfig=kubeconfig, server=view.stdout.strip(), bin_dir=bin_dir, external=True)


# ------------------------------------------------------------- bare apiserver


@contextlib.contextmanager
def _bare_apiserver(bin_dir: Path, workdir: Path) -> Iterator[KubeCluster]:
    pki = _make_pki(workdir / "pki")
    etcd_client, etcd_peer, secure_port = _free_ports(3)
    server = f"https://127.0.0.1:{secure_port}"
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(_kubeconfig(server, pki))
    kubeconfig.chmod(0o600)

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _process(
                "etcd",
                [
                    str(bin_dir / "etcd"),
                    "--name=default",
                    f"--data-dir={workdir / 'etcd'}",
                    f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
                workdir,
                lambda: _http_ok(f"http://127.0.0.1:{etcd_client}/health", None),
            )
        )
        context = pki.client_ssl_context()
        stack.enter_context(
            _process(
                "kube-apiserver",
                [
                    str(bin_dir / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                    "--bind-address=127.0.0.1",
                    "--advertise-address=127.0.0.1",
                    f"--secure-port={secure_port}",
                    f"--tls-cert-file={pki.apiserver_cert}",
                    f"--tls-private-key-file={pki.apiserver_key}",
                    f"--client-ca-file={pki.ca_cert}",
                    f"--service-account-key-file={pki.sa_pub}",
                    f"--service-account-signing-key-file={pki.sa_key}",
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--authorization-mode=Node,RBAC",
                    "--allow-privileged=true",
                    "--profiling=false",
                    f"--cert-dir={workdir / 'certs'}",
                    "--v=0",
                ],
                workdir,
                lambda: _http_ok(f"{server}/readyz", context),
            )
        )
        yield KubeCluster(kubeconfig=kubeconfig, server=server, bin_dir=bin_dir)


@dataclass(frozen=True)
class _Pki:
    ca_cert: Path
    apiserver_cert: Path
    apiserver_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path

    def client_ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_cert))
        context.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        return context


def _make_pki(directory: Path) -> _Pki:
    directory.mkdir(parents=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - datetime.timedelta(minutes=5)
    not_after = now + datetime.timedelta(days=2)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relayfleet-test-ca")])

    def issued(name: x509.Name, key: ec.EllipticCurvePrivateKey, ca: bool) -> x509.CertificateBuilder:
        """A certificate the test CA issues: a CA one signs certificates, a leaf one does not."""
        return (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=ca,
                    crl_sign=ca,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        )

    ca_cert = (
        issued(ca_name, ca_key, ca=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        name: x509.Name, usage: x509.ObjectIdentifier, sans: Sequence[x509.GeneralName]
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            issued(name, key, ca=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server_sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(SERVICE_IP)),
        x509.DNSName("localhost"),
        *(
            x509.DNSName(n)
            for n in (
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            )
        ),
    ]
    server_cert, server_key = leaf(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        ExtendedKeyUsageOID.SERVER_AUTH,
        server_sans,
    )
    admin_cert, admin_key = leaf(
        x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                x509.NameAttribute(NameOID.COMMON_NAME, "relayfleet-test-admin"),
            ]
        ),
        ExtendedKeyUsageOID.CLIENT_AUTH,
        (),
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def write(name: str, data: bytes) -> Path:
        path = directory / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    def key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    pem = serialization.Encoding.PEM
    return _Pki(
        ca_cert=write("ca.crt", ca_cert.public_bytes(pem)),
        apiserver_cert=write("apiserver.crt", server_cert.public_bytes(pem)),
        apiserver_key=write("apiserver.key", key_pem(server_key)),
        admin_cert=write("admin.crt", admin_cert.public_bytes(pem)),
        admin_key=write("admin.key", key_pem(admin_key)),
        sa_key=write("sa.key", key_pem(sa_key)),
        sa_pub=write(
            "sa.pub",
            sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
        ),
    )


def _kubeconfig(server: str, pki: _Pki) -> str:
    """A kubeconfig with the certificates inline; JSON is valid YAML."""

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode("ascii")

    name = "relayfleet-test"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)}}
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": b64(pki.admin_cert),
                    "client-key-data": b64(pki.admin_key),
                },
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "admin"}}],
        "current-context": name,
        "preferences": {},
    }
    return json.dumps(config, indent=2) + "\n"


# ----------------------------------------------------------------------- kwok


@contextlib.contextmanager
def _kwok(bin_dir: Path, workdir: Path) -> Iterator[KubeCluster]:
    try:
        with kwok_tools.kwok_cluster(bin_dir, workdir, KWOK_NODES) as kwok:
            cluster = KubeCluster(kwok.kubeconfig, "", bin_dir, kwok_name=kwok.name, env=kwok.env)
            server = cluster.kubectl(
                "config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}"
            ).stdout.strip()
            yield KubeCluster(kwok.kubeconfig, server, bin_dir, kwok_name=kwok.name, env=kwok.env)
    except kwok_tools.KwokError as exc:
        raise ControlPlaneError(str(exc)) from None


# --------------------------------------------------------------------- helpers


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            return f"; log {self.log_path}:\n{_tail(self.log_path.read_text(errors='replace'), lines)}"
        except OSError:
            return ""


@contextlib.contextmanager
def _process(name: str, argv: list[str], workdir: Path, ready: Callable[[], bool]) -> Iterator[_Proc]:
    """Start a process logging to workdir/NAME.log, wait until it is ready; stop it by pid on exit."""
    log_path = workdir / f"{name}.log"
    log: IO[bytes] = log_path.open("wb")
    try:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    except BaseException:
        log.close()
        raise
    try:
        proc = _Proc(name, popen, log_path)
        _wait_for(proc, ready)
        yield proc
    finally:
        try:
            if popen.poll() is None:
                os.kill(popen.pid, signal.SIGTERM)
                try:
                    popen.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.kill(popen.pid, signal.SIGKILL)
                    popen.wait(timeout=STOP_TIMEOUT_S)
        finally:
            log.close()


def _wait_for(proc: _Proc, ready: Callable[[], bool], timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None:
            raise ControlPlaneError(f"{proc.name} exited with {proc.popen.returncode}{proc.log_tail()}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"{proc.name} not ready after {timeout:.0f}s{proc.log_tail()}")
        time.sleep(0.2)


def _http_ok(url: str, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            status: int = response.status
            return status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
