"""Submitting a run: check the name, upload the snapshot, then one round trip for the rest.

The CLI validates the request (rv.request) and prepares the snapshot before calling anything here.
Then, over the session's one connection:

1. :func:`check` (one round trip, before anything is sent): a live run of this name is refused with
   its job id; what the run's checkpoint folder holds (to say "resuming N from step k"), and the
   ``--from`` run's.
2. The snapshot upload (rv.files.snapshot), which sends only what the cluster lacks.
3. :func:`submit` (one round trip): under the name's lock, the run's folder, run.json, the script,
   the secrets (on stdin, written 0600; never on a command line), the ``--from`` checkpoint, and
   ``sbatch`` of segment 1. If sbatch refuses, nothing of the run stays behind.
"""

from __future__ import annotations

import json
import posixpath
import re
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rv.agent import layout as remote_layout
from rv.errors import RemoteError, UsageError
from rv.job.container import ContainerSpec, resolve
from rv.job.footprint import quota_warning, read_quota_report
from rv.job.records import ClusterRun, RunRecord
from rv.job.workdir import RUN_FILES, shared_files
from rv.layout import RemoteLayout
from rv.names import point_name
from rv.placement import Estimate, parse_test_only
from rv.remote.agent_client import call_agent
from rv.request import JobRequest
from rv.secrets import render_env_file
from rv.slurm import commands
from rv.slurm.container import Container
from rv.slurm.container import to_meta as container_meta
from rv.slurm.parse import ArrayLimits, SubmitLimit, parse_array_limits, parse_submit_limit
from rv.slurm.script import ScriptContext, container_folders, render_script, run_paths, runtime_files
from rv.slurmoptions import Placement
from rv.sweep import SLURM_DEFAULT_MAX_ARRAY_SIZE, ArrayPart, Point, Sweep
from rv.timespec import IDLE_GPU_DEFAULT

if TYPE_CHECKING:
    from rv.remote.transport import Transport


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


def default_run_name(base: str, run_id: str) -> str:
    """Two runs of one command must not share a checkpoint folder: the name gets the id's start.

    Six hex digits: with four, 100 default-named runs of one command collided with odds of 7% (a
    collision resumes the other run's checkpoint); with six, 0.03%."""
    return f"{base[:57]}-{run_id[:6]}"


# RUN: a run name (a sweep's point SWEEP/INDEX too), a run id or a job id.
_FROM = re.compile(r"^(?P<run>[A-Za-z0-9._-]+(?:/\d+)?)(?:@(?P<step>\d+))?$")


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
    quota_warning: str | None = None  # the run would pass 90% of the user's file quota
    container: Container | None = None  # the image and runtime the cluster chose (--container)
    snapshot_held: str | None = None  # the snapshot's commit, when the store holds it whole already


def check(
    transport: Transport,
    layout: RemoteLayout,
    *,
    project: str,
    name: str,
    from_run: FromRun | None,
    probes: Sequence[tuple[str, str]] = (),
    new_files: int = 0,
    container: tuple[ContainerSpec, Sequence[str]] | None = None,
    snapshot: tuple[str, str, int] | None = None,
) -> Check:
    """Refuse a second live run of ``name``; say what its checkpoint folder (and --from's) hold.

    ``probes``: (GPU type, probe script) of each candidate: sbatch --test-only says, in the same round
    trip, when each would start, or why sbatch would refuse it (nothing is submitted). ``new_files``:
    the files the run will create on the shared filesystem, weighed against the user's file quota.
    ``snapshot``: (id, commit, files) of a snapshot this machine believes the store holds: the store
    says, in the same round trip, whether it holds it whole (then no upload call is needed).
    """
    args: dict[str, Any] = {
        "root": layout.root,
        "project": project,
        "name": name,
        "squeue": commands.squeue_user(),
        "quota": True,
    }
    if probes:
        args["probes"] = [{"type": t, "script": text} for t, text in probes]
        args["test_only"] = commands.sbatch_test_only()
    if from_run is not None:
        args["from"] = from_run.run
    if container is not None:
        args["container"] = container[0].check_args(container[1])
    if snapshot is not None:
        args["snapshot"] = {"id": snapshot[0], "commit": snapshot[1], "files": snapshot[2]}
    reply = call_agent(transport, "run-check", args)
    # A missing image or runtime is refused first (rv.agent.container), before anything is sent.
    chosen = resolve(container[0], reply.get("container")) if container is not None else None
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
        quota_warning=quota_warning(read_quota_report(reply.get("quota")).root, new_files),
        container=chosen,
        snapshot_held=snapshot[1] if snapshot is not None and reply.get("snapshot_held") is True else None,
    )


