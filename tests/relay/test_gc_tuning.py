"""The relay process's garbage-collector settings (relay/gc_tuning.py).

Run in a child interpreter: freezing and re-thresholding the test process itself would
change when every other test's garbage is found."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relay.settings import Settings

_CHILD = """
import gc, json
from relay import gc_tuning
before = gc.get_threshold()
gc_tuning.tune(12345)
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def test_tune_freezes_start_up_objects_and_sets_only_the_young_threshold() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    got = json.loads(out.stdout)
    assert got["after"] == [12345, got["before"][1], got["before"][2]]
    assert got["frozen"] > 1000  # at least the imported modules' objects


def test_the_young_threshold_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_env().gc_young_threshold == 10_000
    monkeypatch.setenv("RELAY_GC_YOUNG_THRESHOLD", "700")
    assert Settings.from_env().gc_young_threshold == 700
    monkeypatch.setenv("RELAY_GC_YOUNG_THRESHOLD", "0")  # a pass per allocation would be absurd
    assert Settings.from_env().gc_young_threshold == 1
