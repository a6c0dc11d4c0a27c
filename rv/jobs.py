"""Local records of submitted jobs: what was run, from which snapshot and commit, where.

One JSON file next to the config. Writes are atomic (temp file + rename) under an advisory lock, so
two `rv run` at once cannot lose each other's record.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rv.errors import NotFound, UsageError


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    profile: str
    remote_root: str
    snapshot: str | None
    project: str
    branch: str | None
    commit: str | None
    dirty: bool
    command: list[str]
    request: dict[str, Any]
    submitted_at: float
    nodes: int = 1
    outputs: list[str] = field(default_factory=list)

    @property
    def short_commit(self) -> str:
        if not self.commit:
            return "-"
        return f"{self.branch or '?'}@{self.commit[:7]}{'+' if self.dirty else ''}"


class JobStore:
    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> list[JobRecord]:
        if not self.path.exists():
            return []
        data = json.loads(self.path.read_text(encoding="utf-8"))
        return [JobRecord(**row) for row in data.get("jobs", [])]

    def all(self, profile: str | None = None) -> list[JobRecord]:
        """Oldest first."""
        jobs = self._read()
        return [j for j in jobs if profile is None or j.profile == profile]

    def add(self, record: JobRecord) -> None:
        with self._locked():
            same = (record.job_id, record.profile)
            jobs = [j for j in self._read() if (j.job_id, j.profile) != same]
            jobs.append(record)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"jobs": [asdict(j) for j in jobs]}, indent=1), encoding="utf-8")
            os.replace(tmp, self.path)

    def resolve(self, ref: str | None, profile: str) -> JobRecord:
        """A job by id, unique id prefix or name (the latest of that name); None means the latest job."""
        jobs = self.all(profile)
        if not jobs:
            raise NotFound("no jobs submitted with this profile yet", hint="rv run -- python train.py")
        if ref is None:
            return jobs[-1]
        exact = [j for j in jobs if j.job_id == ref]
        if exact:
            return exact[-1]
        prefixed = [j for j in jobs if j.job_id.startswith(ref)]
        if len(prefixed) == 1:
            return prefixed[0]
        if len(prefixed) > 1:
            ids = ", ".join(j.job_id for j in prefixed[-5:])
            raise UsageError(f"job prefix {ref!r} is ambiguous: {ids}", hint="give more digits")
        named = [j for j in jobs if j.name == ref]
        if named:
            return named[-1]
        raise NotFound(f"no job {ref!r} (by id, id prefix or name)", hint="`rv ps -a` lists your jobs")
