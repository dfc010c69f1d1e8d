"""Docs that list things are checked against the code that defines them, both ways, so they
cannot drift: the error codes (docs/api.md), the alerts (docs/observability.md against
files/alerts.yaml), the `relayfleet` subcommands (docs/api.md's command line), the Redis URL
schemes (docs/api.md) and no reference a reader of the repository cannot open."""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from relay import cli
from relay.fleet.sharding import NODE_SCHEMES, SENTINEL_SCHEME
from relay.storage.connection import RedisTarget, RedisURLError
from tests.support.chart import CHART, ROOT

API = (ROOT / "docs" / "api.md").read_text()
SNAKE = re.compile(r"^[a-z]+(?:_[a-z0-9]+)*$")
# calls whose code argument is a literal: (position, default); a request parameter's declaration
# (relay/api/params.py) names the 400 its parser refuses a value with
CODE_ARGS = {
    "bad_request": (1, "bad_request"),
    "PickupError": (1, "bad_pickup_message"),
    "Param": (4, "bad_request"),
}
# errors built as (text, code, status): their code (or default) and status (or 400)
TEXT_CODE_STATUS = {
    "MediatorError": "bad_didcomm_message",
    "EnvelopeError": "bad_envelope",
    "JwmError": "bad_envelope",
    "JsonLimitError": "",
}


def _literal(node: ast.expr) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def codes_in_code() -> dict[str, set[int]]:
    """Every error code a relay answers with: `(status, "code", ...)` calls, the bad_request and
    Pickup refusals, the parser's (status 400) table and fallbacks."""
    out: dict[str, set[int]] = {}
    for path in (ROOT / "relay").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                args = [_literal(a) for a in node.args]
                if len(args) >= 2 and isinstance(args[0], int) and 400 <= args[0] < 600:
                    if isinstance(args[1], str) and SNAKE.match(args[1]):
                        out.setdefault(args[1], set()).add(args[0])
                elif fn in TEXT_CODE_STATUS:
                    code = args[1] if len(args) > 1 else TEXT_CODE_STATUS[fn]
                    status = args[2] if len(args) > 2 else 400
                    if isinstance(code, str) and SNAKE.match(code) and isinstance(status, int):
                        out.setdefault(code, set()).add(status)
                elif fn in CODE_ARGS:
                    pos, default = CODE_ARGS[fn]
                    code = args[pos] if len(args) > pos else default
                    if isinstance(code, str):
                        out.setdefault(code, set()).add(400)
            if path.name == "parse_errors.py" and isinstance(node, ast.Tuple) and len(node.elts) in (2, 3):
                value = _literal(node.elts[1] if len(node.elts) == 3 else node.elts[0])
                if isinstance(value, str) and SNAKE.match(value) and value != "host":
                    out.setdefault(value, set()).add(400)
    return out


def codes_on_the_page() -> dict[str, set[int]]:
    section = API.split("| code | status | when |", 1)[1].split("\n\n", 1)[0]
    out: dict[str, set[int]] = {}
    for row in section.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for code in re.findall(r"`([a-z_0-9]+)`", cells[0]):
            out.setdefault(code, set()).add(int(cells[1]))
    return out


def test_every_error_code_is_on_the_page_with_its_status() -> None:
    code, page = codes_in_code(), codes_on_the_page()
    assert {"storage_full", "queue_full", "rate_limited", "headers_too_large"} <= set(code)
    assert sorted(set(code) - set(page)) == [], "codes the relay answers with that docs/api.md lacks"
    assert sorted(set(page) - set(code)) == [], "codes docs/api.md lists that the relay never sends"
    for name, statuses in code.items():
        assert statuses <= page[name], f"{name}: the code answers {statuses}, the page says {page[name]}"


def test_the_alert_table_is_the_shipped_rules() -> None:
    shipped = {
        rule["alert"]: rule["for"]
        for group in yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    page = (ROOT / "docs" / "observability.md").read_text()
    rows = dict(re.findall(r"^\| (Relayfleet\w+) \|.*\| (\w+) \|$", page, re.MULTILINE))
    assert rows == shipped
    assert "not shipped" not in page
    assert "not in the shipped rules" not in page


def test_the_command_line_section_names_every_subcommand() -> None:
    usage = cli.build_parser().format_usage()
    commands = usage[usage.index("{") + 1 : usage.index("}")].split(",")
    block = API.split("## Command line", 1)[1].split("```", 2)[1]
    listed = set(re.findall(r"^relayfleet (\w+)", block, re.MULTILINE))
    assert listed == set(commands)


def test_every_redis_url_scheme_is_documented_and_accepted() -> None:
    bullet = API.split("- Redis URLs:", 1)[1].split("\n- ", 1)[0]
    documented = set(re.findall(r"`([a-z+]+)://", bullet))
    assert documented == {*NODE_SCHEMES, SENTINEL_SCHEME}
    for scheme in NODE_SCHEMES:
        RedisTarget.from_url(f"{scheme}://127.0.0.1:6379/0" if scheme != "unix" else "unix:///tmp/r.sock")
    with pytest.raises(RedisURLError):
        RedisTarget.from_url("memcached://127.0.0.1:11211")


def test_docs_cite_nothing_a_reader_cannot_open() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        found = re.findall(r"\b[Ii]ssues? #?\d+|\bDESIGN\b", text)
        assert not found, f"{page.relative_to(ROOT)}: {found}"
        for target in re.findall(r"\]\(([^)#:]+\.md)", text):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}"
