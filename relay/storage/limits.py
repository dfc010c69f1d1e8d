"""Per-queue limits and Redis reply deadlines: plain values, so configuration
(relay.settings) can build them without importing the store or a Redis client."""

from __future__ import annotations

from dataclasses import dataclass


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
