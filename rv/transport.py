"""Running commands and moving files on the cluster: the one module that imports paramiko.

One :class:`SSHTransport` per ``rv`` invocation holds one SSH connection; every command (an exec
channel) and every file transfer (one SFTP session, opened once) reuses it. A reused connection cut a
loopback command from ~250 ms to ~80 ms in the old tool; on a real link with 2FA or a VPN every extra
handshake is felt far more.

:class:`LocalTransport` has the same API and runs commands with local bash. It is the one fake seam
for unit tests of code that drives a transport (sync planning, the job client); integration tests
always use :class:`SSHTransport` against a real sshd.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import select
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import paramiko

from rv.errors import AuthError, ConnectError, HostKeyError, RemoteError

Stdin = bytes | Iterable[bytes] | None
_CHUNK = 1 << 16


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, what: str) -> RunResult:
        """Raise :class:`RemoteError` naming ``what`` and the tail of stderr when the command failed."""
        if self.exit_code != 0:
            tail = self.err.strip().splitlines()[-3:]
            detail = ": " + " / ".join(tail) if tail else ""
            raise RemoteError(f"{what} failed (exit {self.exit_code}){detail}")
        return self


class Transport(Protocol):
    def run(self, command: str, *, stdin: Stdin = None, timeout: float | None = None) -> RunResult: ...

    def stream(
        self,
        command: str,
        *,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> int: ...

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None: ...

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None: ...

    def get_file(self, remote_path: str, local_path: str | Path) -> None: ...

    def close(self) -> None: ...


def _chunks(stdin: Stdin) -> Iterator[bytes]:
    if stdin is None:
        return iter(())
    if isinstance(stdin, bytes | bytearray | memoryview):
        data = bytes(stdin)
        return (data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK))
    return iter(stdin)


def _temp_name(path: str) -> str:
    """A sibling name for an atomic write: same directory, so the final rename never crosses devices."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}.rv-tmp-{uuid.uuid4().hex[:12]}")


class RemoteTimeout(RemoteError):
    pass


class _Collecting:
    """`run` for any transport with `stream`: collect the output instead of handing it on."""

    def stream(self, command: str, **kwargs) -> int:  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def run(self, command: str, *, stdin: Stdin = None, timeout: float | None = None) -> RunResult:
        out: list[bytes] = []
        err: list[bytes] = []
        code = self.stream(command, on_stdout=out.append, on_stderr=err.append, stdin=stdin, timeout=timeout)
        return RunResult(code, b"".join(out), b"".join(err))


