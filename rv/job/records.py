"""A run's records: the laptop's (what was submitted from here) and the cluster's (what the jobs wrote).

Local: ``runs.json`` in rv's state folder, one entry per run, written atomically under a lock so two
``rv run`` at once lose nothing. It points at the cluster's records (profile, remote root, run id)
and caches what rv learned from them (every segment's job id, the run's end).

Cluster: ``<root>/runs/<id>/run.json`` (written at submission), ``seg/<k>.job`` and ``seg/<k>.json``
(each segment's job id and the record its job writes), ``ENDED`` (why the run is over). The agent
returns them in one round trip; :func:`parse_runs` turns them into :class:`ClusterRun`, and
:func:`run_views` merges those with ``squeue`` and ``sacct`` into the rows ``rv ps`` prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rv.agent.segment import end_state
from rv.errors import NotFound, UsageError
from rv.slurm.parse import AccountedJob, QueuedJob
from rv.slurm.pending import one_line

# --- local records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    name: str
    profile: str
    remote_root: str
    project: str
    snapshot: str
    branch: str | None
    commit: str | None
    dirty: bool
    command: list[str]
    request: dict[str, Any]
    submitted_at: float
    job_id: str  # segment 1's job
    has_secrets: bool = False
    secrets_cleared: bool = False  # rv saw the run end, so its secrets are gone
    jobs: list[str] = field(default_factory=list)  # every segment's job id rv has seen
    ended: dict[str, Any] | None = None  # the run's ENDED record, once rv has seen it
    # The repository's facts when the run was sent (rv.files.repo.RepoFacts: root, head, branch,
    # dirty, remote); None for a run sent by an rv that did not record them.
    git: dict[str, Any] | None = None
    # What an `rv up` session serves, as rv code and rv jupyter set it up (rv ps shows it):
    # "editor_host" (the ssh Host), "editor_path", "notebook_url", "notebook_port" (on the node).
    serves: dict[str, Any] = field(default_factory=dict)

    @property
    def short_commit(self) -> str:
        if not self.commit:
            return "-"
        return f"{self.branch or '?'}@{self.commit[:7]}{'+' if self.dirty else ''}"

    @property
    def nodes(self) -> int:
        return int(self.request.get("nodes") or 1)

    @property
    def all_jobs(self) -> list[str]:
        return [self.job_id, *(j for j in self.jobs if j != self.job_id)]


_FIELD_NAMES = tuple(f.name for f in fields(RunRecord))
_FIELDS = set(_FIELD_NAMES)


class RunStore:
    """runs.json: the runs submitted from this machine, oldest first."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> list[RunRecord]:
        if not self.path.exists():
            return []
        data = json.loads(self.path.read_text(encoding="utf-8"))
        # Unknown keys (a newer rv wrote them) are dropped rather than refused.
        return [RunRecord(**{k: v for k, v in row.items() if k in _FIELDS}) for row in data.get("runs", [])]

    def _write(self, runs: Sequence[RunRecord]) -> None:
        # One run per line, each by json's C encoder: every `rv run` rewrites the file between its
        # submission and following it, and asdict's deep copies with indent's pure-Python encoder
        # took 15 ms for 215 runs (2 ms this way; a field holds JSON's own types, nothing to copy).
        rows = (json.dumps({name: getattr(r, name) for name in _FIELD_NAMES}) for r in runs)
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write('{"runs": [\n' + ",\n".join(rows) + "\n]}\n")
        os.replace(tmp, self.path)

    def all(self, profile: str | None = None) -> list[RunRecord]:
        return [r for r in self._read() if profile is None or r.profile == profile]

    def add(self, record: RunRecord) -> None:
        with self._locked():
            runs = [r for r in self._read() if (r.run_id, r.profile) != (record.run_id, record.profile)]
            self._write([*runs, record])

    def add_many(self, records: Sequence[RunRecord]) -> None:
        """:meth:`add` for many (a sweep's points), in one read and one write of the file."""
        keys = {(r.run_id, r.profile) for r in records}
        with self._locked():
            runs = [r for r in self._read() if (r.run_id, r.profile) not in keys]
            self._write([*runs, *records])

    def update(self, profile: str, run_id: str, **changes: Any) -> None:
        """Change one record's fields; a run not recorded here is left alone."""
        self.update_many(profile, {run_id: changes})

    def update_many(self, profile: str, changes: Mapping[str, Mapping[str, Any]]) -> None:
        """Change the fields of many records (run id -> changes) with one read and one write.

        One call per run rewrote the whole file each time: with 500 records, a sweep of 250 of them
        took 20 s.
        """
        if not any(changes.values()):
            return
        with self._locked():
            runs = self._read()
            new = [
                replace(r, **changes[r.run_id]) if r.profile == profile and changes.get(r.run_id) else r
                for r in runs
            ]
            if new != runs:
                self._write(new)

    def resolve(self, ref: str | None, profile: str) -> RunRecord | None:
        """A run by name (the newest of that name), run id, job id of any segment seen, or id prefix.

        None means not known here (a job id of a later segment, a run from another machine): ask the
        cluster. ``ref`` None is the newest run.
        """
        runs = self.all(profile)
        if ref is None:
            if not runs:
                raise NotFound("no runs submitted with this profile yet", hint="rv run -- python train.py")
            return runs[-1]
        for match in (
            lambda r: r.name == ref,
            lambda r: r.run_id == ref,
            lambda r: ref in r.all_jobs,
        ):
            found = [r for r in runs if match(r)]
            if found:
                return found[-1]
        prefixed = [r for r in runs if any(j.startswith(ref) for j in r.all_jobs) or r.run_id.startswith(ref)]
        if len({r.run_id for r in prefixed}) > 1:
            ids = ", ".join(sorted({r.run_id for r in prefixed})[:5])
            raise UsageError(f"{ref!r} is ambiguous: it starts runs {ids}", hint="give more characters")
        return prefixed[-1] if prefixed else None


