"""`rv ssh [RUN] [--node I] [-- CMD...]`: a shell, or one command, on a node of a running job."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import click

from rv.cli.common import SeparatedCommand, node_option, run_store, session, stream_writer


@click.command(cls=SeparatedCommand)
@click.argument("run", required=False)
@node_option("Which node of the job: 0 is the first (rank 0's).")
@click.option("-t", "--tty", "tty", is_flag=True, help="A terminal for CMD too (htop, vim, a REPL).")
@click.pass_context
def ssh(ctx: click.Context, run: str | None, node: int, tty: bool) -> None:
    """A shell on a node of RUN's running job, in the job's environment and work dir; or CMD there.

    RUN is a run name, run id or job id (default: the latest run). The shell is a step of the job
    (`srun --overlap`): it sees the job's GPUs, and has what the program had (setup lines, secrets,
    RV_* variables, caches). With `-- CMD...` the words are joined and run by the job's shell, and
    rv exits with CMD's exit code.

    \b
      rv ssh                          a shell on the latest run's first node
      rv ssh train-3f9a --node 1      on its second node
      rv ssh train-3f9a -- nvidia-smi
    """
    from rv.errors import UsageError
    from rv.job.inside import attach_command, running_job

    words: list[str] | None = ctx.meta.get("rv.after_separator")
    if words is not None and not words:
        raise UsageError("nothing after --", hint="rv ssh RUN -- COMMAND [ARGS...], or no -- for a shell")
    command = " ".join(words) if words else None
    pty = command is None or tty
    if pty and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            "a shell (or -t) needs a terminal, and this is not one",
            hint="give a command instead: rv ssh RUN -- COMMAND",
        )
    # A terminal cannot travel over the warm connection: a connection of this command's own.
    with session(ctx, direct=pty) as s:
        rj = running_job(s.transport, run_store(), s.profile.name, s.layout.root, run)
        line = attach_command(rj.place, rj.node(node), command, pty=pty)
        if pty:
            from rv.remote.terminal import relay, term_name, terminal_size

            cols, rows = terminal_size()
            code = relay(s.connection.open_pty(line, term=term_name(), cols=cols, rows=rows))
        else:
            err = SrunExitFilter(stream_writer(sys.stderr.buffer))
            try:
                out = stream_writer(sys.stdout.buffer)
                code = s.transport.stream(line, on_stdout=out, on_stderr=err.write)
            finally:
                err.close()
    ctx.exit(code)


class SrunExitFilter:
    """stderr without srun's own "task 0: Exited with exit code N" line: rv exits with that code
    already, as ssh would, and says nothing more. Every other line passes, whole, as it comes."""

    _LINE = re.compile(rb"^srun: error: \S+: task \d+: Exited with exit code \d+\r?$")

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self.out = out
        self.partial = b""

    def write(self, data: bytes) -> None:
        *lines, self.partial = (self.partial + data).split(b"\n")
        kept = [line for line in lines if not self._LINE.match(line)]
        if kept:
            self.out(b"\n".join(kept) + b"\n")

    def close(self) -> None:
        if self.partial and not self._LINE.match(self.partial):
            self.out(self.partial)
        self.partial = b""
