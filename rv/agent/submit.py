"""Submitting runs on the cluster side: ``run-check``, ``run-submit``, ``sweep-submit``, ``--from``.

``run-check``   before anything is sent: is a run of this name live, what do the checkpoint folders
                hold (the run's own, and ``--from``'s)
``run-submit``  under the name's lock: the run's folder, its records, secrets (from stdin, 0600),
                the job's runtime files, the ``--from`` checkpoint, the name index, and ``sbatch``
                of segment 1 (``rv up`` submits through :func:`submit_run` too)
``run-arrived`` whether a run-submit whose answer was lost queued its job (asked before sending again)
``sweep-submit`` a sweep's points, each a run of its own, and the job arrays that run them (and a
                retry's: only the points asked for, as new runs of the same names)
"""

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib

from rv.agent import common, container, layout, locks, manifest, quota, rundir, slurmcmd, store

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def sweep_in_the_way(root, project, name):
    """A plain run may not take a sweep's name (its points' checkpoints are folders in its own)."""
    if rundir.is_sweep(root, project, name):
        raise common.AgentError(
            "%s is the name of a sweep (its points are runs %s/0, %s/1, ...): pick another --name"
            % (name, name, name),
            "usage",
        )


def _resolve_from(root, project, ref):
    """The checkpoint folder of RUN in ``--from RUN``: a run name of this project, a run id, a job id."""
    if (
        re.match(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[0-9]+)?$", ref)
        and not rundir.is_sweep(root, project, ref)
        and os.path.isdir(rundir.checkpoint_path(root, project, ref))
    ):
        return {"project": project, "name": ref}
    for run_id in rundir.all_run_ids(root):
        info = rundir.run_info(root, run_id)
        if info is None:
            continue
        jobs = [s["job_id"] for s in info["segments"]]
        if run_id == ref or ref in jobs:
            return {"project": info["meta"]["project"], "name": info["meta"]["name"]}
    raise common.AgentError(
        "no run %r with checkpoints here (by name in this project, run id or job id)" % ref, "not-found"
    )


def mode_run_check(args):
    out = _run_check(args)
    if args.get("quota"):
        # The site's file quota, where a tool tells it: rv run warns before a run passes 90% of it.
        out["quota"] = quota.report(common.root_path(args["root"]))
    return out


def _run_check(args):
    root = common.root_path(args["root"])
    project, name = args["project"], args["name"]
    if args.get("container"):
        # The image and its runtime (rv.agent.container), first: a refusal needs nothing else.
        c = args["container"]
        found = container.check(c["image"], c["runtime"], c.get("setup") or [])
        if "error" in found or args.get("container_only"):
            return {"container": found}
        out = _run_check(dict(args, container=None))
        out["container"] = found
        return out
    if args.get("sweep"):
        return _sweep_check(root, args)
    sweep_in_the_way(root, project, name)
    run_id, live = rundir.live_run_of_name(root, project, name, args["squeue"])
    out = {
        "name_run_id": run_id,
        "live": live,
        "checkpoint": rundir.checkpoint_listing(rundir.checkpoint_path(root, project, name)),
    }
    if args.get("from"):
        src = _resolve_from(root, project, args["from"])
        path = rundir.checkpoint_path(root, src["project"], src["name"])
        out["from"] = dict(src, checkpoint=rundir.checkpoint_listing(path))
    if args.get("probes"):
        out["probes"] = _probes(args)
    if args.get("snapshot"):
        # Held whole already (nothing changed since the last run): the laptop skips its snap-put call.
        out["snapshot_held"] = store.held_whole(root, args["snapshot"])
    return out


def _probes(args):
    """When each candidate would start, and whether sbatch takes it at all (sbatch --test-only
    submits nothing): the script's directives only, on stdin."""
    out = []
    for probe in args["probes"]:
        code, text, err = slurmcmd.run_argv(args["test_only"], stdin_data=probe["script"].encode("utf-8"))
        out.append({"type": probe["type"], "code": code, "text": (text + err)[-2000:]})
    return out


