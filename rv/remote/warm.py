"""Warm connections: one background process per profile keeps the SSH connection open for a while.

The first rv command of a profile starts the process (a fresh ``python -I -S``, see _spawn);
later commands, within ``RV_WARM_SECONDS`` (default 300) of the last one, reach it through a Unix
socket and pay neither the SSH handshake nor paramiko's import. Why our own process rather than
OpenSSH's ControlMaster: it works the same on every machine (no ``ssh`` binary, user config or
``ControlPath`` needed), host keys and errors keep one implementation (paramiko's, with the
prompts and exit codes rv documents), and it needs nothing from the user's ``~/.ssh/config``.

This module is the client, what every rv command uses: :class:`WarmTransport`, one mode only, the
Transport API over that process. The process is rv.remote.warmd; what travels between the two,
rv.remote.warmwire. When the process cannot take a command, the client says so
(:class:`WarmUnavailable`, nothing ran) and rv.remote.connect, which alone chooses routes, sends
the command over a direct connection.

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
  dying one, a dropped connection) sends the command to a new process, or raises WarmUnavailable
  so that rv.remote.connect sends it over a direct connection; nothing is ever run twice (once the
  process says the command started, no failure is WarmUnavailable). Starting waits at most a few
  seconds.
* **Remote commands end with the rv command.** Each command is its own SSH channel; the process
  closes it the moment the rv process that asked goes away (Ctrl-C, SIGKILL: its socket closes),
  exactly as the channel closed with a direct connection.
* **Idle exit.** After ``RV_WARM_SECONDS`` without a request, or when the connection dies, the
  process closes the connection, removes its socket and exits. ``RV_WARM_SECONDS=0`` switches the
  whole mechanism off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rv import runtime as rv_runtime
from rv.errors import ConnectionLost
from rv.remote.agent_client import run_agent_over
from rv.remote.sshconfig import SSHTarget
from rv.remote.transport import (
    PRIVATE_MASK,
    Process,
    RunResult,
    Stdin,
    _Collecting,
    _discard,
    local_file_mode,
    read_chunks,
    run_process,
    write_local_atomically,
)
from rv.remote.warmwire import (
    PROTOCOL,
    SocketFrameReader,
    identity,
    raise_error,
    send_frame,
    send_json,
    target_to_json,
)

_START_WAIT_S = 10.0  # a new process is listening within milliseconds; this bounds a broken start
_ACK_S = 5.0  # a live process acknowledges a request at once


class WarmUnavailable(Exception):
    """The background process cannot take this command; nothing ran. The caller connects directly."""


class Cold(Exception):
    """No warm connection yet: this command started one for the next, and connects directly now."""


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


# --------------------------------------------------------------------------------------------------
# The client: what every rv command uses


class WarmTransport(_Collecting):
    """The Transport API over the profile's background connection (and nothing else: see
    rv.remote.connect for what happens when it raises WarmUnavailable)."""

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
        self.reused: bool | None = None  # did connect() find the connection already open?
        self.daemon_pid: int | None = None

    # -- paths -----------------------------------------------------------------------------------------
    def _paths(self) -> tuple[Path, Path, Path]:
        d = runtime_dir()
        sock = d / f"{self.key}.sock"
        if len(os.fsencode(sock)) > 100:  # sun_path holds 104-108 bytes depending on the system
            raise WarmUnavailable(f"socket path too long for this system: {sock}")
        return sock, d / f"{self.key}.lock", d / f"{self.key}.log"

    # -- connecting ------------------------------------------------------------------------------------
    def connect(self) -> WarmTransport:
        """Reach the warm connection, starting it if there is none: :class:`Cold` when this command
        should not wait for the one it started, WarmUnavailable when it cannot serve (nothing ran).

        A command run by the command server forks the background process (see _spawn), which is
        connecting within a millisecond: the command waits for it and uses it, so one handshake is
        made, not two side by side on the same cores (a host key question comes back through the
        socket). Any other command is told Cold (and connects directly, as rv always did), leaving
        the process it started to the next command: a fresh Python would only be ready after
        importing paramiko and shaking hands too, so waiting for it is no quicker.
        """
        if self.reused is not None:
            return self
        path, lock_path, log_path = self._paths()
        forks = _forks_daemon()
        if self.key in _started_here and not forks:
            raise Cold()
        probe = _try_connect(path, self.target.connect_timeout)
        if probe is None:
            self._start(path, lock_path, log_path, wait=forks)
            if not forks:
                raise Cold()
        else:
            probe.close()
        started, _ = self._call({"op": "ping"})
        self.reused = bool(started.get("reused"))
        self.daemon_pid = started.get("pid")
        return self

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
    ) -> tuple[dict[str, Any], int]:
        """Ask the process to run ``header``'s operation: what it said when it started it, and its
        exit code (0 for a finished put or get)."""
        for _attempt in range(3):
            sock = self._socket()
            try:
                reader = SocketFrameReader(sock)
                started = self._start_request(sock, reader, header)
                if header["op"] == "ping":
                    return started, 0
                command = str(header.get("command", ""))
                reply = _Reply(sock, reader, command, self.target.hostname, feeds=data is not None)
                code = run_process(
                    reply, on_stdout=on_stdout or _discard, on_stderr=on_stderr, stdin=data, timeout=timeout
                )
                return started, code
            except _Retry:
                continue
            finally:
                sock.close()
        raise WarmUnavailable("the background connection kept restarting")

    def _start_request(
        self, sock: socket.socket, reader: SocketFrameReader, header: dict[str, Any]
    ) -> dict[str, Any]:
        """Send the request and answer the process until it starts it ("O"): until then nothing has
        run, and every failure may be retried (_Retry) or sent elsewhere (WarmUnavailable)."""
        try:
            send_json(sock, b"H", {"v": PROTOCOL, "ident": self.ident, **header})
        except OSError as exc:
            raise _Retry() from exc
        # A live process says "h" at once; after that, connecting is bounded by the SSH timeouts.
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
                raise_error(err)
            elif kind == b"O":
                started: dict[str, Any] = json.loads(payload)
                sock.settimeout(None)  # a command may run for hours (`rv logs -f`)
                return started
            else:
                raise WarmUnavailable(f"unexpected reply {kind!r} from the background process")

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
        agent: dict[str, Any] | None = None,
    ) -> int:
        """``agent``: see rv.remote.ssh.SSHTransport.stream (the process's connection keeps agents
        started ahead of time)."""
        header: dict[str, Any] = {
            "op": "exec",
            "command": command,
            "stdin": stdin is not None,
            "keep_stdin_open": keep_stdin_open,
        }
        if agent is not None:
            header["agent"] = agent
        return self._call(header, data=stdin, on_stdout=on_stdout, on_stderr=on_stderr, timeout=timeout)[1]

    def run_agent(
        self, mode: str, args: dict[str, Any], *, stdin: Stdin = None, timeout: float | None = None
    ) -> RunResult:
        """rv's agent in ``mode`` (rv.remote.agent_client.call_agent): a pre-started one where kept."""
        return run_agent_over(self.stream, mode, args, stdin=stdin, timeout=timeout)

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None:
        self._call({"op": "put", "remote": remote_path, "mode": mode}, data=[data])

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        mode = mode if mode is not None else local_file_mode(local_path, 0)
        self._call({"op": "put", "remote": remote_path, "mode": mode}, data=read_chunks(local_path))

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        def fetch(sink: Callable[[bytes], None]) -> None:
            self._call({"op": "get", "remote": remote_path}, on_stdout=sink)

        write_local_atomically(local_path, fetch)

    def close(self) -> None:
        pass  # every request has a socket of its own, closed when it ends

    def __enter__(self) -> WarmTransport:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Reply(Process):
    """A request the process has started, as run_process drives it: stdin goes out as ``D`` frames
    (and ``e``), output comes back as ``1``/``2`` frames, then ``X`` (exit code) or ``F`` (done)."""

    def __init__(
        self, sock: socket.socket, reader: SocketFrameReader, command: str, hostname: str, *, feeds: bool
    ) -> None:
        super().__init__(command)
        self.sock = sock
        self.reader = reader
        self.hostname = hostname
        self.feeds = feeds  # does the process read stdin frames for this request?
        self.code: int | None = None
        self.ended = False  # the process closed the socket (or broke off) before the end

    def write(self, chunk: bytes) -> bool:
        try:
            send_frame(self.sock, b"D", chunk)
        except (BrokenPipeError, ConnectionResetError):
            return False  # the process ended the command; its reply (or EOF) says why
        return True

    def close_stdin(self) -> None:
        if self.feeds:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                send_frame(self.sock, b"e")

    def pump(
        self, wait: float | None, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> None:
        if wait is not None:  # else the read waits for the next frame, however long (`rv logs -f`)
            self.sock.settimeout(min(wait, 1.0))
        try:
            frame = self.reader.read()
        except TimeoutError:
            return
        except OSError:
            frame = None
        if frame is None:
            self.ended = True
            return
        kind, payload = frame
        if kind == b"1":
            on_stdout(payload)
        elif kind == b"2":
            on_stderr(payload)
        elif kind == b"X":
            self.code = int(payload)
        elif kind == b"F":
            self.code = 0
        elif kind == b"E":
            raise_error(json.loads(payload))

    def exit_code(self) -> int | None:
        if self.ended:
            raise ConnectionLost(
                f"the background connection to {self.hostname} ended while a command ran",
                hint="run the command again (it connects afresh)",
            )
        return self.code

    def kill(self) -> None:
        # The process sees the socket close and ends the command, and a feeder blocked on a full
        # socket wakes up, instead of both waiting for data that never comes.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.kill()


def _stop_wedged(sock_path: Path) -> str:
    """Kill a background process that accepts connections but no longer answers (stopped, stuck).

    Only a process of this user whose command line is an rv one, named by the pid file it wrote
    itself in the private runtime folder; its socket goes too, so the next command starts afresh.
    A process started by spawn_python runs rv.remote.warmd (an older rv's, rv.remote.warm: both
    match); one forked from the command server (_fork_daemon) has the server's command line,
    rv.forkserver.
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
    """Start the process: a fresh ``python -I`` running rv.remote.warmd, its own session, no terminal.

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
    from rv.remote.warmd import daemon_entry  # before the fork: the command server has it loaded

    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() == 0:
                os._exit(daemon_entry(spec, lock_fd, ready_w))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


# After rv.runtime.BOOT_PREFIX (the data in `d`, the search path set).
_BOOT = "import rv.remote.warmd as w;sys.exit(w.main(d['spec'],int(sys.argv[1]),int(sys.argv[2])))"
