"""Where rv keeps things under a profile's remote root. One place, so every module agrees.

<root>/store.git/               the snapshot store: a bare git repository (rv.agent.store); each
                                snapshot a commit held by refs/rv/snapshots/<id>
<root>/snapshots/<id>.git.json  the snapshot's provenance, touched at every use (gc's age)
<root>/objects/.lock            the store's lock (gc exclusive, uploads shared)
<root>/objects/, snapshots/<id>/    the store of earlier rv versions (rv.agent.oldstore): kept while
                                runs it queued use it, then collected by rv gc
<root>/workspaces/<project>/<branch>/   mutable mirror for `rv sync push`
<root>/runs/<run id>/           one run (a chain of Slurm jobs, its segments); everything but its
    run.json                    checkpoints and outputs, so one rmtree cleans it up:
    job.sbatch                  the batch script, the same for every segment
    submit.env                  the environment segment 1 was submitted with (for continuations)
    secrets.env                 `rv env` values, mode 0600, deleted when the run ends
    seg/<k>.job, seg/<k>.json   segment k's job id (written by its submitter) and record (by the job)
    STOP, ENDED                 `rv stop` was asked; the run is over (JSON: why, exit code)
    work/                       RV_WORK_DIR: the run's private copy of its snapshot (checked out
    work.index                  from the store with an index of its own: what the job checked)
    jobs/<job id>/              RV_JOB_DIR: per Slurm job (node exit codes, stop deliveries)
    jobs/<job id>/env.sh        the program's environment, for `rv ssh`/`rv up` shells (0600, holds
                                the secrets; removed when the job ends)
    up.alive, up.detached       `rv up`: the watchdog's heartbeat; --detach (the job keeps itself)
    logs/<job id>.out|.err      batch logs; multi-node: <job id>-node<i>.out|.err
<root>/names/<project>/<name>   the id of the newest run of that name (refusing a second live one)
<root>/checkpoints/<project>/<name>/    RV_CHECKPOINT_DIR: shared by the runs of one name (resume)
<root>/outputs/<project>/<name>/        RV_OUTPUT_DIR: likewise
<root>/cache/{hf,torch,triton,pip,wandb,xdg}   caches kept off the home quota
<root>/tmp/                     staging for uploads; renamed into place when complete
<root>/runtime/job-<hash>.sh    rv's job runtime (rv/agent/job.sh) that batch scripts source, and
<root>/runtime/rank-label-<hash>.py   its rank labeller, and notify-<hash>.py its webhook poster; named
                                by content, read-only, written once

Everything rv writes here is private to the user (folders 0700, files 0600, executables 0700)
unless the profile sets ``share_with_group = true``: then the group may read (0750/0640).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteLayout:
    root: str
    share_with_group: bool = False

    @property
    def umask(self) -> int:
        """The umask every remote step runs under: 077 (private), or 027 (group may read)."""
        return 0o027 if self.share_with_group else 0o077

    def agent_args(self, **extra: object) -> dict[str, object]:
        """Arguments for an agent mode: the root, the umask, and the mode's own."""
        return {"root": self.root, "umask": self.umask, **extra}

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    @property
    def store(self) -> str:
        return self._join("store.git")

    def snapshot_ref(self, snapshot_id: str) -> str:
        return f"refs/rv/snapshots/{snapshot_id}"

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
        return self._join("snapshots", snapshot_id + ".git.json")

    def snapshot_layer(self, snapshot_id: str) -> str:
        return self._join("snapshots", snapshot_id + ".layer")

    def workspace(self, project: str, branch: str) -> str:
        return self._join("workspaces", project, branch.replace("/", "_"))

    @property
    def runs(self) -> str:
        return self._join("runs")

    def run_dir(self, run_id: str) -> str:
        return self._join("runs", run_id)

    def name_index(self, project: str, name: str) -> str:
        return self._join("names", project, name)

    def checkpoint_dir(self, project: str, name: str) -> str:
        return self._join("checkpoints", project, name)

    def output_dir(self, project: str, name: str) -> str:
        return self._join("outputs", project, name)

    def log(self, run_id: str, job_id: str, stream: str = "out", node: int | None = None) -> str:
        suffix = f"-node{node}" if node is not None else ""
        return self._join("runs", run_id, "logs", f"{job_id}{suffix}.{stream}")

    @property
    def cache(self) -> str:
        return self._join("cache")

    @property
    def tmp(self) -> str:
        return self._join("tmp")

    @property
    def runtime(self) -> str:
        return self._join("runtime")

    def runtime_file(self, name: str) -> str:
        return self._join("runtime", name)
