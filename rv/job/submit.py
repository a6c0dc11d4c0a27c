"""Submitting a run: check the name, upload the snapshot, then one round trip for the rest.

The CLI validates the request (rv.request) and prepares the snapshot before calling anything here.
Then, over the session's one connection:

1. :func:`check` (one round trip, before anything is sent): a live run of this name is refused with
   its job id; what the run's checkpoint folder holds (to say "resuming N from step k"), and the
   ``--from`` run's.
2. The snapshot upload (rv.snapshot), which sends only what the cluster lacks.
3. :func:`submit` (one round trip): under the name's lock, the run's folder, run.json, the script,
   the secrets (on stdin, written 0600; never on a command line), the ``--from`` checkpoint, and
   ``sbatch`` of segment 1. If sbatch refuses, nothing of the run stays behind.
"""

from __future__ import annotations

import re
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rv.agent_client import call_agent
from rv.errors import RemoteError, UsageError
from rv.job.records import RunRecord
from rv.layout import RemoteLayout
from rv.placement import Estimate, Placement, parse_test_only
from rv.request import JobRequest
from rv.secrets import render_env_file
from rv.slurm import commands
from rv.slurm.script import ScriptContext, render_script, runtime_files


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


def default_run_name(base: str, run_id: str) -> str:
    """Two runs of one command must not share a checkpoint folder: the name gets the id's start.

    Six hex digits: with four, 100 default-named runs of one command collided with odds of 7% (a
    collision resumes the other run's checkpoint); with six, 0.03%."""
    return f"{base[:57]}-{run_id[:6]}"


_FROM = re.compile(r"^(?P<run>[A-Za-z0-9._-]+)(?:@(?P<step>\d+))?$")


@dataclass(frozen=True)
class FromRun:
    """``--from RUN[@STEP]``: start from RUN's newest complete checkpoint at or before STEP."""

    run: str
    step: int | None

    @classmethod
    def parse(cls, text: str) -> FromRun:
        m = _FROM.match(text.strip())
        if not m:
            raise UsageError(
                f"--from {text!r}: expected RUN or RUN@STEP (a run name, run id or job id, and a step)",
                hint="rv ckpt ls RUN lists a run's steps",
            )
        return cls(m["run"], int(m["step"]) if m["step"] else None)


@dataclass(frozen=True)
class Check:
    resume_step: int | None  # the newest complete checkpoint of this name, when it has one
    resume_files: bool  # the checkpoint folder holds something (any layout)
    from_run: Mapping[str, Any] | None  # --from: the source's project, name and checkpoint listing
    estimates: tuple[Estimate, ...] = ()  # sbatch --test-only's word on each candidate, when asked


def check(
    transport: Any,
    layout: RemoteLayout,
    *,
    project: str,
    name: str,
    from_run: FromRun | None,
    probes: Sequence[tuple[str, str]] = (),
) -> Check:
    """Refuse a second live run of ``name``; say what its checkpoint folder (and --from's) hold.

    ``probes``: (GPU type, probe script) of each candidate: sbatch --test-only says, in the same round
    trip, when each would start, or why sbatch would refuse it (nothing is submitted).
    """
    args: dict[str, Any] = {
        "root": layout.root,
        "project": project,
        "name": name,
        "squeue": commands.squeue_user(),
    }
    if probes:
        args["probes"] = [{"type": t, "script": text} for t, text in probes]
        args["test_only"] = commands.sbatch_test_only()
    if from_run is not None:
        args["from"] = from_run.run
    reply = call_agent(transport, "run-check", args)
    if reply.get("live"):
        raise UsageError(
            f"a run named {name!r} is still live (job {reply['live']}); nothing was sent",
            hint=f"rv logs -f {name}   rv stop {name}   or pick another --name",
        )
    ckpt = reply.get("checkpoint") or {}
    source = reply.get("from")
    if from_run is not None and source is not None:
        steps = [s["step"] for s in source["checkpoint"]["steps"] if s["complete"]]
        if from_run.step is not None:
            steps = [s for s in steps if s <= from_run.step]
        if source["checkpoint"]["steps"] and not steps:
            at = "" if from_run.step is None else f" at or before step {from_run.step}"
            raise UsageError(
                f"--from {from_run.run}: no complete checkpoint{at}", hint=f"rv ckpt ls {from_run.run}"
            )
        if not source["checkpoint"]["exists"]:
            raise UsageError(f"--from {from_run.run}: it has no checkpoint folder")
        if ckpt.get("exists") and (ckpt.get("steps") or ckpt.get("files")):
            raise UsageError(
                f"--from {from_run.run}: run {name!r} already has checkpoints of its own",
                hint="give the new run a name of its own with --name, or leave --name out",
            )
    return Check(
        resume_step=ckpt.get("resume_step"),
        resume_files=bool(ckpt.get("steps") or ckpt.get("files")),
        from_run=source,
        estimates=tuple(parse_test_only(p["type"], p["code"], p["text"]) for p in reply.get("probes") or ()),
    )


def script_context(
    layout: RemoteLayout,
    *,
    run_id: str,
    snapshot_id: str,
    project: str,
    account: str | None,
    has_secrets: bool,
    umask: str = "077",
    env_build: tuple[str, ...] = (),
    placement: Placement | None = None,
) -> ScriptContext:
    return ScriptContext(
        remote_root=layout.root,
        snapshot_id=snapshot_id,
        project=project,
        run_id=run_id,
        account=account,
        has_secrets=has_secrets,
        umask=umask,
        env_build=env_build,
        placement=placement or Placement(),
    )


