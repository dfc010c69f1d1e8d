"""The chart's relayDefaults.limits: the spec.limits keys without a CRD default, declared in
values.schema.json exactly as crds/relayshards.yaml declares them, and handed to the operator
as RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS (which it applies under each RelayShard's own keys)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from relayfleet_operator import builders
from relayfleet_operator.config import OPERATOR_SETTINGS, OperatorSettings
from relayfleet_operator.spec import (
    CRD_DEFAULTED_LIMITS,
    DEFAULTABLE_LIMITS,
    RESERVED_RELAY_ENV,
    parse_shard,
)

from relay.envconfig import Setting
from relay.settings import RELAY_SETTINGS
from tests.support.chart import CHART, crd, helm, needs_helm, schema_of
from tests.support.shard_specs import shard_body

ENV = "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS"


def _crd_limits() -> dict[str, Any]:
    spec = schema_of(crd("relayshards.yaml"))["properties"]["spec"]
    props: dict[str, Any] = spec["properties"]["limits"]["properties"]
    return props


def _values_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def test_values_schema_declares_each_limit_as_the_crd_does() -> None:
    limits = _values_schema()["properties"]["relayDefaults"]["properties"]["limits"]
    assert limits["additionalProperties"] is False  # a typo, or a key with a CRD default, is refused
    undefaulted = {k: v for k, v in _crd_limits().items() if "default" not in v}
    # same keys (and the ones the operator takes), each with the same type, range, pattern, text
    assert limits["properties"] == undefaulted
    assert set(undefaulted) == set(DEFAULTABLE_LIMITS)
    assert yaml.safe_load((CHART / "values.yaml").read_text())["relayDefaults"] == {"limits": {}}


def test_values_schema_refuses_what_the_crd_refuses() -> None:
    schema = _values_schema()
    jsonschema.validate({"relayDefaults": {"limits": {"clientRateMessages": 0}}}, schema)
    for bad in (
        {"maxPayloadBytes": 1024},  # has a CRD default: set it per RelayShard
        {"shardReserveFraction": 0.95},
        {"clientRateWindowMs": 0},
        {"recipientMaxChannels": 1.5},
        {"trustedProxies": ["10.0.0.0/8 "]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"relayDefaults": {"limits": bad}}, schema)


def _operator_env(tmp_path: Path, values: dict[str, Any] | None) -> dict[str, str]:
    args = ["template", "relayfleet", str(CHART), "--namespace", "relay"]
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    (dep,) = (
        d
        for d in yaml.safe_load_all(helm(*args))
        if d and d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
    )
    # (downward-API variables carry valueFrom, not value)
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e}


@needs_helm
def test_the_chart_hands_its_limit_defaults_to_the_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ENV in {v.env for v in OPERATOR_SETTINGS}
    assert ENV not in _operator_env(tmp_path, None)  # empty by default: no variable, no defaults
    limits = {
        "clientRateMessages": 2000,
        "clientRateBytes": 1 << 40,  # the largest the schema admits, as a whole number
        "shardReserveFraction": 0.1,
        "trustedProxies": ["10.244.0.0/16", "fd00::/8"],
        "didcommIdleExpirySeconds": 0,
    }
    env = _operator_env(tmp_path, {"ingress": {"enabled": True}, "relayDefaults": {"limits": limits}})
    assert json.loads(env[ENV]) == limits
    # as the operator reads it, down to a relay Deployment's environment
    monkeypatch.setenv(ENV, env[ENV])
    shard = parse_shard(
        shard_body(limits={"clientRateMessages": 50}),
        limit_defaults=OperatorSettings.from_env().limit_defaults,
    )
    relay = {e["name"]: e["value"] for e in builders.relay_env(shard)}
    assert relay["RELAY_CLIENT_RATE_MESSAGES"] == "50"  # the RelayShard's own key wins
    assert relay["RELAY_CLIENT_RATE_BYTES"] == str(1 << 40)
    assert relay["RELAY_SHARD_RESERVE_FRACTION"] == "0.1"
    assert relay["RELAY_TRUSTED_PROXIES"] == "10.244.0.0/16,fd00::/8"
    assert relay["RELAY_DIDCOMM_IDLE_EXPIRY_S"] == "0"


# -- one declaration: the relay's settings name their spec.limits key (relay/settings.py) -----------


def _limit_settings() -> dict[str, Setting[Any]]:
    return {s.limit_key: s for s in RELAY_SETTINGS if s.limit_key}


def test_every_crd_limit_is_a_declared_relay_setting_and_back() -> None:
    crd_limits = _crd_limits()
    declared = _limit_settings()
    assert set(crd_limits) == set(declared)  # a limit added on one side only fails here
    assert {k for k, v in crd_limits.items() if "default" in v} == set(CRD_DEFAULTED_LIMITS)
    for key in CRD_DEFAULTED_LIMITS:  # the CRD's default is the relay's own
        assert crd_limits[key]["default"] * declared[key].limit_scale == declared[key].default, key
    # what the operator defaults when spec.limits is empty: the relay's defaults again
    relay = {e["name"]: e["value"] for e in builders.relay_env(parse_shard(shard_body()))}
    for key in CRD_DEFAULTED_LIMITS:
        assert relay[declared[key].env] == str(declared[key].default), key
    for key in DEFAULTABLE_LIMITS:
        assert declared[key].env not in relay, key  # the relay's own default holds


def test_each_spec_limits_key_reaches_its_declared_relay_variable() -> None:
    values: dict[str, Any] = {}
    for key, schema in _crd_limits().items():
        if schema["type"] == "array":
            values[key] = ["10.1.0.0/16", "fd00::/8"]
        elif schema["type"] == "number":
            values[key] = 0.25
        else:
            values[key] = max(schema.get("minimum", 0), 1) + 2  # in range, unlike any default
    relay = {e["name"]: e["value"] for e in builders.relay_env(parse_shard(shard_body(limits=values)))}
    for key, setting in _limit_settings().items():
        value = values[key]
        expected = ",".join(value) if isinstance(value, list) else str(value * setting.limit_scale)
        assert relay[setting.env] == expected, key
        assert setting.env in RESERVED_RELAY_ENV  # spec.relay.env cannot shadow it
        assert setting.parse(setting.env, relay[setting.env]) is not None  # and the relay takes it


@needs_helm
def test_every_variable_the_chart_gives_the_operator_is_declared_and_valid(tmp_path: Path) -> None:
    declared = {s.env: s for s in OPERATOR_SETTINGS}
    values = {"relayDefaults": {"limits": {"clientRateMessages": 5}}, "spark": {"fleets": ["main"]}}
    full = _operator_env(tmp_path, values)
    assert {"RELAYFLEET_OPERATOR_SPARK_FLEETS", "RELAYFLEET_OPERATOR_DEFAULT_RELAY_LIMITS"} <= set(full)
    for env in (_operator_env(tmp_path, None), full):
        assert set(env) <= set(declared)
        for name, raw in env.items():
            declared[name].parse(name, raw)  # the operator would start with it (no ConfigError)
    env = _operator_env(tmp_path, None)
    # the chart's defaults are the operator's own
    for name in (
        "RELAYFLEET_OPERATOR_HEALTH_PORT",
        "RELAYFLEET_OPERATOR_METRICS_PORT",
        "RELAYFLEET_OPERATOR_RESYNC_SECONDS",
        "RELAYFLEET_OPERATOR_REBALANCE_TICK_SECONDS",
        "RELAY_LOG_LEVEL",
    ):
        assert declared[name].parse(name, env[name]) == declared[name].default, name
