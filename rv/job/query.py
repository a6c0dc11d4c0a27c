"""Asking the cluster about runs: one round trip for the records, squeue and (optionally) sacct.

The cluster's records are the truth (the jobs write them; later segments were submitted by jobs,
not by this laptop); the local ones say which runs this machine started and cache what was learned.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rv.errors import NotFound
from rv.job.records import ClusterRun, RunRecord, RunStore, parse_runs
from rv.remote.agent_client import call_agent
from rv.slurm import commands
from rv.slurm.parse import AccountedJob, QueuedJob, parse_sacct, parse_squeue

if TYPE_CHECKING:
    from rv.remote.transport import Transport

FINISHED_DAYS = 7  # how far back `rv ps -a` looks


@dataclass(frozen=True)
class RunsListing:
    runs: list[ClusterRun]
    queued: list[QueuedJob]
    accounted: list[AccountedJob] = field(default_factory=list)
    squeue_error: str | None = None
    sacct_error: str | None = None
    now: float = 0.0
    sweep: dict[str, Any] | None = None  # the reply of a secrets sweep that rode along, if one did
    metrics: list[dict[str, Any]] = field(default_factory=list)  # rv.agent.metrics rows, when asked
    slurm: dict[str, dict[str, Any]] = field(default_factory=dict)  # {key: {"text", "error"}}, when asked
    # rv.agent.stats.read_run of each run, by run id, when asked: {segment: [node records]}
    stats: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)


def fetch(
    transport: Transport,
    root: str,
    *,
    ids: Sequence[str] = (),
    job_ids: Sequence[str] = (),
    any_names: Sequence[str] = (),
    live: bool = False,
    since: float | None = None,
    sacct_days: int | None = None,
    sweep: Sequence[str] = (),
    sweeps: Sequence[str] = (),
    whole_sweeps: bool = False,
    metrics: Mapping[str, Any] | None = None,
    slurm: Mapping[str, list[str]] | None = None,
    stats: int | None = None,
) -> RunsListing:
    """One round trip: the runs asked for, squeue (and sacct), and a secrets ``sweep`` of those ids.

    ``sweeps``: every point of the sweeps of these names; ``whole_sweeps``: a point chosen brings
    its sweep's other points; ``metrics``: each run's metrics summed up too (``{"series", "points"}``,
    see rv.agent.metrics); ``slurm``: Slurm commands whose answers come back by key; ``stats``: what
    each run's jobs measured (rv.agent.stats), with at most this many points of GPU-utilization curve."""
    args: dict[str, Any] = {
        "root": root,
        "ids": list(ids),
        "job_ids": list(job_ids),
        "any_names": list(any_names),
        "live": live,
        "since": since,
        "squeue": commands.squeue_user(),
        "sweeps": list(sweeps),
        "whole_sweeps": whole_sweeps,
    }
    if metrics is not None:
        args["metrics"] = dict(metrics)
    if slurm:
        args["slurm"] = dict(slurm)
    if stats is not None:
        args["stats"] = stats
    if sacct_days is not None:
        args["sacct"] = commands.sacct_user(sacct_days)
    if sweep:
        args["secrets_sweep"] = list(sweep)
    reply = call_agent(transport, "runs", args, timeout=120)
    squeue, sacct = reply.get("squeue") or {}, reply.get("sacct") or {}
    return RunsListing(
        runs=parse_runs(reply.get("runs") or []),
        queued=parse_squeue(squeue.get("text") or "") if not squeue.get("error") else [],
        accounted=parse_sacct(sacct.get("text") or "") if sacct and not sacct.get("error") else [],
        squeue_error=squeue.get("error"),
        sacct_error=sacct.get("error") if sacct else None,
        now=float(reply.get("now") or time.time()),
        sweep=reply.get("secrets_sweep") if sweep else None,
        metrics=(reply.get("metrics") or {}).get("runs") or [],
        slurm=reply.get("slurm") or {},
        stats=reply.get("stats") or {},
    )


def listing(
    transport: Transport, root: str, *, finished: bool, sweep: Sequence[str] = (), sweeps: Sequence[str] = ()
) -> RunsListing:
    """What `rv ps` shows: live runs (and, with ``finished``, those of the last week, and sacct), each
    sweep with all its points (one line sums them up); with ``sweeps``, every point of those."""
    since = time.time() - FINISHED_DAYS * 86400 if finished else None
    return fetch(
        transport, root, live=not sweeps, since=since if not sweeps else None,
        sacct_days=FINISHED_DAYS if finished else None, sweep=sweep, sweeps=sweeps, whole_sweeps=True,
    )  # fmt: skip


_JOB_ID = re.compile(r"^\d+(?:_\d+)?$")


@dataclass(frozen=True)
class Resolved:
    run: ClusterRun
    record: RunRecord | None  # this machine's record of it, when it submitted it
    listing: RunsListing  # the one answer it was found in (squeue's too)


