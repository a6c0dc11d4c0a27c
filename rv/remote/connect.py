"""How a command reaches the cluster: every choice on the way is made here, and only here.

::

    you type `rv ps`
      rv.entry          the `rv` program, a front end that imports almost nothing
        │  served?      in_process_reason(): a served command, the command server up, not switched off
        ├── yes ──────▶ rv.forkserver   the command server (rv imported) forks a copy per command
        │                 │
        └── no ───────▶ rv.cli.main     the CLI in this process (and it starts the server for next time)
                          │
      rv.cli.common     Session.transport, on its first use ─▶ open_transport() here
        │  warm?        use_warm(): RV_WARM_SECONDS > 0 and no terminal or tunnel wanted
        ├── yes ──────▶ rv.remote.warm.WarmTransport ── Unix socket ──▶ the profile's background process
        │                 │                        (rv.remote.warmd: forked from the command server, or
        │                 │                        started) holding an rv.remote.ssh.SSHTransport
        │                 │  serves?    WarmFirst here: the warm one until it cannot take a call (nothing
        │                 │             ran; on its first use: none running yet, or it will not start)
        │                 └── no ─────▶ direct, from then on ─┐
        └── no ───────▶ rv.remote.ssh.SSHTransport ◀──────────┘  a connection of this process's own
                          │
      rv.remote.ssh            which channel, channels(): for an agent call, a pre-started agent; else a
                        pre-started login shell (the hot shell); else a new exec channel

The transports share one API (rv.remote.transport.Transport); nothing below this module chooses a route,
and nothing here moves a byte. Each mechanism can be switched off alone (benchmarks/cli.py measures
what each earns): ``RV_COMMAND_SERVER=0`` runs every command in the rv process, ``RV_WARM_SECONDS=0``
connects directly every time (and so runs in the rv process: the server would only fork a copy
that connects on its own), ``RV_HOT_SHELL=0`` starts each command's shell on demand (and so every
agent), ``RV_PRESTART_AGENTS=0`` keeps the hot shell but starts the agent per call.

The front end imports this module before anything else: it imports only what Python has loaded at
start-up (and rv.commands, plain data); everything else is imported where it is used.
"""

from __future__ import annotations

import os
import sys

from rv.commands import lookup

TYPE_CHECKING = False  # typing's own costs the front end an import; mypy reads any TYPE_CHECKING
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path
    from typing import Any, TypeVar

    from rv.config import Profile
    from rv.remote.ssh import SSHTransport
    from rv.remote.sshconfig import SSHTarget
    from rv.remote.transport import RunResult, Transport
    from rv.remote.warm import WarmTransport

    T = TypeVar("T")

DEFAULT_WARM_S = 300.0


def debug(message: str) -> None:
    """One line on stderr with ``RV_DEBUG=1``: which way a command went, and why."""
    if os.environ.get("RV_DEBUG") == "1":
        sys.stderr.write(f"rv: debug: {message}\n")
        sys.stderr.flush()


# --------------------------------------------------------------------------------------------------
# Served or in-process (asked by the front end, rv.entry)


def command_of(argv: list[str]) -> str | None:
    """The subcommand of ``rv [--profile P] COMMAND ...``; None for ``rv --help``, ``rv --version``
    and anything the CLI itself should explain."""
    args = iter(argv)
    for arg in args:
        if arg in ("-p", "--profile"):
            next(args, None)
        elif arg.startswith("--profile=") or (arg.startswith("-p") and not arg.startswith("--")):
            continue
        elif arg.startswith("-"):
            return None
        else:
            return arg
    return None


