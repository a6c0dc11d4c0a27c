"""Warm connections: one background process per profile keeps the SSH connection open for a while.

The first rv command of a profile starts the process (a fresh ``python -I -S``, see _spawn);
later commands, within ``RV_WARM_SECONDS`` (default 300) of the last one, reach it through a Unix
socket and pay neither the SSH handshake nor paramiko's import. Why our own process rather than
OpenSSH's ControlMaster: it works the same on every machine (no ``ssh`` binary, user config or
``ControlPath`` needed), host keys and errors keep one implementation (paramiko's, with the
prompts and exit codes rv documents), and it needs nothing from the user's ``~/.ssh/config``.

Rules it keeps:

* **Private.** The socket lives in a folder only the user can enter (``$XDG_RUNTIME_DIR/rv``, else
  ``/tmp/rv-<uid>``, checked to be ours and mode 0700); the socket itself is 0600 and the peer's uid
  is checked on every connection.
* **One connection per profile, never shared.** The socket is named after the config file and the
  profile; every request carries the full connection identity (each hop's user, host, port, keys
  and their files' stat, known_hosts, the mask, rv's version). A request that differs makes the
  process exit ("stale") and the command starts a fresh one. So does a host key that is no longer
  in known_hosts.
* **Never a hang.** Anything that goes wrong before the command starts (no process, a stale or
  dying one, a dropped connection) sends the command to a new process or a direct connection;
  nothing is ever run twice. Starting waits at most a few seconds.
* **Remote commands end with the rv command.** Each command is its own SSH channel; the process
  closes it the moment the rv process that asked goes away (Ctrl-C, SIGKILL: its socket closes),
  exactly as the channel closed with a direct connection.
* **Idle exit.** After ``RV_WARM_SECONDS`` without a request, or when the connection dies, the
  process closes the connection, removes its socket and exits. ``RV_WARM_SECONDS=0`` switches the
  whole mechanism off.

Wire format between an rv command and the process: frames of ``kind:1 length:4 payload``. The
command sends ``H`` (a JSON header), then ``D`` (stdin data) frames and ``e`` (end of stdin); the
process answers ``K`` (an unknown host key to confirm, answered by ``k``), then ``O`` (started) or
``S`` (stale) or ``E`` (error), then ``1``/``2`` (stdout/stderr), and ``X`` (exit code) or ``F``
(done). The process never reads local files for a command: put and get stream through the socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv import __version__, errors
from rv import runtime as rv_runtime
from rv.errors import ConnectError, RemoteError, RvError
from rv.remote.sshconfig import SSHTarget

if TYPE_CHECKING:
    from rv.remote.ssh import SSHTransport

from rv.remote.transport import (
    PRIVATE_MASK,
    RemoteTimeout,
    RunResult,
    Stdin,
    TransferError,
    _chunks,
    _Collecting,
    local_file_mode,
    read_chunks,
    write_local_atomically,
)

PROTOCOL = 1
_START_WAIT_S = 10.0  # a new process is listening within milliseconds; this bounds a broken start
_ACK_S = 5.0  # a live process acknowledges a request at once
_HEADER = struct.Struct(">cI")


class WarmUnavailable(Exception):
    """The background process cannot take this command; nothing ran. The caller connects directly."""


class _Cold(Exception):
    """No warm connection yet (this command starts one for the next): connect directly now."""


# Keys of the background processes this rv process started: they are still starting up.
_started_here: set[str] = set()


class _Retry(Exception):
    """The process is going away (stale, idle exit): start a fresh one and ask again. Nothing ran."""


# --------------------------------------------------------------------------------------------------
# Where the sockets live


def runtime_dir() -> Path:
    """A folder only this user can enter (rv.runtime); WarmUnavailable when it is not private."""
    try:
        return Path(rv_runtime.runtime_dir())
    except rv_runtime.NotPrivate as exc:
        raise WarmUnavailable(str(exc)) from None


def _key(profile_key: str) -> str:
    return hashlib.sha256(profile_key.encode("utf-8", "surrogateescape")).hexdigest()[:20]


def profile_key(config_path: Path | str | None, profile_name: str) -> str:
    """What names a profile's background connection: its config file and its name."""
    return f"{config_path or ''}\0{profile_name}"


def socket_key(config_path: Path | str | None, profile_name: str) -> str:
    """The file name (without suffix) of the profile's socket, pid and log files in runtime_dir()."""
    return _key(profile_key(config_path, profile_name))