def _clone_file(src, dst):
    """Copy without copying bytes where the filesystem allows: reflink, else hard link, else copy."""
    with open(src, "rb") as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.ioctl(fd, FICLONE, fin.fileno())
            os.close(fd)
            shutil.copystat(src, dst)
            return "reflink"
        except OSError:
            os.close(fd)
            os.unlink(dst)
    try:
        os.link(src, dst)
        return "hardlink"
    except OSError:
        shutil.copy2(src, dst)
        return "copy"


def _clone_tree(src, dst, skip=()):
    """``src`` into ``dst`` (made here), file by file with :func:`_clone_file`; returns kinds used."""
    kinds = set()
    common.makedirs(dst, 0o700)
    for name in os.listdir(src):
        if name in skip:
            continue
        s, d = common.join(src, name), common.join(dst, name)
        if os.path.islink(s):
            os.symlink(os.readlink(s), d)
        elif os.path.isdir(s):
            kinds |= _clone_tree(s, d)
        else:
            kinds.add(_clone_file(s, d))
    return kinds


def _start_from(root, spec, dest):
    """Fill the new run's empty checkpoint folder ``dest`` from ``spec`` (--from RUN[@STEP])."""
    src = rundir.checkpoint_path(root, spec["project"], spec["name"])
    listing = rundir.checkpoint_listing(src)
    if os.path.isdir(dest) and os.listdir(dest):
        raise common.AgentError(
            "the new run's checkpoint folder %s is not empty: --from needs a run name of its own"
            % manifest.dec(dest),
            "usage",
        )
    step = spec.get("step")
    if listing["steps"]:
        complete = [s for s in listing["steps"] if s["complete"] and (step is None or s["step"] <= step)]
        if not complete:
            raise common.AgentError(
                "run %s has no complete checkpoint%s"
                % (spec["name"], "" if step is None else " at or before step %d" % step),
                "not-found",
            )
        chosen = complete[-1]
        kinds = _clone_tree(
            common.join(src, manifest.enc(chosen["name"])), common.join(dest, manifest.enc(chosen["name"]))
        )
        return {"step": chosen["step"], "how": sorted(kinds)}
    if step is not None:
        raise common.AgentError(
            "run %s's checkpoints are not in rv_train's step_<N> layout: use --from %s without @STEP"
            % (spec["name"], spec["name"]),
            "usage",
        )
    kinds = _clone_tree(src, dest, skip=(manifest.enc(layout.PREEMPTED),))
    return {"step": None, "how": sorted(kinds)}


_RUNTIME_NAME = re.compile(r"^(job|rank-label|notify|store-check|stats)-[0-9a-f]{16}\.(sh|py)$")


def place_runtime(root, files):
    """The job's runtime files under ``<root>/runtime/``: written once, named by content, read-only.

    A file already there is never rewritten (a queued job may be reading it). The labeller is run
    as a program (torchrun's PYTHON_EXEC): executable; the shell file is only sourced.
    """
    folder = common.under(root, layout.RUNTIME)
    common.makedirs(folder, 0o700)
    for name, text in sorted(files.items()):
        if not _RUNTIME_NAME.match(name):
            raise common.AgentError("bad runtime file name %r" % name, "usage")
        path = common.join(folder, manifest.enc(name))
        if not os.path.exists(path):
            common.write_atomic(path, text.encode("utf-8"), 0o500 if name.endswith(".py") else 0o400)


def mode_run_submit(args):
    secrets = sys.stdin.buffer.read() if args.get("has_secrets") else None
    return submit_run(args, secrets)


