"""relayfleet as the DIDComm mediator of stock agents: Credo-ts 0.6 and ACA-Py 1.7, end to end.

One fleet (two Debian redis-server shards, a shard-map file, one `python -m relay`
process with a DIDComm seed and public URL) and two real agents on loopback:

* the Credo-ts agent (e2e/didcomm/credo/agent.mjs, Askar wallet in sqlite) takes the
  fleet's invitation, connects (DID Exchange), asks for mediation and picks up with
  Pickup 2.0;
* ACA-Py (`aca-py start`, admin API) invites the Credo agent; Credo's DID names relayfleet's
  endpoint with relayfleet's routing key, so everything ACA-Py sends it (the DID Exchange
  response, the basic messages) goes forward -> queue -> pickup.

The tests run in file order on one module fixture; each prints every log on failure.
ACA-Py sends concurrently (its outbound queue does not keep order), so the ordering checks
pace its sends by the relay's own count of stored forwards: "in order" means in the order
relayfleet stored them.
The toolchain (Askar from source, npm, a Python 3.13 venv) comes from
hack/didcomm-toolchain.sh, which `make test` runs first; see docs/e2e.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.didcomm import keys as dk
from relay.didcomm.envelope import pack
from relay.fleet.migration import write_map_file
from relay.fleet.routing import load_file
from relay.fleet.sharding import even_split
from relay.storage import keys as K
from tests.support.didcomm_stock_agents import AcaPy, AgentError, CredoAgent, Toolchain, tail, toolchain
from tests.support.fleet_harness import RelayProc, didcomm_slots, spawn_relay, stop_relays, wait_ready

pytestmark = [
    pytest.mark.didcomm_agents,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(420),  # agents are slow on a loaded 2-core machine
]

DEBIAN_REDIS = "/usr/bin/redis-server"
CLI = (sys.executable, "-c", "import sys; from relay.cli import main; sys.exit(main(sys.argv[1:]))")
# relayfleet_didcomm_messages_total{result="ok",type="routing/1.0/forward"} N (labels in any order):
# a forward relayfleet stored (queued for its recipient).
DIDCOMM_COUNTER = re.compile(r"^relayfleet_didcomm_messages_total\{([^}]*)\}\s+(\S+)$")
FORWARD_OK_LABELS = {'result="ok"', 'type="routing/1.0/forward"'}
LIVE_LATENCY_BUDGET_MS = 1000.0


@dataclass
class World:
    workdir: Path
    tools: Toolchain
    shards: dict[str, LocalRedis]
    map_path: str
    relay: RelayProc
    identity: dk.Identity
    credo: CredoAgent
    acapy: AcaPy
    acapy_conn: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def relay_url(self) -> str:
        return self.relay.url

    def logs(self) -> str:
        parts = [f"===== relay ({self.relay.log_path}) =====", tail(self.relay.log_path)]
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(self.relay_url + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
            parts += [line for line in text.splitlines() if line.startswith("relayfleet_didcomm")]
        parts += ["===== the queues of every key registered with the mediator ====="]
        parts += self.queue_report()
        parts += [f"===== Credo-ts ({self.credo.log_path}) =====", tail(self.credo.log_path, 20000)]
        parts += [f"===== ACA-Py ({self.acapy.log_path}) =====", self.acapy.logs()]
        return "\n".join(parts)

    @contextlib.contextmanager
    def diagnosed(self) -> Iterator[None]:
        """On any failure, print every agent's and the relay's log (pytest shows it)."""
        try:
            yield
        except BaseException:
            print(self.logs())
            raise

    async def forwards_ok(self) -> float:
        async with aiohttp.ClientSession() as http, http.get(self.relay_url + "/metrics") as resp:
            text = await resp.text()
        total = 0.0
        for line in text.splitlines():
            if (m := DIDCOMM_COUNTER.match(line)) and set(m.group(1).split(",")) == FORWARD_OK_LABELS:
                total += float(m.group(2))
        return total

    async def send_paced(self, contents: list[str], timeout: float = 20.0) -> None:
        """ACA-Py sends each one; the next only once relayfleet has stored the one before."""
        for content in contents:
            before = await self.forwards_ok()
            await self.acapy.send_basic_message(self.acapy_conn, content)
            deadline = time.monotonic() + timeout
            while await self.forwards_ok() < before + 1:
                if time.monotonic() > deadline:
                    raise AgentError(f"relayfleet stored no forward for {content!r} in {timeout} s")
                await asyncio.sleep(0.02)

    async def poison(self) -> dict[str, list[int]]:
        """What an attacker with only Credo's public keys can do: anonymous forwards to every
        key Credo registered whose `msg` is 3,000 nested `[` (a string), 3,000 nested objects,
        or shaped like an envelope that opens for nobody; and 3,000 `[` enqueued on each key's
        queue through the plain API. Statuses per kind."""
        routing = self.identity.routing.verkey
        bombs = {
            "string_3000": json.dumps("[" * 3000).encode(),
            "object_3000": b'{"a": ' * 3000 + b"{}" + b"}" * 3000,
            "shaped_garbage": json.dumps(SHAPED_GARBAGE).encode(),
        }
        statuses: dict[str, list[int]] = {name: [] for name in bombs}
        headers = {"Content-Type": "application/didcomm-envelope-enc"}
        async with aiohttp.ClientSession() as http:
            for key in self.registered_keys():
                to = dk.b64decode_any(key)
                for name, inner in bombs.items():
                    body = pack(_forward(to, inner), [routing], None)
                    async with http.post(self.relay_url + "/v1/didcomm", data=body, headers=headers) as resp:
                        statuses[name].append(resp.status)
                # the plain enqueue API takes any bytes on the key's queue
                async with http.post(f"{self.relay_url}/v1/queues/{key}/messages", data=b"[" * 3000) as resp:
                    statuses.setdefault("raw_enqueue", []).append(resp.status)
        return statuses

    def registered_keys(self) -> list[str]:
        """Every recipient key registered with the mediator (unpadded base64url), from Redis."""
        found: list[str] = []
        for slot, shard in didcomm_slots(self.shards).items():
            with redis.Redis.from_url(self.shards[shard].url) as client:
                for field_ in client.hkeys(K.slot_didcomm(slot)):
                    name = field_.decode() if isinstance(field_, bytes) else str(field_)
                    if name.startswith("k:"):
                        found.append(name[2:])
        return found

    def queue_report(self) -> list[str]:
        """Status and first messages of each registered key's queue, through the queue API."""
        lines = []
        for key in self.registered_keys():
            for what in ("status", "messages?limit=3"):
                try:
                    url = f"{self.relay_url}/v1/queues/{key}/{what}"
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        lines.append(f"{key[:12]}.. {what}: {resp.read().decode()[:600]}")
                except OSError as exc:
                    lines.append(f"{key[:12]}.. {what}: {exc}")
        return lines

    def didcomm_slots(self) -> dict[int, str]:
        """Every slot holding DIDComm records (all of them the Credo agent's: its mediator
        connection and every key it registered, so every queue it is sent to) -> its shard."""
        return didcomm_slots(self.shards)


