"""What every command needs: the chosen profile, one lazily opened connection, and stderr output.

Nothing here imports rich or paramiko at import time: `rv ps` on a warm connection must not pay for
either. rich is loaded on the first styled message or progress bar on a terminal; paramiko only if
the command has to connect directly (rv.remote.connect decides).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import click

from rv.config import Config, Profile, load_config
from rv.layout import RemoteLayout

if TYPE_CHECKING:
    from rich.console import Console

    from rv.files.progress import Progress, TransferProgress
    from rv.job.records import RunStore
    from rv.job.secretsweep import SecretsSweep
    from rv.remote.ssh import SSHTransport
    from rv.remote.transport import Transport


class _LazyConsole:
    """rich's stderr Console, created on first use (importing rich costs ~40 ms).

    Chatter (progress, warnings, hints) goes to stderr; stdout is for data so `--json` stays
    parseable. rich honours NO_COLOR and drops styling when stderr is not a terminal.
    """

    _console: Console | None = None

    def _get(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    @property
    def is_terminal(self) -> bool:
        if self._console is None:
            return sys.stderr.isatty()
        return self._console.is_terminal


err_console: Any = _LazyConsole()


def _plain(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def note(message: str) -> None:
    # Paths may hold "[...]" (not rich markup) and must not be wrapped mid-line when piped.
    if not err_console.is_terminal:
        _plain(message)
        return
    err_console.print(message, markup=False, highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    if not err_console.is_terminal or os.environ.get("NO_COLOR"):
        _plain(f"warning: {message}")
        return
    err_console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True, style="yellow")


def tell_desktop(name: str, ended: Any, state: str) -> None:
    """``--notify desktop``: a notification on this machine, else the terminal's bell and a line."""
    from rv.notify import desktop_notify, end_words

    title, body = end_words(name, ended, state)
    if desktop_notify(title, body) is None:
        sys.stderr.write("\a")
        note(f"{title}: {body}")


def escape(text: str) -> str:
    """Text safe inside rich markup: ``[host]:port`` and ``[bold]`` in a path are printed, not parsed."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def stream_writer(stream: BinaryIO) -> Callable[[bytes], None]:
    """A callback writing remote output to ``stream`` as it comes, flushed per chunk."""

    def write(data: bytes) -> None:
        stream.write(data)
        stream.flush()

    return write


def node_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--node I`` of a command that reaches one node of a running job (0, the first, by default)."""
    return click.option("--node", type=click.IntRange(min=0), default=0, show_default=True, help=help_text)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def confirm_host_key_interactively(host: str, key_type: str, fp: str) -> bool:
    """Ask before trusting a host key we have never seen; without a terminal, refuse."""
    err_console.print(f"The host key of [bold]{escape(host)}[/] is not known yet:\n  {escape(key_type)} {fp}")
    if not sys.stdin.isatty():
        return False
    return click.confirm("Trust it and remember it?", default=False, err=True)


