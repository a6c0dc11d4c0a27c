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

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def load_profile(ctx: click.Context) -> tuple[Config, Profile]:
    config = load_config()
    return config, config.profile(ctx.find_root().obj.get("profile"))


@contextmanager
def session(ctx: click.Context) -> Iterator[Session]:
    config, profile = load_profile(ctx)
    s = Session(config, profile)
    try:
        yield s
    finally:
        s.close()
