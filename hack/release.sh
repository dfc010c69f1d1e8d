#!/usr/bin/env bash
# `make release`: every release artifact into dist/, checked. Nothing is pushed anywhere.
#
#   dist/relayfleet-<v>-py3-none-any.whl, dist/relayfleet-<v>.tar.gz   (twine check --strict)
#   dist/relayfleet-<v>.tgz                                            (helm lint --strict, helm package)
#   dist/relayfleet-image-<v>.tar, dist/relayfleet-spark-image-<v>.tar (docker build + docker save,
#                                                                       only where a Docker daemon answers)
#   dist/SHA256SUMS
#
# The version comes from pyproject.toml alone (hack/version.py --check fails on any drift).
# Both Dockerfiles are linted with hadolint (errors fail the release) whether or not images can
# be built. Without a daemon the images are not built and the script says so on stderr and in
# dist/IMAGES-NOT-BUILT; RELAYFLEET_RELEASE_REQUIRE_IMAGES=1 makes that a failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"
py="${PYTHON:-.venv/bin/python}"
bin="$(dirname "${py}")"
log() { printf '[release] %s\n' "$*" >&2; }

"${py}" hack/version.py --check
version="$("${py}" hack/version.py)"
log "version ${version} (tag v${version})"
cmp -s crds/relayshards.yaml charts/relayfleet/crds/relayshards.yaml \
  && cmp -s crds/relayrebalances.yaml charts/relayfleet/crds/relayrebalances.yaml \
  || { log "charts/relayfleet/crds differs from crds/: run make chart-crds"; exit 1; }

rm -rf dist
mkdir -p dist
build_dir="$(mktemp -d)"
trap 'rm -rf "${build_dir}"' EXIT

log "wheel + sdist"
"${py}" -m build --sdist --wheel --outdir dist/ . >"${build_dir}/build.log" 2>&1 \
  || { cat "${build_dir}/build.log" >&2; exit 1; }
"${bin}/twine" check --strict dist/*.whl dist/*.tar.gz

helm="${HELM:-$(bash hack/control-plane.sh --check 2>/dev/null || true)/helm}"
cache="${RELAYFLEET_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/relayfleet}"
pinned="$(sed -n 's/^HELM_VERSION="\(.*\)"$/\1/p' hack/control-plane.sh)"
[[ -x "${helm}" ]] || helm="${cache}/helm/${pinned}/bin/helm"
[[ -x "${helm}" ]] || helm="$(command -v helm || true)"
[[ -x "${helm}" ]] || { log "helm not found: run hack/control-plane.sh (or set HELM)"; exit 1; }
log "chart"
"${helm}" lint --strict charts/relayfleet
"${helm}" package charts/relayfleet --destination dist/ >/dev/null
[[ -f "dist/relayfleet-${version}.tgz" ]] || { log "helm package did not write dist/relayfleet-${version}.tgz"; exit 1; }

log "Dockerfiles (hadolint)"
"${bin}/hadolint" --failure-threshold error Dockerfile Dockerfile.spark

if docker info >/dev/null 2>&1; then
  for spec in "relayfleet:Dockerfile" "relayfleet-spark:Dockerfile.spark"; do
    name="${spec%%:*}" file="${spec#*:}"
    log "image ghcr.io/relayfleet/${name}:${version}"
    docker build -f "${file}" -t "ghcr.io/relayfleet/${name}:${version}" .
    docker save -o "dist/${name}-image-${version}.tar" "ghcr.io/relayfleet/${name}:${version}"
  done
else
  reason="no Docker daemon answers 'docker info' (and no other image builder is installed)"
  printf 'images ghcr.io/relayfleet/relayfleet:%s and relayfleet-spark:%s not built: %s\n' \
    "${version}" "${version}" "${reason}" >dist/IMAGES-NOT-BUILT
  log "IMAGES NOT BUILT: ${reason}"
  [[ "${RELAYFLEET_RELEASE_REQUIRE_IMAGES:-0}" != 1 ]] || exit 1
fi

(cd dist && sha256sum -- * >SHA256SUMS)
log "done:"
ls -l dist >&2
