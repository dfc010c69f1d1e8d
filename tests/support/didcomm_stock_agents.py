"""Stock DIDComm agents for the mediators' tests (tests/relay/didcomm/, tests/relay/didcomm_v2/,
e2e/): one driver for the Node agents of e2e/didcomm/, the agent-specific parts thin.

* ``toolchain()`` runs ``hack/didcomm-toolchain.sh`` (a no-op once built; see docs/e2e.md)
  and returns where Askar, the npm trees of the Node agents and ACA-Py are. As a pytest plugin
  (tests/conftest.py) this module runs it at collection time when a selected test carries
  the ``didcomm_agents`` marker.
* ``NodeAgent`` runs one e2e/didcomm/<kind>/agent.mjs beside a link to its cached npm tree and
  drives it over JSON lines (the command list is at the top of each agent.mjs):
  ``CredoAgent``, the headless Credo-ts 0.6 agent (a mediation recipient with a persistent
  Askar sqlite wallet); ``IdentusAgent``, a Hyperledger Identus SDK 7.0.0 Agent over an
  in-memory store, mediated (Coordinate Mediation 2.0, Pickup 3.0 polling or live over the
  WebSocket) or sending only; ``VeramoAgent``, Veramo 7.0.1 with @veramo/did-comm
  (Coordinate Mediation 3.0, Pickup 3.0 by polling; one `poll` command per delivery-request).
* ``AcaPy`` is ``aca-py start`` on loopback, driven through its admin API.

Every agent writes its log to a file of the test's directory; ``tail()`` reads one for a
failure message.
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from relayfleet_testing.localredis import free_port

from tests.support.procs import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLCHAIN_SCRIPT = REPO_ROOT / "hack" / "didcomm-toolchain.sh"
AGENTS = REPO_ROOT / "e2e" / "didcomm"


class AgentError(RuntimeError):
    """An agent failed to start, answered a command with an error, or timed out."""


@dataclass(frozen=True)
class Toolchain:
    askar_lib_dir: str
    credo_dir: Path
    acapy_bin: str
    identus_dir: Path  # the DIDComm v2 clients
    veramo_dir: Path
    # the Credo 0.5 agent with @credo-ts/push-notifications (e2e/didcomm/credo-push) and the
    # Askar 0.3 its aries-askar-nodejs binds
    askar_legacy_lib_dir: str = ""
    credo_push_dir: Path | None = None


# The build's outcome, once per session: a failure is remembered and raised by every test
# that needs the agents, not retried (a cold build takes minutes).
_BUILT: dict[str, Toolchain | AgentError] = {}


def toolchain(part: str = "all") -> Toolchain:
    """Build what is missing (minutes, once) and return where it is. `part` "credo-push": only
    the Credo 0.5 push agent and its Askar 0.3.2 ("all" builds them too)."""
    if part not in _BUILT:
        done = subprocess.run(
            ["bash", str(TOOLCHAIN_SCRIPT), part], capture_output=True, text=True, check=False, cwd=REPO_ROOT
        )
        if done.returncode != 0:
            tail_ = done.stderr[-4000:]
            _BUILT[part] = AgentError(f"{TOOLCHAIN_SCRIPT} {part} failed ({done.returncode}):\n{tail_}")
        else:
            env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
            _BUILT[part] = Toolchain(
                env["LIB_ASKAR_PATH"],
                Path(env["DIDCOMM_CREDO_DIR"]),
                env["DIDCOMM_ACAPY_BIN"],
                Path(env["DIDCOMM_IDENTUS_DIR"]),
                Path(env["DIDCOMM_VERAMO_DIR"]),
                env["LIB_ASKAR_LEGACY_PATH"],
                Path(env["DIDCOMM_CREDO_PUSH_DIR"]),
            )
    built = _BUILT[part]
    if isinstance(built, AgentError):
        raise built
    return built


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the toolchain before any test runs if a selected test needs it, so a cold build
    (the npm trees and ACA-Py take minutes) does not count against a test's timeout."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("didcomm_agents") for item in session.items):
        with contextlib.suppress(AgentError):
            toolchain()


def tail(path: Path, limit: int = 12000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} absent)"
    return text if len(text) <= limit else "...\n" + text[-limit:]


@cache
def node_major() -> int:
    out = subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.strip().lstrip("v").split(".")[0])


class NodeAgent:
    """One run of e2e/didcomm/<kind>/agent.mjs: commands answered by id, events queued, stderr
    to a log file. A subclass names its npm tree, its node flags and environment, and the
    events it keeps apart (`on_event`); its own `start` builds the command line."""

    kind = ""

    def __init__(self, tools: Toolchain, run_dir: Path, log_path: Path, name: str) -> None:
        self.tools = tools
        self.name = name
        self.run_dir = run_dir
        self.log_path = log_path
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

    def env(self) -> dict[str, str]:
        return {}

    def on_event(self, event: dict[str, Any]) -> bool:
        """True when the event was consumed (not queued)."""
        return False

    def _install(self) -> Path:
        """A copy of e2e/didcomm's layout in run_dir: the agent (its node_modules a link to the
        cached tree) and the modules the agents share (lib/); returns the agent's script. Copied
        at every start, so an edited agent needs no toolchain rebuild."""
        agent_dir = self.run_dir / self.kind
        agent_dir.mkdir(parents=True, exist_ok=True)
        for name in ("agent.mjs", "package.json"):
            shutil.copy(AGENTS / self.kind / name, agent_dir / name)
        shutil.copytree(AGENTS / "lib", self.run_dir / "lib", dirs_exist_ok=True)
        link = agent_dir / "node_modules"
        if not link.exists():
            link.symlink_to(self.node_modules())
        return agent_dir / "agent.mjs"

    async def launch(self, args: list[str], timeout: float) -> dict[str, Any]:
        """Start the agent with `args`; its "ready" event."""
        argv = ["node", *self.node_args(), str(self._install()), *args]
        header = f"===== start {' '.join(args)[:200]} at {time.strftime('%H:%M:%S')} ====="
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(log, f"\n{header}\n".encode())
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env={**os.environ, **self.env()},
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
        # exited already (killed by the test): its stdout is still read to EOF, so asyncio
        # closes the pipe now, not at garbage collection during some later test
        if self.proc.returncode is None:
            with contextlib.suppress(AgentError, ConnectionError):
                await self.command("stop", timeout=20)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.kill()
                await self.proc.wait()
        await self._join_reader()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, whatever was in flight is lost."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def wait_killed(self) -> None:
        assert self.proc is not None
        await self.proc.wait()
        await self._join_reader()

    async def _join_reader(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._reader, 5)
            self._reader = None

    def log_tail(self, limit: int = 12000) -> str:
        return tail(self.log_path, limit)


class CredoAgent(NodeAgent):
    """The Credo-ts 0.6 agent; ``data_dir`` (the Askar wallet) outlives runs. `basic_messages`
    holds every basic message of this run, in arrival order."""

    kind = "credo"

    def __init__(self, tools: Toolchain, data_dir: Path, log_path: Path, label: str = "credo-e2e") -> None:
        super().__init__(tools, data_dir.parent / f"{data_dir.name}-run", log_path, "Credo")
        self.data_dir = data_dir
        self.label = label
        self.basic_messages: list[dict[str, Any]] = []
        self._new_message = asyncio.Event()

    def node_modules(self) -> Path:
        return self.tools.credo_dir / "node_modules"

    def env(self) -> dict[str, str]:
        return {"LIB_ASKAR_PATH": self.tools.askar_lib_dir}

    def on_event(self, event: dict[str, Any]) -> bool:
        if event.get("event") == "basicmessage":
            self.basic_messages.append(event)
            self._new_message.set()
            return True
        return False

    async def start(self, strategy: str, poll_ms: int = 200, timeout: float = 120.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = ["--data", str(self.data_dir), "--label", self.label]
        await self.launch([*args, "--strategy", strategy, "--poll-ms", str(poll_ms)], timeout)

    async def wait_messages(self, count: int, timeout: float) -> list[dict[str, Any]]:
        """Wait until at least `count` basic messages have arrived in this run."""
        deadline = time.monotonic() + timeout
        while len(self.basic_messages) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                have = len(self.basic_messages)
                raise AgentError(f"{have} of {count} basic messages reached the Credo agent in {timeout} s")
            self._new_message.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_message.wait(), left)
        return self.basic_messages[:count]


class IdentusAgent(NodeAgent):
    """The Identus SDK agent of a test's `workdir`. `batches` holds every batch of received
    messages (a Pickup delivery, after its messages-received was answered): {"atMs", "items"}."""

    kind = "identus"

    def __init__(self, tools: Toolchain, workdir: Path, name: str) -> None:
        super().__init__(tools, workdir / name, workdir / f"{name}.log", name)
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
        return await self.launch(args, 120.0)

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
    """The Veramo agent of a test's `workdir`."""

    kind = "veramo"

    def __init__(self, tools: Toolchain, workdir: Path, name: str) -> None:
        super().__init__(tools, workdir / name, workdir / f"{name}.log", name)

    def node_modules(self) -> Path:
        return self.tools.veramo_dir / "node_modules"

    async def start_agent(self, mediator_did: str | None = None) -> dict[str, Any]:
        return await self.launch(["--mediator-did", mediator_did] if mediator_did else [], 120.0)


