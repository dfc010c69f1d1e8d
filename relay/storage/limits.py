"""Per-queue limits and Redis reply deadlines: plain values, so configuration
(relay.settings) can build them without importing the store or a Redis client."""

from __future__ import annotations

from dataclasses import dataclass

# A recipient-wide limit left at this follows the per-queue one (twice it).
FOLLOW_QUEUE = -1


@dataclass(frozen=True, slots=True)
class QueueLimits:
    rate_count: int = 500
    rate_window_ms: int = 5000
    max_messages: int = 10000
    max_bytes: int = 256 * 1024 * 1024
    retention_ms: int = 7 * 24 * 3600 * 1000
    # a read, drain or live batch carries at most this many payload bytes (docs/api.md)
    max_response_bytes: int = 8 * 1024 * 1024
    # reply deadlines per connection class (pipeline.ScriptBatcher.reply_timeout adds
    # transfer time): writes and small replies; reads and drains
    write_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    # minReplicas shards: how long WAIT may wait for the replicas to confirm a batch of
    # writes before the writes are answered 503 replication_timeout (the batch's reply
    # deadline grows by as much)
    wait_timeout_ms: int = 1000
    # Per recipient across all its channels (docs/api.md, "Per-recipient quotas"; 0: no limit).
    # Left at FOLLOW_QUEUE they are twice the per-queue ones (as the relay's settings), so a
    # recipient using only its default channel meets its queue's limits first, and raising a
    # queue limit (a seeding tool, a benchmark) raises the recipient's with it.
    recipient_max_channels: int = 16  # non-default channels registered at once
    recipient_max_messages: int = -1
    recipient_max_bytes: int = -1
    recipient_rate_count: int = -1  # messages per rate_window_ms
    # Shard reserve: within this fraction of a shard's maxmemory, a message that takes its
    # queue past shard_reserve_queue_bytes is refused (507 storage_reserve; 0: no reserve).
    shard_reserve_fraction: float = 0.1
    shard_reserve_queue_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        for name, queue_value in (
            ("recipient_max_messages", self.max_messages),
            ("recipient_max_bytes", self.max_bytes),
            ("recipient_rate_count", self.rate_count),
        ):
            if getattr(self, name) == FOLLOW_QUEUE:
                object.__setattr__(self, name, 2 * queue_value)  # frozen: set once, here

    @property
    def recipient_limited(self) -> bool:
        """Whether any recipient-wide limit is on (a non-default enqueue is admitted first)."""
        return bool(
            self.recipient_max_channels
            or self.recipient_max_messages
            or self.recipient_max_bytes
            or self.recipient_rate_count
        )
