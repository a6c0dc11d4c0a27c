"""Reading runs on the cluster side: a run's folder and records, the name indexes, the checkpoint
folders; and the end a run gets when its jobs could not write it (:func:`end_run`).

The folders and files are :mod:`rv.agent.layout`'s; the records' format is :mod:`rv.agent.segment`'s.
"""

import contextlib
import json
import os
import re
import time

from rv.agent import common, layout, manifest, slurmcmd
from rv.agent import segment as records

_SEGMENT_RECORDS = tuple(manifest.enc(kind) for kind in layout.SEGMENT_RECORDS)


def runs_dir(root):
    return common.under(root, layout.RUNS)


def run_path(root, run_id):
    if not re.match(r"^[A-Za-z0-9._-]+$", run_id) or run_id.startswith("."):
        raise common.AgentError("bad run id %r" % run_id, "usage")
    return common.under(root, layout.run_dir(run_id))


def name_index(root, project, name):
    """The file holding the id of the newest run of ``name`` (a folder for a sweep: see
    :func:`rv.agent.layout.name_index`)."""
    return common.under(root, layout.name_index(project, name))


def checkpoint_path(root, project, name):
    return common.under(root, layout.checkpoint_dir(project, name))


def is_sweep(root, project, name):
    return os.path.isdir(name_index(root, project, name))


def segments(rdir):
    """[{segment, job_id, record, candidates}] in order: seg/<k>.job names the job, seg/<k>.json is its
    record, seg/<k>.candidates the jobs a run over several GPU types sent for it ([job id, type])."""
    seg_dir = common.under(rdir, layout.SEG)
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(seg_dir):
            stem, _, ext = name.partition(b".")
            if stem.isdigit() and ext in _SEGMENT_RECORDS:
                found.setdefault(int(stem), {})
    out = []
    for k in sorted(found):
        job = common.read_text(common.under(rdir, layout.segment_file(k, "job")))
        record = common.read_json(common.under(rdir, layout.segment_file(k, "json")))
        if job is None and record:
            job = record.get("job_id")
        lines = (
            common.read_text(common.under(rdir, layout.segment_file(k, "candidates"))) or ""
        ).splitlines()
        candidates = [
            line.split(None, 1) + [""] * (2 - len(line.split(None, 1))) for line in lines if line.strip()
        ]
        out.append({"segment": k, "job_id": job, "record": record, "candidates": candidates})
    return out


def read_stats(rdir, points=0):
    """What the run's jobs measured (rv/agent/stats.py writes ``stats/<segment>/<node>.json``):
    ``{segment: [node records]}``, for the laptop to sum up (rv.job.stats). With ``points``, each
    record has ``curve``: at most about that many [time, mean utilization of the node's GPUs] of its
    samples (``<node>.gpu.jsonl``), for the page's chart."""
    out = {}
    base = common.under(rdir, layout.STATS)
    try:
        segs = [s for s in os.listdir(base) if s.isdigit()]
    except OSError:
        return out
    for seg in sorted(segs, key=int):
        try:
            names = sorted(n for n in os.listdir(os.path.join(base, seg)) if n.endswith(b".json"))
        except OSError:
            continue
        recs = []
        for n in names:
            rec = common.read_json(os.path.join(base, seg, n))
            if not isinstance(rec, dict):
                continue
            if points:
                rec["curve"] = _gpu_curve(
                    os.path.join(base, seg, n[: -len(b".json")] + b".gpu.jsonl"), points
                )
            recs.append(rec)
        out[manifest.dec(seg)] = recs
    return out


def _gpu_curve(path, points):
    curve = []
    for line in (common.read_bytes(path) or b"").splitlines():
        try:
            row = json.loads(line.decode("utf-8", "replace"))
            utils = [g[1] for g in row["gpus"] if isinstance(g[1], (int, float))]
            curve.append([row["t"], round(sum(utils) / len(utils), 1) if utils else None])
        except common.UNPARSABLE + (KeyError, TypeError, IndexError, AttributeError):
            continue
    if len(curve) > points:
        step = len(curve) / float(points)
        curve = [curve[int(i * step)] for i in range(points)] + [curve[-1]]
    return curve


