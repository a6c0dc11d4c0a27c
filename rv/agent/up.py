"""``up``: ``rv up``'s job, submitted as ``run-submit`` does, then its watchdog for as long as rv is
there (it cancels the job when rv says so, goes quiet or goes away)."""

import os
import select
import sys
import time

from rv.agent import common, follow, layout, rundir, slurmcmd, submit


class _Input:
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
            raise common.Truncated()
        size = int(size)
        while len(self.buf) < size:
            if not self._fill(60.0):
                raise common.Truncated()
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
    root = common.root_path(args["root"])
    rdir = rundir.run_path(root, args["run_id"])
    stdin = _Input()
    secrets = stdin.sized()
    frames = follow.Frames()
    state = {"job": None, "done": False}  # done: released (or being), detached, or ended by itself

    def release():
        """Cancel the job, wait until it has left the queue, then tidy up after it; (gone, error)."""
        if not state["job"] or state["done"]:
            return True, None
        state["done"] = True
        code, _, err = slurmcmd.run_argv([*args["scancel"], state["job"]])
        if code != 0:
            # rv may be gone and never read this; the job's holder ends the job by itself once
            # this process's heartbeat stops.
            sys.stderr.write("rv up: scancel %s failed: %s\n" % (state["job"], err.strip()[-300:]))
        gone, error = _wait_gone(args["squeue"], state["job"], 60.0)
        if gone:
            _tidy_released(rdir)
        return gone, error

    try:
        result = submit.submit_run(args, secrets)
        state["job"] = job = result["job_id"]
        frames.send({"t": "submitted", "job_id": job, "previous_run_id": result.get("previous_run_id")})
        _watch_up(args, rdir, job, stdin, frames, state, release)
    finally:
        release()  # however this ends (rv went away, a signal, a broken pipe): unless done already
    return None


def _tidy_released(rdir):
    """What the job's EXIT trap does, for a job Slurm killed before its trap could finish (KillWait
    after scancel's TERM): its secrets and environment files go, and the run gets its end."""
    rundir.remove_secrets(rdir)
    rundir.remove_job_envs(rdir)
    if not os.path.exists(common.under(rdir, layout.ENDED)):
        rundir.end_run(rdir, "cancelled by rv up (its shell ended, or rv went away)", 1)


def _watch_up(args, rdir, job, stdin, frames, state, release):
    silence = float(args.get("silence", 60))
    env_file = common.under(rdir, layout.job_env(job))
    alive = common.under(rdir, layout.UP_ALIVE)
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
                common.write_atomic(common.under(rdir, layout.UP_DETACHED), ("%f\n" % now).encode(), 0o600)
                state["done"] = True
                frames.send({"t": "detached", "job_id": job})
                return
        if now - heard > silence:
            release()
            frames.send({"t": "lost", "job_id": job, "silence": silence})
            return
        if now >= next_beat:
            beats += 1
            common.write_atomic(alive, ("%d\n" % beats).encode(), 0o600)
            next_beat = now + 10.0
        if now >= next_poll:
            try:
                squeue = slurmcmd.live_jobs(args["squeue"]).get(job)
            except common.AgentError as exc:
                frames.send({"t": "warn", "msg": str(exc)})
                squeue = "?"
            if squeue is None:
                # Gone from the queue by itself (its setup failed, its time ran out, scancel): its
                # records say why. No cancel needed, nor possible.
                state["done"] = True
                time.sleep(1.0)  # shared filesystems show a job's last writes a moment late
                frames.send({"t": "ended", "job_id": job,
                             "record": common.read_json(common.under(rdir, layout.segment_file(1, "json"))),
                             "ended": common.read_json(common.under(rdir, layout.ENDED))})  # fmt: skip
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
            if job not in slurmcmd.live_jobs(squeue_argv):
                return True, None
            error = None
        except common.AgentError as exc:
            error = str(exc)  # asked again; told to rv if squeue never answers
        time.sleep(0.5)
    return False, error
