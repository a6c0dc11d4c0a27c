"""`rv why [RUN]`: why a run waits, or why it ended, and what would start it sooner.

For a pending run, every job it waits as (one per GPU type when it was sent for several):

1. Slurm's reason in words (rv.slurm.pending), a QoS or association limit named with its value
   (``sacctmgr``, where there is accounting), the jobs ahead of it in its partition and Slurm's
   expected start (``scontrol``'s StartTime: what ``squeue --start`` shows).
2. What might start it sooner, from the scheduler's own picture: a shorter ``--time`` (the longest
   that ends before the first job ahead is planned to start: what the backfill scheduler can fit in
   now; for programs that checkpoint, which rv continues), fewer GPUs, another GPU type, another
   QoS the user may use, another partition (a CPU run).
3. Each suggestion judged by ``sbatch --test-only`` on the run's own batch script with that one
   option changed (rv/agent/why.py): one that sbatch refuses is never shown. Its estimate is shown
   only when it is sooner than Slurm's plan for the run: Slurm 22.05 answers a start a backfill
   window away (a day) for any job of a partition where another job pends, whatever the job asks, so
   that reasoning is rv's, from the scheduler's plan (the jobs ahead and their planned starts).

Three round trips: the run (rv.job.query), what Slurm says of its jobs, the probes. Pure apart from
:func:`gather` and :func:`check`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from rv.catalog import GpuType
from rv.job.records import ClusterRun
from rv.placement import parse_test_only
from rv.remote.agent_client import call_agent
from rv.slurm import commands
from rv.slurm.parse import QueuedJob
from rv.slurm.pending import (
    ASSOC_FIELDS,
    QOS_FIELDS,
    QueueEntry,
    SlurmJob,
    parse_backfill_window,
    parse_queue,
    parse_sacctmgr,
    parse_scontrol_jobs,
    reason,
    tres_value,
)
from rv.timespec import format_elapsed

if TYPE_CHECKING:
    from rv.job.query import RunsListing
    from rv.remote.transport import Transport

# A --time shorter than this is no suggestion: a segment that short does little before it stops.
MIN_SUGGESTED_TIME_S = 5 * 60
# Room left before the job ahead starts: the scheduler plans in whole passes, never to the second.
TIME_MARGIN_S = 60


@dataclass(frozen=True)
class Suggestion:
    change: str  # what to type, in rv's words: "--time 9m", "--qos high", "-t v100"
    why: str
    script: str  # the run's batch script it was judged on
    options: tuple[str, ...]  # sbatch options the probe adds
    accepted: bool | None = None  # sbatch --test-only's word (None: not asked yet)
    estimate: int | None = None  # sbatch's expected start, epoch seconds
    sooner: bool | None = None  # sbatch expects it to start before Slurm's plan for the run


@dataclass(frozen=True)
class Waiting:
    """One job a pending run waits as."""

    job_id: str
    gpu_type: str  # "" for a CPU run
    script: str
    code: str  # Slurm's reason
    words: str
    kind: str
    limit: str | None  # the limit named with its value, where sacctmgr says
    partition: str
    qos: str | None
    expected_start: int | None  # epoch, Slurm's plan
    expected_in_s: int | None
    ahead: tuple[str, ...]  # pending jobs of higher priority in its partition
    running: int  # jobs running in its partition
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()


@dataclass(frozen=True)
class Why:
    run: str
    run_id: str
    state: str  # PENDING, RUNNING, or how it ended (COMPLETED, FAILED, ...)
    summary: str
    segment: int
    max_segments: int
    waiting: tuple[Waiting, ...] = ()
    details: tuple[str, ...] = ()  # running or ended: each segment's end, in words
    exit_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- which jobs wait --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    gpu_type: str
    script: str
    queued: QueuedJob


def pending_jobs(run: ClusterRun, queued: Sequence[QueuedJob]) -> list[PendingJob]:
    """The jobs the run's current segment waits as: its job, or each type's candidate (their batch
    scripts job.<i>.sbatch, in the order the candidates were sent)."""
    seg = run.current
    if seg is None:
        return []
    by_id = {q.job_id: q for q in queued if q.state == "PENDING"}
    if seg.candidates and not seg.placed:
        return [
            PendingJob(job, gpu_type, f"job.{i}.sbatch", by_id[job])
            for i, (job, gpu_type) in enumerate(seg.candidates, 1)
            if job in by_id
        ]
    if seg.job_id in by_id:
        gpu_type = str(run.meta.get("gpu_type") or "")
        script = "job.sbatch"
        types = list(run.meta.get("gpu_types") or [])
        if types and seg.gpu_type in types:  # a run over several types: the script of the type it got
            script, gpu_type = f"job.{types.index(seg.gpu_type) + 1}.sbatch", str(seg.gpu_type)
        return [PendingJob(str(seg.job_id), gpu_type, script, by_id[str(seg.job_id)])]
    return []


def asks(pending: Sequence[PendingJob]) -> dict[str, list[str]]:
    """The Slurm commands of the second round trip, by key."""
    out = {
        "config": commands.scontrol_show_config(),
        "qos": commands.sacctmgr_qos_limits(),
        "assoc": commands.sacctmgr_assoc_limits(),
    }
    for p in pending:
        out[f"job:{p.job_id}"] = commands.scontrol_show_job(p.job_id)
        out[f"queue:{p.queued.partition}"] = commands.squeue_partition(p.queued.partition)
    return out


def gather(transport: Transport, root: str, run: ClusterRun, pending: Sequence[PendingJob]) -> RunsListing:
    from rv.job import query

    return query.fetch(transport, root, ids=[run.run_id], slurm=asks(pending))


# --- what Slurm says, in words -------------------------------------------------------------------------


def _text(answers: Mapping[str, Mapping[str, Any]], key: str) -> str:
    answer = answers.get(key) or {}
    return "" if answer.get("error") else str(answer.get("text") or "")


def _limit_text(
    job: SlurmJob, code: str, answers: Mapping[str, Mapping[str, Any]], user_assoc: list[dict[str, str]]
) -> str | None:
    """The limit a reason names, with its value (None: the reason names no limit)."""
    r = reason(code)
    if r.limit is None:
        return None
    if r.limit.owner == "qos":
        rows = [row for row in parse_sacctmgr(_text(answers, "qos"), QOS_FIELDS) if row["name"] == job.qos]
        whose = f"QoS {job.qos}"
    else:
        rows = [
            row
            for row in user_assoc
            if row["account"] == job.account and row["partition"] in ("", job.partition)
        ]
        whose = f"account {job.account}"
    for row in rows:
        raw = row.get(r.limit.field) or ""
        value = tres_value(raw, r.limit.tres) if r.limit.tres else raw
        if value:
            return f"{whose} allows {r.limit.what}: {value} ({r.limit.field}={raw})"
    return f"{whose}: {r.limit.what} (sacctmgr shows no value{'' if rows else ': no accounting here'})"


def explain_pending(
    run: ClusterRun,
    pending: Sequence[PendingJob],
    answers: Mapping[str, Mapping[str, Any]],
    *,
    now: float,
    catalog: Mapping[str, GpuType],
) -> list[Waiting]:
    """Each pending job in words, with the suggestions still to be judged by sbatch."""
    window = parse_backfill_window(_text(answers, "config"))
    assoc = parse_sacctmgr(_text(answers, "assoc"), ASSOC_FIELDS)
    allowed_qos = sorted({q for row in assoc for q in row["qos"].split(",") if q})
    out = []
    for p in pending:
        jobs = parse_scontrol_jobs(_text(answers, f"job:{p.job_id}"))
        job = jobs[0] if jobs else None
        queue = parse_queue(_text(answers, f"queue:{p.queued.partition}"))
        code = (job.reason if job else None) or p.queued.reason or "None"
        r = reason(code)
        priority = job.priority if job else None
        ahead = [
            q for q in queue
            if q.state == "PENDING" and q.job_id != p.job_id and priority is not None
            and q.priority is not None and q.priority > priority
        ]  # fmt: skip
        running = sum(1 for q in queue if q.state in ("RUNNING", "COMPLETING"))
        start = job.start if job and job.start and job.start > now - 5 else None
        limit_seconds = (job.time_limit_seconds if job else None) or p.queued.time_limit_seconds
        notes = []
        if limit_seconds and limit_seconds > window:
            notes.append(
                f"its --time ({format_elapsed(limit_seconds)}) is longer than the scheduler's backfill "
                f"window ({format_elapsed(window)}, bf_window): backfill cannot plan it into a gap"
            )
        waiting = Waiting(
            job_id=p.job_id, gpu_type=p.gpu_type, script=p.script, code=code, words=r.words, kind=r.kind,
            limit=_limit_text(job, code, answers, assoc) if job else None, partition=p.queued.partition,
            qos=job.qos if job else None, expected_start=start,
            expected_in_s=int(start - now) if start is not None else None,
            ahead=tuple(q.job_id for q in sorted(ahead, key=lambda q: -(q.priority or 0))), running=running,
            notes=tuple(notes),
        )  # fmt: skip
        suggestions = _suggestions(
            run, waiting, ahead, now=now, catalog=catalog, allowed_qos=allowed_qos,
            limit_seconds=limit_seconds, window=window,
        )  # fmt: skip
        out.append(replace(waiting, suggestions=tuple(suggestions)))
    return out


def rv_minutes(minutes: int) -> str:
    """A duration as `rv run --time` takes it: ``9m``, ``2h30m``, ``1d4h``."""
    days, rest = divmod(minutes, 1440)
    hours, mins = divmod(rest, 60)
    parts = [
        f"{days}d" if days else "",
        f"{hours}h" if hours else "",
        f"{mins}m" if mins and not days else "",
    ]
    return "".join(parts) or "0m"


def _suggestions(
    run: ClusterRun, w: Waiting, ahead: Sequence[QueueEntry], *, now: float,
    catalog: Mapping[str, GpuType], allowed_qos: Sequence[str], limit_seconds: int | None, window: int,
) -> list[Suggestion]:  # fmt: skip
    out: list[Suggestion] = []
    gpus_per_node = int((run.meta.get("request") or {}).get("gpus_per_node") or 0)
    if w.kind in ("priority", "resources", "nodes") and limit_seconds:
        # Backfill starts a job now when it ends before the jobs ahead are planned to start.
        planned = [q.start for q in ahead if q.start is not None and q.start > now]
        fits = (min(planned) - now - TIME_MARGIN_S) if planned else None
        fits = min(fits, window) if fits is not None else (window if limit_seconds > window else None)
        if fits is not None and MIN_SUGGESTED_TIME_S <= fits < limit_seconds:
            minutes = int(fits // 60)
            before = (
                f"ends before job {ahead[0].job_id} ahead of it is planned to start"
                if planned else "fits in the backfill window"
            )  # fmt: skip
            out.append(
                Suggestion(
                    change=f"--time {rv_minutes(minutes)}",
                    why=f"the longest time that {before}: the scheduler may fit it in now (for a program "
                    "that checkpoints: rv continues it in later segments)",
                    script=w.script,
                    options=(f"--time={minutes}",),
                )
            )
    if w.kind in ("priority", "resources", "nodes", "limit") and w.gpu_type and gpus_per_node > 1:
        t = catalog.get(w.gpu_type)
        if t is not None and (w.kind != "limit" or "gres/gpu" in (w.limit or "") or "GPU" in w.words):
            fewer = gpus_per_node // 2
            out.append(
                Suggestion(
                    change=f"-g {fewer * int(run.meta.get('nodes') or 1)}",
                    why="half the GPUs, if the program can run on fewer",
                    script=w.script,
                    options=(f"--gres=gpu:{t.gres}:{fewer}" if t.gres else f"--gres=gpu:{fewer}",),
                )
            )
    if w.kind in ("priority", "resources", "nodes", "limit") and w.gpu_type:
        taken = {w.gpu_type, *(t for _, t in (run.current.candidates if run.current else ()))}
        for t in catalog.values():
            if t.name in taken or gpus_per_node > t.gpus_per_node or not gpus_per_node:
                continue
            gres = f"--gres=gpu:{t.gres}:{gpus_per_node}" if t.gres else f"--gres=gpu:{gpus_per_node}"
            why = f"another GPU type ({t.name}, partition {t.partition})"
            options = (f"--partition={t.partition}", gres)
            out.append(Suggestion(change=f"-t {t.name}", why=why, script=w.script, options=options))
    if w.kind in ("limit", "priority") and w.qos:
        for q in allowed_qos:
            if q != w.qos:
                why = f"another QoS your account may use (now {w.qos})"
                out.append(Suggestion(change=f"--qos {q}", why=why, script=w.script, options=(f"--qos={q}",)))
    return out


def probes(waiting: Sequence[Waiting]) -> list[dict[str, Any]]:
    return [{"script": s.script, "options": list(s.options)} for w in waiting for s in w.suggestions]


def judged(waiting: Sequence[Waiting], replies: Sequence[Mapping[str, Any]]) -> list[Waiting]:
    """The suggestions with sbatch --test-only's word on each; the ones it refused left out."""
    answers = iter(replies)
    out = []
    for w in waiting:
        kept = []
        for s in w.suggestions:
            reply = next(answers, None)
            if reply is None:
                continue
            estimate = parse_test_only("", int(reply.get("code", 1)), str(reply.get("text") or ""))
            if estimate.error is None:
                start = int(estimate.start) if estimate.start and estimate.start.isdigit() else None
                sooner = None if start is None or w.expected_start is None else start < w.expected_start
                kept.append(replace(s, accepted=True, estimate=start, sooner=sooner))
        out.append(replace(w, suggestions=tuple(kept)))
    return out


