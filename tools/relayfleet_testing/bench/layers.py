"""Enqueue endpoints at several depths of the HTTP stack, each answering a fixed 201.

What each layer of the relay's HTTP machinery costs per request, measured with
``python -m relayfleet_testing.bench.cpu --layers`` (CPU µs per request, alternating rounds):

- ``protocol``: a bare asyncio Protocol on uvloop; finds the end of the headers,
  reads Content-Length bytes of body, writes a canned answer. The floor of Python.
- ``lowlevel``: aiohttp's low-level ``web.Server`` with one handler (HTTP parser,
  Request and Response objects, no application or router).
- ``app``: an aiohttp ``web.Application`` with a router (the ``aiohttp-1p`` ceiling).
- ``relay-http``: the relay's own HTTP stack around the same fixed answer: its
  request wrapper (``relay.app.observed``: JSON errors, request metrics, memory
  guard) on every route, served by ``relay.http.serving.make_runner`` (connection guard,
  keep-alive settings) — everything of an enqueue but the service and Redis.

Each answers GET (200, so readiness checks pass) and POST (201) on any path.

Run: python -m relayfleet_testing.bench.layers --layer NAME --port P
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import cast

import uvloop
from aiohttp import web

LAYERS = ("protocol", "lowlevel", "app", "relay-http")
_CREATED = b'{"seq":1,"duplicate":false}'
_MAX_HEAD = 64 * 1024


def _canned(status: str, body: bytes, content_type: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: ".encode() + content_type
    return head + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


_ANSWER_POST = _canned("201 Created", _CREATED, b"application/json")
_ANSWER_GET = _canned("200 OK", b"ok", b"text/plain")
_ANSWER_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class FixedAnswer(asyncio.Protocol):
    """HTTP/1.1 keep-alive with Content-Length bodies only (what wrk sends); anything else: 400, close."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.body_left = 0  # body bytes of the current request still to skip
        self.answer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:
            if self.body_left:
                take = min(self.body_left, len(self.buf))
                del self.buf[:take]
                self.body_left -= take
                if self.body_left:
                    return
                self.transport.write(self.answer)
                continue
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._refuse()
                return
            head = bytes(self.buf[:end]).lower()
            del self.buf[: end + 4]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name == b"content-length":
                    length = int(value) if value.strip().isdigit() else -1
                elif name == b"transfer-encoding":
                    length = -1
            if length < 0:
                self._refuse()
                return
            self.answer = _ANSWER_POST if head.startswith(b"post ") else _ANSWER_GET
            self.body_left = length
            if not length:
                self.transport.write(self.answer)

    def _refuse(self) -> None:
        assert self.transport is not None
        self.transport.write(_ANSWER_BAD)
        self.transport.close()
        self.transport = None


async def _fixed(request: web.BaseRequest) -> web.Response:
    if request.method == "POST":
        await request.read()
        return web.Response(status=201, body=_CREATED, content_type="application/json")
    return web.Response(body=b"ok")


def _relay_http_app() -> tuple[web.Application, Callable[[web.Application], web.AppRunner]]:
    # the relay's own pieces, imported only for this layer
    from relay.app import observed
    from relay.http.memguard import MemoryGuard, ceiling_bytes
    from relay.http.serving import make_runner
    from relay.settings import Settings

    settings = Settings()
    guard = MemoryGuard(ceiling_bytes(settings.max_rss_mb))
    app = web.Application(client_max_size=settings.max_payload * 2)
    app.router.add_post("/v1/queues/{recipient}/messages", observed(_fixed, guard))
    app.router.add_get("/readyz", observed(_fixed))
    return app, lambda a: make_runner(a, settings)


async def serve(layer: str, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cleanup: Callable[[], Awaitable[None]]
    if layer == "protocol":
        server = await loop.create_server(FixedAnswer, host, port, reuse_address=True, backlog=4096)

        async def close_protocol() -> None:
            server.close()
            await server.wait_closed()

        cleanup = close_protocol
    elif layer == "lowlevel":
        low = web.Server(_fixed, access_log=None)
        server = await loop.create_server(low, host, port, reuse_address=True, backlog=4096)

        async def close_lowlevel() -> None:
            server.close()
            await low.shutdown(1.0)

        cleanup = close_lowlevel
    else:
        if layer == "app":
            from relayfleet_testing.bench.ceiling import build_app

            runner: web.AppRunner = web.AppRunner(build_app(), access_log=None)
        else:
            app, make = _relay_http_app()
            runner = make(app)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_address=True, backlog=4096).start()
        cleanup = runner.cleanup
    await stop.wait()
    await cleanup()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relayfleet_testing.bench.layers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--layer", choices=LAYERS, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.layer, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
