"""Pytest plugin: `--soak` turns on the long-running variants (tests marked `soak`).

Without the flag those tests are skipped, so `make test` stays bounded in time.
`--soak-seconds` sets how long a soak runs its load (default 600).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("relayfleet soak")
    group.addoption(
        "--soak", action="store_true", default=False, help="run the long soak variants (marker: soak)"
    )
    group.addoption(
        "--soak-seconds", type=float, default=600.0, help="load duration of each soak test (default 600)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    """How long a soak test runs its load."""
    return float(request.config.getoption("--soak-seconds"))
