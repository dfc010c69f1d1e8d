#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, from the project's own builds (docs/e2e.md).
#
# Usage: hack/cluster.sh up | down | status | images [NAME...] | render DIR | --help   (as root)
#   up      etcd, kube-apiserver, kube-controller-manager, kube-scheduler (hack/control-plane.sh),
#           containerd + runc + the bridge CNI plugin (Debian), kubelet and kube-proxy (iptables)
#           built from the same k8s.io/kubernetes module, CoreDNS (cluster.local only, never
#           forwards), a host-path PV provisioner (the default StorageClass) and the cluster's
#           images (hack/cluster-images.sh). Waits for the node to be Ready; the last line on
#           stdout is KUBECONFIG=<path>. Running it again on a running cluster only prints that line.
#   down    stops everything and puts the machine back as `up` found it: processes, containers,
#           iptables chains (KUBE-*, CNI-*, RELAYFLEET-*; kube-proxy --cleanup), the bridge, network
#           namespaces, mounts under the state dir, cgroups kubepods and k8s.io, the kernel settings
#           the kubelet and the CNI plugin change, and the directories they create. Then it checks
#           each of those against what `up` recorded and fails naming any difference.
#   status  exits 0 and prints KUBECONFIG=<path> if the cluster answers, else exits 1.
#   images  rebuilds what changed of the images (hack/cluster-images.sh) and imports them into the
#           running node's containerd (after an edit of the relay: then restart its Pods).
#   render  writes every config file `up` would use into DIR and starts nothing (tests read them).
#
# Everything listens on loopback or on the bridge the script creates, and Pods can route nowhere
# but the bridge: nothing binds or routes to the machine's outside interface.
#
# Environment:
#   RELAYFLEET_CLUSTER_DIR     state dir: certificates, configs, logs, etcd, containerd, kubelet
#                              (default /var/lib/relayfleet-cluster; removed by down)
#   RELAYFLEET_CLUSTER_IMAGES  0: bring the node up without importing the images (default 1)
#   RELAYFLEET_CLUSTER_KEEP_FAILED  1: a failed up keeps everything for a look (default: torn down,
#                              the logs copied to a temp dir first)
#   RELAYFLEET_CACHE_DIR, RELAYFLEET_BUILD_NICE  as for hack/control-plane.sh
#   PYTHON                     the provisioner's and the image tools' Python (default .venv/bin/python)
set -Eeuo pipefail

# shellcheck source=hack/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
rf_init cluster

state="${RELAYFLEET_CLUSTER_DIR:-/var/lib/relayfleet-cluster}"
[[ "${state}" == /* ]] || state="${repo_root}/${state}"

# ---- the network: one bridge, its host address is the node's and the API server's ----------
bridge=relayfleet0
node_name=relayfleet-node
node_ip=10.244.0.1
pod_cidr=10.244.0.0/24
service_cidr=10.96.0.0/16
service_ip=10.96.0.1 # the `kubernetes` Service
dns_ip="${node_ip}"  # CoreDNS runs on the host, on the bridge address
# loopback ports, away from the defaults a test's control plane (kwokctl) may take
etcd_port=12379
etcd_peer_port=12380
cm_port=12357
sched_port=12359
proxy_healthz_port=12256
proxy_metrics_port=12249
dns_health_port=12180
dns_ready_port=12181
kubelet_healthz_port=12248
storage_class=relayfleet-hostpath
provisioner_name=relayfleet.dev/hostpath

# Kernel settings the kubelet (setupKernelTunables), kube-proxy and the bridge plugin may change.
sysctls=(kernel.panic kernel.panic_on_oops vm.overcommit_memory vm.panic_on_oom
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward
  net.ipv6.conf.all.forwarding net.bridge.bridge-nf-call-iptables
  net.bridge.bridge-nf-call-ip6tables net.ipv4.conf.all.route_localnet
  net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established
  net.netfilter.nf_conntrack_tcp_timeout_close_wait)
# Paths outside the state dir the runtime or kubelet create when missing (hard-coded there).
outside_paths=(/run/containerd /run/netns /var/log/containers /var/log/pods /var/lib/kubelet
  /opt/containerd /var/lib/cni /etc/cni)
# Processes up starts, in start order (down stops them in reverse).
daemons=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy
  coredns provisioner)

py="${PYTHON:-${repo_root}/.venv/bin/python}"
pki="${state}/pki"
conf="${state}/conf"
logs="${state}/logs"
run="${state}/run"
before="${state}/before"
kubeconfig="${state}/admin.kubeconfig"
sock="${state}/containerd/containerd.sock"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }

# ---- configs (pure: render writes them without root) -----------------------------------------

# reverse_zone CIDR: the in-addr.arpa zone of a /8, /16 or /24 (10.96.0.0/16 -> 96.10.in-addr.arpa.)
reverse_zone() {
  local -a o
  IFS=. read -r -a o <<<"${1%/*}"
  local n=$((${1#*/} / 8)) zone="in-addr.arpa." i
  for ((i = 0; i < n; i++)); do zone="${o[i]}.${zone}"; done
  printf '%s\n' "${zone}"
}

