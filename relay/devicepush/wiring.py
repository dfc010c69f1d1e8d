"""Device push in the relay app: on when the DIDComm mediator is, with each provider that is
configured (RELAY_PUSH_WEBHOOK, and the credentials of RELAY_PUSH_CREDENTIALS_DIR)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from aiohttp import web

from relay.api.context import CTX, Context
from relay.api.didcomm import MEDIATOR
from relay.devicepush.credentials import load_apns, load_fcm
from relay.devicepush.notifier import DeviceNotifier
from relay.devicepush.providers import ApnsProvider, FcmProvider, Provider, WebhookProvider, http_client
from relay.didcomm.records import QUEUE_CHANNEL
from relay.push import hook

log = logging.getLogger("relay.devicepush")

DEVICE_NOTIFIER = web.AppKey("relayfleet_device_push", DeviceNotifier)


def providers(c: Context) -> list[Provider]:
    s = c.settings
    out: list[Provider] = []
    if s.push_webhook and urlsplit(s.push_webhook).scheme in ("http", "https"):
        out.append(WebhookProvider(s.push_webhook, http_client(s.push_ca_file)))
    if s.push_credentials_dir:
        fcm = load_fcm(s.push_credentials_dir)
        if fcm is not None:
            out.append(FcmProvider(fcm, s.push_fcm_url, http_client(s.push_ca_file)))
        apns = load_apns(s.push_credentials_dir)
        if apns is not None:
            out.append(ApnsProvider(apns, s.push_apns_url, http_client(s.push_ca_file, http2=True)))
    return out


def setup(app: web.Application) -> None:
    mediator = app.get(MEDIATOR)
    if mediator is None:
        return
    c: Context = app[CTX]
    chosen = providers(c)
    if not chosen:
        return
    notifier = DeviceNotifier(
        mediator.records,
        chosen,
        online=c.presence.online,  # a live socket or waiting poll on any relay (relay/presence.py)
        coalesce_s=c.settings.push_coalesce_s,
        min_interval_s=c.settings.push_min_interval_s,
    )

    def offer(recipient: bytes, channel: bytes, seq: int, subscribers: int) -> None:
        if channel == QUEUE_CHANNEL and subscribers == 0:
            notifier.offer(recipient)

    hook(app, offer, notifier)
    app[DEVICE_NOTIFIER] = notifier
    log.info("device push for mediated keys through %s", ", ".join(p.name for p in chosen))
