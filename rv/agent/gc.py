"""``gc`` and ``usage``: what finished runs left, then snapshots, objects and environments nothing uses.

The bytes freed are counted inode by inode as paths go (:class:`Freed`); ``usage`` reports what rv
keeps under the root by kind and what ``gc`` would free.
"""

import contextlib
import os
import subprocess
import time

from rv.agent import (
    common,
    container,
    envs,
    images,
    layout,
    locks,
    manifest,
    oldstore,
    quota,
    rundir,
    runs,
    slurmcmd,
    store,
)


class Freed:
    """Bytes a removal frees, counted from the filesystem itself as paths go.

    A file's blocks are freed when its last link goes: each inode is counted once all the links it
    had were removed here (a snapshot's hard links into objects/ free nothing until the object goes).
    Folders cannot be hard-linked: their blocks count when they go.
    """

    def __init__(self):
        self.inodes = {}
        self.dir_bytes = 0
        self.dirs = 0
        self.extra = 0  # measured (or, in a dry run, estimated) elsewhere: what git's gc freed
        self.extra_files = 0  # the same, in files (the quota counts them too)

    def note(self, path):
        for dirpath, dirs, files in os.walk(path) if os.path.isdir(path) and not os.path.islink(path) else []:
            for name in files + [d for d in dirs if os.path.islink(common.join(dirpath, d))]:
                self._file(common.join(dirpath, name))
            for d in dirs:
                p = common.join(dirpath, d)
                if not os.path.islink(p):
                    with contextlib.suppress(OSError):
                        self.dir_bytes += os.lstat(p).st_blocks * 512
                        self.dirs += 1
        if os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):
                self.dir_bytes += os.lstat(path).st_blocks * 512
                self.dirs += 1
        else:
            self._file(path)

    def _file(self, path):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            entry = self.inodes.setdefault((st.st_dev, st.st_ino), [st.st_blocks * 512, st.st_nlink, 0])
            entry[2] += 1

    @property
    def files(self):
        """Files (and folders) whose last link went: what a file quota counts."""
        return (
            self.extra_files
            + self.dirs
            + sum(1 for _size, links, seen in self.inodes.values() if seen >= links)
        )

    @property
    def bytes(self):
        return (
            self.extra
            + self.dir_bytes
            + sum(size for size, links, seen in self.inodes.values() if seen >= links)
        )


def _run_last_activity(rdir, info):
    ended = info["ended"]
    if ended and ended.get("end"):
        return float(ended["end"])
    return max(common.tree_bytes(rdir)[1], float(info["meta"].get("created", 0)))


def plan_gc(root, args, live):
    """(runs to remove, runs kept with why, names whose checkpoints/outputs may go)."""
    now = time.time()
    older_than, grace = float(args["older_than"]), float(args.get("grace", 900))
    remove_runs, kept = [], []
    kept_names = set()
    for run_id in rundir.all_run_ids(root):
        rdir = rundir.run_path(root, run_id)
        info = rundir.run_info(root, run_id)
        if info is None:
            # A folder without run.json: a submission in progress, or one that died: by age only.
            if now - common.tree_bytes(rdir)[1] > max(older_than, grace):
                remove_runs.append((run_id, None))
            continue
        meta = info["meta"]
        key = (meta.get("project"), meta.get("name"))
        alive = [s["job_id"] for s in info["segments"] if s["job_id"] in live]
        age = now - _run_last_activity(rdir, info)
        if alive:
            kept.append(
                {"run_id": run_id, "name": meta.get("name"), "why": "live (job %s)" % ", ".join(alive)}
            )
            kept_names.add(key)
        elif info["ended"] is None and age < grace:
            kept.append({"run_id": run_id, "name": meta.get("name"), "why": "being submitted"})
            kept_names.add(key)
        elif age < older_than:
            kept.append(
                {"run_id": run_id, "name": meta.get("name"), "why": "ended %s ago" % common.human_age(age)}
            )
            kept_names.add(key)
        else:
            remove_runs.append((run_id, info))
    return remove_runs, kept, kept_names


