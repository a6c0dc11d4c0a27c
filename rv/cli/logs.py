"""`rv logs [JOB]`: print or follow a job's output (stdout by default, --err for stderr)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rv.cli.common import note, session


@click.command()
@click.argument("job", required=False)
@click.option("--err", "stderr", is_flag=True, help="Show what the program wrote to stderr.")
@click.option(
    "-f", "--follow", is_flag=True, help="Keep streaming until the job ends (Ctrl-C stops watching)."
)
@click.option("--tail", "lines", type=click.IntRange(min=0), help="Only the last N lines.")
@click.option("--node", type=click.IntRange(min=0), help="Only node I's log of a multi-node job.")
@click.option("--raw", is_flag=True, help="Keep carriage-return progress redraws as written.")
@click.option("--pull", is_flag=True, help="Download the log files to ./rv-logs/JOBID/ instead.")
@click.pass_context
def logs(
    ctx: click.Context,
    job: str | None,
    stderr: bool,
    follow: bool,
    lines: int | None,
    node: int | None,
    raw: bool,
    pull: bool,
) -> None:
    """Show the output of JOB (an id, a unique id prefix or a name; default: the latest job)."""
    from rv import launch
    from rv.config import state_dir
    from rv.errors import UsageError
    from rv.jobs import JobStore
    from rv.layout import RemoteLayout
    from rv.logview import LineCollapser

    with session(ctx) as s:
        record = JobStore(state_dir() / "jobs.json").resolve(job, s.profile.name)
        if node is not None and node >= record.nodes:
            raise UsageError(
                f"--node {node}: job {record.job_id} ran on {record.nodes} node(s) (0..{record.nodes - 1})"
            )
        layout = RemoteLayout(record.remote_root)
        stream = "err" if stderr else "out"
        if pull:
            _pull(s.transport, layout, record, node)
            return
        collapser = LineCollapser(raw=raw)
        sink = sys.stdout

        def write(data: bytes) -> None:
            sink.write(collapser.feed(data.decode("utf-8", errors="replace")))
            sink.flush()

        # The chosen stream goes to stdout either way, so `rv logs --err | grep` works.
        try:
            launch.stream_logs(
                s.transport, layout, record, on_stdout=write, on_stderr=write, follow=follow,
                lines=lines, node=node, which=(stream,),
            )  # fmt: skip
        except KeyboardInterrupt:
            note(f"\nstopped watching; job {record.job_id} is not affected")
        sink.write(collapser.flush())


def _pull(transport, layout, record, node) -> None:  # type: ignore[no-untyped-def]
    from rv import launch
    from rv.errors import RemoteError

    dest = Path("rv-logs") / record.job_id
    dest.mkdir(parents=True, exist_ok=True)
    got = []
    for stream in ("out", "err"):
        for path in launch.log_paths(layout, record, stream, node):
            local = dest / path.rsplit("/", 1)[-1]
            try:
                transport.get_file(path, local)
                got.append(str(local))
            except RemoteError:
                continue  # a per-node log that was never written (single-node job) is not an error
    note(f"downloaded {len(got)} file(s) to {dest}/")
    for p in got:
        click.echo(p)
