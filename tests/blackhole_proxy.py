"""A network that black-holes a replica: a TCP proxy in front of it that forwards bytes both ways until `blackhole()`
is called; from then on it still accepts connections and reads what clients send, but forwards nothing and answers
nothing (connections already open go silent too), as a dropped link or a firewall that drops packets does: no
refusal, no reset, no reply. `restore()` forwards again for new connections. An asyncio loop in a thread of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class BlackholeProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.holed = False
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blackhole-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def blackhole(self) -> None:
        self.holed = True

    def restore(self) -> None:
        self.holed = False

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.holed:  # accepted, read and dropped: never forwarded, never answered
            await self._swallow(reader)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if self.holed:  # the link went dark mid-connection: drop everything from now on
                await self._swallow(reader)
                return
            writer.write(data)
            await writer.drain()

    @staticmethod
    async def _swallow(reader: asyncio.StreamReader) -> None:
        while await reader.read(65536):
            pass
        await asyncio.Event().wait()  # the peer closed its side: stay silent (never close ours)


@contextmanager
def blackhole_proxy(target_host: str, target_port: int) -> Iterator[BlackholeProxy]:
    proxy = BlackholeProxy(target_host, target_port)
    try:
        yield proxy
    finally:
        proxy.close()