def _forget_name(root, project, name, run_id, freed, dry):
    """The name of a removed run, when that run was its newest: its index and its lock file (one
    file per name ever used would stay forever). Under the name's lock, as rv run takes it: a run
    of that name being submitted now keeps both."""
    index = rundir.name_index(root, project, name)
    if common.read_text(index) != run_id:
        return  # a newer run has the name (or none did): its index and lock stay
    lock_path = common.under(root, layout.name_lock(project, name))
    if dry:
        common.remove_counted(index, freed, dry)
        if os.path.exists(lock_path):
            common.remove_counted(lock_path, freed, dry)
        return
    try:
        with locks.lock(lock_path, "rv gc", wait=0):
            if common.read_text(index) != run_id:
                return
            common.remove_counted(index, freed, dry)
            # Removed while held: whoever waits for it finds it gone, and takes a new one (locks.lock).
            common.remove_counted(lock_path, freed, dry)
    except common.AgentError as exc:
        if exc.code != "busy":
            raise
        return  # a run of this name is being submitted, and it will own the name
    if "/" in name:
        # A sweep's point: the sweep's folder of name indexes goes with its last point, so the name
        # is free again for a plain run, and the sweep's own lock with it.
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(index))
            _remove_lock_of(common.under(root, layout.name_lock(project, name.rsplit("/", 1)[0])), freed)


def _remove_lock_of(lock_path, freed):
    """A lock file whose name has no index any more, removed while held (busy: left as it is)."""
    try:
        with locks.lock(lock_path, "rv gc", wait=0):
            common.remove_counted(lock_path, freed, False)
    except common.AgentError as exc:
        if exc.code != "busy":
            raise  # busy: a sweep of this name is being submitted, and the lock is its


def runs_and_store_gc(args, live=None):
    root = common.root_path(args["root"])
    dry = bool(args.get("dry_run"))
    older_than = float(args["older_than"])
    if live is None:
        live = slurmcmd.live_jobs(args["squeue"])  # if squeue fails, nothing is removed
    freed = Freed()
    report = {"dry_run": dry, "runs_removed": [], "runs_kept": [], "checkpoints_removed": [],
              "outputs_removed": [], "warnings": []}  # fmt: skip
    remove_runs, kept, kept_names = plan_gc(root, args, live)
    report["runs_kept"] = kept
    in_use = set()
    for entry in kept:
        meta = (rundir.run_info(root, entry["run_id"]) or {}).get("meta") or {}
        if meta.get("snapshot"):
            in_use.add(meta["snapshot"])
    for run_id, info in remove_runs:
        meta = (info or {}).get("meta") or {}
        before = freed.bytes
        common.remove_counted(rundir.run_path(root, run_id), freed, dry)
        report["runs_removed"].append(
            {"run_id": run_id, "name": meta.get("name"), "bytes": freed.bytes - before,
             "reason": ((info or {}).get("ended") or {}).get("reason")}
        )  # fmt: skip
        if meta:
            _forget_name(root, meta.get("project", ""), meta.get("name", ""), run_id, freed, dry)
    if args.get("checkpoints"):
        now = time.time()
        for kind, report_key in (
            (layout.CHECKPOINTS, "checkpoints_removed"),
            (layout.OUTPUTS, "outputs_removed"),
        ):
            base = common.under(root, kind)
            for project in sorted(os.listdir(base)) if os.path.isdir(base) else []:
                for name in sorted(os.listdir(common.join(base, project))):
                    key = (manifest.dec(project), manifest.dec(name))
                    path = common.join(base, project, name)
                    newest = common.tree_bytes(path)[1]
                    # A sweep's folder holds its points' (SWEEP/INDEX): kept while one of them is.
                    point = [k for k in kept_names if k[0] == key[0] and str(k[1]).startswith(key[1] + "/")]
                    if key in kept_names or point or now - newest < older_than:
                        continue
                    before = freed.bytes
                    common.remove_counted(path, freed, dry)
                    report[report_key].append(
                        {"project": key[0], "name": key[1], "bytes": freed.bytes - before}
                    )
    # The store of an older rv first (its folders and objects), then the git store.
    old = oldstore.collect_garbage(root, in_use, args, freed, dry)
    new = store.collect_garbage(root, in_use, args, freed, dry)
    report.update(
        removed=old["removed"] + new["removed"],
        kept=old["kept"] + new["kept"],
        objects_removed=old["objects_removed"] + new["objects_removed"],
        warnings=report["warnings"] + old["warnings"],
    )
    # What the git store's collection measured and mended (absent when it had nothing to do).
    for key in ("store_files_before", "store_files_after", "broken_removed", "repairs"):
        if key in new:
            report[key] = new[key]
    report["runtime_removed"] = runtime_gc(root, [r for r, _ in remove_runs] if dry else (), freed, dry,
                                           float(args.get("grace", 900)))  # fmt: skip
    report["bytes_freed"] = freed.bytes
    report["files_freed"] = freed.files
    return report


