"""The operator's configuration: one frozen dataclass, read once at start.

`OperatorSettings.from_env()` is the only place the operator reads its environment (no
module reads it at import time): `relayfleet operator` and `python -m relayfleet_operator`
call it before anything starts, a bad value is a ConfigError naming the variable (exit 2,
one line), and the result travels to the handlers (kopf registration, the shared Context).

Names follow the prefix policy of docs/design-decisions.md: the operator's own variables are
RELAYFLEET_OPERATOR_*; RELAY_LOG_LEVEL is the one every `relayfleet` command reads; a
replaced name (RELAY_OPERATOR_NAMESPACE) still works, with a warning in the log, through the
relay's table of deprecated names (relay/settings.py DEPRECATED_ENV), so there is one table.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from relay.settings import DEPRECATED_ENV, ConfigError, EnvVar, env_value, parse_env
from relayfleet_operator.spec import (
    DEFAULT_IMAGE,
    DEFAULT_OPERATOR_LABELS,
    DEFAULT_REDIS_IMAGE,
    ImageDefaults,
    LimitDefaults,
    Neighbours,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LEVELS_KIND = "one of " + ", ".join(LOG_LEVELS)

_DEFAULT_LABELS = ",".join(f"{k}={v}" for k, v in DEFAULT_OPERATOR_LABELS)

# Every variable the operator reads, with its default as --help shows it.
OPERATOR_ENV: tuple[EnvVar, ...] = (
    EnvVar("RELAYFLEET_OPERATOR_NAMESPACE", "none", "watch this namespace only (--namespace wins)"),
    EnvVar("RELAYFLEET_OPERATOR_HEALTH_PORT", "8080", "kopf liveness endpoint (/healthz)"),
    EnvVar("RELAYFLEET_OPERATOR_METRICS_PORT", "9090", "Prometheus /metrics (0 disables)"),
    EnvVar("RELAYFLEET_OPERATOR_RESYNC_SECONDS", "30", "re-apply period of every RelayShard"),
    EnvVar("RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS", "2", "step period of every RelayRebalance"),
    EnvVar("RELAYFLEET_OPERATOR_RETRY_SECONDS", "15", "wait before retrying a failed or blocked step"),
    EnvVar(
        "RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE", DEFAULT_IMAGE, "relay image of shards without spec.image"
    ),
    EnvVar(
        "RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE",
        DEFAULT_REDIS_IMAGE,
        "Redis image of managed shards without spec.redis.managed.image",
    ),
    EnvVar(
        "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS",
        "none",
        "JSON object of spec.limits quota keys for shards that leave them out (a shard's own key wins)",
    ),
    EnvVar(
        "RELAYFLEET_OPERATOR_POD_NAMESPACE",
        "none",
        "the operator's own namespace: Redis NetworkPolicies admit it from there only (none: the shard's)",
    ),
    EnvVar(
        "RELAYFLEET_OPERATOR_POD_LABELS",
        _DEFAULT_LABELS,
        "labels K=V,... that select the operator's Pods in Redis NetworkPolicies",
    ),
    EnvVar(
        "RELAYFLEET_OPERATOR_SPARK_NAMESPACE",
        "none",
        "the Spark jobs' namespace: admitted to their fleets' Redis, given a copy of their credentials",
    ),
    EnvVar("RELAYFLEET_OPERATOR_SPARK_FLEETS", "none", "the fleets NS/FLEET,... that the Spark jobs serve"),
    EnvVar("RELAYFLEET_OPERATOR_CRDS_DIR", "none", "apply the CRD files there at start (guarded)"),
    EnvVar("RELAYFLEET_OPERATOR_KUBECONFIG", "none", "kubeconfig (else KUBECONFIG, else in-cluster)"),
    EnvVar("KUBECONFIG", "none", "the usual kubeconfig list (its first file; else ~/.kube/config)"),
    EnvVar("RELAY_LOG_LEVEL", "INFO", "one of " + ", ".join(LOG_LEVELS) + " (--log-level wins)"),
)


@dataclass(frozen=True)
class OperatorSettings:
    """Plain values: `OperatorSettings()` is the defaults, whatever the environment holds."""

    namespace: str | None = None
    health_port: int = 8080
    metrics_port: int = 9090  # 0: no metrics endpoint
    resync_seconds: float = 30.0
    rebalance_tick_seconds: float = 2.0
    retry_seconds: float = 15.0
    # the images of a RelayShard that names none (the chart sets them from its values)
    images: ImageDefaults = field(default_factory=ImageDefaults)
    # spec.limits quota keys of a RelayShard that leaves them out (the chart's relayDefaults.limits)
    limit_defaults: LimitDefaults = field(default_factory=LimitDefaults)
    # who may reach Redis from outside a shard's namespace; where the Spark jobs run
    neighbours: Neighbours = field(default_factory=Neighbours)
    crds_dir: Path | None = None
    kubeconfig: str | None = None
    log_level: str = "INFO"

    @classmethod
    def from_env(cls) -> OperatorSettings:
        """The settings the environment gives; ConfigError (one line, naming the variable)."""
        crds_dir = env_value("RELAYFLEET_OPERATOR_CRDS_DIR")
        return cls(
            namespace=env_value("RELAYFLEET_OPERATOR_NAMESPACE"),
            health_port=_port("RELAYFLEET_OPERATOR_HEALTH_PORT", cls.health_port),
            metrics_port=_port("RELAYFLEET_OPERATOR_METRICS_PORT", cls.metrics_port),
            resync_seconds=_seconds("RELAYFLEET_OPERATOR_RESYNC_SECONDS", cls.resync_seconds),
            rebalance_tick_seconds=_seconds(
                "RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS", cls.rebalance_tick_seconds
            ),
            retry_seconds=_seconds("RELAYFLEET_OPERATOR_RETRY_SECONDS", cls.retry_seconds),
            images=ImageDefaults(
                relay=_image("RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE", DEFAULT_IMAGE),
                redis=_image("RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE", DEFAULT_REDIS_IMAGE),
            ),
            limit_defaults=_limit_defaults(env_value("RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS")),
            neighbours=_neighbours(),
            crds_dir=Path(crds_dir) if crds_dir else None,
            kubeconfig=env_value("RELAYFLEET_OPERATOR_KUBECONFIG") or _kubeconfig_path(),
            log_level=parse_env("RELAY_LOG_LEVEL", cls.log_level, _log_level, _LEVELS_KIND),
        )


def _neighbours() -> Neighbours:
    spark = env_value("RELAYFLEET_OPERATOR_SPARK_NAMESPACE")
    none: frozenset[tuple[str, str]] = frozenset()
    fleets = parse_env("RELAYFLEET_OPERATOR_SPARK_FLEETS", none, _fleets, "a list NS/FLEET,...")
    if fleets and not spark:
        raise ConfigError("RELAYFLEET_OPERATOR_SPARK_FLEETS needs RELAYFLEET_OPERATOR_SPARK_NAMESPACE")
    return Neighbours(
        operator_namespace=env_value("RELAYFLEET_OPERATOR_POD_NAMESPACE"),
        operator_labels=parse_env(
            "RELAYFLEET_OPERATOR_POD_LABELS", DEFAULT_OPERATOR_LABELS, _labels, "a list K=V,... of labels"
        ),
        spark_namespace=spark,
        spark_fleets=fleets,
    )


def _pairs(raw: str, sep: str) -> list[tuple[str, str]]:
    out = []
    for item in raw.split(","):
        left, found, right = item.strip().partition(sep)
        if not (found and left and right) or any(c.isspace() for c in item.strip()):
            raise ValueError(raw)
        out.append((left, right))
    return out


def _labels(raw: str) -> tuple[tuple[str, str], ...]:
    # an empty selector would admit every Pod of the namespace
    return tuple(sorted(_pairs(raw, "=")))


def _fleets(raw: str) -> frozenset[tuple[str, str]]:
    return frozenset(_pairs(raw, "/"))


def _kubeconfig_path() -> str | None:
    """KUBECONFIG's first file (kubectl merges the list; one file is enough here)."""
    first = (env_value("KUBECONFIG") or "").split(os.pathsep)[0]
    return first or None


