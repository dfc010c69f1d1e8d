#!/usr/bin/env bash
# Build a real Kubernetes control plane for tests from source, with Go only.
#
# Every binary comes from the Go module proxy at a pinned version and is
# compiled here; nothing prebuilt is downloaded. Outputs are cached per
# component and version, and the script is a no-op once they all exist.
#
# Usage: hack/control-plane.sh [--node] [--check | --help]
# On success the only line on stdout is the bin dir holding kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, etcd, kwok, kwokctl, helm.
# Everything else (progress, timings, go output) goes to stderr.
# --node also builds what a real node runs (make cluster, hack/cluster.sh): kubelet and
#        kube-proxy from the same module, version, flags and tags as the control plane, and
#        CoreDNS from its Go module with only the plugins the cluster's DNS uses.
# --check builds nothing: prints the bin dir and exits 0 if all is built, else exits 1.
#
# Environment:
#   RELAYFLEET_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/relayfleet).
#                         It is outside the work tree on purpose: CI runs in a
#                         fresh clone on the same machine and must find it.
#   RELAYFLEET_BUILD_NICE niceness of the go builds (default 10; the machine is shared)
# See docs/control-plane.md.
set -euo pipefail

# ---- pins ------------------------------------------------------------------
# Kubernetes: CRD validation rules (x-kubernetes-validations, CEL) are GA since
# 1.29; 1.36's go.mod asks for go 1.26.0. Every staging module k8s.io/<x> is
# taken at its published v0.<minor>.<patch>.
KUBE_VERSION="v1.36.4"
# etcd: the version Kubernetes v1.36.4 itself requires and ships (build/dependencies.yaml).
ETCD_VERSION="v3.6.8"
# kwok v0.8.0 is built against k8s.io/* v0.36 and asks for go 1.26.0.
KWOK_VERSION="v0.8.0"
HELM_VERSION="v3.22.0"
# CoreDNS: the cluster DNS of make cluster's node (go 1.25 in its go.mod).
COREDNS_VERSION="v1.14.7"

usage() {
  sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

check_only=false
node=false
for arg in "$@"; do
  case "${arg}" in
    -h | --help) usage; exit 0 ;;
    --check) check_only=true ;;
    --node) node=true ;;
    *) echo "unknown argument: ${arg}" >&2; usage >&2; exit 2 ;;
  esac
done

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rf_init control-plane
kube_dir="${cache_root}/k8s/${KUBE_VERSION}"
etcd_dir="${cache_root}/etcd/${ETCD_VERSION}"
kwok_dir="${cache_root}/kwok/${KWOK_VERSION}"
helm_dir="${cache_root}/helm/${HELM_VERSION}"
coredns_dir="${cache_root}/coredns/${COREDNS_VERSION}"
bin_dir="${kube_dir}/bin"

kube_bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
# name -> real location; bin_dir gets a symlink to each so one dir has all.
declare -A linked=(
  [etcd]="${etcd_dir}/bin/etcd"
  [kwok]="${kwok_dir}/bin/kwok"
  [kwokctl]="${kwok_dir}/bin/kwokctl"
  [helm]="${helm_dir}/bin/helm"
)
node_bins=()
if [[ "${node}" == true ]]; then
  node_bins=(kubelet kube-proxy)
  linked[coredns]="${coredns_dir}/bin/coredns"
fi

all_built() {
  local name
  for name in "${kube_bins[@]}" "${node_bins[@]}" "${!linked[@]}"; do
    [[ -x "${bin_dir}/${name}" ]] || return 1
  done
}

# Fast path: nothing to do, not even to take the lock.
if all_built; then
  printf '%s\n' "${bin_dir}"
  exit 0
fi
if [[ "${check_only}" == true ]]; then
  log "not built yet: ${bin_dir}"
  exit 1
fi

command -v go >/dev/null || die "go is not on PATH"
rf_lock .build.lock
if all_built; then
  printf '%s\n' "${bin_dir}"
  exit 0
fi

export GOMODCACHE="${cache_root}/go/mod"
export GOCACHE="${cache_root}/go/build"
export GOFLAGS="-trimpath -buildvcs=false -mod=mod"
export GOTOOLCHAIN=local
export GOWORK=off
export CGO_ENABLED=0
unset GOOS GOARCH GOBIN

gorun() { rf_nice go "$@"; }

log "go: $(go version); cache: ${cache_root}"

# Build reproducibly: stamp the release time the proxy records for a module.
module_time() { # module@version -> RFC3339 UTC time
  local info
  info="$(go mod download -json "$1")" || die "go mod download $1 failed: ${info}"
  sed -n 's/^[[:space:]]*"Time": "\([^"]*\)".*/\1/p' <<<"${info}" | head -n1
}

