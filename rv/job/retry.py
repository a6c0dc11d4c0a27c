"""`rv sweep retry` and the local page's retry: which points of a sweep run again, and sending them.

A plan is one round trip (the sweep's runs, squeue, MaxArraySize and the queue limits); sending is a
second (every point's new run and the arrays that run them, in one ``sweep-submit``). Each retried
point is a new run of its old name (so it starts from its checkpoint, if it saved one), with the same
snapshot, environment and command.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rv.job import query
from rv.job import submit as job
from rv.job.results import points_and_views, result_rows, retry_points
from rv.sweep import ArrayPart, check_limits, plan_arrays

if TYPE_CHECKING:
    from rv.job.records import ClusterRun, RunStore
    from rv.layout import RemoteLayout
    from rv.remote.transport import Transport


@dataclass(frozen=True)
class RetryPlan:
    name: str
    indexes: list[int]  # the points to run again, in order (empty: nothing to retry)
    states: Mapping[int, str]  # each point's state now
    parts: tuple[ArrayPart, ...]  # the job arrays that will run them
    old: Mapping[int, tuple[str, str]]  # index -> (run id, point name) of the run it repeats
    runs: Mapping[str, ClusterRun]  # every run of the sweep, by run id
    squeue_error: str | None  # squeue failed: which points are live is unknown

    @property
    def first(self) -> ClusterRun:
        """The first retried point's old run: the sweep's project, secrets and --parallel come from it."""
        return self.runs[self.old[self.indexes[0]][0]]

    def listing(self) -> str:
        """``1 (failed), 4 (cancelled)``."""
        return ", ".join(f"{i} ({self.states[i].lower()})" for i in self.indexes)


def plan_retry(
    transport: Transport, root: str, name: str, *, parallel: int | None, account: str | None
) -> RetryPlan:
    """What a retry of sweep ``name`` would send; refuses more points than the queue takes
    (:func:`rv.sweep.check_limits`). ``parallel`` None: the sweep's own ``--parallel``."""
    snap = query.fetch(transport, root, sweeps=[name], slurm=job.sweep_asks())
    points, views = points_and_views(snap, name)
    rows = result_rows(points, views, {})
    indexes = retry_points(rows)
    runs = {r.run_id: r for r in snap.runs}
    old = {p.index: (p.run_id, runs[p.run_id].name) for p in points if p.index in indexes and p.run_id}
    states = {r.index: r.state for r in rows}
    if not indexes:
        return RetryPlan(name, [], states, (), old, runs, snap.squeue_error)
    first = runs[old[indexes[0]][0]]
    if parallel is None:
        parallel = (first.meta.get("sweep") or {}).get("parallel")
    arrays, limit = job.sweep_limits(snap.slurm, account=account, qos=None)
    check_limits(
        len(indexes), max_jobs=limit.jobs if limit else None, queued=len(snap.queued),
        limit=limit.what if limit else "MaxSubmitJobs",
    )  # fmt: skip
    parts = plan_arrays(
        indexes, parallel=parallel, max_array_size=arrays.max_array_size,
        max_array_tasks=arrays.max_array_tasks,
    )  # fmt: skip
    return RetryPlan(name, indexes, states, parts, old, runs, snap.squeue_error)


def send_retry(
    transport: Transport,
    layout: RemoteLayout,
    plan: RetryPlan,
    *,
    secrets: Mapping[str, str] | None,
    profile: str,
    store: RunStore,
) -> list[dict[str, Any]]:
    """Send ``plan`` (one round trip) and record each new run here; the arrays sent, by part
    (``[{"array", "runs"}]``)."""
    sent = job.submit_sweep(
        transport, layout, project=str(plan.first.meta.get("project")), name=plan.name,
        parts=job.retry_payload(plan.parts, plan.old), secrets=secrets,
    )  # fmt: skip
    records = [
        job.retry_record(
            plan.runs[plan.old[index][0]], run_id, f"{part['array']}_{task}", layout.root, profile
        )
        for part, planned in zip(sent, plan.parts, strict=True)
        for task, (index, run_id) in enumerate(zip(planned.points, part["runs"], strict=True))
    ]
    store.add_many(records)
    return sent


def arrays_of(sent: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(p["array"]) for p in sent]
