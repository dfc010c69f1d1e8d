"""Push notifications to the devices DIDComm connections set (RFC 0734 fcm, RFC 0699 apns;
the protocol is relay/didcomm/mediator_push.py): the burst logic (notifier.py), the
providers (providers.py: the operator's webhook, FCM HTTP v1, APNs over HTTP/2), their
credentials from a mounted Secret (credentials.py) and the app wiring (wiring.py)."""
