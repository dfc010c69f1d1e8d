"""The short demo `make run` shows: two recipients exchange messages, one long-polls."""

from __future__ import annotations

import asyncio
import time

from relay.client import RelayClient
from relay.protocol import keypair


async def run_demo(url: str) -> None:
    alice_pub, alice_priv = keypair()
    bob_pub, bob_priv = keypair()
    async with RelayClient(url, alice_priv) as alice, RelayClient(url, bob_priv) as bob:
        print("\n== demo: alice and bob exchange opaque ciphertext through the relay ==")
        seq, _ = await alice.enqueue(bob_pub, b"ciphertext: hello bob", idempotency_key="alice-1")
        print(f"alice -> bob: stored as seq {seq}")
        seq2, dup = await alice.enqueue(bob_pub, b"ciphertext: hello bob", idempotency_key="alice-1")
        print(f"alice retries with the same Idempotency-Key: seq {seq2}, duplicate={dup}")
        batch = await bob.read()
        for m in batch.messages:
            print(f"bob reads seq {m.seq}: {m.payload.decode()!r} (received {m.received_at})")
        print(f"bob acks up to {batch.next_seq - 1}: removed {await bob.ack(up_to_seq=batch.next_seq - 1)}")

        print("\nalice long-polls her queue (wait=10s) while bob replies 300 ms later ...")
        start = time.perf_counter()
        poll = asyncio.create_task(alice.read(wait=10))
        await asyncio.sleep(0.3)
        await bob.enqueue(alice_pub, b"ciphertext: hi alice")
        got = await poll
        waited = (time.perf_counter() - start) * 1000
        print(f"alice woke after {waited:.0f} ms with {[m.payload.decode() for m in got.messages]}")
        status = await alice.status()
        print(f"alice's queue status: {status}")
        await alice.ack(up_to_seq=got.next_seq - 1)
        print(f"after ack: {(await alice.status())['message_count']} message(s) held")
        print("== demo done ==\n")
