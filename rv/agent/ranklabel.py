#!/usr/bin/env python3
"""rv's rank labeller: runs one process of a job and writes its output line by line, each line with
its rank in front (``[3] loss=0.25``), so the lines of ranks that share a log never join.

The job script writes this file into the job's folder and uses it two ways:

``rank-label.py ARGS...``
    as torchrun's ``PYTHON_EXEC`` (accelerate launch goes through torchrun too): torchrun runs
    ``$PYTHON_EXEC -u train.py ...`` for every rank, so this runs the real Python with ARGS. The real
    Python is the user's own ``PYTHON_EXEC`` when there was one (``RV_PYTHON_EXEC``), else the one the
    launcher itself runs on (argv[0] of the parent, as CPython finds ``sys.executable``). The label is
    ``$RANK``, which torchrun sets per worker.
``rank-label.py --exec [--label N] PROGRAM ARGS...``
    runs PROGRAM itself (``rv run --each-node``, ``torchrun --no-python``), labelled N (else ``$RANK``).

Why every line arrives whole, however long and however many ranks write at once: the program's
stdout and stderr are pipes that only this process reads. It cuts what arrives at newlines (and at
carriage returns, so a progress bar still shows live) and writes every finished piece, label in front,
with one ``write()`` to the log file, which is open with ``O_APPEND``: the kernel appends each such
write as a whole (one inode lock for the write) whatever its size, so another rank's line can only come
before or after it. A piece with no end yet waits for its end; one over 1 MiB is written as a line of
its own. When the log is not a file (a terminal, a pipe to ``srun``), ``RV_LOG_OUT`` / ``RV_LOG_ERR``
name the file to append to instead.

Signals: torchrun stops a worker with ``killpg``, and Slurm signals every process of a step, so the
program gets each signal directly. This process ignores them (it must outlive the program to pass on
its last lines) and the program starts with the dispositions this process was started with. It ends
as the program ended: the same exit code, or killed by the same signal.

Python 3.6, standard library only: it runs on the cluster with whatever ``python3`` the job has.
"""

import os
import re
import select
import signal
import stat
import subprocess
import sys

MAX_PIECE = 1 << 20  # a line with no end yet is written out at this size
READ = 1 << 16
_PIECE = re.compile(b"[^\r\n]*(?:\r\n|\n|\r)")
_HANDLED = [
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
]


def write_all(fd, data):
    """One write() for all of ``data`` (O_APPEND keeps it whole); more only if the kernel cut it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Labeller:
    """Turns a byte stream into whole labelled pieces written to ``fd``."""

    def __init__(self, fd, label):
        self.fd = fd
        self.label = label
        self.pending = b""

    def feed(self, data):
        self.pending += data
        # A "\r" as the very last byte may be the first half of "\r\n": it waits for the next byte.
        limit = len(self.pending) - 1 if self.pending.endswith(b"\r") else len(self.pending)
        end = max(self.pending.rfind(b"\n", 0, limit), self.pending.rfind(b"\r", 0, limit))
        if end < 0:
            if len(self.pending) >= MAX_PIECE:
                self.flush()
            return
        done, self.pending = self.pending[: end + 1], self.pending[end + 1 :]
        write_all(self.fd, b"".join(self.label + piece for piece in _PIECE.findall(done)))

    def flush(self):
        """What has no end yet, as a line of its own: the next rank's line must not join it."""
        if self.pending:
            rest, self.pending = self.pending, b""
            write_all(self.fd, self.label + rest + (b"" if rest.endswith(b"\n") else b"\n"))


def log_fd(fd, env_name):
    """Where labelled lines go: ``fd`` when it is a file; else the file ``$env_name`` names."""
    try:
        is_file = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        is_file = False
    path = os.environ.get(env_name)
    if is_file or not path:
        return fd
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def real_python():
    """The interpreter torchrun would have run: the user's PYTHON_EXEC, else the launcher's own."""
    own = os.environ.get("RV_PYTHON_EXEC")
    if own:
        return own
    try:
        with open("/proc/%d/cmdline" % os.getppid(), "rb") as fh:
            argv0 = fh.read().split(b"\0")[0].decode("utf-8", "surrogateescape")
    except OSError:
        argv0 = ""
    if "/" in argv0:
        # Relative to the launcher's folder, not ours (`.venv/bin/python -m torch.distributed.run`).
        try:
            return os.path.join(os.readlink("/proc/%d/cwd" % os.getppid()), argv0)
        except OSError:
            return os.path.abspath(argv0)
    if argv0:
        for folder in os.environ.get("PATH", "").split(os.pathsep):
            candidate = os.path.join(folder or ".", argv0)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    return sys.executable


def parse_args(argv):
    """(label text or None, argv of the program to run)."""
    label = os.environ.get("RANK")
    if argv[:1] != ["--exec"]:
        return label, [real_python()] + argv
    rest = argv[1:]
    if rest[:1] == ["--label"] and len(rest) > 1:
        label, rest = rest[1], rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        sys.stderr.write("rank-label.py: --exec needs a program to run\n")
        sys.exit(2)
    return label, rest


def child_env():
    """The program's environment as it would be without rv's labeller in between."""
    env = dict(os.environ)
    own = env.pop("RV_PYTHON_EXEC", None)
    if own:
        env["PYTHON_EXEC"] = own
    else:
        env.pop("PYTHON_EXEC", None)
    return env


def main(argv):
    label, program = parse_args(argv)
    if label is None:  # not a rank of a launcher: nothing to label, run it as it is
        env = child_env()
        os.execvpe(program[0], program, env)
    inherited = dict((s, signal.getsignal(s)) for s in _HANDLED)
    for s in _HANDLED:
        signal.signal(s, signal.SIG_IGN)

    def restore():
        for s, how in inherited.items():
            # Python's own SIGINT handler stands for "default" in the program that is started.
            signal.signal(s, how if how in (signal.SIG_IGN, signal.SIG_DFL) else signal.SIG_DFL)

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(
            program, stdout=out_w, stderr=err_w, env=child_env(), close_fds=False, preexec_fn=restore
        )
    except OSError as exc:
        sys.stderr.write("rank-label.py: cannot run %s: %s\n" % (program[0], exc))
        return 127
    os.close(out_w)
    os.close(err_w)
    tag = ("[%s] " % label).encode("utf-8", "replace")
    streams = {
        out_r: Labeller(log_fd(1, "RV_LOG_OUT"), tag),
        err_r: Labeller(log_fd(2, "RV_LOG_ERR"), tag),
    }
    running = True
    while streams:
        ready = select.select(list(streams), [], [], 0.5 if running else 0.2)[0]
        for fd in ready:
            data = os.read(fd, READ)
            if data:
                streams[fd].feed(data)
            else:
                streams.pop(fd).flush()
                os.close(fd)
        if running and proc.poll() is not None:
            running = False
        elif not running and not ready:
            # The program has ended and nothing more is waiting: a process it left behind may hold
            # the pipes open for ever, so stop here.
            break
    for labeller in streams.values():
        labeller.flush()
    code = proc.wait()
    if code < 0:  # end as the program ended: killed by the same signal
        try:
            signal.signal(-code, signal.SIG_DFL)  # ignored here (SIGPIPE by Python itself) or handled
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP cannot be changed, and need not be
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
