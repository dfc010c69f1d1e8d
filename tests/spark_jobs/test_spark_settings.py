"""The Spark jobs and `relayfleet plan` read their settings through one declaration each
(spark_jobs/settings.py, the relay's own for the map and the credentials): every job's --help
names every variable it reads, and every job reads them alike. No Spark starts here: each case
stops before it (bad input, exit 2)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from relay.fleet.sharding import even_split
from spark_jobs import rebalance, retention
from spark_jobs.load_planner import plan_main
from spark_jobs.settings import MAP_SOURCE, PLAN_SETTINGS, PUSHGATEWAY, SPARK_SETTINGS
from spark_jobs.shard_io import parse_job_args

JOBS: dict[str, Callable[[Sequence[str]], int]] = {
    "retention": retention.main,
    "rebalance": rebalance.main,
    "plan": lambda argv: plan_main(list(argv)),
}
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "retention": retention._parser,
    "rebalance": rebalance._parser,
}


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in SPARK_SETTINGS:
        monkeypatch.delenv(s.env, raising=False)


def _map_file(tmp_path: Path) -> Path:
    path = tmp_path / "map.json"
    # port 1: nothing listens, and no case here gets as far as connecting
    path.write_text(json.dumps(even_split("f", {"a": "redis://127.0.0.1:1/0"}).to_json()))
    return path


@pytest.mark.parametrize("job", sorted(JOBS))
def test_help_names_every_variable_the_job_reads(job: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert JOBS[job](["--help"]) == 0
    shown = capsys.readouterr().out
    for s in PLAN_SETTINGS if job == "plan" else SPARK_SETTINGS:
        assert f"\n  {s.env} " in shown, s.env  # the environment list
        if s.flag:
            assert f"env {s.env}; default {s.shown_default}]" in " ".join(shown.split()), s.env
    if job == "plan":  # no run summary to push without Spark
        assert PUSHGATEWAY.env not in shown


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_reads_the_map_from_the_relays_variable(
    job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """RELAY_SHARD_MAP is the map when no flag names one, for each job alike (retention once
    ignored it); a flag given wins over both map variables, not a second source."""
    monkeypatch.setenv("RELAY_SHARD_MAP", str(tmp_path / "from-env.json"))
    assert JOBS[job]([]) == 2
    assert f"cannot read shard map {tmp_path / 'from-env.json'}" in capsys.readouterr().err
    monkeypatch.delenv("RELAY_SHARD_MAP")
    monkeypatch.setenv("RELAY_SHARD_MAP_CONFIGMAP", "relays/shardmap")
    assert JOBS[job](["--shard-map", str(tmp_path / "from-flag.json")]) == 2
    err = capsys.readouterr().err
    assert f"cannot read shard map {tmp_path / 'from-flag.json'}" in err
    assert "not both" not in err
    monkeypatch.setenv("RELAY_SHARD_MAP_CONFIGMAP", "no-slash")
    assert JOBS[job]([]) == 2
    assert "must be NAMESPACE/NAME, got 'no-slash'" in capsys.readouterr().err


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_reads_the_credentials_dir_from_the_relays_variable(
    job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RELAY_SHARD_MAP", str(_map_file(tmp_path)))
    monkeypatch.setenv("RELAY_REDIS_CREDENTIALS_DIR", str(tmp_path / "env-secrets"))
    assert JOBS[job]([]) == 2
    assert f"credentials directory {tmp_path / 'env-secrets'} does not exist" in capsys.readouterr().err
    assert JOBS[job](["--credentials-dir", str(tmp_path / "flag-secrets")]) == 2  # the flag wins
    assert f"credentials directory {tmp_path / 'flag-secrets'} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("job", sorted(PARSERS))
def test_flags_not_given_come_from_their_variables(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = parse_job_args(PARSERS[job](), [])
    assert (empty.shard_map, empty.shard_map_configmap, empty.credentials_dir, empty.pushgateway) == (
        None,
    ) * 4
    monkeypatch.setenv("RELAYFLEET_PUSHGATEWAY", "http://gateway:9091")
    monkeypatch.setenv("RELAY_REDIS_CREDENTIALS_DIR", "")  # empty counts as unset, as for the relay
    for s in MAP_SOURCE:
        monkeypatch.setenv(s.env, f"from/{s.env}")
    args = parse_job_args(PARSERS[job](), ["--pushgateway", "http://flag:9091"])
    assert (args.pushgateway, args.credentials_dir) == ("http://flag:9091", None)
    # neither map flag given: both variables as set (load_shard_map refuses the pair, one line)
    assert (args.shard_map, args.shard_map_configmap) == (
        "from/RELAY_SHARD_MAP",
        "from/RELAY_SHARD_MAP_CONFIGMAP",
    )
    assert parse_job_args(PARSERS[job](), []).pushgateway == "http://gateway:9091"
