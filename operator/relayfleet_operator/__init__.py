"""The relayfleet Kubernetes operator: RelayShard and RelayRebalance, reconciled by kopf.

Lives in the plain folder ``operator/`` (no ``__init__.py`` there) so that nothing named
``operator`` ever shadows the standard library module.
"""
