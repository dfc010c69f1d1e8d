"""The Spark jobs' settings (retention, rebalance, and `relayfleet plan`), declared once.

Where the shard map is and where the full shard URLs are, the jobs read exactly as the relays
do: the relay's own declarations (relay/settings.py), the same variables, defaults and help,
with the flag each job takes derived from them. The Pushgateway is the jobs' own. The flags,
the environment reading, `--help` and docs/configuration.md's Spark section all come from here.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from relay import settings as relay_settings
from relay.envconfig import Setting, add_flag, epilog, resolve_flags

# the relays' map source: a file, or the ConfigMap they watch (one of the two)
SHARD_MAP = relay_settings.SHARD_MAP
SHARD_MAP_CONFIGMAP = relay_settings.SHARD_MAP_CONFIGMAP
MAP_SOURCE: tuple[Setting[Any], ...] = (SHARD_MAP, SHARD_MAP_CONFIGMAP)
# the relay reads it from the environment only; a job run by hand takes the flag as well
CREDENTIALS_DIR = dataclasses.replace(relay_settings.CREDENTIALS_DIR, flag="--credentials-dir")
PUSHGATEWAY: Setting[str | None] = Setting(
    "RELAYFLEET_PUSHGATEWAY",
    relay_settings.OPTIONAL,
    None,
    "push the run summary to this Prometheus Pushgateway",
    flag="--pushgateway",
    metavar="URL",
)
# read by relay/kubeapi.py when a job reads the ConfigMap and the RelayShards outside a pod; the
# jobs take no flag for it
KUBECONFIG = dataclasses.replace(relay_settings.KUBECONFIG, flag=None)

# `relayfleet plan` reads these; the Spark jobs also PUSHGATEWAY
PLAN_SETTINGS: tuple[Setting[Any], ...] = (*MAP_SOURCE, CREDENTIALS_DIR, KUBECONFIG)
SPARK_SETTINGS: tuple[Setting[Any], ...] = (*PLAN_SETTINGS, PUSHGATEWAY)


def add_source_args(p: argparse.ArgumentParser) -> None:
    """--shard-map | --shard-map-configmap, and --credentials-dir: every job reads its fleet so."""
    src = p.add_mutually_exclusive_group()
    for setting in MAP_SOURCE:
        add_flag(p, setting, to=src)
    add_flag(p, CREDENTIALS_DIR)


def environment_help(settings: tuple[Setting[Any], ...] = SPARK_SETTINGS) -> str:
    """--help's list of every variable the job reads."""
    return epilog("environment (a flag above wins over its variable):", settings)


def resolve(args: argparse.Namespace) -> None:
    """Fill the flags not given from their variables (ConfigError when a value is bad). A map
    source given on the command line wins over both map variables: the other one is not read
    from the environment (else a --shard-map FILE beside the relays' RELAY_SHARD_MAP_CONFIGMAP
    would be refused as two sources)."""
    given = {s.env for s in MAP_SOURCE if getattr(args, _dest(s), None) is not None}
    resolve_flags(args)
    if given:
        for setting in MAP_SOURCE:
            if setting.env not in given:
                setattr(args, _dest(setting), None)


def _dest(setting: Setting[Any]) -> str:
    assert setting.flag is not None, setting.env
    return setting.flag.removeprefix("--").replace("-", "_")
