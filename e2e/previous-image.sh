#!/usr/bin/env bash
# The previous release's relay image for e2e/test_upgrade.py, ghcr.io/relayfleet/relayfleet:0.1.0,
# imported into the node of `make cluster`.
#
# usage: e2e/previous-image.sh SOCKET | --build   (as root; SOCKET: the node's containerd socket;
#        --build: only build it into the cache, .ci/run does that beside make test)
#
# Built once from the previous release's tree (`git archive` of the commit test_upgrade.py names):
# a wheel of it, then hack/images.sh's recipe for the relay image, its dependencies resolved from
# that wheel as that release did (RELAYFLEET_IMAGES_LOCK=none: not this tree's lock). The archive is cached under
# ${cache_root}/cluster-images/ by that commit; later runs only import it.
set -euo pipefail
sock="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/lib.sh
source "${here}/../hack/lib.sh"
rf_init previous-image
py="${PYTHON:-${repo_root}/.venv/bin/python}"
commit="$(sed -n 's/^PREVIOUS = "\([0-9a-f]*\)"$/\1/p' "${here}/test_upgrade.py")"
version="$(sed -n 's|^PREVIOUS_IMAGE = "ghcr.io/relayfleet/relayfleet:\(.*\)"$|\1|p' "${here}/test_upgrade.py")"
[[ -n "${commit}" && -n "${version}" ]] || die "no PREVIOUS / PREVIOUS_IMAGE in e2e/test_upgrade.py"
archive="${cache_root}/cluster-images/relayfleet-${version}-${commit}.oci.tar"

if [[ ! -f "${archive}" ]]; then
  rf_lock .previous-image.lock
fi
if [[ ! -f "${archive}" ]]; then
  work="$(mktemp -d "${TMPDIR:-/tmp}/relayfleet-previous.XXXXXX")"
  # shellcheck disable=SC2064  # work is fixed now
  trap "rm -rf '${work}'" EXIT
  t0=${SECONDS}
  log "the ${version} tree (git archive ${commit})"
  git -C "${repo_root}" archive --format=tar "${commit}" | tar -xf - -C "${work}" --one-top-level=tree
  rf_nice "${py}" -m build --wheel --outdir "${work}/wheel" "${work}/tree" >"${work}/build.log" 2>&1 ||
    { tail -20 "${work}/build.log" >&2; die "building the ${version} wheel failed"; }
  mkdir -p "${work}/out"
  RELAYFLEET_IMAGES_LOCK=none PYTHON="${py}" rf_nice bash "${repo_root}/hack/images.sh" "${version}" "$(ls "${work}"/wheel/*.whl)" "${work}/out" relayfleet
  mkdir -p "${cache_root}/cluster-images"
  mv -f "${work}/out/relayfleet-image-${version}.oci.tar" "${archive}"
  log "built in $((SECONDS - t0)) s: ${archive}"
fi
[[ "${sock}" != --build ]] || exit 0
ctr --address "${sock}" -n k8s.io images import "${archive}" >/dev/null
ctr --address "${sock}" -n k8s.io images ls -q | grep -qxF "ghcr.io/relayfleet/relayfleet:${version}" ||
  die "containerd has no ghcr.io/relayfleet/relayfleet:${version} after the import"
log "ghcr.io/relayfleet/relayfleet:${version} imported"
