"""The package boundaries a client user and the tools rely on, checked in a fresh interpreter.

`relay.client` is what an app embeds: it must not drag in the server (aiohttp.web,
relay.api, relay.service), the fleet, storage or a Redis client.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay.protocol import (
    b64decode,
    b64encode,
    keypair,
    parse_authorization,
    sign_headers,
    signature_valid,
)

SERVER_SIDE = (
    "aiohttp.web",
    "relay.api",
    "relay.service",
    "relay.fleet",
    "relay.storage",
    "relay.settings",
    "redis",
)


def _modules_after_import(module: str) -> list[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )
    return list(json.loads(out.stdout))


@pytest.mark.parametrize("module", ["relay.client", "relay.protocol", "relay.retrying"])
def test_client_side_imports_nothing_server_side(module: str) -> None:
    loaded = _modules_after_import(module)
    assert module in loaded
    leaked = [m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER_SIDE)]
    assert leaked == []


def test_signed_header_round_trips_through_the_leaf() -> None:
    public, private = keypair()
    header = sign_headers(private, "GET", "/v1/queues/x/messages?limit=1", b"body")["Authorization"]
    creds = parse_authorization(header)
    assert creds.key == public
    assert signature_valid(creds, "GET", "/v1/queues/x/messages?limit=1", b"body")
    assert not signature_valid(creds, "GET", "/v1/queues/x/messages?limit=2", b"body")
    assert b64decode(b64encode(b"\xff\x00\xfe")) == b"\xff\x00\xfe"
    with pytest.raises(ValueError, match="scheme must be Relay-Ed25519"):
        parse_authorization("Bearer abc")


def test_settings_do_not_pull_in_the_store() -> None:
    """Configuration builds QueueLimits from a plain leaf, not from the Redis-backed store."""
    loaded = _modules_after_import("relay.settings")
    assert "relay.storage.limits" in loaded
    assert [m for m in loaded if m == "redis" or m.startswith(("redis.", "relay.storage.store"))] == []


def test_import_contracts_hold() -> None:
    """The import-linter contracts in pyproject.toml (also run by `make lint`)."""
    root = Path(__file__).resolve().parents[2]
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "operator"), str(root / "tools")]),
    }
    out = subprocess.run(
        [str(lint_imports)], cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in `path` names (nested ones too), `from
    package import name` counted as `package.name` since the name may be a module."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_test_modules_import_no_test_module_or_conftest() -> None:
    """Shared helpers live in tests/support/, tests/hostile/harness.py or e2e's non-test modules:
    a test module holds tests only, and a conftest is pytest's to load (importing it twice
    runs its hooks twice)."""
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in sorted([*root.glob("tests/**/*.py"), *root.glob("e2e/**/*.py")]):
        for module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] in ("tests", "e2e") and any(
                p.startswith("test_") or p == "conftest" for p in parts[1:]
            ):
                offenders.append(f"{path.relative_to(root)} imports {module}")
    assert offenders == []