@dataclass(frozen=True)
class WorkDir:
    """Where the run's work dir is (rv.job.workdir): "shared" or "node", and the profile's folder on
    each node for "node" (None: $SLURM_TMPDIR, $TMPDIR, /tmp)."""

    where: str = "shared"
    node_folder: str | None = None

    def new_files(self, snapshot_files: int, points: int = 1) -> int:
        """Files a run (or a sweep's ``points``) creates on the shared filesystem: its work dirs, and
        a few dozen records, scripts and logs each."""
        return shared_files(snapshot_files, points, self.where) + RUN_FILES * points


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
    sweep_env: Mapping[str, str] | None = None,
    notify: Sequence[str] = (),
    work: WorkDir | None = None,
    container: Container | None = None,
    idle_gpu: int = IDLE_GPU_DEFAULT,
) -> ScriptContext:
    work = work or WorkDir()
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
        sweep_env=tuple((sweep_env or {}).items()),
        notify=tuple(notify),
        work_dir=work.where,
        node_work_dir=work.node_folder,
        container=container,
        idle_gpu_seconds=idle_gpu,
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
class OnSession:
    """``rv run --on SESSION``: the session's running job and its nodes (Slurm's order)."""

    name: str
    job_id: str
    nodes: tuple[str, ...]

    def srun_argv(self, run_id: str) -> list[str]:
        """The step that runs the batch script: on the session's first node (where its batch script
        runs), beside what runs there (--overlap), named after the run (rv stop finds it by name).

        A step's task sees its own nodes as the job's (SLURM_JOB_NODELIST, SLURM_NNODES: the one node
        of this step), and an srun inside it then refuses more ("Only allocated 1 nodes asked for 2"):
        the script gets the session's nodes back, as a batch script has them."""
        nodes, count = ",".join(self.nodes), str(len(self.nodes))
        return [
            "srun", f"--jobid={self.job_id}", "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={self.nodes[0]}", f"--job-name=rv-on-{run_id}", "--kill-on-bad-exit=1",
            "env", f"SLURM_JOB_NODELIST={nodes}", f"SLURM_NODELIST={nodes}", f"SLURM_NNODES={count}",
            f"SLURM_JOB_NUM_NODES={count}",
        ]  # fmt: skip


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
        "image": provenance.get("image"),  # a pulled image's key (rv.agent.images): rv gc keeps it likewise
        "git": provenance.get("git"),  # the repository's facts (rv.files.repo): rv ps --json shows them
        "submitted_from": socket.gethostname(),
        "has_secrets": has_secrets,
        # $RV_METRICS: where rv sweep results and rv metrics read what the program wrote.
        "metrics": run_paths(req, ctx).metrics,
        # --notify: rv wait tells the desktop when it is among them (the cluster tells the others).
        "notify": list(ctx.notify),
        # --work-dir: "node" keeps the work dir off the shared filesystem (rv/agent/job.sh).
        "work_dir": ctx.work_dir,
    }
    if ctx.container is not None:
        # The image and runtime the cluster chose, and its binds: what later steps enter (rv ssh into
        # a Pyxis image, rv jupyter's tools environment built on the image's Python).
        meta["container"] = container_meta(ctx.container, container_folders(req, ctx))
    # What a GPU-hour of each type the run may land on costs (the catalog's rate, None: not known):
    # the notifier's summary of the run's end counts SUs with them (rv/agent/notify.py).
    meta["su_rates"] = {
        r.type.name: r.type.su_per_gpu_hour for r in (req, *alternatives) if r.type is not None
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
        "sbatch": commands.sbatch(posixpath.join(ctx.run_dir, remote_layout.SCRIPT)),
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
        git=meta.get("git"),
    )


def submit(
    transport: Transport,
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
    on: OnSession | None = None,
) -> Submitted:
    """Segment 1 of the run, in one round trip; the local record of it. ``on``: started as a step of
    that session's running job (``rv run --on``) instead of sbatch."""
    args = submit_args(
        layout, req, ctx, provenance=provenance, has_secrets=bool(secrets), alternatives=alternatives
    )
    if on is not None:
        args["on"] = {"job_id": on.job_id, "srun": on.srun_argv(ctx.run_id)}
        args["meta"]["on"] = {"session": on.name, "job_id": on.job_id}
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


# --- sweeps: one array job per part, each point a run of its own ------------------------------------


