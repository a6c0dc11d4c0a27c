"""The warm connection's background process: one per profile, holding an SSH connection for the
profile's rv commands (rv.remote.warm is the client every command uses; rv.remote.warmwire, what
travels between them).

Started by the client (a fresh ``python -I`` running main(), or forked from the command server:
rv.remote.warm._spawn), it detaches from the terminal and the caller's files, listens on the
profile's socket (0600, in the private runtime folder, the peer's uid checked), connects at once,
and serves each command on a channel of its own until ``RV_WARM_SECONDS`` pass without one or the
connection dies; then it removes its socket and pid file and exits. A request of another identity
(profile, SSH config, rv's code) or a host key no longer in known_hosts makes it stop ("stale"):
the command starts a fresh one. It closes a command's channel the moment the rv command that asked
goes away. It never reads local files for a command: put and get stream through the socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv import runtime as rv_runtime
from rv.errors import RvError
from rv.remote.transport import Cancelled, TransferError
from rv.remote.warmwire import (
    PROTOCOL,
    SocketFrameReader,
    error_json,
    send_frame,
    send_json,
    target_from_json,
)

if TYPE_CHECKING:
    from rv.remote.ssh import SSHTransport


def daemon_entry(spec: dict[str, Any], lock_fd: int, ready_w: int) -> int:
    """Detach from the terminal and the caller's files, then serve. Returns the exit code."""
    with contextlib.suppress(OSError):  # already a session leader (started with start_new_session)
        os.setsid()
    os.chdir("/")
    log_fd = rv_runtime.open_log(spec["log"])
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    keep = sorted({0, 1, 2, lock_fd, ready_w})
    # Every other inherited descriptor is closed: a pipe the caller's caller reads (a test harness,
    # `rv ps | less`) must see EOF when the rv command exits, not minutes later.
    low = 3
    for fd in keep:
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, _max_fd())
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's own stdio, for its lifetime)
    sys.stdout = sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    server = Server(spec, lock_fd)
    try:
        server.listen()
        with contextlib.suppress(BrokenPipeError):  # a starter that did not wait (prewarm)
            os.write(ready_w, b"R")
        os.close(ready_w)
        server.serve()
        return 0
    except SystemExit:
        return 0
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        server.shutdown()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # unwinds through serve(): the socket is removed, the connection closed


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 1024


_HUP = getattr(select, "POLLHUP", 0) | getattr(select, "POLLERR", 0) | getattr(select, "POLLRDHUP", 0)


def _gone(conn: socket.socket) -> bool:
    """Has the rv command at the other end closed its socket (exited, Ctrl-C, SIGKILL)?"""
    poller = select.poll()
    poller.register(conn, _HUP)
    return bool(poller.poll(0))


class _ClientGone(Exception):
    pass


