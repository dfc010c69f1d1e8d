"""docs/api.md and the OpenAPI document describe the same API: every endpoint the page lists
exists in GET /v1/openapi.json with that method, and every documented path is on the page."""

from __future__ import annotations

import re
from pathlib import Path

from relay.api.openapi import document

DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"
ROW = re.compile(r"^\| `(GET|POST|PUT|DELETE|PATCH) (/[^`?]*)` \|", re.MULTILINE)


def documented() -> set[tuple[str, str]]:
    return {(method.lower(), path) for method, path in ROW.findall(DOC.read_text())}


def test_every_endpoint_in_api_md_is_in_the_openapi_document() -> None:
    rows = documented()
    assert len(rows) >= 17  # the table was found and parsed
    paths = document()["paths"]
    missing = sorted(f"{m.upper()} {p}" for m, p in rows if m not in paths.get(p, {}))
    assert not missing, f"docs/api.md lists endpoints the OpenAPI document lacks: {missing}"


def test_every_openapi_path_is_on_the_page() -> None:
    on_page = {path for _, path in documented()}
    absent = sorted(set(document()["paths"]) - on_page)
    assert not absent, f"OpenAPI paths missing from docs/api.md: {absent}"


def test_readme_links_the_in_repo_contract() -> None:
    readme = (DOC.parent.parent / "README.md").read_text()
    assert "(docs/api.md)" in readme
    assert "../shared/" not in readme
