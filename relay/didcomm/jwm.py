"""DIDComm v2 envelopes: JWE (anoncrypt ECDH-ES+A256KW, authcrypt ECDH-1PU+A256KW) and JWS
(EdDSA) in the general JSON serialization, on joserfc (docs/design-decisions.md, "DIDComm v2").

Unpacking peels up to three layers (anoncrypt around authcrypt, a JWS inside either) down to the
plaintext message and says what was proven: the authcrypt sender's key (``skid``, resolved from
its DID, which must be the message's ``from``) or the signer's. Everything is bounded before
joserfc sees it: the body by its caller, the protected header, the recipients and the
signatures here. DIDComm puts the ephemeral key (``epk``) in the protected header, shared by all
recipients; joserfc writes one per recipient, so `pack` gives it one to share and moves it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nacl.bindings as sodium
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash
from joserfc import jwe, jws
from joserfc.errors import JoseError, SecurityWarning
from joserfc.jwa import AESAlgKeyWrapping, JWEEncModel, JWEKeyAgreement
from joserfc.jwe import Recipient
from joserfc.jwk import ECKey, OKPKey

from relay import boundedjson
from relay.didcomm import peer2
from relay.didcomm.keys import DidError, b64decode_any, b64url

__all__ = [
    "ENCRYPTED",
    "PLAIN",
    "SIGNED",
    "AgreementKey",
    "JwmError",
    "Opened",
    "media_type_of",
    "pack",
    "unpack",
]

ENCRYPTED = "application/didcomm-encrypted+json"
SIGNED = "application/didcomm-signed+json"
PLAIN = "application/didcomm-plain+json"
ANON_ALGS = ("ECDH-ES+A256KW",)
AUTH_ALGS = ("ECDH-1PU+A256KW",)
ENCS = ("A256CBC-HS512", "A256GCM", "XC20P")
MAX_PROTECTED = 16384  # base64 characters: an epk, a did:peer:2 skid and its apu
MAX_RECIPIENTS = 32
MAX_SIGNATURES = 4
MAX_LAYERS = 3  # anoncrypt(authcrypt(signed(plaintext))) at most


class _XC20P(JWEEncModel):
    """XChaCha20-Poly1305 content encryption (draft-amringer-jose-chacha), which DIDComm
    anoncrypt uses, on libsodium (PyNaCl, already the v1 envelope's) instead of joserfc's draft
    module's pycryptodome."""

    name = "XC20P"
    description = "XChaCha20-Poly1305"
    iv_size = 192
    cek_size = 256

    def encrypt(self, plaintext: bytes, cek: bytes, iv: bytes, aad: bytes) -> tuple[bytes, bytes]:
        sealed = bytes(sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, aad, iv, cek))
        return sealed[:-16], sealed[-16:]

    def decrypt(self, ciphertext: bytes, tag: bytes, cek: bytes, iv: bytes, aad: bytes) -> bytes:
        try:
            return bytes(sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(ciphertext + tag, aad, iv, cek))
        except Exception:  # libsodium's CryptoError (a bad tag, a wrong nonce length)
            raise ValueError("XC20P: the content does not decrypt") from None


