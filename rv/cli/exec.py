"""`rv exec CMD...`: run a command on the login node, stream its output, exit with its code."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import BinaryIO

import click

from rv.cli.common import session


@click.command(
    "exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def exec_(ctx: click.Context, timeout: float | None, command: tuple[str, ...]) -> None:
    """Run COMMAND on the login node; its output streams back and its exit code becomes rv's.

    As with ssh, the words are joined with spaces and run by the remote shell, so
    `rv exec 'echo $HOME'` expands on the cluster.
    """
    out, err = sys.stdout.buffer, sys.stderr.buffer

    def write(stream: BinaryIO) -> Callable[[bytes], None]:  # flush per chunk: output appears as written
        def _write(data: bytes) -> None:
            stream.write(data)
            stream.flush()

        return _write

    with session(ctx) as s:
        code = s.transport.stream(
            " ".join(command), on_stdout=write(out), on_stderr=write(err), timeout=timeout
        )
    ctx.exit(code)
