"""The RelayRebalance state machine (after Strimzi's KafkaRebalance). Pure.

    New -> PendingProposal -> ProposalReady --(approve | autoApprove)--> Rebalancing -> Ready
                                   |  \\--stop--> Stopped        \\--stop--> Stopped
                                   \\--(invalid)--> NotReady      \\--(a move failed)--> NotReady
    refresh (from ProposalReady, Ready, Stopped, NotReady) -> PendingProposal
    approve on Stopped resumes the remaining moves.

`decide` says what to do next; the handler performs it and records the result with the
helpers below. Everything the executor needs to resume after a restart is in status.moves.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relay.fleet.contract import Move, Obj, move_from_json

ANNOTATION = "relayfleet.dev/rebalance"
APPROVE, STOP, REFRESH = "approve", "stop", "refresh"


class Phase(enum.StrEnum):
    NEW = "New"
    PENDING_PROPOSAL = "PendingProposal"
    PROPOSAL_READY = "ProposalReady"
    REBALANCING = "Rebalancing"
    READY = "Ready"
    STOPPED = "Stopped"
    NOT_READY = "NotReady"


class Action(enum.StrEnum):
    PROPOSE = "propose"  # compute/validate the proposal, then ProposalReady | NotReady | Ready
    START = "start"  # -> Rebalancing
    EXECUTE = "execute"  # run the remaining moves
    STOP = "stop"  # -> Stopped
    REFRESH = "refresh"  # -> PendingProposal (drops status.moves)
    INIT = "init"  # -> PendingProposal
    WAIT = "wait"  # nothing to do until something changes


@dataclass(frozen=True)
class Decision:
    action: Action
    consume_annotation: bool = False  # remove relayfleet.dev/rebalance after acting
    reason: str = ""


def decide(body: Mapping[str, Any]) -> Decision:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    annotation = ((meta.get("annotations") or {}).get(ANNOTATION) or "").strip().lower()
    phase = status.get("phase") or Phase.NEW
    generation = meta.get("generation", 0)
    spec_changed = status.get("observedGeneration") not in (None, generation)

    if phase == Phase.NEW:
        return Decision(Action.INIT)
    if phase == Phase.PENDING_PROPOSAL:
        return Decision(Action.PROPOSE)
    if phase == Phase.PROPOSAL_READY:
        if annotation == STOP:
            return Decision(Action.STOP, True, "stop requested before approval")
        if annotation == REFRESH or spec_changed:
            return Decision(Action.REFRESH, annotation == REFRESH, "refresh requested or spec changed")
        if annotation == APPROVE or spec.get("autoApprove"):
            return Decision(Action.START, annotation == APPROVE, "approved")
        return Decision(Action.WAIT, reason="waiting for approval")
    if phase == Phase.REBALANCING:
        if annotation == STOP:
            return Decision(Action.STOP, True, "stop requested")
        return Decision(Action.EXECUTE, annotation in (APPROVE, REFRESH))
    if phase == Phase.STOPPED:
        if annotation == REFRESH:
            return Decision(Action.REFRESH, True, "refresh requested")
        if annotation == APPROVE:
            return Decision(Action.START, True, "resumed")
        return Decision(Action.WAIT, annotation == STOP)
    if phase in (Phase.READY, Phase.NOT_READY):
        if annotation == REFRESH or (phase == Phase.NOT_READY and spec_changed):
            return Decision(Action.REFRESH, annotation == REFRESH, "refresh requested or spec changed")
        return Decision(Action.WAIT, bool(annotation))
    return Decision(Action.INIT, reason=f"unknown phase {phase!r}")


# --- status.moves bookkeeping --------------------------------------------------------------


def moves_status(moves: Sequence[Move]) -> list[Obj]:
    return [{**m.to_json(), "state": "Pending", "bytesMoved": 0, "keysMoved": 0} for m in moves]


def progress(entries: Sequence[Mapping[str, Any]]) -> Obj:
    total = len(entries)
    done = [e for e in entries if e.get("state") == "Done"]
    slots_total = slots_moved = 0
    for e in entries:
        move = move_from_json(e)
        slots_total += move.size
        if e.get("state") == "Done":
            slots_moved += move.size
    bytes_total = sum(int(e.get("bytes") or 0) for e in entries)
    bytes_moved = sum(int(e.get("bytesMoved") or 0) for e in entries)
    percent = 100 if total == 0 else (100 * slots_moved) // max(slots_total, 1)
    return {
        "movesTotal": total,
        "movesDone": len(done),
        "slotsTotal": slots_total,
        "slotsMoved": slots_moved,
        "bytesTotal": bytes_total,
        "bytesMoved": bytes_moved,
        "percent": f"{percent}%",
    }


def remaining(entries: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indexes of the moves still to run (Pending, Failed, or cut short by a restart)."""
    return [i for i, e in enumerate(entries) if e.get("state") != "Done"]
