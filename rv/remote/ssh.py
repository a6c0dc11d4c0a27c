"""One SSH connection in this process: the one module that connects with paramiko.

One :class:`SSHTransport` holds one connection; every command (an exec channel) and every file
transfer (one SFTP session, opened once) reuses it. Most commands do not build one themselves: they
talk to the warm background process (:mod:`rv.remote.warmd`, through :mod:`rv.remote.warm`), which
holds an SSHTransport for them across invocations; `rv init`, the direct connection rv.remote.connect
turns to when that process is unavailable, and the process itself use this class directly.

Uploads are private: a file is created, chmod-ed to the caller's mode with the profile's mask
applied (``0600``/``0700`` by default) and only then written, and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rv.errors import AuthError, ConnectError, ConnectionLost, HostKeyError, RemoteError
from rv.remote.agent_client import run_agent_over
from rv.remote.sshconfig import SSHTarget
from rv.remote.transport import (
    _CHUNK,
    PRIVATE_MASK,
    Process,
    RunResult,
    Stdin,
    TransferError,
    _Collecting,
    _temp_name,
    file_mode,
    local_file_mode,
    read_chunks,
    run_process,
    write_local_atomically,
)


def _import_paramiko() -> Any:
    # paramiko's config module imports `invoke` (~140 ms, half of paramiko's import time) only to run
    # `Match exec` lines. rv asks OpenSSH (`ssh -G`) about the config, so the import is skipped here;
    # paramiko_lookup loads invoke itself on the rare machine without an ssh binary.
    blocked = "invoke" not in sys.modules
    if blocked:
        sys.modules["invoke"] = None  # type: ignore[assignment]
    try:
        import paramiko
    finally:
        if blocked and sys.modules.get("invoke", 0) is None:
            del sys.modules["invoke"]
    return paramiko


paramiko = _import_paramiko()

ConfirmHostKey = Callable[[str, str, str], bool]  # (host, key type, fingerprint) -> accept?
ParamikoTransport = Any  # paramiko.Transport: the connection under the channels (paramiko has no stubs)


# A "hot" shell: the login shell starts (rc files, module systems: often 100-500 ms on a login node)
# ahead of time, says it is ready, then reads one command from stdin and runs it with eval: same
# shell, same environment, same stdin, stdout, stderr and exit status as `$SHELL -c COMMAND`.
# Nothing meant for the command's stdin is consumed: with GNU head (ready byte \002) the command
# comes as "<length>\n<bytes>" and `head -c` reads exactly that many (it never reads ahead on a
# pipe); elsewhere (ready byte \001) it comes NUL-terminated and bash's read takes it byte by byte
# (slower for rv's 30 kB agent commands, still far faster than a shell start). Only bash says it is
# ready at all; any other login shell fails the test quietly and every command starts its own shell.
HOT_SHELL = (
    'test -n "$BASH_VERSION" && { '
    "if head --version 2>/dev/null | grep -q GNU; then "
    'printf "\\002"; IFS= read -r __rv_n || exit 254; '
    '__rv_cmd=$(head -c "$__rv_n"; printf x) || exit 254; __rv_cmd=${__rv_cmd%x}; '
    'else printf "\\001"; IFS= read -r -d "" __rv_cmd || exit 254; fi; '
    'unset __rv_n; eval "$__rv_cmd"; }'
)


OUTPUT_GRACE_S = 0.5  # after the exit status, for output still on its way (see SSHTransport.stream)

# Agents kept started on a warm connection: two, so that a command run at once after another (a
# script's `rv ps; rv status`) finds one ready while the one the last command took is replaced.
AGENT_SPARES = 2


class _Spare:
    """One pre-started hot shell on its own channel, waiting for a command.

    With ``then``, the shell is given that command as soon as it is ready: a program started ahead
    of time that waits on stdin for what to do (the agent; see rv.remote.agent_client.hot_agent_command).
    """

    def __init__(self, connection: ParamikoTransport, timeout: float, then: str | None = None) -> None:
        self.channel: Any = None
        self.ok = False
        self.framing = b""  # the ready byte: \001 NUL-terminated, \002 length-prefixed
        self.then = then
        self.ready = threading.Event()
        threading.Thread(target=self._start, args=(connection, timeout), daemon=True).start()

    def _start(self, connection: ParamikoTransport, timeout: float) -> None:
        try:
            channel = connection.open_session(timeout=timeout)
            self.channel = channel
            channel.exec_command(HOT_SHELL)
            channel.settimeout(max(timeout, 60.0))  # a busy login node may take a while to start a shell
            seen = 0
            while seen < 1 << 16:
                data = channel.recv(1)
                if not data:
                    return  # not bash, or it died: no hot shells on this connection
                if data in (b"\001", b"\002"):
                    self.framing = data
                    if self.then is not None:
                        channel.sendall(self._framed(self.then))
                    self.ok = True
                    return
                seen += 1  # something the rc files printed on stdout: not the command's output
        except (OSError, EOFError, paramiko.SSHException):
            return  # no spare: the next command starts its own shell, as without one
        finally:
            self.ready.set()

    def take(self, command: str | bytes, wait: float) -> Any:
        """The channel, now running ``command``; None when this spare cannot be used.

        A spare started with ``then`` runs that already: ``command`` is the first bytes of its stdin.
        """
        self.ready.wait(wait)
        channel = self.channel
        if not self.ok or channel is None or channel.closed or channel.exit_status_ready():
            self.close()
            return None
        while channel.recv_stderr_ready():
            channel.recv_stderr(_CHUNK)  # what the rc files said on stderr belongs to no command
        channel.settimeout(None)
        try:
            channel.sendall(self._framed(command) if self.then is None else command)
        except (OSError, EOFError, paramiko.SSHException):
            self.close()
            return None
        return channel

    def _framed(self, command: str | bytes) -> bytes:
        raw = command.encode("utf-8", "surrogateescape") if isinstance(command, str) else command
        return b"%d\n" % len(raw) + raw if self.framing == b"\002" else raw + b"\0"

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


class UnknownHostKey(HostKeyError):
    """The server's key is in no known_hosts file and nobody accepted it."""