class Server:
    def __init__(self, spec: dict[str, Any], lock_fd: int | None = None) -> None:
        self.lock_fd = lock_fd
        self.path = spec["path"]
        self.pid_path = spec["path"][: -len(".sock")] + ".pid"
        self.target = target_from_json(spec["target"])
        self.ident = spec["ident"]
        self.mask = int(spec["mask"])
        self.idle = float(spec["idle"])
        self.ssh: SSHTransport | None = None
        self.connect_error: dict[str, Any] | None = None
        # The early connection's failure and when it ended: told to the requests that were already
        # waiting for it (see ensure_connected), never to later ones.
        self.early_error: tuple[float, dict[str, Any]] | None = None
        self.connect_lock = threading.Lock()
        self.state = threading.Lock()
        self.active = 0
        self.last = time.monotonic()
        self.stopping = threading.Event()
        self.listener: socket.socket | None = None
        self.ino: int | None = None

    @property
    def connection(self) -> SSHTransport:
        """The SSH connection, once ensure_connected has made it."""
        assert self.ssh is not None, "only once connected"
        return self.ssh

    def log(self, message: str) -> None:
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {message}\n")

    def listen(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        self.listener = sock
        self.ino = os.stat(self.path).st_ino
        rv_runtime.write_pid(self.pid_path)
        self.log(f"listening on {self.path} for {self.target.where}, idle exit after {self.idle:g}s")

    def serve(self) -> None:
        threading.Thread(target=self.connect_early, daemon=True).start()
        while not self.stopping.is_set():
            listener = self.listener
            if listener is None:
                break
            try:
                ready, _, _ = select.select([listener], [], [], 0.5)
                conn = listener.accept()[0] if ready else None
            except (OSError, ValueError):
                if self.stopping.is_set():
                    break  # stop() closed the listener under us
                raise
            if conn is not None:
                with self.state:
                    self.active += 1
                threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
                continue
            with self.state:
                idle = self.active == 0 and time.monotonic() - self.last > self.idle
                dead = self.active == 0 and self.ssh is not None and not self.connection.is_alive()
            if idle or dead:
                self.log("idle, exiting" if idle else "connection lost, exiting")
                break
        self._close_listener()
        # Let commands in flight (other rv processes') finish before the connection goes.
        while True:
            with self.state:
                if self.active == 0:
                    break
            time.sleep(0.05)

    def stop(self, why: str) -> None:
        if not self.stopping.is_set():
            self.log(f"stopping: {why}")
        self.stopping.set()
        self._close_listener()

    def _close_listener(self) -> None:
        with self.state:
            if self.listener is not None:
                with contextlib.suppress(OSError):
                    if os.stat(self.path).st_ino == self.ino:
                        os.unlink(self.path)
                self.listener.close()
                self.listener = None
            # Releasing the lock lets a new process start for this profile while commands in
            # flight here (a long `rv logs -f`) finish on this one.
            if self.lock_fd is not None:
                os.close(self.lock_fd)
                self.lock_fd = None

    def shutdown(self) -> None:
        self._close_listener()
        with contextlib.suppress(OSError, ValueError):
            if int(Path(self.pid_path).read_text()) == os.getpid():
                os.unlink(self.pid_path)
        if self.ssh is not None:
            self.ssh.close()

    # -- one rv command --------------------------------------------------------------------------------
    def handle(self, conn: socket.socket) -> None:
        try:
            uid = rv_runtime.peer_uid(conn)
            if uid is not None and uid != os.getuid():
                self.log(f"refused a connection from uid {uid}")
                return
            reader = SocketFrameReader(conn)
            conn.settimeout(30)
            frame = reader.read()
            conn.settimeout(None)
            if frame is None or frame[0] != b"H":
                return
            header = json.loads(frame[1])
            send_frame(conn, b"h")  # alive: the command now waits as long as connecting takes
            if self.stopping.is_set():
                send_frame(conn, b"S")
                return
            if header.get("v") != PROTOCOL or header.get("ident") != self.ident:
                send_frame(conn, b"S")
                self.stop("a request for another connection identity (profile or SSH config changed)")
                return
            reused = self.ensure_connected(conn, reader)
            if reused is None:
                return
            if reused and not self._healthy():
                send_json(conn, b"E", {"message": "the warm connection stopped answering", "retry": True})
                self.stop("the connection stopped answering")
                return
            if not self.connection.host_keys_still_trusted():
                send_frame(conn, b"S")
                self.stop("the host key is no longer in known_hosts")
                return
            started = {"pid": os.getpid(), "reused": reused}
            op = header["op"]
            if op == "exec":
                # "O" only once the command runs: a channel that cannot open is still retryable.
                self.op_exec(conn, reader, header, lambda: send_json(conn, b"O", started))
                return
            send_json(conn, b"O", started)
            if op == "put":
                self.op_put(conn, reader, header)
            elif op == "get":
                self.op_get(conn, header)
        except (_ClientGone, BrokenPipeError, ConnectionResetError) as exc:
            self.log(f"the rv command went away ({type(exc).__name__}); its channel was closed")
        except Exception:
            import traceback

            self.log("error while serving a command:\n" + traceback.format_exc())
        finally:
            conn.close()
            with self.state:
                self.active -= 1
                self.last = time.monotonic()

    def connect_early(self) -> None:
        """Connect at once, before the first request: the handshake overlaps the rv command's start.

        Nobody can be asked about an unknown host key yet: then the first request connects again,
        relaying the question. Any other failure is kept and told to the first request.
        """
        from rv.remote.ssh import SSHTransport, UnknownHostKey

        with self.connect_lock:
            if self.ssh is not None or self.connect_error is not None:
                return
            transport = SSHTransport(self.target, None, mask=self.mask)
            try:
                transport.connect()
            except UnknownHostKey as exc:
                self.log(f"not connecting early: {exc.message}; the first command will be asked")
                return
            except RvError as exc:
                # Kept only for the requests waiting on it now (a served command waits for the
                # connection it forked): trying again for them would double the wait on an
                # unreachable host. A later request tries again: the failure may have passed.
                self.log(f"could not connect early: {exc.message}")
                self.early_error = (time.monotonic(), error_json(exc, retry=False))
                return
            self._connected(transport)

    def _connected(self, transport: SSHTransport) -> None:
        self.ssh = transport
        transport.prestart(**self.ident["channels"])
        self.log(f"connected to {self.target.where}")

    def ensure_connected(self, conn: socket.socket, reader: SocketFrameReader) -> bool | None:
        """Connect once (relaying a host key question to this client). True: it was already open."""
        asked = time.monotonic()
        with self.connect_lock:
            if self.ssh is None and self.early_error is not None and asked < self.early_error[0]:
                self.connect_error = self.early_error[1]  # the attempt this request waited for failed
            if self.connect_error is not None:
                send_json(conn, b"E", self.connect_error)
                self.stop(f"could not connect: {self.connect_error.get('message')}")
                return None
            if self.ssh is not None:
                return True

            def confirm(host: str, key_type: str, fp: str) -> bool:
                send_json(conn, b"K", {"host": host, "key_type": key_type, "fingerprint": fp})
                answer = reader.read()
                return answer is not None and answer[0] == b"k" and bool(json.loads(answer[1]).get("accept"))

            from rv.remote.ssh import SSHTransport

            transport = SSHTransport(self.target, confirm, mask=self.mask)
            try:
                transport.connect()
            except RvError as exc:
                # The same request made directly would fail the same way: say so, and exit.
                self.connect_error = error_json(exc, retry=False)
                send_json(conn, b"E", self.connect_error)
                self.stop(f"could not connect: {exc.message}")
                return None
            self._connected(transport)
            return False

    def _healthy(self) -> bool:
        """After a quiet spell, ask the server for a reply before trusting the connection again.

        A laptop that slept leaves a TCP connection that looks open and answers nothing; without
        this the next command would wait for the channel-open timeout before falling back.
        """
        with self.state:
            quiet = time.monotonic() - self.last
        if quiet < 30:
            return bool(self.connection.is_alive())
        transport = self.connection.client.get_transport()
        answered = threading.Event()

        def ask() -> None:
            with contextlib.suppress(Exception):  # any failure simply means "no answer"
                transport.global_request("keepalive@openssh.com", wait=True)
                answered.set()

        threading.Thread(target=ask, daemon=True).start()
        return answered.wait(min(5.0, self.target.connect_timeout)) and bool(self.connection.is_alive())

    def _stdin_frames(self, reader: SocketFrameReader) -> Iterator[bytes]:
        while True:
            frame = reader.read()
            if frame is None:
                raise _ClientGone()
            kind, payload = frame
            if kind == b"D":
                yield payload
            elif kind == b"e":
                return
            else:
                raise _ClientGone()

    def op_exec(
        self,
        conn: socket.socket,
        reader: SocketFrameReader,
        header: dict[str, Any],
        on_started: Callable[[], None],
    ) -> None:
        from rv.remote.ssh import ChannelOpenError

        try:
            code = self.connection.stream(
                header["command"],
                on_stdout=lambda d: send_frame(conn, b"1", d),
                on_stderr=lambda d: send_frame(conn, b"2", d),
                stdin=self._stdin_frames(reader) if header.get("stdin") else None,
                keep_stdin_open=bool(header.get("keep_stdin_open")),
                cancelled=lambda: _gone(conn),
                on_started=on_started,
                agent=header.get("agent"),
            )
        except Cancelled as exc:
            raise _ClientGone() from exc
        except TransferError as exc:
            if isinstance(exc.__cause__, _ClientGone):
                raise exc.__cause__ from None
            send_json(conn, b"E", error_json(exc, retry=False))
            return
        except ChannelOpenError as exc:
            # Nothing ran: the rv command may send it over a fresh connection.
            send_json(conn, b"E", error_json(exc, retry=True))
            self.stop(f"could not open a channel: {exc.message}")
            return
        except RvError as exc:
            send_json(conn, b"E", error_json(exc, retry=False))
            return
        send_frame(conn, b"X", str(code).encode())

    def op_put(self, conn: socket.socket, reader: SocketFrameReader, header: dict[str, Any]) -> None:
        try:
            self.connection.put_stream(self._stdin_frames(reader), header["remote"], int(header["mode"]))
        except RvError as exc:
            send_json(conn, b"E", error_json(exc, retry=False))
            return
        send_json(conn, b"F", {})

    def op_get(self, conn: socket.socket, header: dict[str, Any]) -> None:
        try:
            self.connection.get_stream(header["remote"], lambda d: send_frame(conn, b"1", d))
        except RvError as exc:
            send_json(conn, b"E", error_json(exc, retry=False))
            return
        send_json(conn, b"F", {})


def main(spec: dict[str, Any], lock_fd: int, ready_w: int) -> int:
    """The background process's entry (see rv.remote.warm._BOOT: it reads the spec from stdin)."""
    return daemon_entry(spec, lock_fd, ready_w)