def submit_run(args, secrets):
    """``run-submit`` with the secrets read (bytes, or None): the run's id, the previous run of its
    name, the jobs sent, and where ``--from`` started it."""
    root = common.root_path(args["root"])
    run_id, project, name = args["run_id"], args["project"], args["name"]
    rdir = rundir.run_path(root, run_id)
    lock_path = common.under(root, layout.name_lock(project, name))
    with locks.lock(lock_path, "rv run %s" % name, wait=30):
        sweep_in_the_way(root, project, name)
        previous, live = rundir.live_run_of_name(root, project, name, args["squeue"])
        if live:
            raise common.AgentError("run %s is still live (job %s)" % (name, live), "live")
        ckpt = rundir.checkpoint_path(root, project, name)
        made_ckpt = not os.path.exists(ckpt)
        _make_run_folders(rdir)
        try:
            result = {}
            if secrets is not None:
                # Created 0600 before a byte is written: never readable by others, even for a moment.
                common.write_atomic(common.under(rdir, layout.SECRETS), secrets, 0o600)
            place_runtime(root, args.get("runtime") or {})
            scripts = _write_scripts(rdir, args)
            _write_run_file(rdir, args["meta"], run_id)
            if args.get("from"):
                result["from"] = _start_from(root, args["from"], ckpt)
            if args.get("on"):
                jobs = [(_start_on(args["on"], rdir, scripts[0][0]), scripts[0][1])]
            else:
                jobs = _sbatch_all(args["sbatch"], rdir, scripts)
            job = jobs[0][0]
            if len(jobs) > 1:
                text = "".join("%s %s\n" % pair for pair in jobs)
                common.write_atomic(
                    common.under(rdir, layout.segment_file(1, "candidates")), text.encode(), 0o600
                )
            _write_first_job(rdir, job)
            _write_name_index(root, project, name, run_id)
        except BaseException:
            # Nothing half-made stays behind: the run's folder, and a checkpoint folder made for it.
            shutil.rmtree(rdir, ignore_errors=True)
            if made_ckpt:
                shutil.rmtree(ckpt, ignore_errors=True)
            raise
    result.update(job_id=job, previous_run_id=previous, candidates=jobs)
    return result


def mode_run_arrived(args):
    """Did ``run-submit`` of this run id queue its job? Asked with run-submit's own arguments when the
    connection was lost before its answer: under the name's lock, so a submission still under way
    here ends first. ``arrived``, and run-submit's reply when it did (the job, the candidates); not
    when nothing of the run is here (it never came, or came and was undone): it may be sent again."""
    root = common.root_path(args["root"])
    name = args["name"]
    with locks.lock(common.under(root, layout.name_lock(args["project"], name)), "rv run %s" % name, wait=30):
        info = rundir.run_info(root, args["run_id"])
    first = info["segments"][0] if info and info["segments"] else {}
    job = first.get("job_id")
    return {"arrived": bool(job), "job_id": job, "candidates": first.get("candidates") or []}


def _write_scripts(rdir, args):
    """The run's batch scripts: ``job.sbatch``, or one per GPU type for a run over several
    (``job.<i>.sbatch``, with their types in ``candidates``). [(file name, type)], preferred first."""
    candidates = args.get("candidates")
    if not candidates:
        common.write_atomic(common.under(rdir, layout.SCRIPT), args["script"].encode("utf-8"), 0o700)
        return [(layout.SCRIPT, None)]
    scripts = []
    for i, candidate in enumerate(candidates, 1):
        if not re.match(r"^[A-Za-z0-9._-]+$", candidate["type"]):
            raise common.AgentError("bad GPU type name %r" % candidate["type"], "usage")
        name = layout.candidate_script(i)
        common.write_atomic(common.under(rdir, name), candidate["script"].encode("utf-8"), 0o700)
        scripts.append((name, candidate["type"]))
    text = "".join("%s %s\n" % pair for pair in scripts)
    common.write_atomic(common.under(rdir, layout.CANDIDATES), text.encode(), 0o600)
    return scripts


