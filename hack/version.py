"""The release version lives in ONE place, pyproject.toml's [project] version; this stamps it.

    python hack/version.py            print the version
    python hack/version.py --check    exit 1 (naming each file) if any stamped place disagrees
    python hack/version.py --sync     write the version into every stamped place

Stamped places: the chart's version and appVersion (the image tags default to appVersion), both
CRDs' relayfleet.dev/version annotation (crds/ and the chart's copy), the operator's
DEFAULT_IMAGE and DEFAULT_REDIS_IMAGE (the images of a RelayShard that names none, when the
operator runs without the chart's values).
Tags are v<version> (see docs/upgrade.md).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "ghcr.io/relayfleet/relayfleet"
REDIS_IMAGE = "ghcr.io/relayfleet/redis"


def version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        v: str = tomllib.load(f)["project"]["version"]
    if not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.]+)?", v):
        raise SystemExit(f"version {v!r} is not semver MAJOR.MINOR.PATCH[-PRE]")
    return v


def stamps(v: str) -> list[tuple[Path, str, str]]:
    """(file, pattern with one group for the version, replacement template)."""
    spec = ROOT / "operator/relayfleet_operator/spec.py"
    out = [
        (ROOT / "charts/relayfleet/Chart.yaml", r"(?m)^version: ([^\s]+)$", f"version: {v}"),
        (ROOT / "charts/relayfleet/Chart.yaml", r'(?m)^appVersion: "([^"]+)"$', f'appVersion: "{v}"'),
    ]
    for constant, image in (("DEFAULT_IMAGE", IMAGE), ("DEFAULT_REDIS_IMAGE", REDIS_IMAGE)):
        tag = re.escape(image) + r":([0-9A-Za-z.+-]+)"
        out.append((spec, rf'(?m)^{constant} = "{tag}"', f'{constant} = "{image}:{v}"'))
    for crds in ("crds", "charts/relayfleet/crds"):
        for name in ("relayshards.yaml", "relayrebalances.yaml"):
            # the operator's never-downgrade guard compares this (relayfleet_operator/crds.py)
            pattern = r'relayfleet\.dev/version: "([^"]+)"'
            out.append((ROOT / crds / name, pattern, f'relayfleet.dev/version: "{v}"'))
    return out


def main(argv: list[str]) -> int:
    v = version()
    if not argv:
        print(v)
        return 0
    mode = argv[0]
    if mode not in ("--check", "--sync"):
        print(__doc__, file=sys.stderr)
        return 2
    wrong: list[str] = []
    for path, pattern, replacement in stamps(v):
        text = path.read_text()
        found = re.search(pattern, text)
        if found is None:
            wrong.append(f"{path.relative_to(ROOT)}: no match for {pattern}")
        elif found.group(1) != v:
            if mode == "--sync":
                path.write_text(text[: found.start()] + replacement + text[found.end() :])
            else:
                wrong.append(f"{path.relative_to(ROOT)}: {found.group(1)} (want {v})")
    for line in wrong:
        print(f"version drift: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
