"""The modes over runs that exist: ``runs`` (what they are), ``run-stop``, ``secrets-sweep``, ``ckpt-ls``.

``runs``        run records and ``squeue`` (and ``sacct``, the runs' metrics and measurements) in one answer
``run-stop``    ``STOP``, ``scancel``, the secrets gone, records for segments that never started
``secrets-sweep`` secrets of runs no job is alive for (a job killed hard could not remove them)
``ckpt-ls``     a checkpoint folder: rv_train's ``step_<N>`` steps, sizes, times, which one resumes

Reading a run is :mod:`rv.agent.rundir`'s; submitting one, :mod:`rv.agent.submit`'s.
"""

import time

from rv.agent import common, layout, metrics, rundir, slurmcmd


def mode_runs(args):
    """Run records, chosen by id, name, job id, recency or liveness; with squeue (and sacct) text."""
    root = common.root_path(args["root"])
    out = {"runs": [], "now": time.time()}
    code, text, err = slurmcmd.run_argv(args["squeue"])
    out["squeue"] = {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}
    if args.get("sacct"):
        out["sacct"] = slurmcmd.answer(args["sacct"])
    if args.get("slurm"):
        out["slurm"] = slurmcmd.slurm_answers(args["slurm"])[0]
    if args.get("secrets_sweep"):
        # The session's secrets sweep rides along on this call: no second round trip.
        if code == 0:
            out["secrets_sweep"] = sweep_secrets(root, args["secrets_sweep"], slurmcmd.jobs_of(text))
        else:
            out["secrets_sweep"] = {"error": slurmcmd.squeue_failure(code, err)}
    out["runs"] = rundir.select_runs(root, args)
    if args.get("metrics") is not None:
        # rv sweep results: each run's metrics summed up in the same call (rv.agent.metrics).
        asked = args["metrics"]
        out["metrics"] = {"runs": metrics.read_runs(
            root, [r["run_id"] for r in out["runs"]], asked.get("series", False),
            asked.get("points") or metrics.DEFAULT_POINTS)}  # fmt: skip
    if args.get("stats") is not None:
        # rv stats: what each run's jobs measured (rv/agent/stats.py), in the same round trip.
        points = int(args["stats"])
        out["stats"] = {
            r["run_id"]: rundir.read_stats(rundir.run_path(root, r["run_id"]), points) for r in out["runs"]
        }
    return out


def mode_run_stop(args):
    """STOP in every run first, then one scancel for all their jobs: a sweep stopped whole leaves no
    window in which a slot one point freed starts another point that is not marked yet."""
    root = common.root_path(args["root"])
    out, found, every = [], [], []
    for run_id in args["ids"]:
        rdir = rundir.run_path(root, run_id)
        info = rundir.run_info(root, run_id)
        if info is None:
            out.append({"run_id": run_id, "error": "no such run"})
            continue
        common.write_atomic(common.under(rdir, layout.STOP), ("%f\n" % time.time()).encode(), 0o600)
        # After STOP: a segment submitting its successor now sees STOP and cancels it itself.
        info = rundir.run_info(root, run_id)
        pending = [s for s in info["segments"] if (s["record"] or {}).get("state") != "ended" and s["job_id"]]
        ids = []
        for seg in pending:  # a segment sent once per GPU type: every one of its jobs
            for job in [seg["job_id"]] + [c[0] for c in seg.get("candidates") or []]:
                if job not in ids:
                    ids.append(job)
        if (info["meta"] or {}).get("on") and ids:
            # rv run --on: the job is the session's, which goes on; the run is a step of it. TERM, as
            # scancel of a job sends its steps: srun passes it on to the program's step, and the
            # batch script's EXIT trap records the end (a step's scancel is a SIGKILL: no record).
            ids = _steps_of(ids[0], "rv-on-%s" % run_id)
            if ids:
                slurmcmd.run_argv(list(args["scancel"]) + ["--signal=TERM"] + ids)
        else:
            every += [job for job in ids if job not in every]
        found.append((run_id, rdir, pending, ids))
    error = None
    if every:
        code, _, err = slurmcmd.run_argv(list(args["scancel"]) + every)
        if code != 0 and "Invalid job id" not in err:
            error = err.strip()[-300:] or "scancel exit %d" % code
    for run_id, rdir, pending, ids in found:
        removed = rundir.remove_secrets(rdir)
        rundir.remove_job_envs(rdir)
        never_started = [s for s in pending if s["record"] is None]
        if never_started and len(never_started) == len(pending):
            rundir.end_run(rdir, "cancelled by rv stop before it started", never_started[-1]["segment"])
        out.append({"run_id": run_id, "cancelled": ids, "secrets_removed": removed,
                    "error": error if ids else None})  # fmt: skip
    return {"stopped": out}


def _steps_of(job, name):
    """The steps of ``job`` named ``name`` (``JOB.STEP`` ids: scancel ends them and no other)."""
    code, out, _ = slurmcmd.run_argv(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"])
    if code != 0:
        return []
    return [w[0] for w in (line.split() for line in out.splitlines()) if len(w) == 2 and w[1] == name]


def mode_secrets_sweep(args):
    """Secrets of runs no job is alive for: removed, and ENDED written where the job could not."""
    return sweep_secrets(common.root_path(args["root"]), args["ids"], slurmcmd.live_jobs(args["squeue"]))


def sweep_secrets(root, ids, live):
    """``secrets-sweep`` for ``ids`` given the live jobs; also done inside ``runs`` and ``usage`` calls."""
    out = {"removed": [], "ended": [], "live": []}
    for run_id in ids:
        info = rundir.run_info(root, run_id)
        if info is None:
            continue
        if any(s["job_id"] in live for s in info["segments"]):
            out["live"].append(run_id)
            continue
        rdir = rundir.run_path(root, run_id)
        if info["secrets"]:
            rundir.remove_secrets(rdir)
            out["removed"].append(run_id)
        rundir.remove_job_envs(rdir)
        if info["ended"] is None:
            segs = info["segments"]
            last = segs[-1] if segs else None
            said = rundir.script_words(rdir, last["job_id"]) if last and last["job_id"] else None
            if said is not None:  # the job said why it could not start: that, not "killed"
                rundir.end_run(rdir, "failed before the program started: " + said, last["segment"], 1)
            else:
                rundir.end_run(rdir, "ended without a record (cancelled or killed before it could write one)",
                               last["segment"] if last else 0)  # fmt: skip
            out["ended"].append(run_id)
    return out


def mode_ckpt_ls(args):
    root = common.root_path(args["root"])
    return rundir.checkpoint_listing(rundir.checkpoint_path(root, args["project"], args["name"]))