def check(transport: Transport, root: str, run_id: str, waiting: Sequence[Waiting]) -> list[Waiting]:
    """The third round trip: sbatch --test-only on each suggestion (rv/agent/why.py)."""
    asked = probes(waiting)
    if not asked:
        return list(waiting)
    reply = call_agent(
        transport, "why-probe",
        {"root": root, "run_id": run_id, "probes": asked, "test_only": commands.sbatch_test_only(epoch=True)},
        timeout=120,
    )  # fmt: skip
    return judged(waiting, reply.get("probes") or [])


# --- runs that run or ended -------------------------------------------------------------------------------


def segment_lines(run: ClusterRun) -> tuple[str, ...]:
    lines = []
    for seg in run.segments:
        if seg.state == "ended":
            lines.append(f"segment {seg.index} (job {seg.job_id}): {seg.reason or 'ended'}"
                         + (f", exit code {seg.exit_code}" if seg.exit_code is not None else ""))  # fmt: skip
        elif seg.state == "running":
            lines.append(f"segment {seg.index} (job {seg.job_id}): running on {seg.nodes or '?'}")
        elif seg.state == "requeued":
            lines.append(f"segment {seg.index} (job {seg.job_id}): requeued by Slurm")
        else:
            lines.append(f"segment {seg.index} (job {seg.job_id}): submitted")
    return tuple(lines)