def _len_prefixed(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class _OnePU(JWEKeyAgreement):
    """ECDH-1PU+A256KW (draft-madden-jose-ecdh-1pu): Z = Ze || Zs, the KEK from the Concat KDF.
    Two variants are in use: draft-04 puts the content's tag in the KDF (didcomm-rust, so
    Identus; joserfc's own model) and takes only AES-CBC-HMAC content; Veramo (did-jwt) derives
    the KEK without the tag (draft-03) and uses A256GCM by default. One model serves both, so
    each registry below holds one variant and any content encryption."""

    key_types = ["EC", "OKP"]

    def __init__(self, tagged: bool) -> None:
        self.name = "ECDH-1PU+A256KW"
        self.description = "ECDH-1PU, CEK wrapped with A256KW" + ("" if tagged else " (no tag in the KDF)")
        self.key_size = 256
        self.key_wrapping = AESAlgKeyWrapping(256, True)
        self.tag_aware = tagged

    def encrypt_agreed_upon_key(self, enc: JWEEncModel, recipient: Recipient[ECKey]) -> bytes:
        return self._agree(recipient, None, True)

    def encrypt_agreed_upon_key_with_tag(
        self, enc: JWEEncModel, recipient: Recipient[ECKey], tag: bytes
    ) -> bytes:
        return self._agree(recipient, tag, True)

    def decrypt_agreed_upon_key(self, enc: JWEEncModel, recipient: Recipient[ECKey]) -> bytes:
        return self._agree(recipient, None, False)

    def decrypt_agreed_upon_key_with_tag(
        self, enc: JWEEncModel, recipient: Recipient[ECKey], tag: bytes
    ) -> bytes:
        return self._agree(recipient, tag, False)

    def _agree(self, recipient: Recipient[ECKey], tag: bytes | None, sending: bool) -> bytes:
        headers = recipient.headers()
        ours, theirs = recipient.recipient_key, recipient.sender_key
        if ours is None or theirs is None or "epk" not in headers:
            raise ValueError("ECDH-1PU needs the recipient's, the sender's and the ephemeral key")
        if sending:
            ephemeral = recipient.ephemeral_key
            assert ephemeral is not None
            z = ephemeral.exchange_derive_key(ours) + theirs.exchange_derive_key(ours)
        else:
            epk = ours.import_key(headers["epk"])
            z = ours.exchange_derive_key(epk) + ours.exchange_derive_key(theirs)
        info = _len_prefixed(self.name.encode())
        for party in ("apu", "apv"):
            value = headers.get(party)
            info += _len_prefixed(b64decode_any(value, MAX_PROTECTED) if isinstance(value, str) else b"")
        info += struct.pack(">I", 256)
        if tag is not None:
            info += _len_prefixed(tag)
        return ConcatKDFHash(algorithm=hashes.SHA256(), length=32, otherinfo=info).derive(z)


class _Registry(jwe.JWERegistry):
    # its own table of algorithms (the base class's is one dict shared by every registry)
    algorithms = {
        "alg": dict(jwe.JWERegistry.algorithms["alg"]),
        "enc": dict(jwe.JWERegistry.algorithms["enc"]),
        "zip": dict(jwe.JWERegistry.algorithms["zip"]),
    }
    # a forward carries a whole packed message: the body's own cap bounds the ciphertext
    max_ciphertext_length = 1 << 30
    max_aad_length = MAX_PROTECTED
    max_protected_header_length = MAX_PROTECTED
    max_recipients = MAX_RECIPIENTS


class _RegistryNoTag(_Registry):
    algorithms = {
        "alg": dict(_Registry.algorithms["alg"]),
        "enc": dict(_Registry.algorithms["enc"]),
        "zip": dict(_Registry.algorithms["zip"]),
    }


_Registry.register(_XC20P())
_RegistryNoTag.register(_XC20P())
_Registry.register(_OnePU(tagged=True))
_RegistryNoTag.register(_OnePU(tagged=False))


class _SigRegistry(jws.JWSRegistry):
    max_payload_length = 1 << 30
    max_header_length = MAX_PROTECTED


_ALGORITHMS = [*ANON_ALGS, *AUTH_ALGS, *ENCS]
_JWE = _Registry(algorithms=_ALGORITHMS, verify_all_recipients=False)
_JWE_NO_TAG = _RegistryNoTag(algorithms=_ALGORITHMS, verify_all_recipients=False)
for _registry in (_JWE, _JWE_NO_TAG):
    _registry.strict_check_header = False  # agents add their own header members (typ, cty)
_JWS = _SigRegistry(algorithms=["EdDSA", "Ed25519"])


class JwmError(ValueError):
    """A v2 message the mediator cannot open; the text is safe to return (never a key or DID)."""

    def __init__(self, text: str, code: str = "bad_envelope", status: int = 400) -> None:
        super().__init__(text)
        self.text = text
        self.code = code
        self.status = status


@dataclass(frozen=True)
class AgreementKey:
    """One of the mediator's X25519 key-agreement keys, with its private half."""

    kid: str
    secret: bytes
    public: bytes

    def jwk(self, kid: str | None = None) -> OKPKey:
        return _okp(self.public, self.secret, kid or self.kid)

    @classmethod
    def from_secret(cls, kid: str, secret: bytes) -> AgreementKey:
        return cls(kid, secret, bytes(sodium.crypto_scalarmult_base(secret)))


@functools.lru_cache(maxsize=64)
def _okp(public: bytes, secret: bytes, kid: str) -> OKPKey:
    """The mediator's own key as joserfc's object (importing one costs ~0.5 ms; it has one)."""
    doc: dict[str, str | list[str]] = {
        "kty": "OKP",
        "crv": "X25519",
        "x": b64url(public),
        "d": b64url(secret),
        "kid": kid,
    }
    return OKPKey.import_key(doc)


@dataclass(frozen=True)
class Opened:
    message: dict[str, Any]  # the plaintext message
    raw: bytes  # its bytes, as sent
    encrypted: bool
    recipient_kid: str | None  # the kid it was encrypted to (the peer's name for our key)
    sender_kid: str | None  # authcrypt: the sender's key-agreement kid (proven)
    signer_kid: str | None  # a JWS's signing kid (proven)
    enc: str = "A256CBC-HS512"  # the authcrypt layer's content encryption: a reply uses it
    tagged: bool = True  # ... and its ECDH-1PU variant (see _OnePU)

    @property
    def sender_did(self) -> str | None:
        """The DID whose keys this message proves, when one is proven."""
        kid = self.sender_kid or self.signer_kid
        return peer2.did_of(kid) if kid else None


def media_type_of(doc: dict[str, Any]) -> str:
    if "ciphertext" in doc:
        return ENCRYPTED
    if "signatures" in doc or ("payload" in doc and "signature" in doc):
        return SIGNED
    return PLAIN


def _json(raw: bytes, max_bytes: int | None, what: str) -> Any:
    return boundedjson.loads_as(raw, max_bytes, what, JwmError, "bad_envelope")


def unpack(raw: bytes, lookup: Callable[[str], AgreementKey | None]) -> Opened:
    """Open a v2 message (its size bounded by the caller): `lookup` finds the mediator's key a
    recipient kid names."""
    doc = _json(raw, None, "the message")
    if not isinstance(doc, dict):
        raise JwmError("a DIDComm v2 message must be a JSON object")
    recipient_kid = sender_kid = signer_kid = None
    encrypted, enc, tagged = False, "A256CBC-HS512", True
    for _ in range(MAX_LAYERS):
        kind = media_type_of(doc)
        if kind == PLAIN:
            break
        if kind == ENCRYPTED:
            layer = _decrypt(doc, lookup)
            raw = layer.plaintext
            encrypted = True
            recipient_kid = recipient_kid or layer.kid
            if sender_kid is None and layer.skid is not None:
                sender_kid, enc, tagged = layer.skid, layer.enc, layer.tagged
        else:
            raw, signer_kid = _verify(doc)
        doc = _json(raw, None, "the message")
        if not isinstance(doc, dict):
            raise JwmError("a DIDComm v2 message must be a JSON object")
    else:
        raise JwmError(f"the message nests more than {MAX_LAYERS} envelopes")
    if not isinstance(doc.get("type"), str) or not isinstance(doc.get("id"), str):
        raise JwmError("a DIDComm v2 message needs type and id, strings", "bad_didcomm_message")
    opened = Opened(doc, raw, encrypted, recipient_kid, sender_kid, signer_kid, enc, tagged)
    sender = doc.get("from")
    proven = opened.sender_did
    if proven is not None and sender is not None and sender != proven:
        raise JwmError("the message's from is not the DID whose key sent it", "sender_mismatch")
    return opened


def _header(doc: dict[str, Any]) -> dict[str, Any]:
    protected = doc.get("protected")
    if not isinstance(protected, str):
        raise JwmError("protected must be a string")
    try:
        header = _json(b64decode_any(protected, MAX_PROTECTED), MAX_PROTECTED, "protected")
    except DidError as exc:
        raise JwmError(f"protected: {exc}") from None
    if not isinstance(header, dict):
        raise JwmError("protected must be a JSON object")
    return header


@dataclass(frozen=True)
class _Layer:
    plaintext: bytes
    kid: str
    skid: str | None
    enc: str
    tagged: bool  # authcrypt's KDF took the content's tag (draft-04), else draft-03's


def _decrypt(doc: dict[str, Any], lookup: Callable[[str], AgreementKey | None]) -> _Layer:
    header = _header(doc)
    alg, enc = header.get("alg"), header.get("enc")
    if alg not in ANON_ALGS + AUTH_ALGS:
        raise JwmError(f"alg must be one of {', '.join(ANON_ALGS + AUTH_ALGS)}", "bad_envelope")
    if enc not in ENCS:
        raise JwmError(f"enc must be one of {', '.join(ENCS)}", "bad_envelope")
    recipients = doc.get("recipients")
    if not isinstance(recipients, list) or not 0 < len(recipients) <= MAX_RECIPIENTS:
        raise JwmError(f"recipients must be a list of 1 to {MAX_RECIPIENTS}")
    for entry in recipients:
        h = entry.get("header") if isinstance(entry, dict) else None
        kid = h.get("kid") if isinstance(h, dict) else None
        if not isinstance(kid, str) or len(kid) > peer2.MAX_DID:
            raise JwmError("each recipient needs header.kid")
        ours = lookup(kid)
        if ours is not None:
            break
    else:
        raise JwmError("the message is not encrypted for this mediator", "bad_envelope")
    sender_key: OKPKey | ECKey | None = None
    skid = None
    if alg in AUTH_ALGS:
        skid = header.get("skid")
        if not isinstance(skid, str) and isinstance(header.get("apu"), str):
            try:
                skid = b64decode_any(header["apu"], peer2.MAX_DID * 2).decode("utf-8", "replace")
            except DidError:
                raise JwmError("apu is not base64url") from None
        if not isinstance(skid, str):
            raise JwmError("authcrypt needs skid, the sender's key id")
        sender_key = _agreement_jwk(skid)
    single = {**doc, "recipients": [entry]}
    # didcomm-rust (Identus) always sends apu/apv and the draft-04 KDF; did-jwt (Veramo) sends
    # neither and derives without the tag: try the likelier first, then the other
    variants = [True, False] if "apu" in header or alg not in AUTH_ALGS else [False, True]
    for tagged in variants[: 1 if alg not in AUTH_ALGS else 2]:
        registry = _JWE if tagged else _JWE_NO_TAG
        try:
            opened = jwe.decrypt_json(single, ours.jwk(kid), registry=registry, sender_key=sender_key)  # type: ignore[arg-type]
        except (JoseError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if opened.plaintext is not None:
            return _Layer(opened.plaintext, kid, skid, enc, tagged)
    raise JwmError("the message does not decrypt", "bad_envelope")


def _agreement_jwk(kid: str) -> OKPKey | ECKey:
    try:
        key = peer2.resolve(kid).key(kid)
    except DidError as exc:
        raise JwmError(f"skid: {exc}", "bad_envelope") from None
    if key is None or key.crv == "Ed25519":
        raise JwmError("skid names no key-agreement key of its DID", "bad_envelope")
    return _public_jwk(key)


@functools.lru_cache(maxsize=1024)
def _public_jwk(key: peer2.VerificationKey) -> OKPKey | ECKey:
    """Cached as the DIDs they come from (peer2.resolve)."""
    try:
        jwk = key.jwk()
    except DidError as exc:
        raise JwmError(f"key: {exc}", "bad_envelope") from None
    return ECKey.import_key(jwk) if jwk["kty"] == "EC" else OKPKey.import_key(jwk)


def _verify(doc: dict[str, Any]) -> tuple[bytes, str]:
    signatures = doc.get("signatures")
    if not isinstance(signatures, list) or not 0 < len(signatures) <= MAX_SIGNATURES:
        raise JwmError(f"signatures must be a list of 1 to {MAX_SIGNATURES}")
    first = signatures[0]
    if not isinstance(doc.get("payload"), str) or not isinstance(first, dict):
        raise JwmError("a JWS needs payload, a string, and signatures, objects")
    if not isinstance(first.get("protected"), str) or not isinstance(first.get("signature"), str):
        raise JwmError("a signature needs protected and signature, strings")
    h = first.get("header")
    kid = h.get("kid") if isinstance(h, dict) else None
    if not isinstance(kid, str):
        kid = _header(first).get("kid")
    if not isinstance(kid, str):
        raise JwmError("a signature needs header.kid")
    try:
        key = peer2.resolve(kid).key(kid)
    except DidError as exc:
        raise JwmError(f"kid: {exc}", "bad_envelope") from None
    if key is None or key.crv != "Ed25519":
        raise JwmError("kid names no Ed25519 key of its DID", "bad_envelope")
    try:
        general: jws.GeneralJSONSerialization = {"payload": doc["payload"], "signatures": [first]}  # type: ignore[list-item]
        with warnings.catch_warnings():
            # DIDComm signs with "EdDSA", which RFC 9864 deprecates for "Ed25519": joserfc warns
            # on every use; both name the same Ed25519 signature here
            warnings.simplefilter("ignore", SecurityWarning)
            verified = jws.deserialize_json(general, OKPKey.import_key(key.jwk()), registry=_JWS)
    except (JoseError, ValueError, KeyError, TypeError, AttributeError):
        raise JwmError("the signature does not verify", "bad_envelope") from None
    return verified.payload, kid


def pack(
    message: dict[str, Any],
    to: peer2.VerificationKey,
    sender: AgreementKey | None,
    sender_kid: str | None = None,
    enc: str = "A256CBC-HS512",
    tagged: bool = True,
) -> bytes:
    """Encrypt `message` for one recipient key: authcrypt (ECDH-1PU+A256KW, `enc`, the KDF
    variant `tagged`) from `sender` (named `sender_kid`, the name the peer knows our key by),
    else anoncrypt (ECDH-ES+A256KW)."""
    plaintext = json.dumps(message, separators=(",", ":")).encode()
    recipient = _public_jwk(to)
    ephemeral = recipient.generate_key(to.crv, private=True)  # type: ignore[arg-type]
    protected: dict[str, Any] = {
        "typ": ENCRYPTED,
        "alg": AUTH_ALGS[0] if sender else ANON_ALGS[0],
        "enc": enc,
        "epk": ephemeral.as_dict(private=False),
    }
    if tagged:  # did-jwt (Veramo, the untagged variant) sends and expects neither
        protected["apv"] = b64url(hashlib.sha256(to.kid.encode()).digest())
    if sender is not None:
        skid = sender_kid or sender.kid
        protected["skid"] = skid
        if tagged:
            protected["apu"] = b64url(skid.encode())
    obj = jwe.GeneralJSONEncryption(protected, plaintext)
    obj.add_recipient({"kid": to.kid}, recipient)
    obj.recipients[0].ephemeral_key = ephemeral
    out = jwe.encrypt_json(
        obj,
        None,
        registry=_JWE if tagged else _JWE_NO_TAG,
        sender_key=sender.jwk(skid) if sender is not None else None,
    )
    for entry in out["recipients"]:
        entry.get("header", {}).pop("epk", None)  # in the protected header, shared
    return json.dumps(out, separators=(",", ":")).encode()