# shaped like a packed message, opens for nobody: stored, handed to Credo, which drops it
SHAPED_GARBAGE = {
    "protected": "e30",
    "iv": "AAAAAAAAAAAAAAAA",
    "ciphertext": "AAAA",
    "tag": "AAAAAAAAAAAAAAAAAAAAAA",
}


def _forward(to: bytes, msg_json: bytes) -> bytes:
    """A forward's plaintext with `msg` exactly `msg_json` (json.dumps recurses on deep values)."""
    head = {
        "@type": "https://didcomm.org/routing/1.0/forward",
        "@id": os.urandom(8).hex(),
        "to": dk.b58encode(to),
    }
    return json.dumps(head).encode()[:-1] + b', "msg": ' + msg_json + b"}"


def first_arrivals(messages: list[dict[str, Any]]) -> tuple[list[str], int]:
    """The contents in the order they first arrived, and how many arrivals were repeats."""
    seen: dict[str, None] = {}
    for m in messages:
        seen.setdefault(m["content"], None)
    return list(seen), len(messages) - len(seen)


def _invitation_of(url: str) -> dict[str, Any]:
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    raw = query["oob"][0]
    invitation: dict[str, Any] = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    return invitation


@pytest.fixture(scope="module")
def tools() -> Toolchain:
    return toolchain()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tools: Toolchain, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    if not Path(DEBIAN_REDIS).exists():  # noqa: ASYNC240 - one stat at set-up
        pytest.fail(f"{DEBIAN_REDIS} is needed (Debian's redis-server; .ci/run installs it)")
    workdir = tmp_path_factory.mktemp("didcomm")
    shards: dict[str, LocalRedis] = {}
    relay: RelayProc | None = None
    credo: CredoAgent | None = None
    acapy: AcaPy | None = None
    world: World | None = None
    try:
        for name in ("a", "b"):
            shards[name] = LocalRedis(binary=DEBIAN_REDIS, dir=str(workdir / f"redis-{name}")).start()
        map_path = str(workdir / "shardmap.json")
        write_map_file(map_path, even_split("test", {n: s.url for n, s in shards.items()}))
        seed_file = workdir / "didcomm-seed"
        seed_file.write_text(os.urandom(32).hex())
        port = free_port()
        public_url = f"http://127.0.0.1:{port}"
        env = {
            "RELAY_DIDCOMM_SEED_FILE": str(seed_file),
            "RELAY_PUBLIC_URL": public_url,
            "RELAY_LOG_LEVEL": "INFO",
        }
        relay = spawn_relay(["--shard-map", map_path], workdir, env, port)
        wait_ready(relay)
        identity = dk.Identity.from_seed(dk.read_seed(seed_file.read_bytes()), public_url)
        credo = CredoAgent(tools, workdir / "credo-wallet", workdir / "credo.log")
        acapy = AcaPy(tools, workdir / "acapy")
        world = World(workdir, tools, shards, map_path, relay, identity, credo, acapy)
        with world.diagnosed():
            await asyncio.gather(credo.start("PickUpV2"), acapy.start())
        yield world
    finally:
        # tests replace world.credo (restarts, a SIGKILL): stop the agent running now, not the
        # first one; a Credo process left behind was a ResourceWarning in some later test
        if world is not None:
            credo = world.credo
        if credo is not None:
            await credo.stop()
        if acapy is not None:
            acapy.stop()
        if relay is not None:
            stop_relays([relay])
        for server in shards.values():
            server.stop()