# --- the cluster's records ------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    index: int
    job_id: str | None
    state: str  # submitted (no record yet) | running | requeued | ended
    reason: str  # why it ended ("" while running)
    exit_code: int | None
    start: float | None
    end: float | None
    nodes: str
    attempt: int
    start_step: int | None
    checkpoint_step: int | None
    stop_sent: bool
    next_job_id: str | None
    gpu_type: str | None = None  # the type it got (a run over several types lands on one)
    # A run over several GPU types: the jobs sent for this segment, one per type ((job id, type)); the
    # first to start takes the segment and cancels the others.
    candidates: tuple[tuple[str, str], ...] = ()

    @property
    def placed(self) -> bool:
        """Whether the segment is past choosing among its candidates (it has a record, or had none)."""
        return not self.candidates or self.state != "submitted"


@dataclass(frozen=True)
class ClusterRun:
    run_id: str
    meta: Mapping[str, Any]
    segments: tuple[Segment, ...]
    ended: Mapping[str, Any] | None
    stop_requested: bool
    has_secrets_file: bool

    @property
    def name(self) -> str:
        return str(self.meta.get("name", "?"))

    @property
    def max_segments(self) -> int:
        return int(self.meta.get("max_segments") or 1)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    @property
    def jobs(self) -> list[str]:
        """Every job of the run, the candidates of a segment sent once per GPU type too."""
        out: list[str] = []
        for s in self.segments:
            for job in (s.job_id, *(j for j, _ in s.candidates)):
                if job and job not in out:
                    out.append(job)
        return out

    __hash__ = None  # type: ignore[assignment]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def parse_segment(
    index: int, job_id: str | None, record: Mapping[str, Any] | None, candidates: Iterable[Any] = ()
) -> Segment:
    rec = record or {}
    return Segment(
        index=index,
        job_id=job_id or rec.get("job_id"),
        state=str(rec.get("state") or "submitted"),
        reason=str(rec.get("reason") or ""),
        exit_code=_int(rec.get("exit_code")),
        start=_float(rec.get("start")),
        end=_float(rec.get("end")),
        nodes=str(rec.get("nodes") or ""),
        attempt=_int(rec.get("attempt")) or 0,
        start_step=_int(rec.get("start_step")),
        checkpoint_step=_int(rec.get("checkpoint_step")),
        stop_sent=rec.get("stop_sent") is True,
        next_job_id=rec.get("next_job_id") or None,
        gpu_type=rec.get("gpu_type") or None,
        candidates=tuple((str(c[0]), str(c[1])) for c in candidates if c and c[0]),
    )