def _stat_sig(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def _code_stamp() -> list[Any]:
    here = Path(__file__).parent
    modules = ("warm.py", "ssh.py", "sshconfig.py", "transport.py")
    return [sys.executable, *(_stat_sig(str(here / n)) for n in modules)]


def identity(target: SSHTarget, mask: int, channels: dict[str, bool]) -> dict[str, Any]:
    """Everything that decides what a connection is; two requests share one only if these are equal."""
    hops = []
    for hop in target.hops():
        hops.append(
            {
                "host": hop.host,
                "hostname": hop.hostname,
                "port": hop.port,
                "user": hop.user,
                "identity_files": [[f, _stat_sig(f)] for f in hop.identity_files],
                "known_hosts": str(hop.known_hosts_path),
                "proxy_command": hop.proxy_command,
            }
        )
    return {
        "hops": hops,
        "mask": mask,
        "channels": channels,
        "rv": __version__,
        "protocol": PROTOCOL,
        "code": _code_stamp(),
    }


def target_to_json(target: SSHTarget) -> dict[str, Any]:
    return dataclasses.asdict(target)


def target_from_json(data: dict[str, Any]) -> SSHTarget:
    jump = data.get("proxy_jump")
    return SSHTarget(
        **{
            **data,
            "identity_files": tuple(data["identity_files"]),
            "proxy_jump": target_from_json(jump) if jump else None,
        }
    )


# --------------------------------------------------------------------------------------------------
# Frames


# A frame longer than this (an upload's stdin, 1 MiB at a time) is sent and received without the
# copies that suit small ones: no header glued in front, no growing of the reader's buffer.
_LARGE_FRAME = 1 << 16


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    if len(payload) > _LARGE_FRAME:
        sock.sendall(_HEADER.pack(kind, len(payload)))
        sock.sendall(payload)
    else:
        sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


def send_json(sock: socket.socket, kind: bytes, obj: Any) -> None:
    send_frame(sock, kind, json.dumps(obj).encode())


class SocketFrameReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            data = self.sock.recv(max(1 << 16, n - len(self.buf)))
            if not data:
                return False
            self.buf += data
        return True

    def read(self) -> tuple[bytes, bytes] | None:
        """The next frame, or None when the other side closed (or broke off mid-frame)."""
        if not self._fill(_HEADER.size):
            return None
        kind, n = _HEADER.unpack(bytes(self.buf[: _HEADER.size]))
        del self.buf[: _HEADER.size]
        if len(self.buf) < n and n > _LARGE_FRAME:
            # Received straight into its own buffer, not grown 64 KiB at a time and then sliced
            # out (three copies of every byte sent).
            payload = bytearray(n)
            have = len(self.buf)
            payload[:have] = self.buf
            self.buf.clear()
            view = memoryview(payload)
            while have < n:
                got = self.sock.recv_into(view[have:], n - have)
                if not got:
                    return None
                have += got
            return kind, bytes(payload)
        if not self._fill(n):
            return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return kind, out


def _error_json(exc: BaseException, *, retry: bool) -> dict[str, Any]:
    if isinstance(exc, RvError):
        return {"kind": type(exc).__name__, "message": exc.message, "hint": exc.hint, "retry": retry}
    return {"kind": "RemoteError", "message": f"{type(exc).__name__}: {exc}", "hint": None, "retry": retry}


def _raise_error(data: dict[str, Any]) -> None:
    """Raise, in the rv command, the error the background process met (same class, same words)."""
    classes: dict[str, type[RvError]] = {
        c.__name__: c
        for c in (
            errors.UsageError, errors.ConfigError, errors.ConnectError, errors.AuthError, errors.HostKeyError,
            errors.RemoteCommandMissing, errors.RemoteError, errors.NotFound, RemoteTimeout, TransferError,
        )
    }  # fmt: skip
    classes["ChannelOpenError"] = ConnectError
    cls = classes.get(data.get("kind", ""), RemoteError)
    raise cls(data.get("message", "the background connection failed"), hint=data.get("hint"))


# --------------------------------------------------------------------------------------------------
# The client: what every rv command uses


class WarmTransport(_Collecting):
    """The Transport API over the profile's background connection; a direct one when that fails."""

    def __init__(
        self,
        target: SSHTarget,
        *,
        profile_key: str,
        confirm_host_key: Callable[[str, str, str], bool] | None = None,
        mask: int = PRIVATE_MASK,
        idle: float,
        channels: dict[str, bool],
    ) -> None:
        """``idle``: how long the background process waits for the next command (seconds);
        ``channels``: what it keeps started on the login node (rv.remote.connect.channels)."""
        self.target = target
        self.mask = mask
        self.idle = idle
        self._confirm = confirm_host_key
        self.key = _key(profile_key)
        self.ident = identity(target, mask, channels)
        self._direct: SSHTransport | None = None
        self.reused: bool | None = None  # did connect() find the connection already open?
        self.daemon_pid: int | None = None
        self.fallback_reason: str | None = None
        self.started_daemon = False

    # -- paths -----------------------------------------------------------------------------------------
    def _paths(self) -> tuple[Path, Path, Path]:
        d = runtime_dir()
        sock = d / f"{self.key}.sock"
        if len(os.fsencode(sock)) > 100:  # sun_path holds 104-108 bytes depending on the system
            raise WarmUnavailable(f"socket path too long for this system: {sock}")
        return sock, d / f"{self.key}.lock", d / f"{self.key}.log"

    # -- connecting ------------------------------------------------------------------------------------
    def connect(self) -> WarmTransport:
        """Use the warm connection if there is one; otherwise start it, for this command or the next.

        A command run by the command server forks the background process (see _spawn), which is
        connecting within a millisecond: the command waits for it and uses it, so one handshake is
        made, not two side by side on the same cores (a host key question comes back through the
        socket). Any other command connects directly (as rv always did) and leaves the process it
        started to the next command: a fresh Python would only be ready after importing paramiko
        and shaking hands too, so waiting for it is no quicker.
        """
        if self._direct is not None or self.reused is not None:
            return self
        try:
            path, lock_path, log_path = self._paths()
            forks = _forks_daemon()
            if self.key in _started_here and not forks:
                raise _Cold()
            probe = _try_connect(path, self.target.connect_timeout)
            if probe is None:
                self._start(path, lock_path, log_path, wait=forks)
                if not forks:
                    raise _Cold()
            else:
                probe.close()
            reply = self._call({"op": "ping"})
            self.reused = bool(reply.get("reused"))
            self.daemon_pid = reply.get("pid")
        except _Cold:
            self._fall_back(None)
        except WarmUnavailable as exc:
            self._fall_back(exc)
        return self

    def _fall_back(self, exc: BaseException | None) -> None:
        """Connect directly, in this process. Said on stderr when something is wrong (``exc``)."""
        if self._direct is None:
            if exc is not None:
                self.fallback_reason = str(exc)
                sys.stderr.write(f"rv: note: connecting directly ({exc})\n")
            from rv.remote.ssh import SSHTransport

            self._direct = SSHTransport(self.target, self._confirm, mask=self.mask).connect()

    def _fallen_back(self) -> SSHTransport:
        """The direct connection, once _fall_back has made it."""
        assert self._direct is not None, "only after _fall_back"
        return self._direct

    def _socket(self) -> socket.socket:
        path, lock_path, log_path = self._paths()
        sock = _try_connect(path, self.target.connect_timeout)
        if sock is not None:
            return sock
        self._start(path, lock_path, log_path)
        sock = _try_connect(path, self.target.connect_timeout)
        if sock is None:
            raise WarmUnavailable(f"the background process did not accept connections (log: {log_path})")
        return sock

    def prewarm(self) -> None:
        """Start the background process (and its SSH handshake) now, without waiting for it.

        The rv command calls this as soon as it knows the profile, so the process's start-up,
        paramiko's import and the handshake overlap with the command's own imports and parsing.
        """
        path, lock_path, log_path = self._paths()
        probe = _try_connect(path, 0.5)
        if probe is not None:
            probe.close()
            return
        self._start(path, lock_path, log_path, wait=False)

    def _start(self, path: Path, lock_path: Path, log_path: Path, *, wait: bool = True) -> None:
        """Start the background process, unless another rv is starting one (then wait for it)."""
        import fcntl  # POSIX only, like the rest of this module's work (rv.remote.connect.use_warm says so)

        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + _START_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # The lock's holder is a live process: starting, serving, or on its way out.
                    probe = _try_connect(path, 1.0)
                    if probe is not None or not wait:
                        if probe is not None:
                            probe.close()
                        return
                    if time.monotonic() > deadline:
                        raise WarmUnavailable(
                            "another rv process holds the background connection's lock"
                        ) from None
                    time.sleep(0.02)
            # We hold the lock, so nobody serves this profile: a socket file left here is stale.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            ready_r, ready_w = os.pipe()
            spec = {
                "path": str(path),
                "log": str(log_path),
                "key": self.key,
                "target": target_to_json(self.target),
                "ident": self.ident,
                "mask": self.mask,
                "idle": self.idle,
            }
            try:
                _spawn(spec, fd, ready_w)
            finally:
                os.close(ready_w)
            self.started_daemon = True
            _started_here.add(self.key)
            if not wait:
                os.close(ready_r)  # the process shrugs off the closed pipe; the socket tells the rest
                return
            try:
                ready, _, _ = select.select([ready_r], [], [], _START_WAIT_S)
                said = os.read(ready_r, 1) if ready else b""
            finally:
                os.close(ready_r)
            if said != b"R":
                raise WarmUnavailable(f"the background process did not start (log: {log_path})")
        finally:
            os.close(fd)  # the process keeps its own copy of the lock

    # -- one request ----------------------------------------------------------------------------------
    def _call(
        self,
        header: dict[str, Any],
        *,
        data: Stdin = None,
        on_stdout: Callable[[bytes], None] | None = None,
        on_stderr: Callable[[bytes], None] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        for _attempt in range(3):
            sock = self._socket()
            try:
                return self._converse(sock, header, data, on_stdout, on_stderr, timeout)
            except _Retry:
                continue
            finally:
                sock.close()
        raise WarmUnavailable("the background connection kept restarting")

    def _converse(
        self,
        sock: socket.socket,
        header: dict[str, Any],
        data: Stdin,
        on_stdout: Callable[[bytes], None] | None,
        on_stderr: Callable[[bytes], None] | None,
        timeout: float | None,
    ) -> dict[str, Any]:
        reader = SocketFrameReader(sock)
        try:
            send_json(sock, b"H", {"v": PROTOCOL, "ident": self.ident, **header})
        except OSError as exc:
            raise _Retry() from exc
        # Until "O" nothing has run: every failure here may be retried or sent elsewhere. A live
        # process says "h" at once; after that, connecting is bounded by the SSH timeouts.
        sock.settimeout(_ACK_S)
        try:
            ack = reader.read()
        except TimeoutError:
            path = self._paths()[0]
            raise WarmUnavailable(
                f"the background connection did not answer in {_ACK_S:g} s; {_stop_wedged(path)}"
            ) from None
        except OSError:
            ack = None
        if ack is None:
            raise _Retry()
        if ack[0] != b"h":
            raise WarmUnavailable(f"unexpected reply {ack[0]!r} from the background process")
        sock.settimeout(self.target.connect_timeout * 6)
        while True:
            try:
                frame = reader.read()
            except TimeoutError:
                raise WarmUnavailable("the background connection is taking too long to connect") from None
            except OSError:
                frame = None
            if frame is None:
                raise _Retry()
            kind, payload = frame
            if kind == b"K":
                q = json.loads(payload)
                accept = bool(self._confirm and self._confirm(q["host"], q["key_type"], q["fingerprint"]))
                send_json(sock, b"k", {"accept": accept})  # the user took their time: the clock restarts
            elif kind == b"S":
                raise _Retry()
            elif kind == b"E":
                err = json.loads(payload)
                if err.get("retry"):
                    raise WarmUnavailable(err.get("message", "the background connection failed"))
                _raise_error(err)
            elif kind == b"O":
                started: dict[str, Any] = json.loads(payload)
                sock.settimeout(None)  # a command may run for hours (`rv logs -f`)
                break
            else:
                raise WarmUnavailable(f"unexpected reply {kind!r} from the background process")
        if header["op"] == "ping":
            return started

        failure: list[BaseException] = []
        feeder = None
        if data is not None:

            def feed() -> None:
                source = _chunks(data)
                try:
                    for chunk in source:
                        send_frame(sock, b"D", chunk)
                    send_frame(sock, b"e")
                except OSError as exc:
                    if isinstance(exc, BrokenPipeError | ConnectionResetError):
                        return  # the process ended the command; its reply (or EOF) says why
                    failure.append(exc)
                except BaseException as exc:  # handed to the caller below, never dropped
                    failure.append(exc)
                if failure:
                    # Stop everything now: the process sees the socket close and ends the command,
                    # and our reader wakes up, instead of both waiting for data that never comes.
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()

        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        what = str(header.get("command", ""))[:80]
                        raise RemoteTimeout(
                            f"remote command timed out after {timeout:g}s: {what}",
                            hint="raise the limit with --timeout",
                        )
                    sock.settimeout(min(left, 1.0))
                try:
                    frame = reader.read()
                except TimeoutError:
                    continue
                except OSError:
                    frame = None
                if frame is None:
                    if failure:
                        raise TransferError(
                            f"upload stopped: reading the data to send failed: {failure[0]}"
                        ) from (failure[0])
                    raise ConnectError(
                        f"the background connection to {self.target.hostname} ended while a command ran",
                        hint="run the command again (it connects afresh)",
                    )
                kind, payload = frame
                if kind == b"1":
                    if on_stdout is not None:
                        on_stdout(payload)
                elif kind == b"2":
                    if on_stderr is not None:
                        on_stderr(payload)
                elif kind == b"X":
                    if failure:
                        raise TransferError(
                            f"upload stopped: reading the data to send failed: {failure[0]}"
                        ) from (failure[0])
                    return {"exit_code": int(payload)}
                elif kind == b"F":
                    done: dict[str, Any] = json.loads(payload or b"{}")
                    return done
                elif kind == b"E":
                    _raise_error(json.loads(payload))
        finally:
            if feeder is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # stops a feeder still blocked on a full socket
                feeder.join(timeout=5)

    # -- the Transport API ------------------------------------------------------------------------------
    def stream(
        self,
        command: str,
        *,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> int:
        if self._direct is None:
            header = {
                "op": "exec",
                "command": command,
                "stdin": stdin is not None,
                "keep_stdin_open": keep_stdin_open,
            }
            try:
                reply = self._call(
                    header, data=stdin, on_stdout=on_stdout, on_stderr=on_stderr, timeout=timeout
                )
                return int(reply["exit_code"])
            except WarmUnavailable as exc:
                self._fall_back(exc)
        return int(
            self._fallen_back().stream(
                command,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                stdin=stdin,
                timeout=timeout,
                keep_stdin_open=keep_stdin_open,
            )
        )

    def run_agent(
        self, mode: str, args: dict[str, Any], *, stdin: Stdin = None, timeout: float | None = None
    ) -> RunResult:
        """rv's agent in ``mode``: served by the agent the background process started ahead of time
        when it has one of this code, else as any command (rv.remote.agent_client.call_agent uses this)."""
        from rv.remote.agent_client import agent_command, agent_key

        command = agent_command(mode, args)
        if self._direct is None:
            out: list[bytes] = []
            err: list[bytes] = []
            header = {
                "op": "exec",
                "command": command,
                "stdin": stdin is not None,
                "keep_stdin_open": False,
                "agent": {"key": agent_key(), "mode": mode, "args": args},
            }
            try:
                reply = self._call(
                    header, data=stdin, on_stdout=out.append, on_stderr=err.append, timeout=timeout
                )
                return RunResult(int(reply["exit_code"]), b"".join(out), b"".join(err))
            except WarmUnavailable as exc:
                self._fall_back(exc)
        result: RunResult = self._fallen_back().run(command, stdin=stdin, timeout=timeout)
        return result

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None:
        self._put([data], remote_path, mode)

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        self._put(
            read_chunks(local_path), remote_path, mode if mode is not None else local_file_mode(local_path, 0)
        )

    def _put(self, chunks: Any, remote_path: str, mode: int) -> None:
        if self._direct is None:
            try:
                self._call({"op": "put", "remote": remote_path, "mode": mode}, data=chunks)
                return
            except WarmUnavailable as exc:
                self._fall_back(exc)
        self._fallen_back().put_stream(chunks, remote_path, mode)

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        if self._direct is None:
            try:

                def fetch(sink: Callable[[bytes], None]) -> None:
                    self._call({"op": "get", "remote": remote_path}, on_stdout=sink)

                write_local_atomically(local_path, fetch)
                return
            except WarmUnavailable as exc:
                self._fall_back(exc)
        self._fallen_back().get_file(remote_path, local_path)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    def __enter__(self) -> WarmTransport:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_wedged(sock_path: Path) -> str:
    """Kill a background process that accepts connections but no longer answers (stopped, stuck).

    Only a process of this user whose command line is an rv one, named by the pid file it wrote
    itself in the private runtime folder; its socket goes too, so the next command starts afresh.
    A process started by spawn_python runs rv.remote.warm; one forked from the command server (_fork_daemon)
    has the server's command line, rv.forkserver.
    """
    pid_path = sock_path.with_suffix(".pid")
    try:
        pid = int(pid_path.read_text())
        proc = Path(f"/proc/{pid}")
        cmdline = (proc / "cmdline").read_bytes()
        mine = proc.stat().st_uid == os.getuid() and (
            b"rv.remote.warm" in cmdline or b"rv.forkserver" in cmdline
        )
    except (OSError, ValueError):
        return "it could not be identified, so it was left alone"
    if not mine:
        return "its pid file names another process, so it was left alone"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pid_path)
    return f"it was stopped (pid {pid})"


def _try_connect(path: Path, timeout: float) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
        sock.close()
        return None
    return sock


def _spawn(spec: dict[str, Any], lock_fd: int, ready_w: int) -> None:
    """Start the process: a fresh ``python -I`` running rv.remote.warm, its own session, no terminal.

    Not a fork of this rv process: that would be ~40 ms quicker, but the fork's command line
    (visible in `ps`, to other users too) would be this command's, for minutes after it ended. The
    description of the connection travels on stdin, not on the command line. The exception: a
    command run by the command server (rv.forkserver) is a fork of that server, whose command line
    says nothing of the user's; it forks (twice: the process is nobody's child), which saves the
    new process ~150 ms of importing paramiko before it can connect.
    """
    if _forks_daemon():
        _fork_daemon(spec, lock_fd, ready_w)
        return
    # The search path this process found rv and paramiko on comes along (rv.runtime.spawn_python).
    rv_runtime.spawn_python(
        _BOOT,
        {"spec": spec},
        args=(str(lock_fd), str(ready_w)),
        pass_fds=(lock_fd, ready_w),
        log=spec["log"],
    )


def _forks_daemon() -> bool:
    """Is this a command run by the command server, which starts the process by forking?"""
    forkserver = sys.modules.get("rv.forkserver")
    return forkserver is not None and bool(forkserver.in_copy)


def _fork_daemon(spec: dict[str, Any], lock_fd: int, ready_w: int) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() == 0:
                os._exit(_daemon_entry(spec, lock_fd, ready_w))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


# After rv.runtime.BOOT_PREFIX (the data in `d`, the search path set).
_BOOT = "import rv.remote.warm as w;sys.exit(w.main(d['spec'],int(sys.argv[1]),int(sys.argv[2])))"


# --------------------------------------------------------------------------------------------------
# The background process


def _daemon_entry(spec: dict[str, Any], lock_fd: int, ready_w: int) -> int:
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
                self.early_error = (time.monotonic(), _error_json(exc, retry=False))
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
                self.connect_error = _error_json(exc, retry=False)
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
        from rv.remote.ssh import Cancelled, ChannelOpenError

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
            send_json(conn, b"E", _error_json(exc, retry=False))
            return
        except ChannelOpenError as exc:
            # Nothing ran: the rv command may send it over a fresh connection.
            send_json(conn, b"E", _error_json(exc, retry=True))
            self.stop(f"could not open a channel: {exc.message}")
            return
        except RvError as exc:
            send_json(conn, b"E", _error_json(exc, retry=False))
            return
        send_frame(conn, b"X", str(code).encode())

    def op_put(self, conn: socket.socket, reader: SocketFrameReader, header: dict[str, Any]) -> None:
        try:
            self.connection.put_stream(self._stdin_frames(reader), header["remote"], int(header["mode"]))
        except RvError as exc:
            send_json(conn, b"E", _error_json(exc, retry=False))
            return
        send_json(conn, b"F", {})

    def op_get(self, conn: socket.socket, header: dict[str, Any]) -> None:
        try:
            self.connection.get_stream(header["remote"], lambda d: send_frame(conn, b"1", d))
        except RvError as exc:
            send_json(conn, b"E", _error_json(exc, retry=False))
            return
        send_json(conn, b"F", {})


def main(spec: dict[str, Any], lock_fd: int, ready_w: int) -> int:
    """The background process's entry (see _BOOT: it reads the spec from stdin)."""
    return _daemon_entry(spec, lock_fd, ready_w)
