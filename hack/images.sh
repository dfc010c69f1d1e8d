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
#   redis image:  the tools are there; `redis-server` answers `redis-cli ping` as uid 999
#   pause image:  /pause runs and exits 0 on SIGTERM
set -euo pipefail
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

[[ "$(id -u)" -eq 0 ]] || { log "needs root (debootstrap, chroot)"; exit 1; }
for tool in debootstrap unshare chroot curl; do
  command -v "${tool}" >/dev/null || { log "${tool} not found (apt-get install debootstrap util-linux curl)"; exit 1; }
done
if want relayfleet; then
  [[ -x "${redis_server}" ]] || { log "${redis_server} not found (the relay image's smoke test needs it)"; exit 1; }
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/relayfleet-images.XXXXXX")"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL "${pid}" 2>/dev/null || true; done
  wait 2>/dev/null || true
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

# base ROOTFS-NAME PARENT-OR-"" PACKAGES...: a cached base rootfs; prints its directory.
base() {
  local name="$1" parent="$2"
  shift 2
  local recipe key dir
  recipe="$(printf '%s\n' "v1" "${suite}" "${mirror}" "${security}" "${parent}" "$@")"
  # base_setup: a shell step before the packages go in (a user whose uid they must not pick)
  [[ -z "${base_setup-}" ]] || recipe+=$'\n'"${base_setup}"
  key="$(printf '%s' "${recipe}" | rf_key)"
  dir="${cache}/image-base/${name}-${key}"
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

# image NAME DOCKERFILE BASE EXTRAS: the rootfs in ${work}/NAME with the venv, ready to pack.
# pip runs inside the rootfs (its python3.11 decides environment markers: Debian's 3.11.2 needs
# async-timeout where the release venv's newer 3.11 does not), online, with the project's pip
# cache bind-mounted at /root/.cache/pip (so nothing of it lands in the image).
image() {
  local name="$1" dockerfile="$2" base_dir="$3" extras="$4"
  local rfs="${work}/${name}"
  cp -a "${base_dir}" "${rfs}"
  mkdir -p "${rfs}/tmp/wheels" "${rfs}/root/.cache/pip" "${cache}/pip"
  cp "${wheel}" "${rfs}/tmp/wheels/"
  cp /etc/resolv.conf "${rfs}/etc/resolv.conf"
  # pip in the rootfs trusts what the host's pip trusts (a site's TLS-intercepting proxy CA), for this step only
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "${rfs}/tmp/wheels/host-ca.pem"
  unshare --mount --propagation private --pid --fork --kill-child -- sh -c '
    set -e; d="$1" c="$2"; shift 2
    mount -t proc proc "$d/proc"
    mount --rbind /dev "$d/dev"
    mount --bind "$c" "$d/root/.cache/pip"
    rc=0; chroot "$d" "$@" || rc=$?
    exit "$rc"' in_root "${rfs}" "${cache}/pip" \
    /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SOURCE_DATE_EPOCH="${epoch}" PIP_CERT=/tmp/wheels/host-ca.pem PIP_INDEX_URL="${PIP_INDEX_URL:-https://pypi.org/simple}" sh -c '
    set -e
    python3.11 -m venv /opt/venv
    /opt/venv/bin/pip install -q --upgrade pip
    /opt/venv/bin/pip install -q "$(ls /tmp/wheels/*.whl)[$1]"' sh "${extras}" >&2
  rm -rf "${rfs}/tmp/wheels" "${rfs}/root/.cache" "${rfs}/etc/resolv.conf"
  "${py}" "${root}/hack/oci_image.py" config --dockerfile "${root}/${dockerfile}" \
    --base-path /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin >"${work}/${name}.image-config.json"
}

# pack_and_unpack NAME [TAG]: dist/NAME-image-<v>.oci.tar, then its layer unpacked into ${work}/NAME.run
pack_and_unpack() {
  local name="$1" tag="${2:-${version}}" out="${dist}/$1-image-${version}.oci.tar"
  local digest
  digest="$("${py}" "${root}/hack/oci_image.py" pack --rootfs "${work}/${name}" --config "${work}/${name}.image-config.json" \
    --ref "${tag}" --name "ghcr.io/relayfleet/${name}:${tag}" --epoch "${epoch}" --out "${out}")"
  log "${out##*/}: ghcr.io/relayfleet/${name}:${tag} manifest ${digest} ($(du -m "${out}" | cut -f1) MiB)"
  if command -v skopeo >/dev/null; then
    skopeo inspect --config "oci-archive:${out}:${tag}" >/dev/null \
      || { log "skopeo inspect oci-archive:${out} failed"; exit 1; }
  fi
  rm -rf "${work:?}/${name}"
  "${py}" "${root}/hack/oci_image.py" unpack --archive "${out}" --out "${work}/${name}.run" >"${work}/${name}.run.config.json"
  # what a container runtime provides: /etc/hosts naming the pod's hostname (Spark resolves it)
  [[ ! -d "${work}/${name}.run/etc" ]] ||
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t%s\n' "$(hostname)" >"${work}/${name}.run/etc/hosts"
}

relay_pkgs=(python3.11 python3.11-venv python3 ca-certificates netbase tzdata)
spark_pkgs=(openjdk-17-jre-headless tini procps)
redis_pkgs=(redis-server redis-sentinel redis-tools)
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

if want relayfleet; then
  # --- relayfleet (Dockerfile) ----------------------------------------------------------------
  image relayfleet Dockerfile "${relay_base}" operator
  in_root "${work}/relayfleet" sh -c 'groupadd --gid 10001 relayfleet && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin relayfleet'
  pack_and_unpack relayfleet
fi
if want relayfleet-spark; then
  # --- relayfleet-spark (Dockerfile.spark) ----------------------------------------------------
  image relayfleet-spark Dockerfile.spark "${spark_base}" spark,operator
  rfs="${work}/relayfleet-spark"
  in_root "${rfs}" sh -c 'groupadd --gid 185 spark && useradd --uid 185 --gid 185 --no-create-home --home-dir /app --shell /usr/sbin/nologin spark'
  ln -s /opt/venv/lib/python3.11/site-packages/pyspark "${rfs}/opt/spark"
  mkdir -p "${rfs}/app"
  (cd "${root}" && git ls-files -z spark_jobs | tar --null -T - -cf -) | tar -xf - -C "${rfs}/app" --no-same-owner
  install -m 0755 "${root}/e2e/docker/spark-entrypoint.sh" "${rfs}/opt/entrypoint.sh"
  [[ -x "${rfs}/usr/lib/jvm/java-17-openjdk-amd64/bin/java" ]] || { log "JAVA_HOME of Dockerfile.spark is not in the rootfs"; exit 1; }
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
  image_argv "${run}" python -c '
from pyspark.sql import SparkSession
s = SparkSession.builder.master("local[1]").appName("image-smoke").getOrCreate()
print("rows", s.range(1000).selectExpr("sum(id) AS t").first()["t"])
s.stop()'
  in_root "${run}" "${argv[@]}" >"${work}/spark-job.txt" 2>"${work}/spark-job.err" \
    || { tail -30 "${work}/spark-job.err" >&2; exit 1; }
  grep -q '^rows 499500$' "${work}/spark-job.txt" \
    || { log "the local PySpark job gave a wrong answer"; tail -20 "${work}/spark-job.txt" "${work}/spark-job.err" >&2; exit 1; }
  log "relayfleet-spark image: $(grep -m1 -o 'version [0-9.]*' "${work}/spark-version.txt"); local[1] job ok"
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
