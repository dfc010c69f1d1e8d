"""The Python HTTP ceiling: aiohttp + uvloop with handlers that do no work.

Serves the relay's enqueue path so the same wrk scripts hit it unchanged: it reads the body
and answers a fixed 201. What a relay process can reach on this machine is bounded by these
numbers.

Run: python -m relayfleet_testing.bench.ceiling --port P
"""

from __future__ import annotations

import argparse
import sys

import uvloop
from aiohttp import web

_CREATED = b'{"seq":1,"duplicate":false}'


async def enqueue(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(status=201, body=_CREATED, content_type="application/json")


async def empty(request: web.Request) -> web.Response:
    return web.Response(body=b"ok")


def build_app() -> web.Application:
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v1/queues/{recipient}/messages", enqueue)
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
