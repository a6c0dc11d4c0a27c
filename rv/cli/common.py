"""What every command needs: the chosen profile, one lazily opened connection, and stderr output."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import click
from rich.console import Console

from rv.config import Config, Profile, load_config
from rv.layout import RemoteLayout

# Chatter (progress, warnings, hints) goes to stderr; stdout is for data so `--json` stays parseable.
# rich honours NO_COLOR and drops styling when stderr is not a terminal.
err_console = Console(stderr=True, highlight=False)


def note(message: str) -> None:
    # Paths may hold "[...]" (not rich markup) and must not be wrapped mid-line when piped.
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    err_console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True, style="yellow")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def confirm_host_key_interactively(host: str, key_type: str, fp: str) -> bool:
    """Ask before trusting a host key we have never seen; without a terminal, refuse."""
    err_console.print(f"The host key of [bold]{host}[/] is not known yet:\n  {key_type} {fp}")
    if not sys.stdin.isatty():
        return False
    return click.confirm("Trust it and remember it?", default=False, err=True)


@dataclass
class Session:
    config: Config
    profile: Profile
    _transport: Any = field(default=None, repr=False)

    @property
    def transport(self):  # -> rv.transport.SSHTransport; imported lazily (paramiko is slow to import)
        if self._transport is None:
            from rv.transport import SSHTransport, resolve_target

            p = self.profile
            target = resolve_target(
                p.host, port=p.port, user=p.user, identity_file=p.identity_file, known_hosts=p.known_hosts
            )
            self._transport = SSHTransport(target, confirm_host_key_interactively).connect()
        return self._transport

    @property
    def layout(self) -> RemoteLayout:
        return RemoteLayout(self.profile.require_remote_root())

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def reconnect(self):  # -> rv.transport.SSHTransport
        """A fresh connection, after the old one dropped (following a run survives that)."""
        self.close()
        return self.transport

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def load_profile(ctx: click.Context) -> tuple[Config, Profile]:
    config = load_config()
    return config, config.profile(ctx.find_root().obj.get("profile"))


def run_store():  # -> rv.job.records.RunStore
    from rv.config import state_dir
    from rv.job.records import RunStore

    return RunStore(state_dir() / "runs.json")


@contextmanager
def session(ctx: click.Context) -> Iterator[Session]:
    config, profile = load_profile(ctx)
    s = Session(config, profile)
    try:
        yield s
        if s.connected:
            _sweep(s)
    finally:
        s.close()


def _sweep(s: Session) -> None:
    """Secrets a killed job could not remove: the next command that talks to the cluster does."""
    from rv.errors import RvError
    from rv.job.cleanup import sweep_secrets

    try:
        sweep_secrets(s.transport, run_store(), s.profile.name, s.layout.root, note)
    except RvError as exc:
        warn(f"could not check for leftover secrets of ended runs: {exc.message}")
