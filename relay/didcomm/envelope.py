"""DIDComm v1 envelopes (Aries RFC 0019 "encryption envelope"), as Askar-based agents pack them.

``{"protected", "iv", "ciphertext", "tag"}``; ``protected`` is base64url of JSON
``{"enc": "xchacha20poly1305_ietf", "typ": "JWM/1.0", "alg": "Authcrypt"|"Anoncrypt",
"recipients": [{"encrypted_key", "header": {"kid": <base58 verkey>, "sender"?, "iv"?}}]}``.
The content key (CEK, 32 bytes) is sealed per recipient: Anoncrypt with crypto_box_seal,
Authcrypt with crypto_box (24-byte ``iv``) from the sender's X25519 key, the sender's base58
verkey itself sealed in ``sender``. The payload is ChaCha20-Poly1305 with the ``protected``
text (as sent) as AAD. Despite the ``enc`` label, Askar (Credo, ACA-Py) uses the IETF
12-byte nonce; libindy used XChaCha's 24 bytes: we pack with 12 and open either.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nacl.bindings as sodium

from relay import boundedjson
from relay.didcomm.keys import DidError, KeyPair, b58decode, b58encode, b64decode_any, b64url
from relay.didcomm.keys import to_x25519_public as x25519

ENC = "xchacha20poly1305_ietf"
TYP = "JWM/1.0"
TAG_BYTES = 16
MAX_RECIPIENTS = 64
# base64 lengths checked before decoding (docs/api.md, "Input limits"): the protected header
# of MAX_RECIPIENTS recipients is ~16 KiB; a sealed key, sender or nonce is under 200 chars
MAX_PROTECTED = 65536
MAX_SEALED = 256


class EnvelopeError(ValueError):
    """An envelope the mediator cannot open (not for us, malformed, forged, over a bound)."""

    def __init__(self, text: str, code: str = "bad_envelope", status: int = 400) -> None:
        super().__init__(text)
        self.code = code
        self.status = status


@dataclass(frozen=True)
class Unpacked:
    message: bytes  # the plaintext JSON, as sent
    recipient: bytes  # our verkey it was packed for
    sender: bytes | None  # the sender's verkey (Authcrypt), None for Anoncrypt


def pack(message: bytes, recipients: list[bytes], sender: KeyPair | None, nonce_bytes: int = 12) -> bytes:
    """Pack `message` for the verkeys `recipients`; Authcrypt when `sender` is given."""
    cek = os.urandom(32)
    entries = []
    for verkey in recipients:
        their_x = x25519(verkey)
        if sender is None:
            entries.append(
                {
                    "encrypted_key": b64url(sodium.crypto_box_seal(cek, their_x)),
                    "header": {"kid": b58encode(verkey)},
                }
            )
            continue
        box_nonce = os.urandom(24)
        entries.append(
            {
                "encrypted_key": b64url(sodium.crypto_box(cek, box_nonce, their_x, sender.x_secret)),
                "header": {
                    "kid": b58encode(verkey),
                    "sender": b64url(sodium.crypto_box_seal(sender.b58.encode(), their_x)),
                    "iv": b64url(box_nonce),
                },
            }
        )
    header = {"enc": ENC, "typ": TYP, "alg": "Authcrypt" if sender else "Anoncrypt", "recipients": entries}
    protected = b64url(json.dumps(header, separators=(",", ":")).encode())
    nonce = os.urandom(nonce_bytes)
    sealed = _aead_encrypt(message, protected.encode(), nonce, cek)
    envelope = {
        "protected": protected,
        "iv": b64url(nonce),
        "ciphertext": b64url(sealed[:-TAG_BYTES]),
        "tag": b64url(sealed[-TAG_BYTES:]),
    }
    return json.dumps(envelope, separators=(",", ":")).encode()


def _aead_encrypt(message: bytes, aad: bytes, nonce: bytes, key: bytes) -> bytes:
    if len(nonce) == 12:
        return bytes(sodium.crypto_aead_chacha20poly1305_ietf_encrypt(message, aad, nonce, key))
    return bytes(sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(message, aad, nonce, key))


def _aead_decrypt(sealed: bytes, aad: bytes, nonce: bytes, key: bytes) -> bytes:
    if len(nonce) == 12:
        return bytes(sodium.crypto_aead_chacha20poly1305_ietf_decrypt(sealed, aad, nonce, key))
    if len(nonce) == 24:
        return bytes(sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(sealed, aad, nonce, key))
    raise EnvelopeError("iv must be 12 or 24 bytes")


def _field(doc: dict[str, Any], name: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str) or not value:
        raise EnvelopeError(f"envelope field {name} must be a non-empty string")
    return value


def _b64(text: str, what: str, limit: int | None = MAX_SEALED) -> bytes:
    if limit is not None and len(text) > limit:
        raise EnvelopeError(f"{what} exceeds {limit} characters")
    try:
        return b64decode_any(text)
    except DidError:
        raise EnvelopeError(f"{what} is not base64") from None


def _json(raw: bytes, max_bytes: int | None, what: str) -> Any:
    return boundedjson.loads_as(raw, max_bytes, what, EnvelopeError, "bad_envelope")


def shaped(doc: Any) -> dict[str, Any]:
    """`doc` if it has an envelope's shape (a JSON object with the four string fields)."""
    if not isinstance(doc, dict):
        raise EnvelopeError("the envelope must be a JSON object")
    for name in ("protected", "iv", "ciphertext", "tag"):
        _field(doc, name)
    return doc


