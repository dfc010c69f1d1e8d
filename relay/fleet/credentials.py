"""Full Redis URLs (with passwords) kept out of the shard map.

The operator stores them in the fleet's credentials Secret, mounted as one file
per shard; relays, migrations and the Spark jobs all read them the same way, from the directory
RELAY_REDIS_CREDENTIALS_DIR names (declared once: relay/settings.py's CREDENTIALS_DIR).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from relay.fleet.sharding import ShardMap


class CredentialsError(ValueError):
    pass


def shard_url(name: str, url: str, directory: str | None) -> str:
    """`directory`/<name> when it exists and is non-empty, else the map's own URL."""
    if not directory:
        return url
    try:
        text = (Path(directory) / name).read_text("utf-8").strip()
    except FileNotFoundError:
        return url
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials for shard {name}: {exc.strerror or exc}") from None
    return text or url


def apply_credentials(shard_map: ShardMap, directory: str | None) -> ShardMap:
    if not directory:
        return shard_map
    if not Path(directory).is_dir():
        raise CredentialsError(f"credentials directory {directory} does not exist")
    urls = {name: shard_url(name, url, directory) for name, url in shard_map.shards.items()}
    return dataclasses.replace(shard_map, shards=urls)
