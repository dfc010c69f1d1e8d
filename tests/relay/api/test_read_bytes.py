"""Read and drain answers are shaped as bytes (relay/api/bulk.py), at once or streamed: both
must be exactly what orjson writes for the contract's JSON document (docs/api.md)."""

from __future__ import annotations

import base64

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.api import bulk
from relay.api.params import rfc3339_ms
from relay.storage.message import Message

messages = st.lists(
    st.builds(
        Message,
        st.integers(1, 2**63 - 1),
        st.binary(min_size=1, max_size=700),
        st.integers(0, 2**45),
        st.none() | st.text(max_size=20),
    ),
    max_size=5,
)


def document(ms: list[Message], next_seq: int, epoch: str, more: bool | None) -> bytes:
    """The answer as the contract describes it, written with orjson (not with bulk's parts)."""
    doc: dict[str, object] = {
        "messages": [
            {
                "seq": m.seq,
                "payload": base64.urlsafe_b64encode(m.payload).rstrip(b"=").decode(),
                "receivedAt": rfc3339_ms(m.received_ms),
                "messageId": m.message_id,
            }
            for m in ms
        ],
        "nextSeq": next_seq,
        "epoch": epoch,
    }
    if more is not None:
        doc["more"] = more
    return orjson.dumps(doc)


@settings(derandomize=True, database=None, max_examples=300)
@given(messages, st.integers(0, 2**63 - 1), st.text(max_size=20), st.none() | st.booleans())
def test_answers_are_orjsons_bytes_at_once_and_streamed(
    ms: list[Message], next_seq: int, epoch: str, more: bool | None
) -> None:
    want = document(ms, next_seq, epoch, more)
    assert bulk.answer_bytes(ms, next_seq, epoch, more) == want
    length, pieces = bulk.read_body(ms, next_seq, epoch, more)
    assert b"".join(pieces) == want
    assert length == len(want)


def test_a_streamed_payload_is_split_in_slices() -> None:
    big = Message(1, bytes(range(256)) * 1000, 1_700_000_000_000, "id")
    _, pieces = bulk.read_body([big], 2, "e", None)
    parts = list(pieces)
    assert len(parts) == -(-len(big.payload) // bulk.SLICE) + 1  # a piece per slice, then the end
    assert b"".join(parts) == document([big], 2, "e", None)
