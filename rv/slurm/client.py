"""Questions to Slurm that rv asks often, each answered in ONE round trip over the transport."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field

from rv.setup import parse_probe
from rv.slurm.parse import (
    SACCT_FORMAT,
    SINFO_NODE_FORMAT,
    SQUEUE_FORMAT,
    AccountedJob,
    NodeInfo,
    QueuedJob,
    parse_sacct,
    parse_sinfo_nodes,
    parse_squeue,
)
from rv.transport import Transport

# `squeue --me` is Slurm 20.11+; `-u "$(id -un)"` works everywhere.
_SQUEUE = f'squeue -u "$(id -un)" -h -o {shlex.quote(SQUEUE_FORMAT)}'


@dataclass(frozen=True)
class JobsSnapshot:
    live: list[QueuedJob]
    finished: list[AccountedJob] = field(default_factory=list)
    sacct_error: str | None = None


def list_jobs(transport: Transport, *, include_finished: bool, days: int = 7) -> JobsSnapshot:
    """Live jobs from squeue, plus (with include_finished) the last `days` of jobs from sacct."""
    parts = ["echo @@squeue", _SQUEUE]
    if include_finished:
        parts += [
            "echo @@sacct",
            f'sacct -u "$(id -un)" -S now-{int(days)}days -n --parsable2 -o {shlex.quote(SACCT_FORMAT)} '
            "2>&1 || echo @@sacct_failed",
        ]
    out = parse_probe(transport.run("; ".join(parts), timeout=60).check("squeue").out)
    sacct_lines = out.get("sacct", [])
    failed = "sacct_failed" in out
    return JobsSnapshot(
        live=parse_squeue("\n".join(out.get("squeue", []))),
        finished=[] if failed else parse_sacct("\n".join(sacct_lines)),
        sacct_error=" ".join(sacct_lines).strip() if failed else None,
    )


@dataclass(frozen=True)
class ClusterStatus:
    user: str
    round_trip_ms: float
    storage_bytes: int | None
    jobs: list[QueuedJob]
    nodes: list[NodeInfo]


def cluster_status(transport: Transport, remote_root: str) -> ClusterStatus:
    root = shlex.quote(remote_root)
    command = "; ".join(
        [
            "echo @@user; id -un",
            f"echo @@du; du -sk {root} 2>/dev/null | cut -f1",
            "echo @@squeue",
            _SQUEUE,
            "echo @@sinfo",
            f"sinfo -N -h -O {shlex.quote(SINFO_NODE_FORMAT)}",
        ]
    )
    started = time.monotonic()
    result = transport.run(command, timeout=60).check("reading the cluster's state")
    elapsed = (time.monotonic() - started) * 1000
    out = parse_probe(result.out)
    du = "".join(out.get("du", [])).strip()
    return ClusterStatus(
        user="".join(out.get("user", [])).strip(),
        round_trip_ms=elapsed,
        storage_bytes=int(du) * 1024 if du.isdigit() else None,
        jobs=parse_squeue("\n".join(out.get("squeue", []))),
        nodes=parse_sinfo_nodes("\n".join(out.get("sinfo", []))),
    )
