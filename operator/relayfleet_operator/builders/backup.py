"""Backups: the claim they live on and the CronJob that takes them."""

from __future__ import annotations

from relay.fleet.contract import Obj
from relayfleet_operator.builders.meta import shard_meta
from relayfleet_operator.builders.names import (
    CREDENTIALS_DIR,
    LABEL_REDIS_CLIENT,
    RELAY_UID,
    backup_name,
    credentials_name,
    labels,
)
from relayfleet_operator.builders.pods import (
    claim_spec,
    container_security,
    mount,
    pod_security,
    scratch_volume,
    secret_volume,
)
from relayfleet_operator.spec import (
    Backup,
    ShardSpec,
)

BACKUP_DIR = "/backups"


def _backup_spec(shard: ShardSpec) -> Backup:
    if shard.backup is None:
        raise ValueError(f"RelayShard {shard.name} has no spec.backup")
    return shard.backup


def backup_claim(shard: ShardSpec) -> Obj:
    """The claim the backups live on. No owner reference: deleting the shard keeps its
    backups (they are what a restore needs after a mistake)."""
    backup = _backup_spec(shard)
    spec = claim_spec(backup.storage_size, backup.storage_class)
    meta = shard_meta(backup_name(shard.name), shard, "backup")
    del meta["ownerReferences"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def backup_cronjob(shard: ShardSpec) -> Obj:
    """`relayfleet backup` on a schedule: a point-in-time snapshot of the shard's Redis onto
    the claim. The URL comes from the fleet's credentials Secret; for a shard with replicas
    it names the Sentinels, and the backup is taken from the primary they name."""
    backup = _backup_spec(shard)
    args = [
        "backup",
        "--redis-url-file",
        f"{CREDENTIALS_DIR}/{shard.name}",
        "--shard",
        shard.name,
        "--to",
        BACKUP_DIR,
        "--keep",
        str(backup.keep),
    ]
    pod_labels = {**labels(shard.fleet, shard.name, "backup"), LABEL_REDIS_CLIENT: "true"}
    container: Obj = {
        "name": "backup",
        "image": shard.image,
        "imagePullPolicy": shard.image_pull_policy,
        "command": ["relayfleet"],
        "args": args,
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [
            mount("credentials", CREDENTIALS_DIR, read_only=True),
            mount("backups", BACKUP_DIR),
            mount("tmp", "/tmp"),
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": shard_meta(backup_name(shard.name), shard, "backup"),
        "spec": {
            "schedule": backup.schedule,
            "timeZone": "Etc/UTC",
            "suspend": backup.suspend,
            # One backup at a time: the claim is ReadWriteOnce and snapshots fork the primary.
            "concurrencyPolicy": "Forbid",
            "startingDeadlineSeconds": 600,
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "backoffLimit": 2,
                    "activeDeadlineSeconds": 3600,
                    "template": {
                        "metadata": {"labels": pod_labels},
                        "spec": {
                            "restartPolicy": "OnFailure",
                            "automountServiceAccountToken": False,
                            "securityContext": pod_security(RELAY_UID),
                            "containers": [container],
                            "volumes": [
                                secret_volume(
                                    "credentials", credentials_name(shard.fleet), {shard.name: shard.name}
                                ),
                                {
                                    "name": "backups",
                                    "persistentVolumeClaim": {"claimName": backup_name(shard.name)},
                                },
                                scratch_volume("tmp", "64Mi"),
                            ],
                        },
                    },
                },
            },
        },
    }
