#!/usr/bin/env bash
# `make release`: every release artifact into dist/, checked. Nothing is pushed anywhere.
#
#   dist/relayfleet-<v>-py3-none-any.whl, dist/relayfleet-<v>.tar.gz   (twine check --strict)
#   dist/relayfleet-<v>.tgz                                            (helm lint --strict, helm package)
#   dist/relayfleet-image-<v>.tar, dist/relayfleet-spark-image-<v>.tar, dist/redis-image-<v>.tar
#        (docker build + docker save, where a Docker daemon answers)
#   else dist/relayfleet-image-<v>.oci.tar, dist/relayfleet-spark-image-<v>.oci.tar,
#        dist/redis-image-<v>.oci.tar (hack/images.sh: the same images from Debian packages, no
#        daemon, as root; each one run; each archive names its image ghcr.io/relayfleet/NAME:<v>;
#        taken from hack/cluster-images.sh's cache when `make e2e` already built this content)
#   dist/SHA256SUMS
#
# The version comes from pyproject.toml alone (hack/version.py --check fails on any drift).
# The Dockerfiles are linted with hadolint (errors fail the release) whether or not images can
# be built. RELAYFLEET_RELEASE_IMAGES=daemonless takes the OCI path even where a daemon answers.
# With neither a daemon nor root + debootstrap the images are not built and the script says so on
# stderr and in dist/IMAGES-NOT-BUILT; RELAYFLEET_RELEASE_REQUIRE_IMAGES=1 makes that a failure.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rf_init release
root="${repo_root}"
cd "${root}"
py="${PYTHON:-.venv/bin/python}"
bin="$(dirname "${py}")"

"${py}" hack/version.py --check
version="$("${py}" hack/version.py)"
log "version ${version} (tag v${version})"
if ! { cmp -s crds/relayshards.yaml charts/relayfleet/crds/relayshards.yaml &&
  cmp -s crds/relayrebalances.yaml charts/relayfleet/crds/relayrebalances.yaml; }; then
  log "charts/relayfleet/crds differs from crds/: run make chart-crds"
  exit 1
fi

rm -rf dist
mkdir -p dist
build_dir="$(mktemp -d)"
trap 'rm -rf "${build_dir}"' EXIT

log "wheel + sdist"
"${py}" -m build --sdist --wheel --outdir dist/ . >"${build_dir}/build.log" 2>&1 \
  || { cat "${build_dir}/build.log" >&2; exit 1; }
"${bin}/twine" check --strict dist/*.whl dist/*.tar.gz
# the product only: the tools (tools/, the relayfleet-testing distribution) never ship in it
"${py}" - dist/*.whl <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tools = [n for n in names if n.split("/")[0] == "relayfleet_testing"
         or n.startswith(("relay/bench/", "relay/dev.py", "relay/demo.py", "relay/localredis.py"))]
if tools:
    sys.exit(f"the wheel holds tools: {tools[:5]}")
PY

helm="${HELM:-$(bash hack/control-plane.sh --check 2>/dev/null || true)/helm}"
cache="${cache_root}"
pinned="$(sed -n 's/^HELM_VERSION="\(.*\)"$/\1/p' hack/control-plane.sh)"
[[ -x "${helm}" ]] || helm="${cache}/helm/${pinned}/bin/helm"
[[ -x "${helm}" ]] || helm="$(command -v helm || true)"
[[ -x "${helm}" ]] || { log "helm not found: run hack/control-plane.sh (or set HELM)"; exit 1; }
log "chart"
"${helm}" lint --strict charts/relayfleet
"${helm}" package charts/relayfleet --destination dist/ >/dev/null
[[ -f "dist/relayfleet-${version}.tgz" ]] || { log "helm package did not write dist/relayfleet-${version}.tgz"; exit 1; }

log "Dockerfiles (hadolint)"
"${bin}/hadolint" --failure-threshold error Dockerfile Dockerfile.spark Dockerfile.redis

if docker info >/dev/null 2>&1 && [[ "${RELAYFLEET_RELEASE_IMAGES:-auto}" != daemonless ]]; then
  for spec in "relayfleet:Dockerfile" "relayfleet-spark:Dockerfile.spark" "redis:Dockerfile.redis"; do
    name="${spec%%:*}" file="${spec#*:}"
    log "image ghcr.io/relayfleet/${name}:${version}"
    docker build -f "${file}" -t "ghcr.io/relayfleet/${name}:${version}" .
    docker save -o "dist/${name}-image-${version}.tar" "ghcr.io/relayfleet/${name}:${version}"
  done
elif [[ "$(id -u)" -eq 0 ]] && command -v debootstrap >/dev/null; then
  # No daemon: the same three images as OCI archives, built from Debian packages (hack/images.sh).
  # hack/cluster-images.sh keeps them keyed by the content they are made of (the product's
  # files, the Dockerfiles, the image scripts): what `make e2e` built and ran for this tree is
  # what ships, built (and smoke-run) once, not a second time here.
  log "images without a Docker daemon (hack/images.sh through hack/cluster-images.sh): OCI archives"
  images=(relayfleet relayfleet-spark redis)
  mapfile -t archives < <(PYTHON="${py}" bash hack/cluster-images.sh build "${images[@]}")
  ((${#archives[@]} == ${#images[@]})) ||
    { log "hack/cluster-images.sh build named ${#archives[@]} archives, not ${#images[@]}"; exit 1; }
  for i in "${!images[@]}"; do
    # a copy, not a link: whatever is done to dist/ later never reaches the cache
    cp --reflink=auto "${archives[i]}" "dist/${images[i]}-image-${version}.oci.tar"
  done
else
  reason="no Docker daemon answers 'docker info', and the daemonless build (hack/images.sh) needs root and debootstrap"
  printf 'images ghcr.io/relayfleet/relayfleet:%s, relayfleet-spark:%s and redis:%s not built: %s\n' \
    "${version}" "${version}" "${version}" "${reason}" >dist/IMAGES-NOT-BUILT
  log "IMAGES NOT BUILT: ${reason}"
  [[ "${RELAYFLEET_RELEASE_REQUIRE_IMAGES:-0}" != 1 ]] || exit 1
fi

(cd dist && sha256sum -- * >SHA256SUMS)
log "done:"
ls -l dist >&2
