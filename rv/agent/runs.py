"""Runs on the cluster side: their records, ``run-check``, ``run-submit``, ``runs``, stop, secrets-sweep.

Every Slurm command it runs comes from the laptop as an argv built by :mod:`rv.slurm.commands`
(``{user}`` stands for the login name), so this file writes no Slurm command text of its own.

``run-check``   before anything is sent: is a run of this name live, what do the checkpoint folders
                hold (the run's own, and ``--from``'s)
``run-submit``  under the name's lock: the run's folder, its records, secrets (from stdin, 0600),
                the job's runtime files, the ``--from`` checkpoint, the name index, and ``sbatch``
                of segment 1
``sweep-submit`` a sweep's points, each a run of its own, and the job arrays that run them (and a
                retry's: only the points asked for, as new runs of the same names)
``runs``        run records and ``squeue`` (and ``sacct``, the runs' metrics) in one answer
``run-stop``    ``STOP``, ``scancel``, the secrets gone, records for segments that never started
``secrets-sweep`` secrets of runs no job is alive for (a job killed hard could not remove them)
``ckpt-ls``     a checkpoint folder: rv_train's ``step_<N>`` steps, sizes, times, which one resumes
"""

import contextlib
import fcntl
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import time
import zlib

from rv.agent import common, locks, manifest, metrics, quota, store
from rv.agent import segment as records

RUN_FILE = b"run.json"

ENDED = b"ENDED"

STOP = b"STOP"

SECRETS = b"secrets.env"

SCRIPT = b"job.sbatch"
CANDIDATES = b"candidates"  # a run over several GPU types: "<script> <type>" lines, in preference order
RUNTIME = b"runtime"  # <root>/runtime/: the job runtime and rank labeller (rv.slurm.script.runtime_files)

PREEMPTED = b"PREEMPTED"

JOB_ENV = b"env.sh"  # jobs/<id>/env.sh: the job's environment, secrets included (rv.slurm.script)

_STEP = re.compile(r"^step_(\d+)$")

_JOB_ID = re.compile(r"^\d+(?:_\d+)?$")

FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def user_name():
    return pwd.getpwuid(os.getuid()).pw_name


def run_argv(argv, env=None, timeout=60, stdin_data=None):
    """(exit code, stdout, stderr) of ``argv``; 127 when the program is missing."""
    return _finish(_start(argv, env, stdin_data is not None), stdin_data, timeout)


def _start(argv, env=None, stdin=False):
    """The process running ``argv``, or (127, "", why) when it cannot start."""
    # "{user}" stands for the login name, alone or in a word ("user={user}").
    argv = [word.replace("{user}", user_name()) if "{user}" in word else word for word in argv]
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
    except OSError as exc:
        return 127, "", "%s: %s" % (argv[0], exc.strerror)