def resolve(
    transport: Transport,
    store: RunStore,
    profile: str,
    root: str,
    ref: str | None,
    *,
    sweep: Sequence[str] = (),
) -> Resolved:
    """RUN as the user typed it: a run name, a run id, a job id of any segment, or None (the latest).

    ``sweep``: run ids under ``root`` whose secrets this same call sweeps (see rv.job.cleanup).
    """
    local = store.resolve(ref, profile)
    if local is not None:
        same_root = local.remote_root == root
        snap = fetch(transport, local.remote_root, ids=[local.run_id], sweep=sweep if same_root else ())
    elif ref is not None:
        where = selectors(ref)
        snap = fetch(
            transport, root, ids=where["ids"], job_ids=where["job_ids"], any_names=where["any_names"],
            sweep=sweep,
        )  # fmt: skip
    else:
        raise NotFound("no runs submitted with this profile yet", hint="rv run -- python train.py")
    runs = snap.runs
    if local is not None:
        runs = [r for r in runs if r.run_id == local.run_id]
    if not runs:
        raise missing(transport, root, ref) if local is None else not_on_cluster(ref)
    run = runs[-1]  # the newest of that name
    if local is not None:
        cache_learned(store, local, run)
    return Resolved(run, local, snap)


def resolve_or_sweep(
    transport: Transport, store: RunStore, profile: str, root: str, ref: str
) -> tuple[list[ClusterRun], bool]:
    """RUN as :func:`resolve` finds it, or else the sweep of that name: (the runs, whether they are a
    sweep's points: the newest run of each point). One round trip either way."""
    local = store.resolve(ref, profile)
    if local is not None:
        return [resolve(transport, store, profile, root, ref).run], False
    where = selectors(ref)
    snap = fetch(
        transport, root, ids=where["ids"], job_ids=where["job_ids"], any_names=where["any_names"],
        sweeps=[ref],
    )  # fmt: skip
    sweep = [r for r in snap.runs if (r.meta.get("sweep") or {}).get("name") == ref]
    direct = [r for r in snap.runs if r not in sweep or r.name == ref or r.run_id == ref or ref in r.jobs]
    if direct:
        return [direct[-1]], False
    if not sweep:
        raise not_on_cluster(ref)
    newest: dict[int, ClusterRun] = {}
    for run in sweep:  # oldest first: the newest of each point wins
        newest[int(run.meta["sweep"].get("index") or 0)] = run
    return [newest[i] for i in sorted(newest)], True


def selectors(ref: str) -> dict[str, list[str]]:
    """How the cluster finds a RUN this machine does not know: run id, job id of any segment, name."""
    return {"ids": [ref], "job_ids": [ref] if _JOB_ID.match(ref) else [], "any_names": [ref]}


def missing(transport: Transport, root: str, ref: str | None, command: str | None = None) -> NotFound:
    """Why RUN was not found, in the user's words (one more round trip, on this error's path only):
    a sweep's name (its points are the runs: ``SWEEP/0``...), a job Slurm rejected as it was
    submitted (accounting keeps it; there is no run, so no logs), or neither."""
    if not ref:
        return not_on_cluster(ref)
    snap = fetch(transport, root, sweeps=[ref], sacct_days=FINISHED_DAYS)
    indexes = sorted(
        {
            int(r.meta["sweep"].get("index") or 0)
            for r in snap.runs
            if (r.meta.get("sweep") or {}).get("name") == ref
        }
    )
    if indexes:
        then = f"{command} {ref}/{indexes[0]}   " if command else ""
        return NotFound(
            f"{ref!r} is a sweep of {len(indexes)} point(s), each a run of its own: name one, e.g. "
            f"{ref}/{indexes[0]} (points {indexes[0]} to {indexes[-1]})",
            hint=f"{then}rv ps {ref} lists its points",
        )
    from rv.job.records import rejected_at_submission

    rejected = [j for j in snap.accounted if j.name == ref and rejected_at_submission(j)]
    if rejected:
        return NotFound(
            f"run {ref!r} never ran: Slurm rejected its job {rejected[-1].job_id} as it was submitted "
            "(rv run said why), so there is no run and no logs",
            hint="rv ps -a shows it; change what Slurm refused, then rv run again",
        )
    return not_on_cluster(ref)


def not_on_cluster(ref: str | None) -> NotFound:
    from rv.names import lookup_hint

    what = f"run {ref!r}" if ref else "the latest run"
    return NotFound(
        f"{what} is not on the cluster (by name, run id or job id of any segment)",
        hint=lookup_hint(ref or "") or "`rv ps -a` lists runs; `rv gc` may have removed an old one",
    )


def cache_learned(store: RunStore, record: RunRecord, run: ClusterRun) -> None:
    """Remember a run's segments and end locally, so later lookups by job id need no scan."""
    store.update(record.profile, record.run_id, **learned(record, run))


def cache_learned_many(store: RunStore, profile: str, pairs: Sequence[tuple[RunRecord, ClusterRun]]) -> None:
    """:func:`cache_learned` for many runs, in one write of the local records."""
    store.update_many(profile, {record.run_id: learned(record, run) for record, run in pairs})


def learned(record: RunRecord, run: ClusterRun) -> dict[str, Any]:
    """What the cluster's records of ``run`` add to this machine's ``record`` (empty: nothing)."""
    jobs = run.jobs
    changes: dict[str, Any] = {}
    if jobs != record.all_jobs:
        changes["jobs"] = jobs
    if run.ended is not None and record.ended is None:
        changes["ended"] = dict(run.ended)
        if not run.has_secrets_file:
            changes["secrets_cleared"] = True
    return changes
