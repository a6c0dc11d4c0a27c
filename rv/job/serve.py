"""What an `rv up` session serves: an editor's SSH host (`rv code`), a notebook (`rv jupyter`).

Both commands keep their session as a detached `rv up` (rv.job.up): it ends with `rv stop NAME` or
its time limit. Running either again reuses the newest live session that one of them set up, so the
editor and the notebook share one allocation; ``--name`` picks one. What each serves is kept in the
session's local record (:attr:`rv.job.records.RunRecord.serves`), which `rv ps` shows.
"""

from __future__ import annotations

import io
import posixpath
import shlex
import tarfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rv.job import query
from rv.job.inside import RunningJob
from rv.job.records import RunRecord, RunStore

if TYPE_CHECKING:
    from rv.remote.transport import RunResult, Transport


def candidates(store: RunStore, profile: str, root: str) -> list[RunRecord]:
    """This machine's sessions that rv code or rv jupyter set up, not known to have ended, newest first."""
    found = [r for r in store.all(profile) if r.serves and r.ended is None and r.remote_root == root]
    return sorted(found, key=lambda r: r.submitted_at, reverse=True)


def live_session(
    transport: Transport, store: RunStore, profile: str, root: str, records: Sequence[RunRecord]
) -> RunningJob | None:
    """The newest of ``records`` whose job is running now (one round trip); None when none is."""
    if not records:
        return None
    listing = query.fetch(transport, root, ids=[r.run_id for r in records])
    runs = {run.run_id: run for run in listing.runs}
    queued = {job.job_id: job for job in listing.queued}
    learned = []
    for record in records:
        run = runs.get(record.run_id)
        if run is None:
            continue
        learned.append((record, run))
        seg = run.current
        job = queued.get(seg.job_id) if seg is not None and seg.job_id else None
        if job is not None and job.state == "RUNNING" and run.ended is None:
            query.cache_learned_many(store, profile, learned)
            return RunningJob(run=run, job=job, root=record.remote_root)
    query.cache_learned_many(store, profile, learned)
    return None


def remember(store: RunStore, rj: RunningJob, profile: str, **serves: Any) -> None:
    """Add to what the session's record says it serves."""
    record = store.resolve(rj.run.run_id, profile)
    merged = dict(record.serves if record is not None else {})
    merged.update({k: v for k, v in serves.items() if v is not None})
    store.update(profile, rj.run.run_id, serves=merged)


def put_folder(
    transport: Transport,
    folder: str,
    files: Mapping[str, tuple[bytes, int]],
    *,
    then: str | None = None,
    timeout: float = 120,
) -> RunResult:
    """Write ``files`` (name -> (bytes, mode)) into ``folder`` on the cluster (made 0700), then run
    ``then`` there: one round trip, one tar stream on stdin; a file is replaced whole."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    q = shlex.quote(folder)
    line = f"umask 077 && mkdir -p {q} && chmod 700 {q} && tar -x --no-same-owner -f - -C {q}" + (
        f" && {then}" if then else ""
    )
    return transport.run(line, stdin=buf.getvalue(), timeout=timeout)


def session_folder(rj: RunningJob, name: str) -> str:
    """A folder of the session's own under its run's folder (gone with the run at rv gc)."""
    return posixpath.join(rj.place.run_dir, name)