async def test_mediation_is_granted_with_relayfleets_routing_key(world: World) -> None:
    with world.diagnosed():
        async with (
            aiohttp.ClientSession() as http,
            http.get(world.relay_url + "/v1/didcomm/invitation") as resp,
        ):
            assert resp.status == 200
            body = await resp.json()
        t0 = time.monotonic()
        grant = await world.credo.command("mediate", url=body["invitation_url"], timeout=60)
        world.figures["mediation_s"] = round(time.monotonic() - t0, 2)
        assert grant["state"] == "granted"
        # Credo keeps them as base58 verkeys, the invitation below as did:key: compare keys.
        assert [dk.verkey_from(k) for k in grant["routingKeys"]] == [world.identity.routing.verkey]
        assert grant["endpoint"] == world.identity.endpoint
        # The pickup polls already reach the relay: its records now hold the Credo agent.
        assert world.didcomm_slots(), "the relay keeps no DIDComm record of the Credo agent"


async def test_acapy_connects_to_credo_through_relayfleet(world: World) -> None:
    # Credo accepts ACA-Py's invitation: its DID (sent in the request) names relayfleet's
    # endpoint and routing key, so ACA-Py's DID Exchange response, and every message after,
    # reaches Credo as forward -> queue -> pickup. (The other way round, ACA-Py 1.7 as the
    # requester cannot build its `complete` from Credo 0.6's response, which has no pthid:
    # docs/protocols.md, "Tested agents".)
    with world.diagnosed():
        invitation = await world.acapy.create_invitation()
        forwards_before = await world.forwards_ok()
        t0 = time.monotonic()
        accepted = await world.credo.command("accept", url=invitation["invitation_url"], timeout=90)
        assert accepted["theirLabel"] == world.acapy.label
        world.acapy_conn = await world.acapy.connection_for_invitation(invitation["invi_msg_id"], 30)
        record = await world.acapy.wait_active(world.acapy_conn, timeout=60)
        world.figures["did_exchange_s"] = round(time.monotonic() - t0, 2)
        assert record["their_label"] == world.credo.label
        # ACA-Py's response reached Credo as a forward relayfleet stored.
        assert await world.forwards_ok() >= forwards_before + 1
        # The invitation Credo makes for its peers points at relayfleet too.
        invite = await world.credo.command("invite")
        services = [s for s in _invitation_of(invite["url"])["services"] if isinstance(s, dict)]
        assert services[0]["serviceEndpoint"] == world.identity.endpoint
        assert [dk.verkey_from(k) for k in services[0]["routingKeys"]] == [world.identity.routing.verkey]


