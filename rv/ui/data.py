"""What the local page shows, asked of the clusters through rv's own core; plain JSON-ready dicts out.

One :class:`Cluster` per profile of the config holds that profile's connections: a small pool, so
the page's requests (each in a thread of its own) never share one, each opened by
rv.remote.connect.open_transport: the profile's warm connection where one is running, else (as for
any rv command) a connection of this process's own, which the pool then keeps open between the
page's requests as the warm one would. Every function here is one round trip to one cluster (a run's
page two), and the page asks only for what it shows.

Nothing here writes to a cluster except :func:`stop` and :func:`retry`, the same core calls as
`rv stop` and `rv sweep retry`. Secret values never pass through here: the run records hold none, and
a run's secrets are only ever said to exist.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

from rv.errors import ConnectError, NotFound, RvError, UsageError
from rv.job import query
from rv.job.records import ClusterRun, RunView, run_views
from rv.job.results import fold_sweeps, param_names, parse_metrics_reply, points_and_views, result_rows
from rv.job.results import retry_points as retryable
from rv.layout import RemoteLayout
from rv.slurm.parse import QueuedJob

if TYPE_CHECKING:
    from rv.config import Config, Profile
    from rv.job.records import RunStore
    from rv.remote.transport import Transport

T = TypeVar("T")

# Points per series: enough for a smooth curve at a page's width; the agent thins evenly, keeps the last.
RUN_SERIES_POINTS = 600
GPU_CURVE_POINTS = 300  # per node and segment: the run page's GPU-utilization chart
SWEEP_SERIES_POINTS = 300
# The first look at a segment's log: its last lines (the rest is a `from segment 1` away).
LOG_TAIL_LINES = 2000
# A line without its newline yet is read again on the next call, up to this many bytes of it.
PARTIAL_LIMIT = 1 << 16
IDLE_CONNECTIONS = 2  # per cluster, kept open between the page's requests


class Cluster:
    """One profile as the page sees it: its name, remote root, and a pool of connections."""

    def __init__(
        self, profile: Profile, opener: Callable[[Profile], Transport], *, default: bool = False
    ) -> None:
        self.profile = profile
        self.name = profile.name
        self.default = default
        self._opener = opener
        self._idle: list[Transport] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def layout(self) -> RemoteLayout:
        return RemoteLayout(
            self.profile.require_remote_root(), share_with_group=self.profile.share_with_group
        )

    @property
    def root(self) -> str:
        return self.layout.root

    def ask(self, work: Callable[[Transport], T], *, again: bool = True) -> T:
        """``work`` over a pooled connection, and once more over a fresh one when that connection
        turns out lost (ConnectError): a connection kept idle can die unseen (a VPN or NAT that
        forgets it, a restarted sshd). ``again`` False for what must never run twice (a retry's
        submission: the first may have gone through)."""
        try:
            with self.connection() as transport:
                return work(transport)
        except ConnectError:
            if not again:
                raise
        with self.connection(fresh=True) as transport:
            return work(transport)

    @contextmanager
    def connection(self, *, fresh: bool = False) -> Iterator[Transport]:
        """A connection for one request (``fresh``: a new one, not the pool's); kept for the next
        unless the request failed on it."""
        with self._lock:
            transport = self._idle.pop() if self._idle and not fresh else None
        if transport is None:
            transport = self._opener(self.profile)
        try:
            yield transport
        except BaseException:
            transport.close()  # it may be the connection that failed: the next request opens a fresh one
            raise
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(transport)
                return
        transport.close()

    def connect_ahead(self) -> threading.Thread:
        """Open a connection into the pool now, in the background, so the page's first request finds
        one (the handshake is most of a first answer). A failure here is left for that request, which
        connects again and says why; RV_DEBUG=1 shows it here too."""

        def connect() -> None:
            try:
                with self.connection():
                    pass
            except RvError as exc:
                from rv.remote.connect import debug

                debug(f"connecting ahead to {self.name} failed (the page will try again): {exc.message}")

        thread = threading.Thread(target=connect, name=f"connect-{self.name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for transport in idle:
            transport.close()


def clusters_of(config: Config, opener: Callable[[Profile], Transport]) -> dict[str, Cluster]:
    """Every profile of the config, the default first."""
    names = sorted(config.profiles, key=lambda n: (n != config.default, n))
    return {n: Cluster(config.profiles[n], opener, default=n == config.default) for n in names}


def profiles(clusters: Mapping[str, Cluster]) -> list[dict[str, Any]]:
    """What the page says of each profile: its name, host and remote root (nothing of its keys)."""
    return [
        {"name": c.name, "host": c.profile.host, "user": c.profile.user, "root": c.profile.remote_root,
         "default": c.default}
        for c in clusters.values()
    ]  # fmt: skip


# --- the runs page ---------------------------------------------------------------------------------


def runs(cluster: Cluster, *, finished: bool = True) -> dict[str, Any]:
    """Every run of the cluster (live ones, and with ``finished`` those of the last week), each sweep
    folded to one row, and the jobs rv did not submit while queued: what `rv ps [-a]` shows, one round
    trip. Without sacct, which `rv ps -a` asks too: rv's own records say how each run ended, and a
    page that asks every few seconds must not load the cluster's accounting database each time (it
    also cost 0.2-0.4 s of each answer's 0.5 s on the loopback cluster)."""
    since = time.time() - query.FINISHED_DAYS * 86400 if finished else None
    snap = cluster.ask(lambda t: query.fetch(t, cluster.root, live=True, since=since, whole_sweeps=True))
    views = run_views(snap.runs, snap.queued, snap.accounted, now=snap.now)
    by_run = {r.run_id: r for r in snap.runs}
    queued = {j.job_id: j for j in snap.queued}
    # Jobs rv did not submit only while they hold the queue: sacct's years of ended ones are noise here.
    rows = [
        _run_row(cluster.name, v, by_run, queued)
        for v in fold_sweeps(views, live_only=not finished)
        if v.run_id is not None or v.points or v.live
    ]
    warnings = []
    if snap.squeue_error:
        warnings.append(f"squeue failed, so what is queued or running is unknown: {snap.squeue_error}")
    return {"profile": cluster.name, "now": snap.now, "rows": rows, "warnings": warnings}


def _run_row(
    profile: str, v: RunView, runs: Mapping[str, ClusterRun], queued: Mapping[str, QueuedJob]
) -> dict[str, Any]:
    jobs = [queued[j] for j in (*v.jobs, v.job_id or "") if j in queued]
    nodes = sorted({n for j in jobs for n in j.node_list})
    if not nodes and v.run_id is not None and v.run_id in runs:
        current = runs[v.run_id].current
        nodes = [current.nodes] if current is not None and current.nodes else []
    pending = [j for j in jobs if j.state == "PENDING"]
    return {
        "profile": profile,
        "kind": "sweep" if v.points else "run" if v.run_id else "job",
        "name": v.name,
        "run_id": v.run_id,
        "sweep": v.sweep,
        "points": v.points,
        "state": v.state,
        "live": v.live,
        "segment": v.segment,
        "max_segments": v.max_segments,
        "segments": v.segments_text(),
        "gpus": v.gpus,
        "gpu_type": v.gpu_type,
        "nodes": v.nodes,
        "node_list": nodes,
        "elapsed": v.elapsed_seconds,
        "reason": v.reason,
        "expected_start": pending[0].start if pending and v.state == "PENDING" else None,
        "job_id": v.job_id,
        "exit_code": v.exit_code,
        "created": v.created,
        "source": v.source,
    }


# --- a run -----------------------------------------------------------------------------------------

# The run.json fields the page shows (provenance and request). A list, not the whole record: what a
# later rv adds to run.json is shown only once someone decides it belongs on the page.
META_SHOWN = (
    "project", "snapshot", "command", "branch", "commit", "dirty", "submitted_from", "created", "gpus",
    "gpu_type", "gpu_types", "nodes", "ranks", "labeled", "max_segments", "request", "env", "metrics",
)  # fmt: skip


def run(cluster: Cluster, run_id: str) -> dict[str, Any]:
    """A run: its chain of segments (each with its job's state while queued or running), where it
    came from, and its checkpoints. Two round trips: the records and squeue, then ``ckpt-ls``."""
    from rv.remote.agent_client import call_agent

    def look(t: Transport) -> tuple[query.RunsListing, ClusterRun, Any]:
        snap = query.fetch(t, cluster.root, ids=[run_id], stats=GPU_CURVE_POINTS)
        found = [r for r in snap.runs if r.run_id == run_id]
        if not found:
            raise query.not_on_cluster(run_id)
        meta = found[-1].meta
        checkpoints = None
        if meta.get("project") and meta.get("name"):
            checkpoints = call_agent(
                t, "ckpt-ls", {"root": cluster.root, "project": meta["project"], "name": meta["name"]}
            )
        return snap, found[-1], checkpoints

    snap, target, checkpoints = cluster.ask(look)
    meta = target.meta
    (view,) = [v for v in run_views(snap.runs, snap.queued, now=snap.now) if v.run_id == run_id]
    queued = {j.job_id: j for j in snap.queued}
    segments = []
    for seg in target.segments:
        job = queued.get(seg.job_id or "")
        waiting = [queued[j] for j, _ in seg.candidates if j in queued]
        job = job or (waiting[0] if waiting else None)
        segments.append(
            {**asdict(seg), "candidates": [list(c) for c in seg.candidates],
             "queue": None if job is None else {
                 "job_id": job.job_id, "state": job.state, "reason": job.reason, "start": job.start,
                 "node_list": list(job.node_list), "elapsed": job.elapsed_seconds,
                 "time_limit": job.time_limit_seconds, "partition": job.partition}}
        )  # fmt: skip
    sweep = meta.get("sweep") if isinstance(meta.get("sweep"), Mapping) else None
    return {
        "profile": cluster.name,
        "run_id": target.run_id,
        "name": target.name,
        "now": snap.now,
        "view": _run_row(cluster.name, view, {target.run_id: target}, queued),
        "meta": {k: meta[k] for k in META_SHOWN if k in meta},
        "sweep": None if sweep is None else {"name": sweep.get("name"), "index": sweep.get("index"),
                                             "params": sweep.get("params")},
        "secrets": "sent with the run (values never shown)" if meta.get("has_secrets") else None,
        "segments": segments,
        "ended": dict(target.ended) if target.ended is not None else None,
        "stop_requested": target.stop_requested,
        "checkpoints": checkpoints,
        "usage": usage(cluster, target, snap.stats.get(target.run_id) or {}, snap.now),
    }  # fmt: skip


def usage(cluster: Cluster, run: ClusterRun, measured: Mapping[str, Any], now: float) -> dict[str, Any]:
    """What the run used (rv stats's figures and advice) and, per segment and node, its GPU curve."""
    from rv.job.stats import run_stats, summary_line, to_json

    figures = run_stats(run, measured, cluster.profile.gpu_catalog(), now)
    curves = [
        {"segment": int(seg), "node": rec.get("node"), "points": rec.get("curve") or []}
        for seg, recs in measured.items()
        for rec in recs
        if rec.get("curve")
    ]
    return {**to_json(figures), "summary": summary_line(figures), "curves": curves}


def logs(
    cluster: Cluster,
    run_id: str,
    *,
    stream: str,
    cursor: Mapping[str, Any] | None,
    from_segment: int | None = None,
    tail: int | None = LOG_TAIL_LINES,
) -> dict[str, Any]:
    """What a run's ``stream`` (out or err) gained since ``cursor``, every segment from the cursor's
    on (so a follow goes on into the next segment when the chain moves), as complete lines.

    No cursor: the last ``tail`` lines of segment ``from_segment`` (the run's current one when None)
    and everything after. The answer's ``cursor`` says where the next call starts: per log file, the
    byte after its last complete line (a line still being written comes as ``partial``, and again,
    whole, once it ends). One round trip: the agent's ``follow`` mode, not following.
    """
    from rv.job.watch import FollowerFrameReader, Position, follower_args
    from rv.remote.agent_client import agent_command

    if stream not in ("out", "err"):
        raise UsageError(f"stream {stream!r}: out or err")
    offsets = {str(k): int(v) for k, v in ((cursor or {}).get("offsets") or {}).items()}
    segment = int((cursor or {}).get("segment") or from_segment or 0) or None
    if cursor is None and segment is None:
        snap = cluster.ask(lambda t: query.fetch(t, cluster.root, ids=[run_id]))
        found = [r for r in snap.runs if r.run_id == run_id]
        if not found:
            raise query.not_on_cluster(run_id)
        segment = found[-1].current.index if found[-1].current else 1
    pos = Position(segment=segment, offsets=dict(offsets), run_id=run_id)
    args = follower_args(
        cluster.root, pos, follow=False, streams=(stream,), node=None, tail=None if cursor else tail
    )

    def read(t: Transport) -> tuple[int, list[tuple[dict[str, Any], bytes]], list[bytes]]:
        reader = FollowerFrameReader()
        frames: list[tuple[dict[str, Any], bytes]] = []
        errors: list[bytes] = []

        def on_stdout(chunk: bytes) -> None:
            frames.extend(reader.feed(chunk))

        code = t.stream(agent_command("follow", args), on_stdout=on_stdout, on_stderr=errors.append)
        return code, frames, errors

    code, frames, errors = cluster.ask(read)
    if code != 0:
        detail = b"".join(errors).decode("utf-8", "replace").strip().splitlines()[-3:]
        raise RvError(f"reading the logs on {cluster.name} failed (exit {code}): {' / '.join(detail)}")
    return _log_answer(frames, offsets, segment or 1)


def _log_answer(
    frames: Sequence[tuple[dict[str, Any], bytes]], offsets: Mapping[str, int], segment: int
) -> dict[str, Any]:
    """The follower's frames as the page's answer: segments in order, each with its new lines."""
    segments: dict[int, dict[str, Any]] = {}
    received: dict[str, tuple[int, int, bytearray]] = {}  # file -> (segment, first offset, bytes)
    ended = None
    for head, data in frames:
        kind = head.get("t")
        if kind in ("segment", "segment-end"):
            k = int(head["segment"])
            entry = segments.setdefault(k, {"segment": k, "job_id": head.get("job_id"), "files": {}})
            entry["record"] = head.get("record")
            segment = max(segment, k)
        elif kind == "data":
            name, start = str(head["f"]), int(head["o"])
            received.setdefault(name, (int(head.get("seg") or segment), start, bytearray()))[2].extend(data)
        elif kind == "end":
            ended = head.get("ended")
    cursor = dict(offsets)
    for name, (k, start, got) in received.items():
        whole = got.rfind(b"\n") + 1  # the lines that ended; the rest comes again next time
        if len(got) - whole > PARTIAL_LIMIT:
            whole = len(got)  # a progress bar redrawn with \r for ever: not read again each time
        cursor[name] = start + whole
        entry = segments.setdefault(k, {"segment": k, "job_id": None, "files": {}, "record": None})
        entry["files"][name.rsplit("/", 1)[-1]] = {
            "text": got[:whole].decode("utf-8", "replace"),
            "partial": got[whole:].decode("utf-8", "replace"),
        }
    return {
        "segments": [segments[k] for k in sorted(segments)],
        "cursor": {"segment": segment, "offsets": cursor},
        "ended": ended,
    }


def metrics(cluster: Cluster, run_id: str) -> dict[str, Any]:
    """Every numeric metric the run's program wrote to $RV_METRICS, as series against its step (or
    line), and whether the run has ended (then the page stops asking). One round trip."""
    asked = {"series": True, "points": RUN_SERIES_POINTS}
    snap = cluster.ask(lambda t: query.fetch(t, cluster.root, ids=[run_id], metrics=asked))
    found = [r for r in snap.runs if r.run_id == run_id]
    if not found:
        raise query.not_on_cluster(run_id)
    summary = parse_metrics_reply(snap.metrics).get(run_id)
    if summary is None:
        raise NotFound(f"the cluster sent no metrics for run {found[-1].name}")
    return {
        "profile": cluster.name,
        "run_id": run_id,
        "name": found[-1].name,
        "ended": dict(found[-1].ended) if found[-1].ended is not None else None,
        "path": summary.path,
        "exists": summary.exists,
        "x": summary.x or "step",
        "notes": summary.notes(),
        "metrics": {
            name: {"last": m.last, "min": m.min, "max": m.max, "count": m.count,
                   "series": [list(p) for p in m.series]}
            for name, m in sorted(summary.metrics.items())
        },
    }  # fmt: skip


# --- a sweep ---------------------------------------------------------------------------------------


def sweep(cluster: Cluster, name: str) -> dict[str, Any]:
    """A sweep's results table (one row per point: its values, state, segments, wall time, each
    metric's last value) and every point's series of every metric. One round trip."""
    asked = {"series": True, "points": SWEEP_SERIES_POINTS}
    snap = cluster.ask(lambda t: query.fetch(t, cluster.root, sweeps=[name], metrics=asked))
    points, views = points_and_views(snap, name)
    found = parse_metrics_reply(snap.metrics)
    rows = result_rows(points, views, found)
    retry = set(retryable(rows))
    names = {r.run_id: r.name for r in snap.runs}
    sus = point_sus(cluster, snap.runs, snap.now)
    out = []
    for r in rows:
        m = found.get(r.run_id or "")
        view = views.get(r.run_id or "")
        out.append(
            {"index": r.index, "params": dict(r.params), "run_id": r.run_id,
             "name": names.get(r.run_id or "", f"{name}/{r.index}"), "state": r.state,
             "live": bool(view and view.live), "failed": r.index in retry, "segments": r.segments,
             "wall_seconds": r.wall_seconds, "su": sus.get(r.run_id or ""), "metrics": dict(r.metrics),
             "series": {k: [list(p) for p in s.series] for k, s in (m.metrics.items() if m else ())}}
        )  # fmt: skip
    point_su = [sus.get(r.run_id or "") for r in rows]
    warnings = [line for m in found.values() for line in m.notes()]
    if snap.squeue_error:
        warnings.append(
            f"squeue failed, so which points are queued or running is unknown: {snap.squeue_error}"
        )
    return {
        "profile": cluster.name,
        "name": name,
        "params": param_names(rows),
        "metrics": sorted({k for r in rows for k in r.metrics}),
        "points": out,
        "retryable": sorted(retry),
        "warnings": warnings,
        # The sweep's SUs: the sum over its points (null when one has no rate, or none has run).
        "su_total": None if not out or None in point_su else round(sum(x or 0.0 for x in point_su), 2),
    }


def point_sus(cluster: Cluster, runs: Sequence[ClusterRun], now: float) -> dict[str, float | None]:
    """Each run's SUs so far (rv stats's: the catalog's rate × GPUs × each segment's hours)."""
    from rv.job.stats import run_stats

    catalog = cluster.profile.gpu_catalog()
    out = {}
    for r in runs:
        su = run_stats(r, {}, catalog, now).su
        out[r.run_id] = round(su, 2) if su is not None else None
    return out


# --- the two actions -------------------------------------------------------------------------------


def stop(
    cluster: Cluster, store: RunStore, *, run_id: str | None = None, sweep: str | None = None
) -> dict[str, Any]:
    """`rv stop RUN` (by run id) or `rv stop SWEEP` (every point not ended): STOP, scancel, the
    secrets removed, through the same core call (rv.job.cleanup.stop_runs)."""
    from rv.job.cleanup import stop_runs

    if (run_id is None) == (sweep is None):
        raise UsageError("stop takes a run id or a sweep name")

    def end(t: Transport) -> list[Any]:  # as `rv stop` twice does nothing more than once: asked again if lost
        if run_id is not None:
            snap = query.fetch(t, cluster.root, ids=[run_id])
            targets = [(r.run_id, r.name) for r in snap.runs if r.run_id == run_id][-1:]
            if not targets:
                raise query.not_on_cluster(run_id)
        else:
            snap = query.fetch(t, cluster.root, sweeps=[str(sweep)])
            points = [r for r in snap.runs if (r.meta.get("sweep") or {}).get("name") == sweep]
            if not points:
                raise NotFound(f"no sweep named {sweep!r} on {cluster.name}")
            targets = [(r.run_id, r.name) for r in points if r.ended is None]
        return stop_runs(t, cluster.root, targets) if targets else []

    stopped = cluster.ask(end)
    store.update_many(cluster.name, {row.run_id: {"secrets_cleared": True} for row in stopped})
    return {
        "stopped": [{"run_id": s.run_id, "name": s.name, "cancelled": list(s.cancelled),
                     "secrets_removed": s.secrets_removed, "error": s.error} for s in stopped]
    }  # fmt: skip


def retry(cluster: Cluster, store: RunStore, name: str, notes: list[str]) -> dict[str, Any]:
    """`rv sweep retry SWEEP`: the points that failed or were cancelled, again, as one job array
    (rv.job.retry: the same plan and send as the command). What the command would warn of lands in
    ``notes``."""
    from rv.job.retry import arrays_of, plan_retry, send_retry
    from rv.secrets import job_secrets

    plan = cluster.ask(
        lambda t: plan_retry(t, cluster.root, name, parallel=None, account=cluster.profile.account)
    )
    if not plan.indexes:
        return {"retried": [], "arrays": [], "message": f"nothing to retry in sweep {name}"}
    secrets = job_secrets(cluster.name, notice=notes.append)
    if secrets and not plan.first.meta.get("has_secrets"):
        notes.append(f"sweep {name} was sent without secrets: its points run again as they were")
    sent = cluster.ask(
        lambda t: send_retry(
            t, cluster.layout, plan, secrets=secrets or None, profile=cluster.name, store=store
        ),
        again=False,
    )
    return {
        "retried": plan.indexes,
        "arrays": arrays_of(sent),
        "message": f"retrying {len(plan.indexes)} point(s) of sweep {name}: {plan.listing()}",
    }
