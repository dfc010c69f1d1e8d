"""A local fleet (Redis shard(s) + a relay) with a short demo: ``relayfleet dev``, ``make run``."""