def explain(
    run: ClusterRun,
    listing: RunsListing,
    waiting: Sequence[Waiting] = (),
) -> Why:
    """The whole answer for one run: pending (``waiting``), running, or ended."""
    from rv.job.records import run_views

    (view,) = [v for v in run_views([run], listing.queued, listing.accounted, now=listing.now) if v.run_id]
    seg = run.current
    common: dict[str, Any] = {"run": run.name, "run_id": run.run_id, "segment": seg.index if seg else 0,
              "max_segments": run.max_segments, "details": segment_lines(run)}  # fmt: skip
    if waiting:
        parts = [f"{w.gpu_type or 'job'} {w.job_id}: {w.words}{_in_brackets(w.code)}" for w in waiting]
        return Why(state="PENDING", summary="pending: " + "; ".join(parts), waiting=tuple(waiting), **common)
    if view.live:
        if view.state == "PENDING":
            return Why(
                state="PENDING",
                summary=f"pending: {reason(view.reason).words}{_in_brackets(view.reason)}",
                **common,
            )
        so_far = (
            f"segment {view.segment} of at most {view.max_segments}, {format_elapsed(view.elapsed_seconds)}"
        )
        return Why(state=view.state, summary=f"{view.state.lower()}: {so_far} so far", **common)
    ended = run.ended or {}
    why = str(ended.get("reason") or view.reason or "no record of its end")
    return Why(state=view.state, summary=f"ended: {why}", exit_code=view.exit_code, **common)


def _in_brackets(code: str | None) -> str:
    """`` (Priority)`` after the words; nothing for Slurm's ``None`` (no reason yet)."""
    from rv.slurm.pending import said_code

    shown = said_code(code)
    return f" ({shown})" if shown else ""
