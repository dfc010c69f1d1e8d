"""A loopback TCP proxy a test controls, to cut and restore one network link.

It runs its own event loop on a thread, so cutting the link does not depend on the
test's loop being free. Two ways to cut:

- ``cut("reset")``: every open connection is closed and new ones are refused at once
  (what a crashed peer or a firewall REJECT looks like);
- ``cut("blackhole")``: connections stay open but nothing is forwarded, and new ones
  are accepted and then starved (a partition or a firewall DROP: the harder case,
  since only timeouts notice it).

A third way holds only one direction: ``cut("mute")`` forwards requests but keeps the
answers (the server did the work; the client never hears of it), the case a reply
timeout must handle. ``restore()`` then delivers the held answers on connections the
client still has open.

``restore()`` forwards again; connections starved during a blackhole are closed so
the client reconnects rather than reading a torn stream.

Given more than one target port, it hands each new connection to the next one in turn (what
a Kubernetes Service's proxy does): two relays behind one public URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

_STOP_S = 30.0  # a loaded CI box may be slow to run the proxy's thread; never leave it running


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", also: tuple[int, ...] = ()) -> None:
        self.target = (target_host, target_port)
        self.targets = [self.target, *((target_host, p) for p in also)]
        self.mode = "up"  # 'up' | 'reset' | 'blackhole' | 'mute'
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        """Every connection closed and every handler ended on the proxy's loop, then the loop
        stopped, joined and closed: nothing of the proxy is left for a later test's garbage
        collection to warn about (pytest turns that ResourceWarning into a failure)."""
        try:
            self._call(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_STOP_S)
            if self._thread.is_alive():
                raise RuntimeError(f"the proxy's loop did not stop within {_STOP_S} s")
            self._loop.close()

    def cut(self, how: str = "reset") -> None:
        assert how in ("reset", "blackhole", "mute"), how
        self._call(self._set(how))

    def restore(self) -> None:
        self._call(self._set("up"))

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(_STOP_S)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._answering = asyncio.Event()  # server -> client only; cleared by 'mute'
        self._answering.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_all()
        # the handlers end on their own once their streams are aborted; cancelling covers
        # one still connecting upstream, and awaiting them means no pump outlives the proxy
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        self._close_all()

    def _close_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _set(self, mode: str) -> None:
        previous, self.mode = self.mode, mode
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "mute":
            self._answering.clear()
        else:
            self._answering.set()
        if mode == "reset" or (mode == "up" and previous == "blackhole"):
            self._close_all()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            # cancelled only by _stop; ending normally keeps asyncio's done-callback of a
            # server handler from logging the cancellation as an error
            with contextlib.suppress(asyncio.CancelledError):
                await self._forward(reader, writer)
        finally:
            self._handlers.discard(task)
            writer.transport.abort()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            return
        self._writers.add(writer)
        target = self.targets[self.connections % len(self.targets)]
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            self._writers.discard(writer)
            return
        try:
            self._writers.add(up_writer)
            await asyncio.gather(
                self._pump(reader, up_writer), self._pump(up_reader, writer, self._answering)
            )
        finally:
            up_writer.transport.abort()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event | None = None
    ) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # a blackhole holds the bytes: nothing gets through
                if gate is not None:
                    await gate.wait()  # muted: answers wait
                if dst not in self._writers:
                    break
                dst.write(data)
                await dst.drain()
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(dst)
            dst.transport.abort()


@contextlib.contextmanager
def tcp_proxy(target_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_port).start()
    try:
        yield proxy
    finally:
        proxy.stop()
