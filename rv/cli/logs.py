"""`rv logs [RUN]`: a run's output, every segment in order (stdout by default, --err for stderr)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from rv.cli.common import note, print_json, run_store, session, warn


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
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON document on stdout: the run, and each segment's lines (with node and rank); with -f "
    "when the run ends, with its exit code; with --pull the files downloaded.",
)
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
    as_json: bool,
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
            dest, got = _pull(s.transport, root, found.run, segment)
            if as_json:
                print_json(
                    {"run": found.run.name, "run_id": found.run.run_id, "folder": str(dest), "files": got}
                )
            else:
                note(f"downloaded {len(got)} file(s) to {dest}/")
                for p in got:
                    click.echo(p)
            return
        # One call to the cluster: the follower finds the run (a name, run id or job id of any
        # segment; this machine's record when it has one), sweeps leftover secrets, then streams.
        local = store.resolve(run, s.profile.name)
        root = local.remote_root if local is not None else s.layout.root
        find = {"ids": [local.run_id]} if local is not None else query.selectors(str(run))
        view: TerminalView | JsonView
        if as_json:
            view = JsonView(raw=raw, rank=rank)
        else:
            view = TerminalView(max_segments=1, separators=follow, raw=raw, rank=rank, merge=True)
        names: list[str] = []
        runs: list[Any] = []

        def on_run(info: dict[str, Any] | None, sweep: dict[str, Any] | None) -> None:
            s.swept(sweep)
            if info is None:
                raise (
                    query.missing(s.transport, root, run, "rv logs")
                    if local is None
                    else query.not_on_cluster(run)
                )
            target = parse_runs([info])[0]
            if local is not None:
                query.cache_learned(store, local, target)
            last = _check(target, node=node, segment=segment, rank=rank)
            if isinstance(view, TerminalView):
                view.max_segments = target.max_segments
                view.separators = last > 1 or follow
            names.append(target.name)
            runs.append(target)

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
        code = run_exit_code(followed.ended) if follow and segment is None else None
        target = runs[0] if runs else None
        if not follow and target is not None and _never_started(target, followed.ended, as_json=as_json):
            from rv.errors import NotFound

            ctx.exit(NotFound.exit_code)  # the output asked for does not exist
        if isinstance(view, JsonView):
            print_json(
                {"run": target.name if target else None, "run_id": target.run_id if target else None,
                 "stream": "err" if stderr else "out", "segments": view.segments,
                 "ended": followed.ended is not None, "exit_code": code}
            )  # fmt: skip
        if code is not None:
            ctx.exit(code)


def _never_started(target: Any, ended: dict[str, Any] | None, *, as_json: bool) -> bool:
    """When no job of the run ever started, no output will come from it: said, never a bare nothing.
    Whether that is final (the run ended without starting) and so an error (not with --json)."""
    if any(sg.start for sg in target.segments):
        return False
    ended = ended or target.ended
    if ended is None:
        note(f"run {target.name} has not started yet: rv logs -f {target.name} waits for its output")
        return False
    note(f"run {target.name} never started ({ended.get('reason') or 'no record of why'}): it has no output")
    return not as_json


class JsonView:
    """Collects what a follow shows for `rv logs --json`: per segment, its lines, each with the node
    whose log it came from (None: the job's own log) and the rank that printed it (None: no label).
    rv's chatter (reconnects, warnings) goes to stderr; stdout gets the one document at the end."""

    def __init__(self, *, raw: bool, rank: int | None) -> None:
        self.raw, self.rank = raw, rank
        self.segments: list[dict[str, Any]] = []
        self._collapsers: dict[str, Any] = {}

    def _current(self) -> dict[str, Any]:
        if not self.segments:  # output before any segment frame (one segment asked for): a bare entry
            self.segments.append({"segment": None, "job_id": None, "lines": []})
        return self.segments[-1]

    def _add(self, source: str, text: str) -> None:
        import re

        from rv.cli.logview import rank_of

        m = re.search(r"-node(\d+)\.(?:out|err)$", source)
        lines = self._current()["lines"]
        for line in text.splitlines():
            rank = self.rank if self.rank is not None else rank_of(line)
            lines.append({"node": int(m.group(1)) if m else None, "rank": rank, "text": line})

    def output(self, stream: str, data: bytes, source: str = "") -> None:
        from rv.cli.logview import LineCollapser

        collapser = self._collapsers.get(source)
        if collapser is None:
            collapser = self._collapsers[source] = LineCollapser(raw=self.raw, rank=self.rank)
        self._add(source, collapser.feed(data.decode("utf-8", errors="replace")))

    def flush(self) -> None:
        for source, collapser in self._collapsers.items():
            rest = collapser.flush()
            if rest:
                self._add(source, rest)

    def segment(self, frame: dict[str, Any]) -> None:
        self.flush()
        self.segments.append({"segment": frame["segment"], "job_id": frame["job_id"], "lines": []})

    def segment_end(self, frame: dict[str, Any]) -> None:
        self.flush()

    def state(self, frame: dict[str, Any]) -> None:
        pass  # squeue's view of the job: not part of its output

    def warning(self, message: str) -> None:
        warn(message)

    def reconnecting(self, error: str, wait: float) -> None:
        warn(f"{error}; reconnecting in {wait:g} s (the run is not affected)")


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


def _pull(transport, root: str, run, segment: int | None) -> tuple[Path, list[str]]:  # type: ignore[no-untyped-def]
    """Every log file of the run (or of one segment) into ./rv-logs/<name>-<run id>/: (folder, files)."""
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
    return dest, got
