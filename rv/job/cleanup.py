"""The end of a run's life: stopping it, sweeping secrets a killed job left, and collecting garbage.

Secrets live exactly as long as the run: the job removes them when the run ends by any path it sees
(finished, crashed, time limit, rv stop, scancel). A job killed too hard to run its EXIT trap, or
cancelled before it started, cannot: then the next rv command that talks to the cluster does
(:func:`sweep_secrets`), and says so. It only asks about runs this machine submitted with secrets
and has not yet seen end, so it costs nothing in the common case.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rv.job.records import RunRecord, RunStore
from rv.remote.agent_client import call_agent
from rv.slurm import commands

if TYPE_CHECKING:
    from rv.remote.transport import Transport


@dataclass(frozen=True)
class Stopped:
    run_id: str
    name: str
    cancelled: tuple[str, ...]
    secrets_removed: bool
    error: str | None


def stop_runs(transport: Transport, root: str, runs: Sequence[tuple[str, str]]) -> list[Stopped]:
    """``rv stop``: STOP for each (run id, name), scancel of its live segments, its secrets gone."""
    names = dict(runs)
    reply = call_agent(
        transport, "run-stop", {"root": root, "ids": list(names), "scancel": commands.scancel([])}, timeout=60
    )
    return [
        Stopped(
            run_id=row["run_id"],
            name=names.get(row["run_id"], row["run_id"]),
            cancelled=tuple(row.get("cancelled") or ()),
            secrets_removed=bool(row.get("secrets_removed")),
            error=row.get("error"),
        )
        for row in reply["stopped"]
    ]


def pending_secrets(store: RunStore, profile: str, root: str) -> list[RunRecord]:
    """Runs sent with secrets whose end this machine has not seen: their secrets may still be there."""
    return [
        r for r in store.all(profile) if r.has_secrets and not r.secrets_cleared and r.remote_root == root
    ]


def sweep_secrets(
    transport: Transport, store: RunStore, profile: str, root: str, note: Callable[[str], None]
) -> None:
    """Remove the secrets of runs no job is alive for; mark the rest of what is known."""
    pending = pending_secrets(store, profile, root)
    if not pending:
        return
    reply = call_agent(
        transport,
        "secrets-sweep",
        {"root": root, "ids": [r.run_id for r in pending], "squeue": commands.squeue_user()},
    )
    apply_sweep(store, profile, pending, reply, note)


def apply_sweep(
    store: RunStore,
    profile: str,
    pending: Sequence[RunRecord],
    reply: dict[str, Any],
    note: Callable[[str], None],
) -> None:
    """What a sweep found (its own call's reply, or one that rode along on ``runs`` or ``usage``)."""
    by_id = {r.run_id: r for r in pending}
    for run_id in reply.get("removed", []):
        run = by_id[run_id]
        note(f"removed the secrets of run {run.name} ({run_id}): its job ended without removing them")
    live = set(reply.get("live", []))
    # One write for all of them: a write per run made a sweep of hundreds of runs take seconds.
    store.update_many(profile, {run_id: {"secrets_cleared": True} for run_id in by_id if run_id not in live})


def collect_garbage(
    transport: Transport, root: str, *, older_than: float, checkpoints: bool, dry_run: bool
) -> dict[str, Any]:
    """``rv gc``: the agent removes what finished runs left, then unreferenced snapshots and objects."""
    args = {
        "root": root,
        "older_than": older_than,
        "checkpoints": checkpoints,
        "dry_run": dry_run,
        "squeue": commands.squeue_user(),
        # How long to wait for a store another rv holds (an upload, another gc) before giving up.
        "lock_wait": float(os.environ.get("RV_LOCK_WAIT", "120")),
    }
    return call_agent(transport, "gc", args, timeout=600)


def usage(transport: Transport, root: str, *, older_than: float) -> dict[str, Any]:
    """What rv keeps under the root, by kind, and what ``rv gc`` (with these settings) would free."""
    args = {"root": root, "older_than": older_than, "checkpoints": False, "squeue": commands.squeue_user()}
    return call_agent(transport, "usage", args, timeout=300)