render_configs() { # dir
  local d="$1" rev_pods rev_services
  rev_pods="$(reverse_zone "${pod_cidr}")"
  rev_services="$(reverse_zone "${service_cidr}")"
  mkdir -p "${d}/cni"
  cat >"${d}/containerd.toml" <<EOF
# containerd for the relayfleet node: its own root, state and socket; CRI with runc (cgroupfs).
version = 2
root = "${state}/containerd/root"
state = "${state}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "${sock}"

[plugins."io.containerd.internal.v1.opt"]
  path = "${state}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$(image_ref pause)"
  # No CAP_SYS_RESOURCE on some machines: a negative oom_score_adj would fail every sandbox.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "${state}/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "${state}/conf/cni"
EOF
  # No default route in a Pod: only the pod subnet (the bridge) and the Service range behind it.
  cat >"${d}/cni/10-relayfleet.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "relayfleet",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "${bridge}",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "${state}/cni-ipam",
        "ranges": [[{"subnet": "${pod_cidr}", "gateway": "${node_ip}", "rangeStart": "${pod_cidr%.*/*}.10"}]],
        "routes": [{"dst": "${service_cidr}", "gw": "${node_ip}"}]
      }
    }
  ]
}
EOF
  cat >"${d}/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: ${node_ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${kubelet_healthz_port}
tlsCertFile: ${pki}/kubelet-serving.crt
tlsPrivateKeyFile: ${pki}/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: ${pki}/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://${sock}
imageServiceEndpoint: unix://${sock}
# cgroup v1 hierarchies on some machines: allowed, with cgroupfs like containerd's runc
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
clusterDomain: cluster.local
clusterDNS: [${dns_ip}]
# Pods get nothing of the host's resolv.conf: cluster names only, never the outside resolver
resolvConf: ""
podLogsDir: ${state}/pod-logs
# the images are imported, never pulled: never garbage-collect them, never evict for a shared disk
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
EOF
  cat >"${d}/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: ${node_name}
clientConnection: {kubeconfig: ${state}/kube-proxy.kubeconfig}
clusterCIDR: ${pod_cidr}
healthzBindAddress: 127.0.0.1:${proxy_healthz_port}
metricsBindAddress: 127.0.0.1:${proxy_metrics_port}
nodePortAddresses: [${node_ip}/32]
# 0: leave the kernel's conntrack limits and timeouts as they are (no CAP_SYS_RESOURCE needed)
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false, masqueradeAll: false}
EOF
  # cluster.local and the reverse zones of the pod and Service ranges; every other name is
  # NXDOMAIN here: nothing is forwarded outside the cluster.
  cat >"${d}/Corefile" <<EOF
cluster.local:53 ${rev_pods}:53 ${rev_services}:53 {
    bind ${dns_ip}
    errors
    health 127.0.0.1:${dns_health_port}
    ready 127.0.0.1:${dns_ready_port}
    kubernetes cluster.local ${rev_pods} ${rev_services} {
        kubeconfig ${state}/coredns.kubeconfig default
        pods insecure
        ttl 5
    }
    cache 5
    loadbalance
}
.:53 {
    bind ${dns_ip}
    errors
    template ANY ANY . {
        rcode NXDOMAIN
    }
}
EOF
  cat >"${d}/bootstrap.yaml" <<EOF