def runtime_gc(root, going, freed, dry, grace):
    """Runtime files (``<root>/runtime/``) that no run's batch script names any more, once older than
    ``grace``: a run folder that stays keeps what its script sources. ``going``: runs removed in a dry
    run (still there, but counted as gone)."""
    folder = common.under(root, layout.RUNTIME)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    named = set()
    skip = set(manifest.enc(r) for r in going)
    for run_id in os.listdir(rundir.runs_dir(root)) if os.path.isdir(rundir.runs_dir(root)) else []:
        if run_id in skip:
            continue
        rdir = common.join(rundir.runs_dir(root), run_id)
        for script in os.listdir(rdir) if os.path.isdir(rdir) else []:
            if script.endswith(
                manifest.enc(layout.SCRIPT_SUFFIX)
            ):  # job.sbatch, or a run over several types' job.<i>.sbatch
                text = common.read_bytes(common.join(rdir, script))
                named.update(n for n in names if n in text)
    removed = []
    now = time.time()
    for name in sorted(set(names) - named):
        path = common.join(folder, name)
        with contextlib.suppress(OSError):
            if now - os.lstat(path).st_mtime < grace:
                continue
            common.remove_counted(path, freed, dry)
            removed.append(manifest.dec(name))
    return removed


# (kind, folder under the root, or under each run's folder). The git store first; then an older
# rv's objects, whose snapshots' files are hard links to them (snapshots count only their folders).
KINDS = (
    ("store", layout.STORE, False),
    ("objects", layout.OBJECTS, False),
    ("snapshots", layout.SNAPSHOTS, False),
    ("work dirs", layout.WORK, True),
    ("work dirs", layout.WORK_CHANGES, True),  # --work-dir node: what the program changed, one tar
    ("logs", layout.LOGS, True),
    ("checkpoints", layout.CHECKPOINTS, False),
    ("outputs", layout.OUTPUTS, False),
    ("environments", layout.ENVS, False),
    ("images", layout.IMAGES, False),
)


def _runtimes(setup):
    """The container runtimes found after the profile's ``setup`` lines, with versions (rv status)."""
    try:
        return {"found": container.find_runtimes(container.setup_environment(setup))}
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}


