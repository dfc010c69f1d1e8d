"""RelayShard spec.relay without an API server: parsing, the relay Deployment the builders make
of it, and the relay reading its secrets from mounted files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from relayfleet_operator import builders
from relayfleet_operator.spec import RESERVED_RELAY_ENV, parse_shard

from relay.settings import BY_ENV, env_secret
from tests.support.chart import crd, schema_of
from tests.support.shard_specs import FULL_RELAY, shard_body


def full_deployment() -> dict[str, Any]:
    return builders.relay_deployment(parse_shard(shard_body(relay=FULL_RELAY)))


def test_without_spec_relay_the_pod_is_unchanged() -> None:
    pod = builders.relay_deployment(parse_shard(shard_body()))["spec"]["template"]["spec"]
    env = {e["name"] for e in pod["containers"][0]["env"]}
    assert not env & {"RELAY_PUBLIC_URL", "RELAY_ENQUEUE_TOKENS_FILE", "RELAY_PUSH_WEBHOOK_FILE"}
    assert {v["name"] for v in pod["volumes"]} == {"credentials", "tmp"}
    assert not pod.keys() & {"affinity", "tolerations", "nodeSelector", "priorityClassName"}


def test_secrets_are_mounted_files_never_env_values() -> None:
    dep = full_deployment()
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    files = {
        "RELAY_ENQUEUE_TOKENS_FILE": ("relay-tokens", "tokens"),
        "RELAY_PUSH_WEBHOOK_FILE": ("push", "endpoint"),
        "RELAY_DIDCOMM_SEED_FILE": ("didcomm", "seed"),
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for name, (secret, key) in files.items():
        path = env[name]["value"]
        directory, filename = path.rsplit("/", 1)
        mount = mounts[directory]
        assert mount["readOnly"] is True
        source = volumes[mount["name"]]["secret"]
        assert source["secretName"] == secret
        assert source["items"] == [{"key": key, "path": filename}]
        assert source["defaultMode"] == 0o440
    # No secretKeyRef env (it would put the value into the process environment) and no
    # plain secret variables.
    assert all("valueFrom" not in e for e in container["env"])
    assert not env.keys() & {"RELAY_ENQUEUE_TOKENS", "RELAY_PUSH_WEBHOOK", "RELAY_DIDCOMM_SEED"}


def test_public_url_extra_env_and_pod_template_reach_the_pod() -> None:
    dep = full_deployment()
    template = dep["spec"]["template"]
    pod = template["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["RELAY_PUBLIC_URL"] == "https://relay.example.com"
    assert env["RELAY_MAX_WAITERS"] == "5000"
    assert env["RELAY_LOG_LEVEL"] == "DEBUG"
    assert env["RELAY_FLEET"] == "main"  # the operator's own still there
    t = FULL_RELAY["podTemplate"]
    assert pod["affinity"] == t["affinity"]
    assert pod["tolerations"] == t["tolerations"]
    assert pod["topologySpreadConstraints"] == t["topologySpreadConstraints"]
    assert pod["nodeSelector"] == {"pool": "relays"}
    assert pod["priorityClassName"] == "relay-critical"
    annotations = template["metadata"]["annotations"]
    assert annotations["example.com/team"] == "messaging"
    assert annotations["prometheus.io/port"] == str(builders.RELAY_PORT)  # the operator's wins


def test_secrets_digest_rolls_the_relays_when_a_secret_changes() -> None:
    shard = parse_shard(shard_body(relay=FULL_RELAY))
    refs = builders.relay_secret_refs(shard)
    assert [(r.name, r.key) for r in refs] == [
        ("relay-tokens", "tokens"),
        ("push", "endpoint"),
        ("didcomm", "seed"),
    ]
    one = builders.secrets_hash(shard, [b"tok-1", b"https://push", b"s" * 32])
    two = builders.secrets_hash(shard, [b"tok-2", b"https://push", b"s" * 32])
    missing = builders.secrets_hash(shard, [None, b"https://push", b"s" * 32])
    empty = builders.secrets_hash(shard, [b"", b"https://push", b"s" * 32])
    assert len({one, two, missing, empty}) == 4
    assert "tok" not in one
    other_shard = parse_shard(shard_body("z", relay=FULL_RELAY))
    assert builders.secrets_hash(other_shard, [b"tok-1", b"https://push", b"s" * 32]) != one  # keyed by uid

    def annotation(digest: str | None) -> str | None:
        meta = builders.relay_deployment(shard, digest)["spec"]["template"]["metadata"]
        value: str | None = meta["annotations"].get(builders.SECRETS_HASH)
        return value

    assert annotation(one) == one
    assert annotation(None) is None
    assert builders.relay_secret_refs(parse_shard(shard_body())) == []


def test_crd_reserved_env_list_matches_the_operator() -> None:
    relay = schema_of(crd("relayshards.yaml"))["properties"]["spec"]["properties"]["relay"]
    rule = relay["properties"]["env"]["items"]["x-kubernetes-validations"][0]["rule"]
    listed = {part.strip(" '") for part in rule.split("[", 1)[1].split("]", 1)[0].split(",")}
    assert listed == RESERVED_RELAY_ENV
    # Every variable the builders set is reserved (so spec.relay.env cannot shadow it).
    env = full_deployment()["spec"]["template"]["spec"]["containers"][0]["env"]
    own = {e["name"] for e in env} - {e["name"] for e in FULL_RELAY["env"]}
    assert own <= RESERVED_RELAY_ENV


# --- the relay side: *_FILE variables --------------------------------------------------------


def test_env_secret_prefers_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alpha\nbeta, gamma\n\n")
    monkeypatch.setenv("RELAY_ENQUEUE_TOKENS", "inline")
    assert BY_ENV["RELAY_ENQUEUE_TOKENS"].read() == ("inline",)
    monkeypatch.setenv("RELAY_ENQUEUE_TOKENS_FILE", str(tokens))
    assert BY_ENV["RELAY_ENQUEUE_TOKENS"].read() == ("alpha", "beta", "gamma")
    hook = tmp_path / "hook"
    hook.write_text("https://push.example/x?key=secret\n")
    monkeypatch.setenv("RELAY_PUSH_WEBHOOK_FILE", str(hook))
    assert env_secret("RELAY_PUSH_WEBHOOK") == "https://push.example/x?key=secret"
    monkeypatch.delenv("RELAY_PUSH_WEBHOOK_FILE")
    assert env_secret("RELAY_PUSH_WEBHOOK") is None


def test_unreadable_secret_file_is_one_line_without_content(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    proc = subprocess.run(
        [sys.executable, "-m", "relay", "--redis-url", "redis://127.0.0.1:1/0"],
        env={
            "PATH": "/usr/bin:/bin",
            "RELAY_ENQUEUE_TOKENS_FILE": str(missing),
            "PYTHONPATH": ":".join(sys.path),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"RELAY_ENQUEUE_TOKENS_FILE {missing}" in lines[0]
    assert "Traceback" not in proc.stderr


def test_push_credentials_mount_a_whole_secret_and_roll_the_relays() -> None:
    """spec.relay.pushCredentialsSecretRef: the Secret mounted whole, read-only, owner-readable,
    at the path RELAY_PUSH_CREDENTIALS_DIR names; each provider file is hashed, so rotating a
    key (or adding a provider) rolls the relays."""
    shard = parse_shard(shard_body(relay={"pushCredentialsSecretRef": {"name": "wallet-push"}}))
    pod = builders.relay_deployment(shard)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    directory = env["RELAY_PUSH_CREDENTIALS_DIR"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == directory)
    assert mount["readOnly"] is True
    source = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert source == {"secretName": "wallet-push", "defaultMode": 0o440}
    refs = builders.relay_secret_refs(shard)
    assert [(r.name, r.key) for r in refs] == [
        ("wallet-push", "fcm-service-account.json"),
        ("wallet-push", "apns-auth-key.p8"),
        ("wallet-push", "apns-key-id"),
        ("wallet-push", "apns-team-id"),
        ("wallet-push", "apns-topic"),
    ]
    fcm_only = builders.secrets_hash(shard, [b"{}", None, None, None, None])
    both = builders.secrets_hash(shard, [b"{}", b"key", b"K", b"T", b"org.x"])
    assert fcm_only != both
    bare = builders.relay_deployment(parse_shard(shard_body()))["spec"]["template"]["spec"]
    assert "RELAY_PUSH_CREDENTIALS_DIR" not in {e["name"] for e in bare["containers"][0]["env"]}
