"""The pod runner's rewriting and the address table's resolution, without a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from e2e.podrunner.pods import RunPod
from e2e.podrunner.translate import PODENV, ROOT, expand, port_words, rewrite, rewrite_path, rewrite_text


def mounted_pod(tmp_path: Path) -> RunPod:
    pod = RunPod(uid="u", name="p", ip="10.244.0.2", spec={}, labels={}, dir=tmp_path)
    pod.mounts = {"/data": "/x/data", "/etc/redis": "/x/conf", "/tmp": "/x/tmp"}
    return pod


def test_expand_follows_kubernetes_rules() -> None:
    env = {"POD_NAMESPACE": "ns", "POD_IP": "10.0.0.1"}
    assert expand("$(POD_NAMESPACE)/relayfleet-main-shardmap", env) == "ns/relayfleet-main-shardmap"
    assert expand("spark.driver.host=$(POD_IP)", env) == "spark.driver.host=10.0.0.1"
    assert expand("$$(POD_IP)", env) == "$(POD_IP)"
    assert expand("$(UNKNOWN)", env) == "$(UNKNOWN)"


def test_paths_ports_and_wildcard_are_rewritten(tmp_path: Path) -> None:
    pod = mounted_pod(tmp_path)
    ports = {"8080": 41000, "http": 41000}
    assert rewrite("/etc/redis/redis.conf", pod, ports) == "/x/conf/redis.conf"
    assert rewrite("/tmp", pod, ports) == "/x/tmp"
    assert rewrite("/tmpfoo", pod, ports) == "/tmpfoo"  # a prefix, not a path inside
    assert rewrite("8080", pod, ports) == "41000"
    assert rewrite("0.0.0.0", pod, ports) == "127.0.0.1"
    assert rewrite("/app", pod, ports) == str(ROOT)  # the Spark image's repository
    assert rewrite_path("--report=/tmp/r.jsonl", pod) == "--report=/x/tmp/r.jsonl"


def test_config_files_get_their_paths_rewritten(tmp_path: Path) -> None:
    pod = mounted_pod(tmp_path)
    conf = 'port 6379\ndir "/data"\ninclude /etc/redis/auth.conf\n'
    assert rewrite_text(conf, pod) == 'port 6379\ndir "/x/data"\ninclude /x/conf/auth.conf\n'


def test_exec_probe_ports_are_translated() -> None:
    cmd = "redis-cli -p 6379 ping | grep -q PONG"
    assert port_words(cmd, {"6379": 5000, "redis": 5000}) == "redis-cli -p 5000 ping | grep -q PONG"


def test_processes_resolve_service_names_through_the_table(tmp_path: Path) -> None:
    table = tmp_path / "addresses.json"
    table.write_text(json.dumps({"relayfleet-a-redis.ns.svc:6379": ["127.0.0.1:5999"]}))
    code = (
        "import socket, uvloop\n"
        "from relay.fleet.migration import shard_ops\n"
        "print(socket.getaddrinfo('relayfleet-a-redis.ns.svc', 6379)[0][4])\n"
        "print(shard_ops.migrate_address('a', 'redis://:pw@relayfleet-a-redis.ns.svc:6379/0'))\n"
        "print(uvloop.run.__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{PODENV}{os.pathsep}{ROOT}", "RELAYFLEET_E2E_ADDRESSES": str(table)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    assert out[0] == "('127.0.0.1', 5999)"
    assert "host='127.0.0.1', port=5999" in out[1]
    assert out[2] == "sitecustomize"  # asyncio's loop: uvloop would resolve past the table