class ChannelOpenError(ConnectError):
    """The connection could not start the command: nothing ran on the cluster."""


class TunnelError(RemoteError):
    """The login node could not reach the address a tunnel was asked for."""


def fingerprint(key: Any) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh` prints it, so users can compare the two."""
    return str(key.fingerprint) if hasattr(key, "fingerprint") else key.get_fingerprint().hex()


def _append_known_host(path: Path, line: str) -> None:
    """Append one line (never rewrite: that would reformat and drop comments of the user's file)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        fh.write(line)


class _AskPolicy(paramiko.MissingHostKeyPolicy):  # type: ignore[name-defined,misc]
    """Unknown host key: ask (or accept with --yes), then remember it in the known_hosts file."""

    def __init__(self, target: SSHTarget, confirm: ConfirmHostKey | None) -> None:
        self.target = target
        self.confirm = confirm

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        fp = fingerprint(key)
        if self.confirm is None or not self.confirm(self.target.host_key_name, key.get_name(), fp):
            raise UnknownHostKey(
                f"host key of {self.target.host_key_name} is not known ({key.get_name()} {fp})",
                hint="check the fingerprint with your cluster's documentation, then run `rv init` "
                "and accept it (or pass --yes)",
            )
        _append_known_host(
            self.target.known_hosts_path, f"{self.target.host_key_name} {key.get_name()} {key.get_base64()}\n"
        )
        client.get_host_keys().add(self.target.host_key_name, key.get_name(), key)


def _expand_proxy_command(command: str, t: SSHTarget) -> str:
    tokens = {"h": t.hostname, "p": str(t.port), "r": t.user or "", "n": t.host, "%": "%"}
    out, i = [], 0
    while i < len(command):
        if command[i] == "%" and i + 1 < len(command) and command[i + 1] in tokens:
            out.append(tokens[command[i + 1]])
            i += 2
        else:
            out.append(command[i])
            i += 1
    return "".join(out)


class _ChannelProcess(Process):
    """A command on an SSH channel, as run_process drives it."""

    feeder_join_s = 1.0

    def __init__(self, command: str, channel: Any, hostname: str, *, tick: float) -> None:
        super().__init__(command)
        self.channel = channel
        self.hostname = hostname
        self.tick = tick
        self.eof_by: float | None = None  # see exit_code: how long output may still trail the exit status

    def write(self, chunk: bytes) -> bool:
        try:
            # A view: paramiko's sendall slices what is left after each 32 KiB packet, and slicing
            # bytes copies the rest of the chunk every time.
            self.channel.sendall(memoryview(chunk))
        except (OSError, EOFError, paramiko.SSHException):
            return False
        return True

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            self.channel.shutdown_write()  # fails only when the channel is already closed

    def pump(
        self, wait: float | None, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> None:
        channel = self.channel
        tick = self.tick if self.eof_by is None else 0.02
        select.select([channel], [], [], tick if wait is None else min(tick, wait))
        while channel.recv_ready():
            on_stdout(channel.recv(_CHUNK))
        while channel.recv_stderr_ready():
            on_stderr(channel.recv_stderr(_CHUNK))

    def exit_code(self) -> int | None:
        channel = self.channel
        # Whether the channel closed is read once, first: paramiko's transport thread can take the exit
        # status, EOF and close (sshd sends them together when the command ends) between any two reads
        # here. Read after "no exit status yet", a closed channel looked like a dropped connection, and
        # a command that had ended with 0 failed as "connection ... was lost" (3 in 3,800 rv ps, status
        # and stop on 2 cores under a load of 8-14; a test's closing `rv stop` in CI, once).
        closed = channel.closed
        if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
            # sshd sends the exit status when the command exits, which can be before the last output
            # it still had to read from the command's pipes: the output is complete at EOF. A
            # background process still holding the pipes keeps EOF away, so that is waited for only
            # briefly (OUTPUT_GRACE_S).
            if (
                channel.eof_received
                or closed
                or (self.eof_by is not None and time.monotonic() >= self.eof_by)
            ):
                code = channel.recv_exit_status()
                if code == -1:
                    return self._no_exit_status()
                return int(code)
            if self.eof_by is None:
                self.eof_by = time.monotonic() + OUTPUT_GRACE_S
        pending = channel.exit_status_ready() or channel.recv_ready() or channel.recv_stderr_ready()
        if not pending and not channel.get_transport().is_active():
            raise self._lost()  # and left this channel open: no exit status will ever come
        return None

    def _no_exit_status(self) -> int:
        """The channel closed without an exit status: the connection dropped (ConnectionLost, so that
        a caller may reconnect), or the command was killed by a signal (sshd then sends exit-signal,
        which paramiko drops): 255, as OpenSSH's ssh says."""
        transport = self.channel.get_transport()
        # A dropping connection closes its channels first and is marked inactive just after.
        if transport.is_active():
            transport.join(OUTPUT_GRACE_S)  # the transport is a thread: it ends when the connection does
        if not transport.is_active():
            raise self._lost()
        return 255

    def _lost(self) -> ConnectionLost:
        return ConnectionLost(
            f"connection to {self.hostname} was lost while a command ran", hint="check the network and retry"
        )

    def kill(self) -> None:
        self.channel.close()

    def close(self) -> None:
        self.channel.close()


class SSHTransport(_Collecting):
    """One SSH connection, reused for every command and transfer made through it."""

    def __init__(
        self, target: SSHTarget, confirm_host_key: ConfirmHostKey | None = None, *, mask: int = PRIVATE_MASK
    ) -> None:
        self.target = target
        self.mask = mask
        self._confirm = confirm_host_key
        self._client: Any = None
        self._jump: SSHTransport | None = None
        self._sftp: Any = None
        self._lock = threading.Lock()
        self._sftp_lock = threading.Lock()
        # What is kept started ahead of time (rv.remote.connect.channels decides; see prestart).
        self._hot = False  # a login shell ready for the next command (see HOT_SHELL)
        self._agents = False  # rv's agents ready for the next agent calls (each in such a shell)
        self._spare: _Spare | None = None
        self._agent_spares: list[tuple[str, _Spare]] = []  # (the agent code's key, its spare)
        self.hot_commands = 0  # commands that ran in a pre-started shell
        self.hot_agents = 0  # agent calls served by a pre-started agent

    # -- connection ---------------------------------------------------------------------------------
    def connect(self) -> SSHTransport:
        if self._client is not None:
            return self
        t = self.target
        sock: Any = None
        if t.proxy_jump is not None:
            # ProxyJump: a direct-tcpip channel through the previous hop's own connection, as OpenSSH
            # does; that hop reaches its own previous hop the same way, so chains of any length work.
            self._jump = SSHTransport(t.proxy_jump, self._confirm, mask=self.mask).connect()
            jump_transport = self._jump._client.get_transport()
            try:
                sock = jump_transport.open_channel(
                    "direct-tcpip", (t.hostname, t.port), ("127.0.0.1", 0), timeout=t.connect_timeout
                )
            except (paramiko.SSHException, OSError) as exc:
                self._jump.close()
                self._jump = None
                raise ConnectError(
                    f"cannot reach {t.hostname}:{t.port} through {t.proxy_jump.hostname}: {exc}",
                    hint="check the ProxyJump hosts in ~/.ssh/config (`ssh -G " + t.host + "` shows them)",
                ) from exc
        elif t.proxy_command:
            sock = paramiko.ProxyCommand(_expand_proxy_command(t.proxy_command, t))
        client = paramiko.SSHClient()
        known = t.known_hosts_path
        if known.exists():
            client.load_host_keys(str(known))
        client.set_missing_host_key_policy(_AskPolicy(t, self._confirm))
        try:
            client.connect(
                t.hostname,
                port=t.port,
                username=t.user,
                key_filename=list(t.identity_files) or None,
                # With an explicit identity file, don't also try every key in ~/.ssh: servers count
                # each try against MaxAuthTries and a wrong key would be blamed for the failure.
                look_for_keys=not t.identity_files,
                allow_agent=True,
                timeout=t.connect_timeout,
                banner_timeout=t.connect_timeout,
                auth_timeout=t.connect_timeout,
                channel_timeout=t.connect_timeout,
                sock=sock,
            )
        except BaseException as exc:
            client.close()
            if self._jump is not None:
                self._jump.close()
                self._jump = None
            raise self._connect_error(exc) from exc
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(30)
        self._client = client
        return self

    def _connect_error(self, exc: BaseException) -> BaseException:
        t = self.target
        where = t.where
        if isinstance(exc, paramiko.BadHostKeyException):
            return HostKeyError(
                f"host key of {t.host_key_name} has CHANGED: expected {fingerprint(exc.expected_key)}, "
                f"got {fingerprint(exc.key)} — refusing to connect",
                hint=f"if the cluster really changed its key, remove the old line from {t.known_hosts_path} "
                "and run `rv init` again; otherwise someone may be intercepting the connection",
            )
        if isinstance(exc, HostKeyError | KeyboardInterrupt):
            return exc
        if isinstance(exc, paramiko.AuthenticationException):
            return AuthError(
                f"authentication refused by {where} ({exc})",
                hint="check the user and identity file (`rv init --identity-file ...`), or load your key "
                "into ssh-agent",
            )
        if isinstance(exc, TimeoutError):
            return ConnectError(
                f"timed out connecting to {where} after {t.connect_timeout:g}s",
                hint="check the host and port, and that you are on the cluster's network or VPN",
            )
        if isinstance(exc, OSError | paramiko.SSHException | EOFError):
            return ConnectError(
                f"cannot connect to {where}: {exc}",
                hint="check the host and port, and that you are on the cluster's network or VPN",
            )
        return exc

    def reconnect(self) -> None:
        """Connect afresh: the connection was lost while a call ran (rv.remote.agent_client asks)."""
        self.close()
        self.connect()

    @property
    def client(self) -> Any:
        return self.connect()._client

    @property
    def sftp(self) -> Any:
        with self._lock:
            if self._sftp is None:
                self._sftp = self.client.open_sftp()
                # Every SFTP reply is awaited at most this long: a stalled server turns into an error
                # instead of a hang (paramiko waits forever by default).
                self._sftp.get_channel().settimeout(self.target.connect_timeout)
            return self._sftp

    def is_alive(self) -> bool:
        if self._client is None:
            return False
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def host_keys_still_trusted(self) -> bool:
        """Is every hop's key (the one this connection verified) still in its known_hosts file?"""
        hop: SSHTransport | None = self
        while hop is not None:
            if hop._client is None:
                return False
            transport = hop._client.get_transport()
            if transport is None:
                return False
            key = transport.get_remote_server_key()
            try:
                keys = paramiko.HostKeys(str(hop.target.known_hosts_path))
            except (OSError, paramiko.SSHException):
                return False  # unreadable now: do not trust what we cannot check
            if not keys.check(hop.target.host_key_name, key):
                return False
            hop = hop._jump
        return True

    def prestart(self, *, hot_shell: bool, agents: bool) -> None:
        """Keep channels started ahead of time (for a long-lived connection): a login shell for the
        next command (``hot_shell``) and rv's agents for the next agent calls (``agents``)."""
        self._hot, self._agents = hot_shell, agents
        # One agent at first: a second, started beside the first command, would compete with it.
        # The refill after each command keeps AGENT_SPARES.
        self._refill(agents=1)

    def _refill(self, agents: int = AGENT_SPARES) -> None:
        with self._lock:
            if not (self._hot or self._agents) or not self.is_alive():
                return
            transport = self._client.get_transport()
            if self._hot and self._spare is None:
                self._spare = _Spare(transport, self.target.connect_timeout)
            if self._agents and len(self._agent_spares) < agents:
                # rv's agent (python start-up, its modules loaded) waits too: an agent call then
                # costs the command's own work, not a python start on the login node.
                from rv.remote.agent_client import agent_key, hot_agent_command

                key, command = agent_key(), hot_agent_command()
                while len(self._agent_spares) < agents:
                    spare = _Spare(transport, self.target.connect_timeout, then=command)
                    self._agent_spares.append((key, spare))

    def _take_agent(self, agent: dict[str, Any]) -> Any:
        """A pre-started agent (a ready one first), given ``agent``'s mode and arguments; None if
        there is none for it."""
        with self._lock:
            mine = [held for held in self._agent_spares if held[0] == agent.get("key")]
            if not mine:
                return None  # none yet, or of other code: the command starts its own
            held = next((h for h in mine if h[1].ready.is_set()), mine[0])
            self._agent_spares.remove(held)
        from rv.remote.agent_client import agent_request

        spare = held[1]
        channel = spare.take(agent_request(agent["mode"], agent["args"]), self.target.connect_timeout)
        if channel is None and spare.ready.is_set() and not spare.ok:
            self._hot = self._agents = False  # this login shell cannot do it (not bash): stop trying
        elif channel is not None:
            self.hot_agents += 1
        return channel

    def _take_spare(self, command: str) -> Any:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        channel = spare.take(command, self.target.connect_timeout)
        if channel is None and spare.ready.is_set() and not spare.ok:
            self._hot = self._agents = False  # this login shell cannot do it (not bash): stop trying
        elif channel is not None:
            self.hot_commands += 1
        return channel

    def close(self) -> None:
        self._hot = self._agents = False
        with self._lock:
            spare, self._spare = self._spare, None
            agents, self._agent_spares = self._agent_spares, []
        if spare is not None:
            spare.close()
        for _key, agent in agents:
            agent.close()
        if self._sftp is not None:
            with contextlib.suppress(OSError, EOFError):  # already gone with the connection
                self._sftp.close()
            self._sftp = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None

    def __enter__(self) -> SSHTransport:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands -------------------------------------------------------------------------------------
    def _open(self, command: str, agent: dict[str, Any] | None = None) -> Any:
        """A channel running ``command``: a pre-started agent for an agent call, the hot shell for
        any other command, else a new exec channel."""
        if self._agents and agent is not None:
            channel = self._take_agent(agent)
            if channel is not None:
                return channel
        # An agent call with no agent for it takes a new channel, not the hot shell: the shell reads
        # and evals the agent's ~30 kB command line, which measured slower than a channel of its own
        # (benchmarks/cli.py, `rv ps` with RV_PRESTART_AGENTS=0: 0.19 s against 0.14 s).
        if self._hot and agent is None:
            channel = self._take_spare(command)
            if channel is not None:
                return channel
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ChannelOpenError(
                f"connection to {self.target.hostname} was lost", hint="check the network and retry"
            )
        try:
            channel = transport.open_session(timeout=self.target.connect_timeout)
            channel.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ChannelOpenError(
                f"could not start a command on {self.target.hostname}: {exc}",
                hint="check the network and retry",
            ) from exc
        return channel

    def stream(
        self,
        command: str,
        *,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
        cancelled: Callable[[], bool] | None = None,
        on_started: Callable[[], None] | None = None,
        agent: dict[str, Any] | None = None,
    ) -> int:
        """Run ``command``, handing output to the callbacks as it arrives; return the exit code
        (rv.remote.transport.run_process drives it).

        ``keep_stdin_open`` leaves the command's stdin open until we close the channel, so a remote
        watchdog reading stdin learns at once when rv goes away (Ctrl-C, a dropped laptop lid).
        ``cancelled`` (polled a few times a second) closes the channel when it turns true: the warm
        background process passes "the rv command that asked has gone".

        When the data for stdin cannot be produced here (a file fails mid-read), the channel is
        closed at once and :class:`TransferError` raised: the command must not wait for the rest.

        ``agent`` (``{"key", "mode", "args"}``, when ``command`` is rv's agent_command for them) lets a
        pre-started agent of the same code serve it.
        """
        channel = self._open(command, agent)
        if on_started is not None:
            try:
                on_started()
            except BaseException:
                channel.close()
                raise
        try:
            return run_process(
                _ChannelProcess(command, channel, self.target.hostname, tick=0.2 if cancelled else 0.5),
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                timeout=timeout,
                cancelled=cancelled,
            )
        finally:
            if self._hot or self._agents:
                self._refill()  # after the command, so its shell start does not compete with it

    def run_agent(
        self, mode: str, args: dict[str, Any], *, stdin: Stdin = None, timeout: float | None = None
    ) -> RunResult:
        """rv's agent in ``mode`` (rv.remote.agent_client.call_agent): a pre-started one where kept."""
        return run_agent_over(self.stream, mode, args, stdin=stdin, timeout=timeout)

    # -- channels for terminals and tunnels -------------------------------------------------------------
    def open_pty(self, command: str, *, term: str, cols: int, rows: int) -> Any:
        """A channel running ``command`` on a terminal of its own (an interactive shell, ``srun
        --pty``); the caller relays it (rv.remote.terminal). Never a pre-started shell: it has no terminal."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ChannelOpenError(
                f"connection to {self.target.hostname} was lost", hint="check the network and retry"
            )
        try:
            channel = transport.open_session(timeout=self.target.connect_timeout)
            channel.get_pty(term=term, width=cols, height=rows)
            channel.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ChannelOpenError(
                f"could not start a terminal on {self.target.hostname}: {exc}",
                hint="check the network and retry",
            ) from exc
        return channel

    def open_tunnel(self, host: str, port: int) -> Any:
        """A TCP connection from the login node to ``host:port``, as a channel of this connection
        (``direct-tcpip``, what ``ssh -L`` uses): no second login, nothing started on the cluster."""
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ChannelOpenError(
                f"connection to {self.target.hostname} was lost", hint="check the network and retry"
            )
        try:
            return transport.open_channel(
                "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=self.target.connect_timeout
            )
        except paramiko.ChannelException as exc:
            # The server tried and could not connect (refused, no route), or forwarding is off.
            raise TunnelError(
                f"{self.target.hostname} could not connect to {host}:{port}: {exc.text or exc}",
                hint="check that the program in the job listens on that port, on the node's address "
                "or on all (0.0.0.0), not only on 127.0.0.1; and that the cluster allows TCP "
                "forwarding (sshd's AllowTcpForwarding)",
            ) from exc
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ChannelOpenError(
                f"could not open a tunnel through {self.target.hostname}: {exc}",
                hint="check the network and retry",
            ) from exc

    # -- files ----------------------------------------------------------------------------------------
    def put_stream(self, chunks: Iterable[bytes], remote_path: str, mode: int) -> None:
        """Write ``chunks`` to ``remote_path``: private before the first byte, renamed when complete."""
        tmp = _temp_name(remote_path)
        with self._sftp_lock:
            sftp = self.sftp
            try:
                with sftp.open(tmp, "wb") as fh:
                    fh.chmod(file_mode(mode, self.mask))  # before the data lands: never readable by others
                    fh.set_pipelined(True)
                    source = iter(chunks)
                    while True:
                        try:
                            chunk = next(source)
                        except StopIteration:
                            break
                        except OSError as exc:
                            raise TransferError(
                                f"upload to {remote_path} stopped: reading the data failed: {exc}"
                            ) from exc
                        fh.write(chunk)
                sftp.posix_rename(tmp, remote_path)
            except BaseException as exc:
                with contextlib.suppress(OSError, EOFError):  # best effort; the timeout bounds it
                    sftp.remove(tmp)
                if isinstance(exc, TransferError) or not isinstance(exc, OSError | EOFError):
                    raise
                raise RemoteError(f"upload to {remote_path} failed: {exc}") from exc

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None:
        self.put_stream([data], remote_path, mode)

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        self.put_stream(
            read_chunks(local_path), remote_path, mode if mode is not None else local_file_mode(local_path, 0)
        )

    def get_stream(self, remote_path: str, sink: Callable[[bytes], None]) -> None:
        with self._sftp_lock:
            try:
                with self.sftp.open(remote_path, "rb") as fh:
                    fh.prefetch()
                    while data := fh.read(1 << 20):
                        sink(data)
            except (OSError, EOFError) as exc:
                raise RemoteError(f"download of {remote_path} failed: {exc}") from exc

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        write_local_atomically(local_path, lambda sink: self.get_stream(remote_path, sink))
