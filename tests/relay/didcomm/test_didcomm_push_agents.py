"""Device push with stock agents: forwards from ACA-Py 1.7.0 to a wallet that is not picking
up make one notification at the webhook and at each local provider (FCM, APNs; the real ones
are out of reach here, tests/support/push_providers.py), with no payload; the device info set
and read by the stock client `@credo-ts/push-notifications` 0.7.1 (on Credo 0.5, Askar 0.3.2)
and in envelopes Askar packs (docs/protocols.md, "Device push").

The wallet whose queue fills is the PyNaCl test agent (connected, mediated, its devices set,
never picking up). ACA-Py is handed five OOB invitations naming the wallet's key behind
relayfleet's routing key and endpoint, as a mediated wallet publishes them, and accepts them at
once: its five DID Exchange requests reach relayfleet as five forwards to that key, a burst.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from relayfleet_testing.localredis import LocalRedis, free_port

from relay.devicepush.wiring import DEVICE_NOTIFIER
from relay.didcomm import keys as dk
from tests.support.didcomm_stock_agents import AcaPy, Toolchain, tail, toolchain
from tests.support.fleet_harness import spawn_relay, stop_relays, wait_ready
from tests.support.in_process_relay import RelayFactory
from tests.support.push_world import APNS_TOKEN, FCM_TOKEN, OpenPushWorld, phone
from tests.support.waiting import until

pytestmark = [pytest.mark.didcomm_agents, pytest.mark.timeout(420)]


@pytest.fixture
def tools() -> Toolchain:
    return toolchain()


def invitation(endpoint: str, key: bytes, routing_key: str) -> dict[str, Any]:
    """An OOB 1.1 invitation as a wallet mediated by relayfleet publishes it."""
    return {
        "@type": "https://didcomm.org/out-of-band/1.1/invitation",
        "@id": str(uuid.uuid4()),
        "label": "wallet",
        "handshake_protocols": ["https://didcomm.org/didexchange/1.1"],
        "services": [
            {
                "id": "#inline-0",
                "type": "did-communication",
                "recipientKeys": [dk.did_key(key)],
                "routingKeys": [routing_key],
                "serviceEndpoint": endpoint,
            }
        ],
    }


async def test_five_forwards_from_acapy_make_one_notification_per_provider(
    tools: Toolchain, open_push_world: OpenPushWorld, tmp_path: Path
) -> None:
    acapy = AcaPy(tools, tmp_path / "acapy", label="acapy-push")
    async with open_push_world() as world:
        fcm, apns, webhook = world.fcm, world.apns, world.webhook
        try:
            await acapy.start()
            agent, key = await phone(world)
            endpoint = world.relay.base_url + "/v1/didcomm"
            invitations = [invitation(endpoint, key, agent.grant["routing_keys"][0]) for _ in range(5)]
            t0 = time.monotonic()
            await asyncio.gather(
                *(
                    acapy.call("POST", "/out-of-band/receive-invitation?auto_accept=true", inv)
                    for inv in invitations
                )
            )

            async def stored() -> int:
                st = await agent.send(
                    {"@type": "https://didcomm.org/messagepickup/2.0/status-request", "@id": "s"}
                )
                return int((st or {}).get("message_count", 0))

            # the five requests are queued for the wallet, which is not picking up
            await until("five", lambda: _equals(stored, 5), timeout=60)
            await fcm.wait_for(1, timeout=30)
            await apns.wait_for(1, timeout=30)
            await until("the webhook's call", lambda: len(webhook.calls) >= 1, timeout=30)
            first_s = time.monotonic() - t0
            notifier = world.relay.app[DEVICE_NOTIFIER]
            await until("no burst pending", lambda: notifier.pending() == 0)
            await asyncio.sleep(1.5)  # anything still to come would come within the window
            assert (len(webhook.calls), len(fcm.notifications), len(apns.notifications)) == (1, 1, 1)
            counts = {
                "webhook": webhook.calls[0]["count"],
                "fcm": int(fcm.notifications[0]["message"]["data"]["message_count"]),
                "apns": apns.notifications[0]["payload"]["message_count"],
            }
            # each says how many the burst held (the five, or those within RELAY_PUSH_COALESCE_S
            # of the first: the rest fall in the connection's minimum interval)
            assert len(set(counts.values())) == 1
            assert 1 <= counts["fcm"] <= 5
            assert fcm.notifications[0]["token"] == FCM_TOKEN
            assert apns.notifications[0]["token"] == APNS_TOKEN
            # no payload: nothing of the packed requests, the invitations or ACA-Py reaches a provider
            bodies = [webhook.raw[0], fcm.notifications[0]["raw"], apns.notifications[0]["raw"]]
            for inv in invitations:
                assert all(inv["@id"].encode() not in raw for raw in bodies)
            for raw in bodies:
                assert b"ciphertext" not in raw
                assert b"acapy" not in raw.lower()
                assert dk.b58encode(key).encode() not in raw
            print(f"device push figures: {json.dumps({'first_notification_s': round(first_s, 2), **counts})}")
        finally:
            acapy.stop()


async def _equals(check: Any, n: int) -> bool:
    return bool(await check() == n)


ASKAR_CLIENT = Path(__file__).resolve().parents[3] / "e2e" / "didcomm" / "askar-push" / "client.py"


async def test_askar_packed_set_get_round_trip(
    tools: Toolchain,
    redis_server: LocalRedis,
    relay_factory: RelayFactory,
    seed_file: str,
    http: aiohttp.ClientSession,
) -> None:
    """The push protocol in envelopes Askar packs and opens (e2e/didcomm/askar-push/client.py,
    aries-askar 0.5.0 under ACA-Py 1.7.0's venv, packing with ACA-Py's own v1 packer), on a
    connection the test agent made from the same seed."""
    from tests.support.didcomm_test_agent import Agent

    relay = await relay_factory(
        redis_server.url, didcomm_seed_file=seed_file, public_url="https://relay.example.test"
    )
    seed = os.urandom(32)
    agent = Agent(relay.base_url, http)
    agent.kp = dk.KeyPair.from_seed(seed)
    agent.did = dk.peer2_did(agent.kp, ["didcomm:transport/queue"])
    await agent.connect()
    assert agent.mediator_key is not None
    python = str(Path(tools.acapy_bin).parent / "python")
    argv = [python, str(ASKAR_CLIENT), "--seed", seed.hex(), "--mediator", dk.b58encode(agent.mediator_key)]
    argv += ["--url", relay.base_url + "/v1/didcomm", "--fcm-token", FCM_TOKEN, "--apns-token", APNS_TOKEN]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-4000:]
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert lines[-1] == {"done": True}
    steps = [(line["step"], line["sent"], line["reply"]) for line in lines[:-1]]
    fcm, apns = (
        "https://didcomm.org/push-notifications-fcm/1.0/",
        "https://didcomm.org/push-notifications-apns/1.0/",
    )
    ack = "https://didcomm.org/notification/1.0/ack"
    (
        (_, g0, before),
        (_, s1, ack1),
        (_, g1, info),
        (_, _, ack2),
        (_, g2, ainfo),
        (_, _, ack3),
        (_, _, after),
    ) = steps
    assert before["@type"] == fcm + "problem-report"
    assert before["description"]["code"] == "not-registered-for-push-notifications"
    assert before["~thread"] == {"thid": g0}
    assert (ack1["@type"], ack1["status"], ack1["~thread"]) == (ack, "OK", {"thid": s1})
    assert info["@type"] == fcm + "device-info"
    assert (info["device_token"], info["device_platform"], info["~thread"]) == (
        FCM_TOKEN,
        "android",
        {"thid": g1},
    )
    assert ack2["@type"] == ack
    assert (ainfo["@type"], ainfo["device_token"], ainfo["~thread"]) == (
        apns + "device-info",
        APNS_TOKEN,
        {"thid": g2},
    )
    assert ack3["@type"] == ack
    assert after["description"]["code"] == "not-registered-for-push-notifications"
    print(f"askar round trip: {[s for s, _, _ in steps]}")


CREDO_PUSH = Path(__file__).resolve().parents[3] / "e2e" / "didcomm" / "credo-push"


@pytest.mark.credo_push
async def test_stock_credo_push_notifications_client_round_trip(
    tools: Toolchain, redis_server: LocalRedis, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The stock client, @credo-ts/push-notifications 0.7.1 on Credo 0.5.13 with Askar 0.3.2
    (e2e/didcomm/credo-push/agent.mjs, hack/didcomm-toolchain.sh credo-push): it connects to
    the mediator through its invitation and sets and reads its device info through the
    module's own API."""
    assert tools.credo_push_dir is not None
    seed_file = tmp_path / "didcomm-seed"
    seed_file.write_text(os.urandom(32).hex())
    port = free_port()
    env = {"RELAY_DIDCOMM_SEED_FILE": str(seed_file), "RELAY_PUBLIC_URL": f"http://127.0.0.1:{port}"}
    relay = spawn_relay(["--redis-url", redis_server.url], tmp_path, env, port)
    run_dir = tmp_path / "credo-push"
    run_dir.mkdir()
    for name in ("agent.mjs", "package.json"):
        shutil.copy(CREDO_PUSH / name, run_dir / name)
    (run_dir / "node_modules").symlink_to(tools.credo_push_dir / "node_modules")
    log_path = tmp_path / "credo-push.log"
    try:
        await asyncio.to_thread(wait_ready, relay)
        async with http.get(relay.url + "/v1/didcomm/invitation") as resp:
            url = (await resp.json())["invitation_url"]
        argv = ["node", str(run_dir / "agent.mjs"), "--data", str(tmp_path), "--url", url]
        argv += ["--fcm-token", FCM_TOKEN, "--apns-token", APNS_TOKEN, "--log-level", "debug"]
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env={**os.environ, "LIB_ARIES_ASKAR_PATH": tools.askar_legacy_lib_dir},
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 120)
        lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        assert (proc.returncode, lines[-1:]) == (0, [{"done": True}]), (lines, tail(log_path))
    finally:
        stop_relays([relay])
    steps = {line["step"]: line for line in lines[:-1]}
    assert list(steps) == [
        "connected",
        "fcm-get-before",
        "fcm-set",
        "fcm-get",
        "apns-set",
        "apns-get",
        "fcm-unset",
        "fcm-get-after",
    ]
    fcm = "https://didcomm.org/push-notifications-fcm/1.0/"
    apns = "https://didcomm.org/push-notifications-apns/1.0/"
    ack = "https://didcomm.org/notification/1.0/ack"
    for name, line in steps.items():
        if name != "connected":  # each answer is in the thread of what the module sent
            assert line["body"]["~thread"]["thid"] == line["sent"], line
    before, after = steps["fcm-get-before"]["body"], steps["fcm-get-after"]["body"]
    for report in (before, after):
        assert report["@type"] == fcm + "problem-report"
        assert report["description"]["code"] == "not-registered-for-push-notifications"
    for name in ("fcm-set", "apns-set", "fcm-unset"):
        assert (steps[name]["type"], steps[name]["body"]["status"]) == (ack, "OK")
    info = steps["fcm-get"]["body"]
    assert (info["@type"], info["device_token"], info["device_platform"]) == (
        fcm + "device-info",
        FCM_TOKEN,
        "android",
    )
    ainfo = steps["apns-get"]["body"]
    assert (ainfo["@type"], ainfo["device_token"]) == (apns + "device-info", APNS_TOKEN)
