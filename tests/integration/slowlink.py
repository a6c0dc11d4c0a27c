"""A slow link for tests and benchmarks: a relay in front of the loopback cluster's sshd that passes
each connection's bytes at a given rate each way, holds each chunk a given delay, and keeps a
router's buffer (128 kB each way), so TCP and SSH windows push back as on a real link. Not a real
slow link: no loss, no jitter, nobody else's traffic. It counts the bytes it carries.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

CHUNK = 16 << 10
BUFFER_CHUNKS = 8  # 128 kB each way


class Relay:
    """127.0.0.1:<port> -> 127.0.0.1:<target>, at ``rate`` bytes/s each way, each chunk held ``delay``
    seconds; ``carried`` counts the bytes it passed (both ways)."""

    def __init__(self, target: int, rate: float, delay: float) -> None:
        self.target, self.rate, self.delay = target, rate, delay
        self.carried = 0
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def close(self) -> None:
        """Stop serving: connections through it drop, its thread ends."""
        asyncio.run_coroutine_threadsafe(self._drop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _drop(self) -> None:
        self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        while self.writers:  # each pipe ends once its connection has dropped
            await asyncio.sleep(0.01)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers |= {client_w, server_w}
        try:
            await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))
        finally:
            for writer in (client_w, server_w):
                writer.transport.abort()
                self.writers.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(BUFFER_CHUNKS)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            try:
                while data := await reader.read(CHUNK):
                    await queue.put((loop.time(), data))
            except (ConnectionError, OSError):
                pass  # the other side dropped: end this way too
            await queue.put((loop.time(), b""))

        async def write() -> None:
            free_at = 0.0  # when the link has sent what it was given
            dropped = False  # the far side went: what still comes is read and dropped
            while True:
                arrived, data = await queue.get()
                if not data:
                    writer.close()
                    return
                if dropped:
                    continue
                free_at = max(loop.time(), free_at) + len(data) / self.rate
                await asyncio.sleep(max(0.0, max(arrived + self.delay, free_at) - loop.time()))
                try:
                    writer.write(data)
                    await writer.drain()
                except (ConnectionError, OSError):
                    dropped = True
                    continue
                self.carried += len(data)

        await asyncio.gather(read(), write())


def known_hosts_for(port: int, known_hosts: str, dest: Path) -> Path:
    """The cluster's host keys, listed for the relay's port too (OpenSSH and paramiko key them by
    [host]:port)."""
    lines = Path(known_hosts).read_text().splitlines()
    relay = [f"[127.0.0.1]:{port} " + line.split(" ", 1)[1] for line in lines if line.strip()]
    dest.write_text("\n".join(lines + relay) + "\n")
    return dest
