#!/usr/bin/env bash
# The images make cluster's node runs (docs/e2e.md): OCI archives built by hack/images.sh with no
# Docker daemon and no registry, cached under ${cache_root}/cluster-images, and imported into the
# node's containerd (hack/cluster.sh up runs `import`).
#
# Usage: hack/cluster-images.sh ref NAME | archive NAME | build [NAME...] | import SOCKET [NAME...] | --help
#   NAME    relayfleet, relayfleet-spark, redis, pause (default: all four)
#   ref     the image's name in containerd: what the chart's values and a RelayShard's
#           spec.redis.managed.image name on this node (pause: containerd's sandbox_image)
#   archive the archive's path in the cache for the tree as it is now (built or not)
#   build   builds each archive not cached yet (as root: debootstrap, chroot); prints their paths
#   import  build, then `ctr -n k8s.io images import` each archive into the containerd at SOCKET
#           (each archive names its image: no --base-name, no retagging), unless that containerd
#           has this very archive already (recorded next to SOCKET, in imported/NAME): after a
#           code change only the relay and Spark images load, and of them containerd unpacks
#           only the code layer (the dependency layer's snapshot is there, same digest)
# Cache keys: relayfleet and relayfleet-spark by the content of what they are made of (the
# product's files, tracked or not, the Dockerfiles, the image scripts), so an edit rebuilds them;
# redis by its recipe (Dockerfile.redis, hack/images.sh), pause by that and the Kubernetes version.
#
# Environment: RELAYFLEET_CACHE_DIR, RELAYFLEET_BUILD_NICE (hack/lib.sh); PYTHON (default .venv's)
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rf_init cluster-images
py="${PYTHON:-${repo_root}/.venv/bin/python}"
all=(relayfleet relayfleet-spark redis pause)

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }

kube_version() { sed -n 's/^KUBE_VERSION="\(.*\)"$/\1/p' "${repo_root}/hack/control-plane.sh"; }
project_version() { python3 "${repo_root}/hack/version.py"; }

tag_of() { # name
  case "$1" in
    pause) kube_version ;;
    relayfleet | relayfleet-spark | redis) project_version ;;
    *) die "unknown image $1 (${all[*]})" ;;
  esac
}

ref() {
  local tag
  tag="$(tag_of "$1")"
  printf 'ghcr.io/relayfleet/%s:%s\n' "$1" "${tag}"
}

key_of() { # name: the content key of what the image is made of
  local -a inputs=(hack/images.sh hack/oci_image.py)
  case "$1" in
    relayfleet | relayfleet-spark)
      inputs+=(relay operator spark_jobs pyproject.toml README.md requirements hack/lock.py Dockerfile Dockerfile.spark e2e/docker) ;;
    redis) inputs+=(Dockerfile.redis) ;;
    pause) ;; # pause.c of the pinned Kubernetes version: its tag, in the key below
  esac
  (
    cd "${repo_root}"
    printf '%s\n' "$1" "$(tag_of "$1")"
    git ls-files -z --cached --others --exclude-standard -- "${inputs[@]}" | sort -zu |
      while IFS= read -r -d '' f; do [[ -f "${f}" ]] && sha256sum -- "${f}"; done
  ) | rf_key
}

archive_of() { printf '%s/cluster-images/%s-%s.oci.tar\n' "${cache_root}" "$1" "$(key_of "$1")"; }

missing_of() { # name...: into ${missing[@]}, those whose archive is not cached yet
  missing=()
  local name
  for name in "$@"; do
    [[ -f "$(archive_of "${name}")" ]] || missing+=("${name}")
  done
}

