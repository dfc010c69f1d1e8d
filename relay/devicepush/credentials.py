"""The providers' credentials, from RELAY_PUSH_CREDENTIALS_DIR (the RelayShard's
spec.relay.pushCredentialsSecretRef mounted as files; docs/protocols.md, "Device push"):

- ``fcm-service-account.json``: a Google service-account key file (FCM HTTP v1);
- ``apns-auth-key.p8``, ``apns-key-id``, ``apns-team-id``, ``apns-topic``: an APNs token-auth
  signing key, its key id, the team id and the app's bundle id.

A provider whose files are absent is off; one whose files are present but unusable is off
with an error naming the file (never its content).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from relay.devicepush.providers import ApnsCredentials, FcmCredentials
from relay.settings import PUSH_APNS_FILES as APNS_FILES
from relay.settings import PUSH_FCM_FILE as FCM_FILE

log = logging.getLogger("relay.devicepush")

MAX_FILE = 65536


def _read(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(MAX_FILE + 1)[:MAX_FILE]


def load_fcm(directory: str) -> FcmCredentials | None:
    path = Path(directory) / FCM_FILE
    if not path.exists():
        return None
    try:
        return FcmCredentials.parse(_read(path))
    except Exception as exc:  # a bad file must not stop the relay: FCM stays off
        log.error("%s is not a usable service-account key (%s); FCM push is off", path, type(exc).__name__)
        return None


def load_apns(directory: str) -> ApnsCredentials | None:
    paths = [Path(directory) / name for name in APNS_FILES]
    present = [p.exists() for p in paths]
    if not any(present):
        return None
    if not all(present):
        missing = ", ".join(p.name for p, ok in zip(paths, present, strict=True) if not ok)
        log.error("APNs push is off: %s missing in %s", missing, directory)
        return None
    try:
        key, key_id, team_id, topic = (_read(p).decode().strip() for p in paths)
        if not (key_id and team_id and topic):
            raise ValueError("an empty value")
        creds = ApnsCredentials(key, key_id, team_id, topic)
        creds.provider_token(int(time.time()))  # the key signs, or it is refused now
    except Exception as exc:
        log.error(
            "the APNs credentials in %s are not usable (%s); APNs push is off", directory, type(exc).__name__
        )
        return None
    return creds