def parse(raw: bytes) -> dict[str, Any]:
    """The envelope's JSON object, checked for shape (not yet decrypted); its size is the
    caller's bound (the request body's cap)."""
    return shaped(_json(raw, None, "the envelope"))


def unpack(doc: dict[str, Any], lookup: Callable[[bytes], KeyPair | None]) -> Unpacked:
    """Open an envelope packed for a key `lookup` holds (the mediator: Identity.keypair_for)."""
    protected = _field(doc, "protected")
    header = _json(_b64(protected, "protected", MAX_PROTECTED), MAX_PROTECTED, "protected")
    if not isinstance(header, dict):
        raise EnvelopeError("protected must be a JSON object")
    alg = header.get("alg")
    if alg not in ("Authcrypt", "Anoncrypt"):
        raise EnvelopeError("alg must be Authcrypt or Anoncrypt")
    if header.get("enc") not in (ENC, "chacha20poly1305_ietf"):
        raise EnvelopeError(f"enc must be {ENC}")
    recipients = header.get("recipients")
    if not isinstance(recipients, list) or not 0 < len(recipients) <= MAX_RECIPIENTS:
        raise EnvelopeError("recipients must be a non-empty list")
    for entry in recipients:
        h = entry.get("header") if isinstance(entry, dict) else None
        if not isinstance(h, dict):
            raise EnvelopeError("each recipient needs a header")
        kid = h.get("kid")
        if not isinstance(kid, str) or len(kid) > 50:
            raise EnvelopeError("each recipient needs header.kid, a base58 verkey")
        try:
            ours = lookup(b58decode(kid))
        except DidError:
            raise EnvelopeError("header.kid is not base58") from None
        if ours is not None:
            cek, sender = _open_key(entry, h, alg, ours)
            break
    else:
        raise EnvelopeError("the envelope is not packed for this mediator")
    nonce = _b64(_field(doc, "iv"), "iv")
    # the ciphertext is bounded by the body it came in
    sealed = _b64(_field(doc, "ciphertext"), "ciphertext", None) + _b64(_field(doc, "tag"), "tag")
    try:
        message = _aead_decrypt(sealed, protected.encode(), nonce, cek)
    except EnvelopeError:
        raise
    except Exception:
        raise EnvelopeError("the envelope does not decrypt") from None
    return Unpacked(message, ours.verkey, sender)


def _open_key(
    entry: dict[str, Any], h: dict[str, Any], alg: str, ours: KeyPair
) -> tuple[bytes, bytes | None]:
    """The content key and, for Authcrypt, the sender's verkey."""
    encrypted_key = _b64(_field(entry, "encrypted_key"), "encrypted_key")
    try:
        if alg == "Anoncrypt":
            cek = bytes(sodium.crypto_box_seal_open(encrypted_key, ours.x_public, ours.x_secret))
            sender = None
        else:
            sealed_sender = _b64(_field(h, "sender"), "sender")
            box_nonce = _b64(_field(h, "iv"), "iv")
            sender_b58 = bytes(sodium.crypto_box_seal_open(sealed_sender, ours.x_public, ours.x_secret))
            sender = b58decode(sender_b58.decode("ascii"))
            if len(sender) != 32:
                raise EnvelopeError("the sender is not a verkey")
            cek = bytes(sodium.crypto_box_open(encrypted_key, box_nonce, x25519(sender), ours.x_secret))
    except Exception:  # EnvelopeError, DidError, and whatever libsodium raises
        raise EnvelopeError("the envelope's key does not open") from None
    if len(cek) != 32:
        raise EnvelopeError("the content key must be 32 bytes")
    return cek, sender