def in_process_reason(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """None when the command server may run ``rv ARGV``; otherwise why it runs in this process."""
    if os.name != "posix":
        return "no Unix sockets on this system"
    if environ.get("RV_COMMAND_SERVER", "1") == "0":
        return "RV_COMMAND_SERVER=0"
    raw = environ.get("RV_WARM_SECONDS", "")
    try:
        if raw and float(raw) <= 0:
            return f"RV_WARM_SECONDS={raw}"
    except ValueError:
        return f"RV_WARM_SECONDS={raw!r} is not a number (the CLI says so)"
    name = command_of(argv)
    command = lookup(name) if name else None
    if command is None:
        return "no command to serve (help, version, or one the CLI explains)"
    if not command.served:
        return f"`rv {name}` needs this terminal as its own"
    return None


# --------------------------------------------------------------------------------------------------
# Warm or direct, and which channel (asked when a command first needs the cluster)


def warm_seconds() -> float:
    """``RV_WARM_SECONDS``: how long a warm connection waits for the next command (0: none)."""
    raw = os.environ.get("RV_WARM_SECONDS", "")
    if not raw:
        return DEFAULT_WARM_S
    try:
        value = float(raw)
    except ValueError:
        from rv.errors import ConfigError

        raise ConfigError(
            f"RV_WARM_SECONDS must be a number of seconds, not {raw!r}",
            hint="e.g. RV_WARM_SECONDS=600, or 0 to connect afresh for every command",
        ) from None
    return max(0.0, value)


def use_warm(*, direct: bool = False) -> bool:
    """Go through the profile's warm connection? Not for a terminal or a tunnel (``direct``: the
    background process carries neither), not when switched off, not without Unix sockets."""
    import socket

    return not direct and os.name == "posix" and hasattr(socket, "AF_UNIX") and warm_seconds() > 0


def channels() -> dict[str, bool]:
    """What a warm connection keeps started on the login node for the next commands (rv.remote.ssh):
    ``hot_shell``, a login shell (its rc files already read); ``agents``, rv's agent, python
    started and its modules loaded (it waits in such a shell, so it needs ``hot_shell``)."""
    hot_shell = os.environ.get("RV_HOT_SHELL", "1") != "0"
    return {"hot_shell": hot_shell, "agents": hot_shell and os.environ.get("RV_PRESTART_AGENTS", "1") != "0"}


def profile_mask(profile: Profile) -> int:
    """What the profile lets others read of what rv writes on the cluster."""
    from rv.remote.transport import GROUP_MASK, PRIVATE_MASK

    return GROUP_MASK if profile.share_with_group else PRIVATE_MASK


# (config file, profile name) -> where prewarm found it connects, so the command need not ask ssh -G again
_resolved: dict[tuple[str, str], SSHTarget] = {}


def target_for(profile: Profile, config_path: Path | str | None) -> SSHTarget:
    """Where ``profile`` connects: the profile over what OpenSSH makes of ~/.ssh/config."""
    found = _resolved.get((str(config_path), profile.name))
    if found is not None:
        return found
    from rv.remote.sshconfig import resolve_target

    target = resolve_target(
        profile.host,
        port=profile.port,
        user=profile.user,
        identity_file=profile.identity_file,
        known_hosts=profile.known_hosts,
    )
    _resolved[(str(config_path), profile.name)] = target
    return target


def open_transport(
    profile: Profile,
    *,
    confirm_host_key: Callable[[str, str, str], bool] | None = None,
    config_path: Path | str | None = None,
) -> Transport:
    """A connected transport for ``profile``: the warm background connection unless use_warm() says
    no, then a connection of this process's own.

    The warm one is used while it serves (:class:`WarmFirst`); when it cannot (no process and none
    can start, a stale or dying one, a dropped connection: rv.remote.warm.WarmUnavailable, raised
    only before anything ran), the command goes over a direct connection, said on stderr. A command
    that started is never sent again: what fails after it started is that command's error.
    """
    if not use_warm():
        debug("connection: direct (RV_WARM_SECONDS=0)")
        return direct_connection(profile, confirm_host_key=confirm_host_key, config_path=config_path)
    from rv.remote import warm

    def connect_directly() -> SSHTransport:
        return direct_connection(profile, confirm_host_key=confirm_host_key, config_path=config_path)

    client = warm.WarmTransport(
        target_for(profile, config_path),
        profile_key=warm.profile_key(config_path, profile.name),
        confirm_host_key=confirm_host_key,
        mask=profile_mask(profile),
        idle=warm_seconds(),
        channels=channels(),
    )
    try:
        client.connect()
    except warm.Cold:
        debug("connection: direct this time (the warm connection starts for the next command)")
        return connect_directly()
    except warm.WarmUnavailable as exc:
        return _directly_because(exc, connect_directly)
    debug(f"connection: warm ({'reused' if client.reused else 'new'}, pid {client.daemon_pid})")
    return WarmFirst(client, connect_directly)


def _directly_because(reason: Exception, connect_directly: Callable[[], SSHTransport]) -> SSHTransport:
    """The warm connection cannot serve (nothing ran): say so on stderr, and connect directly."""
    sys.stderr.write(f"rv: note: connecting directly ({reason})\n")
    return connect_directly()


class WarmFirst:
    """The transport of a command whose warm connection answered: every call goes through it until
    it cannot serve one (WarmUnavailable: nothing ran); that call and every later one then go over
    a connection of this process's own. The one place a warm command turns direct."""

    def __init__(self, warm: WarmTransport, connect_directly: Callable[[], SSHTransport]) -> None:
        self.warm = warm
        self.direct: SSHTransport | None = None
        self._connect_directly = connect_directly

    @property
    def via_warm(self) -> bool:
        """Do the calls still go through the warm connection?"""
        return self.direct is None

    def _route(self, call: Callable[[WarmTransport | SSHTransport], T]) -> T:
        if self.direct is None:
            from rv.remote.warm import WarmUnavailable

            try:
                return call(self.warm)
            except WarmUnavailable as exc:
                self.direct = _directly_because(exc, self._connect_directly)
        return call(self.direct)

    def connect(self) -> WarmFirst:
        return self  # connected already: open_transport reached the warm connection (`rv status` asks)

    def reconnect(self) -> None:
        """A fresh connection, this process's own, for the calls from now on: one was lost while a
        call ran (rv.remote.agent_client.call_agent asks). The warm one, its connection gone, exits."""
        if self.direct is not None:
            self.direct.close()
        self.direct = None
        self.direct = self._connect_directly()

    # The Transport API (rv.remote.transport.Transport), each call routed.
    def stream(self, command: str, **options: Any) -> int:
        return self._route(lambda t: t.stream(command, **options))

    def run(self, command: str, **options: Any) -> RunResult:
        return self._route(lambda t: t.run(command, **options))

    def run_agent(self, mode: str, args: dict[str, Any], **options: Any) -> RunResult:
        return self._route(lambda t: t.run_agent(mode, args, **options))

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o600) -> None:
        self._route(lambda t: t.put_bytes(data, remote_path, mode))

    def put_file(self, local_path: str | Path, remote_path: str, mode: int | None = None) -> None:
        self._route(lambda t: t.put_file(local_path, remote_path, mode))

    def get_file(self, remote_path: str, local_path: str | Path) -> None:
        self._route(lambda t: t.get_file(remote_path, local_path))

    def close(self) -> None:
        self.warm.close()
        if self.direct is not None:
            self.direct.close()
            self.direct = None

    def __enter__(self) -> WarmFirst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def direct_connection(
    profile: Profile,
    *,
    confirm_host_key: Callable[[str, str, str], bool] | None = None,
    config_path: Path | str | None = None,
) -> SSHTransport:
    """A connection of this process's own: what open_transport falls back to, and what carries
    terminals (``rv up``, ``rv ssh``) and tunnels (``rv forward``), which the warm one cannot."""
    from rv.remote.ssh import SSHTransport

    target = target_for(profile, config_path)
    return SSHTransport(target, confirm_host_key, mask=profile_mask(profile)).connect()


def prewarm(profile_name: str | None) -> None:
    """Start the profile's warm connection in the background, if it has none (see rv.remote.warm).

    Purely a head start: when anything stands in the way (no config yet, a bad profile, no private
    runtime folder) nothing is started here, and the command meets and reports the same problem
    when it connects, as it would have without this.
    """
    from rv.errors import RvError

    try:
        if not use_warm():
            return
    except RvError:
        return  # the command reports the bad value
    from rv.config import load_config
    from rv.remote import warm

    try:
        config = load_config()
        profile = config.profile(profile_name)
        warm.WarmTransport(
            target_for(profile, config.path),
            profile_key=warm.profile_key(config.path, profile.name),
            mask=profile_mask(profile),
            idle=warm_seconds(),
            channels=channels(),
        ).prewarm()
    except (RvError, OSError, warm.WarmUnavailable) as exc:
        debug(f"no head start for the warm connection: {exc}")  # the command itself reports it
