"""The Python HTTP ceiling: aiohttp + uvloop with handlers that do no work.

Serves the relay's paths so the same load generator scripts hit it unchanged:
enqueue reads the body and answers a fixed 201, a long-poll GET parks on an
in-process future that the next enqueue to the same recipient resolves. What a
relay process can reach on this machine is bounded by these numbers.

Run: python -m relayfleet_testing.bench.ceiling --port P
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import uvloop
from aiohttp import web

_CREATED = b'{"seq":1,"duplicate":false}'
_EMPTY = b'{"messages":[],"nextSeq":1,"epoch":"0"}'
_WAITERS = web.AppKey("waiters", dict[str, "asyncio.Future[bytes]"])


async def enqueue(request: web.Request) -> web.Response:
    body = await request.read()
    fut = request.app[_WAITERS].pop(request.match_info["recipient"], None)
    if fut is not None and not fut.done():
        fut.set_result(body)
    return web.Response(status=201, body=_CREATED, content_type="application/json")


async def read(request: web.Request) -> web.Response:
    wait = float(request.query.get("wait", "0") or 0)
    if wait <= 0:
        return web.Response(body=_EMPTY, content_type="application/json")
    waiters = request.app[_WAITERS]
    key = request.match_info["recipient"]
    fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    waiters[key] = fut
    try:
        await asyncio.wait_for(fut, min(wait, 60.0))
    except TimeoutError:
        return web.Response(body=_EMPTY, content_type="application/json")
    finally:
        if waiters.get(key) is fut:
            del waiters[key]
    return web.Response(
        body=b'{"messages":[{"seq":1}],"nextSeq":2,"epoch":"0"}', content_type="application/json"
    )


async def empty(request: web.Request) -> web.Response:
    return web.Response(body=b"ok")


def build_app() -> web.Application:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app[_WAITERS] = {}
    app.router.add_post("/v1/queues/{recipient}/messages", enqueue)
    app.router.add_get("/v1/queues/{recipient}/messages", read)
    app.router.add_get("/empty", empty)
    app.router.add_get("/readyz", empty)
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m relayfleet_testing.bench.ceiling")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    web.run_app(
        build_app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        backlog=4096,
        loop=uvloop.new_event_loop(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
