"""A local port that reaches a port on the cluster, through the SSH connection (`rv forward`).

Each TCP connection accepted on the local port becomes one ``direct-tcpip`` channel of the one SSH
connection (rv.remote.ssh.SSHTransport.open_tunnel, what ``ssh -L`` does): the login node connects to the
job's node and the bytes flow both ways until either side closes. Nothing runs on the cluster for
it and nothing logs in again. The local port is bound on 127.0.0.1 only: never reachable from
another machine.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from rv.errors import ConnectError, RvError, UsageError

_CHUNK = 1 << 16


def parse_ports(spec: str) -> tuple[int, int]:
    """``PORT[:LOCALPORT]`` -> (port on the node, local port). LOCALPORT defaults to PORT; 0 means
    any free port (the URL printed says which)."""
    remote, sep, local = spec.partition(":")
    try:
        port = int(remote)
        local_port = int(local) if sep else port
    except ValueError:
        raise UsageError(
            f"{spec!r} is not PORT or PORT:LOCALPORT", hint="e.g. rv forward 8888, or rv forward 6006:16006"
        ) from None
    if not 1 <= port <= 65535 or not 0 <= local_port <= 65535:
        raise UsageError(f"{spec!r}: ports are 1-65535 (LOCALPORT 0: any free port)")
    return port, local_port


def bind_local(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:``port``; a clear error when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if os.name == "posix":
        # The port of a forward just stopped stays in TIME_WAIT for a minute: binding it again at once
        # (rv forward or rv jupyter run again, for the same URL) must work. (Not on Windows, where the
        # option lets a second listener take a port in use.)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(16)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            why = "is already in use here" if exc.errno == errno.EADDRINUSE else "needs privileges here"
            raise UsageError(
                f"local port {port} {why}",
                hint="pick another local port: rv forward PORT:LOCALPORT (LOCALPORT 0: any free port)",
            ) from exc
        raise
    return sock


class Forwarder:
    """Accept on ``listener``; join each connection to a channel from ``open_channel``."""

    def __init__(
        self,
        listener: socket.socket,
        open_channel: Callable[[], Any],
        on_error: Callable[[str], None],
    ) -> None:
        self.listener = listener
        self.open_channel = open_channel
        self.on_error = on_error
        self.connections = 0
        self._stop = threading.Event()
        self._failure: list[BaseException] = []
        self._lock = threading.Lock()
        self._open: set[Any] = set()

    def serve(self, still_wanted: Callable[[], bool] | None = None, every: float = 15.0) -> None:
        """Until Ctrl-C (KeyboardInterrupt), a lost connection (raised) or ``still_wanted()`` turning
        False (asked every ``every`` s: the job ended)."""
        self.listener.settimeout(0.5)
        next_check = time.monotonic() + every
        try:
            while not self._stop.is_set():
                if self._failure:
                    raise self._failure[0]
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    conn = None
                except OSError:
                    if self._stop.is_set():
                        break  # close() from another thread closed the listener under us
                    raise
                if conn is not None:
                    self.connections += 1
                    threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()
                if still_wanted is not None and time.monotonic() >= next_check:
                    if not still_wanted():
                        return
                    next_check = time.monotonic() + every
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        with self._lock:
            open_now = list(self._open)
        for item in open_now:
            with contextlib.suppress(OSError):  # closing what may be closed already
                item.close()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            channel = self.open_channel()
        except RvError as exc:
            conn.close()
            if isinstance(exc, ConnectError):
                self._failure.append(exc)  # the SSH connection is gone: nothing more will work
            else:
                self.on_error(exc.message)  # this connection only: the next may work
            return
        with self._lock:
            self._open.update((conn, channel))
        try:
            _pipe(conn, channel)
        finally:
            with self._lock:
                self._open.difference_update((conn, channel))
            conn.close()
            channel.close()


def _pipe(conn: socket.socket, channel: Any) -> None:
    """Copy both ways until both have ended; an end on one side is passed on as a half-close."""
    local_open, remote_open = True, True
    while local_open or remote_open:
        watch = ([conn] if local_open else []) + ([channel] if remote_open else [])
        try:
            ready, _, _ = select.select(watch, [], [], 1.0)
        except (OSError, ValueError):
            return  # closed under us (rv is stopping)
        if conn in ready:
            try:
                data = conn.recv(_CHUNK)
            except OSError:
                data = b""
            if data:
                try:
                    channel.sendall(data)
                except OSError:
                    return  # the channel closed (the job's program went away)
            else:
                local_open = False
                channel.shutdown_write()
        if channel in ready:
            data = channel.recv(_CHUNK)
            if data:
                try:
                    conn.sendall(data)
                except OSError:
                    return  # the local client went away
            else:
                remote_open = False
                with contextlib.suppress(OSError):  # the local client may have closed already
                    conn.shutdown(socket.SHUT_WR)
        if channel.closed and not channel.recv_ready():
            return