# What a kubeadm cluster adds: DNS read access, the provisioner's rights, a default StorageClass.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "relayfleet:coredns"}
rules:
  - apiGroups: [""]
    resources: [endpoints, services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "relayfleet:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "relayfleet:coredns"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "relayfleet:coredns"}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "relayfleet:provisioner"}
rules:
  - apiGroups: [""]
    resources: [persistentvolumeclaims]
    verbs: [get, list, watch]
  - apiGroups: [""]
    resources: [persistentvolumes]
    verbs: [get, list, watch, create, delete]
  - apiGroups: [""]
    resources: [events]
    verbs: [create, patch]
  - apiGroups: [storage.k8s.io]
    resources: [storageclasses]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "relayfleet:provisioner"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "relayfleet:provisioner"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: "relayfleet:provisioner"}]
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: ${storage_class}
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: ${provisioner_name}
reclaimPolicy: Delete
volumeBindingMode: Immediate
EOF
}

# image_ref NAME: the name an image of hack/cluster-images.sh has in containerd.
image_ref() { bash "${repo_root}/hack/cluster-images.sh" ref "$1"; }

# ---- certificates ----------------------------------------------------------------------------

# cert NAME CN [O] [SAN]: an EC key and a certificate from the cluster CA (client + server use).
cert() {
  local name="$1" cn="$2" org="${3-}" san="${4-}" subj
  subj="/CN=${cn}"
  [[ -z "${org}" ]] || subj="/O=${org}${subj}"
  openssl ecparam -name prime256v1 -genkey -noout -out "${pki}/${name}.key" 2>/dev/null
  {
    printf 'basicConstraints=critical,CA:FALSE\n'
    printf 'keyUsage=critical,digitalSignature,keyEncipherment\n'
    printf 'extendedKeyUsage=clientAuth,serverAuth\n'
    [[ -z "${san}" ]] || printf 'subjectAltName=%s\n' "${san}"
  } >"${pki}/${name}.ext"
  openssl req -new -key "${pki}/${name}.key" -subj "${subj}" 2>/dev/null |
    openssl x509 -req -CA "${pki}/ca.crt" -CAkey "${pki}/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
      -days 365 -extfile "${pki}/${name}.ext" -out "${pki}/${name}.crt" 2>/dev/null
}

# kubeconfig FILE CERT-NAME: a kubeconfig for the API server on the bridge, with that client cert.
kubeconfig_for() {
  local file="$1" name="$2"
  cat >"${file}" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: relayfleet
    cluster: {server: "https://${node_ip}:6443", certificate-authority: "${pki}/ca.crt"}
users:
  - name: ${name}
    user: {client-certificate: "${pki}/${name}.crt", client-key: "${pki}/${name}.key"}
contexts:
  - name: default
    context: {cluster: relayfleet, user: ${name}}
current-context: default
EOF
}

make_pki() {
  mkdir -p "${pki}"
  openssl ecparam -name prime256v1 -genkey -noout -out "${pki}/ca.key" 2>/dev/null
  openssl req -x509 -new -key "${pki}/ca.key" -subj "/CN=relayfleet-cluster-ca" -days 3650 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "${pki}/ca.crt" 2>/dev/null
  local dns="DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  cert apiserver kube-apiserver "" "${dns},DNS:kubernetes.default.svc.cluster.local,IP:${node_ip},IP:${service_ip}"
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  cert kubelet-serving "system:node:${node_name}" system:nodes "DNS:${node_name},IP:${node_ip}"
  cert admin relayfleet-admin system:masters
  cert kubelet "system:node:${node_name}" system:nodes
  cert kube-proxy system:kube-proxy
  cert kube-controller-manager system:kube-controller-manager
  cert kube-scheduler system:kube-scheduler
  cert coredns relayfleet:coredns
  cert provisioner relayfleet:provisioner
  openssl ecparam -name prime256v1 -genkey -noout -out "${pki}/sa.key" 2>/dev/null
  openssl ec -in "${pki}/sa.key" -pubout -out "${pki}/sa.pub" 2>/dev/null
  local name
  for name in admin kubelet kube-proxy kube-controller-manager kube-scheduler coredns provisioner; do
    kubeconfig_for "${state}/${name}.kubeconfig" "${name}"
  done
}

# ---- processes -------------------------------------------------------------------------------

