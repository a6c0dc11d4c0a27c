"""The cluster-side half of runs: agent modes that rv ships on every call, bundled with rv.remote_store.

One program (see :mod:`rv.agent_client`) holds both modules; this one adds its modes to the store's. Every
Slurm command it runs comes from the laptop as an argv built by :mod:`rv.slurm.commands` (``{user}``
stands for the login name), so this file writes no Slurm command text of its own.

Modes (ARGS is one JSON object; replies are zlib-compressed JSON, except ``follow``'s frames):

``run-check``   before anything is sent: is a run of this name live, what do the checkpoint folders
                hold (the run's own, and ``--from``'s)
``run-submit``  under the name's lock: the run's folder, its records, secrets (from stdin, 0600),
                the ``--from`` checkpoint, the name index, and ``sbatch`` of segment 1
``up``          ``rv up``: ``run-submit``, then the session's watchdog for as long as rv is there
                (it cancels the job when rv says so, goes quiet or goes away)
``runs``        run records and ``squeue`` (and ``sacct``) in one answer
``follow``      a run's output, segment after segment, from given offsets; with state frames; ends
                when the run ends (following) or when the logs are read (not following)
``run-stop``    ``STOP``, ``scancel``, the secrets gone, records for segments that never started
``sweep``       secrets of runs no job is alive for (a job killed hard could not remove them)
``gc``          what finished runs left, then snapshots and objects nothing references; the bytes
                freed are counted inode by inode as they go
``usage``       what rv keeps under the root, by kind, and what ``gc`` would free
``ckpt-ls``     a checkpoint folder: rv_train's ``step_<N>`` steps, sizes, times, which one resumes

Python 3.6 like the store (no dataclasses, no ``capture_output``, no postponed annotations).
"""

import contextlib
import fcntl
import json
import os
import pwd
import re
import select
import shutil
import stat
import struct
import subprocess
import sys
import time

from rv import remote_store as store

RUN_FILE = b"run.json"
ENDED = b"ENDED"
STOP = b"STOP"
SECRETS = b"secrets.env"
SCRIPT = b"job.sbatch"
PREEMPTED = b"PREEMPTED"
JOB_ENV = b"env.sh"  # jobs/<id>/env.sh: the job's environment, secrets included (rv.slurm.script)
_STEP = re.compile(r"^step_(\d+)$")
_JOB_ID = re.compile(r"^\d+(?:_\d+)?$")
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
POLL_S = 2.0  # how often a follower asks squeue


# -- small helpers ---------------------------------------------------------------------------------


def user_name():
    return pwd.getpwuid(os.getuid()).pw_name


