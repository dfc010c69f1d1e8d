"""What stock DIDComm v2 clients saw as a tests.support.history record, so the history checker
judges a stock client's run (tests/relay/didcomm_v2/, e2e/): see ``ClientHistory`` for what each
record stands for. The clients themselves: tests/support/didcomm_stock_agents.py."""

from __future__ import annotations

from tests.support.history import History, Verdict


class ClientHistory:
    """A tests.support.history record of one recipient's run, from what the clients saw.

    The relay's sequence numbers are not visible to a DIDComm client, so each message's `seq` is
    the order in which its send was answered; the sends are paced (each starts once the one
    before was answered), which makes that order the queue's FIFO order. Records:

    * enqueue: the sender's send, from its start to its answer (the HTTP POST of the forward);
    * deliver (mode read): one delivery as the recipient handed it over; `t0` is the request's
      start where the client shows it (Veramo's poll) and otherwise the previous delivery's time
      (earlier than the true start: the "skipped" check can only be less strict, never wrong);
    * ack: the messages-received of that delivery, answered before the client handed the batch
      over (both clients send it and await its answer first), so it ends at the delivery's end.

    A message delivered twice is a `duplicate` (exactly-once), and once more after its ack an
    `after_removal`; one never delivered is `lost`; a delivery out of send order is `fifo` or
    `skipped`.
    """

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.history = History()
        self.seq_of: dict[str, int] = {}
        self.last_delivery_s = 0.0

    def sent(self, content: str, t0_ms: float, t1_ms: float, ok: bool = True) -> None:
        seq = len(self.seq_of) + 1
        self.seq_of[content] = seq
        self.history.enqueue(
            self.queue, content, t0_ms / 1000, t1_ms / 1000, 201 if ok else 0, seq=seq if ok else None
        )
        self.last_delivery_s = self.last_delivery_s or t0_ms / 1000

    def delivered(self, contents: list[str], t1_ms: float, t0_ms: float | None = None) -> None:
        t1 = t1_ms / 1000
        t0 = t0_ms / 1000 if t0_ms is not None else self.last_delivery_s
        items = [(self.seq_of.get(c, 0), c) for c in contents]
        self.history.deliver(self.queue, "read", min(t0, t1), t1, 200, items)
        if items:
            self.history.ack(self.queue, t1 - 1e-6, t1 - 1e-6, 200, seqs=[s for s, _ in items])
        self.last_delivery_s = t1

    def check(self) -> Verdict:
        return self.history.check(exactly_once=True)


def verdict_summary(verdict: Verdict) -> str:
    if verdict.ok:
        return "valid"
    return ", ".join(f"{n} {k}" for k, n in sorted(verdict.by_kind().items()))
