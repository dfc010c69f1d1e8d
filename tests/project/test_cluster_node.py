"""make cluster's real node (hack/cluster.sh, docs/e2e.md), checked without running it: the
configs `up` renders, the image names, and the host-path provisioner (against a real API server)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from relayfleet_testing import hostpath_provisioner as hp

from tests.support.k8s_cluster import KubeCluster

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "hack" / "cluster.sh"
POD_CIDR = ipaddress.ip_network("10.244.0.0/24")
SERVICE_CIDR = ipaddress.ip_network("10.96.0.0/16")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config dir, state dir) of `hack/cluster.sh render` with a state dir of the test's own."""
    base = tmp_path_factory.mktemp("cluster")
    state, out = base / "state", base / "conf"
    subprocess.run(
        ["bash", str(CLUSTER), "render", str(out)],
        check=True,
        env={**os.environ, "RELAYFLEET_CLUSTER_DIR": str(state)},
        timeout=60,
    )
    return out, state


def _image_ref(name: str) -> str:
    return subprocess.run(
        ["bash", str(ROOT / "hack" / "cluster-images.sh"), "ref", name],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()


def test_every_address_is_loopback_or_the_bridge(rendered: tuple[Path, Path]) -> None:
    conf, _ = rendered
    texts = [p.read_text() for p in sorted(conf.rglob("*")) if p.is_file()]
    addresses = {
        ipaddress.ip_address(a)
        for t in texts
        for a in re.findall(r"(?<![\d.])(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?![\d.])", t)
    }
    assert addresses, "no address found: the regex or the configs changed"
    for address in addresses:
        assert address.is_loopback or address in POD_CIDR or address in SERVICE_CIDR, address
    assert "0.0.0.0" not in "".join(texts)


def test_containerd_runs_pods_on_this_machine_kind_and_keeps_to_its_state_dir(
    rendered: tuple[Path, Path],
) -> None:
    import tomllib

    conf, state = rendered
    cfg = tomllib.loads((conf / "containerd.toml").read_text())
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    # without it every sandbox fails where root lacks CAP_SYS_RESOURCE
    assert cri["restrict_oom_score_adj"] is True
    assert (
        cri["sandbox_image"]
        == _image_ref("pause")
        == "ghcr.io/relayfleet/pause:"
        + (re.search(r'^KUBE_VERSION="(.*)"$', (ROOT / "hack/control-plane.sh").read_text(), re.M) or [""])[1]
    )
    runc = cri["containerd"]["runtimes"]["runc"]["options"]
    assert runc["SystemdCgroup"] is False  # cgroupfs, as the kubelet
    paths = [
        cfg["root"],
        cfg["state"],
        cfg["grpc"]["address"],
        runc["Root"],
        cri["cni"]["conf_dir"],
        cfg["plugins"]["io.containerd.internal.v1.opt"]["path"],
    ]
    assert all(Path(p).is_relative_to(state) for p in paths), paths
    assert cri["stream_server_address"] == "127.0.0.1"


def test_pods_route_nowhere_but_the_bridge_and_services(rendered: tuple[Path, Path]) -> None:
    conf, state = rendered
    (conflist,) = (conf / "cni").glob("*.conflist")
    (bridge,) = json.loads(conflist.read_text())["plugins"]
    assert bridge["type"] == "bridge"
    assert bridge["ipMasq"] is False
    routes = bridge["ipam"]["routes"]
    assert routes == [{"dst": str(SERVICE_CIDR), "gw": "10.244.0.1"}]  # no default route
    assert Path(bridge["ipam"]["dataDir"]).is_relative_to(state)


def test_kubelet_and_kube_proxy_settings_this_machine_needs(rendered: tuple[Path, Path]) -> None:
    conf, state = rendered
    kubelet: dict[str, Any] = yaml.safe_load((conf / "kubelet.yaml").read_text())
    assert kubelet["failCgroupV1"] is False
    assert kubelet["cgroupDriver"] == "cgroupfs"
    assert kubelet["failSwapOn"] is False
    assert kubelet["resolvConf"] == ""  # nothing of the host's resolver reaches a Pod
    assert kubelet["clusterDNS"] == ["10.244.0.1"]
    assert kubelet["readOnlyPort"] == 0
    assert kubelet["authentication"]["anonymous"]["enabled"] is False
    assert Path(kubelet["podLogsDir"]).is_relative_to(state)
    proxy: dict[str, Any] = yaml.safe_load((conf / "kube-proxy.yaml").read_text())
    assert proxy["mode"] == "iptables"
    assert proxy["conntrack"]["maxPerCore"] == 0  # may not raise the kernel's conntrack limits
    assert proxy["iptables"]["localhostNodePorts"] is False
    assert proxy["nodePortAddresses"] == ["10.244.0.1/32"]


def test_coredns_serves_cluster_names_only_and_forwards_nothing(rendered: tuple[Path, Path]) -> None:
    conf, state = rendered
    corefile = (conf / "Corefile").read_text()
    blocks = re.findall(r"^([^\s{}][^{}\n]*)\{", corefile, re.M)
    assert [b.split() for b in blocks] == [
        ["cluster.local:53", "0.244.10.in-addr.arpa.:53", "96.10.in-addr.arpa.:53"],
        [".:53"],
    ]
    plugins = set(re.findall(r"^\s{4}([a-z_]+)\b", corefile, re.M))
    assert not plugins & {"forward", "proxy", "grpc", "etcd", "file", "hosts"}
    catch_all = corefile[corefile.index(".:53 {") :]
    assert "rcode NXDOMAIN" in catch_all
    # every plugin the Corefile names is linked into the CoreDNS hack/control-plane.sh builds
    built = re.search(r"^coredns_plugins=\((.*)\)$", (ROOT / "hack/control-plane.sh").read_text(), re.M)
    assert built is not None
    assert plugins <= set(built[1].split()), plugins - set(built[1].split())
    assert f"kubeconfig {state}/coredns.kubeconfig" in corefile


def test_the_bootstrap_makes_the_provisioner_the_default_storage_class(
    rendered: tuple[Path, Path],
) -> None:
    conf, _ = rendered
    docs = [d for d in yaml.safe_load_all((conf / "bootstrap.yaml").read_text()) if d]
    (sc,) = [d for d in docs if d["kind"] == "StorageClass"]
    assert sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    assert sc["provisioner"] == hp.PROVISIONER
    assert sc["reclaimPolicy"] == "Delete"


def test_images_are_named_under_the_project() -> None:
    for name in ("relayfleet", "relayfleet-spark", "redis"):
        assert _image_ref(name).startswith(f"ghcr.io/relayfleet/{name}:")
    bad = subprocess.run(
        ["bash", str(ROOT / "hack" / "cluster-images.sh"), "ref", "nginx"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode != 0
    assert "unknown image nginx" in bad.stderr


IMAGES = ("relayfleet", "relayfleet-spark", "redis", "pause")
# what hack/cluster-images.sh keys the images by (and what it reads to name their tags)
KEY_INPUTS = (
    "hack/cluster-images.sh",
    "hack/lib.sh",
    "hack/images.sh",
    "hack/oci_image.py",
    "hack/lock.py",
    "hack/control-plane.sh",
    "hack/version.py",
    "pyproject.toml",
    "README.md",
    "Dockerfile",
    "Dockerfile.spark",
    "Dockerfile.redis",
    "relay/__init__.py",
    "spark_jobs/__init__.py",
    "e2e/docker/spark-entrypoint.sh",
    "requirements/relayfleet.txt",
    "requirements/relayfleet-spark.txt",
)


def _archives(tree: Path, cache: Path) -> dict[str, str]:
    """Each image's cache archive for `tree` as it is now (hack/cluster-images.sh archive)."""
    out = {}
    for name in IMAGES:
        path = subprocess.run(
            ["bash", str(tree / "hack" / "cluster-images.sh"), "archive", name],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "RELAYFLEET_CACHE_DIR": str(cache)},
        ).stdout.strip()
        assert re.fullmatch(rf"{re.escape(str(cache))}/cluster-images/{name}-[0-9a-f]{{16}}\.oci\.tar", path)
        out[name] = path
    return out


def test_an_edit_rebuilds_the_images_made_of_it_and_no_other(tmp_path: Path) -> None:
    """The node's images (and `make release`'s, taken from the same cache) are keyed by what
    they are made of: an edit gives a new archive name to exactly the images it goes into."""
    tree, cache = tmp_path / "tree", tmp_path / "cache"
    for rel in KEY_INPUTS:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes((ROOT / rel).read_bytes())
    subprocess.run(["git", "init", "-q", str(tree)], check=True, timeout=30)
    before = _archives(tree, cache)

    def changed(edit: str, text: str) -> set[str]:
        nonlocal before
        with (tree / edit).open("a") as f:
            f.write(text)
        now = _archives(tree, cache)
        diff = {name for name in IMAGES if now[name] != before[name]}
        before = now
        return diff

    assert changed("relay/__init__.py", "# an edit of the product\n") == {"relayfleet", "relayfleet-spark"}
    # not committed, not even added: still what the wheel is made of
    assert changed("relay/new_module.py", "X = 1\n") == {"relayfleet", "relayfleet-spark"}
    assert changed("spark_jobs/__init__.py", "# an edit\n") == {"relayfleet", "relayfleet-spark"}
    assert changed("Dockerfile.redis", "# an edit\n") == {"redis"}
    assert changed("hack/control-plane.sh", "# an edit that is not the Kubernetes pin\n") == set()
    cp = tree / "hack" / "control-plane.sh"
    cp.write_text(re.sub(r'(?m)^KUBE_VERSION="[^"]*"$', 'KUBE_VERSION="v1.99.0"', cp.read_text()))
    assert changed("hack/control-plane.sh", "") == {"pause"}
    assert changed("requirements/relayfleet-spark.txt", "# a new lock\n") == {
        "relayfleet",
        "relayfleet-spark",
    }
    assert changed("hack/images.sh", "# an edit of the recipes\n") == set(IMAGES)


def test_a_code_change_keeps_the_dependency_layers_a_lock_change_rebuilds_its_own(tmp_path: Path) -> None:
    """The relay and Spark images' dependency layers (hack/images.sh, cached under image-deps/)
    are keyed by their lock and base, never by the product's files: a code-only commit reuses
    them and builds only the code layer."""
    tree = tmp_path / "tree"
    for rel in KEY_INPUTS:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes((ROOT / rel).read_bytes())
    subprocess.run(["git", "init", "-q", str(tree)], check=True, timeout=30)

    def keys() -> dict[str, str]:
        out = subprocess.run(
            ["bash", str(tree / "hack" / "images.sh"), "--deps-keys"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "RELAYFLEET_CACHE_DIR": str(tmp_path / "cache")},
        ).stdout
        found = dict(line.split() for line in out.splitlines())
        assert set(found) == {"relayfleet", "relayfleet-spark"}, out
        return found

    before = keys()
    for rel in ("relay/__init__.py", "spark_jobs/__init__.py", "pyproject.toml", "Dockerfile", "README.md"):
        with (tree / rel).open("a") as f:
            f.write("# a code-only edit\n")
    (tree / "relay" / "new_module.py").write_text("X = 1\n")
    assert keys() == before
    with (tree / "requirements" / "relayfleet.txt").open("a") as f:
        f.write("# a new lock\n")
    after = keys()
    assert after["relayfleet"] != before["relayfleet"]
    assert after["relayfleet-spark"] == before["relayfleet-spark"]


# --- the provisioner's decisions (pure) ---------------------------------------------------------


def _claim(name: str, phase: str = "Pending", sc: str = "local", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "storageClassName": sc,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            **spec,
        },
        "status": {"phase": phase},
    }


def test_only_pending_claims_of_its_classes_without_a_volume_are_provisioned() -> None:
    classes = hp.our_classes(
        [
            {"metadata": {"name": "local"}, "provisioner": hp.PROVISIONER},
            {"metadata": {"name": "other"}, "provisioner": "example.com/else"},
        ],
        hp.PROVISIONER,
    )
    claims = [
        _claim("a"),
        _claim("bound", phase="Bound"),
        _claim("elsewhere", sc="other"),
        _claim("named", volumeName="pv-x"),
        _claim("block", volumeMode="Block"),
        _claim("done"),
    ]
    volumes = [{"metadata": {"name": "pvc-uid-done"}}]
    assert [c["metadata"]["name"] for c in hp.claims_to_provision(claims, classes, volumes)] == ["a"]


def test_a_volume_is_bound_to_its_claim_with_its_size_and_modes(tmp_path: Path) -> None:
    claim = _claim("data-redis-0", accessModes=["ReadWriteOnce"])
    pv = hp.volume_for(claim, {"metadata": {"name": "local"}}, tmp_path / "v", hp.PROVISIONER)
    assert pv["metadata"]["name"] == "pvc-uid-data-redis-0"
    assert pv["spec"]["claimRef"] == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "namespace": "ns",
        "name": "data-redis-0",
        "uid": "uid-data-redis-0",
    }
    assert pv["spec"]["capacity"] == {"storage": "1Gi"}
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    assert pv["spec"]["hostPath"] == {"path": str(tmp_path / "v"), "type": "Directory"}