def _sbatch_all(argv, rdir, scripts):
    """sbatch of each script as segment 1 ([(job id, type)]); on a refusal the ones queued are cancelled."""
    env = dict(os.environ, RV_SEGMENT="1")
    jobs = []
    for name, gpu_type in scripts:
        code, out, err = slurmcmd.run_argv(argv[:-1] + [manifest.dec(common.under(rdir, name))], env=env)
        if code != 0:
            if jobs:
                slurmcmd.run_argv(["scancel"] + [j for j, _ in jobs])
            lines = [line for line in err.strip().splitlines() if line.strip()]
            what = " for %s" % gpu_type if gpu_type else ""
            raise common.AgentError(
                "sbatch rejected the job%s: %s" % (what, " / ".join(lines[-3:]) or "exit %d" % code), "sbatch"
            )
        jobs.append((out.strip().splitlines()[-1].split(";")[0].strip(), gpu_type or ""))
    return jobs


# --- sweeps: points as runs, run by job arrays ------------------------------------------------------


def _start_on(on, rdir, script):
    """``rv run --on SESSION``: the batch script as a step of the session's running job (``on``:
    job_id, srun: the step's argv before the script), on its first node; its inner srun (rv_launch)
    overlaps too (SLURM_OVERLAP). The step outlives this process (a session of its own); its output
    goes where the script's #SBATCH lines would send a batch job's. The session's job id."""
    job = on["job_id"]
    env = dict(os.environ, SLURM_OVERLAP="1", RV_SEGMENT="1")
    out_path, err_path = (common.under(rdir, layout.log_file(job, stream)) for stream in ("out", "err"))
    with open(out_path, "ab") as out, open(err_path, "ab") as err:
        subprocess.Popen(
            [*on["srun"], "bash", manifest.dec(common.under(rdir, script))],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=rdir, env=env, start_new_session=True,
        )  # fmt: skip
    return job


def _plain_run_in_the_way(root, project, name):
    if os.path.isfile(rundir.name_index(root, project, name)):
        raise common.AgentError(
            "a run named %s exists: a sweep needs a name no run has (its points are %s/0, %s/1, ...): "
            "pick another --name" % (name, name, name),
            "usage",
        )


def _sweep_points(root, project, name, live):
    """{index: what is known of the newest run of point SWEEP/index}: its run id, values, live job,
    and what its checkpoint folder holds (a point named again resumes from it, as a plain run does)."""
    folder = rundir.name_index(root, project, name)
    out = {}
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not entry.isdigit():
            continue
        point = "%s/%s" % (name, manifest.dec(entry))
        run_id, job = rundir.live_run_of_name(root, project, point, None, live)
        info = rundir.run_info(root, run_id) if run_id else None
        ckpt = rundir.checkpoint_listing(rundir.checkpoint_path(root, project, point))
        out[manifest.dec(entry)] = {
            "run_id": run_id,
            "params": ((info or {}).get("meta") or {}).get("sweep", {}).get("params"),
            "live": job,
            "resume_step": ckpt.get("resume_step"),
            "resume_files": bool(ckpt["steps"] or ckpt["files"]),
        }
    return out


def _sweep_check(root, args):
    """``run-check`` of a sweep: a plain run of the name refuses it; its points that exist already
    (a sweep named again), the user's queued jobs (queue limits) and the Slurm answers asked for."""
    project, name = args["project"], args["name"]
    _plain_run_in_the_way(root, project, name)
    answers, live = slurmcmd.slurm_answers(args.get("slurm"), lambda: slurmcmd.live_jobs(args["squeue"]))
    out = {"points": _sweep_points(root, project, name, live), "queued": len(live), "slurm": answers}
    if args.get("probes"):
        out["probes"] = _probes(args)
    return out


_NOT_ID_CHAR = r"[A-Za-z0-9._-]"


