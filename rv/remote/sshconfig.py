"""Where to connect: the profile's values laid over what OpenSSH makes of ``~/.ssh/config``.

:func:`resolve_target` asks ``ssh -G`` (``Include``, ``Match``, tokens, every hop of a ``ProxyJump``
chain mean what they mean to OpenSSH); only where no ``ssh`` binary is installed does paramiko's
parser read the files (:func:`paramiko_lookup`, with ``Include`` expanded by us). Nothing here
connects: rv.remote.ssh does, with the :class:`SSHTarget` this module gives.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rv.errors import ConfigError, UsageError

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
# ~/.ssh/config without OpenSSH


def paramiko_lookup(path: Path | None, host: str, port: int | None, user: str | None) -> dict[str, list[str]]:
    """What paramiko's parser makes of the SSH config, with ``Include`` expanded (paramiko ignores it).

    Used only where no ``ssh`` binary is installed; keys and values as ``ssh -G`` would give them.
    """
    files = [path] if path is not None else [Path("~/.ssh/config").expanduser(), Path("/etc/ssh/ssh_config")]
    text = "\n".join(
        _with_includes(f, user_file=(f != Path("/etc/ssh/ssh_config"))) for f in files if f.exists()
    )
    paramiko = _paramiko()
    if "exec" in text and paramiko.config.invoke is None:
        with contextlib.suppress(ImportError):  # then paramiko names the missing invoke itself
            import invoke

            paramiko.config.invoke = invoke
    cfg = paramiko.SSHConfig.from_text(text)
    try:
        entry = cfg.lookup(host)
    except (paramiko.SSHException, ImportError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the SSH config for {host}: {exc}", hint="fix the line it names"
        ) from exc
    out: dict[str, list[str]] = {}
    for key, value in entry.items():
        out[key.lower()] = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    if port:
        out["port"] = [str(port)]
    if user:
        out["user"] = [user]
    if "user" not in out:
        import getpass

        out["user"] = [getpass.getuser()]  # as `ssh -G` reports (and as paramiko would log in)
    return out


def _with_includes(path: Path, *, user_file: bool, depth: int = 0) -> str:
    """The file's text with every ``Include`` line replaced by the files it names (globs, in order)."""
    import glob

    if depth > 16:
        raise ConfigError(f"SSH config Include nesting is too deep at {path} (an Include loop?)")
    base = Path("~/.ssh").expanduser() if user_file else Path("/etc/ssh")
    lines = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0].lower() == "include":
            for pattern in words[1].split():
                pattern = os.path.expanduser(pattern)
                full = pattern if os.path.isabs(pattern) else str(base / pattern)
                for match in sorted(glob.glob(full)):
                    lines.append(_with_includes(Path(match), user_file=user_file, depth=depth + 1))
        else:
            lines.append(line)
    return "\n".join(lines)


def _paramiko() -> Any:
    # Only where no ssh binary is installed; rv.remote.ssh imports paramiko for connecting (without invoke,
    # which only `Match exec` needs: loaded above when the config has such a line).
    import paramiko

    return paramiko
