"""`rv logs [RUN]`: a run's output, every segment in order (stdout by default, --err for stderr)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from rv.cli.common import note, run_store, session


@click.command()
@click.argument("run", required=False)
@click.option("--err", "stderr", is_flag=True, help="Show what the program wrote to stderr.")
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Keep streaming until the run ends; exit with its code (Ctrl-C stops).",
)
@click.option(
    "--tail", "lines", type=click.IntRange(min=0), help="Only the last N lines (of the last segment)."
)
@click.option("--node", type=click.IntRange(min=0), help="Only node I's log of a multi-node run.")
@click.option("--segment", type=click.IntRange(min=1), help="Only segment K of the run.")
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    help="Only what rank R printed, without its [R] label (runs of more than one process).",
)
@click.option("--raw", is_flag=True, help="The lines as written: progress redraws and rank labels kept.")
@click.option("--pull", is_flag=True, help="Download the log files to ./rv-logs/RUN/ instead.")
@click.pass_context
def logs(
    ctx: click.Context,
    run: str | None,
    stderr: bool,
    follow: bool,
    lines: int | None,
    node: int | None,
    segment: int | None,
    rank: int | None,
    raw: bool,
    pull: bool,
) -> None:
    """Show the output of RUN: a run name, a job id of any segment, or nothing (the latest run).

    Each segment's output is headed by one separator line. In a run of more than one process every
    line carries its rank, `[3] ...`; --rank 3 shows rank 3's lines alone.
    """
    from rv.cli.following import TerminalView
    from rv.job import query
    from rv.job.records import parse_runs, run_exit_code
    from rv.job.watch import follow_run

    store = run_store()
    with session(ctx) as s:
        if pull:
            sweep = s.sweep_along()
            found = query.resolve(s.transport, store, s.profile.name, s.layout.root, run, sweep=sweep)
            s.swept(found.listing.sweep)
            _check(found.run, node=node, segment=segment, rank=rank)
            root = str(found.record.remote_root if found.record else s.layout.root)
            _pull(s.transport, root, found.run, segment)
            return
        # One call to the cluster: the follower finds the run (a name, run id or job id of any
        # segment; this machine's record when it has one), sweeps leftover secrets, then streams.
        local = store.resolve(run, s.profile.name)
        root = local.remote_root if local is not None else s.layout.root
        find = {"ids": [local.run_id]} if local is not None else query.selectors(str(run))
        view = TerminalView(max_segments=1, separators=follow, raw=raw, rank=rank, merge=True)
        names: list[str] = []

        def on_run(info: dict[str, Any] | None, sweep: dict[str, Any] | None) -> None:
            s.swept(sweep)
            if info is None:
                raise query.not_on_cluster(run)
            target = parse_runs([info])[0]
            if local is not None:
                query.cache_learned(store, local, target)
            last = _check(target, node=node, segment=segment, rank=rank)
            view.max_segments = target.max_segments
            view.separators = last > 1 or follow
            names.append(target.name)

        try:
            followed = follow_run(
                lambda: s.transport, s.reconnect, root, None, view,
                follow=follow, streams=("err",) if stderr else ("out",), node=node, segment=segment,
                tail=lines, find=find, sweep=s.sweep_along() if root == s.layout.root else (),
                on_run=on_run,
            )  # fmt: skip
        except KeyboardInterrupt:
            view.flush()
            note(f"\nstopped watching; run {names[0] if names else run or 'the latest run'} is not affected")
            ctx.exit(130)
        view.flush()
        if follow and segment is None:
            ctx.exit(run_exit_code(followed.ended))


def _check(target, *, node: int | None, segment: int | None, rank: int | None) -> int:  # type: ignore[no-untyped-def]
    """Refuse a --node, --segment or --rank the run does not have; its last segment so far."""
    from rv.errors import UsageError

    nodes = int(target.meta.get("nodes") or 1)
    if node is not None and node >= nodes:
        raise UsageError(f"--node {node}: run {target.name} runs on {nodes} node(s) (0..{nodes - 1})")
    if rank is not None:
        _check_rank(target, rank)
    last = int(target.current.index) if target.current else 1
    if segment is not None and segment > last:
        raise UsageError(f"--segment {segment}: run {target.name} has {last} segment(s) so far")
    return last


def _check_rank(run, rank: int) -> None:  # type: ignore[no-untyped-def]
    """--rank R needs a run whose lines carry ranks, and a rank it has."""
    from rv.errors import UsageError

    if "labeled" not in run.meta:
        raise UsageError(
            f"--rank: run {run.name} was started by an rv that did not label lines with their rank",
            hint="drop --rank; its lines are in `rv logs` (and per node with --node)",
        )
    if not run.meta["labeled"]:
        raise UsageError(
            f"--rank: run {run.name} is a single process; its lines carry no rank",
            hint="drop --rank",
        )
    ranks = run.meta.get("ranks")
    if isinstance(ranks, int) and rank >= ranks:
        raise UsageError(f"--rank {rank}: run {run.name} has {ranks} ranks (0..{ranks - 1})")


def _pull(transport, root: str, run, segment: int | None) -> None:  # type: ignore[no-untyped-def]
    """Every log file of the run (or of one segment) into ./rv-logs/<name>-<run id>/."""
    from rv.errors import RemoteError
    from rv.layout import RemoteLayout

    layout = RemoteLayout(root)
    dest = Path("rv-logs") / f"{run.name}-{run.run_id}"
    dest.mkdir(parents=True, exist_ok=True)
    got = []
    nodes = int(run.meta.get("nodes") or 1)
    for seg in run.segments:
        if (segment is not None and seg.index != segment) or not seg.job_id:
            continue
        for stream in ("out", "err"):
            paths = [layout.log(run.run_id, seg.job_id, stream)]
            if nodes > 1:
                paths += [layout.log(run.run_id, seg.job_id, stream, node=i) for i in range(nodes)]
            for path in paths:
                local = dest / path.rsplit("/", 1)[-1]
                try:
                    transport.get_file(path, local)
                except RemoteError:
                    continue  # a log that was never written (the segment did not start) is not an error
                got.append(str(local))
    note(f"downloaded {len(got)} file(s) to {dest}/")
    for p in got:
        click.echo(p)
