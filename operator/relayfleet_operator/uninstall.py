"""Before the chart goes: the fleets' custom resources are deleted while the operator still runs.

RelayShards and RelayRebalances carry the finalizer relayfleet.dev/drain, which only the
operator releases (a shard's once its slots live elsewhere, or once its whole fleet is being
deleted and no data would be lost). Uninstalled first, the operator leaves them undeletable,
and a namespace holding them never finishes deleting. The chart runs this as a pre-delete hook
(`python -m relayfleet_operator.uninstall`): it deletes every RelayRebalance and RelayShard it
sees and waits until they are gone, printing what each still waits for. Past --timeout it
exits 1 naming what holds the uninstall back (a shard whose data has nowhere to go), so
`helm uninstall` fails with the operator still running and nothing lost (docs/operator.md,
"Uninstalling").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from relay.fleet.contract import Obj
from relayfleet_operator.kube import Kube
from relayfleet_operator.spec import API_VERSION, REBALANCE_KIND, SHARD_KIND
from relayfleet_operator.status import condition

KINDS = (REBALANCE_KIND, SHARD_KIND)  # rebalances first: they hold a fleet's slot moves


def describe(kind: str, obj: Mapping[str, Any]) -> str:
    """One line per object still there: what it is and what it waits for."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    where = f"{kind} {meta.get('namespace')}/{meta.get('name')}"
    phase = status.get("phase") or "-"
    if kind == SHARD_KIND:
        why = (condition(status, "Degraded") or {}).get("message") or (condition(status, "Ready") or {}).get(
            "message"
        )
    else:
        why = status.get("message")
    return f"{where}: {phase}" + (f": {why}" if why else "")


async def _survey(kube: Kube, namespaces: Sequence[str | None]) -> list[tuple[str, Obj]]:
    found: list[tuple[str, Obj]] = []
    for kind in KINDS:
        for ns in namespaces:
            found += [(kind, o) for o in await kube.list(API_VERSION, kind, ns)]
    return found


async def run(
    kube: Kube,
    namespaces: Sequence[str | None],
    timeout_s: float,
    poll_s: float = 2.0,
    out: TextIO = sys.stdout,
) -> int:
    """Delete every RelayRebalance and RelayShard, then wait until they are gone (0) or
    `timeout_s` passed (1, naming each one left and why)."""
    left = await _survey(kube, namespaces)
    if not left:
        print("no RelayShards or RelayRebalances left", file=out)
        return 0
    for kind in KINDS:
        for k, obj in left:
            meta = obj.get("metadata") or {}
            if k == kind and not meta.get("deletionTimestamp"):
                await kube.delete(API_VERSION, kind, meta.get("namespace"), str(meta.get("name")))
                print(f"deleting {kind} {meta.get('namespace')}/{meta.get('name')}", file=out)
    deadline = time.monotonic() + timeout_s
    while True:
        left = await _survey(kube, namespaces)
        if not left:
            print("every RelayShard and RelayRebalance is gone", file=out)
            return 0
        if time.monotonic() >= deadline:
            print(f"after {timeout_s:.0f}s {len(left)} remain; the operator keeps running:", file=out)
            for kind, obj in left:
                print(f"  {describe(kind, obj)}", file=out)
            print(
                "Deal with them (docs/operator.md, Uninstalling), then run helm uninstall again.",
                file=out,
            )
            return 1
        print(f"waiting for {len(left)}: " + "; ".join(describe(k, o) for k, o in left), file=out)
        await asyncio.sleep(poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relayfleet_operator.uninstall",
        description="Delete the RelayShards and RelayRebalances while the operator runs; wait until gone.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", action="append", help="a namespace the operator watches (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="the operator watches every namespace")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait (default 240)")
    args = parser.parse_args(argv)
    namespaces: list[str | None] = [None] if args.all_namespaces else list(args.namespace)

    async def go() -> int:
        kube = await Kube.from_config()
        try:
            return await run(kube, namespaces, args.timeout)
        finally:
            await kube.close()

    return asyncio.run(go())


if __name__ == "__main__":
    sys.exit(main())