class AcaPy:
    """``aca-py start`` on loopback: HTTP in and out, an insecure admin API for the test."""

    def __init__(self, tools: Toolchain, workdir: Path, label: str = "acapy-e2e") -> None:
        self.tools = tools
        self.workdir = workdir
        self.label = label
        self.log_path = workdir / "acapy.log"  # its stdout and stderr
        self.inbound_port = free_port()
        self.admin_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self, timeout: float = 150.0) -> None:
        endpoint = f"http://127.0.0.1:{self.inbound_port}"
        argv = [self.tools.acapy_bin, "start"]
        argv += ["--inbound-transport", "http", "127.0.0.1", str(self.inbound_port)]
        argv += ["--outbound-transport", "http", "--endpoint", endpoint]
        argv += ["--admin", "127.0.0.1", str(self.admin_port), "--admin-insecure-mode"]
        argv += ["--label", self.label, "--no-ledger"]
        argv += ["--wallet-type", "askar", "--wallet-name", "acapy-e2e", "--wallet-key", "acapy-e2e-key"]
        argv += ["--auto-provision", "--auto-accept-invites", "--auto-accept-requests"]
        argv += ["--log-level", "info"]
        self.proc = self._spawn(argv)
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise AgentError(f"aca-py exited ({self.proc.returncode}) while starting")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(self.admin + "/status/ready") as resp:
                        if resp.status == 200 and (await resp.json()).get("ready"):
                            return
                if time.monotonic() > deadline:
                    raise AgentError(f"aca-py's admin API was not ready in {timeout} s")
                await asyncio.sleep(0.3)

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # HOME: ACA-Py keeps its Askar wallet under ~/.acapy_agent; one per test run.
        env = {**os.environ, "HOME": str(self.workdir)}
        with open(self.log_path, "ab") as out:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
            )

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, self.admin + path, json=body) as resp,
        ):
            text = await resp.text()
            if resp.status != 200:
                raise AgentError(f"aca-py {method} {path} -> {resp.status}: {text[:500]}")
            result: dict[str, Any] = json.loads(text)
            return result

    async def create_invitation(self) -> dict[str, Any]:
        """An OOB invitation (DID Exchange 1.1) to ACA-Py itself: {"invitation_url", "invi_msg_id", ...}."""
        body = {"handshake_protocols": ["https://didcomm.org/didexchange/1.1"]}
        return await self.call("POST", "/out-of-band/create-invitation?auto_accept=true", body)

    async def connection_for_invitation(self, invi_msg_id: str, timeout: float) -> str:
        """The id of the connection a peer opened on our invitation `invi_msg_id`."""
        deadline = time.monotonic() + timeout
        while True:
            found = await self.call("GET", f"/connections?invitation_msg_id={invi_msg_id}")
            if found.get("results"):
                return str(found["results"][0]["connection_id"])
            if time.monotonic() > deadline:
                raise AgentError(f"no aca-py connection for invitation {invi_msg_id} in {timeout} s")
            await asyncio.sleep(0.5)

    async def wait_active(self, conn_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            record = await self.call("GET", f"/connections/{conn_id}")
            if record.get("state") in ("active", "completed"):
                return record
            if record.get("state") == "abandoned" or time.monotonic() > deadline:
                raise AgentError(f"aca-py connection {conn_id} is {record.get('state')!r} after {timeout} s")
            await asyncio.sleep(0.5)

    async def send_basic_message(self, conn_id: str, content: str) -> None:
        await self.call("POST", f"/connections/{conn_id}/send-message", {"content": content})

    def stop(self) -> None:
        stop_process(self.proc, 15, kill_wait=None)

    def logs(self) -> str:
        """Its log without the admin API's access lines (the test polls it)."""
        lines = tail(self.log_path, 200000).splitlines()
        kept = "\n".join(line for line in lines if "aiohttp.access" not in line)
        return kept[-20000:]
