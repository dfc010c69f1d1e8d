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


@settings(derandomize=True, database=None, max_examples=200)
@given(messages, st.integers(0, 2**63 - 1), st.text(max_size=20))
def test_an_answer_from_its_prepared_message_is_the_same(
    ms: list[Message], next_seq: int, epoch: str
) -> None:
    """A woken long-poll's answer made from the text prepared while Redis stored its message
    (bulk.Prepared) is orjson's; one prepared for another message, time, messageId or epoch
    is not used."""
    want = document(ms, next_seq, epoch, None)
    for m in ms:
        ready = bulk.prepare(epoch, m.received_ms, m.payload, m.message_id or "")
        if m.message_id == "":  # (a message without one has None: "" is never stored)
            continue
        assert ready.matches(m, epoch)
        assert bulk.answer_bytes([m], next_seq, epoch, ready=ready) == document([m], next_seq, epoch, None)
        # the woken long-poll's: the answer but for its seq and nextSeq, filled in once stored
        parts = bulk.lone_answer_parts(ready)
        assert bulk.lone_answer(m.seq, parts) == document([m], m.seq + 1, epoch, None)
        assert bulk.answer_bytes(ms, next_seq, epoch, ready=ready) == want
    if ms:
        m = ms[0]
        other = [
            bulk.prepare(epoch, m.received_ms, m.payload + b"x", m.message_id or ""),
            bulk.prepare(epoch, m.received_ms + 1, m.payload, m.message_id or ""),
            bulk.prepare(epoch, m.received_ms, m.payload, "another id"),
            bulk.prepare(epoch + "x", m.received_ms, m.payload, m.message_id or ""),
        ]
        for ready in other:
            assert not ready.matches(m, epoch)
            assert bulk.answer_bytes([m], next_seq, epoch, ready=ready) == document(
                [m], next_seq, epoch, None
            )


def test_a_streamed_payload_is_split_in_slices() -> None:
    big = Message(1, bytes(range(256)) * 1000, 1_700_000_000_000, "id")
    _, pieces = bulk.read_body([big], 2, "e", None)
    parts = list(pieces)
    assert len(parts) == -(-len(big.payload) // bulk.SLICE) + 1  # a piece per slice, then the end
    assert b"".join(parts) == document([big], 2, "e", None)
