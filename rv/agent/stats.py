#!/usr/bin/env python3
"""What a run used, measured by its own job on every node: CPU time, peak memory, GPU samples.

Two sides, one format:

* On each node (the job's runtime, ``rv_task`` in rv/agent/job.sh, runs this file shipped as
  ``<root>/runtime/stats-<hash>.py``)::

      stats.py wrap DIR NODE -- COMMAND...

  runs COMMAND (the program) as its child and waits for it with ``wait4``: the child's rusage is
  the exact user + system CPU time of its whole process tree (every process that was waited for)
  and the largest resident set of any one of them (``ru_maxrss``). Meanwhile a thread samples,
  every ``RV_STATS_INTERVAL`` seconds (default :data:`INTERVAL_S`) and once more at the end, the
  tree's summed resident memory (``/proc``) and, where ``nvidia-smi`` exists and the job has GPUs,
  each GPU's utilization and memory. It writes ``DIR/NODE.json`` (the node's figures, rewritten at
  every sample and finally at the end, ``final: true``) and appends ``DIR/NODE.gpu.jsonl`` (one
  line per GPU sample). DIR is ``<run>/stats/<segment>``. The exit code is the child's (128+N for
  a signal, as bash says it).

  When every GPU of the node stays under :data:`IDLE_UTIL` % for ``RV_IDLE_GPU`` seconds (0: never),
  one line goes to stderr (the run's log) and, with ``RV_STATS_NOTIFY`` (the notifier's argv, as
  JSON), one message; once per idle stretch.

* On the login node, the agent (``runs`` with ``stats``: rv.agent.rundir.read_stats) gathers the
  node files of every segment for the laptop, which sums them up (rv.job.stats).

The wrapper ignores the signals Slurm and rv send (TERM, INT, HUP, QUIT, USR1, USR2) so that it
outlives the program to record its end, and gives the program the dispositions it had itself:
ignored, never *caught*, so rv's stop watcher (which signals only processes that catch the stop
signal) never takes it for the program.

Python 3.6, standard library only, imports nothing of rv: it runs with whatever ``python3`` the node
has.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

INTERVAL_S = 30.0
IDLE_UTIL = 5  # percent: a GPU under this is idle
NVSMI_TIMEOUT_S = 20
# The fields asked of nvidia-smi, in this order (documented in `nvidia-smi --help-query-gpu`).
GPU_FIELDS = ("index", "uuid", "name", "utilization.gpu", "memory.used", "memory.total")
MIB = 1024 * 1024
PASSED = ("TERM", "INT", "HUP", "QUIT", "USR1", "USR2")


# --- nvidia-smi -----------------------------------------------------------------------------------


def _num(text):
    """A number of nvidia-smi's, or None for [N/A], [Not Supported] and anything else."""
    try:
        return float(text)
    except ValueError:
        return None