def request_summary(req: JobRequest) -> dict[str, Any]:
    return {
        "gpus": req.gpus,
        "type": req.type.name if req.type is not None else None,
        "nodes": req.nodes,
        "gpus_per_node": req.gpus_per_node,
        "time_seconds": req.time_seconds,
        "mem": req.mem,
        "cpus_per_task": req.cpus_per_task,
        "setup": list(req.setup),
        "mig": req.mig,
        "signal": f"{req.signal}@{req.signal_lead_seconds}",
        "max_segments": req.max_segments,
        "launch": asdict(req.launch) if req.launch is not None else None,
        "each_node": req.each_node,
        "allow_single_process": req.allow_single_process,
        "ranks": req.ranks,
        "labeled": req.labeled,
        "outputs": list(req.outputs),
    }


@dataclass(frozen=True)
class Submitted:
    record: RunRecord
    from_step: int | None  # --from: the step the new run starts from
    from_how: tuple[str, ...]  # reflink / hardlink / copy: how the checkpoint was brought over
    candidates: tuple[tuple[str, str], ...] = ()  # a run over several types: (job id, type) each


def submit_args(
    layout: RemoteLayout,
    req: JobRequest,
    ctx: ScriptContext,
    *,
    provenance: Mapping[str, Any],
    has_secrets: bool,
    alternatives: Sequence[JobRequest] = (),
) -> dict[str, Any]:
    """What the agent needs to make the run's folder and records and submit segment 1.

    ``alternatives``: the same run on further GPU types (a run over several): one batch script and
    one job each besides ``req``'s; the first job to start takes the run (rv/agent/job.sh).
    """
    script = render_script(req, ctx)
    meta = {
        "name": req.name,
        "project": ctx.project,
        "snapshot": ctx.snapshot_id,
        "command": list(req.command),
        "request": request_summary(req),
        "max_segments": req.max_segments,
        "gpus": req.gpus,
        "gpu_type": req.type.name if req.type is not None else None,
        "nodes": req.nodes,
        "ranks": req.ranks,
        "labeled": req.labeled,
        "branch": provenance.get("branch"),
        "commit": provenance.get("commit"),
        "dirty": bool(provenance.get("dirty")),
        "env": provenance.get("env"),  # the environment's key: rv gc keeps it while this run lives
        "submitted_from": socket.gethostname(),
        "has_secrets": has_secrets,
    }
    candidates = None
    if alternatives:
        meta["gpu_types"] = [r.type.name for r in (req, *alternatives) if r.type is not None]
        candidates = [
            {"type": r.type.name if r.type is not None else "", "script": render_script(r, ctx)}
            for r in (req, *alternatives)
        ]
    return {
        "root": layout.root,
        "run_id": ctx.run_id,
        "project": ctx.project,
        "name": req.name,
        "meta": meta,
        "script": script,
        # The job's runtime files, written under <root>/runtime/ once per content (the script sources them).
        "runtime": runtime_files(),
        "has_secrets": has_secrets,
        "squeue": commands.squeue_user(),
        "sbatch": commands.sbatch(f"{ctx.run_dir}/job.sbatch"),
        **({"candidates": candidates} if candidates else {}),
    }


def run_record(
    layout: RemoteLayout,
    req: JobRequest,
    ctx: ScriptContext,
    args: Mapping[str, Any],
    *,
    profile: str,
    job_id: str,
) -> RunRecord:
    """This machine's record of a run the agent submitted with ``args`` (from :func:`submit_args`)."""
    meta = args["meta"]
    return RunRecord(
        run_id=ctx.run_id,
        name=req.name,
        profile=profile,
        remote_root=layout.root,
        project=ctx.project,
        snapshot=ctx.snapshot_id,
        branch=meta["branch"],
        commit=meta["commit"],
        dirty=meta["dirty"],
        command=list(req.command),
        request=request_summary(req),
        submitted_at=time.time(),
        job_id=job_id,
        has_secrets=bool(args["has_secrets"]),
    )


def submit(
    transport: Any,
    layout: RemoteLayout,
    req: JobRequest,
    ctx: ScriptContext,
    *,
    profile: str,
    provenance: Mapping[str, Any],
    secrets: Mapping[str, str],
    from_run: Check | None = None,
    from_step: int | None = None,
    alternatives: Sequence[JobRequest] = (),
) -> Submitted:
    """Segment 1 of the run, in one round trip; the local record of it."""
    args = submit_args(
        layout, req, ctx, provenance=provenance, has_secrets=bool(secrets), alternatives=alternatives
    )
    source = from_run.from_run if from_run is not None else None
    if source is not None:
        args["from"] = {"project": source["project"], "name": source["name"], "step": from_step}
    stdin = render_env_file(dict(secrets)).encode() if secrets else None
    reply = call_agent(transport, "run-submit", args, stdin=stdin, timeout=120)
    if "job_id" not in reply:
        raise RemoteError(f"the cluster sent no job id for run {req.name}")
    record = run_record(layout, req, ctx, args, profile=profile, job_id=str(reply["job_id"]))
    started = reply.get("from") or {}
    candidates = tuple((str(j), str(t)) for j, t in reply.get("candidates") or () if alternatives)
    return Submitted(record, started.get("step"), tuple(started.get("how") or ()), candidates)
