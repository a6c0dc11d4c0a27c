"""Questions to Slurm that rv asks often, each answered in ONE round trip over the transport."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from rv.setup import parse_probe
from rv.slurm import commands
from rv.slurm.parse import NodeInfo, QueuedJob, parse_sinfo_nodes, parse_squeue
from rv.transport import Transport


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
            commands.shell(commands.squeue_user()),
            "echo @@sinfo",
            commands.shell(commands.sinfo_nodes()),
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