module_gomod() { # module@version -> path of its go.mod in the module cache
  local info
  info="$(go mod download -json "$1")" || die "go mod download $1 failed: ${info}"
  sed -n 's/^[[:space:]]*"GoMod": "\([^"]*\)".*/\1/p' <<<"${info}" | head -n1
}

# A wrapper module in <dir>/src: `requires` the module, plus optional replaces.
write_wrapper() { # dir module version [replace-lines...]
  local dir="$1" module="$2" version="$3"
  shift 3
  mkdir -p "${dir}/src"
  {
    printf 'module relayfleet.dev/build/%s\n\n' "$(basename "$(dirname "${dir}")")"
    printf 'go 1.26.0\n\n'
    printf 'require %s %s\n' "${module}" "${version}"
    if (($# > 0)); then
      printf '\nreplace (\n'
      printf '\t%s\n' "$@"
      printf ')\n'
    fi
  } >"${dir}/src/go.mod"
  rm -f "${dir}/src/go.sum"
}

# go build <pkgs> (all from one module at <version>), or the <targets> after
# "--" (a main package of the wrapper itself), into <dir>/bin atomically:
# link into a staging dir, then rename.
build_into() { # dir version ldflags tags pkg... [-- target...]
  local dir="$1" version="$2" ldflags="$3" tags="$4"
  shift 4
  local stage="${dir}/bin.partial"
  local -a at_version=() targets=()
  while (($# > 0)) && [[ "$1" != -- ]]; do
    at_version+=("$1@${version}")
    targets+=("$1")
    shift
  done
  if (($# > 0)); then
    shift
    targets=("$@")
  fi
  rm -rf "${stage}"
  mkdir -p "${stage}" "${dir}/bin"
  (
    cd "${dir}/src"
    # Resolves the packages' dependencies into go.mod/go.sum at the pinned
    # version (a bare package path would mean @upgrade).
    gorun get "${at_version[@]}"
    gorun build -tags "${tags}" -ldflags "${ldflags}" -o "${stage}/" "${targets[@]}"
  )
  local f
  for f in "${stage}"/*; do
    mv -f "${f}" "${dir}/bin/"
  done
  rmdir "${stage}"
}

have_all() { # dir name...
  local dir="$1" name
  shift
  for name in "$@"; do
    [[ -x "${dir}/bin/${name}" ]] || return 1
  done
}

timed() { # label cmd...
  local label="$1" start=${SECONDS}
  shift
  log "building ${label}"
  "$@"
  log "built ${label} in $((SECONDS - start))s"
}

build_kubernetes() { # binary... (each one k8s.io/kubernetes/cmd/<binary>)
  local gomod
  gomod="$(module_gomod "k8s.io/kubernetes@${KUBE_VERSION}")"
  [[ -f "${gomod}" ]] || die "no go.mod for k8s.io/kubernetes@${KUBE_VERSION}"
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and points them
  # at ./staging with replace directives, which only count in the main module.
  # Map each of them to the published release instead.
  local staging_version="v0.${KUBE_VERSION#v1.}"
  local -a replaces=()
  local mod
  while read -r mod; do
    replaces+=("${mod} => ${mod} ${staging_version}")
  done < <(sed -n 's|^[[:space:]]*\(k8s\.io/[A-Za-z0-9._/-]*\) => \./staging/src/.*|\1|p' "${gomod}")
  ((${#replaces[@]} > 10)) || die "found only ${#replaces[@]} staging modules in ${gomod}"
  write_wrapper "${kube_dir}" k8s.io/kubernetes "${KUBE_VERSION}" "${replaces[@]}"

  local ver="${KUBE_VERSION}" major minor build_date
  major="${ver#v}"; major="${major%%.*}"
  minor="${ver#v*.}"; minor="${minor%%.*}"
  build_date="$(module_time "k8s.io/kubernetes@${KUBE_VERSION}")"
  local -a ld=(-s -w)
  local pkg key val
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for key in gitVersion gitMajor gitMinor gitTreeState buildDate; do
      case "${key}" in
        gitVersion) val="${ver}" ;;
        gitMajor) val="${major}" ;;
        gitMinor) val="${minor}" ;;
        # Built from the module archive, not a git checkout (as upstream names it).
        gitTreeState) val="archive" ;;
        buildDate) val="${build_date}" ;;
      esac
      ld+=("-X" "${pkg}.${key}=${val}")
    done
  done
  local -a pkgs=()
  local name
  for name in "$@"; do
    pkgs+=("k8s.io/kubernetes/cmd/${name}")
  done
  # Same build tags as upstream release builds (hack/lib/golang.sh).
  build_into "${kube_dir}" "${KUBE_VERSION}" "${ld[*]}" "selinux,notest,grpcnotrace" "${pkgs[@]}"
}

# CoreDNS's own main (coredns.go) links every plugin, cloud DNS SDKs included; this one links
# only what the cluster's Corefile names (hack/cluster.sh), at the versions CoreDNS's go.mod pins.
coredns_plugins=(bind cache errors health kubernetes loadbalance log ready template)
build_coredns() {
  write_wrapper "${coredns_dir}" github.com/coredns/coredns "${COREDNS_VERSION}"
  local -a pkgs=(github.com/coredns/coredns/coremain) plugin
  for plugin in "${coredns_plugins[@]}"; do
    pkgs+=("github.com/coredns/coredns/plugin/${plugin}")
  done
  {
    printf '// Generated by hack/control-plane.sh: CoreDNS with the plugins make cluster uses.\n'
    printf 'package main\n\nimport (\n\t"github.com/coredns/coredns/coremain"\n\n'
    printf '\t_ "%s"\n' "${pkgs[@]:1}"
    printf ')\n\nfunc main() { coremain.Run() }\n'
  } >"${coredns_dir}/src/main.go"
  # the wrapper's own main package: go names the binary after its module, .../coredns
  build_into "${coredns_dir}" "${COREDNS_VERSION}" \
    "-s -w -X github.com/coredns/coredns/coremain.GitCommit=${COREDNS_VERSION}" "" "${pkgs[@]}" -- .
}

build_etcd() {
  write_wrapper "${etcd_dir}" go.etcd.io/etcd/server/v3 "${ETCD_VERSION}"
  build_into "${etcd_dir}" "${ETCD_VERSION}" "-s -w" "" go.etcd.io/etcd/server/v3
  # go names a binary whose path ends in a major-version suffix after the element before it.
  mv -f "${etcd_dir}/bin/server" "${etcd_dir}/bin/etcd"
}

build_kwok() {
  write_wrapper "${kwok_dir}" sigs.k8s.io/kwok "${KWOK_VERSION}"
  local -a ld=(-s -w
    -X "sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}"
    -X "sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBE_VERSION}")
  build_into "${kwok_dir}" "${KWOK_VERSION}" "${ld[*]}" "" sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl
}

build_helm() {
  write_wrapper "${helm_dir}" helm.sh/helm/v3 "${HELM_VERSION}"
  # helm derives its default Kubernetes version from the client-go it links.
  local client_go k8s_minor
  client_go="$(sed -n 's|^[[:space:]]*k8s\.io/client-go \(v[0-9.]*\).*|\1|p' \
    "$(module_gomod "helm.sh/helm/v3@${HELM_VERSION}")" | head -n1)"
  [[ -n "${client_go}" ]] || die "cannot find the client-go version helm ${HELM_VERSION} uses"
  k8s_minor="${client_go#v0.}"; k8s_minor="${k8s_minor%%.*}"
  local -a ld=(-s -w
    -X "helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
    -X "helm.sh/helm/v3/internal/version.gitTreeState=clean")
  local pkg
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ld+=(-X "${pkg}.k8sVersionMajor=1" -X "${pkg}.k8sVersionMinor=${k8s_minor}")
  done
  build_into "${helm_dir}" "${HELM_VERSION}" "${ld[*]}" "" helm.sh/helm/v3/cmd/helm
}

total_start=${SECONDS}
have_all "${etcd_dir}" etcd || timed "etcd ${ETCD_VERSION}" build_etcd
have_all "${kwok_dir}" kwok kwokctl || timed "kwok ${KWOK_VERSION}" build_kwok
have_all "${helm_dir}" helm || timed "helm ${HELM_VERSION}" build_helm
have_all "${kube_dir}" "${kube_bins[@]}" || timed "kubernetes ${KUBE_VERSION}" build_kubernetes "${kube_bins[@]}"
if [[ "${node}" == true ]]; then
  have_all "${kube_dir}" "${node_bins[@]}" ||
    timed "kubelet, kube-proxy ${KUBE_VERSION}" build_kubernetes "${node_bins[@]}"
  have_all "${coredns_dir}" coredns || timed "coredns ${COREDNS_VERSION}" build_coredns
fi

for name in "${!linked[@]}"; do
  ln -sfn "${linked[${name}]}" "${bin_dir}/${name}"
done
all_built || die "some binaries are still missing in ${bin_dir}"
"${bin_dir}/kube-apiserver" --version >&2
log "done in $((SECONDS - total_start))s"
printf '%s\n' "${bin_dir}"