def run_info(root, run_id):
    rdir = run_path(root, run_id)
    meta = common.read_json(common.under(rdir, layout.RUN_FILE))
    if meta is None:
        return None
    return {
        "run_id": run_id,
        "meta": meta,
        "segments": segments(rdir),
        "ended": common.read_json(common.under(rdir, layout.ENDED)),
        "stop": os.path.exists(common.under(rdir, layout.STOP)),
        "secrets": os.path.exists(common.under(rdir, layout.SECRETS)),
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
        step = layout.step_of(text)
        size, mtime = common.tree_bytes(full)
        out["bytes"] += size
        if step is not None and os.path.isdir(full):
            out["steps"].append(
                {
                    "step": step,
                    "name": text,
                    "complete": os.path.isfile(common.under(full, layout.COMPLETE)),
                    "bytes": size,
                    "mtime": mtime,
                }
            )
        elif text == layout.PREEMPTED:
            out["marker"] = common.read_text(full)
        else:
            out["files"] += 1
    out["steps"].sort(key=lambda s: s["step"])
    complete = [s["step"] for s in out["steps"] if s["complete"]]
    out["resume_step"] = complete[-1] if complete else None
    return out


def live_run_of_name(root, project, name, squeue_argv, live=None):
    """(run id, live job id) of the newest run of this name, the job None when nothing of it is live.
    ``live``: the live jobs when the caller has them (squeue is then not asked again)."""
    index = name_index(root, project, name)
    run_id = common.read_text(index) if os.path.isfile(index) else None
    if not run_id:
        return None, None
    info = run_info(root, run_id)
    if info is None or info["ended"] is not None:
        return run_id, None
    job = current_job(info)
    if job and job in (live if live is not None else slurmcmd.live_jobs(squeue_argv)):
        return run_id, job
    return run_id, None


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
        meta = common.read_json(common.under(rdir, layout.RUN_FILE))
        if meta is None:
            continue
        ended = common.read_json(common.under(rdir, layout.ENDED))
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


def end_run(rdir, reason, segment, exit_code=None):
    """ENDED for a run whose jobs could not write it; records for segments that never started."""
    now = time.time()
    for seg in segments(rdir):
        if seg["record"] is None:
            common.write_json(
                common.under(rdir, layout.segment_file(seg["segment"], "json")),
                records.segment_record(seg["segment"], seg["job_id"], "ended", reason, now),
            )
    ended = common.under(rdir, layout.ENDED)
    if not os.path.exists(ended):
        common.write_json(ended, records.ended_record(reason, exit_code, segment, now))


# What the batch script itself writes to the job's stderr when it cannot start the job, before the job's
# runtime could record anything (rv/slurm/script.py: the runtime file purged from scratch). The run's
# own cause, which "ended without a record" would hide.
_SCRIPT_WORDS = re.compile(rb"^rv: (the job runtime .* is missing .*)$", re.M)


def script_words(rdir, job):
    """The cause the batch script of ``job`` wrote on its stderr log when it could not start the job;
    None when it wrote none."""
    path = common.under(rdir, layout.log_file(job, "err"))
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            text = fh.read()
    except OSError:
        return None
    found = _SCRIPT_WORDS.findall(text)
    return found[-1].decode("utf-8", "replace").strip() if found else None


def remove_secrets(rdir):
    """The run's secrets file, if it has one: whether it was there."""
    secrets = common.under(rdir, layout.SECRETS)
    removed = os.path.exists(secrets)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(secrets)
    return removed


def remove_job_envs(rdir):
    """The jobs' environment files (they hold the secrets) of a run no job of which is alive, or that
    is being stopped; each job removes its own as it ends, unless it was killed too hard to."""
    jobs = common.under(rdir, layout.JOBS)
    for job in os.listdir(jobs) if os.path.isdir(jobs) else []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(common.under(common.join(jobs, job), layout.JOB_ENV))