def _port(name: str, default: int) -> int:
    port = parse_env(name, default, int, "a port number")
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name} must be a port number, got {port}")
    return port


def _image(name: str, default: str) -> str:
    """An image reference as the CRD admits one in spec (1-512 characters), without blanks."""
    return parse_env(name, default, _image_ref, "an image reference of at most 512 characters, no spaces")


def _image_ref(raw: str) -> str:
    if len(raw) > 512 or any(c.isspace() for c in raw):
        raise ValueError(raw)
    return raw


def _limit_defaults(raw: str | None) -> LimitDefaults:
    """Not through parse_env: its message would hide which key is wrong."""
    if raw is None:
        return LimitDefaults()
    try:
        return LimitDefaults.parse(json.loads(raw))
    except ValueError as exc:  # json.JSONDecodeError is one
        raise ConfigError(f"RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS: {exc}") from None


def _seconds(name: str, default: float) -> float:
    value = parse_env(name, default, _finite, "a number")
    if value <= 0:
        raise ConfigError(f"{name} must be a positive number of seconds")
    return value


def _finite(raw: str) -> float:
    value = float(raw)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(raw)
    return value


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(raw)
    return level


def env_help() -> str:
    """The environment section of --help: every variable with its default, and the old names."""
    width = max(len(v.name) for v in OPERATOR_ENV)
    lines = ["environment (read once at start; a bad value exits 2):"]
    lines += [f"  {v.name:<{width}}  {v.help} [default {v.default}]" for v in OPERATOR_ENV]
    ours = {v.name for v in OPERATOR_ENV}
    old = [(o, n) for o, n in DEPRECATED_ENV.items() if n in ours]
    if old:
        lines.append("deprecated names (still read, with a warning in the log):")
        lines += [f"  {o} -> {n}" for o, n in old]
    return "\n".join(lines)


def configure_logging(settings: OperatorSettings) -> None:
    """Log format and level; kopf's per-handler INFO lines only at DEBUG (periodic noise)."""
    logging.basicConfig(
        level=getattr(logging, settings.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.log_level != "DEBUG":
        for noisy in ("kopf.objects", "kopf.activities.probe", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
