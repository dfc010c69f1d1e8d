#!/usr/bin/env bash
# Build the real DIDComm agents tests/relay/didcomm/test_didcomm_agents.py talks to.
#
# Askar's libaries_askar.so comes out of PyPI's aries-askar wheel (hash-pinned, by
# `uname -m`: x86_64 or aarch64; no cargo build), Credo-ts from npm (its native FFI
# modules rebuilt here, the Askar binary its install script would fetch from GitHub
# replaced by the wheel's), ACA-Py from PyPI into its own Python 3.13 venv. Each part
# is cached under the cache root (pip's cache in its pip/), keyed by its version (or by
# the lockfile's hash), and the script is a no-op once they exist.
#
# The DIDComm v2 clients (Hyperledger Identus SDK, Veramo's did-comm) are npm trees
# installed from their lockfiles (e2e/didcomm/identus, e2e/didcomm/veramo), pure
# JavaScript and WebAssembly, keyed by the lockfile and the node version.
#
# Usage: hack/didcomm-toolchain.sh [all | askar | credo | credo-push | acapy | identus | veramo | env | --help]
#   all    (default) build what is missing, then print the env lines below
#   credo-push  build only the Credo 0.5 push agent and its Askar 0.3.2, then print the env lines
#   env    print, without building, KEY=VALUE lines for the test:
#          LIB_ASKAR_PATH (dir of libaries_askar.so), DIDCOMM_CREDO_DIR
#          (dir with node_modules), DIDCOMM_ACAPY_BIN (the aca-py script),
#          LIB_ASKAR_LEGACY_PATH and DIDCOMM_CREDO_PUSH_DIR (the Credo 0.5 agent of
#          e2e/didcomm/credo-push: @credo-ts/push-notifications 0.7.1 needs Credo 0.5, whose
#          aries-askar-nodejs 0.2 binds Askar 0.3's C ABI; it crashes on 0.4's),
#          DIDCOMM_IDENTUS_DIR, DIDCOMM_VERAMO_DIR (the v2 clients' dirs with node_modules)
# Progress goes to stderr; stdout carries only the env lines.
#
# Environment:
#   RELAYFLEET_CACHE_DIR   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/relayfleet)
#   RELAYFLEET_BUILD_NICE  niceness of the builds (default 10)
#   DIDCOMM_PYTHON313      a Python >= 3.13 for ACA-Py (default: pyenv's 3.13.x, then python3.13)
# See docs/e2e.md ("DIDComm e2e toolchain").
set -euo pipefail

# ---- pins ------------------------------------------------------------------
ASKAR_VERSION="0.4.6"
# The Askar of Credo 0.5's aries-askar-nodejs 0.2.x (the push-notifications agent): it binds
# 0.3.2's C ABI (0.3.1 lacks its askar_key_get_supported_backends; 0.4 crashes it).
ASKAR_LEGACY_VERSION="0.3.2"
# sha256 of PyPI's aries-askar wheels (py3-none-manylinux2014_<arch>), by version-arch: each
# carries the release's libaries_askar.so (0.4.6's exports the C symbols of a cargo build with
# features ffi,logger,sqlite,migration).
declare -A ASKAR_WHEEL_SHA256=(
  [0.4.6-x86_64]=86785548e24765a102f68b7d6655b87ad4c13e903a36ee679ba68617bfcd3cfb
  [0.4.6-aarch64]=3907aef5aeebf5613e4392612e84bc01d8bde3a4d5eddf5ab047872f35a65517
  [0.3.2-x86_64]=63f9ab97db4778ced830a6d1135e1f8bd1ca564de27218bd114f1cffbd31b04c
  [0.3.2-aarch64]=176eebcf833bb9974a162fd931c8d67669e4f0145b351ce9cb1289fd2d5a345c
)
# acapy-agent 1.7 needs Python >= 3.13.
ACAPY_VERSION="1.7.0"