build() { # name...
  local -a missing
  missing_of "$@"
  if ((${#missing[@]} > 0)); then
    rf_lock .cluster-images.lock
    build_missing "$@"
  fi
  local name archive
  for name in "$@"; do
    archive="$(archive_of "${name}")"
    touch "${archive}" # its mtime: when a tree last used it (prune keeps the latest)
    printf '%s\n' "${archive}"
  done
}

# prune NAME: keep the 3 archives of NAME used last, remove older ones (a CI machine's cache
# would otherwise grow by both images, ~770 MiB, with every commit)
prune() {
  local -a old
  mapfile -t old < <(find "${cache_root}/cluster-images" -maxdepth 1 -name "$1-????????????????.oci.tar" -printf '%T@ %p\n' |
    sort -rn | tail -n +4 | cut -d' ' -f2-)
  ((${#old[@]} == 0)) || { rm -f -- "${old[@]}"; log "removed ${#old[@]} older $1 archive(s) from the cache"; }
}

build_missing() { # name...: under the lock, again
  local -a missing
  missing_of "$@"
  ((${#missing[@]} > 0)) || return 0
  [[ "$(id -u)" -eq 0 ]] || die "building ${missing[*]} needs root (debootstrap, chroot)"
  local out t0=${SECONDS} wheel="-" version
  version="$(project_version)"
  out="$(mktemp -d "${TMPDIR:-/tmp}/relayfleet-cluster-images.XXXXXX")"
  # shellcheck disable=SC2064  # out is fixed now
  trap "rm -rf '${out}'" EXIT
  if printf '%s\n' "${missing[@]}" | grep -q '^relayfleet'; then
    [[ -x "${py}" ]] || die "no ${py} (make venv-dev, or set PYTHON)"
    log "wheel of the work tree"
    rf_nice "${py}" -m build --wheel --outdir "${out}/wheel" "${repo_root}" >"${out}/build.log" 2>&1 ||
      { tail -20 "${out}/build.log" >&2; die "building the wheel failed"; }
    wheel="$(ls "${out}"/wheel/*.whl)"
  fi
  log "building ${missing[*]} (hack/images.sh)"
  PYTHON="${py}" rf_nice bash "${repo_root}/hack/images.sh" "${version}" "${wheel}" "${out}" "${missing[@]}"
  mkdir -p "${cache_root}/cluster-images"
  for name in "${missing[@]}"; do
    mv -f "${out}/${name}-image-${version}.oci.tar" "$(archive_of "${name}")"
    prune "${name}"
  done
  log "built ${missing[*]} in $((SECONDS - t0))s"
}

import() { # socket name...: each archive not imported into that containerd yet
  local sock="$1" archive name i
  shift
  local t0=${SECONDS} record_dir
  record_dir="${sock%/*}/imported"
  mapfile -t archives < <(build "$@")
  mkdir -p "${record_dir}"
  local -a names=("$@") loaded=()
  local refs
  refs="$(ctr --address "${sock}" -n k8s.io images ls -q)"
  for i in "${!names[@]}"; do
    name="${names[i]}" archive="${archives[i]}"
    # the same archive (content key) imported before and its name still there: nothing to load
    if [[ "$(cat "${record_dir}/${name}" 2>/dev/null)" == "${archive}" ]] && grep -qxF "$(ref "${name}")" <<<"${refs}"; then
      continue
    fi
    ctr --address "${sock}" -n k8s.io images import "${archive}" >/dev/null ||
      die "ctr images import ${archive} failed"
    ctr --address "${sock}" -n k8s.io images ls -q | grep -qxF "$(ref "${name}")" ||
      die "containerd has no $(ref "${name}") after the import"
    printf '%s\n' "${archive}" >"${record_dir}/${name}"
    loaded+=("${name}")
  done
  if ((${#loaded[@]} == 0)); then
    log "$* unchanged: nothing imported ($((SECONDS - t0))s)"
  else
    log "imported ${loaded[*]} in $((SECONDS - t0))s"
  fi
}

cmd="${1-}"
shift || true
case "${cmd}" in
  ref) [[ $# -eq 1 ]] || { usage >&2; exit 2; }; ref "$1" ;;
  archive) [[ $# -eq 1 ]] || { usage >&2; exit 2; }; tag_of "$1" >/dev/null; archive_of "$1" ;;
  build) (($# > 0)) || set -- "${all[@]}"; build "$@" ;;
  import)
    [[ $# -ge 1 ]] || { usage >&2; exit 2; }
    sock="$1"
    shift
    (($# > 0)) || set -- "${all[@]}"
    import "${sock}" "$@"
    ;;
  -h | --help) usage ;;
  *) usage >&2; exit 2 ;;
esac
