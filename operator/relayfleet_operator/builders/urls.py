"""Redis URLs and addresses of a shard: what the credentials Secret, the shard map and status show."""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

from relay.fleet.sharding import (
    SentinelTarget,
    is_sentinel_url,
    parse_sentinel_url,
)
from relayfleet_operator.builders.meta import managed_spec
from relayfleet_operator.builders.names import (
    REDIS_PORT,
    SENTINEL_PORT,
    SENTINELS_PER_SHARD,
    redis_name,
    sentinel_master_name,
    sentinel_name,
)
from relayfleet_operator.spec import ShardSpec


def strip_credentials(url: str) -> str:
    """The URL without user:password, safe to put in a ConfigMap or a status."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def endpoint_of(url: str) -> str:
    """host:port (or the socket path) of a Redis URL, without credentials; for a Sentinel
    URL, the service and the Sentinels (the primary is in status.redis)."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).redacted()
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or REDIS_PORT}"


def managed_redis_host(shard: ShardSpec) -> str:
    return f"{redis_name(shard.name)}.{shard.namespace}.svc"


def managed_redis_url(shard: ShardSpec, password: str | None = None, ca_pem: str | None = None) -> str:
    """URL of a managed shard's Redis; with the password only for the credentials Secret.
    With replicas it names the shard's Sentinels (a redis+sentinel:// URL, written into the
    shard map as a Sentinel entry: relay/fleet/sharding.py). With TLS the URL carries the CA
    itself (`ssl_ca_data`, read by relay/storage/connection.py and redis-py alike), so relays,
    the operator and the Spark jobs verify the shard without mounting anything."""
    managed = managed_spec(shard)
    if managed.sentinel:
        return SentinelTarget(
            sentinels=tuple(_split_address(a) for a in sentinel_addresses(shard)),
            service=sentinel_master_name(shard),
            password=password or None,
            min_replicas=managed.min_replicas,
        ).url()
    auth = f":{quote(password, safe='')}@" if password else ""
    base = f"{auth}{managed_redis_host(shard)}:{REDIS_PORT}/0"
    if managed.tls_secret:
        if not ca_pem or "BEGIN CERTIFICATE" not in ca_pem:
            raise ValueError(f"Secret {managed.tls_secret} must hold the CA certificate in ca.crt")
        return f"rediss://{base}?ssl_ca_data={quote(ca_pem.strip(), safe='')}"
    return f"redis://{base}"


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def redis_pod_host(shard: ShardSpec, ordinal: int) -> str:
    name = redis_name(shard.name)
    return f"{name}-{ordinal}.{name}.{shard.namespace}.svc"


def sentinel_addresses(shard: ShardSpec) -> list[str]:
    name = sentinel_name(shard.name)
    return [f"{name}-{i}.{name}.{shard.namespace}.svc:{SENTINEL_PORT}" for i in range(SENTINELS_PER_SHARD)]
