"""Questions to Slurm that rv asks often, each answered in ONE round trip over the transport."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rv.remote.transport import Transport
from rv.slurm import commands
from rv.slurm.parse import NodeInfo, QueuedJob, parse_sinfo_nodes, parse_squeue


@dataclass(frozen=True)
class ClusterStatus:
    user: str
    round_trip_ms: float  # the call, less the time the agent worked on the cluster
    jobs: list[QueuedJob]
    nodes: list[NodeInfo]
    # What rv keeps by kind, in bytes ("kinds", "total") and files ("files", "files_total"), what gc
    # would free ("gc"), and the quota tools' answer ("quota": rv.job.footprint reads it).
    usage: dict[str, Any]
    squeue_error: str | None = None
    sinfo_error: str | None = None
    sweep: dict[str, Any] | None = None  # the secrets sweep that rode along, if one was asked for
    partitions_text: str = ""  # sinfo's partitions (SINFO_PARTITION_FORMAT), "" when it failed
    associations_text: str = ""  # sacctmgr's associations of the user, "" without accounting
    git: dict[str, Any] = field(default_factory=dict)  # the login node's git: version, problem (or None)
    # Container runtimes after the profile's setup lines (rv.agent.container): {"found": {name:
    # {"path", "version"}}} or {"error": ...}.
    runtimes: dict[str, Any] = field(default_factory=dict)


def cluster_status(
    transport: Transport,
    remote_root: str,
    *,
    older_than: float,
    sweep: Sequence[str] = (),
    setup: Sequence[str] = (),
) -> ClusterStatus:
    """Everything `rv status` shows, in one agent call however many jobs are queued.

    ``older_than`` is the age `rv gc` would remove ended runs at; ``sweep`` the run ids whose leftover
    secrets this call removes too (see rv.job.cleanup).
    """
    from rv.remote.agent_client import call_agent

    args: dict[str, Any] = {
        "root": remote_root,
        "older_than": older_than,
        "checkpoints": False,
        "squeue": commands.squeue_user(),
        "sinfo": commands.sinfo_nodes(),
        "partitions": commands.sinfo_partitions(),
        "associations": commands.sacctmgr_associations(),
        "quota": True,
        "runtimes": list(setup),  # found after these lines (a module load)
    }
    if sweep:
        args["secrets_sweep"] = list(sweep)
    started = time.monotonic()
    reply = call_agent(transport, "usage", args, timeout=300)
    elapsed = (time.monotonic() - started) * 1000
    squeue, sinfo = reply.get("squeue") or {}, reply.get("sinfo") or {}
    return ClusterStatus(
        user=str(reply.get("user") or ""),
        round_trip_ms=max(0.0, elapsed - float(reply.get("work_ms") or 0.0)),
        jobs=[] if squeue.get("error") else parse_squeue(squeue.get("text") or ""),
        nodes=[] if sinfo.get("error") else parse_sinfo_nodes(sinfo.get("text") or ""),
        usage={
            key: reply.get(key) for key in ("kinds", "total", "gc", "files", "files_total", "quota", "images")
        },
        git=reply.get("git") or {},
        squeue_error=squeue.get("error"),
        sinfo_error=sinfo.get("error"),
        sweep=reply.get("secrets_sweep") if sweep else None,
        partitions_text=_text(reply.get("partitions")),
        associations_text=_text(reply.get("associations")),
        runtimes=reply.get("runtimes") or {},
    )


def _text(answer: Any) -> str:
    return str(answer.get("text") or "") if isinstance(answer, dict) and not answer.get("error") else ""
