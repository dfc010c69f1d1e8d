#!/usr/bin/env bash
# The Debian packages the test suite needs (real redis-server, Sentinel, nginx+nchan, wrk,
# Prometheus, Pushgateway, shellcheck; debootstrap and skopeo for make release's daemonless
# images; containerd, runc, the CNI plugins and kube-proxy's tools for make cluster's real node).
# `make test` runs this first: as root it installs what is missing; otherwise it fails with the
# exact command to run. Nothing is skipped for lack of them.
set -euo pipefail

# package            a file it installs (what the tests look for)
checks=(
  "redis-server           /usr/bin/redis-server"
  "redis-tools            /usr/bin/redis-cli"
  "redis-sentinel         /usr/bin/redis-sentinel"
  "nginx                  /usr/sbin/nginx"
  "libnginx-mod-nchan     /usr/lib/nginx/modules/ngx_nchan_module.so"
  "wrk                    /usr/bin/wrk"
  "prometheus             /usr/bin/promtool"
  "prometheus-pushgateway /usr/bin/prometheus-pushgateway"
  "shellcheck             /usr/bin/shellcheck"
  "debootstrap            /usr/sbin/debootstrap"
  "skopeo                 /usr/bin/skopeo"
  # make cluster's real node (hack/cluster.sh): container runtime, CNI, kube-proxy's tools
  "containerd             /usr/bin/containerd"
  "runc                   /usr/sbin/runc"
  "containernetworking-plugins /usr/lib/cni/bridge"
  "iptables               /usr/sbin/iptables"
  "nftables               /usr/sbin/nft"
  "conntrack              /usr/sbin/conntrack"
  "ebtables               /usr/sbin/ebtables"
  "socat                  /usr/bin/socat"
)

# --check: report only, never install. SYSTEM_DEPS_ROOT: look under another root (tests).
mode="${1:-}"
root="${SYSTEM_DEPS_ROOT:-}"
missing=()
for line in "${checks[@]}"; do
  read -r pkg path <<<"$line"
  [ -e "$root$path" ] || missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$mode" != "--check" ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  exit 0
fi
echo "system-deps: missing Debian packages: ${missing[*]}" >&2
if command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: run:  sudo $cmd" >&2
else
  echo "system-deps: this is not a Debian/Ubuntu machine; install the equivalents of: ${missing[*]}" >&2
fi
exit 1