def parse_gpus(text, visible=None):
    """GPU rows from ``--query-gpu=GPU_FIELDS --format=csv,noheader,nounits``: a list of dicts with
    index, uuid, name, util (percent or None), memory_used and memory_total (bytes or None).

    ``visible``: CUDA_VISIBLE_DEVICES. A node without device cgroups shows every GPU it has: keep
    those the job was given (by index or uuid) when that leaves any."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) != len(GPU_FIELDS) or not parts[0].isdigit():
            continue
        used, total = _num(parts[4]), _num(parts[5])
        rows.append({
            "index": int(parts[0]), "uuid": parts[1], "name": parts[2], "util": _num(parts[3]),
            "memory_used": int(used * MIB) if used is not None else None,
            "memory_total": int(total * MIB) if total is not None else None,
        })  # fmt: skip
    wanted = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if wanted and len(rows) > len(wanted):
        kept = [r for r in rows if str(r["index"]) in wanted or r["uuid"] in wanted]
        rows = kept or rows
    return rows


def query_gpus(environ):
    """(rows, None) or (None, why there are none)."""
    try:
        proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=" + ",".join(GPU_FIELDS), "--format=csv,noheader,nounits"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
    except OSError:
        return None, "no nvidia-smi on PATH"
    try:
        out, _ = proc.communicate(timeout=NVSMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, "nvidia-smi did not answer in %d s" % NVSMI_TIMEOUT_S
    text = out.decode("utf-8", "replace")
    if proc.returncode != 0:
        return None, "nvidia-smi exited %d: %s" % (proc.returncode, " ".join(text.split())[:200])
    rows = parse_gpus(text, environ.get("CUDA_VISIBLE_DEVICES"))
    if not rows:
        return None, "nvidia-smi listed no GPU"
    return rows, None


# --- the process tree -----------------------------------------------------------------------------


def tree_usage(root):
    """(resident bytes, CPU seconds) of ``root`` and every live process under it, from /proc."""
    up, stat = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as fh:
                text = fh.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()  # after the command, which may hold spaces
        if len(fields) < 22:
            continue
        pid = int(name)
        up[pid] = int(fields[1])
        # utime stime cutime cstime (fields 14-17), rss in pages (24)
        stat[pid] = (sum(int(x) for x in fields[11:15]), int(fields[21]))
    rss = ticks = 0
    for pid in stat:
        q, n = pid, 0
        while q != root and q in up and n < 64:
            q, n = up[q], n + 1
        if q == root:
            ticks += stat[pid][0]
            rss += stat[pid][1]
    return rss * os.sysconf("SC_PAGE_SIZE"), ticks / float(os.sysconf("SC_CLK_TCK"))


def cgroup_peak():
    """The peak memory of this job's cgroup (Slurm's task/cgroup), or None: only a cgroup Slurm
    made for the job counts (anything else is not the job's alone)."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or "job_" not in parts[2] or "slurm" not in parts[2]:
            continue
        if parts[0] == "0" and parts[1] == "":
            path = "/sys/fs/cgroup%s/memory.peak" % parts[2]
        elif "memory" in parts[1].split(","):
            path = "/sys/fs/cgroup/memory%s/memory.max_usage_in_bytes" % parts[2]
        else:
            continue
        # The step's cgroup may be below the job's: the job's (its parent) holds every step.
        while True:
            try:
                with open(path) as fh:
                    return int(fh.read().strip())
            except (OSError, ValueError):
                head, leaf = os.path.split(os.path.dirname(path))
                if not leaf.startswith("step_"):
                    return None
                path = os.path.join(head, os.path.basename(path))
    return None


# --- the wrapper ----------------------------------------------------------------------------------


def _fmt_duration(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)
    if seconds >= 60:
        return "%dm%02ds" % (seconds // 60, seconds % 60)
    return "%ds" % seconds


def _number(text, default):
    try:
        return float(text) if text else default
    except ValueError:
        return default


class IdleWatch(object):
    """Every GPU of the node under IDLE_UTIL % for ``limit`` seconds: told once per idle stretch."""

    def __init__(self, limit):
        self.limit = limit
        self.since = None
        self.told = False

    def see(self, now, rows):
        """The idle stretch's start when it is to be told now, else None."""
        if not self.limit or not rows:
            return None
        utils = [r["util"] for r in rows]
        if any(u is None for u in utils) or any(u >= IDLE_UTIL for u in utils):
            self.since, self.told = None, False
            return None
        if self.since is None:
            self.since = now
        if not self.told and now - self.since >= self.limit:
            self.told = True
            return self.since
        return None


class Meter(object):
    def __init__(self, out_dir, node, environ, now=time.time):
        self.dir, self.node, self.env, self.now = out_dir, node, environ, now
        # A value the meter cannot read is its default: the program runs whatever the meter is told.
        self.interval = max(0.1, _number(environ.get("RV_STATS_INTERVAL"), INTERVAL_S))
        self.gpus_asked = _number(environ.get("RV_GPUS_PER_NODE"), 0) > 0
        self.idle = IdleWatch(_number(environ.get("RV_IDLE_GPU"), 0))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pid = None
        self.started = now()
        self.gpu = {}  # uuid -> per-GPU figures
        self.gpu_error = None if self.gpus_asked else "a CPU job"
        self.samples = 0
        self.sample_cpu_s = 0.0
        self.rss_peak = 0
        self.cpu_sampled = 0.0
        self.final = {}
        self.warned = False

    def record(self):
        cpus = self.env.get("SLURM_CPUS_ON_NODE")
        rec = {
            "node": self.node, "job_id": self.env.get("RV_STATS_JOB") or self.env.get("SLURM_JOB_ID"),
            "start": self.started, "end": self.now(), "final": bool(self.final),
            "cpus": int(cpus) if cpus and cpus.isdigit() else None,
            "mem_asked_bytes": mem_asked(self.env),
            "cpu_seconds": round(self.cpu_sampled, 3), "rss_peak_bytes": self.rss_peak,
            "maxrss_bytes": None, "cgroup_peak_bytes": None,
            "gpu_error": self.gpu_error,
            "gpus": sorted(self.gpu.values(), key=lambda g: g["index"]),
            "samples": self.samples, "interval_s": self.interval,
            "sampler_cpu_seconds": round(self.sample_cpu_s, 4),
        }  # fmt: skip
        rec.update(self.final)
        return rec

    def write(self):
        path = os.path.join(self.dir, self.node + ".json")
        data = (json.dumps(self.record(), sort_keys=True) + "\n").encode()
        tmp = "%s.tmp.%d" % (path, os.getpid())
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.rename(tmp, path)

    def sample(self):
        t0 = time.process_time()
        c0 = os.times()
        now = self.now()
        if self.pid is not None:
            rss, cpu = tree_usage(self.pid)
            self.rss_peak = max(self.rss_peak, rss)
            self.cpu_sampled = max(self.cpu_sampled, cpu)
        rows = None
        if self.gpus_asked:
            rows, why = query_gpus(self.env)
            if rows is None:
                self.gpu_error = why
            else:
                self.gpu_error = None
                self._gpu_rows(now, rows)
        c1 = os.times()
        # The sampler's own cost: this thread's CPU and nvidia-smi's (a child of this process).
        spent = time.process_time() - t0
        self.sample_cpu_s += spent + (c1[2] + c1[3] - c0[2] - c0[3])
        self.samples += 1
        if rows is not None:
            since = self.idle.see(now, rows)
            if since is not None:
                self.tell_idle(now, since, rows)

    def _gpu_rows(self, now, rows):
        for r in rows:
            g = self.gpu.setdefault(r["uuid"], {
                "index": r["index"], "uuid": r["uuid"], "name": r["name"], "util_sum": 0.0,
                "util_samples": 0, "util_mean": None, "util_max": None, "memory_peak_bytes": None,
                "memory_total_bytes": r["memory_total"],
            })  # fmt: skip
            if r["util"] is not None:
                g["util_sum"] += r["util"]
                g["util_samples"] += 1
                g["util_mean"] = round(g["util_sum"] / g["util_samples"], 1)
                g["util_max"] = max(g["util_max"] or 0, r["util"])
            if r["memory_used"] is not None:
                g["memory_peak_bytes"] = max(g["memory_peak_bytes"] or 0, r["memory_used"])
        line = {"t": round(now, 1), "gpus": [[r["index"], r["util"], r["memory_used"]] for r in rows]}
        with open(os.path.join(self.dir, self.node + ".gpu.jsonl"), "a") as fh:
            fh.write(json.dumps(line) + "\n")

    def tell_idle(self, now, since, rows):
        when = time.strftime("%H:%M:%S UTC", time.gmtime(since))
        text = "rv: warning: GPUs idle on %s: GPU %s under %d%% since %s (%s): the allocation is paid for" % (
            self.node,
            ", ".join(str(r["index"]) for r in rows),
            IDLE_UTIL,
            when,
            _fmt_duration(now - since),
        )
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        prog, hooks = (
            self.env.get("RV_STATS_NOTIFY_PROG"),
            (self.env.get("RV_STATS_NOTIFY_HOOKS") or "").split(),
        )
        if not prog or not hooks:
            return
        run_dir = os.path.dirname(os.path.dirname(self.dir))
        argv = [
            sys.executable or "python3",
            prog,
            "idle",
            run_dir,
            self.env.get("RV_STATS_JOB") or "",
        ] + hooks
        env = dict(os.environ, RV_IDLE_MESSAGE=text[len("rv: warning: ") :])
        try:
            subprocess.call(argv, stdin=subprocess.DEVNULL, env=env, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            sys.stderr.write("rv: warning: notify: the idle-GPU message was not sent: %s\n" % exc)

    def loop(self):
        while not self.stop.wait(self.interval):
            with self.lock:
                if self.stop.is_set():
                    return
                try:
                    self.sample()
                    self.write()
                except Exception as exc:  # the program runs on whatever the meter meets: said once
                    if not self.warned:
                        self.warned = True
                        sys.stderr.write(
                            "rv: warning: stats on %s: %s: %s\n" % (self.node, type(exc).__name__, exc)
                        )


def mem_asked(environ):
    """What the job asked for this node (--mem, or --mem-per-cpu x cpus), in bytes, or None."""
    per_node = environ.get("SLURM_MEM_PER_NODE")
    if per_node and per_node.isdigit():
        return int(per_node) * MIB
    per_cpu, cpus = environ.get("SLURM_MEM_PER_CPU"), environ.get("SLURM_CPUS_ON_NODE")
    if per_cpu and per_cpu.isdigit() and cpus and cpus.isdigit():
        return int(per_cpu) * int(cpus) * MIB
    return None


def exit_code(status):
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def wrap(out_dir, node, argv, environ=None):
    environ = os.environ if environ is None else environ
    before = {}
    for name in PASSED:
        num = getattr(signal, "SIG" + name)
        handler = signal.getsignal(num)
        before[num] = signal.SIG_DFL if handler is signal.default_int_handler or handler is None else handler
        signal.signal(num, signal.SIG_IGN)

    def restore():
        for num, handler in before.items():
            signal.signal(num, handler)

    meter = Meter(out_dir, node, environ)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        sys.stderr.write("rv: warning: stats on %s: %s: not measured\n" % (node, exc))
    # What rv's meter alone needs stays out of the program's environment.
    child_env = {k: v for k, v in environ.items() if not k.startswith("RV_STATS_")}
    try:
        child = subprocess.Popen(argv, preexec_fn=restore, env=child_env)
    except OSError as exc:
        sys.stderr.write("rv: cannot start the program: %s\n" % exc)
        return 127
    meter.pid = child.pid
    sampler = threading.Thread(target=meter.loop)
    sampler.daemon = True
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = exit_code(status)  # reaped here: Popen must not wait for it again
    meter.stop.set()
    with meter.lock:
        try:
            meter.pid = None
            meter.sample()  # the GPUs once more at the end
            peak = cgroup_peak()
            meter.final = {
                "final": True, "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
                "cpu_user_seconds": round(usage.ru_utime, 3), "cpu_system_seconds": round(usage.ru_stime, 3),
                "maxrss_bytes": usage.ru_maxrss * 1024, "cgroup_peak_bytes": peak,
                "exit_code": child.returncode,
            }  # fmt: skip
            meter.write()
        except OSError as exc:
            sys.stderr.write("rv: warning: stats on %s: %s\n" % (node, exc))
    return child.returncode


def node_peak(rec):
    """A node's peak memory: the job's cgroup where Slurm made one (every process, exact), else the
    larger of the largest process (exact) and the sampled sum of the program's processes."""
    if isinstance(rec.get("cgroup_peak_bytes"), int):
        return rec["cgroup_peak_bytes"]
    got = [v for v in (rec.get("maxrss_bytes"), rec.get("rss_peak_bytes")) if isinstance(v, int)]
    return max(got) if got else None


def main(argv):
    if len(argv) >= 4 and argv[0] == "wrap" and "--" in argv:
        cut = argv.index("--")
        if cut == 3 and argv[cut + 1 :]:
            return wrap(argv[1], argv[2], argv[cut + 1 :])
    sys.stderr.write("usage: stats.py wrap DIR NODE -- COMMAND...\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