def run_argv(argv, env=None, timeout=60, stdin_data=None):
    """(exit code, stdout, stderr) of ``argv``; 127 when the program is missing."""
    argv = [user_name() if word == "{user}" else word for word in argv]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
    except OSError as exc:
        return 127, "", "%s: %s" % (argv[0], exc.strerror)
    try:
        out, err = proc.communicate(stdin_data, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return 124, "", "%s did not answer within %d s" % (argv[0], timeout)
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


def read_text(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return None


def write_json(path, obj, mode=0o600):
    store.write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"), mode)


def runs_dir(root):
    return store.join(root, b"runs")


def run_path(root, run_id):
    if not re.match(r"^[A-Za-z0-9._-]+$", run_id) or run_id.startswith("."):
        raise store.AgentError("bad run id %r" % run_id, "usage")
    return store.join(runs_dir(root), store.enc(run_id))


def name_index(root, project, name):
    return store.join(root, b"names", store.enc(project), store.enc(name))


def live_jobs(squeue_argv):
    """{job id: squeue line} of the user's queued and running jobs; raises when squeue fails."""
    code, out, err = run_argv(squeue_argv)
    if code != 0:
        raise store.AgentError(squeue_failure(code, err), "squeue")
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


# -- a run as its records say --------------------------------------------------------------------


def segments(rdir):
    """[{segment, job_id, record}] in order: seg/<k>.job names the job, seg/<k>.json is its record."""
    seg_dir = store.join(rdir, b"seg")
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(seg_dir):
            stem, _, ext = name.partition(b".")
            if stem.isdigit() and ext in (b"job", b"json"):
                found.setdefault(int(stem), {})
    out = []
    for k in sorted(found):
        job = read_text(store.join(seg_dir, b"%d.job" % k))
        record = read_json(store.join(seg_dir, b"%d.json" % k))
        if job is None and record:
            job = record.get("job_id")
        out.append({"segment": k, "job_id": job, "record": record})
    return out


def run_info(root, run_id):
    rdir = run_path(root, run_id)
    meta = read_json(store.join(rdir, RUN_FILE))
    if meta is None:
        return None
    return {
        "run_id": run_id,
        "meta": meta,
        "segments": segments(rdir),
        "ended": read_json(store.join(rdir, ENDED)),
        "stop": os.path.exists(store.join(rdir, STOP)),
        "secrets": os.path.exists(store.join(rdir, SECRETS)),
    }


def current_job(info):
    segs = info["segments"]
    return segs[-1]["job_id"] if segs else None


def all_run_ids(root):
    try:
        names = os.listdir(runs_dir(root))
    except OSError:
        return []
    return sorted(store.dec(n) for n in names if not n.startswith(b"."))


def checkpoint_listing(path):
    """rv_train's layout (step_<N>/COMPLETE) or any files: what a checkpoint folder holds."""
    out = {"exists": os.path.isdir(path), "steps": [], "files": 0, "bytes": 0, "marker": None}
    if not out["exists"]:
        return out
    for name in sorted(os.listdir(path)):
        full = store.join(path, name)
        text = store.dec(name)
        m = _STEP.match(text)
        size, mtime = tree_bytes(full)
        out["bytes"] += size
        if m and os.path.isdir(full):
            out["steps"].append(
                {
                    "step": int(m.group(1)),
                    "name": text,
                    "complete": os.path.isfile(store.join(full, b"COMPLETE")),
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
                st = os.lstat(store.join(dirpath, name))
                total += st.st_blocks * 512
                newest = max(newest, st.st_mtime)
    return total, newest


# -- run-check and run-submit ----------------------------------------------------------------------


def _live_run_of_name(root, project, name, squeue_argv):
    """(run id, live job id) of the newest run of this name, the job None when nothing of it is live."""
    run_id = read_text(name_index(root, project, name))
    if not run_id:
        return None, None
    info = run_info(root, run_id)
    if info is None or info["ended"] is not None:
        return run_id, None
    job = current_job(info)
    if job and job in live_jobs(squeue_argv):
        return run_id, job
    return run_id, None


def _resolve_from(root, project, ref):
    """The checkpoint folder of RUN in ``--from RUN``: a run name of this project, a run id, a job id."""
    if re.match(r"^[A-Za-z0-9._-]+$", ref) and os.path.isdir(
        store.join(root, b"checkpoints", store.enc(project), store.enc(ref))
    ):
        return {"project": project, "name": ref}
    for run_id in all_run_ids(root):
        info = run_info(root, run_id)
        if info is None:
            continue
        jobs = [s["job_id"] for s in info["segments"]]
        if run_id == ref or ref in jobs:
            return {"project": info["meta"]["project"], "name": info["meta"]["name"]}
    raise store.AgentError(
        "no run %r with checkpoints here (by name in this project, run id or job id)" % ref, "not-found"
    )


def mode_run_check(args):
    root = store.root_path(args["root"])
    project, name = args["project"], args["name"]
    run_id, live = _live_run_of_name(root, project, name, args["squeue"])
    out = {
        "name_run_id": run_id,
        "live": live,
        "checkpoint": checkpoint_listing(
            store.join(root, b"checkpoints", store.enc(project), store.enc(name))
        ),
    }
    if args.get("from"):
        src = _resolve_from(root, project, args["from"])
        path = store.join(root, b"checkpoints", store.enc(src["project"]), store.enc(src["name"]))
        out["from"] = dict(src, checkpoint=checkpoint_listing(path))
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
    store.makedirs(dst, 0o700)
    for name in os.listdir(src):
        if name in skip:
            continue
        s, d = store.join(src, name), store.join(dst, name)
        if os.path.islink(s):
            os.symlink(os.readlink(s), d)
        elif os.path.isdir(s):
            kinds |= _clone_tree(s, d)
        else:
            kinds.add(_clone_file(s, d))
    return kinds


def _start_from(root, spec, dest):
    """Fill the new run's empty checkpoint folder ``dest`` from ``spec`` (--from RUN[@STEP])."""
    src = store.join(root, b"checkpoints", store.enc(spec["project"]), store.enc(spec["name"]))
    listing = checkpoint_listing(src)
    if os.path.isdir(dest) and os.listdir(dest):
        raise store.AgentError(
            "the new run's checkpoint folder %s is not empty: --from needs a run name of its own"
            % store.dec(dest),
            "usage",
        )
    step = spec.get("step")
    if listing["steps"]:
        complete = [s for s in listing["steps"] if s["complete"] and (step is None or s["step"] <= step)]
        if not complete:
            raise store.AgentError(
                "run %s has no complete checkpoint%s"
                % (spec["name"], "" if step is None else " at or before step %d" % step),
                "not-found",
            )
        chosen = complete[-1]
        kinds = _clone_tree(
            store.join(src, store.enc(chosen["name"])), store.join(dest, store.enc(chosen["name"]))
        )
        return {"step": chosen["step"], "how": sorted(kinds)}
    if step is not None:
        raise store.AgentError(
            "run %s's checkpoints are not in rv_train's step_<N> layout: use --from %s without @STEP"
            % (spec["name"], spec["name"]),
            "usage",
        )
    kinds = _clone_tree(src, dest, skip=(PREEMPTED,))
    return {"step": None, "how": sorted(kinds)}


def mode_run_submit(args):
    secrets = sys.stdin.buffer.read() if args.get("has_secrets") else None
    return _submit(args, secrets)


def _submit(args, secrets):
    root = store.root_path(args["root"])
    run_id, project, name = args["run_id"], args["project"], args["name"]
    rdir = run_path(root, run_id)
    lock_path = name_index(root, project, name) + b".lock"
    with store.lock(lock_path, "rv run %s" % name, wait=30):
        previous, live = _live_run_of_name(root, project, name, args["squeue"])
        if live:
            raise store.AgentError("run %s is still live (job %s)" % (name, live), "live")
        ckpt = store.join(root, b"checkpoints", store.enc(project), store.enc(name))
        made_ckpt = not os.path.exists(ckpt)
        store.makedirs(store.join(rdir, b"seg"), 0o700)
        store.makedirs(store.join(rdir, b"logs"), 0o700)
        try:
            result = {}
            if secrets is not None:
                # Created 0600 before a byte is written: never readable by others, even for a moment.
                store.write_atomic(store.join(rdir, SECRETS), secrets, 0o600)
            store.write_atomic(store.join(rdir, SCRIPT), args["script"].encode("utf-8"), 0o700)
            write_json(store.join(rdir, RUN_FILE), dict(args["meta"], run_id=run_id, created=time.time()))
            if args.get("from"):
                result["from"] = _start_from(root, args["from"], ckpt)
            env = dict(os.environ, RV_SEGMENT="1")
            code, out, err = run_argv(args["sbatch"], env=env)
            if code != 0:
                lines = [line for line in err.strip().splitlines() if line.strip()]
                raise store.AgentError(
                    "sbatch rejected the job: %s" % (" / ".join(lines[-3:]) or "exit %d" % code), "sbatch"
                )
            job = out.strip().splitlines()[-1].split(";")[0].strip()
            store.write_atomic(store.join(rdir, b"seg", b"1.job"), (job + "\n").encode(), 0o600)
            index = name_index(root, project, name)
            store.makedirs(os.path.dirname(index), 0o700)
            store.write_atomic(index, (run_id + "\n").encode(), 0o600)
        except BaseException:
            # Nothing half-made stays behind: the run's folder, and a checkpoint folder made for it.
            shutil.rmtree(rdir, ignore_errors=True)
            if made_ckpt:
                shutil.rmtree(ckpt, ignore_errors=True)
            raise
    result.update(job_id=job, previous_run_id=previous)
    return result


# -- up: an interactive session's watchdog ----------------------------------------------------------


UP_ALIVE = b"up.alive"  # the watchdog's heartbeat counter, read by the job's holder
UP_DETACHED = b"up.detached"  # rv up --detach: the holder keeps the allocation without a watchdog


class _Input(object):
    """rv's side of stdin, read without blocking past a timeout: sized data first, then lines."""

    def __init__(self):
        self.buf = b""
        self.eof = False

    def _fill(self, timeout):
        if self.eof:
            return False
        ready, _, _ = select.select([0], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(0, 65536)
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def line(self, timeout):
        """The next line (without its newline); None after ``timeout`` s; "" at the end of input."""
        deadline = time.time() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return ""
            if not self._fill(max(0.0, deadline - time.time())) and not self.eof:
                return None
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8", "replace").strip() or None

    def sized(self):
        """``<n>\\n`` then n bytes (the secrets); None for n = 0. Raises Truncated at an early end."""
        size = self.line(60.0)
        if size is None or size == "" or not size.isdigit():
            raise store.Truncated()
        size = int(size)
        while len(self.buf) < size:
            if not self._fill(60.0):
                raise store.Truncated()
        data, self.buf = self.buf[:size], self.buf[size:]
        return data or None


def mode_up(args):
    """``rv up``: submit the session's job, then watch over it for as long as rv is there.

    stdin: the secrets (``<n>\\n`` and n bytes), then one line at a time from rv: ``hb`` (still
    here, every few seconds), ``release`` (the shell exited: cancel the job) or ``detach`` (keep it).
    Frames on stdout, as ``follow`` writes them: ``submitted``, ``state`` (the job's squeue line, on
    every poll), ``ready`` (the job wrote its environment file: a shell may start), ``ended`` (it
    ended by itself), ``released`` / ``detached``.

    The allocation must never outlive rv: the end of stdin (rv exited, was killed, or its connection
    dropped: sshd closes the channel), silence for ``silence`` seconds (a connection that died without
    closing), and any way this process ends (SIGHUP, SIGTERM, a write to a closed stdout) cancel the
    job, unless rv said ``detach``. The job's holder ends it too when this process's heartbeat
    (``up.alive`` in the run's folder, a counter) stops moving: a login node that went down.
    """
    root = store.root_path(args["root"])
    rdir = run_path(root, args["run_id"])
    stdin = _Input()
    secrets = stdin.sized()
    frames = Frames()
    state = {"job": None, "done": False}  # done: released (or being), detached, or ended by itself

    def release():
        """Cancel the job, wait until it has left the queue, then tidy up after it; (gone, error)."""
        if not state["job"] or state["done"]:
            return True, None
        state["done"] = True
        code, _, err = run_argv([*args["scancel"], state["job"]])
        if code != 0:
            # rv may be gone and never read this; the job's holder ends the job by itself once
            # this process's heartbeat stops.
            sys.stderr.write("rv up: scancel %s failed: %s\n" % (state["job"], err.strip()[-300:]))
        gone, error = _wait_gone(args["squeue"], state["job"], 60.0)
        if gone:
            _tidy_released(rdir)
        return gone, error

    try:
        result = _submit(args, secrets)
        state["job"] = job = result["job_id"]
        frames.send({"t": "submitted", "job_id": job, "previous_run_id": result.get("previous_run_id")})
        _watch_up(args, rdir, job, stdin, frames, state, release)
    finally:
        release()  # however this ends (rv went away, a signal, a broken pipe): unless done already
    return None


def _tidy_released(rdir):
    """What the job's EXIT trap does, for a job Slurm killed before its trap could finish (KillWait
    after scancel's TERM): its secrets and environment files go, and the run gets its end."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(store.join(rdir, SECRETS))
    _remove_job_envs(rdir)
    if not os.path.exists(store.join(rdir, ENDED)):
        _end_run(rdir, "cancelled by rv up (its shell ended, or rv went away)", 1)


def _watch_up(args, rdir, job, stdin, frames, state, release):
    silence = float(args.get("silence", 60))
    env_file = store.join(rdir, b"jobs", store.enc(job), JOB_ENV)
    alive = store.join(rdir, UP_ALIVE)
    heard, beats, next_beat, next_poll, ready = time.time(), 0, 0.0, 0.0, False
    while True:
        line = stdin.line(0.5)
        now = time.time()
        if line == "":
            release()  # rv went away: exited, killed, or its connection closed
            return
        if line is not None:
            heard = now
            if line == "release":
                gone, error = release()
                frames.send({"t": "released", "job_id": job, "gone": gone, "error": error})
                return
            if line == "detach":
                store.write_atomic(store.join(rdir, UP_DETACHED), ("%f\n" % now).encode(), 0o600)
                state["done"] = True
                frames.send({"t": "detached", "job_id": job})
                return
        if now - heard > silence:
            release()
            frames.send({"t": "lost", "job_id": job, "silence": silence})
            return
        if now >= next_beat:
            beats += 1
            store.write_atomic(alive, ("%d\n" % beats).encode(), 0o600)
            next_beat = now + 10.0
        if now >= next_poll:
            try:
                squeue = live_jobs(args["squeue"]).get(job)
            except store.AgentError as exc:
                frames.send({"t": "warn", "msg": str(exc)})
                squeue = "?"
            if squeue is None:
                # Gone from the queue by itself (its setup failed, its time ran out, scancel): its
                # records say why. No cancel needed, nor possible.
                state["done"] = True
                time.sleep(1.0)  # shared filesystems show a job's last writes a moment late
                frames.send({"t": "ended", "job_id": job,
                             "record": read_json(store.join(rdir, b"seg", b"1.json")),
                             "ended": read_json(store.join(rdir, ENDED))})  # fmt: skip
                return
            if squeue != "?":
                frames.send({"t": "state", "job_id": job, "squeue": squeue})
            if not ready and squeue != "?" and os.path.exists(env_file):
                ready = True
                frames.send({"t": "ready", "job_id": job, "squeue": squeue})
            next_poll = now + (1.0 if not ready else 5.0)
        frames.beat()


def _wait_gone(squeue_argv, job, timeout):
    """(True, None) once ``job`` has left the queue (its allocation released) within ``timeout`` s;
    else (False, squeue's last error or None)."""
    deadline, error = time.time() + timeout, None
    while time.time() < deadline:
        try:
            if job not in live_jobs(squeue_argv):
                return True, None
            error = None
        except store.AgentError as exc:
            error = str(exc)  # asked again; told to rv if squeue never answers
        time.sleep(0.5)
    return False, error


# -- runs ------------------------------------------------------------------------------------------


def mode_runs(args):
    """Run records, chosen by id, name, job id, recency or liveness; with squeue (and sacct) text."""
    root = store.root_path(args["root"])
    out = {"runs": [], "now": time.time()}
    code, text, err = run_argv(args["squeue"])
    out["squeue"] = {"text": text, "error": None if code == 0 else (err.strip() or "exit %d" % code)}
    if args.get("sacct"):
        out["sacct"] = answer(args["sacct"])
    if args.get("sweep"):
        # The session's secrets sweep rides along on this call: no second round trip.
        out["sweep"] = sweep_runs(root, args["sweep"], jobs_of(text)) if code == 0 else {
            "error": squeue_failure(code, err)}  # fmt: skip
    out["runs"] = select_runs(root, args)
    return out


def select_runs(root, args):
    """The runs ``args`` asks for (``ids``, ``names``, ``any_names``, ``job_ids``, ``live``,
    ``since``), as :func:`run_info` dicts in run id order."""
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
        meta = read_json(store.join(rdir, RUN_FILE))
        if meta is None:
            continue
        ended = read_json(store.join(rdir, ENDED))
        wanted = (
            run_id in ids
            or (meta.get("project"), meta.get("name")) in names
            or meta.get("name") in any_names
            or (args.get("live") and ended is None)
            or (
                since is not None
                and (meta.get("created", 0) >= since or (ended or {}).get("end", 0) >= since)
            )
        )
        if not wanted and not job_ids:
            continue
        info = run_info(root, run_id)
        if info is None:
            continue
        if wanted or job_ids & set(seg["job_id"] for seg in info["segments"]):
            found.append(info)
    return found


# -- follow ----------------------------------------------------------------------------------------


class Frames:
    """Framed output: 4-byte header length, 4-byte data length, a JSON header, then the data."""

    BEAT_S = 10.0  # a frame at least this often, so rv can tell a silent connection from a quiet job

    def __init__(self):
        self.out = sys.stdout.buffer
        self.last = time.time()

    def send(self, header, data=b""):
        head = json.dumps(header).encode("utf-8")
        self.out.write(struct.pack(">II", len(head), len(data)) + head + data)
        self.out.flush()
        self.last = time.time()

    def beat(self):
        if time.time() - self.last > self.BEAT_S:
            self.send({"t": "beat"})


def _client_gone(timeout):
    """Wait up to ``timeout`` s on stdin; True once it is closed (rv went away: stop at once)."""
    ready, _, _ = select.select([0], [], [], timeout)
    if not ready:
        return False
    try:
        return os.read(0, 4096) == b""
    except OSError:
        return True


def _segment_files(rdir, job, streams, node):
    """Log files of one job: the batch log, and per-node logs of a multi-node job."""
    logs = store.join(rdir, b"logs")
    try:
        names = os.listdir(logs)
    except OSError:
        names = []
    files = []
    for stream in streams:
        batch = ("%s.%s" % (job, stream)).encode()
        if node is None:
            files.append((batch, stream))
        per_node = sorted(n for n in names if re.match(("^%s-node(\\d+)\\.%s$" % (job, stream)).encode(), n))
        for n in per_node:
            index = int(re.match(rb"^\d+(?:_\d+)?-node(\d+)", n).group(1))
            if node is None or index == node:
                files.append((n, stream))
    return [(store.join(logs, n), s) for n, s in files]


def _tail_offset(path, lines):
    """The offset where the last ``lines`` lines of ``path`` begin."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    with open(path, "rb") as fh:
        pos, seen = size, -1
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step)
            for i in range(len(block) - 1, -1, -1):
                if block[i] == 10:
                    seen += 1
                    if seen == lines:
                        return pos + i + 1
        return 0


def _pump(frames, files, offsets, segment):
    """Send what is new in ``files`` from ``offsets``; True when anything was sent."""
    sent = False
    for path, stream in files:
        key = store.dec(path)
        offset = offsets.get(key, 0)
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(1 << 16)
        except OSError:
            continue
        if data:
            frames.send({"t": "data", "f": key, "o": offset, "s": stream, "seg": segment}, data)
            offsets[key] = offset + len(data)
            sent = True
    return sent


def _drain(frames, rdir, job, streams, node, offsets, segment, settle):
    if settle:
        time.sleep(1.0)  # shared filesystems show a job's last writes a moment late
    files = _segment_files(rdir, job, streams, node)
    while _pump(frames, files, offsets, segment):
        pass


def mode_follow(args):
    """Stream a run's logs from ``offsets``, segment by segment; with ``follow``, until it ends.

    Given ``find`` (``runs``' selectors) instead of ``run_id``, the follower first finds the run
    (the newest that matches) and sends it in a ``run`` frame, with the ``sweep`` of the session:
    `rv logs` is then one call to the cluster. With ``tail`` and no ``segment``, that is the last
    segment only.
    """
    root = store.root_path(args["root"])
    frames = Frames()
    only = args.get("segment")
    if args.get("find") is not None:
        head = {"t": "run", "run": None}
        if args.get("sweep"):
            try:
                head["sweep"] = sweep_runs(root, args["sweep"], live_jobs(args["squeue"]))
            except store.AgentError as exc:
                head["sweep"] = {"error": str(exc)}
        found = select_runs(root, args["find"])
        if found:
            head["run"] = max(found, key=lambda info: float(info["meta"].get("created") or 0))
            segs = head["run"]["segments"]
            if only is None and args.get("tail") is not None and segs:
                only = segs[-1]["segment"]
        head["segment"] = only  # which segment alone is shown (None: all), for a reconnect to ask again
        frames.send(head)
        if head["run"] is None:
            return None
        run_id = head["run"]["run_id"]
    else:
        run_id = args["run_id"]
    rdir = run_path(root, run_id)
    streams = args.get("streams") or ["out", "err"]
    node = args.get("node")
    follow = bool(args.get("follow"))
    offsets = dict(args.get("offsets") or {})
    k = int(args.get("from_segment") or only or 1)
    backoff, next_poll, last_state = POLL_S, 0.0, None
    while True:
        segs = {s["segment"]: s for s in segments(rdir)}
        seg = segs.get(k)
        if seg is None or not seg["job_id"]:
            ended = read_json(store.join(rdir, ENDED))
            if ended is not None or not follow or only:
                frames.send({"t": "end", "ended": ended, "segment": k - 1})
                return None
            frames.beat()
            if _client_gone(1.0):
                return None
            continue
        job = seg["job_id"]
        if args.get("tail") is not None and not offsets:
            for path, _ in _segment_files(rdir, job, streams, node):
                offsets[store.dec(path)] = _tail_offset(path, int(args["tail"]))
        frames.send({"t": "segment", "segment": k, "job_id": job, "record": seg["record"]})
        while follow:
            files = _segment_files(rdir, job, streams, node)
            if _pump(frames, files, offsets, k):
                continue
            now = time.time()
            if now >= next_poll:
                try:
                    line = live_jobs(args["squeue"]).get(job)
                    backoff = POLL_S
                    next_poll = now + POLL_S
                except store.AgentError as exc:
                    # Never a reason to stop following: say so, ask again later.
                    frames.send({"t": "warn", "msg": str(exc), "retry_in": backoff})
                    next_poll = now + backoff
                    backoff = min(backoff * 2, 30.0)
                    line = "?"
                if line is None:
                    break  # the job is no longer queued or running: drain, then its record
                if line != "?" and line != last_state:
                    frames.send({"t": "state", "segment": k, "job_id": job, "squeue": line})
                    last_state = line
            frames.beat()
            if _client_gone(0.2):
                return None
        _drain(frames, rdir, job, streams, node, offsets, k, settle=follow)
        record = read_json(store.join(rdir, b"seg", b"%d.json" % k))
        frames.send({"t": "segment-end", "segment": k, "job_id": job, "record": record})
        if only:
            frames.send({"t": "end", "ended": read_json(store.join(rdir, ENDED)), "segment": k})
            return None
        k += 1
        if follow:
            # The job is gone from the queue; its EXIT trap wrote the next segment or ENDED just before.
            deadline = time.time() + 30
            while not os.path.exists(store.join(rdir, b"seg", b"%d.job" % k)):
                if os.path.exists(store.join(rdir, ENDED)) or time.time() > deadline:
                    frames.send({"t": "end", "ended": read_json(store.join(rdir, ENDED)), "segment": k - 1})
                    return None
                frames.beat()
                if _client_gone(0.5):
                    return None


# -- stop and sweep ---------------------------------------------------------------------------------


def _end_run(rdir, reason, segment):
    """ENDED for a run whose jobs could not write it; records for segments that never started."""
    for seg in segments(rdir):
        if seg["record"] is None:
            write_json(
                store.join(rdir, b"seg", b"%d.json" % seg["segment"]),
                {"segment": seg["segment"], "job_id": seg["job_id"], "state": "ended", "reason": reason,
                 "exit_code": None, "start": None, "end": time.time()},
            )  # fmt: skip
    if not os.path.exists(store.join(rdir, ENDED)):
        write_json(store.join(rdir, ENDED), {"reason": reason, "exit_code": None, "segment": segment,
                                             "end": time.time()})  # fmt: skip


def _remove_job_envs(rdir):
    """The jobs' environment files (they hold the secrets) of a run no job of which is alive, or that
    is being stopped; each job removes its own as it ends, unless it was killed too hard to."""
    jobs = store.join(rdir, b"jobs")
    for job in os.listdir(jobs) if os.path.isdir(jobs) else []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store.join(jobs, job, JOB_ENV))


def mode_run_stop(args):
    root = store.root_path(args["root"])
    out = []
    for run_id in args["ids"]:
        rdir = run_path(root, run_id)
        info = run_info(root, run_id)
        if info is None:
            out.append({"run_id": run_id, "error": "no such run"})
            continue
        store.write_atomic(store.join(rdir, STOP), ("%f\n" % time.time()).encode(), 0o600)
        # After STOP: a segment submitting its successor now sees STOP and cancels it itself.
        info = run_info(root, run_id)
        pending = [s for s in info["segments"] if (s["record"] or {}).get("state") != "ended" and s["job_id"]]
        ids = [s["job_id"] for s in pending]
        error = None
        if ids:
            code, _, err = run_argv(list(args["scancel"]) + ids)
            if code != 0 and "Invalid job id" not in err:
                error = err.strip()[-300:] or "scancel exit %d" % code
        secrets = store.join(rdir, SECRETS)
        removed = os.path.exists(secrets)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(secrets)
        _remove_job_envs(rdir)
        never_started = [s for s in pending if s["record"] is None]
        if never_started and len(never_started) == len(pending):
            _end_run(rdir, "cancelled by rv stop before it started", never_started[-1]["segment"])
        out.append({"run_id": run_id, "cancelled": ids, "secrets_removed": removed, "error": error})
    return {"stopped": out}


def mode_sweep(args):
    """Secrets of runs no job is alive for: removed, and ENDED written where the job could not."""
    return sweep_runs(store.root_path(args["root"]), args["ids"], live_jobs(args["squeue"]))


def sweep_runs(root, ids, live):
    """``sweep`` for ``ids`` given the live jobs; also done inside ``runs`` and ``usage`` calls."""
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
                os.unlink(store.join(rdir, SECRETS))
            out["removed"].append(run_id)
        _remove_job_envs(rdir)
        if info["ended"] is None:
            segs = info["segments"]
            _end_run(rdir, "ended without a record (cancelled or killed before it could write one)",
                     segs[-1]["segment"] if segs else 0)  # fmt: skip
            out["ended"].append(run_id)
    return out


# -- gc and usage ----------------------------------------------------------------------------------


class Freed:
    """Bytes a removal frees, counted from the filesystem itself as paths go.

    A file's blocks are freed when its last link goes: each inode is counted once all the links it
    had were removed here (a snapshot's hard links into objects/ free nothing until the object goes).
    Folders cannot be hard-linked: their blocks count when they go.
    """

    def __init__(self):
        self.inodes = {}
        self.dir_bytes = 0

    def note(self, path):
        for dirpath, dirs, files in os.walk(path) if os.path.isdir(path) and not os.path.islink(path) else []:
            for name in files + [d for d in dirs if os.path.islink(store.join(dirpath, d))]:
                self._file(store.join(dirpath, name))
            for d in dirs:
                p = store.join(dirpath, d)
                if not os.path.islink(p):
                    with contextlib.suppress(OSError):
                        self.dir_bytes += os.lstat(p).st_blocks * 512
        if os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):
                self.dir_bytes += os.lstat(path).st_blocks * 512
        else:
            self._file(path)

    def _file(self, path):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            entry = self.inodes.setdefault((st.st_dev, st.st_ino), [st.st_blocks * 512, st.st_nlink, 0])
            entry[2] += 1

    @property
    def bytes(self):
        return self.dir_bytes + sum(size for size, links, seen in self.inodes.values() if seen >= links)


def _run_last_activity(rdir, info):
    ended = info["ended"]
    if ended and ended.get("end"):
        return float(ended["end"])
    return max(tree_bytes(rdir)[1], float(info["meta"].get("created", 0)))


def plan_gc(root, args, live):
    """(runs to remove, runs kept with why, names whose checkpoints/outputs may go)."""
    now = time.time()
    older_than, grace = float(args["older_than"]), float(args.get("grace", 900))
    remove_runs, kept = [], []
    kept_names = set()
    for run_id in all_run_ids(root):
        rdir = run_path(root, run_id)
        info = run_info(root, run_id)
        if info is None:
            # A folder without run.json: a submission in progress, or one that died: by age only.
            if now - tree_bytes(rdir)[1] > max(older_than, grace):
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
                {"run_id": run_id, "name": meta.get("name"), "why": "ended %s ago" % store.human_age(age)}
            )
            kept_names.add(key)
        else:
            remove_runs.append((run_id, info))
    return remove_runs, kept, kept_names


def mode_gc(args, live=None):
    root = store.root_path(args["root"])
    dry = bool(args.get("dry_run"))
    older_than = float(args["older_than"])
    if live is None:
        live = live_jobs(args["squeue"])  # if squeue fails, nothing is removed
    freed = Freed()
    report = {"dry_run": dry, "runs_removed": [], "runs_kept": [], "checkpoints_removed": [],
              "outputs_removed": [], "warnings": []}  # fmt: skip
    remove_runs, kept, kept_names = plan_gc(root, args, live)
    report["runs_kept"] = kept
    in_use = set()
    for entry in kept:
        meta = (run_info(root, entry["run_id"]) or {}).get("meta") or {}
        if meta.get("snapshot"):
            in_use.add(meta["snapshot"])
    for run_id, info in remove_runs:
        meta = (info or {}).get("meta") or {}
        before = freed.bytes
        store.remove_counted(run_path(root, run_id), freed, dry)
        report["runs_removed"].append(
            {"run_id": run_id, "name": meta.get("name"), "bytes": freed.bytes - before,
             "reason": ((info or {}).get("ended") or {}).get("reason")}
        )  # fmt: skip
        index = name_index(root, meta.get("project", ""), meta.get("name", "")) if meta else None
        if index and read_text(index) == run_id:
            store.remove_counted(index, freed, dry)
    if args.get("checkpoints"):
        now = time.time()
        for kind, report_key in ((b"checkpoints", "checkpoints_removed"), (b"outputs", "outputs_removed")):
            base = store.join(root, kind)
            for project in sorted(os.listdir(base)) if os.path.isdir(base) else []:
                for name in sorted(os.listdir(store.join(base, project))):
                    key = (store.dec(project), store.dec(name))
                    path = store.join(base, project, name)
                    newest = tree_bytes(path)[1]
                    if key in kept_names or now - newest < older_than:
                        continue
                    before = freed.bytes
                    store.remove_counted(path, freed, dry)
                    report[report_key].append(
                        {"project": key[0], "name": key[1], "bytes": freed.bytes - before}
                    )
    store_report = store.collect_garbage(root, in_use, args, freed, dry)
    report.update(store_report)
    report["bytes_freed"] = freed.bytes
    return report


# (kind, folder under the root, or under each run's folder). Objects first: a snapshot's files are
# hard links to them, so snapshots count only their own folders and manifests.
KINDS = (
    ("objects", b"objects", False),
    ("snapshots", b"snapshots", False),
    ("work dirs", b"work", True),
    ("logs", b"logs", True),
    ("checkpoints", b"checkpoints", False),
    ("outputs", b"outputs", False),
    ("environments", b"envs", False),
)


def mode_usage(args):
    """Bytes on disk by kind (each inode counted once, objects first), and what gc would free.

    With ``sinfo`` (`rv status`), all the rest of what status shows, in this one call: the login
    name, ``squeue`` (also gc's live jobs) and ``sinfo`` text, the ``sweep`` of the session, and
    ``work_ms``, the time spent here (rv reports the rest of the call as the round trip).
    """
    started = time.time()
    root = store.root_path(args["root"])
    out = {}
    live = None
    if args.get("sinfo"):
        out["user"] = user_name()
        code, text, err = run_argv(args["squeue"])
        out["squeue"] = {"text": text, "error": None if code == 0 else squeue_failure(code, err)}
        if code == 0:
            live = jobs_of(text)
        out["sinfo"] = answer(args["sinfo"])
        if args.get("sweep"):
            out["sweep"] = sweep_runs(root, args["sweep"], live) if live is not None else {
                "error": out["squeue"]["error"]}  # fmt: skip
    seen = set()
    sizes = {}

    def count(path):
        total = 0
        for dirpath, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    st = os.lstat(store.join(dirpath, name))
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total

    for kind, folder, per_run in KINDS:
        if per_run:
            sizes[kind] = sum(count(store.join(run_path(root, r), folder)) for r in all_run_ids(root))
        else:
            sizes[kind] = count(store.join(root, folder))
    sizes["other"] = count(root)  # run records, scripts, caches, workspaces: whatever is left
    out.update(kinds=sizes, total=sum(sizes.values()))
    try:
        gc = mode_gc(dict(args, dry_run=True), live=live)
        out["gc"] = {"bytes_freed": gc["bytes_freed"], "runs": len(gc["runs_removed"]),
                     "snapshots": len(gc["removed"]), "objects": gc["objects_removed"]}  # fmt: skip
    except store.AgentError as exc:
        out["gc"] = {"error": str(exc)}
    out["work_ms"] = (time.time() - started) * 1000
    return out


def mode_ckpt_ls(args):
    root = store.root_path(args["root"])
    return checkpoint_listing(
        store.join(root, b"checkpoints", store.enc(args["project"]), store.enc(args["name"]))
    )


store.MODES.update(
    {
        "run-check": mode_run_check,
        "run-submit": mode_run_submit,
        "up": mode_up,
        "runs": mode_runs,
        "follow": mode_follow,
        "run-stop": mode_run_stop,
        "sweep": mode_sweep,
        "gc": mode_gc,
        "usage": mode_usage,
        "ckpt-ls": mode_ckpt_ls,
    }
)
