#!/usr/bin/env python3
"""Daemonless image packing for `make release` (hack/images.sh): a root filesystem → an OCI archive.

    oci_image.py config --dockerfile Dockerfile --base-path PATH   the final stage's image config, JSON
    oci_image.py layer --rootfs DIR --out BLOB [--epoch N]         one gzip layer of DIR (+ BLOB.json)
    oci_image.py pack [--layer BLOB]... [--rootfs DIR] --config FILE --ref TAG [--name NAME]
                      --out X.oci.tar [--epoch N]

`config` reads the runtime settings (ENV, USER, WORKDIR, EXPOSE, ENTRYPOINT, CMD) from the
Dockerfile itself, so the daemonless image and `docker build` cannot drift apart on them.
`layer` writes one gzip layer of a tree and its descriptor (BLOB.json: diff_id, digest, size):
hack/images.sh caches the dependency layer that way and makes the code layer of an overlayfs
upper directory (its whiteouts, a 0/0 character device or an opaque directory, become the OCI
`.wh.` entries). `pack` writes the layers given (in order: --layer blobs, then the tree of
--rootfs if given) plus config, manifest and index in an OCI image layout, tarred (what
`skopeo copy oci-archive:X.oci.tar docker://...` pushes). The index names
the manifest by its tag (`org.opencontainers.image.ref.name`, what skopeo's `oci-archive:X:TAG`
looks up) and, given --name, by its full name (`io.containerd.image.name`, what a plain
`ctr images import X` names the image; without it ctr would call it `import-<date>:TAG`). The output is
reproducible: entries sorted, mtimes clamped to --epoch, owners numeric, gzip header time 0.
Standard library only: it runs under any Python 3.11 (the release venv's).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import stat
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any, Protocol

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
# Never part of an image: the runtime mounts these (a container gets an empty /dev, /proc, /sys).
EMPTY_DIRS = ("dev", "proc", "sys")


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), ""), value)


def dockerfile_config(text: str, base_path: str) -> dict[str, Any]:
    """The final stage's runtime config, as `docker build` would record it on a base with PATH=base_path."""
    env: dict[str, str] = {"PATH": base_path}
    config: dict[str, Any] = {}
    ports: dict[str, dict[str, str]] = {}
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":  # a new stage starts from the base again
            env, config, ports = {"PATH": base_path}, {}, {}
        elif instruction == "ENV":
            for word in shlex.split(rest):
                name, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"ENV without '=' is not supported: {line}")
                env[name] = _expand(value, env)
        elif instruction == "USER":
            config["User"] = rest
        elif instruction == "WORKDIR":
            config["WorkingDir"] = rest
        elif instruction == "EXPOSE":
            for port in rest.split():
                ports[port if "/" in port else f"{port}/tcp"] = {}
        elif instruction in ("ENTRYPOINT", "CMD"):
            if not rest.startswith("["):
                raise ValueError(f"{instruction} must be in exec (JSON) form: {line}")
            config["Entrypoint" if instruction == "ENTRYPOINT" else "Cmd"] = json.loads(rest)
            if instruction == "ENTRYPOINT":
                config.pop("Cmd", None)  # as Docker: a later ENTRYPOINT resets an inherited CMD
    config["Env"] = [f"{k}={v}" for k, v in env.items()]
    if ports:
        config["ExposedPorts"] = ports
    return config