def _finish(proc, stdin_data=None, timeout=60):
    if isinstance(proc, tuple):
        return proc
    try:
        out, err = proc.communicate(stdin_data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return 124, "", "%s did not answer within %d s" % (proc.args[0], timeout)
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def answer(argv):
    """{"text": stdout, "error": None, or what went wrong} of ``argv``, for a reply."""
    code, text, err = run_argv(argv)
    return {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}


def read_json(path):
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def read_bytes(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def read_text(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return None


def write_json(path, obj, mode=0o600):
    common.write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"), mode)


def runs_dir(root):
    return common.join(root, b"runs")


def run_path(root, run_id):
    if not re.match(r"^[A-Za-z0-9._-]+$", run_id) or run_id.startswith("."):
        raise common.AgentError("bad run id %r" % run_id, "usage")
    return common.join(runs_dir(root), manifest.enc(run_id))


def name_index(root, project, name):
    """The file holding the id of the newest run of ``name``. A sweep's points (``SWEEP/INDEX``)
    have theirs in a folder ``SWEEP``: a sweep's name index is a folder, a plain run's a file."""
    return common.join(root, b"names", manifest.enc(project), manifest.enc(name))


def is_sweep(root, project, name):
    return os.path.isdir(name_index(root, project, name))


def sweep_in_the_way(root, project, name):
    """A plain run may not take a sweep's name (its points' checkpoints are folders in its own)."""
    if is_sweep(root, project, name):
        raise common.AgentError(
            "%s is the name of a sweep (its points are runs %s/0, %s/1, ...): pick another --name"
            % (name, name, name),
            "usage",
        )


def slurm_answers(asks, meanwhile=None):
    """{key: answer(argv)} for each Slurm command a call carries along (``slurm``: {key: argv}), all
    at once (sacctmgr alone takes ~0.2 s a call), and ``meanwhile()``'s result, run beside them:
    (answers, result)."""
    started = [(key, _start(argv)) for key, argv in sorted((asks or {}).items())]
    try:
        result = meanwhile() if meanwhile is not None else None
    finally:
        # Each is read to its end in turn; the others meanwhile run (or wait on a full pipe).
        done = [(key, _finish(proc)) for key, proc in started]
    out = {}
    for key, (code, text, err) in done:
        out[key] = {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}
    return out, result


def live_jobs(squeue_argv):
    """{job id: squeue line} of the user's queued and running jobs; raises when squeue fails."""
    code, out, err = run_argv(squeue_argv)
    if code != 0:
        raise common.AgentError(squeue_failure(code, err), "squeue")
    return jobs_of(out)


def squeue_failure(code, err):
    return "squeue failed (%s)" % (err.strip()[-300:] or "exit %d" % code)


def jobs_of(squeue_text):
    """{job id: line} from squeue's ``|``-separated output."""
    jobs = {}
    for line in squeue_text.splitlines():
        job = line.split("|", 1)[0].strip()
        if job:
            jobs[job] = line
    return jobs


def segments(rdir):
    """[{segment, job_id, record, candidates}] in order: seg/<k>.job names the job, seg/<k>.json is its
    record, seg/<k>.candidates the jobs a run over several GPU types sent for it ([job id, type])."""
    seg_dir = common.join(rdir, b"seg")
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(seg_dir):
            stem, _, ext = name.partition(b".")
            if stem.isdigit() and ext in (b"job", b"json", b"candidates"):
                found.setdefault(int(stem), {})
    out = []
    for k in sorted(found):
        job = read_text(common.join(seg_dir, b"%d.job" % k))
        record = read_json(common.join(seg_dir, b"%d.json" % k))
        if job is None and record:
            job = record.get("job_id")
        lines = (read_text(common.join(seg_dir, b"%d.candidates" % k)) or "").splitlines()
        candidates = [
            line.split(None, 1) + [""] * (2 - len(line.split(None, 1))) for line in lines if line.strip()
        ]
        out.append({"segment": k, "job_id": job, "record": record, "candidates": candidates})
    return out


def run_info(root, run_id):
    rdir = run_path(root, run_id)
    meta = read_json(common.join(rdir, RUN_FILE))
    if meta is None:
        return None
    return {
        "run_id": run_id,
        "meta": meta,
        "segments": segments(rdir),
        "ended": read_json(common.join(rdir, ENDED)),
        "stop": os.path.exists(common.join(rdir, STOP)),
        "secrets": os.path.exists(common.join(rdir, SECRETS)),
    }


def current_job(info):
    segs = info["segments"]
    return segs[-1]["job_id"] if segs else None


def all_run_ids(root):
    try:
        names = os.listdir(runs_dir(root))
    except OSError:
        return []
    return sorted(manifest.dec(n) for n in names if not n.startswith(b"."))


def checkpoint_listing(path):
    """rv_train's layout (step_<N>/COMPLETE) or any files: what a checkpoint folder holds."""
    out = {"exists": os.path.isdir(path), "steps": [], "files": 0, "bytes": 0, "marker": None}
    if not out["exists"]:
        return out
    for name in sorted(os.listdir(path)):
        full = common.join(path, name)
        text = manifest.dec(name)
        m = _STEP.match(text)
        size, mtime = tree_bytes(full)
        out["bytes"] += size
        if m and os.path.isdir(full):
            out["steps"].append(
                {
                    "step": int(m.group(1)),
                    "name": text,
                    "complete": os.path.isfile(common.join(full, b"COMPLETE")),
                    "bytes": size,
                    "mtime": mtime,
                }
            )
        elif name == PREEMPTED:
            out["marker"] = read_text(full)
        else:
            out["files"] += 1
    out["steps"].sort(key=lambda s: s["step"])
    complete = [s["step"] for s in out["steps"] if s["complete"]]
    out["resume_step"] = complete[-1] if complete else None
    return out


def tree_bytes(path):
    """(bytes on disk, newest mtime) of a file or folder."""
    total, newest = 0, 0.0
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0.0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512, st.st_mtime
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                st = os.lstat(common.join(dirpath, name))
                total += st.st_blocks * 512
                newest = max(newest, st.st_mtime)
    return total, newest


def _live_run_of_name(root, project, name, squeue_argv, live=None):
    """(run id, live job id) of the newest run of this name, the job None when nothing of it is live.
    ``live``: the live jobs when the caller has them (squeue is then not asked again)."""
    index = name_index(root, project, name)
    run_id = read_text(index) if os.path.isfile(index) else None
    if not run_id:
        return None, None
    info = run_info(root, run_id)
    if info is None or info["ended"] is not None:
        return run_id, None
    job = current_job(info)
    if job and job in (live if live is not None else live_jobs(squeue_argv)):
        return run_id, job
    return run_id, None


def _resolve_from(root, project, ref):
    """The checkpoint folder of RUN in ``--from RUN``: a run name of this project, a run id, a job id."""
    if (
        re.match(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[0-9]+)?$", ref)
        and not is_sweep(root, project, ref)
        and os.path.isdir(common.join(root, b"checkpoints", manifest.enc(project), manifest.enc(ref)))
    ):
        return {"project": project, "name": ref}
    for run_id in all_run_ids(root):
        info = run_info(root, run_id)
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
    if args.get("sweep"):
        return _sweep_check(root, args)
    sweep_in_the_way(root, project, name)
    run_id, live = _live_run_of_name(root, project, name, args["squeue"])
    out = {
        "name_run_id": run_id,
        "live": live,
        "checkpoint": checkpoint_listing(
            common.join(root, b"checkpoints", manifest.enc(project), manifest.enc(name))
        ),
    }
    if args.get("from"):
        src = _resolve_from(root, project, args["from"])
        path = common.join(root, b"checkpoints", manifest.enc(src["project"]), manifest.enc(src["name"]))
        out["from"] = dict(src, checkpoint=checkpoint_listing(path))
    if args.get("probes"):
        out["probes"] = _probes(args)
    return out


def _probes(args):
    """When each candidate would start, and whether sbatch takes it at all (sbatch --test-only
    submits nothing): the script's directives only, on stdin."""
    out = []
    for probe in args["probes"]:
        code, text, err = run_argv(args["test_only"], stdin_data=probe["script"].encode("utf-8"))
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
    src = common.join(root, b"checkpoints", manifest.enc(spec["project"]), manifest.enc(spec["name"]))
    listing = checkpoint_listing(src)
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
    kinds = _clone_tree(src, dest, skip=(PREEMPTED,))
    return {"step": None, "how": sorted(kinds)}


_RUNTIME_NAME = re.compile(r"^(job|rank-label|notify)-[0-9a-f]{16}\.(sh|py)$")


def place_runtime(root, files):
    """The job's runtime files under ``<root>/runtime/``: written once, named by content, read-only.

    A file already there is never rewritten (a queued job may be reading it). The labeller is run
    as a program (torchrun's PYTHON_EXEC): executable; the shell file is only sourced.
    """
    folder = common.join(root, RUNTIME)
    common.makedirs(folder, 0o700)
    for name, text in sorted(files.items()):
        if not _RUNTIME_NAME.match(name):
            raise common.AgentError("bad runtime file name %r" % name, "usage")
        path = common.join(folder, manifest.enc(name))
        if not os.path.exists(path):
            common.write_atomic(path, text.encode("utf-8"), 0o500 if name.endswith(".py") else 0o400)


def mode_run_submit(args):
    secrets = sys.stdin.buffer.read() if args.get("has_secrets") else None
    return _submit(args, secrets)


def _submit(args, secrets):
    root = common.root_path(args["root"])
    run_id, project, name = args["run_id"], args["project"], args["name"]
    rdir = run_path(root, run_id)
    lock_path = name_index(root, project, name) + b".lock"
    with locks.lock(lock_path, "rv run %s" % name, wait=30):
        sweep_in_the_way(root, project, name)
        previous, live = _live_run_of_name(root, project, name, args["squeue"])
        if live:
            raise common.AgentError("run %s is still live (job %s)" % (name, live), "live")
        ckpt = common.join(root, b"checkpoints", manifest.enc(project), manifest.enc(name))
        made_ckpt = not os.path.exists(ckpt)
        common.makedirs(common.join(rdir, b"seg"), 0o700)
        common.makedirs(common.join(rdir, b"logs"), 0o700)
        try:
            result = {}
            if secrets is not None:
                # Created 0600 before a byte is written: never readable by others, even for a moment.
                common.write_atomic(common.join(rdir, SECRETS), secrets, 0o600)
            place_runtime(root, args.get("runtime") or {})
            scripts = _write_scripts(rdir, args)
            write_json(common.join(rdir, RUN_FILE), dict(args["meta"], run_id=run_id, created=time.time()))
            if args.get("from"):
                result["from"] = _start_from(root, args["from"], ckpt)
            jobs = _sbatch_all(args["sbatch"], rdir, scripts)
            job = jobs[0][0]
            if len(jobs) > 1:
                text = "".join("%s %s\n" % pair for pair in jobs)
                common.write_atomic(common.join(rdir, b"seg", b"1.candidates"), text.encode(), 0o600)
            common.write_atomic(common.join(rdir, b"seg", b"1.job"), (job + "\n").encode(), 0o600)
            index = name_index(root, project, name)
            common.makedirs(os.path.dirname(index), 0o700)
            common.write_atomic(index, (run_id + "\n").encode(), 0o600)
        except BaseException:
            # Nothing half-made stays behind: the run's folder, and a checkpoint folder made for it.
            shutil.rmtree(rdir, ignore_errors=True)
            if made_ckpt:
                shutil.rmtree(ckpt, ignore_errors=True)
            raise
    result.update(job_id=job, previous_run_id=previous, candidates=jobs)
    return result


def _write_scripts(rdir, args):
    """The run's batch scripts: ``job.sbatch``, or one per GPU type for a run over several
    (``job.<i>.sbatch``, with their types in ``candidates``). [(file name, type)], preferred first."""
    candidates = args.get("candidates")
    if not candidates:
        common.write_atomic(common.join(rdir, SCRIPT), args["script"].encode("utf-8"), 0o700)
        return [(SCRIPT.decode(), None)]
    scripts = []
    for i, candidate in enumerate(candidates, 1):
        if not re.match(r"^[A-Za-z0-9._-]+$", candidate["type"]):
            raise common.AgentError("bad GPU type name %r" % candidate["type"], "usage")
        name = "job.%d.sbatch" % i
        common.write_atomic(common.join(rdir, name.encode()), candidate["script"].encode("utf-8"), 0o700)
        scripts.append((name, candidate["type"]))
    text = "".join("%s %s\n" % pair for pair in scripts)
    common.write_atomic(common.join(rdir, CANDIDATES), text.encode(), 0o600)
    return scripts


def _sbatch_all(argv, rdir, scripts):
    """sbatch of each script as segment 1 ([(job id, type)]); on a refusal the ones queued are cancelled."""
    env = dict(os.environ, RV_SEGMENT="1")
    jobs = []
    for name, gpu_type in scripts:
        code, out, err = run_argv(argv[:-1] + [manifest.dec(common.join(rdir, name.encode()))], env=env)
        if code != 0:
            if jobs:
                run_argv(["scancel"] + [j for j, _ in jobs])
            lines = [line for line in err.strip().splitlines() if line.strip()]
            what = " for %s" % gpu_type if gpu_type else ""
            raise common.AgentError(
                "sbatch rejected the job%s: %s" % (what, " / ".join(lines[-3:]) or "exit %d" % code), "sbatch"
            )
        jobs.append((out.strip().splitlines()[-1].split(";")[0].strip(), gpu_type or ""))
    return jobs


# --- sweeps: points as runs, run by job arrays ------------------------------------------------------


def _plain_run_in_the_way(root, project, name):
    if os.path.isfile(name_index(root, project, name)):
        raise common.AgentError(
            "a run named %s exists: a sweep needs a name no run has (its points are %s/0, %s/1, ...): "
            "pick another --name" % (name, name, name),
            "usage",
        )


def _sweep_points(root, project, name, live):
    """{index: what is known of the newest run of point SWEEP/index}: its run id, values, live job,
    and what its checkpoint folder holds (a point named again resumes from it, as a plain run does)."""
    folder = name_index(root, project, name)
    out = {}
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not entry.isdigit():
            continue
        point = "%s/%s" % (name, manifest.dec(entry))
        run_id, job = _live_run_of_name(root, project, point, None, live)
        info = run_info(root, run_id) if run_id else None
        ckpt = checkpoint_listing(
            common.join(root, b"checkpoints", manifest.enc(project), manifest.enc(point))
        )
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
    answers, live = slurm_answers(args.get("slurm"), lambda: live_jobs(args["squeue"]))
    out = {"points": _sweep_points(root, project, name, live), "queued": len(live), "slurm": answers}
    if args.get("probes"):
        out["probes"] = _probes(args)
    return out


_NOT_ID_CHAR = r"[A-Za-z0-9._-]"


def _retry_script(root, old_run_id, run_id):
    """A retry's point: the batch script and run.json of the run ``old_run_id`` (the point as it was
    sent), made the run ``run_id``'s. The run id is random, so in the script it is only ever the
    run's own (its folder, its records); replaced where it stands as a whole word."""
    old_dir = run_path(root, old_run_id)
    script = read_bytes(common.join(old_dir, SCRIPT)).decode("utf-8")
    meta = read_json(common.join(old_dir, RUN_FILE))
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
    logs = "%s/%s-%%a/logs/%%A_%%a" % (runs_folder, prefix)
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
        'rv_point="%s/%s-$SLURM_ARRAY_TASK_ID/job.sbatch"' % (runs_folder, prefix),
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
    with locks.lock(name_index(root, project, name) + b".lock", "rv run --sweep %s" % name, wait=30):
        _plain_run_in_the_way(root, project, name)
        live = live_jobs(args["squeue"])
        for part in payload["parts"]:
            for point in part["points"]:
                _, job = _live_run_of_name(root, project, point["name"], None, live)
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
                    rdir = run_path(root, run_id)
                    if os.path.exists(rdir):
                        raise common.AgentError("run %s exists already" % run_id, "usage")
                    if "like" in point:
                        script, meta = _retry_script(root, point["like"], run_id)
                    else:
                        script, meta = point["script"], point["meta"]
                    meta = dict(meta, **(point.get("meta_update") or {}))
                    made.append(rdir)
                    common.makedirs(common.join(rdir, b"seg"), 0o700)
                    common.makedirs(common.join(rdir, b"logs"), 0o700)
                    if meta.get("has_secrets"):
                        # 0600 before a byte is written; an empty file when a retry has none now.
                        common.write_atomic(
                            common.join(rdir, SECRETS), (secrets or "").encode("utf-8"), 0o600
                        )
                    common.write_atomic(common.join(rdir, SCRIPT), script.encode("utf-8"), 0o700)
                    write_json(common.join(rdir, RUN_FILE), dict(meta, run_id=run_id, created=time.time()))
                    runs_here.append((run_id, point["name"]))
                    first = first or script
                runs_folder = manifest.dec(runs_dir(root))
                array_path = common.join(run_path(root, runs_here[0][0]), b"array.sbatch")
                wrapper = _array_script(first, name, runs_folder, part["prefix"], part["spec"])
                common.write_atomic(array_path, wrapper.encode("utf-8"), 0o700)
                after = previous if part.get("after_previous") else None
                argv = (
                    [w.replace("{after}", after) for w in args["sbatch_after"]] if after else args["sbatch"]
                )
                code, out, err = run_argv(argv[:-1] + [manifest.dec(array_path)], env=env)
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
                    common.write_atomic(
                        common.join(run_path(root, run_id), b"seg", b"1.job"), (job + "\n").encode(), 0o600
                    )
                result.append({"array": array, "runs": [run_id for run_id, _ in runs_here]})
                named += runs_here
            for run_id, point in named:  # each point is now the newest run of its name
                index = name_index(root, project, point)
                common.makedirs(os.path.dirname(index), 0o700)
                common.write_atomic(index, (run_id + "\n").encode(), 0o600)
        except BaseException:
            # Nothing half-made stays behind: what was queued is cancelled, every run folder goes.
            if arrays:
                run_argv(list(args["scancel"]) + arrays)
            for rdir in made:
                shutil.rmtree(rdir, ignore_errors=True)
            raise
    return {"parts": result}


def _point_span(runs_here):
    names = [n for _, n in runs_here]
    return names[0] if len(names) == 1 else "%s .. %s" % (names[0], names[-1])


def mode_runs(args):
    """Run records, chosen by id, name, job id, recency or liveness; with squeue (and sacct) text."""
    root = common.root_path(args["root"])
    out = {"runs": [], "now": time.time()}
    code, text, err = run_argv(args["squeue"])
    out["squeue"] = {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}
    if args.get("sacct"):
        out["sacct"] = answer(args["sacct"])
    if args.get("slurm"):
        out["slurm"] = slurm_answers(args["slurm"])[0]
    if args.get("secrets_sweep"):
        # The session's secrets sweep rides along on this call: no second round trip.
        out["secrets_sweep"] = sweep_secrets(root, args["secrets_sweep"], jobs_of(text)) if code == 0 else {
            "error": squeue_failure(code, err)}  # fmt: skip
    out["runs"] = select_runs(root, args)
    if args.get("metrics") is not None:
        # rv sweep results: each run's metrics summed up in the same call (rv.agent.metrics).
        asked = args["metrics"]
        out["metrics"] = {"runs": metrics.read_runs(
            root, [r["run_id"] for r in out["runs"]], asked.get("series", False),
            asked.get("points") or metrics.DEFAULT_POINTS)}  # fmt: skip
    return out


def _sweep_of(meta):
    """(project, sweep name) of a sweep's point, or None."""
    sweep = meta.get("sweep")
    return (meta.get("project"), sweep.get("name")) if isinstance(sweep, dict) else None


def select_runs(root, args):
    """The runs ``args`` asks for (``ids``, ``names``, ``any_names``, ``job_ids``, ``live``,
    ``since``, ``sweeps``: every point of the sweeps of these names), as :func:`run_info` dicts in run
    id order. ``whole_sweeps``: a point chosen brings every other point of its sweep (rv ps counts a
    sweep's points by state)."""
    sweeps = set(args.get("sweeps") or [])
    whole = bool(args.get("whole_sweeps"))
    siblings = {}  # (project, sweep) -> run ids of its points not chosen (yet)
    chosen_sweeps = set()
    ids = set(args.get("ids") or [])
    names = set(tuple(n) for n in args.get("names") or [])
    any_names = set(args.get("any_names") or [])  # a run name, whatever its project
    job_ids = set(args.get("job_ids") or [])
    since = args.get("since")
    found = []
    for run_id in all_run_ids(root):
        # Two reads decide for most runs (an ended run rv ps does not show): the segments, one or
        # two files each, are read only for the runs that are sent, or asked for by job id.
        rdir = run_path(root, run_id)
        meta = read_json(common.join(rdir, RUN_FILE))
        if meta is None:
            continue
        ended = read_json(common.join(rdir, ENDED))
        sweep = _sweep_of(meta)
        wanted = (
            (sweep is not None and sweep[1] in sweeps)
            or run_id in ids
            or (meta.get("project"), meta.get("name")) in names
            or meta.get("name") in any_names
            or (args.get("live") and ended is None)
            or (
                since is not None
                and (meta.get("created", 0) >= since or (ended or {}).get("end", 0) >= since)
            )
        )
        if not wanted and not job_ids:
            if whole and sweep is not None:
                siblings.setdefault(sweep, []).append(run_id)
            continue
        info = run_info(root, run_id)
        if info is None:
            continue
        if wanted or job_ids & set(seg["job_id"] for seg in info["segments"]):
            found.append(info)
            if sweep is not None:
                chosen_sweeps.add(sweep)
        elif whole and sweep is not None:
            siblings.setdefault(sweep, []).append(run_id)
    if whole:
        more = [run_info(root, r) for key in chosen_sweeps for r in siblings.get(key, ())]
        found = sorted(found + [info for info in more if info is not None], key=lambda info: info["run_id"])
    return found


def _end_run(rdir, reason, segment):
    """ENDED for a run whose jobs could not write it; records for segments that never started."""
    now = time.time()
    for seg in segments(rdir):
        if seg["record"] is None:
            write_json(
                common.join(rdir, b"seg", b"%d.json" % seg["segment"]),
                records.segment_record(seg["segment"], seg["job_id"], "ended", reason, now),
            )
    if not os.path.exists(common.join(rdir, ENDED)):
        write_json(common.join(rdir, ENDED), records.ended_record(reason, None, segment, now))


def _remove_job_envs(rdir):
    """The jobs' environment files (they hold the secrets) of a run no job of which is alive, or that
    is being stopped; each job removes its own as it ends, unless it was killed too hard to."""
    jobs = common.join(rdir, b"jobs")
    for job in os.listdir(jobs) if os.path.isdir(jobs) else []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(common.join(jobs, job, JOB_ENV))


def mode_run_stop(args):
    """STOP in every run first, then one scancel for all their jobs: a sweep stopped whole leaves no
    window in which a slot one point freed starts another point that is not marked yet."""
    root = common.root_path(args["root"])
    out, found, every = [], [], []
    for run_id in args["ids"]:
        rdir = run_path(root, run_id)
        info = run_info(root, run_id)
        if info is None:
            out.append({"run_id": run_id, "error": "no such run"})
            continue
        common.write_atomic(common.join(rdir, STOP), ("%f\n" % time.time()).encode(), 0o600)
        # After STOP: a segment submitting its successor now sees STOP and cancels it itself.
        info = run_info(root, run_id)
        pending = [s for s in info["segments"] if (s["record"] or {}).get("state") != "ended" and s["job_id"]]
        ids = []
        for seg in pending:  # a segment sent once per GPU type: every one of its jobs
            for job in [seg["job_id"]] + [c[0] for c in seg.get("candidates") or []]:
                if job not in ids:
                    ids.append(job)
        found.append((run_id, rdir, pending, ids))
        every += [job for job in ids if job not in every]
    error = None
    if every:
        code, _, err = run_argv(list(args["scancel"]) + every)
        if code != 0 and "Invalid job id" not in err:
            error = err.strip()[-300:] or "scancel exit %d" % code
    for run_id, rdir, pending, ids in found:
        secrets = common.join(rdir, SECRETS)
        removed = os.path.exists(secrets)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(secrets)
        _remove_job_envs(rdir)
        never_started = [s for s in pending if s["record"] is None]
        if never_started and len(never_started) == len(pending):
            _end_run(rdir, "cancelled by rv stop before it started", never_started[-1]["segment"])
        out.append({"run_id": run_id, "cancelled": ids, "secrets_removed": removed,
                    "error": error if ids else None})  # fmt: skip
    return {"stopped": out}


def mode_secrets_sweep(args):
    """Secrets of runs no job is alive for: removed, and ENDED written where the job could not."""
    return sweep_secrets(common.root_path(args["root"]), args["ids"], live_jobs(args["squeue"]))


def sweep_secrets(root, ids, live):
    """``secrets-sweep`` for ``ids`` given the live jobs; also done inside ``runs`` and ``usage`` calls."""
    out = {"removed": [], "ended": [], "live": []}
    for run_id in ids:
        info = run_info(root, run_id)
        if info is None:
            continue
        if any(s["job_id"] in live for s in info["segments"]):
            out["live"].append(run_id)
            continue
        rdir = run_path(root, run_id)
        if info["secrets"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(common.join(rdir, SECRETS))
            out["removed"].append(run_id)
        _remove_job_envs(rdir)
        if info["ended"] is None:
            segs = info["segments"]
            _end_run(rdir, "ended without a record (cancelled or killed before it could write one)",
                     segs[-1]["segment"] if segs else 0)  # fmt: skip
            out["ended"].append(run_id)
    return out


def mode_ckpt_ls(args):
    root = common.root_path(args["root"])
    return checkpoint_listing(
        common.join(root, b"checkpoints", manifest.enc(args["project"]), manifest.enc(args["name"]))
    )