@dataclass(frozen=True)
class SweepCheck:
    """What the cluster said before a sweep is sent."""

    existing: Mapping[int, Mapping[str, Any]]  # index -> the newest run of point SWEEP/index, if any
    queued: int  # the user's jobs in the queue now (each array task counts)
    arrays: ArrayLimits
    limit: SubmitLimit | None  # the user's queue limit, where Slurm says
    estimates: tuple[Estimate, ...] = ()
    quota_warning: str | None = None  # the sweep would pass 90% of the user's file quota
    container: Container | None = None  # the image and runtime the cluster chose (--container)


def check_sweep(
    transport: Transport,
    layout: RemoteLayout,
    *,
    project: str,
    name: str,
    probes: Sequence[tuple[str, str]] = (),
    account: str | None = None,
    qos: str | None = None,
    new_files: int = 0,
    container: tuple[ContainerSpec, Sequence[str]] | None = None,
) -> SweepCheck:
    """One round trip before anything of a sweep is sent: a plain run of its name refuses it; the
    points of a sweep of this name that exist already; MaxArraySize; the user's queue and its limit."""
    args: dict[str, Any] = {
        "root": layout.root,
        "project": project,
        "name": name,
        "sweep": True,
        "squeue": commands.squeue_user(),
        "slurm": sweep_asks(),
        "quota": True,
    }
    if probes:
        args["probes"] = [{"type": t, "script": text} for t, text in probes]
        args["test_only"] = commands.sbatch_test_only()
    if container is not None:
        args["container"] = container[0].check_args(container[1])
    reply = call_agent(transport, "run-check", args)
    chosen = resolve(container[0], reply.get("container")) if container is not None else None
    arrays, limit = sweep_limits(reply.get("slurm") or {}, account=account, qos=qos)
    return SweepCheck(
        existing={int(k): v for k, v in (reply.get("points") or {}).items()},
        queued=int(reply.get("queued") or 0),
        arrays=arrays,
        limit=limit,
        estimates=tuple(parse_test_only(p["type"], p["code"], p["text"]) for p in reply.get("probes") or ()),
        quota_warning=quota_warning(read_quota_report(reply.get("quota")).root, new_files),
        container=chosen,
    )


def sweep_asks() -> dict[str, list[str]]:
    """The Slurm answers a sweep is planned by (:func:`sweep_limits` reads them)."""
    return {
        "config": commands.scontrol_show_config(),
        "assoc": commands.sacctmgr_submit_limits(),
        "qos": commands.sacctmgr_qos_submit_limits(),
    }


def sweep_limits(
    answers: Mapping[str, Mapping[str, Any]], *, account: str | None, qos: str | None
) -> tuple[ArrayLimits, SubmitLimit | None]:
    """MaxArraySize (Slurm's default when scontrol did not answer) and the user's queue limit (None
    where there is no accounting: sacctmgr fails, and no limit is rv's to know)."""
    config = answers.get("config") or {}
    if config.get("error"):
        arrays = ArrayLimits(SLURM_DEFAULT_MAX_ARRAY_SIZE, None)
    else:
        arrays = parse_array_limits(config.get("text") or "", SLURM_DEFAULT_MAX_ARRAY_SIZE)
    assoc, qos_rows = answers.get("assoc") or {}, answers.get("qos") or {}
    if assoc.get("error"):
        return arrays, None
    qos_text = "" if qos_rows.get("error") else qos_rows.get("text") or ""
    return arrays, parse_submit_limit(assoc.get("text") or "", qos_text, account=account, qos=qos)


def check_existing_points(name: str, check: SweepCheck, points: Sequence[Point]) -> list[int]:
    """A sweep named again resumes its points from their checkpoints, as a run named again does: only
    when each point it sends is the point of that index it had, and none is live. The indexes that
    resume (a checkpoint of theirs exists)."""
    resumed = []
    for point in points:
        known = check.existing.get(point.index)
        if not known:
            continue
        if known.get("live"):
            raise UsageError(
                f"point {point_name(name, point.index)} of sweep {name!r} is still live "
                f"(job {known['live']}); nothing was sent",
                hint=f"rv ps {name}   rv stop {name}   or pick another --name",
            )
        had = known.get("params")
        if had is not None and dict(had) != point.values:
            was = ", ".join(f"{k}={v}" for k, v in dict(had).items())
            now = ", ".join(f"{k}={v}" for k, v in point.params)
            raise UsageError(
                f"sweep {name!r} exists, and its point {point.index} was {was}, not {now}: it would resume "
                "that point's checkpoint; nothing was sent",
                hint=f"give this sweep a name of its own with --name, or rv sweep retry {name}",
            )
        if known.get("resume_step") is not None or known.get("resume_files"):
            resumed.append(point.index)
    return resumed