class _Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `sink`."""

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.sha.update(chunk)
        self.size += len(chunk)
        self.sink.write(chunk)
        return len(chunk)


def _layer(rootfs: Path, out: IO[bytes], epoch: int) -> tuple[str, str, int]:
    """Tar+gzip `rootfs` into `out`: (diff_id, blob digest, blob size)."""
    blob = _Hashing(out)
    gz = gzip.GzipFile(fileobj=blob, mode="wb", compresslevel=1, mtime=0)
    diff = _Hashing(gz)

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if len(parts) > 1 and parts[0] in EMPTY_DIRS:
            return None
        info.mtime = min(int(info.mtime), epoch)
        info.uname = info.gname = ""
        return info

    def add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
        st = path.lstat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # overlayfs whiteout: NAME was deleted
            parent, _, base = arcname.rpartition("/")
            info = tarfile.TarInfo(f"{parent}/{WHITEOUT}{base}" if parent else f"{WHITEOUT}{base}")
            info.mtime = min(int(st.st_mtime), epoch)
            tar.addfile(info)
            return
        info = tar.gettarinfo(path, arcname)
        kept = None if info is None else normalize(info)  # None: a socket, never part of an image
        if kept is None:
            return
        if kept.isreg():
            with open(path, "rb") as f:
                tar.addfile(kept, f)
            return
        tar.addfile(kept)
        if kept.isdir():
            if _opaque(path):  # overlayfs: the lower layers' entries of this directory are hidden
                opq = tarfile.TarInfo(f"{arcname}/{OPAQUE}")
                opq.mtime = kept.mtime
                tar.addfile(opq)
            for entry in sorted(os.listdir(path)):
                add(tar, path / entry, f"{arcname}/{entry}")

    with tarfile.open(fileobj=diff, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(rootfs)):
            add(tar, rootfs / entry, entry)
    gz.close()
    return f"sha256:{diff.sha.hexdigest()}", f"sha256:{blob.sha.hexdigest()}", blob.size


WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


def _opaque(path: Path) -> bool:
    for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
        try:
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def write_layer(rootfs: Path, out: Path, epoch: int) -> dict[str, Any]:
    """`rootfs` as a gzip layer blob at `out`, its descriptor (also written to OUT.json)."""
    partial = out.with_name(out.name + ".partial")
    with open(partial, "wb") as f:
        diff_id, digest, size = _layer(rootfs, f, epoch)
    partial.rename(out)
    desc = {"diff_id": diff_id, "digest": digest, "size": size}
    out.with_name(out.name + ".json").write_text(json.dumps(desc, sort_keys=True) + "\n")
    return desc


def _copy_verified(src: Path, dest: Path, digest: str) -> None:
    """Copy a cached blob, failing if it is no longer the content its descriptor names."""
    sha = hashlib.sha256()
    with open(src, "rb") as f, open(dest, "wb") as g:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            g.write(chunk)
    if f"sha256:{sha.hexdigest()}" != digest:
        raise ValueError(f"{src}: content is not {digest} (a changed cache? remove it)")


def _json_blob(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


CONTAINERD_NAME = "io.containerd.image.name"


def pack(
    rootfs: Path | None,
    image_config: dict[str, Any],
    ref: str,
    out: Path,
    epoch: int,
    name: str = "",
    layers: tuple[Path, ...] = (),
) -> str:
    """Write the OCI archive of `layers` (blobs of write_layer) then `rootfs` (named `name` for
    containerd, if given); returns the manifest digest."""
    created = _rfc3339(epoch)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        layout = Path(tmp)
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        descs: list[dict[str, Any]] = []
        for blob in layers:
            desc = json.loads(blob.with_name(blob.name + ".json").read_text())
            _copy_verified(blob, blobs / desc["digest"].split(":")[1], desc["digest"])
            descs.append(desc)
        if rootfs is not None:
            with open(layout / "layer.tmp", "wb") as f:
                diff_id, layer_digest, layer_size = _layer(rootfs, f, epoch)
            (layout / "layer.tmp").rename(blobs / layer_digest.split(":")[1])
            descs.append({"diff_id": diff_id, "digest": layer_digest, "size": layer_size})
        if not descs:
            raise ValueError("an image needs a layer (--layer or --rootfs)")
        config = {
            "created": created,
            "architecture": _arch(),
            "os": "linux",
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [d["diff_id"] for d in descs]},
            "history": [
                {"created": created, "created_by": "relayfleet hack/images.sh (daemonless)"} for _ in descs
            ],
        }

        def put(data: bytes) -> dict[str, Any]:
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return {"digest": f"sha256:{digest}", "size": len(data)}

        config_desc = {"mediaType": OCI_CONFIG, **put(_json_blob(config))}
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config_desc,
            "layers": [{"mediaType": OCI_LAYER, "digest": d["digest"], "size": d["size"]} for d in descs],
        }
        manifest_desc = {"mediaType": OCI_MANIFEST, **put(_json_blob(manifest))}
        manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": ref}
        if name:
            manifest_desc["annotations"][CONTAINERD_NAME] = name
        manifest_desc["platform"] = {"architecture": _arch(), "os": "linux"}
        (layout / "index.json").write_bytes(
            _json_blob({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [manifest_desc]})
        )
        (layout / "oci-layout").write_bytes(_json_blob({"imageLayoutVersion": "1.0.0"}))
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            for name in ["oci-layout", "index.json", "blobs", "blobs/sha256"] + [
                f"blobs/sha256/{d}" for d in sorted(os.listdir(blobs))
            ]:
                info = tar.gettarinfo(layout / name, arcname=name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = epoch, 0, 0, "", ""
                info.mode = 0o755 if info.isdir() else 0o644
                if info.isdir():
                    tar.addfile(info)
                else:
                    with open(layout / name, "rb") as src:
                        tar.addfile(info, src)
        partial.rename(out)
    return str(manifest_desc["digest"])


def unpack(archive: Path, dest: Path, skip: int = 0) -> dict[str, Any]:
    """Extract an archive's (single-manifest) layers into `dest`, owners kept, whiteouts applied;
    returns its config. `skip`: the first layers are there already (hack/images.sh mounts the
    cached dependency layer's tree under `dest`)."""
    with tarfile.open(archive) as outer:

        def blob(digest: str) -> IO[bytes]:
            f = outer.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
            if f is None:
                raise ValueError(f"{archive}: blob {digest} missing")
            return f

        index = json.load(blob_of(outer, "index.json"))
        manifest = json.load(blob(index["manifests"][0]["digest"]))
        config: dict[str, Any] = json.load(blob(manifest["config"]["digest"]))
        dest.mkdir(parents=True, exist_ok=True)
        for layer in manifest["layers"][skip:]:
            with tarfile.open(fileobj=blob(layer["digest"]), mode="r|gz") as tar:
                for member in tar:
                    parent, _, base = member.name.rpartition("/")
                    if base == OPAQUE:
                        for entry in os.listdir(dest / parent):
                            _remove(dest / parent / entry)
                    elif base.startswith(WHITEOUT):
                        _remove(dest / parent / base.removeprefix(WHITEOUT))
                    else:  # our own archive: keep modes (/tmp 1777) and owners
                        tar.extract(member, dest, numeric_owner=True, filter="fully_trusted")
    return config


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def blob_of(tar: tarfile.TarFile, name: str) -> IO[bytes]:
    f = tar.extractfile(name)
    if f is None:
        raise ValueError(f"{name} missing")
    return f


def run_argv(config: dict[str, Any], args: list[str]) -> list[str]:
    """`docker run IMAGE ARGS...` as an argv to chroot into the unpacked root: only the image's ENV,
    its WORKDIR, its USER, ENTRYPOINT + (ARGS or CMD). setpriv is util-linux's (essential in Debian)."""
    cfg = config["config"]
    user, _, group = str(cfg.get("User") or "0").partition(":")
    command = [*cfg.get("Entrypoint", []), *(args or cfg.get("Cmd", []))]
    switch = 'u="$0" g="$1"; cd "$2"; shift 2; exec setpriv --reuid="$u" --regid="$g" --clear-groups "$@"'
    return [
        "/usr/bin/env",
        "-i",
        *cfg.get("Env", []),
        "/bin/sh",
        "-c",
        switch,
        user,
        group or user,
        cfg.get("WorkingDir") or "/",
        *command,
    ]


def _arch() -> str:
    machine = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _rfc3339(epoch: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    cfg = sub.add_parser("config", help="the Dockerfile's final-stage config as OCI image config JSON")
    cfg.add_argument("--dockerfile", type=Path, required=True)
    cfg.add_argument("--base-path", required=True, help="PATH of the base image")
    ly = sub.add_parser("layer", help="one gzip layer of a tree (and BLOB.json); prints its descriptor")
    ly.add_argument("--rootfs", type=Path, required=True)
    ly.add_argument("--out", type=Path, required=True)
    ly.add_argument("--epoch", type=int, default=int(os.environ.get("SOURCE_DATE_EPOCH", "0")))
    pk = sub.add_parser("pack", help="pack layers (blobs of `layer`, then a rootfs) as an OCI archive")
    pk.add_argument("--layer", type=Path, action="append", default=[], help="a blob of `layer`, bottom first")
    pk.add_argument("--rootfs", type=Path, help="a tree packed as the top layer")
    pk.add_argument("--config", type=Path, required=True, help="image config JSON (from `config`)")
    pk.add_argument(
        "--ref", required=True, help="tag recorded in index.json (org.opencontainers.image.ref.name)"
    )
    pk.add_argument("--name", default="", help=f"full image name recorded as {CONTAINERD_NAME}")
    pk.add_argument("--out", type=Path, required=True)
    pk.add_argument("--epoch", type=int, default=int(os.environ.get("SOURCE_DATE_EPOCH", "0")))
    up = sub.add_parser("unpack", help="extract an OCI archive's layers; prints its config JSON")
    up.add_argument("--archive", type=Path, required=True)
    up.add_argument("--out", type=Path, required=True)
    up.add_argument("--skip", type=int, default=0, help="layers already under --out (not extracted)")
    ra = sub.add_parser("run-argv", help="NUL-separated argv running the image (see run_argv)")
    ra.add_argument("--config", type=Path, required=True, help="config JSON (from `unpack`)")
    ra.add_argument("args", nargs="*")
    args = parser.parse_args(argv)
    if args.cmd == "unpack":
        print(json.dumps(unpack(args.archive, args.out, args.skip), indent=2))
        return 0
    if args.cmd == "run-argv":
        sys.stdout.write("\0".join(run_argv(json.loads(args.config.read_text()), args.args)) + "\0")
        return 0
    if args.cmd == "config":
        print(json.dumps(dockerfile_config(args.dockerfile.read_text(), args.base_path), indent=2))
        return 0
    if args.cmd == "layer":
        print(json.dumps(write_layer(args.rootfs, args.out, args.epoch)))
        return 0
    config = json.loads(args.config.read_text())
    digest = pack(args.rootfs, config, args.ref, args.out, args.epoch, args.name, tuple(args.layer))
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