# start NAME CMD...: a daemon in its own session, all output to logs/NAME.log, pid in run/NAME.pid.
start() {
  local name="$1"
  shift
  # not a process group leader here, so setsid execs in place: $! is the daemon's pid
  setsid "$@" </dev/null >>"${logs}/${name}.log" 2>&1 &
  echo $! >"${run}/${name}.pid"
  log "started ${name} (pid $!)"
}

# pid_of NAME: the daemon's pid if it still runs (a pid file outlives a crash, and the pid may
# have been reused since: the process must still name the state dir)
pid_of() {
  local pid
  pid="$(cat "${run}/$1.pid" 2>/dev/null)" || return 1
  grep -qaF -- "${state}/" "/proc/${pid}/cmdline" 2>/dev/null || return 1
  echo "${pid}"
}

alive() { pid_of "$1" >/dev/null; }

# wait_for DESC SECONDS CMD...: poll CMD until it succeeds; fail naming DESC (and the logs).
wait_for() {
  local desc="$1" limit="$2" t0=${SECONDS}
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS - t0 >= limit)); then
      log "timed out after ${limit}s waiting for ${desc}; logs in ${logs}"
      local f
      for f in "${logs}"/*.log; do
        [[ -s "${f}" ]] && { printf -- '--- %s\n' "${f}" >&2; tail -5 "${f}" >&2; }
      done
      return 1
    fi
    sleep 1
  done
  log "${desc}: ok after $((SECONDS - t0))s"
}

# stop NAME [GRACE]: SIGTERM, then SIGKILL after GRACE seconds (the API server may take minutes).
stop() {
  local name="$1" grace="${2:-10}" pid i
  if pid="$(pid_of "${name}")" && kill -TERM "${pid}" 2>/dev/null; then
    for ((i = 0; i < grace * 5; i++)); do
      kill -0 "${pid}" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "${pid}" 2>/dev/null && log "${name} (pid ${pid}) killed after ${grace}s"
  fi
  rm -f "${run}/${name}.pid"
}

kubectl_() { "${bin_dir}/kubectl" --kubeconfig "${kubeconfig}" "$@"; }
api_ready() { kubectl_ get --raw /readyz; }
node_ready() {
  [[ "$(kubectl_ get node "${node_name}" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}
http_ok() { curl -fsS --max-time 2 "$1"; }

# ---- the state `up` found, to put back and to check against ---------------------------------

rules_save() { # family (4|6): iptables-save without counters or comments
  local tool=iptables-save
  [[ "$1" == 6 ]] && tool=ip6tables-save
  "${tool}" 2>/dev/null | sed -e '/^#/d' -e 's/\[[0-9]*:[0-9]*\]$//'
}

snapshot() { # dir: what down must restore (and check)
  local d="$1" key p
  mkdir -p "${d}"
  for key in "${sysctls[@]}"; do
    sysctl -n "${key}" >/dev/null 2>&1 && printf '%s=%s\n' "${key}" "$(sysctl -n "${key}")"
  done >"${d}/sysctl"
  rules_save 4 >"${d}/iptables"
  rules_save 6 >"${d}/ip6tables"
  ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort >"${d}/links"
  findmnt -rn -o TARGET | sort >"${d}/mounts"
  { ls /run/netns 2>/dev/null || true; } | sort >"${d}/netns"
  for p in "${outside_paths[@]}"; do [[ -e "${p}" ]] && echo "${p}"; done >"${d}/paths"
  cgroup_dirs | sort >"${d}/cgroups"
  { nft list tables 2>/dev/null || true; } | sort >"${d}/nft"
}

cgroup_dirs() { # the kubelet's and containerd's cgroup roots that exist now
  local h
  for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
    for p in kubepods kubepods.slice k8s.io; do
      [[ -d "${h}${p}" ]] && echo "${h}${p}"
    done
  done
  return 0
}

# ---- up --------------------------------------------------------------------------------------

up() {
  [[ "$(id -u)" -eq 0 ]] || die "needs root (containerd, kubelet, iptables, a bridge)"
  if cluster_answers; then
    log "already running"
    printf 'KUBECONFIG=%s\n' "${kubeconfig}"
    return 0
  fi
  bash "${repo_root}/hack/system-deps.sh" --check || die "missing Debian packages (make system-deps)"
  [[ -x "${py}" ]] || die "no ${py} (make venv-dev, or set PYTHON to a Python with the dev venv's packages)"
  local t0=${SECONDS} images_pid="" built=0
  if [[ "${RELAYFLEET_CLUSTER_IMAGES:-1}" != 0 ]]; then
    # On a cold cache the images (debootstrap, apt and pip: much of it waiting on the network)
    # build while Go compiles the node's binaries; warm, both are no-ops.
    PYTHON="${py}" bash "${repo_root}/hack/cluster-images.sh" build >/dev/null &
    images_pid=$!
  fi
  bin_dir="$(bash "${repo_root}/hack/control-plane.sh" --node)" && built=1
  if [[ -n "${images_pid}" ]]; then
    wait "${images_pid}" || die "building the images failed (hack/cluster-images.sh build)"
  fi
  ((built)) || die "building the node's binaries failed (hack/control-plane.sh --node)"
  log "binaries and images ready in $((SECONDS - t0))s (${bin_dir})"
  [[ -d "${state}" ]] && { log "a cluster state dir is left over: tearing it down first"; down; }
  mkdir -p "${state}" "${logs}" "${run}" "${conf}"
  printf '%s\n' "${bin_dir}" >"${state}/bin-dir"
  snapshot "${before}"
  trap up_failed ERR
  local t_up=${SECONDS}
  make_pki
  render_configs "${conf}"

  # the bridge with the node's address before anything binds to it
  ip link add "${bridge}" type bridge
  ip addr add "${node_ip}/${pod_cidr#*/}" dev "${bridge}"
  ip link set "${bridge}" up
  # the host reaches Services from the node's address over the bridge (kube-proxy's rules), not
  # by the default route (goes with the bridge on down)
  ip route add "${service_cidr}" dev "${bridge}" src "${node_ip}"
  # Pods route nowhere but the bridge (and the host itself): drop any forwarding in or out of it
  iptables -N RELAYFLEET-NODE-FORWARD
  iptables -A RELAYFLEET-NODE-FORWARD -i "${bridge}" ! -o "${bridge}" -j DROP
  iptables -A RELAYFLEET-NODE-FORWARD -o "${bridge}" ! -i "${bridge}" -j DROP
  iptables -I FORWARD 1 -j RELAYFLEET-NODE-FORWARD

  start etcd "${bin_dir}/etcd" --name "${node_name}" --data-dir "${state}/etcd" \
    --listen-client-urls "http://127.0.0.1:${etcd_port}" --advertise-client-urls "http://127.0.0.1:${etcd_port}" \
    --listen-peer-urls "http://127.0.0.1:${etcd_peer_port}" \
    --initial-advertise-peer-urls "http://127.0.0.1:${etcd_peer_port}" \
    --initial-cluster "${node_name}=http://127.0.0.1:${etcd_peer_port}" \
    --log-level warn --quota-backend-bytes 2147483648
  wait_for etcd 60 http_ok "http://127.0.0.1:${etcd_port}/health"

  start kube-apiserver "${bin_dir}/kube-apiserver" \
    --advertise-address "${node_ip}" --bind-address "${node_ip}" --secure-port 6443 \
    --etcd-servers "http://127.0.0.1:${etcd_port}" --service-cluster-ip-range "${service_cidr}" \
    --client-ca-file "${pki}/ca.crt" --tls-cert-file "${pki}/apiserver.crt" \
    --tls-private-key-file "${pki}/apiserver.key" \
    --kubelet-client-certificate "${pki}/apiserver-kubelet-client.crt" \
    --kubelet-client-key "${pki}/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP,Hostname \
    --service-account-key-file "${pki}/sa.pub" --service-account-signing-key-file "${pki}/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --allow-privileged=true --profiling=false --v=1
  wait_for "the API server" 120 api_ready

  start kube-controller-manager "${bin_dir}/kube-controller-manager" \
    --kubeconfig "${state}/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig "${state}/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig "${state}/kube-controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "${cm_port}" --leader-elect=false \
    --service-account-private-key-file "${pki}/sa.key" --root-ca-file "${pki}/ca.crt" \
    --cluster-signing-cert-file "${pki}/ca.crt" --cluster-signing-key-file "${pki}/ca.key" \
    --use-service-account-credentials=true --profiling=false --v=1
  start kube-scheduler "${bin_dir}/kube-scheduler" \
    --kubeconfig "${state}/kube-scheduler.kubeconfig" \
    --authentication-kubeconfig "${state}/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig "${state}/kube-scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "${sched_port}" --leader-elect=false --profiling=false --v=1
  kubectl_ apply -f "${conf}/bootstrap.yaml" >/dev/null

  mkdir -p "${state}/containerd" "${state}/pod-logs"
  start containerd /usr/bin/containerd --config "${conf}/containerd.toml"
  wait_for containerd 60 ctr_ version
  if [[ "${RELAYFLEET_CLUSTER_IMAGES:-1}" != 0 ]]; then
    local t_img=${SECONDS}
    PYTHON="${py}" bash "${repo_root}/hack/cluster-images.sh" import "${sock}"
    log "images imported in $((SECONDS - t_img))s"
  else
    bash "${repo_root}/hack/cluster-images.sh" import "${sock}" pause
  fi

  start kubelet "${bin_dir}/kubelet" --config "${conf}/kubelet.yaml" \
    --kubeconfig "${state}/kubelet.kubeconfig" --hostname-override "${node_name}" \
    --node-ip "${node_ip}" --root-dir "${state}/kubelet" --v=1
  start kube-proxy "${bin_dir}/kube-proxy" --config "${conf}/kube-proxy.yaml"
  start coredns "${bin_dir}/coredns" -conf "${conf}/Corefile"
  start provisioner "${py}" -m relayfleet_testing.hostpath_provisioner \
    --kubeconfig "${state}/provisioner.kubeconfig" --root "${state}/volumes" \
    --provisioner "${provisioner_name}"

  wait_for "the node ${node_name} Ready" 180 node_ready
  wait_for "CoreDNS ready" 60 http_ok "http://127.0.0.1:${dns_ready_port}/ready"
  wait_for "the default ServiceAccount" 60 kubectl_ -n default get serviceaccount default
  local name
  for name in "${daemons[@]}"; do
    alive "${name}" || { log "${name} is not running: ${logs}/${name}.log"; tail -5 "${logs}/${name}.log" >&2; false; }
  done
  trap - ERR
  log "cluster up in $((SECONDS - t_up))s (binaries $((t_up - t0))s before); logs in ${logs}"
  printf 'KUBECONFIG=%s\n' "${kubeconfig}"
}