def _retry_script(root, old_run_id, run_id):
    """A retry's point: the batch script and run.json of the run ``old_run_id`` (the point as it was
    sent), made the run ``run_id``'s. The run id is random, so in the script it is only ever the
    run's own (its folder, its records); replaced where it stands as a whole word."""
    old_dir = rundir.run_path(root, old_run_id)
    script = common.read_bytes(common.under(old_dir, layout.SCRIPT)).decode("utf-8")
    meta = common.read_json(common.under(old_dir, layout.RUN_FILE))
    if not script or not isinstance(meta, dict):
        raise common.AgentError(
            "run %s (point %s) has no batch script left to retry: rv gc removed it?"
            % (old_run_id, (meta or {}).get("name", "?")),
            "not-found",
        )
    if not store.has_snapshot(root, meta.get("snapshot") or ""):
        raise common.AgentError(
            "snapshot %s of point %s is gone (rv gc removed it): run the sweep again with rv run --sweep"
            % (meta.get("snapshot"), meta.get("name")),
            "not-found",
        )
    pattern = re.compile("(?<!%s)%s(?!%s)" % (_NOT_ID_CHAR, re.escape(old_run_id), _NOT_ID_CHAR))
    script, n = pattern.subn(run_id, script)
    if n == 0:
        raise common.AgentError("run %s's batch script does not name the run" % old_run_id, "usage")
    meta = dict(meta, sweep=dict(meta.get("sweep") or {}, retry_of=old_run_id))
    return script, meta


def _array_script(point_script, sweep, runs_folder, prefix, spec):
    """The batch script of one job array: task T runs the run ``<prefix>-T``, a point of its own, by
    that run's own batch script (the one its later segments are submitted with, like a plain run's).
    The #SBATCH lines are the point's (every point asks for the same), but for the job name (the
    sweep's), the logs (%A_%a in the task's run folder: the name job.sh's rv_job gives the task) and
    --array."""
    logs = "%s/%s-%%a/%s/%%A_%%a" % (runs_folder, prefix, layout.LOGS)
    lines = ["#!/bin/bash"]
    for line in point_script.splitlines()[1:]:
        if not line.startswith("#SBATCH "):
            break
        key = line.split("=", 1)[0]
        if key == "#SBATCH --job-name":
            line = "#SBATCH --job-name=%s" % sweep
        elif key == "#SBATCH --output":
            line = "#SBATCH --output=%s.out" % logs
        elif key == "#SBATCH --error":
            line = "#SBATCH --error=%s.err" % logs
        lines.append(line)
    lines += [
        "#SBATCH --array=%s" % spec,
        "# Written by rv for sweep %s: task T of this array is the run %s-T, a point of its own."
        % (sweep, prefix),
        "set -eu",
        'rv_point="%s/%s-$SLURM_ARRAY_TASK_ID/%s"' % (runs_folder, prefix, layout.SCRIPT),
        '[ -r "$rv_point" ] || { echo "rv: the point\'s batch script $rv_point is missing" >&2; exit 1; }',
        'exec "$BASH" -- "$rv_point"',
    ]
    return "\n".join(lines) + "\n"


def mode_sweep_submit(args):
    """The points of a sweep (or a retry's), each a run of its own, and one job array per part.

    ``args``: root, project, name (the sweep's), squeue, sbatch and sbatch_after (``{after}`` stands
    for the previous part's array), scancel, runtime. Stdin: zlib-compressed JSON (it holds every
    point's batch script and the secrets: never on a command line) ``{"secrets": text or null,
    "parts": [{"prefix", "spec", "after_previous", "points": [{"name", "script", "meta"} or
    {"name", "like": run id}]}]}``. Task T of a part is the run ``<prefix>-T``. All or nothing: an
    array sbatch refuses cancels the arrays already queued and removes every run folder made."""
    payload = json.loads(zlib.decompress(sys.stdin.buffer.read()).decode("utf-8"))
    return _sweep_submit(args, payload)