@dataclass(frozen=True)
class PointRun:
    """One point as sent: its run (id, script, records) and the array task that runs it."""

    index: int
    req: JobRequest
    ctx: ScriptContext
    args: dict[str, Any]  # what submit_args made of it (meta, script)


def sweep_meta(sweep: Sweep, name: str, point: Point, sweep_id: str) -> dict[str, Any]:
    """``run.json``'s ``sweep`` for a point: rv ps, rv sweep results and rv sweep retry read it."""
    return {
        "name": name,
        "id": sweep_id,
        "index": point.index,
        "params": point.values,
        "points": len(sweep),
        "parallel": sweep.parallel,
    }


def sweep_payload(
    layout: RemoteLayout,
    parts: Sequence[ArrayPart],
    make: Callable[[int, str], PointRun],
) -> tuple[list[dict[str, Any]], list[list[PointRun]]]:
    """The ``parts`` of a sweep-submit payload: each array part with a prefix of its own, task T of
    it the run ``<prefix>-T`` (``make(index, run_id)`` renders that point). Also the points by part."""
    out, runs = [], []
    for part in parts:
        prefix = new_run_id()
        made = [make(index, f"{prefix}-{task}") for task, index in enumerate(part.points)]
        out.append(
            {
                "prefix": prefix,
                "spec": part.spec,
                "after_previous": part.after_previous,
                "points": [
                    {"name": p.req.name, "script": p.args["script"], "meta": p.args["meta"]} for p in made
                ],
            }
        )
        runs.append(made)
    return out, runs


def retry_payload(
    parts: Sequence[ArrayPart], old_runs: Mapping[int, tuple[str, str]]
) -> list[dict[str, Any]]:
    """The ``parts`` of a retry: each point as the run ``old_runs[index]`` (run id, point name) was
    sent (its batch script and records, made the new run's on the cluster)."""
    out = []
    for part in parts:
        points = []
        for index in part.points:
            run_id, pname = old_runs[index]
            points.append(
                {"name": pname, "like": run_id, "meta_update": {"submitted_from": socket.gethostname()}}
            )
        out.append(
            {
                "prefix": new_run_id(),
                "spec": part.spec,
                "after_previous": part.after_previous,
                "points": points,
            }
        )
    return out


def submit_sweep(
    transport: Transport,
    layout: RemoteLayout,
    *,
    project: str,
    name: str,
    parts: Sequence[Mapping[str, Any]],
    secrets: Mapping[str, str] | None,
) -> list[dict[str, Any]]:
    """One round trip: every point's run and the arrays that run them ([{"array", "runs"}] by part).
    The scripts and secrets travel on stdin, compressed: a hundred points' scripts would pass the
    kernel's limit for one command-line argument (128 KiB)."""
    args = {
        "root": layout.root,
        "project": project,
        "name": name,
        "runtime": runtime_files(),
        "squeue": commands.squeue_user(),
        "sbatch": commands.sbatch("SCRIPT"),
        "sbatch_after": commands.sbatch("SCRIPT", after="{after}"),
        "scancel": commands.scancel([]),
    }
    payload = {
        "secrets": render_env_file(dict(secrets)) if secrets is not None else None,
        "parts": list(parts),
    }
    stdin = zlib.compress(json.dumps(payload).encode("utf-8"), 6)
    reply = call_agent(transport, "sweep-submit", args, stdin=stdin, timeout=300)
    return list(reply.get("parts") or [])


def retry_record(old: ClusterRun, run_id: str, job_id: str, root: str, profile: str) -> RunRecord:
    """This machine's record of a retried point: the run ``old`` was, as the new run ``run_id``."""
    meta = old.meta
    return RunRecord(
        run_id=run_id,
        name=old.name,
        profile=profile,
        remote_root=root,
        project=str(meta.get("project") or ""),
        snapshot=str(meta.get("snapshot") or ""),
        branch=meta.get("branch"),
        commit=meta.get("commit"),
        dirty=bool(meta.get("dirty")),
        command=list(meta.get("command") or []),
        request=dict(meta.get("request") or {}),
        submitted_at=time.time(),
        job_id=job_id,
        has_secrets=bool(meta.get("has_secrets")),
        git=meta.get("git") if isinstance(meta.get("git"), dict) else None,
    )
