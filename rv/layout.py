"""Where rv keeps things under a profile's remote root. One place, so every module agrees.

<root>/objects/ab/abcdef...     content-addressed file store (git blob ids)
<root>/snapshots/<id>/          immutable tree of hard links into objects/ (read-only)
<root>/snapshots/<id>.json      the snapshot's manifest and provenance, beside it
<root>/workspaces/<project>/<branch>/   mutable mirror for `rv sync push`
<root>/jobs/<jobid>/            RV_JOB_DIR: the job's script, work tree and output
<root>/jobs/<jobid>/output/     RV_OUTPUT_DIR
<root>/checkpoints/<project>/<name>/    RV_CHECKPOINT_DIR: stable across resubmits of one run
<root>/logs/<name>-<jobid>.out|.err     batch logs; per node: <name>-<jobid>-node<i>.out|.err
<root>/secrets/<uuid>.env       env for one job, mode 0600, deleted when the job ends
<root>/cache/{hf,torch,triton,pip,wandb,xdg}   caches kept off the home quota
<root>/tmp/                     staging for uploads; renamed into place when complete
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteLayout:
    root: str

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    @property
    def objects(self) -> str:
        return self._join("objects")

    def object(self, oid: str) -> str:
        return self._join("objects", oid[:2], oid)

    @property
    def snapshots(self) -> str:
        return self._join("snapshots")

    def snapshot(self, snapshot_id: str) -> str:
        return self._join("snapshots", snapshot_id)

    def snapshot_meta(self, snapshot_id: str) -> str:
        return self._join("snapshots", snapshot_id + ".json")

    def workspace(self, project: str, branch: str) -> str:
        return self._join("workspaces", project, branch.replace("/", "_"))

    @property
    def jobs(self) -> str:
        return self._join("jobs")

    def job_dir(self, job_id: str) -> str:
        return self._join("jobs", job_id)

    def checkpoint_dir(self, project: str, name: str) -> str:
        return self._join("checkpoints", project, name)

    @property
    def logs(self) -> str:
        return self._join("logs")

    def log(self, name: str, job_id: str, stream: str = "out", node: int | None = None) -> str:
        suffix = f"-node{node}" if node is not None else ""
        return self._join("logs", f"{name}-{job_id}{suffix}.{stream}")

    @property
    def secrets(self) -> str:
        return self._join("secrets")

    @property
    def cache(self) -> str:
        return self._join("cache")

    @property
    def tmp(self) -> str:
        return self._join("tmp")
