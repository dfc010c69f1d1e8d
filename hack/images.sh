#!/usr/bin/env bash
# shellcheck disable=SC2016  # sh -c scripts in single quotes expand in the chroot, on purpose
# The container images without a Docker daemon (hack/release.sh calls this where no daemon answers
# for the first three; hack/cluster-images.sh for all four, make cluster's node):
#
#   DISTDIR/relayfleet-image-<v>.oci.tar        Dockerfile:       relay + operator, `.[operator]`
#   DISTDIR/relayfleet-spark-image-<v>.oci.tar  Dockerfile.spark: Spark jobs, `.[spark,operator]`
#   DISTDIR/redis-image-<v>.oci.tar             Dockerfile.redis: Debian's redis-server and
#                                               redis-sentinel as uid 999, with the tools the
#                                               operator's Redis scripts use
#   DISTDIR/pause-image-<v>.oci.tar             the Pod sandbox: pause.c of the k8s.io/kubernetes
#                                               module hack/control-plane.sh pins, static (gcc)
#
# usage: hack/images.sh VERSION WHEEL DISTDIR [IMAGE...]   (as root: debootstrap, chroot, unshare)
#   IMAGE: relayfleet, relayfleet-spark (the default: both), redis, pause; WHEEL is unused ("-")
#   unless a relayfleet image is asked for.
# Each archive's index names its image ghcr.io/relayfleet/NAME:TAG (TAG: VERSION; pause: the pinned
# Kubernetes version), so a plain `ctr -n k8s.io images import FILE` gives that name.
#
# Each image is the Dockerfile's recipe on a Debian bookworm rootfs made by `debootstrap
# --variant=minbase` from the apt mirror (Debian's python3.11 in place of python:3.11-slim, whose
# CPython is built from source under /usr/local), with security updates applied. The base rootfs
# is cached under ${cache}/image-base keyed by a hash of its recipe (packages, suites, mirror),
# so a repeated release only installs the wheel and packs. The venv /opt/venv is made in the
# rootfs by its own python3.11 and filled offline from a wheelhouse the release venv's pip
# builds (pip cache: ${cache}/pip). Users, ENV, USER, WORKDIR, EXPOSE, ENTRYPOINT and CMD are
# the Dockerfile's (hack/oci_image.py config reads them from it). Then each archive is unpacked
# again and run in a chroot (separate mount and pid namespaces) as the image's user:
#   relay image:  `relayfleet --help`; `relayfleet relay` answers /healthz 200 against a redis-server
#   spark image:  `spark-submit --version` through tini + the entrypoint; a local[1] PySpark job
#                 (once per dependency layer: it exercises only the JVM and pyspark)
#   redis image:  the tools are there; `redis-server` answers `redis-cli ping` as uid 999
#   pause image:  /pause runs and exits 0 on SIGTERM
set -euo pipefail
# --deps-keys: print each layered image's dependency-layer cache key and stop (no root needed;
# tests/project/test_cluster_node.py checks what changes them)
keys_only=""
if [[ "${1-}" == --deps-keys ]]; then keys_only=1; set -- - - - relayfleet relayfleet-spark; fi
version="$1" wheel="$2" dist="$3"
shift 3
wanted=("$@")
((${#wanted[@]} > 0)) || wanted=(relayfleet relayfleet-spark)
want() { printf '%s\n' "${wanted[@]}" | grep -qxF -- "$1"; }
for name in "${wanted[@]}"; do
  case "${name}" in
    relayfleet | relayfleet-spark | redis | pause) ;;
    *) printf 'images: unknown image %s (relayfleet, relayfleet-spark, redis, pause)\n' "${name}" >&2; exit 2 ;;
  esac
done
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rf_init images
root="${repo_root}"
py="${PYTHON:-${root}/.venv/bin/python}"
cache="${cache_root}"
mirror="${RELAYFLEET_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${RELAYFLEET_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
suite=bookworm
redis_server="${REDIS_SERVER:-/usr/bin/redis-server}"
# SOURCE_DATE_EPOCH (reproducible builds): the commit's time, else the version's release time is unknown: 0
epoch="${SOURCE_DATE_EPOCH:-$(git -C "${root}" log -1 --format=%ct 2>/dev/null || echo 0)}"

if [[ -z "${keys_only}" ]]; then
  [[ "$(id -u)" -eq 0 ]] || { log "needs root (debootstrap, chroot)"; exit 1; }
  for tool in debootstrap unshare chroot curl; do
    command -v "${tool}" >/dev/null || { log "${tool} not found (apt-get install debootstrap util-linux curl)"; exit 1; }
  done
  if want relayfleet; then
    [[ -x "${redis_server}" ]] || { log "${redis_server} not found (the relay image's smoke test needs it)"; exit 1; }
  fi
  if { want relayfleet || want relayfleet-spark; } && [[ "${RELAYFLEET_IMAGES_LOCK:-}" != none ]]; then
    "${py}" "${root}/hack/lock.py" --check || exit 1
  fi
fi

# The whole build in a mount namespace of its own: the overlayfs mounts below (and anything a
# step mounts) go away with it, whatever ends the script.
if [[ -z "${keys_only}" && "${RELAYFLEET_IMAGES_NS-}" != "$$" ]]; then
  RELAYFLEET_IMAGES_NS=$$ exec unshare --mount --propagation private -- "${BASH}" "${BASH_SOURCE[0]}" "${version}" "${wheel}" "${dist}" "${wanted[@]}"
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/relayfleet-images.XXXXXX")"
pids=()
mounts=()
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL "${pid}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null || true; done
  rm -rf "${work}"
}
trap cleanup EXIT