@dataclass
class Session:
    config: Config
    profile: Profile
    direct: bool = False  # a connection of this process's own, not the warm one (rv.remote.connect)
    _transport: Transport | None = field(default=None, repr=False)
    _connection: SSHTransport | None = field(default=None, repr=False)
    # The secrets sweep (rv.job.secretsweep): a command whose one call to the cluster can carry it
    # asks for the ids with sweep_along() and hands the reply to swept(); the session's end sweeps
    # otherwise.
    _sweep: SecretsSweep | None = field(default=None, repr=False)

    @property
    def transport(self) -> Transport:
        """The command's way to the cluster, connected on first use (rv.remote.connect chooses it)."""
        if self._transport is None:
            if self.direct:
                self._transport = self.connection
            else:
                from rv.remote.connect import open_transport

                self._transport = open_transport(
                    self.profile,
                    confirm_host_key=confirm_host_key_interactively,
                    config_path=self.config.path,
                )
        return self._transport

    @property
    def connection(self) -> SSHTransport:
        """A connection of this process's own (a session opened with ``direct``): what carries a
        terminal (``open_pty``) or a tunnel (``open_tunnel``), which the warm one cannot."""
        if not self.direct:
            raise RuntimeError("a terminal or tunnel needs session(ctx, direct=True)")
        if self._connection is None:
            from rv.remote.connect import direct_connection

            self._connection = direct_connection(
                self.profile, confirm_host_key=confirm_host_key_interactively, config_path=self.config.path
            )
        return self._connection

    @property
    def layout(self) -> RemoteLayout:
        return RemoteLayout(
            self.profile.require_remote_root(), share_with_group=self.profile.share_with_group
        )

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def reconnect(self) -> Transport:
        """A fresh connection, after the old one dropped (following a run survives that)."""
        self.close()
        return self.transport

    @property
    def secrets_sweep(self) -> SecretsSweep:
        if self._sweep is None:
            from rv.config import state_dir
            from rv.job.secretsweep import SecretsSweep

            self._sweep = SecretsSweep(
                state_dir() / "runs.json", self.profile.name, self.layout.root, note=note, warn=warn
            )
        return self._sweep

    def sweep_along(self) -> list[str]:
        """Run ids whose leftover secrets the command's own call to the cluster should sweep."""
        return self.secrets_sweep.along()

    def swept(self, reply: dict[str, Any] | None) -> None:
        """The reply of a sweep that rode along (None: none was asked for, or the call did not take it)."""
        self.secrets_sweep.swept(reply)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._connection is not None:
            self._connection.close()  # closing it twice (it was the transport too) does nothing
            self._connection = None


def load_profile(ctx: click.Context) -> tuple[Config, Profile]:
    config = load_config()
    return config, config.profile(ctx.find_root().obj.get("profile"))


def run_store() -> RunStore:
    from rv.config import state_dir
    from rv.job.records import RunStore

    return RunStore(state_dir() / "runs.json")


@contextmanager
def session(ctx: click.Context, *, direct: bool = False) -> Iterator[Session]:
    config, profile = load_profile(ctx)
    s = Session(config, profile, direct=direct)
    try:
        yield s
        if s.connected:
            # Secrets a killed job could not remove: the next command that talks to the cluster does.
            s.secrets_sweep.at_end(s.transport)
    finally:
        s.close()


# --------------------------------------------------------------------------------------------------
# Progress


@contextmanager
def progress_renderer(what: str, *, delay: float = 1.0) -> Iterator[Progress]:
    """A progress callback for the core's transfers (see rv.files.progress): a rich bar on a terminal.

    The bar appears only once a transfer has run ``delay`` seconds (short ones stay silent) and
    shows files, bytes, rate and time left; on a pipe or file nothing is drawn at all.
    """
    if not err_console.is_terminal:
        yield _ignore
        return
    start = time.monotonic()
    state: dict[str, Any] = {"bar": None, "task": None}

    def update(p: TransferProgress) -> None:
        if state["bar"] is None:
            if time.monotonic() - start < delay or p.finished:
                return
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as RichProgress

            bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[files]} files"),
                TimeRemainingColumn(),
                console=err_console._get(),
                transient=True,
            )
            bar.start()
            state["bar"] = bar
            state["task"] = bar.add_task(what, total=p.bytes_total, files="")
        state["bar"].update(
            state["task"],
            completed=p.bytes_done,
            total=p.bytes_total,
            files=f"{p.files_done:,}/{p.files_total:,}",
        )

    try:
        yield update
    finally:
        if state["bar"] is not None:
            state["bar"].stop()


def _ignore(p: TransferProgress) -> None:
    """No terminal to draw on: progress is dropped, by design (nothing on a pipe)."""


ProgressCallback = Callable[["TransferProgress"], None]


class SeparatedCommand(click.Command):
    """A command whose words after ``--`` are a command line of its own, never rv's options or
    arguments: they land in ``ctx.meta["rv.after_separator"]`` (None when there was no ``--``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        after: list[str] | None = None
        if "--" in args:
            i = args.index("--")
            args, after = args[:i], args[i + 1 :]
        ctx.meta["rv.after_separator"] = after
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- CMD...]"]