ctr_() { ctr --address "${sock}" "$@"; }

# A failed up leaves nothing running: its logs are copied out, then down puts the machine back
# (RELAYFLEET_CLUSTER_KEEP_FAILED=1 keeps it all for a look; make cluster-down ends it then).
up_failed() {
  trap - ERR
  if [[ "${RELAYFLEET_CLUSTER_KEEP_FAILED:-0}" == 1 ]]; then
    log "up failed; everything kept (logs in ${logs}); make cluster-down when done"
    exit 1
  fi
  local saved
  saved="$(mktemp -d "${TMPDIR:-/tmp}/relayfleet-cluster-logs.XXXXXX")"
  cp -a "${logs}/." "${saved}/" 2>/dev/null || true
  log "up failed; the logs are in ${saved}; tearing down"
  down || true
  exit 1
}

cluster_answers() {
  [[ -f "${state}/bin-dir" ]] || return 1
  bin_dir="$(cat "${state}/bin-dir")"
  local name
  for name in "${daemons[@]}"; do alive "${name}" || return 1; done
  api_ready >/dev/null 2>&1 && node_ready
}

status() {
  cluster_answers || { log "not running"; return 1; }
  printf 'KUBECONFIG=%s\n' "${kubeconfig}"
}

# ---- down ------------------------------------------------------------------------------------