def mode_usage(args):
    """Bytes on disk by kind (each inode counted once, objects first), and what gc would free.

    With ``sinfo`` (`rv status`), all the rest of what status shows, in this one call: the login
    name, ``squeue`` (also gc's live jobs) and ``sinfo`` text, the ``secrets_sweep`` of the session, and
    ``work_ms``, the time spent here (rv reports the rest of the call as the round trip).
    """
    started = time.time()
    root = common.root_path(args["root"])
    out = {}
    live = None
    if args.get("sinfo"):
        out["user"] = slurmcmd.user_name()
        code, text, err = slurmcmd.run_argv(args["squeue"])
        out["squeue"] = {"text": text, "error": None if code == 0 else slurmcmd.squeue_failure(code, err)}
        if code == 0:
            live = slurmcmd.jobs_of(text)
        out["sinfo"] = slurmcmd.answer(args["sinfo"])
        for key in ("partitions", "associations"):  # what the user may ask Slurm for
            if args.get(key):
                out[key] = slurmcmd.answer(args[key])
        if args.get("secrets_sweep"):
            if live is not None:
                out["secrets_sweep"] = runs.sweep_secrets(root, args["secrets_sweep"], live)
            else:
                out["secrets_sweep"] = {"error": out["squeue"]["error"]}
        if args.get("runtimes") is not None:
            out["runtimes"] = _runtimes(args["runtimes"])
    seen = set()
    sizes, counts = {}, {}

    def count(path):
        """(bytes, files) under ``path`` not counted yet: each inode once, folders too (a file quota
        counts every inode)."""
        total = files = 0
        for dirpath, dirs, names in os.walk(path):
            for name in dirs + names:
                with contextlib.suppress(OSError):
                    st = os.lstat(common.join(dirpath, name))
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                    files += 1
        return total, files

    def add(kind, found):
        sizes[kind] = sizes.get(kind, 0) + found[0]
        counts[kind] = counts.get(kind, 0) + found[1]

    for kind, folder, per_run in KINDS:
        if per_run:
            for r in rundir.all_run_ids(root):
                add(kind, count(common.under(rundir.run_path(root, r), folder)))
        else:
            add(kind, count(common.under(root, folder)))
    add("other", count(root))  # run records, scripts, caches, workspaces: whatever is left
    out.update(kinds=sizes, total=sum(sizes.values()), files=counts, files_total=sum(counts.values()))
    if args.get("sinfo"):
        out["images"] = _image_listing(root, live)
    if args.get("quota"):
        out["quota"] = quota.report(root)
    version = store.git_version()
    out["git"] = {
        "version": ".".join(str(v) for v in version) if version else None,
        "problem": store.git_problem(),
    }
    failed = store.background_gc_failure(root)
    if failed:
        out["git"]["background_gc_failed"] = failed  # a job's gc --auto: rv status shows it
    try:
        gc = runs_and_store_gc(dict(args, dry_run=True), live=live)
        out["gc"] = {"bytes_freed": gc["bytes_freed"], "files_freed": gc["files_freed"],
                     "runs": len(gc["runs_removed"]), "snapshots": len(gc["removed"]),
                     "objects": gc["objects_removed"]}  # fmt: skip
    except common.AgentError as exc:
        out["gc"] = {"error": str(exc)}
    out["work_ms"] = (time.time() - started) * 1000
    return out


def _image_listing(root, live):
    """rv status: each pulled image, its size, and the runs that name it."""
    using = images.runs_using(root, live)
    return [{"key": e["key"], "reference": e["meta"].get("reference"), "digest": e["meta"].get("digest"),
             "runtime": e["meta"].get("runtime"), "image": e["image"], "bytes": common.tree_bytes(
                 manifest.enc(e["path"]))[0], "last_used": e["last_used"], "runs": using.get(e["key"], [])}
            for e in images.list_images(root)]  # fmt: skip


def mode_gc(args):
    """``rv gc``: what runs, snapshots and objects left, then environments no live run uses."""
    report = runs_and_store_gc(args)
    root = common.root_path(args["root"])
    freed = Freed()
    in_use = envs.envs_in_use(root, args["squeue"], float(args.get("grace", 900)))
    removed, kept = envs.gc_envs(root, float(args["older_than"]), in_use, freed, bool(args.get("dry_run")))
    # Images: kept while a run gc keeps names one (as snapshots are), or used within --older-than.
    used = images.images_in_use(root, [k["run_id"] for k in report["runs_kept"]])
    images_removed, images_kept = images.gc_images(
        root, float(args["older_than"]), used, freed, bool(args.get("dry_run"))
    )
    report.update(envs_removed=removed, envs_kept=kept, images_removed=images_removed,
                  images_kept=images_kept, bytes_freed=report["bytes_freed"] + freed.bytes,
                  files_freed=report["files_freed"] + freed.files)  # fmt: skip
    return report