# in_root DIR CMD...: CMD chrooted into DIR with /proc and /dev, in private mount + pid namespaces,
# so nothing stays mounted and nothing keeps running when it ends. sh stays the namespace's pid 1
# (no exec): a SIGKILL of unshare reaches it (--kill-child; the parent-death signal would be
# cleared in CMD when it changes user) and the kernel then kills everything in the namespace.
ns=(unshare --mount --propagation private --pid --fork --kill-child -- sh -c '
  set -e; d="$1"; shift
  mount -t proc proc "$d/proc"
  mount --rbind /dev "$d/dev"
  rc=0; chroot "$d" "$@" || rc=$?
  exit "$rc"' in_root)
in_root() { "${ns[@]}" "$@"; }
# image_argv DIR [ARGS...]: into ${argv[@]}, `docker run IMAGE ARGS...` for the unpacked DIR: the
# image's ENV only, its WORKDIR and USER, ENTRYPOINT + (ARGS or CMD) (hack/oci_image.py run-argv).
image_argv() {
  local dir="$1"
  shift
  mapfile -d '' -t argv < <("${py}" "${root}/hack/oci_image.py" run-argv --config "${dir}.config.json" -- "$@")
  [[ "${#argv[@]}" -gt 3 ]] || { log "no run argv for ${dir}"; exit 1; }
}

# base_dir_of ROOTFS-NAME PARENT-OR-"" PACKAGES...: where that base rootfs is cached
base_dir_of() {
  local name="$1" parent="$2"
  shift 2
  local recipe
  recipe="$(printf '%s\n' "v1" "${suite}" "${mirror}" "${security}" "${parent}" "$@")"
  # base_setup: a shell step before the packages go in (a user whose uid they must not pick)
  [[ -z "${base_setup-}" ]] || recipe+=$'\n'"${base_setup}"
  printf '%s/image-base/%s-%s\n' "${cache}" "${name}" "$(printf '%s' "${recipe}" | rf_key)"
}

# base ROOTFS-NAME PARENT-OR-"" PACKAGES...: a cached base rootfs; prints its directory.
base() {
  local name="$1" parent="$2"
  shift 2
  local key dir
  dir="$(base_dir_of "${name}" "${parent}" "$@")"
  key="${dir##*-}"
  if [[ -d "${dir}" ]]; then
    log "base ${name}: cached (${dir})"
    printf '%s\n' "${dir}"
    return
  fi
  mkdir -p "${cache}/image-base"
  local tmp="${cache}/image-base/.${name}-${key}.$$"
  rm -rf "${tmp}"
  local started=${SECONDS}
  if [[ -z "${parent}" ]]; then
    # the packages go in with apt below: debootstrap's own resolver misses alternatives
    log "base ${name}: debootstrap --variant=minbase ${suite} + $*"
    debootstrap --variant=minbase "${suite}" "${tmp}" "${mirror}" >"${work}/debootstrap-${name}.log" 2>&1 \
      || { tail -30 "${work}/debootstrap-${name}.log" >&2; [[ -f "${tmp}/debootstrap/debootstrap.log" ]] && tail -30 "${tmp}/debootstrap/debootstrap.log" >&2; rm -rf "${tmp}"; exit 1; }
    cat >"${tmp}/etc/apt/sources.list" <<EOF
deb ${mirror} ${suite} main
deb ${mirror} ${suite}-updates main
deb ${security} ${suite}-security main
EOF
  else
    log "base ${name}: ${parent##*/} + $*"
    cp -a "${parent}" "${tmp}"
  fi
  cp /etc/resolv.conf "${tmp}/etc/resolv.conf"
  in_root "${tmp}" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    BASE_SETUP="${base_setup-}" sh -c '
    set -e
    eval "${BASE_SETUP}"
    apt-get update -qq
    apt-get -y -qq -o Dpkg::Options::=--force-confold upgrade >/dev/null
    if [ "$#" -gt 0 ]; then apt-get install -y -qq --no-install-recommends "$@" >/dev/null; fi
    apt-get clean
    rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/apt/* /var/log/*.log /tmp/* /root/.cache' sh "$@" \
    >"${work}/apt-${name}.log" 2>&1 || { tail -30 "${work}/apt-${name}.log" >&2; rm -rf "${tmp}"; exit 1; }
  rm -f "${tmp}/etc/resolv.conf"
  : >"${tmp}/etc/hostname"
  # a concurrent release may have finished the same base first: keep theirs
  mv -T "${tmp}" "${dir}" 2>/dev/null || rm -rf "${tmp}"
  log "base ${name}: built in $((SECONDS - started)) s"
  printf '%s\n' "${dir}"
}

# in_root_pip DIR CMD...: in_root with the project's pip cache at /root/.cache/pip (so nothing of
# it lands in the image), the host's resolver and CA bundle (a site's TLS-intercepting proxy) for
# this step only, and pip's settings; SOURCE_DATE_EPOCH: the caller's ${layer_epoch}
in_root_pip() {
  local dir="$1"
  shift
  mkdir -p "${dir}/tmp/build" "${dir}/root/.cache/pip" "${cache}/pip"
  cp /etc/resolv.conf "${dir}/etc/resolv.conf"
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "${dir}/tmp/build/host-ca.pem"
  unshare --mount --propagation private --pid --fork --kill-child -- sh -c '
    set -e; d="$1" c="$2"; shift 2
    mount -t proc proc "$d/proc"
    mount --rbind /dev "$d/dev"
    mount --bind "$c" "$d/root/.cache/pip"
    rc=0; chroot "$d" "$@" || rc=$?
    exit "$rc"' in_root "${dir}" "${cache}/pip" \
    /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 SOURCE_DATE_EPOCH="${layer_epoch}" PIP_CERT=/tmp/build/host-ca.pem \
    PIP_INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}" "$@" >&2
  rm -rf "${dir}/tmp/build" "${dir}/root/.cache" "${dir}/etc/resolv.conf"
}

# The two layers of the relayfleet and relayfleet-spark images (Dockerfile, Dockerfile.spark):
#   dependencies  the base rootfs + the image's users + /opt/venv holding the image's locked set
#                 (requirements/NAME.txt, `make lock`: pip --require-hashes --no-deps); cached
#                 under ${cache}/image-deps/NAME-KEY as a tree and as its packed layer, KEY: the
#                 base, the lock, this recipe; built once per locked set, never per commit (the 2
#                 used last of each image are kept)
#   code          the relayfleet wheel installed --no-deps (`pip check` then proves the lock
#                 complete), for Spark also /app/spark_jobs and the entrypoint: the upper dir of
#                 an overlayfs on the dependency tree, packed alone (a few MiB)
# So a code change repacks only the code layer, and the dependency layer keeps its digest (a
# node's containerd keeps its unpacked snapshot). RELAYFLEET_IMAGES_LOCK=none (the previous
# release's image, e2e/previous-image.sh): no lock; the code layer installs the wheel with its
# dependencies, resolved online, as that release did.
deps_recipe_version=1
relay_users='groupadd --gid 10001 relayfleet && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin relayfleet'
spark_users='groupadd --gid 185 spark && useradd --uid 185 --gid 185 --no-create-home --home-dir /app --shell /usr/sbin/nologin spark'
# /opt/spark: the pyspark wheel's tree (SPARK_HOME of Dockerfile.spark)
spark_setup="${spark_users}"' && ln -s /opt/venv/lib/python3.11/site-packages/pyspark /opt/spark && mkdir -p /app'

lock_of() { # name: the lock file the image installs, or "" (RELAYFLEET_IMAGES_LOCK=none)
  [[ "${RELAYFLEET_IMAGES_LOCK:-}" == none ]] || printf '%s\n' "${root}/requirements/$1.txt"
}

# deps_epoch LOCK: the layer's mtime clamp: the lock's own commit (author) time, so the layer is
# the same bytes for every commit that keeps the lock
deps_epoch() {
  local t=""
  [[ -z "$1" ]] || t="$(git -C "${root}" log -1 --format=%at -- "$1" 2>/dev/null || true)"
  printf '%s\n' "${t:-${epoch}}"
}

# deps_key NAME BASE-DIR SETUP: the dependency layer's cache key
deps_key() {
  local lock
  lock="$(lock_of "$1")"
  {
    printf '%s\n' "deps-v${deps_recipe_version}" "$1" "${2##*/}" "$3" "$(deps_epoch "${lock}")"
    if [[ -n "${lock}" ]]; then sha256sum <"${lock}"; else echo "no lock"; fi
  } | rf_key
}