usage() { sed -n '2,31p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rf_init didcomm-toolchain

askar_dir="${cache_root}/askar-${ASKAR_VERSION}"
askar_legacy_dir="${cache_root}/askar-${ASKAR_LEGACY_VERSION}"

build_askar() {
  install_askar_version "${ASKAR_VERSION}"
}

build_askar_legacy() {
  install_askar_version "${ASKAR_LEGACY_VERSION}"
}

# A Python with pip for the wheel download: the project venv's (make builds it before this
# script), else python3 on PATH.
askar_python() {
  local c
  for c in "${repo_root}/.venv/bin/python" "$(command -v python3 || true)"; do
    [[ -n "${c}" && -x "${c}" ]] || continue
    if "${c}" -m pip --version >/dev/null 2>&1; then
      echo "${c}"
      return 0
    fi
  done
  return 1
}

install_askar_version() { # version: libaries_askar.so from PyPI's hash-pinned aries-askar wheel
  local version="$1"
  local dir="${cache_root}/askar-${version}"
  local lib="${dir}/lib/libaries_askar.so"
  if [[ -f "${lib}" ]]; then return 0; fi
  rf_lock .didcomm.lock
  if [[ -f "${lib}" ]]; then return 0; fi  # installed by another run meanwhile
  local arch hashes py
  arch="$(uname -m)"
  hashes="${ASKAR_WHEEL_SHA256["${version}-${arch}"]:-}"
  [[ -n "${hashes}" ]] || die "no pinned aries-askar ${version} wheel for ${arch}"
  py="$(askar_python)" || die "a Python with pip is needed for the aries-askar wheel (make venv)"
  log "aries-askar ${version}: libaries_askar.so from PyPI's manylinux2014_${arch} wheel"
  local t0=${SECONDS} work="${dir}/work"
  rm -rf "${work}" && mkdir -p "${work}/wheel"
  printf 'aries-askar==%s --hash=sha256:%s\n' "${version}" "${hashes}" >"${work}/requirements.txt"
  # the wheel is py3-none (the library is loaded through ctypes): any Python version tag fits
  PIP_CACHE_DIR="${cache_root}/pip" "${py}" -m pip download -q --disable-pip-version-check \
    --no-deps --only-binary=:all: --require-hashes --platform "manylinux2014_${arch}" \
    --python-version 3.11 -d "${work}/wheel" -r "${work}/requirements.txt" >&2
  mkdir -p "${dir}/lib"
  "${py}" - "${work}/wheel" "${lib}.tmp" <<'PY'
import pathlib, shutil, sys, zipfile
(wheel,) = pathlib.Path(sys.argv[1]).glob("aries_askar-*.whl")
with zipfile.ZipFile(wheel) as z, z.open("aries_askar/libaries_askar.so") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "${lib}.tmp" "${lib}"
  rm -rf "${work}"
  log "aries-askar ${version} ready in $((SECONDS - t0)) s: ${lib}"
}

acapy_dir="${cache_root}/acapy-${ACAPY_VERSION}"
acapy_bin="${acapy_dir}/venv/bin/aca-py"

find_python313() {
  local c
  for c in "${DIDCOMM_PYTHON313:-}" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[3-9]*/bin/python3 \
    "$(command -v python3.13 || true)" "$(command -v python3.14 || true)"; do
    [[ -n "${c}" && -x "${c}" ]] || continue
    if "${c}" -c 'import sys; sys.exit(sys.version_info < (3, 13))' 2>/dev/null; then
      echo "${c}"
      return 0
    fi
  done
  return 1
}

build_acapy() {
  if [[ -f "${acapy_dir}/.done" ]]; then return 0; fi
  rf_lock .didcomm.lock
  if [[ -f "${acapy_dir}/.done" ]]; then return 0; fi  # built by another run meanwhile
  local py
  py="$(find_python313)" || die "acapy-agent ${ACAPY_VERSION} needs Python >= 3.13 (set DIDCOMM_PYTHON313)"
  log "installing acapy-agent ${ACAPY_VERSION} into a venv of ${py}"
  local t0=${SECONDS}
  # A venv's scripts carry its absolute path, so it is built in place; .done marks it whole.
  rm -rf "${acapy_dir}" && "${py}" -m venv "${acapy_dir}/venv"
  rf_nice "${acapy_dir}/venv/bin/pip" install -q --disable-pip-version-check \
    "acapy-agent==${ACAPY_VERSION}" >&2
  "${acapy_bin}" --version >/dev/null || die "aca-py ${ACAPY_VERSION} does not start"
  touch "${acapy_dir}/.done"
  log "acapy-agent ${ACAPY_VERSION} installed in $((SECONDS - t0)) s"
}

# Native modules are built against this node's ABI: each key covers the lockfile and node.
credo_key_of() { { cat "$1/package-lock.json"; node --version 2>/dev/null || true; } | rf_key; }
credo_src="${repo_root}/e2e/didcomm/credo"
credo_dir="${cache_root}/credo-$(credo_key_of "${credo_src}")"
credo_push_src="${repo_root}/e2e/didcomm/credo-push"
credo_push_dir="${cache_root}/credo-push-$(credo_key_of "${credo_push_src}")"

build_credo() {
  build_node_modules "${credo_src}" "${credo_dir}"
}

build_credo_push() {
  build_node_modules "${credo_push_src}" "${credo_push_dir}"
}

build_node_modules() { # source dir (package.json + package-lock.json), cache dir
  local src="$1" dir="$2"
  if [[ -f "${dir}/.done" ]]; then return 0; fi
  rf_lock .didcomm.lock
  if [[ -f "${dir}/.done" ]]; then return 0; fi  # built by another run meanwhile
  command -v npm >/dev/null || die "node and npm are needed for the Credo-ts agent"
  log "installing the node_modules of ${src#"${repo_root}/"} into ${dir}"
  local t0=${SECONDS} work="${dir}.tmp"
  rm -rf "${work}" && mkdir -p "${work}"
  cp "${src}/package.json" "${src}/package-lock.json" "${work}/"
  # --ignore-scripts: askar-nodejs' install script downloads a prebuilt Askar, which we
  # build ourselves instead (LIB_ASKAR_PATH). The two FFI modules are compiled here
  # against the local node headers.
  (cd "${work}" && rf_nice npm ci -s --ignore-scripts --no-audit --no-fund >&2 &&
    npm_config_nodedir="${DIDCOMM_NODEDIR:-/usr}" rf_nice \
      npm rebuild -s @2060.io/ref-napi @2060.io/ffi-napi >&2)
  [[ -f "${work}/node_modules/@2060.io/ffi-napi/build/Release/ffi_bindings.node" ]] ||
    die "ffi-napi did not build (node headers under ${DIDCOMM_NODEDIR:-/usr}/include/node?)"
  rm -rf "${dir}" && mv "${work}" "${dir}"
  touch "${dir}/.done"
  log "node_modules ready in $((SECONDS - t0)) s: ${dir}"
}

# The v2 clients: `npm ci` of a lockfile, no install scripts (none of their packages
# needs one: core-js prints a banner, postinstall-postinstall is empty). Cached under
# <name>-<key of lockfile and node version>; .done marks the tree whole. Only what npm installs
# is cached: the agents' scripts (agent.mjs, the shared e2e/didcomm/lib/; Credo's too) are copied
# beside a link to the tree at every start (tests/support/didcomm_stock_agents.py): not in the key.
npm_tree_dir() {
  echo "${cache_root}/$1-$(credo_key_of "${repo_root}/e2e/didcomm/$1")"
}
identus_dir="$(npm_tree_dir identus)"
veramo_dir="$(npm_tree_dir veramo)"

build_npm_tree() {
  local name="$1" dir="$2" src="${repo_root}/e2e/didcomm/$1"
  if [[ -f "${dir}/.done" ]]; then return 0; fi
  rf_lock .didcomm.lock
  if [[ -f "${dir}/.done" ]]; then return 0; fi  # built by another run meanwhile
  command -v npm >/dev/null || die "node and npm are needed for the ${name} agent"
  log "installing the ${name} agent's node_modules (${dir##*/})"
  local t0=${SECONDS} work="${dir}.tmp"
  rm -rf "${work}" && mkdir -p "${work}"
  cp "${src}/package.json" "${src}/package-lock.json" "${work}/"
  (cd "${work}" && rf_nice npm ci -s --ignore-scripts --no-audit --no-fund >&2)
  rm -rf "${dir}" && mv "${work}" "${dir}"
  touch "${dir}/.done"
  log "${name} node_modules ready in $((SECONDS - t0)) s: ${dir}"
}

print_env() {
  echo "LIB_ASKAR_PATH=${askar_dir}/lib"
  echo "DIDCOMM_CREDO_DIR=${credo_dir}"
  echo "DIDCOMM_ACAPY_BIN=${acapy_bin}"
  echo "LIB_ASKAR_LEGACY_PATH=${askar_legacy_dir}/lib"
  echo "DIDCOMM_CREDO_PUSH_DIR=${credo_push_dir}"
  echo "DIDCOMM_IDENTUS_DIR=${identus_dir}"
  echo "DIDCOMM_VERAMO_DIR=${veramo_dir}"
}

cmd="${1:-all}"
case "${cmd}" in
  -h | --help) usage ;;
  askar) build_askar ;;
  acapy) build_acapy ;;
  credo) build_credo ;;
  credo-push)  # one command each: inside an && list a failing build would not stop the script
    build_credo_push
    build_askar_legacy
    print_env
    ;;
  identus) build_npm_tree identus "${identus_dir}" ;;
  veramo) build_npm_tree veramo "${veramo_dir}" ;;
  env) print_env ;;
  all)
    build_credo
    build_credo_push
    build_askar_legacy
    build_npm_tree identus "${identus_dir}"
    build_npm_tree veramo "${veramo_dir}"
    build_acapy
    build_askar
    print_env
    ;;
  *) die "unknown command ${cmd}" ;;
esac
