"""Stock DIDComm agents (Credo-ts 0.6, ACA-Py 1.7) with the fleet as their mediator, through the
fleet Service: two relays of a RelayShard whose spec.relay names a DIDComm seed Secret and the
Service's address as the public URL (the agents run on the node's host, as tests/test_didcomm_agents.py
runs them against one relay process).

1. Credo takes the fleet's invitation, connects, asks for mediation: granted with the fleet's
   routing key and endpoint.
2. ACA-Py invites Credo; Credo's DID names the fleet's endpoint, so ACA-Py's DID Exchange response
   and every message after reach Credo as forward -> queue -> pickup.
3. Ten basic messages, each sent once the one before arrived (Pickup 2.0 polling): all arrive, in
   order, none twice.
4. Credo restarted in live mode (the WebSocket): five messages, latency printed.
5. DIDComm v2: a stock Identus SDK agent mediated by the fleet (its v2 invitation's DID names
   the Service) receives from a second Identus agent by polling, then live over the WebSocket;
   the history checker judges each run.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from e2e.env import Env
from e2e.probes import http_get, phase, relay_url, shard, wait_for
from relay.didcomm import keys as dk
from tests.support.client_history import ClientHistory, verdict_summary
from tests.support.didcomm_stock_agents import AcaPy, CredoAgent, IdentusAgent, Toolchain, tail, toolchain

pytestmark = [
    pytest.mark.didcomm_agents,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

SHARD = "d"
FIGURES: dict[str, Any] = {}


@dataclass
class Agents:
    url: str  # the fleet Service, as the agents reach it (and the relays' public URL)
    identity: dk.Identity
    tools: Toolchain
    workdir: Path
    credo: CredoAgent
    acapy: AcaPy
    acapy_conn: str = ""
    sent: list[str] = field(default_factory=list)

    def logs(self) -> str:
        credo = [f"===== Credo ({self.credo.log_path}) =====", tail(self.credo.log_path, 20000)]
        return "\n".join([*credo, f"===== ACA-Py ({self.acapy.log_path}) =====", self.acapy.logs()])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agents(e2e: Env) -> AsyncIterator[Agents]:
    tools = toolchain()
    seed = os.urandom(32).hex()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "didcomm"},
        "stringData": {"seed": seed},
    }
    e2e.kubectl("apply", "-f", "-", input=json.dumps(secret))
    relay: dict[str, Any] = {
        "didcommSeedSecretRef": {"name": "didcomm", "key": "seed"},
        # Credo-ts handles what it receives one message at a time: polling every 200 ms on the
        # loaded node its inbound queue ran 18-31 s behind, so a 10 s lease sent each message
        # again before its ack arrived and Credo showed it twice (docs/protocols.md, Pickup 2.0)
        "env": [{"name": "RELAY_DIDCOMM_REDELIVER_S", "value": "60"}],
    }
    e2e.kubectl("apply", "-f", "-", input=shard(SHARD, replicas=2, relay=relay))
    url = await asyncio.to_thread(wait_for, "fleet service", lambda: relay_url(e2e), 180)
    if url.startswith("http://127.0.0.1:"):
        pytest.skip("the agents need the Service's own address (ClusterIP) as the relays' public URL")
    patch = {"spec": {"relay": {**relay, "publicURL": url}}}
    e2e.kubectl("patch", "rshard", SHARD, "--type=merge", "-p", json.dumps(patch))

    def rolled() -> bool:
        dep: Any = e2e.get("deployment", f"relayfleet-{SHARD}-relay")
        env = dep["spec"]["template"]["spec"]["containers"][0].get("env") or []
        status = dep.get("status") or {}
        return (
            any(e.get("value") == url for e in env)
            and status.get("updatedReplicas") == 2
            and status.get("readyReplicas") == 2
            and not status.get("unavailableReplicas")
        )

    await asyncio.to_thread(wait_for, "relays with the public URL", rolled, 180)
    await asyncio.to_thread(wait_for, "shard d Ready", lambda: phase(e2e, "rshard", SHARD) == "Ready", 60)
    await asyncio.to_thread(wait_for, "fleet /readyz", lambda: http_get(url + "/readyz")[0] == 200, 60)
    workdir = e2e.workdir / "didcomm"
    identity = dk.Identity.from_seed(dk.read_seed(seed.encode()), url)
    world = Agents(
        url,
        identity,
        tools,
        workdir,
        CredoAgent(tools, workdir / "credo-wallet", workdir / "credo.log"),
        AcaPy(tools, workdir / "acapy"),
    )
    try:
        await asyncio.gather(world.credo.start("PickUpV2"), world.acapy.start())
        yield world
    finally:
        await world.credo.stop()
        world.acapy.stop()
        print(f"didcomm fleet figures: {json.dumps(FIGURES)}")


async def test_mediation_through_the_fleet_service(agents: Agents) -> None:
    try:
        async with aiohttp.ClientSession() as http, http.get(agents.url + "/v1/didcomm/invitation") as resp:
            assert resp.status == 200
            body = await resp.json()
        t0 = time.monotonic()
        grant = await agents.credo.command("mediate", url=body["invitation_url"], timeout=90)
        FIGURES["mediation_s"] = round(time.monotonic() - t0, 2)
        assert grant["state"] == "granted"
        assert [dk.verkey_from(k) for k in grant["routingKeys"]] == [agents.identity.routing.verkey]
        assert grant["endpoint"] == agents.identity.endpoint
    except BaseException:
        print(agents.logs())
        raise


async def test_acapy_reaches_credo_through_the_fleet(agents: Agents) -> None:
    try:
        invitation = await agents.acapy.create_invitation()
        t0 = time.monotonic()
        accepted = await agents.credo.command("accept", url=invitation["invitation_url"], timeout=120)
        assert accepted["theirLabel"] == agents.acapy.label
        agents.acapy_conn = await agents.acapy.connection_for_invitation(invitation["invi_msg_id"], 30)
        record = await agents.acapy.wait_active(agents.acapy_conn, timeout=90)
        FIGURES["did_exchange_s"] = round(time.monotonic() - t0, 2)
        assert record["their_label"] == agents.credo.label
    except BaseException:
        print(agents.logs())
        raise


async def test_ten_messages_in_order_with_polling(agents: Agents) -> None:
    try:
        already = len(agents.credo.basic_messages)
        contents = [f"fleet-poll-{i:02d}" for i in range(10)]
        t0 = time.monotonic()
        for n, content in enumerate(contents, 1):
            await agents.acapy.send_basic_message(agents.acapy_conn, content)
            await agents.credo.wait_messages(already + n, timeout=60)
        FIGURES["poll_10_s"] = round(time.monotonic() - t0, 2)
        await asyncio.sleep(1.0)  # a late repeat would show now
        got = [m["content"] for m in agents.credo.basic_messages[already:]]
        assert got == contents
    except BaseException:
        print(agents.logs())
        raise


async def test_live_mode_over_the_fleet_service(agents: Agents) -> None:
    try:
        await agents.credo.stop()
        agents.credo = CredoAgent(agents.tools, agents.credo.data_dir, agents.credo.log_path)
        await agents.credo.start("PickUpV2LiveMode")
        await agents.credo.wait_event("ws-open", timeout=30)
        await asyncio.sleep(1.0)
        latencies = []
        for i in range(5):
            sent_ms = time.time() * 1000
            await agents.acapy.send_basic_message(agents.acapy_conn, f"fleet-live-{i}")
            got = await agents.credo.wait_messages(i + 1, timeout=20)
            assert got[i]["content"] == f"fleet-live-{i}"
            latencies.append(round(got[i]["atMs"] - sent_ms, 1))
        FIGURES["live_latency_ms"] = latencies
    except BaseException:
        print(agents.logs())
        raise


async def _identus_round_trip(agents: Agents, live: bool, count: int) -> dict[str, Any]:
    """A stock Identus SDK agent mediated by the fleet (DIDComm v2: Coordinate Mediation 2.0,
    Pickup 3.0) receives `count` basic messages from a second Identus agent, sent paced; the
    history checker judges what it saw (tests/support/client_history.py, ClientHistory)."""
    async with aiohttp.ClientSession() as http, http.get(agents.url + "/v1/didcomm/v2/invitation") as resp:
        assert resp.status == 200, await resp.text()
        mediator_did = (await resp.json())["did"]
    mode = "live" if live else "poll"
    alice = IdentusAgent(agents.tools, agents.workdir, f"identus-alice-{mode}")
    bob = IdentusAgent(agents.tools, agents.workdir, f"identus-bob-{mode}")
    try:
        ready = await alice.start_agent(mediator_did, live=live, poll_ms=300)
        assert ready["mediation"] == "GRANTED", ready
        await bob.start_agent(None)
        alice_did = (await alice.command("new-did"))["did"]
        bob_did = (await bob.command("new-did"))["did"]
        record = ClientHistory(alice_did)
        contents = [f"fleet-identus-{mode}-{i:02d}" for i in range(count)]
        t0 = time.monotonic()
        for content in contents:
            reply = await bob.command(
                "send", timeout=60, **{"from": bob_did, "to": alice_did, "content": content}
            )
            record.sent(content, reply["t0Ms"], reply["t1Ms"])
        await alice.wait_contents(set(contents), timeout=120)
        await asyncio.sleep(1.0)  # a late repeat would show now
        got: list[str] = []
        for batch in alice.batches:
            batch_contents = [str(i["content"]) for i in batch["items"] if i.get("content") in set(contents)]
            if batch_contents:
                record.delivered(batch_contents, batch["atMs"])
                got += batch_contents
        verdict = record.check()
        print(verdict.render())
        figures = {
            "sent": len(contents),
            "received": len(set(got)),
            "duplicates": len(got) - len(set(got)),
            "in_order": got == contents,
            "verdict": verdict_summary(verdict),
            "seconds": round(time.monotonic() - t0, 1),
        }
        FIGURES[f"identus_{mode}"] = figures
        assert verdict.ok, verdict.render()
        assert got == contents
        assert not alice.http_failures(), alice.http_failures()
        return figures
    except BaseException:
        for agent in (alice, bob):
            print(f"===== {agent.name} ({agent.log_path}) =====\n{agent.log_tail()}")
        raise
    finally:
        await asyncio.gather(alice.stop(), bob.stop())


async def test_identus_round_trip_through_the_fleet_service_polling(agents: Agents) -> None:
    await _identus_round_trip(agents, live=False, count=10)


async def test_identus_round_trip_through_the_fleet_service_live(agents: Agents) -> None:
    await _identus_round_trip(agents, live=True, count=5)
