"""Signed attachments of DID Exchange: the JWS the mediator puts over its response's
``did_rotate~attach``, and the check of a requester's attached DID document against its JWS
(the signer must be a key of the document itself)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from relay import boundedjson
from relay.didcomm import keys as dk

__all__ = ["AttachmentError", "attached_document", "signed_attachment"]

# checked before decoding (docs/api.md, "Input limits")
MAX_DOCUMENT = 65536  # base64 characters of an attached DID document
MAX_JWS_HEADER = 4096  # base64 characters of a JWS protected header
MAX_SIGNATURES = 8  # each costs a signature check


class AttachmentError(ValueError):
    """An attachment that is malformed or not signed as required; the message is safe to return."""


def signed_attachment(kp: dk.KeyPair, data: bytes, mime: str) -> dict[str, Any]:
    """A signed attachment as DID Exchange 1.1 wants it: the data, and a JWS over it by the
    key `kp` (the mediator's invitation key; protected {alg: EdDSA, jwk}, header {kid: did:key})."""
    payload = dk.b64url(data)
    jwk = {"kty": "OKP", "crv": "Ed25519", "x": dk.b64url(kp.verkey)}
    protected = dk.b64url(json.dumps({"alg": "EdDSA", "jwk": jwk}, separators=(",", ":")).encode())
    signature = kp.sign(f"{protected}.{payload}".encode())
    return {
        "@id": str(uuid.uuid4()),
        "mime-type": mime,
        "data": {
            "base64": payload,
            "jws": {
                "header": {"kid": kp.did_key},
                "protected": protected,
                "signature": dk.b64url(signature),
            },
        },
    }


def attached_document(attach: Any) -> dict[str, Any] | None:
    """A DID document attached to a DID Exchange request, verified against its JWS: the signer
    must be a key of the document itself."""
    if attach is None:
        return None
    data = attach.get("data") if isinstance(attach, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("base64"), str):
        raise AttachmentError("did_doc~attach needs data.base64")
    try:
        raw = dk.b64decode_any(data["base64"], MAX_DOCUMENT)
        doc = boundedjson.loads(raw, MAX_DOCUMENT, "did_doc~attach")
        doc_keys = dk.keys_of_document(doc)
    except boundedjson.JsonLimitError as exc:
        raise AttachmentError(exc.text) from None
    except dk.DidError:
        raise AttachmentError("did_doc~attach is not a DID document") from None
    jws = data.get("jws")
    if isinstance(jws, dict):
        listed = jws.get("signatures")
        sigs: list[Any] = listed if isinstance(listed, list) else [jws]
        if len(sigs) > MAX_SIGNATURES:
            raise AttachmentError(f"did_doc~attach has more than {MAX_SIGNATURES} signatures")
        payload = dk.b64url(raw)
        for sig in sigs:
            if not _jws_valid(sig, payload, doc_keys):
                raise AttachmentError("did_doc~attach signature is invalid")
    return doc if isinstance(doc, dict) else None


def _jws_valid(sig: Any, payload: str, allowed: list[bytes]) -> bool:
    if not isinstance(sig, dict):
        return False
    given = sig.get("header")
    header: dict[str, Any] = given if isinstance(given, dict) else {}
    protected, signature = sig.get("protected"), sig.get("signature")
    if not isinstance(protected, str) or not isinstance(signature, str):
        return False
    try:
        prot = boundedjson.loads(dk.b64decode_any(protected, MAX_JWS_HEADER), MAX_JWS_HEADER)
        kid = header.get("kid") or prot.get("kid")
        if isinstance(prot.get("jwk"), dict) and isinstance(prot["jwk"].get("x"), str):
            key = dk.b64decode_any(prot["jwk"]["x"], 64)
        else:
            key = dk.verkey_from(kid)
        sig_bytes = dk.b64decode_any(signature, 128)
    except (dk.DidError, ValueError, AttributeError):  # JsonLimitError is a ValueError
        return False
    if key not in allowed or prot.get("alg") not in ("EdDSA", "Ed25519"):
        return False
    return dk.verify(key, f"{protected}.{payload}".encode(), sig_bytes)
