"""Running commands and moving files on the cluster: the transport API, without importing paramiko.

Three transports share one API (:class:`Transport`):

* :class:`rv.warm.WarmTransport` (what every command gets from :func:`open_transport`): talks to a
  small per-profile background process that holds one SSH connection for a few minutes, so the
  second ``rv ps`` pays no handshake and no paramiko import. It falls back to a direct connection
  whenever the background process is missing, stale or dead.
* :class:`rv.ssh.SSHTransport`: one paramiko connection in this process (``rv init``, the fallback,
  and the background process itself). ``rv.ssh`` is the one module that imports paramiko; its name
  is re-exported here lazily, so ``from rv.transport import SSHTransport`` keeps working.
* :class:`LocalTransport`: local bash, the one fake seam for unit tests.

Where to connect comes from :func:`resolve_target`: the profile's explicit values laid over what
OpenSSH itself makes of ``~/.ssh/config`` (``ssh -G``: ``Include``, ``Match``, every hop of a
``ProxyJump`` chain), with a parser of our own only where no ``ssh`` binary is installed.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rv.errors import ConfigError, RemoteError, UsageError

if TYPE_CHECKING:
    from rv.config import Profile

Stdin = bytes | Iterable[bytes] | None
_CHUNK = 1 << 16
PRIVATE_MASK = 0o077  # what rv never grants to anyone but the user...
GROUP_MASK = 0o027  # ...unless the profile says share_with_group = true (then the group may read)


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

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None: ...

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
    return posixpath.join(head, f".{tail}.rv-tmp-{os.urandom(6).hex()}")


def file_mode(mode: int, mask: int) -> int:
    """``mode`` with what ``mask`` forbids removed: 0o644 -> 0o600 when private, 0o640 with the group."""
    return mode & ~mask & 0o7777


def local_file_mode(local_path: str | Path, mask: int) -> int:
    """The mode an uploaded copy of a local file gets: executables stay executable, for the user only."""
    executable = os.stat(local_path).st_mode & 0o100
    return file_mode(0o755 if executable else 0o644, mask)


def read_chunks(path: str | Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while data := fh.read(size):
            yield data


def write_local_atomically(
    local_path: str | Path, produce: Callable[[Callable[[bytes], None]], None]
) -> None:
    """Write a local file by temp file and rename: a failure or Ctrl-C never leaves half a file."""
    local = Path(local_path)
    tmp = local.with_name(f".{local.name}.rv-tmp-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        with open(tmp, "wb") as fh:

            def sink(data: bytes) -> None:
                fh.write(data)

            produce(sink)
        tmp.replace(local)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RemoteTimeout(RemoteError):
    pass


class TransferError(RemoteError):
    """The data being sent could not be read here (a file vanished or failed mid-read)."""


class _Collecting:
    """`run` for any transport with `stream`: collect the output instead of handing it on."""

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
        raise NotImplementedError

    def run(self, command: str, *, stdin: Stdin = None, timeout: float | None = None) -> RunResult:
        out: list[bytes] = []
        err: list[bytes] = []
        code = self.stream(command, on_stdout=out.append, on_stderr=err.append, stdin=stdin, timeout=timeout)
        return RunResult(code, b"".join(out), b"".join(err))


# --------------------------------------------------------------------------------------------------
# Where to connect


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to connect, after ~/.ssh/config and the profile have been merged."""

    host: str  # the name the user gave (alias); host keys are looked up under `hostname`
    hostname: str
    port: int = 22
    user: str | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts: str | None = None  # None: ~/.ssh/known_hosts
    proxy_jump: SSHTarget | None = None  # the last hop before this host; it has its own proxy_jump
    connect_timeout: float = 10.0
    proxy_command: str | None = None  # OpenSSH's ProxyCommand, tokens not yet expanded

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts or "~/.ssh/known_hosts").expanduser()

    @property
    def host_key_name(self) -> str:
        """The name known_hosts files use: ``host`` on port 22, ``[host]:port`` otherwise (OpenSSH)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def where(self) -> str:
        return f"{self.user + '@' if self.user else ''}{self.hostname}:{self.port}"

    def hops(self) -> list[SSHTarget]:
        """Every host on the way, first hop first, this one last."""
        chain = [self]
        hop = self.proxy_jump
        while hop is not None:
            chain.insert(0, hop)
            hop = hop.proxy_jump
        return chain


_BAD_HOST = re.compile(r"^-|[\s\x00-\x1f\x7f]")
_MAX_HOPS = 8


def check_host(host: str, what: str = "host") -> str:
    """A host name that cannot turn into an ssh option or break a command line."""
    if not host or _BAD_HOST.search(host):
        raise UsageError(
            f"invalid {what} {host!r}: no spaces or control characters, and it cannot start with '-'",
            hint="use the login node's name or a Host alias from ~/.ssh/config",
        )
    return host


def _default_timeout(connect_timeout: float | None) -> float:
    if connect_timeout is not None:
        return connect_timeout
    raw = os.environ.get("RV_CONNECT_TIMEOUT", "10")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"RV_CONNECT_TIMEOUT must be a number of seconds, not {raw!r}", hint="e.g. RV_CONNECT_TIMEOUT=20"
        ) from None
    if value <= 0:
        raise ConfigError(
            f"RV_CONNECT_TIMEOUT must be positive, not {raw!r}", hint="e.g. RV_CONNECT_TIMEOUT=20"
        )
    return value


def resolve_target(
    host: str,
    *,
    port: int | None = None,
    user: str | None = None,
    identity_file: str | None = None,
    known_hosts: str | None = None,
    ssh_config_path: str | Path | None = None,
    connect_timeout: float | None = None,
    use_openssh: bool | None = None,
) -> SSHTarget:
    """Merge what the profile says with ~/.ssh/config as OpenSSH reads it.

    The profile wins where it sets a value (it was written by `rv init` on purpose); the SSH config
    fills in the rest: Host aliases, HostName, User, Port, IdentityFile, UserKnownHostsFile,
    ProxyJump (every hop) and ProxyCommand. ``ssh -G`` answers when an ``ssh`` binary is installed
    (``use_openssh=None``), so ``Include``, ``Match`` and tokens mean exactly what they mean to
    OpenSSH; otherwise paramiko's parser reads the file, with ``Include`` expanded by us.
    ``ssh_config_path`` (or ``$RV_SSH_CONFIG``) replaces the user's and the system's config files.
    """
    check_host(host)
    raw_path = ssh_config_path or os.environ.get("RV_SSH_CONFIG")
    path = Path(raw_path).expanduser() if raw_path else None
    timeout = _default_timeout(connect_timeout)
    ssh = shutil.which("ssh") if use_openssh is not False else None
    if use_openssh and ssh is None:
        raise UsageError("ssh is not installed here, so `ssh -G` cannot be asked")
    if ssh is not None:
        found: str = ssh

        def lookup(h: str, p: int | None, u: str | None) -> dict[str, list[str]]:
            return _openssh_lookup(found, path, h, p, u)
    else:
        from rv.ssh import paramiko_lookup

        def lookup(h: str, p: int | None, u: str | None) -> dict[str, list[str]]:
            return paramiko_lookup(path, h, p, u)

    return _resolve(lookup, host, port, user, identity_file, known_hosts, timeout, None, 0)


def _resolve(
    lookup: Callable[[str, int | None, str | None], dict[str, list[str]]],
    host: str,
    port: int | None,
    user: str | None,
    identity_file: str | None,
    known_hosts: str | None,
    timeout: float,
    jumps: list[str] | None,
    depth: int,
) -> SSHTarget:
    if depth > _MAX_HOPS:
        raise ConfigError(
            f"the ProxyJump chain to {host} has more than {_MAX_HOPS} hops (a loop in ~/.ssh/config?)",
            hint="check the ProxyJump lines of your SSH config (`ssh -G HOST` shows what OpenSSH reads)",
        )
    entry = lookup(host, port, user)

    def first(key: str) -> str | None:
        values = entry.get(key)
        return values[0] if values else None

    identities = (identity_file,) if identity_file else _configured_identities(entry.get("identityfile", []))
    known = known_hosts or _configured_known_hosts(first("userknownhostsfile"))
    proxy = jumps if jumps is not None else _jump_list(first("proxyjump"))
    jump = None
    if proxy:
        # OpenSSH's rule for `ProxyJump a,b`: reach b through a, then the target through b. The
        # last hop is connected with the rest of the list as its own jumps (its config's ProxyJump is
        # overridden); the first hop follows its own config.
        last_user, last_host, last_port = _parse_jump(proxy[-1])
        jump = _resolve(
            lookup,
            last_host,
            last_port,
            last_user,
            None,
            known_hosts,
            timeout,
            proxy[:-1] or None,
            depth + 1,
        )
    command = first("proxycommand")
    return SSHTarget(
        host=host,
        hostname=first("hostname") or host,
        port=port or int(first("port") or 22),
        user=user or first("user"),
        identity_files=tuple(str(Path(i).expanduser()) for i in identities),
        known_hosts=known,
        proxy_jump=jump,
        connect_timeout=timeout,
        proxy_command=None if jump is not None or not command or command.lower() == "none" else command,
    )


def _jump_list(value: str | None) -> list[str]:
    if not value or value.lower() == "none":
        return []
    return [hop.strip() for hop in value.split(",") if hop.strip()]


def _parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]``, ``ssh://[user@]host[:port]`` or ``[user@][v6addr]:port``."""
    spec = spec.removeprefix("ssh://").rstrip("/")
    user, _, rest = spec.rpartition("@")
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":")
    else:
        host, _, port = rest.partition(":")
    if port and not port.isdigit():
        raise ConfigError(f"ProxyJump hop {spec!r} has a port that is not a number")
    check_host(host, "ProxyJump host")
    return user or None, host, int(port) if port else None