def parse_runs(rows: Iterable[Mapping[str, Any]]) -> list[ClusterRun]:
    """The agent's run rows (``runs`` mode) as :class:`ClusterRun`, oldest first."""
    runs = []
    for row in rows:
        segs = tuple(
            parse_segment(s["segment"], s.get("job_id"), s.get("record"), s.get("candidates") or ())
            for s in row["segments"]
        )
        runs.append(
            ClusterRun(
                run_id=row["run_id"],
                meta=row["meta"],
                segments=segs,
                ended=row.get("ended"),
                stop_requested=bool(row.get("stop")),
                has_secrets_file=bool(row.get("secrets")),
            )
        )
    return sorted(runs, key=lambda r: float(r.meta.get("created") or 0))


# --- what `rv ps` shows ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunView:
    """One line of `rv ps`: a run, or a job rv did not submit (then run_id is None)."""

    name: str
    run_id: str | None
    segment: int
    max_segments: int
    state: str
    job_id: str | None
    live: bool
    reason: str | None  # why pending, or why the run ended
    exit_code: int | None
    gpus: int
    gpu_type: str | None
    nodes: int
    elapsed_seconds: int | None
    source: str
    created: float | None
    jobs: tuple[str, ...] = ()
    checkpoint_step: int | None = None
    sweep: str | None = None  # a sweep's point: the sweep's name (its own is SWEEP/INDEX)
    sweep_index: int | None = None
    points: int = 0  # `rv ps`'s one line for a whole sweep: how many points it sums up
    why: str | None = None  # a pending run: its reason in words (rv why's one-line form)
    git: dict[str, Any] | None = None  # the repository's facts the run was sent with (run.json's "git")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def segments_text(self) -> str:
        """SEG: a live run's segment of at most N (``2/10``); an ended run's count of segments (``1``).

        ``1/10`` for a run that finished in one segment read as "stopped after 1 of 10": the ten is
        a ceiling for continuing, not a plan, and means nothing once the run is over."""
        if not self.run_id:
            return f"{self.points}pt" if self.points else "-"  # a sweep's line: the points it sums up
        return f"{self.segment}/{self.max_segments}" if self.live else str(self.segment)


def _source(meta: Mapping[str, Any]) -> str:
    commit = meta.get("commit")
    if not commit:
        return "-"
    return f"{meta.get('branch') or '?'}@{str(commit)[:7]}{'+' if meta.get('dirty') else ''}"


def _elapsed(run: ClusterRun, live: QueuedJob | None, now: float) -> int | None:
    """Seconds the run's segments ran, the live one's per squeue."""
    total, known = 0.0, False
    for seg in run.segments:
        if live is not None and seg.job_id == live.job_id:
            if live.elapsed_seconds is not None:
                total, known = total + live.elapsed_seconds, True
        elif seg.start is not None:
            total, known = total + max(0.0, (seg.end or now) - seg.start), True
    return round(total) if known else None