# deps_layer NAME BASE-DIR SETUP: the cached dependency layer's directory (rootfs/, layer.tar.gz
# and its .json descriptor); builds it if missing.
deps_layer() {
  local name="$1" base_dir="$2" setup="$3"
  local key dir lock layer_epoch kind="${name}"
  key="$(deps_key "${name}" "${base_dir}" "${setup}")"
  # the previous release's (no lock) apart: prune below counts only the locked sets' layers
  [[ -n "$(lock_of "${name}")" ]] || kind="${name}-nolock"
  dir="${cache}/image-deps/${kind}-${key}"
  if [[ -f "${dir}/layer.tar.gz.json" ]]; then
    log "dependency layer ${name}: cached (${dir})"
    touch "${dir}" # when a build last used it (prune keeps the latest)
    printf '%s\n' "${dir}"
    return
  fi
  lock="$(lock_of "${name}")"
  layer_epoch="$(deps_epoch "${lock}")"
  local started=${SECONDS} tmp="${cache}/image-deps/.${name}-${key}.$$"
  rm -rf "${tmp}"
  mkdir -p "${tmp}"
  cp -a "${base_dir}" "${tmp}/rootfs"
  local req=""
  if [[ -n "${lock}" ]]; then
    log "dependency layer ${name}: ${lock#"${root}"/} ($(grep -c '==' "${lock}") pins)"
    mkdir -p "${tmp}/rootfs/tmp/build"
    cp "${lock}" "${tmp}/rootfs/tmp/requirements.txt"
    req=/tmp/requirements.txt
  fi
  in_root_pip "${tmp}/rootfs" sh -c '
    set -e
    eval "$1"
    python3.11 -m venv /opt/venv
    /opt/venv/bin/pip install -q --upgrade pip
    if [ -n "$2" ]; then /opt/venv/bin/pip install -q --require-hashes --no-deps -r "$2"; fi' sh "${setup}" "${req}"
  rm -f "${tmp}/rootfs/tmp/requirements.txt"
  "${py}" "${root}/hack/oci_image.py" layer --rootfs "${tmp}/rootfs" --out "${tmp}/layer.tar.gz" --epoch "${layer_epoch}" >/dev/null
  # a concurrent build may have finished the same layer first: keep theirs
  mv -T "${tmp}" "${dir}" 2>/dev/null || rm -rf "${tmp}"
  log "dependency layer ${name}: built in $((SECONDS - started)) s ($(du -m "${dir}/layer.tar.gz" | cut -f1) MiB packed)"
  # keep the 2 layers of this kind used last (a lock change adds 0.5 GiB, or 2.4 GiB for Spark)
  local -a old
  mapfile -t old < <(find "${cache}/image-deps" -mindepth 1 -maxdepth 1 -type d -name "${kind}-????????????????" -printf '%T@ %p\n' |
    sort -rn | tail -n +3 | cut -d' ' -f2-)
  ((${#old[@]} == 0)) || { rm -rf -- "${old[@]}"; log "removed ${#old[@]} older ${kind} dependency layer(s) from the cache"; }
  printf '%s\n' "${dir}"
}

# overlay LOWER DIR: DIR (made here) is an overlayfs on LOWER, its changes in DIR.upper (this
# script's own mount namespace: everything mounted goes with it)
overlay() {
  mkdir -p "$2" "$2.upper" "$2.ovl-work"
  mount -t overlay overlay -o "lowerdir=$1,upperdir=$2.upper,workdir=$2.ovl-work" "$2"
  mounts+=("$2")
}

# code_layer NAME DEPS-DIR EXTRAS: ${work}/NAME.code.tar.gz (+ .json), the wheel on the dependency
# tree; the tree itself stays mounted at ${work}/NAME for the image-specific steps below
code_layer() {
  local name="$1" deps="$2" extras="$3" rfs="${work}/$1" layer_epoch="${epoch}"
  overlay "${deps}/rootfs" "${rfs}"
  mkdir -p "${rfs}/tmp/wheels"
  cp "${wheel}" "${rfs}/tmp/wheels/"
  if [[ -n "$(lock_of "${name}")" ]]; then
    in_root_pip "${rfs}" sh -c '
      set -e
      /opt/venv/bin/pip install -q --no-index --no-deps /tmp/wheels/*.whl
      /opt/venv/bin/pip check >/dev/null || { /opt/venv/bin/pip check; echo "the lock misses a dependency: make lock" >&2; exit 1; }'
  else
    in_root_pip "${rfs}" sh -c '/opt/venv/bin/pip install -q "$(ls /tmp/wheels/*.whl)[$1]"' sh "${extras}"
  fi
  rm -rf "${rfs}/tmp/wheels"
}

# finish_code_layer NAME DOCKERFILE: pack the upper dir; the image config from the Dockerfile
finish_code_layer() {
  local name="$1" rfs="${work}/$1"
  umount "${rfs}"
  # what the steps left that is no image content: the mount points' and /tmp's copied-up entries
  "${py}" "${root}/hack/oci_image.py" layer --rootfs "${rfs}.upper" --out "${work}/${name}.code.tar.gz" --epoch "${epoch}" >/dev/null
  log "code layer ${name}: $(du -k "${work}/${name}.code.tar.gz" | cut -f1) KiB"
  "${py}" "${root}/hack/oci_image.py" config --dockerfile "${root}/$2" \
    --base-path /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin >"${work}/${name}.image-config.json"
}

# pack_and_unpack NAME [TAG]: dist/NAME-image-<v>.oci.tar, then unpacked for the runs below into
# ${work}/NAME.run: a layered image's code layer onto an overlay of its cached dependency tree
# (the dependency layer in the archive is that tree's cached blob, its digest checked in pack),
# a single-layer image whole
pack_and_unpack() {
  local name="$1" tag="${2:-${version}}" out="${dist}/$1-image-${version}.oci.tar"
  local digest deps="${deps_dir[$1]-}"
  local -a layers=(--rootfs "${work}/${name}")
  [[ -z "${deps}" ]] || layers=(--layer "${deps}/layer.tar.gz" --layer "${work}/${name}.code.tar.gz")
  digest="$("${py}" "${root}/hack/oci_image.py" pack "${layers[@]}" --config "${work}/${name}.image-config.json" \
    --ref "${tag}" --name "ghcr.io/relayfleet/${name}:${tag}" --epoch "${epoch}" --out "${out}")"
  log "${out##*/}: ghcr.io/relayfleet/${name}:${tag} manifest ${digest} ($(du -m "${out}" | cut -f1) MiB)"
  if command -v skopeo >/dev/null; then
    skopeo inspect --config "oci-archive:${out}:${tag}" >/dev/null \
      || { log "skopeo inspect oci-archive:${out} failed"; exit 1; }
  fi
  rm -rf "${work:?}/${name}" "${work:?}/${name}.upper" "${work:?}/${name}.ovl-work"
  local skip=0
  if [[ -n "${deps}" ]]; then
    overlay "${deps}/rootfs" "${work}/${name}.run"
    skip=1
  fi
  "${py}" "${root}/hack/oci_image.py" unpack --archive "${out}" --out "${work}/${name}.run" --skip "${skip}" >"${work}/${name}.run.config.json"
  # what a container runtime provides: /etc/hosts naming the pod's hostname (Spark resolves it)
  [[ ! -d "${work}/${name}.run/etc" ]] ||
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t%s\n' "$(hostname)" >"${work}/${name}.run/etc/hosts"
}

relay_pkgs=(python3.11 python3.11-venv python3 ca-certificates netbase tzdata)
spark_pkgs=(openjdk-17-jre-headless tini procps)
redis_pkgs=(redis-server redis-sentinel redis-tools)
if [[ -n "${keys_only}" ]]; then
  relay_base="$(base_dir_of relay "" "${relay_pkgs[@]}")"
  printf 'relayfleet %s\n' "$(deps_key relayfleet "${relay_base}" "${relay_users}")"
  printf 'relayfleet-spark %s\n' "$(deps_key relayfleet-spark "$(base_dir_of spark "${relay_base}" "${spark_pkgs[@]}")" "${spark_setup}")"
  exit 0
fi
started=${SECONDS}
if want relayfleet || want relayfleet-spark; then
  relay_base="$(base relay "" "${relay_pkgs[@]}")"
fi
if want relayfleet-spark; then
  spark_base="$(base spark "${relay_base}" "${spark_pkgs[@]}")"
fi
if want redis; then
  # uid/gid 999 before Debian's package would pick a system uid of its own (the operator runs
  # Redis as 999); home /data, the volume the operator mounts
  base_setup='groupadd --system --gid 999 redis && useradd --system --uid 999 --gid 999 --no-create-home --home-dir /data --shell /usr/sbin/nologin redis'
  redis_base="$(base redis "" "${redis_pkgs[@]}")"
  base_setup=""
fi
log "bases ready in $((SECONDS - started)) s"

declare -A deps_dir=()
if want relayfleet; then
  # --- relayfleet (Dockerfile) ----------------------------------------------------------------
  deps_dir[relayfleet]="$(deps_layer relayfleet "${relay_base}" "${relay_users}")"
  code_layer relayfleet "${deps_dir[relayfleet]}" operator
  finish_code_layer relayfleet Dockerfile
  pack_and_unpack relayfleet
fi
if want relayfleet-spark; then
  # --- relayfleet-spark (Dockerfile.spark) ----------------------------------------------------
  deps_dir[relayfleet-spark]="$(deps_layer relayfleet-spark "${spark_base}" "${spark_setup}")"
  code_layer relayfleet-spark "${deps_dir[relayfleet-spark]}" spark,operator
  rfs="${work}/relayfleet-spark"
  (cd "${root}" && git ls-files -z spark_jobs | tar --null -T - -cf -) | tar -xf - -C "${rfs}/app" --no-same-owner
  install -m 0755 "${root}/e2e/docker/spark-entrypoint.sh" "${rfs}/opt/entrypoint.sh"
  [[ -x "${rfs}/usr/lib/jvm/java-17-openjdk-amd64/bin/java" ]] || { log "JAVA_HOME of Dockerfile.spark is not in the rootfs"; exit 1; }
  finish_code_layer relayfleet-spark Dockerfile.spark
  pack_and_unpack relayfleet-spark
fi
if want redis; then
  # --- redis (Dockerfile.redis) --------------------------------------------------------------
  cp -a "${redis_base}" "${work}/redis"
  mkdir -p "${work}/redis/data"
  chown 999:999 "${work}/redis/data"
  "${py}" "${root}/hack/oci_image.py" config --dockerfile "${root}/Dockerfile.redis" \
    --base-path /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin >"${work}/redis.image-config.json"
  pack_and_unpack redis
fi
if want pause; then
  # --- pause: the sandbox every Pod starts with (containerd's sandbox_image) ------------------
  kube_version="$(sed -n 's/^KUBE_VERSION="\(.*\)"$/\1/p' "${root}/hack/control-plane.sh")"
  kube_src="$(GOMODCACHE="${cache}/go/mod" GOFLAGS=-mod=mod GOTOOLCHAIN=local \
    go mod download -json "k8s.io/kubernetes@${kube_version}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -f "${kube_src}/build/pause/linux/pause.c" ]] || { log "no build/pause/linux/pause.c in k8s.io/kubernetes@${kube_version}"; exit 1; }
  pause_tag="$(sed -n 's/^TAG ?= \(.*\)$/\1/p' "${kube_src}/build/pause/Makefile")"
  mkdir -p "${work}/pause"
  # upstream's CFLAGS (build/pause/Makefile)
  gcc -Os -Wall -Werror -static "-DVERSION=v${pause_tag}-relayfleet" -o "${work}/pause/pause" \
    "${kube_src}/build/pause/linux/pause.c"
  strip "${work}/pause/pause"
  printf '{"Entrypoint": ["/pause"], "User": "65535:65535", "Env": ["PATH=/"]}\n' >"${work}/pause.image-config.json"
  pack_and_unpack pause "${kube_version}"
