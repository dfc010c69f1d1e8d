"""relayfleet-testing: the tools around relayfleet that are not the product.

- ``relayfleet_testing.bench``: side-by-side benchmarks (``relayfleet bench``) and how each part's
  cost grows with its work (``relayfleet bench --scale``);
- ``relayfleet_testing.devfleet``: a local fleet with a short demo (``relayfleet dev``, ``make run``);
- ``relayfleet_testing.localredis``: local redis-server processes for the dev fleet, tests and benchmarks.
"""
