# shellcheck shell=bash
# Shared by the hack/ build scripts; sourced, never run:
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"; rf_init <log tag>
#
# rf_init sets, for the caller:
#   repo_root   the repository root
#   cache_root  RELAYFLEET_CACHE_DIR, default ${XDG_CACHE_HOME:-$HOME/.cache}/relayfleet; outside
#               the work tree on purpose (CI runs in a fresh clone on the same machine and must
#               find it); a relative value is taken relative to the repository root
#   nice_level  RELAYFLEET_BUILD_NICE, default 10 (the machine is shared)
# Each cached part lives under cache_root in a directory named by its version (or by a
# content key, rf_key), so a change of pin builds anew and the old output stays usable by
# older checkouts; a script is a no-op once its outputs exist.

rf_init() { # log-tag
  rf_tag="$1"
  repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cache_root="${RELAYFLEET_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/relayfleet}"
  [[ "${cache_root}" == /* ]] || cache_root="${repo_root}/${cache_root}"
  nice_level="${RELAYFLEET_BUILD_NICE:-10}"
}

log() { printf '[%s] %s\n' "${rf_tag}" "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

# Run a build step at the build niceness.
rf_nice() { nice -n "${nice_level}" "$@"; }

# A 16-hex-digit key of stdin's content (a lockfile, a recipe), for cache directory names.
rf_key() { sha256sum | cut -c1-16; }

# Hold cache_root/<name> (an flock on fd 9) until the script exits, so two runs on one
# machine never build the same part at once; a second call is a no-op. Callers check
# "already built?" again once they hold it.
rf_lock() { # lock-file-name
  [[ -z "${rf_locked-}" ]] || return 0
  rf_locked=1
  command -v flock >/dev/null || die "flock (util-linux) is not on PATH"
  mkdir -p "${cache_root}"
  exec 9>"${cache_root}/$1"
  log "waiting for ${cache_root}/$1"
  flock 9
}