def run_views(
    runs: Sequence[ClusterRun],
    queued: Sequence[QueuedJob],
    accounted: Sequence[AccountedJob] = (),
    *,
    now: float,
    live_only: bool = False,
) -> list[RunView]:
    """Newest first: runs by their records (squeue for the live segment), then others' jobs."""
    by_id = {j.job_id: j for j in queued}
    acct = {j.job_id: j for j in accounted}
    views = []
    claimed: set[str] = set()
    for run in runs:
        claimed.update(run.jobs)
        seg = run.current
        meta = run.meta
        live_job = by_id.get(seg.job_id) if seg and seg.job_id else None
        gpu_type = (seg.gpu_type if seg else None) or meta.get("gpu_type")
        reason: str | None
        if seg is not None and not seg.placed:
            # Sent once per GPU type and none started yet: pending on each, in order of preference.
            waiting = [(by_id[j], t) for j, t in seg.candidates if j in by_id]
            live_job = waiting[0][0] if waiting else live_job
            gpu_type = "|".join(t for _, t in seg.candidates)
        why = None
        if seg is not None and not seg.placed and live_job is not None:
            state, exit_code = live_job.state, None
            reason = "pending on " + ", ".join(f"{t} ({j.reason})" if j.reason else t for j, t in waiting)
            why = "pending on " + ", ".join(f"{t}: {one_line(j.reason)}" for j, t in waiting)
        elif live_job is not None:
            state, reason, exit_code = (
                live_job.state,
                live_job.reason if live_job.state == "PENDING" else None,
                None,
            )
            why = one_line(live_job.reason) if live_job.state == "PENDING" else None
        elif run.ended is not None:
            reason = str(run.ended.get("reason") or "")
            state, exit_code = end_state(reason), _int(run.ended.get("exit_code"))
        elif seg is not None and seg.state == "ended":
            state, reason, exit_code = end_state(seg.reason), seg.reason, seg.exit_code
        else:
            # Neither live nor recorded as over: sacct may know (cancelled while pending), else unknown.
            known = acct.get(seg.job_id or "") if seg else None
            state = known.state if known else "UNKNOWN"
            reason = "no record of its end (rv stop or any rv command that connects will tidy up)"
            exit_code = known.exit_code if known else None
        if live_only and live_job is None:
            continue
        steps = [s.checkpoint_step for s in run.segments if s.checkpoint_step is not None]
        sweep: Mapping[str, Any] = meta["sweep"] if isinstance(meta.get("sweep"), Mapping) else {}
        views.append(
            RunView(
                name=run.name,
                run_id=run.run_id,
                segment=seg.index if seg else 0,
                max_segments=run.max_segments,
                state=state,
                job_id=seg.job_id if seg else None,
                live=live_job is not None,
                reason=reason or None,
                exit_code=exit_code,
                gpus=int(meta.get("gpus") or 0),
                gpu_type=gpu_type,
                nodes=int(meta.get("nodes") or 1),
                elapsed_seconds=_elapsed(run, live_job, now),
                source=_source(meta),
                created=_float(meta.get("created")),
                jobs=tuple(run.jobs),
                checkpoint_step=steps[-1] if steps else None,
                sweep=str(sweep["name"]) if sweep.get("name") else None,
                sweep_index=_int(sweep.get("index")),
                why=why,
                git=dict(meta["git"]) if isinstance(meta.get("git"), Mapping) else None,
            )
        )
    views.sort(key=lambda v: v.created or 0, reverse=True)
    others: list[RunView] = []
    for job in queued:
        if job.job_id not in claimed and job.id.job not in claimed:
            others.append(_job_view(job.name, job.job_id, job.state, job.reason, None, job))
    if not live_only:
        for acc in accounted:
            if acc.job_id not in claimed and acc.id.job not in claimed and acc.job_id not in by_id:
                view = _job_view(acc.name, acc.job_id, acc.state, acc.reason, acc.exit_code, acc)
                if rejected_at_submission(acc):
                    view = replace(view, reason=REJECTED)
                others.append(view)
    others.sort(key=lambda v: _job_sort_key(v.job_id or ""), reverse=True)
    return views + others


REJECTED = "rejected at submission: it never ran, so it has no logs"


def rejected_at_submission(job: AccountedJob) -> bool:
    """A job slurmctld refused as it was submitted (sbatch said why and exited 1): accounting keeps it
    as FAILED on no node. rv made no run of it (nothing half-made stays), so only sacct knows it."""
    return job.state == "FAILED" and not job.node_list


def _job_view(name: str, job_id: str, state: str, reason: str | None, code: int | None, job: Any) -> RunView:
    return RunView(
        name=name, run_id=None, segment=1, max_segments=1, state=state, job_id=job_id,
        live=isinstance(job, QueuedJob), reason=reason if state == "PENDING" else None, exit_code=code,
        gpus=job.gpus, gpu_type=job.gpu_type, nodes=job.nodes, elapsed_seconds=job.elapsed_seconds,
        source="-", created=None,
    )  # fmt: skip


def _job_sort_key(job_id: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", job_id))


def run_exit_code(ended: Mapping[str, Any] | None) -> int:
    """What `rv run -f` and `rv logs -f` exit with: the run's code, 1 when it is unknown."""
    code = _int((ended or {}).get("exit_code"))
    return 1 if code is None else code
