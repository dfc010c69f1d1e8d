#!/usr/bin/env bash
# `make e2e`: the e2e suite (e2e/) on a real cluster.
#
# With RELAYFLEET_KUBECONFIG (or `make e2e KUBECONFIG=PATH`) set: that cluster, as it is (its node
# must hold the images the chart names; docs/e2e.md). Otherwise the single-node cluster of
# `make cluster` is brought up here (it prints KUBECONFIG=<path> last) and torn down at the end
# with `make cluster-down` whether the suite passed or not, unless RELAYFLEET_E2E_KEEP_CLUSTER=1.
# A `make cluster` node that is already up was brought up by someone else: it is used (its
# images refreshed with `make cluster-images`) and left running.
#
# Environment:
#   RELAYFLEET_KUBECONFIG        an existing cluster's kubeconfig (KUBECONFIG too)
#   RELAYFLEET_E2E_KEEP_CLUSTER  1: leave the cluster this script brought up running
#   RELAYFLEET_CLUSTER_DIR       make cluster's state dir (its containerd socket), as for hack/cluster.sh
#   PYTEST_ARGS                  extra pytest arguments
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${root}/.venv/bin/python"
kubeconfig="${RELAYFLEET_KUBECONFIG:-${KUBECONFIG:-}}"
started=0

finish() {
  local rc=$?
  if [[ "${started}" == 1 && "${RELAYFLEET_E2E_KEEP_CLUSTER:-0}" != 1 ]]; then
    make -C "${root}" --no-print-directory cluster-down || rc=1
  fi
  exit "${rc}"
}
trap finish EXIT

if [[ -z "${kubeconfig}" ]] && running="$(bash "${root}/hack/cluster.sh" status 2>/dev/null)"; then
  kubeconfig="${running#KUBECONFIG=}"
  echo "e2e: make cluster's node is already up: using it, not tearing it down afterwards" >&2
  make -C "${root}" --no-print-directory cluster-images
fi
if [[ -z "${kubeconfig}" ]]; then
  started=1
  log="$(mktemp)"
  # its progress to the terminal, its last line (KUBECONFIG=...) kept
  make -C "${root}" --no-print-directory cluster | tee "${log}"
  kubeconfig="$(tail -n 1 "${log}" | sed -n 's/^KUBECONFIG=//p')"
  rm -f "${log}"
  [[ -f "${kubeconfig}" ]] || { echo "e2e: make cluster printed no KUBECONFIG=<path> last" >&2; exit 1; }
fi

# The node of `make cluster` (whether brought up here or given) gets the previous release's relay
# image for the upgrade test (built once, cached).
sock="${RELAYFLEET_CLUSTER_DIR:-/var/lib/relayfleet-cluster}/containerd/containerd.sock"
if [[ -S "${sock}" ]]; then
  bash "${root}/e2e/previous-image.sh" "${sock}"
  # the node's Redis image, for the test's RelayShards (spec.redis.managed.image)
  RELAYFLEET_E2E_REDIS_IMAGE="${RELAYFLEET_E2E_REDIS_IMAGE:-$(bash "${root}/hack/cluster-images.sh" ref redis)}"
  export RELAYFLEET_E2E_REDIS_IMAGE
fi

# The user's path first (what most of the suite builds on), the upgrade last (it swaps the CRDs).
tests=(test_user_path.py test_least_privilege.py test_faults.py test_shard_down.py test_relay_config.py test_didcomm_fleet.py test_presence_fleet.py test_upgrade.py)
# shellcheck disable=SC2086 # PYTEST_ARGS is a list of words on purpose
"${python}" -m pytest "${tests[@]/#/${root}/e2e/}" --kubeconfig "${kubeconfig}" -p no:cacheprovider -rs ${PYTEST_ARGS:-}