def test_only_its_own_released_volumes_are_deleted() -> None:
    def pv(name: str, phase: str, by: str = hp.PROVISIONER, policy: str = "Delete") -> dict[str, Any]:
        return {
            "metadata": {"name": name, "annotations": {hp.PROVISIONED_BY: by}},
            "spec": {"persistentVolumeReclaimPolicy": policy},
            "status": {"phase": phase},
        }

    volumes = [
        pv("released", "Released"),
        pv("bound", "Bound"),
        pv("foreign", "Released", by="example.com/else"),
        pv("kept", "Released", policy="Retain"),
    ]
    assert [v["metadata"]["name"] for v in hp.volumes_to_delete(volumes, hp.PROVISIONER)] == ["released"]


# --- against a real API server --------------------------------------------------------------------


@pytest.mark.k8s
def test_provisioner_binds_a_claim_and_cleans_up_after_it(
    kube_apiserver: KubeCluster, apiserver_ns: str, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:6]
    sc_name, ns = f"hostpath-{suffix}", apiserver_ns
    provisioner = f"relayfleet.dev/test-{suffix}"

    def kubectl(*args: str, doc: dict[str, Any] | None = None) -> Any:
        out = kube_apiserver.kubectl(*args, input=None if doc is None else json.dumps(doc)).stdout
        return json.loads(out) if out.startswith("{") else out

    def our_volumes() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = kubectl("get", "pv", "-o", "json")["items"]
        return [v for v in items if v["spec"].get("storageClassName") == sc_name]

    sc = {"kind": "StorageClass", "metadata": {"name": sc_name}, "reclaimPolicy": "Delete"}
    kubectl("create", "-f", "-", doc={"apiVersion": "storage.k8s.io/v1", **sc, "provisioner": provisioner})
    try:
        claim = kubectl(
            "-n",
            ns,
            "create",
            "-o",
            "json",
            "-f",
            "-",
            doc={
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "data"},
                "spec": {
                    "storageClassName": sc_name,
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "64Mi"}},
                },
            },
        )
        # no PV controller here to set it: Pending is what the provisioner looks for
        kubectl(
            "-n", ns, "patch", "pvc", "data", "--subresource=status", "-p", '{"status":{"phase":"Pending"}}'
        )
        with kube_apiserver.api_client() as api:
            prov = hp.Provisioner(api, tmp_path / "volumes", provisioner)
            prov.run_once()
            (pv,) = our_volumes()
            assert pv["metadata"]["name"] == f"pvc-{claim['metadata']['uid']}"
            assert pv["spec"]["claimRef"]["uid"] == claim["metadata"]["uid"]
            assert pv["spec"]["capacity"] == {"storage": "64Mi"}
            path = Path(pv["spec"]["hostPath"]["path"])
            assert path.parent == (tmp_path / "volumes").resolve()
            assert stat.S_IMODE(path.stat().st_mode) == 0o777  # writable by any uid, no fsGroup
            prov.run_once()  # nothing new
            assert len(our_volumes()) == 1

            name = pv["metadata"]["name"]
            kubectl("patch", "pv", name, "--subresource=status", "-p", '{"status":{"phase":"Released"}}')
            prov.run_once()
            assert not path.exists()
            # deleted (the pv-protection finalizer may hold it: no controller here drops it)
            assert all(v["metadata"].get("deletionTimestamp") for v in our_volumes())
    finally:
        kubectl("delete", "storageclass", sc_name)
        for v in our_volumes():
            kubectl(
                "patch", "pv", v["metadata"]["name"], "--type=merge", "-p", '{"metadata":{"finalizers":null}}'
            )
            kubectl("delete", "pv", v["metadata"]["name"], "--ignore-not-found", "--wait=false")
