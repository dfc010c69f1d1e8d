"""spec.redis.managed.tls: the operator's builders give Redis a TLS-only redis.conf with the
certificate Secret mounted, and a rediss:// URL carrying the CA for relays, migrator and Spark;
the generated redis.conf and URL work together on a real redis-server (only file paths pointed at
a temp dir), for the relay's own client and redis-py."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from relayfleet_operator import builders
from relayfleet_operator.spec import ManagedRedis, parse_shard
from relayfleet_testing.localredis import free_port

from relay.storage import keys as K
from relay.storage.connection import RedisTarget
from relay.storage.store import EnqueueRequest, QueueLimits, ShardStore
from tests.support.shard_specs import shard_body
from tests.support.tls_pki import make_pki

DEBIAN_REDIS = "/usr/bin/redis-server"
TLS = parse_shard(shard_body("t", redis={"managed": {"tls": {"secretName": "shard-t-tls"}}}))


def test_tls_parses() -> None:
    # with replicas, or without a secretName, the API server refuses it (tests/operator/test_operator_k8s.py)
    assert isinstance(TLS.redis, ManagedRedis)
    assert TLS.redis.tls_secret == "shard-t-tls"


def test_builders_mount_the_certificate_and_put_the_ca_in_the_url(tmp_path: Path) -> None:
    ca = make_pki(tmp_path).ca.read_text()
    url = builders.managed_redis_url(TLS, "p w", ca)
    assert url.startswith("rediss://:p%20w@relayfleet-t-redis.ns1.svc:6379/0?ssl_ca_data=-----BEGIN")
    target = RedisTarget.from_url(url)  # the relay reads back exactly the CA
    assert target.tls
    assert target.options["ssl_ca_data"] == ca.strip()
    ctx = target.ssl_context()
    assert ctx is not None
    assert ctx.check_hostname  # the certificate must name the Service
    with pytest.raises(ValueError, match=r"ca\.crt"):
        builders.managed_redis_url(TLS, "pw", "not a certificate")
    assert builders.strip_credentials(url).startswith("rediss://relayfleet-t-redis.ns1.svc:6379/0?ssl_ca")
    conf = builders.redis_config_map(TLS)["data"]["redis.conf"]
    assert "port 0\n" in conf
    assert "tls-port 6379\n" in conf
    assert "tls-cluster yes\n" in conf
    pod = builders.redis_statefulset(TLS)["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "shard-t-tls"}} in pod["volumes"]
    redis = pod["containers"][0]
    assert {"name": "tls", "mountPath": "/etc/redis-tls", "readOnly": True} in redis["volumeMounts"]
    assert "--tls --cacert /etc/redis-tls/ca.crt" in redis["readinessProbe"]["exec"]["command"][2]
    assert "tls-port" not in builders.redis_config_map(parse_shard(shard_body()))["data"]["redis.conf"]


@pytest.mark.skipif(not os.path.exists(DEBIAN_REDIS), reason="Debian redis-server not installed")
async def test_generated_tls_conf_and_url_work_on_real_redis(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    secret = tmp_path / "redis-tls"  # what the kubernetes.io/tls Secret mount holds
    secret.mkdir()
    shutil.copy(pki.server_cert, secret / "tls.crt")
    shutil.copy(pki.server_key, secret / "tls.key")
    shutil.copy(pki.ca, secret / "ca.crt")
    password = 'pw/with@odd "chars\\'
    (tmp_path / "auth.conf").write_text(builders.redis_auth_conf(password))
    conf = builders.redis_config_map(TLS)["data"]["redis.conf"]
    conf = conf.replace(builders.REDIS_TLS_DIR, str(secret)).replace('dir "/data"', f'dir "{tmp_path}"')
    conf = conf.replace("/etc/redis-secret/auth.conf", str(tmp_path / "auth.conf"))
    port = free_port()
    conf = conf.replace(f"tls-port {builders.REDIS_PORT}", f"tls-port {port}").replace(
        "bind * -::*", "bind 127.0.0.1"
    )
    (tmp_path / "redis.conf").write_text(conf)
    proc = subprocess.Popen(  # noqa: ASYNC220  # started once, stopped by pid below
        [DEBIAN_REDIS, str(tmp_path / "redis.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = builders.managed_redis_url(TLS, password, (secret / "ca.crt").read_text())
    url = url.replace(builders.managed_redis_host(TLS), "127.0.0.1").replace(":6379/", f":{port}/")
    assert quote(password, safe="") in url
    store = ShardStore("t", url, QueueLimits())
    try:
        deadline = time.monotonic() + 10
        while not await store.ping():
            assert proc.poll() is None, "redis-server refused the generated redis.conf"
            assert time.monotonic() < deadline, store.last_error
            await asyncio.sleep(0.1)
        await store.start()
        with redis.Redis.from_url(url) as migrator_view:  # redis-py (migrator, Spark): the same URL
            assert migrator_view.ping()
        r = os.urandom(32)
        q = K.queue_keys(r, b"")
        assert (await store.enqueue(q, EnqueueRequest(r, b"", b"over tls"), 1000)).seq == 1
        assert [m.payload for m in (await store.read(q, None, 10)).messages] == [b"over tls"]
        plain = ShardStore("t", f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0", QueueLimits())
        try:
            assert not await plain.ping()  # no plaintext port: TLS only
        finally:
            await plain.close()
    finally:
        await store.close()
        proc.terminate()
        proc.wait(10)
