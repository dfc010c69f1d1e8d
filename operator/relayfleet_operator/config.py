"""The operator's configuration: every setting declared once (relay.envconfig.Setting), read once.

`OperatorSettings.from_env()` is the only place the operator reads its environment (no
module reads it at import time): `relayfleet operator` and `python -m relayfleet_operator`
call it before anything starts, a bad value is a ConfigError naming the variable (exit 2,
one line), and the result travels to the handlers (kopf registration, the shared Context).
OPERATOR_SETTINGS also gives both entry points their flags (`add_arguments`), the environment
section of their --help (`env_help`) and docs/configuration.md.

Names follow the prefix policy of docs/design-decisions.md: the operator's own variables are
RELAYFLEET_OPERATOR_*; RELAY_LOG_LEVEL is the one every `relayfleet` command reads; a
replaced name (RELAY_OPERATOR_NAMESPACE) still works, with a warning in the log, through the
one table of deprecated names (relay/envconfig.py DEPRECATED_ENV).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay import settings as relay_settings
from relay.envconfig import FLOAT, PORT_NUMBER, ConfigError, Kind, Setting, add_flag, epilog
from relayfleet_operator.spec import (
    DEFAULT_IMAGE,
    DEFAULT_OPERATOR_LABELS,
    DEFAULT_REDIS_IMAGE,
    ImageDefaults,
    LimitDefaults,
    Neighbours,
)

LOG_LEVELS = relay_settings.LOG_LEVELS


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


def _image_ref(raw: str) -> str:
    """An image reference as the CRD admits one in spec (1-512 characters), without blanks."""
    if len(raw) > 512 or any(c.isspace() for c in raw):
        raise ValueError(raw)
    return raw


def _limit_defaults(raw: str) -> LimitDefaults:
    return LimitDefaults.parse(json.loads(raw))  # json.JSONDecodeError is a ValueError


def _show_pairs(pairs: Any, sep: str) -> str:
    return ",".join(f"{a}{sep}{b}" for a, b in sorted(pairs)) or "none"


OPTIONAL: Kind[str | None] = relay_settings.OPTIONAL
IMAGE: Kind[str] = Kind(_image_ref, "an image reference of at most 512 characters, no spaces")
LABELS: Kind[tuple[tuple[str, str], ...]] = Kind(
    _labels, "a list K=V,... of labels", show=lambda v: ",".join(f"{k}={x}" for k, x in v)
)
FLEETS: Kind[frozenset[tuple[str, str]]] = Kind(
    _fleets, "a list NS/FLEET,...", show=lambda v: _show_pairs(v, "/")
)
# its error says which key is wrong ("NAME: why"), not only that the value is
LIMITS: Kind[LimitDefaults] = Kind(
    _limit_defaults, "a JSON object of spec.limits keys", explains=True, show=lambda v: "none"
)
_PORT_REFUSED = "must be a port number, got {value}"
_SECONDS_REFUSED = "must be a positive number of seconds"

# fmt: off
NAMESPACE = Setting(
    "RELAYFLEET_OPERATOR_NAMESPACE", OPTIONAL, None, "watch this namespace only", flag="--namespace",
    field="namespace",
)
OPERATOR_KUBECONFIG = Setting(
    "RELAYFLEET_OPERATOR_KUBECONFIG", OPTIONAL, None,
    "kubeconfig (else KUBECONFIG's first file, else in-cluster)", field="kubeconfig",
)
SPARK_NAMESPACE = Setting(
    "RELAYFLEET_OPERATOR_SPARK_NAMESPACE", OPTIONAL, None,
    "the Spark jobs' namespace: admitted to their fleets' Redis, given a copy of their credentials",
    field="neighbours.spark_namespace",
)
SPARK_FLEETS = Setting(
    "RELAYFLEET_OPERATOR_SPARK_FLEETS", FLEETS, frozenset(),
    "the fleets NS/FLEET,... that the Spark jobs serve",
    field="neighbours.spark_fleets",
)
# Every variable the operator reads, in the order --help and docs/configuration.md show them.
OPERATOR_SETTINGS: tuple[Setting[Any], ...] = (
    NAMESPACE,
    Setting("RELAYFLEET_OPERATOR_HEALTH_PORT", PORT_NUMBER, 8080, "kopf liveness endpoint (/healthz)",
            lo=0, hi=65535, refuse=_PORT_REFUSED, field="health_port"),
    Setting("RELAYFLEET_OPERATOR_METRICS_PORT", PORT_NUMBER, 9090, "Prometheus /metrics (0 disables)",
            lo=0, hi=65535, refuse=_PORT_REFUSED, field="metrics_port"),
    Setting("RELAYFLEET_OPERATOR_RESYNC_SECONDS", FLOAT, 30.0,
            "resync period of every RelayShard (drift, status)",
            lo=0, lo_open=True, refuse=_SECONDS_REFUSED, field="resync_seconds"),
    Setting("RELAYFLEET_OPERATOR_REAPPLY_SECONDS", FLOAT, 300.0,
            "an unchanged child is written again at most this often (a changed one at once)",
            lo=0, lo_open=True, refuse=_SECONDS_REFUSED, field="reapply_seconds"),
    Setting("RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS", FLOAT, 2.0, "step period of every RelayRebalance",
            lo=0, lo_open=True, refuse=_SECONDS_REFUSED, field="rebalance_tick_seconds"),
    Setting("RELAYFLEET_OPERATOR_RETRY_SECONDS", FLOAT, 15.0, "wait before retrying a failed or blocked step",
            lo=0, lo_open=True, refuse=_SECONDS_REFUSED, field="retry_seconds"),
    Setting("RELAYFLEET_OPERATOR_DEFAULT_RELAY_IMAGE", IMAGE, DEFAULT_IMAGE,
            "relay image of shards without spec.image", field="images.relay"),
    Setting("RELAYFLEET_OPERATOR_DEFAULT_REDIS_IMAGE", IMAGE, DEFAULT_REDIS_IMAGE,
            "Redis image of managed shards without spec.redis.managed.image", field="images.redis"),
    Setting(
        "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS", LIMITS, LimitDefaults(),
        "JSON object of spec.limits quota keys for shards that leave them out (a shard's own key wins)",
        field="limit_defaults",
    ),
    Setting(
        "RELAYFLEET_OPERATOR_POD_NAMESPACE", OPTIONAL, None,
        "the operator's own namespace: Redis NetworkPolicies admit it from there only (none: the shard's)",
        field="neighbours.operator_namespace",
    ),
    Setting(
        "RELAYFLEET_OPERATOR_POD_LABELS", LABELS, DEFAULT_OPERATOR_LABELS,
        "labels K=V,... that select the operator's Pods in Redis NetworkPolicies",
        field="neighbours.operator_labels",
    ),
    SPARK_NAMESPACE,
    SPARK_FLEETS,
    Setting("RELAYFLEET_OPERATOR_CRDS_DIR", OPTIONAL, None, "apply the CRD files there at start (guarded)",
            field="crds_dir"),
    OPERATOR_KUBECONFIG,
    relay_settings.KUBECONFIG,
    relay_settings.LOG_LEVEL,
)
# fmt: on


def _d(name: str) -> Any:
    """The declared default of a field (the dataclass repeats no value)."""
    return next(s.default for s in OPERATOR_SETTINGS if s.field == name)


@dataclass(frozen=True)
class OperatorSettings:
    """Plain values: `OperatorSettings()` is the defaults, whatever the environment holds."""

    namespace: str | None = None
    health_port: int = _d("health_port")
    metrics_port: int = _d("metrics_port")  # 0: no metrics endpoint
    resync_seconds: float = _d("resync_seconds")
    reapply_seconds: float = _d("reapply_seconds")
    rebalance_tick_seconds: float = _d("rebalance_tick_seconds")
    retry_seconds: float = _d("retry_seconds")
    # the images of a RelayShard that names none (the chart sets them from its values)
    images: ImageDefaults = field(default_factory=ImageDefaults)
    # spec.limits quota keys of a RelayShard that leaves them out (the chart's relayDefaults.limits)
    limit_defaults: LimitDefaults = field(default_factory=LimitDefaults)
    # who may reach Redis from outside a shard's namespace; where the Spark jobs run
    neighbours: Neighbours = field(default_factory=Neighbours)
    crds_dir: Path | None = None
    kubeconfig: str | None = None
    log_level: str = relay_settings.LOG_LEVEL.default

    @classmethod
    def from_env(cls) -> OperatorSettings:
        """The settings the environment gives; ConfigError (one line, naming the variable)."""
        values: dict[str, Any] = {"images": {}, "neighbours": {}}
        for s in OPERATOR_SETTINGS:
            if s.field is None:
                continue
            group, _, name = s.field.rpartition(".")
            (values[group] if group else values)[name] = s.read()
        if values["neighbours"]["spark_fleets"] and not values["neighbours"]["spark_namespace"]:
            raise ConfigError(f"{SPARK_FLEETS.env} needs {SPARK_NAMESPACE.env}")
        crds_dir = values.pop("crds_dir")
        kubeconfig = values.pop("kubeconfig") or _first_file(relay_settings.KUBECONFIG.read())
        return cls(
            images=ImageDefaults(**values.pop("images")),
            neighbours=Neighbours(**values.pop("neighbours")),
            crds_dir=Path(crds_dir) if crds_dir else None,
            kubeconfig=kubeconfig,
            log_level=relay_settings.LOG_LEVEL.read(),
            **values,
        )


def _first_file(paths: str | None) -> str | None:
    """KUBECONFIG's first file (kubectl merges the list; one file is enough here)."""
    first = (paths or "").split(os.pathsep)[0]
    return first or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `relayfleet operator` and `python -m relayfleet_operator` (resolve them with
    relay.envconfig.resolve_flags: a flag wins over its variable)."""
    scope = parser.add_mutually_exclusive_group()
    add_flag(parser, NAMESPACE, to=scope)
    scope.add_argument(
        "--all-namespaces", action="store_true", help="watch every namespace [no env; default off]"
    )
    add_flag(parser, relay_settings.LOG_LEVEL)


def env_help() -> str:
    """The environment section of --help: every variable with its default, and the old names."""
    return epilog("environment (read once at start; a bad value exits 2):", OPERATOR_SETTINGS)


def configure_logging(settings: OperatorSettings) -> None:
    """Log format and level; kopf's per-handler INFO lines only at DEBUG (periodic noise)."""
    logging.basicConfig(
        level=getattr(logging, settings.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.log_level != "DEBUG":
        for noisy in ("kopf.objects", "kopf.activities.probe", "aiohttp.access"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
