"""Stock DIDComm v2 clients for the v2 mediator's tests (tests/relay/didcomm_v2/, e2e/).

* ``IdentusAgent`` runs e2e/didcomm/identus/agent.mjs: a Hyperledger Identus SDK 7.0.0 Agent
  over an in-memory store, mediated (Coordinate Mediation 2.0, Pickup 3.0 polling or live over
  the WebSocket) or sending only.
* ``VeramoAgent`` runs e2e/didcomm/veramo/agent.mjs: Veramo 7.0.1 with @veramo/did-comm
  (Coordinate Mediation 3.0, Pickup 3.0 by polling; one `poll` command per delivery-request).

Both are driven over JSON lines (the command list is at the top of each agent.mjs) from the npm
trees `hack/didcomm-toolchain.sh` caches (``toolchain()`` of tests/support/didcomm_stock_agents.py).

``ClientHistory`` turns what the clients saw into a tests.support.history record, so the history
checker judges a stock client's run: see its docstring for what each record stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import Any

from tests.support.didcomm_stock_agents import AgentError, Toolchain
from tests.support.history import History, Verdict

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENTS = REPO_ROOT / "e2e" / "didcomm"


@cache
def node_major() -> int:
    out = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.strip().lstrip("v").split(".")[0])


def _open_log(path: Path, header: str) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"\n{header}\n".encode())
    return fd


class NodeAgent:
    """One run of an agent.mjs: commands answered by id, events queued, stderr to a log file."""

    kind = ""

    def __init__(self, tools: Toolchain, workdir: Path, name: str) -> None:
        self.tools = tools
        self.name = name
        self.run_dir = workdir / name
        self.log_path = workdir / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.errors: list[str] = []  # unhandled rejections inside the agent
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._reader: asyncio.Task[None] | None = None

    def node_modules(self) -> Path:
        raise NotImplementedError

    def node_args(self) -> list[str]:
        return []

    def on_event(self, event: dict[str, Any]) -> bool:
        """True when the event was consumed (not queued)."""
        return False

    async def start(self, args: list[str], timeout: float = 120.0) -> dict[str, Any]:
        # agent.mjs imports from a node_modules beside it: a copy next to a link to the cache.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        source = AGENTS / self.kind
        shutil.copy(source / "agent.mjs", self.run_dir / "agent.mjs")
        shutil.copy(source / "package.json", self.run_dir / "package.json")
        link = self.run_dir / "node_modules"
        if not link.exists():
            link.symlink_to(self.node_modules())
        argv = ["node", *self.node_args(), str(self.run_dir / "agent.mjs"), *args]
        log = _open_log(
            self.log_path, f"===== start {' '.join(args)[:200]} at {time.strftime('%H:%M:%S')} ====="
        )
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                limit=16 * 1024 * 1024,
            )
        finally:
            os.close(log)
        self._reader = asyncio.create_task(self._read())
        return await self.wait_event("ready", timeout)

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if "id" in obj and obj["id"] in self._replies:
                fut = self._replies.pop(obj["id"])
                if not fut.done():
                    fut.set_result(obj)
                continue
            if obj.get("event") == "error":
                self.errors.append(str(obj.get("error")))
            if not self.on_event(obj):
                await self.events.put(obj)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(AgentError(f"the {self.name} agent exited ({self.proc.returncode})"))
        await self.events.put({"event": "exit", "code": self.proc.returncode})

    async def command(self, cmd: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self._next_id += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[self._next_id] = fut
        self.proc.stdin.write(json.dumps({"id": self._next_id, "cmd": cmd, **args}).encode() + b"\n")
        await self.proc.stdin.drain()
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise AgentError(f"{self.name}: {cmd} timed out after {timeout} s") from None
        if not reply.get("ok"):
            raise AgentError(f"{self.name}: {cmd} failed: {reply.get('error')}")
        return reply

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"no {name!r} event from {self.name} in {timeout} s")
            try:
                event = await asyncio.wait_for(self.events.get(), left)
            except TimeoutError:
                continue
            if event.get("event") == name:
                return event
            if event.get("event") in ("fatal", "exit"):
                raise AgentError(f"{self.name} ended before {name!r}: {event}")

    async def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(AgentError, ConnectionError):
                await self.command("stop", timeout=20)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.send_signal(signal.SIGKILL)
                await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._reader, 5)
            self._reader = None

    def log_tail(self, limit: int = 12000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return f"({self.log_path} absent)"
        return text if len(text) <= limit else "...\n" + text[-limit:]


class IdentusAgent(NodeAgent):
    """The Identus SDK agent. `batches` holds every batch of received messages (a Pickup
    delivery, after its messages-received was answered): {"atMs", "items": [...]}."""

    kind = "identus"

    def __init__(self, tools: Toolchain, workdir: Path, name: str) -> None:
        super().__init__(tools, workdir, name)
        self.batches: list[dict[str, Any]] = []
        self.http: list[dict[str, Any]] = []
        self._batch = asyncio.Event()

    def node_modules(self) -> Path:
        return self.tools.identus_dir / "node_modules"

    def node_args(self) -> list[str]:
        # the SDK's live mode opens the global WebSocket, behind a flag below Node 22
        return ["--experimental-websocket"] if node_major() < 22 else []

    def on_event(self, event: dict[str, Any]) -> bool:
        if event.get("event") == "messages":
            self.batches.append(event)
            self._batch.set()
            return True
        if event.get("event") == "http":
            self.http.append(event)
            return True
        return False

    async def start_agent(
        self, mediator_did: str | None = None, live: bool = False, poll_ms: int = 300
    ) -> dict[str, Any]:
        args = ["--poll-ms", str(poll_ms)]
        if mediator_did:
            args += ["--mediator-did", mediator_did]
        if live:
            args.append("--live")
        return await self.start(args)

    def contents(self) -> list[str]:
        """Basic-message contents in the order the agent was handed them."""
        return [
            str(item["content"])
            for batch in self.batches
            for item in batch["items"]
            if str(item.get("piuri", "")).endswith("/basicmessage/2.0/message")
        ]

    async def wait_contents(self, wanted: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not wanted <= set(self.contents()):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - set(self.contents()))
                raise AgentError(f"{self.name}: {len(missing)} not received in {timeout} s: {missing[:10]}")
            self._batch.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._batch.wait(), left)

    def http_failures(self) -> list[dict[str, Any]]:
        return [h for h in self.http if not 200 <= int(h["status"]) < 300]


class VeramoAgent(NodeAgent):
    kind = "veramo"

    def node_modules(self) -> Path:
        return self.tools.veramo_dir / "node_modules"

    async def start_agent(self, mediator_did: str | None = None) -> dict[str, Any]:
        return await self.start(["--mediator-did", mediator_did] if mediator_did else [])


class ClientHistory:
    """A tests.support.history record of one recipient's run, from what the clients saw.

    The relay's sequence numbers are not visible to a DIDComm client, so each message's `seq` is
    the order in which its send was answered; the sends are paced (each starts once the one
    before was answered), which makes that order the queue's FIFO order. Records:

    * enqueue: the sender's send, from its start to its answer (the HTTP POST of the forward);
    * deliver (mode read): one delivery as the recipient handed it over; `t0` is the request's
      start where the client shows it (Veramo's poll) and otherwise the previous delivery's time
      (earlier than the true start: the "skipped" check can only be less strict, never wrong);
    * ack: the messages-received of that delivery, answered before the client handed the batch
      over (both clients send it and await its answer first), so it ends at the delivery's end.

    A message delivered twice is a `duplicate` (exactly-once), and once more after its ack an
    `after_removal`; one never delivered is `lost`; a delivery out of send order is `fifo` or
    `skipped`.
    """

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.history = History()
        self.seq_of: dict[str, int] = {}
        self.last_delivery_s = 0.0

    def sent(self, content: str, t0_ms: float, t1_ms: float, ok: bool = True) -> None:
        seq = len(self.seq_of) + 1
        self.seq_of[content] = seq
        self.history.enqueue(
            self.queue, content, t0_ms / 1000, t1_ms / 1000, 201 if ok else 0, seq=seq if ok else None
        )
        self.last_delivery_s = self.last_delivery_s or t0_ms / 1000

    def delivered(self, contents: list[str], t1_ms: float, t0_ms: float | None = None) -> None:
        t1 = t1_ms / 1000
        t0 = t0_ms / 1000 if t0_ms is not None else self.last_delivery_s
        items = [(self.seq_of.get(c, 0), c) for c in contents]
        self.history.deliver(self.queue, "read", min(t0, t1), t1, 200, items)
        if items:
            self.history.ack(self.queue, t1 - 1e-6, t1 - 1e-6, 200, seqs=[s for s, _ in items])
        self.last_delivery_s = t1

    def check(self) -> Verdict:
        return self.history.check(exactly_once=True)


def verdict_summary(verdict: Verdict) -> str:
    if verdict.ok:
        return "valid"
    return ", ".join(f"{n} {k}" for k, n in sorted(verdict.by_kind().items()))