# --------------------------------------------------------------------------------------------------
# SSH


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to connect, after ~/.ssh/config and the profile have been merged."""

    host: str  # the name the user gave (alias); host keys are looked up under `hostname`
    hostname: str
    port: int = 22
    user: str | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts: str | None = None  # None: ~/.ssh/known_hosts
    proxy_jump: SSHTarget | None = None
    connect_timeout: float = 10.0

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts or "~/.ssh/known_hosts").expanduser()

    @property
    def host_key_name(self) -> str:
        """The name known_hosts files use: ``host`` on port 22, ``[host]:port`` otherwise (OpenSSH)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh` prints it, so users can compare the two."""
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_fingerprint().hex()


ConfirmHostKey = Callable[[str, str, str], bool]  # (host, key type, fingerprint) -> accept?


class _AskPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: ask (or accept with --yes), then remember it in the known_hosts file."""

    def __init__(self, target: SSHTarget, confirm: ConfirmHostKey | None) -> None:
        self.target = target
        self.confirm = confirm

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        fp = fingerprint(key)
        if self.confirm is None or not self.confirm(self.target.host_key_name, key.get_name(), fp):
            raise HostKeyError(
                f"host key of {self.target.host_key_name} is not known ({key.get_name()} {fp})",
                hint="check the fingerprint with your cluster's documentation, then run `rv init` "
                "and accept it (or pass --yes)",
            )
        path = self.target.known_hosts_path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Append one line rather than rewriting the file: paramiko's save_host_keys would reformat
        # (and drop comments from) the user's own known_hosts.
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"{self.target.host_key_name} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(self.target.host_key_name, key.get_name(), key)


class SSHTransport(_Collecting):
    """One SSH connection, reused for every command and transfer of this rv invocation."""

    def __init__(self, target: SSHTarget, confirm_host_key: ConfirmHostKey | None = None) -> None:
        self.target = target
        self._confirm = confirm_host_key
        self._client: paramiko.SSHClient | None = None
        self._jump: SSHTransport | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.Lock()

    # -- connection ---------------------------------------------------------------------------------
    def connect(self) -> SSHTransport:
        if self._client is not None:
            return self
        t = self.target
        sock = None
        if t.proxy_jump is not None:
            # ProxyJump: a direct-tcpip channel through the jump host's own connection, as OpenSSH does.
            self._jump = SSHTransport(t.proxy_jump, self._confirm).connect()
            jump_transport = self._jump._client.get_transport()  # type: ignore[union-attr]
            try:
                sock = jump_transport.open_channel(
                    "direct-tcpip", (t.hostname, t.port), ("127.0.0.1", 0), timeout=t.connect_timeout
                )
            except (paramiko.SSHException, OSError) as exc:
                raise ConnectError(
                    f"cannot reach {t.hostname}:{t.port} through {t.proxy_jump.hostname}: {exc}",
                    hint="check the ProxyJump host in ~/.ssh/config",
                ) from exc
        client = paramiko.SSHClient()
        known = t.known_hosts_path
        if known.exists():
            client.load_host_keys(str(known))
        client.set_missing_host_key_policy(_AskPolicy(t, self._confirm))
        where = f"{t.user + '@' if t.user else ''}{t.hostname}:{t.port}"
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
                sock=sock,
            )
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"host key of {t.host_key_name} has CHANGED: expected {fingerprint(exc.expected_key)}, "
                f"got {fingerprint(exc.key)} — refusing to connect",
                hint=f"if the cluster really changed its key, remove the old line from {known} and run "
                "`rv init` again; otherwise someone may be intercepting the connection",
            ) from exc
        except HostKeyError:
            raise
        except paramiko.AuthenticationException as exc:
            raise AuthError(
                f"authentication refused by {where} ({exc})",
                hint="check the user and identity file (`rv init --identity-file ...`), or load your key "
                "into ssh-agent",
            ) from exc
        except TimeoutError as exc:
            raise ConnectError(
                f"timed out connecting to {where} after {t.connect_timeout:g}s",
                hint="check the host and port, and that you are on the cluster's network or VPN",
            ) from exc
        except (OSError, paramiko.SSHException) as exc:
            raise ConnectError(
                f"cannot connect to {where}: {exc}",
                hint="check the host and port, and that you are on the cluster's network or VPN",
            ) from exc
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(30)
        self._client = client
        return self

    @property
    def client(self) -> paramiko.SSHClient:
        return self.connect()._client  # type: ignore[return-value]

    @property
    def sftp(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None:
                self._sftp = self.client.open_sftp()
            return self._sftp

    def close(self) -> None:
        if self._sftp is not None:
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
    def _open(self, command: str) -> paramiko.Channel:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise ConnectError(
                f"connection to {self.target.hostname} was lost", hint="check the network and retry"
            )
        channel = transport.open_session(timeout=self.target.connect_timeout)
        channel.exec_command(command)
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
    ) -> int:
        """Run ``command``, handing output to the callbacks as it arrives; return the exit code.

        ``keep_stdin_open`` leaves the command's stdin open until we close the channel, so a remote
        watchdog reading stdin learns at once when rv goes away (Ctrl-C, a dropped laptop lid).
        """
        channel = self._open(command)
        feeder = None
        if stdin is not None:
            # A thread feeds stdin so a command that writes a lot before it reads everything cannot
            # deadlock against us (both sides' windows full).
            def feed() -> None:
                try:
                    for chunk in _chunks(stdin):
                        channel.sendall(chunk)
                    channel.shutdown_write()
                except (OSError, EOFError, paramiko.SSHException):
                    pass  # the command exited early: its exit code and stderr say why

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
        elif not keep_stdin_open:
            channel.shutdown_write()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                select.select([channel], [], [], wait)
                while channel.recv_ready():
                    on_stdout(channel.recv(_CHUNK))
                while channel.recv_stderr_ready():
                    data = channel.recv_stderr(_CHUNK)
                    if on_stderr is not None:
                        on_stderr(data)
                if (
                    channel.exit_status_ready()
                    and not channel.recv_ready()
                    and not channel.recv_stderr_ready()
                ):
                    break
                pending = channel.exit_status_ready() or channel.recv_ready() or channel.recv_stderr_ready()
                if not pending and (channel.closed or not channel.get_transport().is_active()):
                    # The connection dropped: no exit status will ever come. Say so instead of
                    # waiting forever, so a follower can reconnect.
                    raise ConnectError(
                        f"connection to {self.target.hostname} was lost",
                        hint="check the network and retry",
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    raise RemoteTimeout(
                        f"remote command timed out after {timeout:g}s: {command[:80]}",
                        hint="raise the limit with --timeout",
                    )
            code = channel.recv_exit_status()
            return 255 if code == -1 else code
        finally:
            channel.close()
            if feeder is not None:
                feeder.join(timeout=1)

    # -- files ----------------------------------------------------------------------------------------
    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        tmp = _temp_name(remote_path)
        sftp = self.sftp
        try:
            with sftp.open(tmp, "wb") as fh:
                fh.set_pipelined(True)
                fh.chmod(mode)  # before the data lands: a secret is never readable by others
                fh.write(data)
            sftp.posix_rename(tmp, remote_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                sftp.remove(tmp)
            raise RemoteError(f"upload to {remote_path} failed: {exc}") from exc

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        tmp = _temp_name(remote_path)
        sftp = self.sftp
        try:
            sftp.put(str(local_path), tmp)
            sftp.chmod(tmp, mode if mode is not None else os.stat(local_path).st_mode & 0o7777)
            sftp.posix_rename(tmp, remote_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                sftp.remove(tmp)
            raise RemoteError(f"upload of {local_path} to {remote_path} failed: {exc}") from exc

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        local = Path(local_path)
        tmp = local.with_name(f".{local.name}.rv-tmp-{uuid.uuid4().hex[:12]}")
        try:
            self.sftp.get(remote_path, str(tmp))
            tmp.replace(local)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise RemoteError(f"download of {remote_path} failed: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Local: the unit-test seam


@dataclass
class LocalTransport(_Collecting):
    """Runs commands with local bash and moves files with the local file system."""

    env: dict[str, str] | None = None
    calls: list[str] = field(default_factory=list)  # every command run, so tests can count round trips

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
        self.calls.append(command)
        proc = subprocess.Popen(
            ["bash", "-c", command],
            stdin=subprocess.PIPE if stdin is not None or keep_stdin_open else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
        )

        def pump(src, sink) -> None:  # type: ignore[no-untyped-def]
            for chunk in iter(lambda: src.read1(_CHUNK), b""):
                if sink is not None:
                    sink(chunk)

        threads = [
            threading.Thread(target=pump, args=(proc.stdout, on_stdout), daemon=True),
            threading.Thread(target=pump, args=(proc.stderr, on_stderr), daemon=True),
        ]
        for t in threads:
            t.start()
        if stdin is not None:
            try:
                for chunk in _chunks(stdin):
                    proc.stdin.write(chunk)  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass  # the command exited early: its exit code and stderr say why
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            raise RemoteTimeout(f"command timed out after {timeout:g}s: {command[:80]}") from exc
        for t in threads:
            t.join()
        return code

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        tmp = _temp_name(remote_path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)  # umask must not widen or narrow what the caller asked for
        os.replace(tmp, remote_path)

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        data = Path(local_path).read_bytes()
        self.put_bytes(data, remote_path, mode if mode is not None else os.stat(local_path).st_mode & 0o7777)

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        local = Path(local_path)
        tmp = local.with_name(f".{local.name}.rv-tmp-{uuid.uuid4().hex[:12]}")
        tmp.write_bytes(Path(remote_path).read_bytes())
        tmp.replace(local)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# ~/.ssh/config


def resolve_target(
    host: str,
    *,
    port: int | None = None,
    user: str | None = None,
    identity_file: str | None = None,
    known_hosts: str | None = None,
    ssh_config_path: str | Path | None = None,
    connect_timeout: float | None = None,
    _depth: int = 0,
) -> SSHTarget:
    """Merge what the profile says with ~/.ssh/config, using paramiko's own parser.

    The profile wins where it sets a value (it was written by `rv init` on purpose); ~/.ssh/config
    fills the rest: Host aliases, HostName, User, Port, IdentityFile, UserKnownHostsFile, ProxyJump.
    """
    path = Path(ssh_config_path or os.environ.get("RV_SSH_CONFIG") or "~/.ssh/config").expanduser()
    if connect_timeout is None:
        connect_timeout = float(os.environ.get("RV_CONNECT_TIMEOUT", "10"))
    cfg = paramiko.SSHConfig.from_path(str(path)) if path.exists() else paramiko.SSHConfig()
    entry = cfg.lookup(host)
    identities = (identity_file,) if identity_file else tuple(entry.get("identityfile", ()))
    known = known_hosts or (entry.get("userknownhostsfile", "").split() or [None])[0]
    jump = None
    proxy = entry.get("proxyjump")
    if proxy and proxy.lower() != "none":
        if _depth > 5:
            raise ConnectError(f"ProxyJump chain for {host} is too deep (a loop in ~/.ssh/config?)")
        # Only the first hop of a comma-separated chain is taken from this entry; that hop's own
        # ProxyJump (if any) is resolved recursively, which covers chains written host by host.
        first = proxy.split(",")[0].strip()
        jump_user, _, jump_host = first.rpartition("@")
        jump_host, _, jump_port = jump_host.partition(":")
        jump = resolve_target(
            jump_host,
            port=int(jump_port) if jump_port else None,
            user=jump_user or None,
            known_hosts=known,
            ssh_config_path=path,
            connect_timeout=connect_timeout,
            _depth=_depth + 1,
        )
    return SSHTarget(
        host=host,
        hostname=entry.get("hostname", host),
        port=port or int(entry.get("port", 22)),
        user=user or entry.get("user"),
        identity_files=tuple(str(Path(i).expanduser()) for i in identities),
        known_hosts=known,
        proxy_jump=jump,
        connect_timeout=connect_timeout,
    )
