"""`rv exec CMD...`: run a command on the login node, stream its output, exit with its code."""

from __future__ import annotations

import sys

import click

from rv.cli.common import session, stream_writer


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
    with session(ctx) as s:
        code = s.transport.stream(
            " ".join(command),
            on_stdout=stream_writer(sys.stdout.buffer),
            on_stderr=stream_writer(sys.stderr.buffer),
            timeout=timeout,
        )
    ctx.exit(code)