async def test_twenty_basic_messages_arrive_in_order_with_http_polling(world: World) -> None:
    with world.diagnosed():
        contents = [f"poll-{i:02d}" for i in range(20)]
        already = len(world.credo.basic_messages)
        t0 = time.monotonic()
        await world.send_paced(contents)
        await world.credo.wait_messages(already + 20, timeout=150)
        deadline = time.monotonic() + 30
        while (got := first_arrivals(world.credo.basic_messages[already:]))[0] != contents:
            if time.monotonic() > deadline or len(got[0]) > len(contents):
                break
            await asyncio.sleep(0.1)
        world.figures["poll_20_s"] = round(time.monotonic() - t0, 2)
        await asyncio.sleep(1.0)  # let any late repeat arrive before counting
        order, repeats = first_arrivals(world.credo.basic_messages[already:])
        world.figures["poll_duplicates"] = repeats
        assert order == contents
        # A delivery leases what it hands out: a poll before the ack gets nothing twice.
        assert repeats == 0, f"{repeats} messages delivered twice"


async def test_a_poisoned_inbox_does_not_stop_pickup_polling(world: World) -> None:
    with world.diagnosed():
        statuses = await world.poison()
        world.figures["poison_statuses_polling"] = statuses
        assert set(statuses["string_3000"]) == {400}
        assert set(statuses["object_3000"]) == {400}
        assert set(statuses["shaped_garbage"]) == {202}
        assert set(statuses["raw_enqueue"]) == {201}
        already = len(world.credo.basic_messages)
        contents = [f"after-poison-poll-{i}" for i in range(5)]
        t0 = time.monotonic()
        await world.send_paced(contents)
        await _wait_first_arrivals(world.credo, contents, timeout=90, start=already)
        world.figures["after_poison_poll_s"] = round(time.monotonic() - t0, 2)


async def test_live_mode_on_the_websocket_delivers_within_a_second(world: World) -> None:
    with world.diagnosed():
        await world.credo.stop()
        world.credo = CredoAgent(world.tools, world.credo.data_dir, world.credo.log_path)
        await world.credo.start("PickUpV2LiveMode")
        await world.credo.wait_event("ws-open", timeout=30)
        # live-delivery-change answered by a status over the socket: live mode is on.
        await _wait_inbound(world.credo, "/status", timeout=30)
        await asyncio.sleep(0.5)
        latencies: list[float] = []
        for i in range(5):
            sent_ms = time.time() * 1000
            await world.acapy.send_basic_message(world.acapy_conn, f"live-{i}")
            got = await world.credo.wait_messages(i + 1, timeout=10)
            assert got[i]["content"] == f"live-{i}"
            latencies.append(got[i]["atMs"] - sent_ms)
        world.figures["live_latency_ms"] = [round(x, 1) for x in latencies]
        world.figures["live_latency_median_ms"] = round(statistics.median(latencies), 1)
        print(f"live-mode latency (ACA-Py send -> Credo received), ms: {world.figures['live_latency_ms']}")
        assert max(latencies) < LIVE_LATENCY_BUDGET_MS, latencies


async def _wait_first_arrivals(
    credo: CredoAgent, contents: list[str], timeout: float, start: int = 0
) -> None:
    """Until every one of `contents` has arrived (in any order, repeats allowed)."""
    deadline = time.monotonic() + timeout
    while not set(contents) <= {m["content"] for m in credo.basic_messages[start:]}:
        if time.monotonic() > deadline:
            have = {m["content"] for m in credo.basic_messages[start:]}
            raise AgentError(f"missing after {timeout} s: {sorted(set(contents) - have)}")
        await asyncio.sleep(0.1)