# OpenSSH lists these when the config names no IdentityFile; then paramiko's own search
# (look_for_keys) is the equivalent, and the list means "none configured".
_DEFAULT_IDENTITIES = {
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ecdsa_sk",
    "id_ed25519",
    "id_ed25519_sk",
    "id_xmss",
}


def _configured_identities(values: list[str]) -> tuple[str, ...]:
    if len(values) > 1 and all(
        posixpath.dirname(v) in ("~/.ssh", str(Path.home() / ".ssh"))
        and posixpath.basename(v) in _DEFAULT_IDENTITIES
        for v in values
    ):
        return ()
    return tuple(values)


def _configured_known_hosts(value: str | None) -> str | None:
    """The first UserKnownHostsFile, or None when it is OpenSSH's default (then $HOME's is used)."""
    if not value:
        return None
    first = value.split()[0]
    for home in {str(Path.home()), _passwd_home()}:
        if first in (f"{home}/.ssh/known_hosts", "~/.ssh/known_hosts"):
            return None
    return first


def _passwd_home() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return str(Path.home())


def _openssh_lookup(
    ssh: str, path: Path | None, host: str, port: int | None, user: str | None
) -> dict[str, list[str]]:
    """What OpenSSH would use for ``host``: ``ssh -G``, which reads the config and connects nowhere."""
    cmd = [ssh, "-G"]
    if path is not None:
        cmd += ["-F", str(path) if path.exists() else os.devnull]
    if port:
        cmd += ["-p", str(port)]
    if user:
        cmd += ["-l", user]  # `Match user` depends on it
    cmd += ["--", host]
    try:
        proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=20)
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(
            f"`ssh -G {host}` did not finish in 20 s (a slow `Match exec` in your SSH config?)",
            hint="run `ssh -G " + host + "` to see where it stops",
        ) from exc
    if proc.returncode != 0:
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ConfigError(
            f"OpenSSH cannot read the SSH config for {host}: {lines[-1] if lines else 'no message'}",
            hint=f"fix the line it names, then check with `ssh -G {host}`",
        )
    return parse_ssh_g(proc.stdout.decode("utf-8", "replace"))