# pids of the node's own programs (daemons, containerd's shims) whose command line names the
# state dir: what down must end, found without matching any broad name (a kubectl or a test
# that names the kubeconfig is not ours to end). Containers' processes are found by cgroup.
state_pids() {
  local f p exe
  # one grep over every command line (a fork per process is minutes on a loaded machine)
  while read -r f; do
    p="${f%/cmdline}"
    exe="$(readlink "${p}/exe" 2>/dev/null)" || continue
    case "${exe##*/}" in
      containerd | containerd-shim-runc-v2 | etcd | kube-* | kubelet | coredns) echo "${p#/proc/}" ;;
      python*) grep -qaF hostpath_provisioner "${f}" 2>/dev/null && echo "${p#/proc/}" ;;
    esac
  done < <(grep -laF -- "${state}/" /proc/[0-9]*/cmdline 2>/dev/null)
  return 0
}

remove_chains() { # family: delete the KUBE-*, CNI-*, RELAYFLEET-* chains (and jumps to them) up added
  local fam="$1" tool=iptables restore=iptables-restore
  [[ "${fam}" == 6 ]] && { tool=ip6tables; restore=ip6tables-restore; }
  command -v "${tool}" >/dev/null || return 0
  local keep="${before}/iptables"
  [[ "${fam}" == 6 ]] && keep="${before}/ip6tables"
  local table saved
  for table in filter nat mangle raw; do
    saved="$("${tool}-save" -t "${table}" 2>/dev/null)" || continue
    # chains of ours that did not exist before up: their declarations, rules and the jumps to them
    local chains
    chains="$(sed -n 's/^:\(\(KUBE\|CNI\|RELAYFLEET\)-[^ ]*\) .*/\1/p' <<<"${saved}" |
      while read -r c; do grep -q "^:${c} " "${keep}" || echo "${c}"; done)"
    [[ -n "${chains}" ]] || continue
    awk -v list="${chains}" '
      BEGIN { n = split(list, a, "\n"); for (i = 1; i <= n; i++) ours[a[i]] = 1 }
      /^:/ { c = substr($1, 2); if (c in ours) next }
      /^-A / {
        if ($2 in ours) next
        for (i = 3; i <= NF; i++) if (($i == "-j" || $i == "-g") && ($(i + 1) in ours)) next
      }
      { print }' <<<"${saved}" | "${restore}" -T "${table}" ||
      log "WARNING: ${restore} of table ${table} failed"
  done
}