async def _wait_inbound(credo: CredoAgent, type_suffix: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        event = await credo.wait_event("inbound", max(0.1, deadline - time.monotonic()))
        if str(event.get("type", "")).endswith(type_suffix):
            return event


async def test_a_poisoned_inbox_does_not_stop_live_mode(world: World) -> None:
    with world.diagnosed():
        statuses = await world.poison()
        world.figures["poison_statuses_live"] = statuses
        assert set(statuses["shaped_garbage"]) == {202}
        assert set(statuses["string_3000"]) == set(statuses["object_3000"]) == {400}
        already = len(world.credo.basic_messages)
        contents = [f"after-poison-live-{i}" for i in range(3)]
        t0 = time.monotonic()
        for content in contents:
            await world.acapy.send_basic_message(world.acapy_conn, content)
        await _wait_first_arrivals(world.credo, contents, timeout=30, start=already)
        world.figures["after_poison_live_s"] = round(time.monotonic() - t0, 2)
        # no live round failed on the poison (it would close the socket 1011 and log this)
        assert "didcomm live delivery failed" not in world.relay.log_path.read_text()


async def test_killed_before_acking_gets_the_messages_again_after_restart(world: World) -> None:
    with world.diagnosed():
        await world.credo.stop()
        world.credo = CredoAgent(world.tools, world.credo.data_dir, world.credo.log_path)
        await world.credo.start("PickUpV2")
        await world.credo.command("hold-acks")
        contents = [f"unacked-{i}" for i in range(5)]
        await world.send_paced(contents)
        held = await world.credo.wait_event("holding", timeout=30)
        assert held["count"] >= 1
        world.credo.kill()
        await world.credo.wait_killed()
        world.figures["held_in_first_delivery"] = held["count"]
        # A new process on the same Askar wallet: it still has its mediator and connections.
        world.credo = CredoAgent(world.tools, world.credo.data_dir, world.credo.log_path)
        await world.credo.start("PickUpV2")
        t0 = time.monotonic()
        await _wait_first_arrivals(world.credo, contents, timeout=150)
        world.figures["redelivered_after_restart_s"] = round(time.monotonic() - t0, 2)
        # Acked this time: after the next message, nothing of before comes again.
        await world.send_paced(["after-restart"])
        await _wait_first_arrivals(world.credo, [*contents, "after-restart"], timeout=30)
        last = len(world.credo.basic_messages)
        await world.send_paced(["after-restart-2"])
        await _wait_first_arrivals(world.credo, [*contents, "after-restart", "after-restart-2"], timeout=30)
        await asyncio.sleep(1.0)
        late = [m["content"] for m in world.credo.basic_messages[last:]]
        assert not set(late) & set(contents), f"acknowledged messages came again: {late}"


async def test_slot_migration_while_fifty_messages_flow_loses_none(world: World) -> None:
    with world.diagnosed():
        before = world.didcomm_slots()
        assert before, "no DIDComm records to move"
        already = len(world.credo.basic_messages)
        contents = [f"migrate-{i:02d}" for i in range(50)]
        sender = asyncio.create_task(world.send_paced(contents, timeout=60))
        # Start moving once the flow is under way (10 of the 50 delivered).
        with contextlib.suppress(AgentError):
            await world.credo.wait_messages(already + 10, timeout=60)
        moved: list[tuple[int, str, str]] = []
        t0 = time.monotonic()
        for slot, shard in sorted(before.items()):
            target = "b" if shard == "a" else "a"
            done = await asyncio.to_thread(
                subprocess.run,
                [*CLI, "migrate", "--shard-map", world.map_path, "--slots", f"{slot}-{slot}", "--to", target],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, f"migrate slot {slot}: {done.stdout}\n{done.stderr}"
            moved.append((slot, shard, target))
        world.figures["migrated_slots"] = len(moved)
        world.figures["migration_s"] = round(time.monotonic() - t0, 2)
        await sender
        await _wait_first_arrivals(world.credo, contents, timeout=150, start=already)
        received, repeats = first_arrivals(world.credo.basic_messages[already:])
        assert sorted(received) == contents, "lost across the migration"
        world.figures["migration_in_order"] = received == contents
        world.figures["migration_duplicates"] = repeats
        after = world.didcomm_slots()
        shard_map = load_file(world.map_path)
        for slot, _, target in moved:
            assert after.get(slot) == target
            assert shard_map.shard_for_slot(slot) == target
        print(f"didcomm e2e figures: {json.dumps(world.figures)}")