def parse_ssh_g(text: str) -> dict[str, list[str]]:
    """``ssh -G`` output: one ``key value`` per line, keys lower case; repeated keys collect."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            out.setdefault(key.lower(), []).append(value.strip())
    return out


# --------------------------------------------------------------------------------------------------
# Opening one for a profile


def profile_mask(profile: Profile) -> int:
    return GROUP_MASK if profile.share_with_group else PRIVATE_MASK


def open_transport(
    profile: Profile,
    *,
    confirm_host_key: Callable[[str, str, str], bool] | None = None,
    config_path: Path | None = None,
    target: SSHTarget | None = None,
    direct: bool = False,
) -> Any:
    """A connected transport for ``profile``: the warm background connection unless switched off.

    ``RV_WARM_SECONDS=0`` (or a platform without Unix sockets) connects directly, as rv did before.
    ``direct``: a connection of this process's own (rv.ssh.SSHTransport), for what the warm one
    cannot carry: terminals (``rv up``, ``rv ssh``) and tunnels (``rv forward``).
    """
    if target is None:
        target = resolve_target(
            profile.host,
            port=profile.port,
            user=profile.user,
            identity_file=profile.identity_file,
            known_hosts=profile.known_hosts,
        )
    mask = profile_mask(profile)
    from rv import warm

    if warm.enabled() and not direct:
        return warm.WarmTransport(
            target,
            profile_key=warm.profile_key(config_path, profile.name),
            confirm_host_key=confirm_host_key,
            mask=mask,
        ).connect()
    from rv.ssh import SSHTransport

    return SSHTransport(target, confirm_host_key, mask=mask).connect()


# --------------------------------------------------------------------------------------------------
# Local: the unit-test seam


@dataclass
class LocalTransport(_Collecting):
    """Runs commands with local bash and moves files with the local file system."""

    env: dict[str, str] | None = None
    calls: list[str] = field(default_factory=list)  # every command run, so tests can count round trips
    mask: int = PRIVATE_MASK

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
            start_new_session=True,  # so a kill reaches the command's children too
        )

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(proc.pid, signal.SIGKILL)

        # As over SSH: stdout is read (and its callback runs) in this thread, so an exception from
        # a callback (Ctrl-C in a progress bar) stops the command; stdin and stderr have threads.
        failure: list[BaseException] = []
        threads = []

        def pump_stderr() -> None:
            assert proc.stderr is not None
            fd = proc.stderr.fileno()
            try:
                for chunk in iter(lambda: os.read(fd, _CHUNK), b""):
                    if on_stderr is not None:
                        on_stderr(chunk)
            except BaseException as exc:  # handed to the caller below, never dropped
                failure.append(exc)
                kill()

        threads.append(threading.Thread(target=pump_stderr, daemon=True))
        if stdin is not None:
            source = _chunks(stdin)

            def feed() -> None:
                assert proc.stdin is not None
                while True:
                    try:
                        chunk = next(source)
                    except StopIteration:
                        break
                    except BaseException as exc:  # handed to the caller below, never dropped
                        failure.append(
                            TransferError(f"upload stopped: reading the data to send failed: {exc}")
                        )
                        failure[-1].__cause__ = exc
                        kill()
                        return
                    try:
                        proc.stdin.write(chunk)
                        proc.stdin.flush()  # as over SSH: each chunk is sent as it comes
                    except (BrokenPipeError, ValueError):
                        return  # the command exited early: its exit code and stderr say why
                with contextlib.suppress(BrokenPipeError):  # exited before reading everything
                    proc.stdin.close()

            threads.append(threading.Thread(target=feed, daemon=True))
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        try:
            while True:
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                ready, _, _ = select.select([fd], [], [], wait)
                if ready:
                    data = os.read(fd, _CHUNK)
                    if not data:
                        break
                    on_stdout(data)
                if deadline is not None and time.monotonic() >= deadline:
                    raise RemoteTimeout(f"command timed out after {timeout:g}s: {command[:80]}")
            code = proc.wait()
        except BaseException:
            # Ctrl-C, a timeout, a callback's error: the command must not outlive us (as a closed channel).
            kill()
            proc.wait()
            raise
        finally:
            for t in threads:
                t.join(timeout=5)
            proc.stdout.close()
            if proc.stderr is not None:
                proc.stderr.close()
        if failure:
            raise failure[0]
        return code

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None:
        self._put([data], remote_path, file_mode(mode, self.mask))

    def _put(self, chunks: Iterable[bytes], remote_path: str, mode: int) -> None:
        tmp = _temp_name(remote_path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, mode)  # umask must not widen or narrow what the caller asked for
            with os.fdopen(fd, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
            os.replace(tmp, remote_path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        want = file_mode(mode, self.mask) if mode is not None else local_file_mode(local_path, self.mask)
        self._put(read_chunks(local_path), remote_path, want)

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        local = Path(local_path)
        tmp = local.with_name(f".{local.name}.rv-tmp-{os.urandom(6).hex()}")
        tmp.write_bytes(Path(remote_path).read_bytes())
        tmp.replace(local)

    def close(self) -> None:
        pass


def __getattr__(name: str) -> Any:
    # Lazy re-exports: `from rv.transport import SSHTransport` works, but importing this module
    # never imports paramiko (150-350 ms); only code that really connects pays for it.
    if name in ("SSHTransport", "fingerprint"):
        from rv import ssh

        return getattr(ssh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
