"""relayfleet as a DIDComm v1 mediator (docs/protocols.md).

keys (base58, did:key, did:peer, the fleet's identity) ← envelope (pack/unpack) ←
records (connections and keylists in Redis) ← mediator (the protocols) ← relay.api.didcomm.
"""
