#!/usr/bin/env bash
# `make e2e-kind`: the e2e suite (e2e/) on a kind cluster with real kubelets and real images.
#
# Needs: Docker (running), kind, kubectl, helm (3.x) on PATH, and the dev venv (make venv-dev).
# Creates the cluster (unless it exists), builds the three images, loads them into the nodes, and
# runs pytest e2e/ against it; the tests install the chart themselves (helm install with the
# image tags below). The cluster is kept for inspection unless RELAYFLEET_KIND_DELETE=1.
#
# Environment:
#   RELAYFLEET_KIND_CLUSTER  cluster name            (default relayfleet-e2e)
#   RELAYFLEET_IMAGE_TAG     tag for the images      (default e2e)
#   RELAYFLEET_KIND_DELETE   1: delete the cluster at the end
#   PYTEST_ARGS              extra pytest arguments
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
cluster="${RELAYFLEET_KIND_CLUSTER:-relayfleet-e2e}"
tag="${RELAYFLEET_IMAGE_TAG:-e2e}"
relay_image="ghcr.io/relayfleet/relayfleet:${tag}"
spark_image="ghcr.io/relayfleet/relayfleet-spark:${tag}"
redis_image="ghcr.io/relayfleet/redis:${tag}"
python="${root}/.venv/bin/python"

need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "e2e-kind: $1 is required but not on PATH ($2)" >&2
    exit 2
  fi
}
need docker "https://docs.docker.com/engine/install/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh/docs/intro/install/"
if ! docker info >/dev/null 2>&1; then
  echo "e2e-kind: the Docker daemon is not reachable (is it running? may this user use it?)" >&2
  exit 2
fi
if [ ! -x "$python" ]; then
  echo "e2e-kind: ${python} is missing: run 'make venv-dev' first" >&2
  exit 2
fi

workdir="$(mktemp -d)"
kubeconfig="${workdir}/kubeconfig"
cleanup() {
  if [ "${RELAYFLEET_KIND_DELETE:-0}" = "1" ]; then
    kind delete cluster --name "$cluster" || true
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT

if kind get clusters | grep -qx "$cluster"; then
  echo "e2e-kind: reusing cluster ${cluster}"
else
  kind create cluster --name "$cluster" --config "${here}/cluster.yaml" --wait 180s
fi
kind get kubeconfig --name "$cluster" >"$kubeconfig"

echo "e2e-kind: building ${relay_image}, ${spark_image} and ${redis_image}"
docker build -t "$relay_image" -f "${root}/Dockerfile" "$root"
docker build -t "$spark_image" -f "${root}/Dockerfile.spark" "$root"
docker build -t "$redis_image" -f "${root}/Dockerfile.redis" "$root"
# the previous release for the upgrade test (e2e/test_upgrade.py names it), built from its tree
previous_commit="$(sed -n 's/^PREVIOUS = "\([0-9a-f]*\)"$/\1/p' "${root}/e2e/test_upgrade.py")"
previous_image="$(sed -n 's/^PREVIOUS_IMAGE = "\(.*\)"$/\1/p' "${root}/e2e/test_upgrade.py")"
git -C "$root" archive --format=tar "$previous_commit" | docker build -t "$previous_image" -
kind load docker-image --name "$cluster" "$relay_image" "$spark_image" "$redis_image" "$previous_image"

# The chart and the RelayShards use these images; IfNotPresent keeps kubelets off the registry.
helm_args=(
  "--set" "image.tag=${tag}"
  "--set" "image.pullPolicy=IfNotPresent"
  "--set" "spark.image.tag=${tag}"
  "--set" "spark.image.pullPolicy=IfNotPresent"
  "--set" "redis.image.tag=${tag}"
)
export RELAYFLEET_E2E_HELM_ARGS="${helm_args[*]}"
export RELAYFLEET_E2E_SHARD_IMAGE="${relay_image}"

# shellcheck disable=SC2086 # PYTEST_ARGS is a list of words on purpose
"$python" -m pytest "${root}/e2e" --kubeconfig "$kubeconfig" -p no:cacheprovider ${PYTEST_ARGS:-}
