"""A DIDComm v1 client whose envelopes Askar packs and opens (aries-askar's Python binding, as
ACA-Py 1.7.0's venv ships it), speaking push-notifications-fcm/apns 1.0 to relayfleet's
mediator over HTTP with return route: tests/relay/didcomm/test_didcomm_push_agents.py runs it
with that venv's python. Its connection already exists (made by the test's agent from the same
Ed25519 seed); every push message here is authcrypted by Askar, every reply opened by Askar.

    python client.py --seed HEX --mediator B58 --url URL --fcm-token T --apns-token T

Prints one JSON line per step ({"step", "sent", "reply"}), then {"done": true}.
"""

from __future__ import annotations

import argparse
import base64
import json
import urllib.request
import uuid
from typing import Any

from acapy_agent.askar.didcomm.v1 import pack_message
from aries_askar import Key, KeyAlg, crypto_box

WIRE = "application/didcomm-envelope-enc"


def b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def b58d(text: str) -> bytes:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    n = 0
    for c in text:
        n = n * 58 + alphabet.index(c)
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return b"\0" * (len(text) - len(text.lstrip("1"))) + raw


def unpack(envelope: bytes, me: Key) -> dict[str, Any]:
    """Open an Authcrypt envelope for `me` with Askar's primitives."""
    env = json.loads(envelope)
    protected = json.loads(b64d(env["protected"]))
    mine = next(r for r in protected["recipients"] if b58d(r["header"]["kid"]) == me.get_public_bytes())
    me_x = me.convert_key(KeyAlg.X25519)
    sender_vk = crypto_box.crypto_box_seal_open(me_x, b64d(mine["header"]["sender"])).decode()
    sender_x = Key.from_public_bytes(KeyAlg.ED25519, b58d(sender_vk)).convert_key(KeyAlg.X25519)
    cek = crypto_box.crypto_box_open(me_x, sender_x, b64d(mine["encrypted_key"]), b64d(mine["header"]["iv"]))
    content = Key.from_secret_bytes(KeyAlg.C20P, bytes(cek))
    plain = content.aead_decrypt(
        b64d(env["ciphertext"]) + b64d(env["tag"]), nonce=b64d(env["iv"]), aad=env["protected"].encode()
    )
    doc: dict[str, Any] = json.loads(bytes(plain))
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--seed", "--mediator", "--url", "--fcm-token", "--apns-token"):
        ap.add_argument(flag, required=True)
    args = ap.parse_args()
    me = Key.from_secret_bytes(KeyAlg.ED25519, bytes.fromhex(args.seed))

    def send(name: str, **body: object) -> None:
        doc = {"@type": "https://didcomm.org/" + name, "@id": str(uuid.uuid4()), **body}
        doc["~transport"] = {"return_route": "all"}
        packed = pack_message([args.mediator], me, json.dumps(doc).encode())
        req = urllib.request.Request(args.url, data=packed, headers={"Content-Type": WIRE})
        with urllib.request.urlopen(req, timeout=30) as resp:
            reply = unpack(resp.read(), me)
        print(json.dumps({"step": name.rsplit("/", 1)[1], "sent": doc["@id"], "reply": reply}), flush=True)

    fcm, apns = "push-notifications-fcm/1.0/", "push-notifications-apns/1.0/"
    send(fcm + "get-device-info")
    send(fcm + "set-device-info", device_token=args.fcm_token, device_platform="android")
    send(fcm + "get-device-info")
    send(apns + "set-device-info", device_token=args.apns_token)
    send(apns + "get-device-info")
    send(fcm + "set-device-info", device_token=None, device_platform=None)
    send(fcm + "get-device-info")
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