fi
log "images packed in $((SECONDS - started)) s; running them"

# --- run them -----------------------------------------------------------------------------
smoke=${SECONDS}
free_port() { "${py}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
if want relayfleet; then
  run="${work}/relayfleet.run"
  image_argv "${run}" --help
  in_root "${run}" "${argv[@]}" >"${work}/help.txt"
  grep -q 'relay' "${work}/help.txt" || { log "relayfleet --help in the image printed no usage"; exit 1; }
  redis_port="$(free_port)" relay_port="$(free_port)"
  "${redis_server}" --port "${redis_port}" --bind 127.0.0.1 --save '' --appendonly no --dir "${work}" >"${work}/redis.log" 2>&1 &
  pids+=($!)
  # the image's ENTRYPOINT + CMD with the listen address and Redis URL of this test
  image_argv "${run}" relay --host 127.0.0.1 --port "${relay_port}" --redis-url "redis://127.0.0.1:${redis_port}/0"
  "${ns[@]}" "${run}" "${argv[@]}" >"${work}/relay.log" 2>&1 &
  pids+=($!)
  healthy=""
  for _ in $(seq 1 120); do
    if curl -fsS "http://127.0.0.1:${relay_port}/healthz" >"${work}/healthz.json" 2>/dev/null; then healthy=1; break; fi
    sleep 0.5
  done
  [[ -n "${healthy}" ]] || { log "the relay image's relay never answered /healthz 200:"; tail -20 "${work}/relay.log" >&2; exit 1; }
  log "relayfleet image: --help ok; relay /healthz 200: $(head -c 200 "${work}/healthz.json")"
fi
if want relayfleet-spark; then
  run="${work}/relayfleet-spark.run"
  image_argv "${run}" spark-submit --version
  in_root "${run}" "${argv[@]}" >"${work}/spark-version.txt" 2>&1 \
    || { tail -20 "${work}/spark-version.txt" >&2; exit 1; }
  grep -q 'version' "${work}/spark-version.txt" || { log "spark-submit --version printed no version"; exit 1; }
  # The local PySpark job exercises the JVM and pyspark, both of the dependency layer: once per
  # dependency layer (a marker in its cache dir), not on every code change (e2e runs the jobs)
  spark_deps="${deps_dir[relayfleet-spark]}"
  job="local[1] job ok"
  if [[ -f "${spark_deps}/local-job.ok" ]]; then
    job="local[1] job passed on this dependency layer before"
  else
    image_argv "${run}" python -c '
from pyspark.sql import SparkSession
s = SparkSession.builder.master("local[1]").appName("image-smoke").getOrCreate()
print("rows", s.range(1000).selectExpr("sum(id) AS t").first()["t"])
s.stop()'
    in_root "${run}" "${argv[@]}" >"${work}/spark-job.txt" 2>"${work}/spark-job.err" \
      || { tail -30 "${work}/spark-job.err" >&2; exit 1; }
    grep -q '^rows 499500$' "${work}/spark-job.txt" \
      || { log "the local PySpark job gave a wrong answer"; tail -20 "${work}/spark-job.txt" "${work}/spark-job.err" >&2; exit 1; }
    : >"${spark_deps}/local-job.ok"
  fi
  log "relayfleet-spark image: $(grep -m1 -o 'version [0-9.]*' "${work}/spark-version.txt"); ${job}"
fi
if want redis; then
  run="${work}/redis.run"
  in_root "${run}" sh -c 'for t in sh getent sha1sum timeout redis-cli redis-server redis-sentinel; do
    command -v "$t" >/dev/null || { echo "missing $t" >&2; exit 1; }; done'
  [[ "$(stat -c %u "${run}/data")" == 999 ]] || { log "/data in the redis image is not uid 999's"; exit 1; }
  redis_port="$(free_port)"
  image_argv "${run}" redis-server --port "${redis_port}" --bind 127.0.0.1 --save '' --appendonly no
  "${ns[@]}" "${run}" "${argv[@]}" >"${work}/redis-image.log" 2>&1 &
  pids+=($!)
  pong=""
  for _ in $(seq 1 60); do
    if [[ "$(in_root "${run}" redis-cli -p "${redis_port}" ping 2>/dev/null)" == PONG ]]; then pong=1; break; fi
    sleep 0.5
  done
  [[ -n "${pong}" ]] || { log "redis-server in the redis image never answered PING:"; tail -20 "${work}/redis-image.log" >&2; exit 1; }
  log "redis image: $(in_root "${run}" redis-server --version | cut -d' ' -f1-3); PING answered as uid 999"
fi
if want pause; then
  run="${work}/pause.run"
  # a static binary alone in its rootfs (no /proc to mount for in_root): run it as it is
  "${run}/pause" >"${work}/pause.log" 2>&1 &
  pause_pid=$!
  sleep 0.5
  kill -TERM "${pause_pid}"
  wait "${pause_pid}" || { log "/pause did not exit 0 on SIGTERM"; cat "${work}/pause.log" >&2; exit 1; }
  log "pause image: $(head -c 100 "${work}/pause.log" | tr '\n' ' ')exits 0 on SIGTERM"
fi
log "images run in $((SECONDS - smoke)) s; total $((SECONDS - started)) s"