# The tables iptables (nf_tables backend) made for those chains, if they did not exist before up
# and hold nothing now but empty built-in chains.
remove_empty_tables() {
  command -v nft >/dev/null || return 0
  local fam tool table saved extra
  for fam in ip ip6; do
    tool=iptables-save
    [[ "${fam}" == ip6 ]] && tool=ip6tables-save
    for table in filter nat mangle raw security; do
      grep -qx "table ${fam} ${table}" "${before}/nft" 2>/dev/null && continue
      nft list table "${fam}" "${table}" >/dev/null 2>&1 || continue
      saved="$("${tool}" -t "${table}" 2>/dev/null)" || continue
      extra="$(grep -v -e '^[#*]' -e '^COMMIT' -e '^:\(PREROUTING\|INPUT\|FORWARD\|OUTPUT\|POSTROUTING\) ACCEPT' \
        <<<"${saved}" || true)"
      [[ -z "${extra}" ]] || continue
      nft delete table "${fam}" "${table}" || log "WARNING: cannot delete the empty table ${fam} ${table}"
    done
  done
}

down() {
  [[ "$(id -u)" -eq 0 ]] || die "needs root"
  [[ -d "${state}" ]] || { log "no cluster (no ${state})"; return 0; }
  local t0=${SECONDS}
  bin_dir="$(cat "${state}/bin-dir" 2>/dev/null || true)"
  [[ -d "${before}" ]] || log "WARNING: no record of the machine before up (${before}); cleaning what is ours"
  stop provisioner
  stop coredns
  stop kubelet 30
  # every container and sandbox, while containerd still answers (their snapshots go with them)
  if alive containerd; then
    local id
    for id in $(ctr_ -n k8s.io tasks ls -q 2>/dev/null); do
      ctr_ -n k8s.io tasks kill -s SIGKILL "${id}" >/dev/null 2>&1 || true
    done
    sleep 1
    for id in $(ctr_ -n k8s.io containers ls -q 2>/dev/null); do
      ctr_ -n k8s.io tasks delete -f "${id}" >/dev/null 2>&1 || true
      ctr_ -n k8s.io containers delete "${id}" >/dev/null 2>&1 || true
    done
  fi
  stop kube-proxy
  stop kube-scheduler
  stop kube-controller-manager
  stop kube-apiserver 20
  stop etcd
  stop containerd 20
  # what is left of containers (shims, processes in the pod cgroups)
  local pid cg
  for pid in $(state_pids); do kill -KILL "${pid}" 2>/dev/null || true; done
  while read -r cg; do
    grep -qxF "${cg}" "${before}/cgroups" 2>/dev/null && continue
    find "${cg}" -name cgroup.procs -exec cat {} + 2>/dev/null | while read -r pid; do
      kill -KILL "${pid}" 2>/dev/null || true
    done
  done < <(cgroup_dirs)
  sleep 0.5
  if [[ -n "${bin_dir}" && -x "${bin_dir}/kube-proxy" ]]; then
    "${bin_dir}/kube-proxy" --cleanup >>"${logs}/kube-proxy-cleanup.log" 2>&1 ||
      log "WARNING: kube-proxy --cleanup failed (${logs}/kube-proxy-cleanup.log)"
  fi
  remove_chains 4
  remove_chains 6
  remove_empty_tables
  # network namespaces the runtime made (/run/netns/cni-*), then the bridge and its veths
  local ns
  for ns in /run/netns/*; do
    [[ -e "${ns}" ]] || continue
    grep -qxF "${ns##*/}" "${before}/netns" 2>/dev/null && continue
    ip netns delete "${ns##*/}" 2>/dev/null || { umount -l "${ns}" 2>/dev/null; rm -f "${ns}"; }
  done
  if ip link show "${bridge}" >/dev/null 2>&1; then
    local l
    for l in $(ip -o link show master "${bridge}" | awk -F': ' '{print $2}' | sed 's/@.*//'); do
      ip link delete "${l}" 2>/dev/null || true
    done
    ip link delete "${bridge}"
  fi
  # mounts under the state dir (kubelet volumes, container rootfs, sandbox shm), deepest first
  local m
  findmnt -rn -o TARGET | { grep -F "${state}/" || true; } | sort -r | while read -r m; do
    umount "${m}" 2>/dev/null || umount -l "${m}" || log "WARNING: cannot unmount ${m}"
  done
  while read -r cg; do
    grep -qxF "${cg}" "${before}/cgroups" 2>/dev/null && continue
    find "${cg}" -depth -type d -exec rmdir {} + 2>/dev/null || true
    [[ -d "${cg}" ]] && log "WARNING: cgroup ${cg} is still there"
  done < <(cgroup_dirs)
  local kv
  while IFS= read -r kv; do
    [[ "$(sysctl -n "${kv%%=*}" 2>/dev/null)" == "${kv#*=}" ]] || sysctl -q -w "${kv}" >/dev/null ||
      log "WARNING: cannot restore ${kv}"
  done <"${before}/sysctl" 2>/dev/null
  local p
  for p in "${outside_paths[@]}"; do
    [[ -e "${p}" ]] || continue
    grep -qxF "${p}" "${before}/paths" 2>/dev/null && continue
    # /run/netns may be a mount point of its own (ip netns makes it shared)
    if [[ "${p}" == /run/netns ]] && mountpoint -q "${p}"; then umount "${p}" || true; fi
    rm -rf "${p}"
  done
  local check="${state}.check.$$" problems=0
  if [[ -d "${before}" ]]; then
    snapshot "${check}"
    local f
    for f in sysctl iptables ip6tables links netns paths cgroups nft; do
      if ! diff -q "${before}/${f}" "${check}/${f}" >/dev/null; then
        log "not as before up: ${f}:"
        diff "${before}/${f}" "${check}/${f}" | grep '^[<>]' | head -20 >&2
        problems=1
      fi
    done
    # mounts: only ours count (others on a shared machine come and go)
    if findmnt -rn -o TARGET | grep -qF "${state}"; then
      log "mounts under ${state} remain"
      problems=1
    fi
    if [[ -n "$(state_pids)" ]]; then
      log "processes naming ${state} remain: $(state_pids | tr '\n' ' ')"
      problems=1
    fi
  fi
  rm -rf "${check}"
  if ((problems)); then
    log "kept ${state} (its before/ is the record); fix the above and run down again"
    return 1
  fi
  rm -rf "${state}"
  log "down in $((SECONDS - t0))s; the machine is as up found it"
}

case "${1-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  images)
    shift
    cluster_answers || die "no cluster is running (make cluster)"
    bash "${repo_root}/hack/cluster-images.sh" import "${sock}" "$@"
    ;;
  render)
    [[ -n "${2-}" ]] || { usage >&2; exit 2; }
    render_configs "$2"
    ;;
  -h | --help) usage ;;
  *) usage >&2; exit 2 ;;
esac