def _sweep_submit(args, payload):
    root = common.root_path(args["root"])
    project, name = args["project"], args["name"]
    secrets = payload.get("secrets")
    made, arrays, result, named = [], [], [], []
    env = dict(os.environ, RV_SEGMENT="1")
    with locks.lock(common.under(root, layout.name_lock(project, name)), "rv run --sweep %s" % name, wait=30):
        _plain_run_in_the_way(root, project, name)
        live = slurmcmd.live_jobs(args["squeue"])
        for part in payload["parts"]:
            for point in part["points"]:
                _, job = rundir.live_run_of_name(root, project, point["name"], None, live)
                if job:
                    raise common.AgentError(
                        "point %s is still live (job %s): nothing was sent" % (point["name"], job), "live"
                    )
        try:
            place_runtime(root, args.get("runtime") or {})
            previous = None
            for part in payload["parts"]:
                runs_here, first = [], None
                for task, point in enumerate(part["points"]):
                    run_id = "%s-%d" % (part["prefix"], task)
                    rdir = rundir.run_path(root, run_id)
                    if os.path.exists(rdir):
                        raise common.AgentError("run %s exists already" % run_id, "usage")
                    if "like" in point:
                        script, meta = _retry_script(root, point["like"], run_id)
                    else:
                        script, meta = point["script"], point["meta"]
                    meta = dict(meta, **(point.get("meta_update") or {}))
                    made.append(rdir)
                    _make_run_folders(rdir)
                    if meta.get("has_secrets"):
                        # 0600 before a byte is written; an empty file when a retry has none now.
                        common.write_atomic(
                            common.under(rdir, layout.SECRETS), (secrets or "").encode("utf-8"), 0o600
                        )
                    common.write_atomic(common.under(rdir, layout.SCRIPT), script.encode("utf-8"), 0o700)
                    _write_run_file(rdir, meta, run_id)
                    runs_here.append((run_id, point["name"]))
                    first = first or script
                runs_folder = manifest.dec(rundir.runs_dir(root))
                array_path = common.under(rundir.run_path(root, runs_here[0][0]), layout.ARRAY_SCRIPT)
                wrapper = _array_script(first, name, runs_folder, part["prefix"], part["spec"])
                common.write_atomic(array_path, wrapper.encode("utf-8"), 0o700)
                after = previous if part.get("after_previous") else None
                argv = (
                    [w.replace("{after}", after) for w in args["sbatch_after"]] if after else args["sbatch"]
                )
                code, out, err = slurmcmd.run_argv(argv[:-1] + [manifest.dec(array_path)], env=env)
                if code != 0:
                    lines = [line for line in err.strip().splitlines() if line.strip()]
                    raise common.AgentError(
                        "sbatch rejected the array of points %s: %s"
                        % (_point_span(runs_here), " / ".join(lines[-3:]) or "exit %d" % code),
                        "sbatch",
                    )
                array = out.strip().splitlines()[-1].split(";")[0].strip()
                arrays.append(array)
                previous = array
                for task, (run_id, _) in enumerate(runs_here):
                    job = "%s_%d" % (array, task)
                    _write_first_job(rundir.run_path(root, run_id), job)
                result.append({"array": array, "runs": [run_id for run_id, _ in runs_here]})
                named += runs_here
            for run_id, point in named:  # each point is now the newest run of its name
                _write_name_index(root, project, point, run_id)
        except BaseException:
            # Nothing half-made stays behind: what was queued is cancelled, every run folder goes.
            if arrays:
                slurmcmd.run_argv(list(args["scancel"]) + arrays)
            for rdir in made:
                shutil.rmtree(rdir, ignore_errors=True)
            raise
    return {"parts": result}


def _point_span(runs_here):
    names = [n for _, n in runs_here]
    return names[0] if len(names) == 1 else "%s .. %s" % (names[0], names[-1])


def _make_run_folders(rdir):
    common.makedirs(common.under(rdir, layout.SEG), 0o700)
    common.makedirs(common.under(rdir, layout.LOGS), 0o700)


def _write_run_file(rdir, meta, run_id):
    common.write_json(common.under(rdir, layout.RUN_FILE), dict(meta, run_id=run_id, created=time.time()))


def _write_first_job(rdir, job):
    common.write_atomic(common.under(rdir, layout.segment_file(1, "job")), (job + "\n").encode(), 0o600)


def _write_name_index(root, project, name, run_id):
    """``run_id`` is now the newest run of ``name``."""
    index = rundir.name_index(root, project, name)
    common.makedirs(os.path.dirname(index), 0o700)
    common.write_atomic(index, (run_id + "\n").encode(), 0o600)
