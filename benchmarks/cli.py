"""What each of rv's speed mechanisms earns, on and off, beside a bare `ssh host squeue`, in one run.

    scripts/testcluster up
    .venv/bin/python benchmarks/cli.py [--runs 10] [--queued 2000] [--groups ps,status,resubmit,local]

The `rv` measured is the one installed beside the Python running this script (its venv's `rv`
program, as a user types it): run it with the Python of the install you mean to measure (a venv with
`pip install -e .`, say). The cluster is the loopback one of ``RV_TESTCLUSTER_DIR`` (the bare layout:
``RV_TESTCLUSTER_DIR=/tmp/rv-testcluster-bare``), as its user.

The mechanisms (rv.remote.connect draws the path; each can be switched off alone):

  command server   the `rv` front end hands the command to a process with rv imported, which forks
                   a copy for it (off: RV_COMMAND_SERVER=0, the command runs in the rv process)
  warm connection  a background process per profile holds the SSH connection for RV_WARM_SECONDS
                   (off: RV_WARM_SECONDS=0, which connects in-process, every time)
  hot shell        the warm connection keeps a login shell started for the next command
                   (off: RV_HOT_SHELL=0; the agents wait in such a shell, so they go too)
  agents           and two of rv's agents, python started, modules loaded, for the next agent calls
                   (off: RV_PRESTART_AGENTS=0)

Groups of cases, measured in interleaved rounds (one of each per round, so drifting load on this
shared machine falls on all alike), each a whole process:

  ps        `rv ps`: cold (nothing of rv's running: the first command of the day), cold connection
            (the server up, no connection: the first command after a five-minute pause), warm at
            once (~10 ms after the last command, as in a script), warm (PAUSE_S later: a person's
            pace), and warm with each mechanism off; beside `ssh host squeue` on a fresh connection
            and through an OpenSSH ControlMaster that is already up
  status    `rv status` cold, cold connection, warm at once, warm
  exec      `rv exec true` (a plain command, not an agent call: what the hot shell alone serves),
            warm, with everything on, without the hot shell, without the warm connection
  resubmit  `rv run -g 0 -- sh job.sh` in a repo of RESUBMIT_FILES files, again with nothing changed
            and with one file changed, with everything on and with each mechanism off; beside what
            the same by hand costs: `rsync` of the repo, then `ssh host sbatch`, over fresh
            connections and through the ControlMaster (every job is cancelled at once, untimed)
  local     `rv --help` and `rv run --dry-run`, with the modules each imports

``--queued N`` queues N held jobs of this user first (cancelled at the end) and measures with them
in the queue (what `rv ps` and `squeue` then print grows with them).

Printed: median and spread (min-max) of wall seconds, and per case the median of the per-round ratio
to `ssh squeue` (resubmits: to rsync + ssh sbatch over fresh connections) with its min-max.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopback import read_env, stop_warm

REPO_ROOT = Path(__file__).resolve().parents[1]
PAUSE_S = 1.0  # between a command and the "warm" case: a person reads the output before typing again
RESUBMIT_FILES = 200
HELD = "sbatch --hold --parsable -J rv-bench-held -t 1 --mem 10M -o /dev/null --wrap true"
# Each mechanism off, alone: the profile it runs on (a profile's warm connection keeps what it was
# started with, so each setting has its own) and its environment.
MECHANISMS: dict[str, tuple[str, dict[str, str]]] = {
    "everything on": ("bench", {}),
    "no pre-started agents": ("noagents", {"RV_PRESTART_AGENTS": "0"}),
    "no hot shell (and so no agents)": ("noshell", {"RV_HOT_SHELL": "0"}),
    "no command server": ("bench", {"RV_COMMAND_SERVER": "0"}),
    "no warm connection (and so no server)": ("bench", {"RV_WARM_SECONDS": "0"}),
}


def run_ok(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """One successful run. The loopback Slurm is shared with other work on this machine and now and
    then times out (`Socket timed out on send/recv`): such a run is repeated (at most twice, said on
    stderr), never counted."""
    for _attempt in range(3):
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
        if proc.returncode == 0:
            return proc
        print(
            f"note: retrying ({proc.stderr.strip().splitlines()[-1:]}): {' '.join(cmd[:6])} ...",
            file=sys.stderr,
        )
    raise SystemExit(f"benchmark step failed 3 times: {' '.join(cmd)}\n{proc.stderr[-2000:]}")


def timed(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    """Wall seconds of one successful run (a failed one is repeated, see run_ok)."""
    return timed_run(cmd, env, cwd)[0]


def timed_run(
    cmd: list[str], env: dict[str, str], cwd: Path | None = None
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Wall seconds of one successful run, and the run (a failed one is repeated, see run_ok)."""
    for _attempt in range(3):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
        took = time.perf_counter() - start
        if proc.returncode == 0:
            return took, proc
        print(
            f"note: retrying ({proc.stderr.strip().splitlines()[-1:]}): {' '.join(cmd[:6])} ...",
            file=sys.stderr,
        )
    raise SystemExit(f"benchmark step failed 3 times: {' '.join(cmd)}\n{proc.stderr[-2000:]}")


def wait_server(runtime: Path) -> None:
    """Wait until the command server a cold command started is listening (it imports ~400 modules
    in the background after the command ends), so the next case finds it up."""
    for _ in range(1000):
        if list(runtime.glob("cmd-*.pid")):
            return
        time.sleep(0.01)
    raise SystemExit(f"the command server did not start (see {runtime}/cmd-*.log)")


def imported(args: list[str], env: dict[str, str], cwd: Path, python: Path) -> tuple[int, list[str]]:
    probe = (
        "import atexit, sys\n"
        "def report():\n"
        "    tops = sorted({m.split('.')[0] for m in sys.modules})\n"
        "    names = ('paramiko', 'cryptography', 'rich', 'tomlkit', 'git', 'torch')\n"
        "    heavy = [m for m in names if m in tops]\n"
        '    sys.stderr.write(f\'IMPORTS {len(sys.modules)} {",".join(heavy) or "-"}\\n\')\n'
        "atexit.register(report)\n"
        "from rv.cli.main import main\nsys.argv[0] = 'rv'\nmain()\n"
    )
    r = subprocess.run([python, "-c", probe, *args], env=env, cwd=cwd, capture_output=True, text=True)
    line = next(x for x in r.stderr.splitlines() if x.startswith("IMPORTS"))
    _, count, heavy = line.split()
    return int(count), [] if heavy == "-" else heavy.split(",")


def summary(name: str, values: list[float], ratios: list[float] | None) -> str:
    med = statistics.median(values)
    text = f"{name:<66} {med:6.3f} s  ({min(values):.3f}-{max(values):.3f})"
    if ratios:
        text += f"   {statistics.median(ratios):5.2f}x  ({min(ratios):.2f}-{max(ratios):.2f})"
    return text


def make_repo(path: Path) -> None:
    """A small project: RESUBMIT_FILES files of ~2 kB in a few folders, committed."""
    path.mkdir()
    for i in range(RESUBMIT_FILES):
        f = path / f"pkg{i % 8}" / f"mod{i}.py"
        f.parent.mkdir(exist_ok=True)
        f.write_text(f"# module {i}\n" + "x = 1\n" * 340)
    (path / "job.sh").write_text("echo resubmitted\n")
    for git in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "i"],
    ):
        subprocess.run(["git", *git], cwd=path, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--queued", type=int, default=0, help="held jobs of this user in the queue meanwhile")
    ap.add_argument("--groups", default="ps,status,exec,resubmit,local")
    ap.add_argument(
        "--before",
        type=Path,
        metavar="PYTHON",
        help="the Python of another rv install (e.g. main's venv): its `rv ps` and `rv status` (warm), "
        "its resubmits (everything on) and its `rv --help` and `rv run --dry-run` are timed in the same "
        "rounds (its own config, runtime folder, records and connection)",
    )
    args = ap.parse_args()
    groups = set(args.groups.split(","))
    # An installed rv has its bytecode compiled (pip does it); a checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would recompile every module on every command. Compile once first.
    import rv

    rv_dir = Path(rv.__file__).resolve().parent
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(rv_dir)], check=True, capture_output=True)
    if args.before:
        where = "import rv, os; print(os.path.dirname(rv.__file__))"
        before_dir = subprocess.run([args.before, "-c", where], check=True, capture_output=True, text=True)
        subprocess.run([args.before, "-m", "compileall", "-q", before_dir.stdout.strip()], check=True)
    state = Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster"))
    tc = read_env(state / "env")
    user = tc.get("RV_TESTCLUSTER_USER", "root")
    port, key, known = (
        tc["RV_TESTCLUSTER_SSH_PORT"],
        tc["RV_TESTCLUSTER_KEY"],
        tc["RV_TESTCLUSTER_KNOWN_HOSTS"],
    )
    work = Path(tempfile.mkdtemp(prefix="rv-bench-", dir="/tmp"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    home = work / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1", RV_RUNTIME_DIR=str(runtime))
    # Resubmits keep their own records, config and remote root: `rv ps` must not list more each round.
    run_env = dict(env, RV_CONFIG=str(home / "rv-run.toml"), RV_STATE_DIR=str(home / "state-run"))
    base = f"{tc['RV_TESTCLUSTER_REMOTE_ROOT']}/bench-cli-{os.getpid()}"
    # The `rv` program installed beside this Python (its front end hands commands to the command
    # server), as a user types it; `python -m rv` always runs in-process.
    rv = [str(Path(sys.executable).parent / "rv")]
    for config_env, root in ((env, f"{base}/ps"), (run_env, f"{base}/run")):
        for profile in sorted({p for p, _ in MECHANISMS.values()}):
            run_ok(
                [*rv, "init", "--profile", profile, "--host", "127.0.0.1", "--port", port, "--user", user,
                 "--identity-file", key, "--known-hosts", known, "--remote-root", root, "--yes"],
                config_env,
            )  # fmt: skip
    repo = work / "repo"
    make_repo(repo)
    ssh = [
        "ssh", "-F", "none", "-p", port, "-i", key, "-o", f"UserKnownHostsFile={known}",
        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", f"{user}@127.0.0.1",
    ]  # fmt: skip
    mux = [*ssh[:-1], "-o", f"ControlPath={work}/mux", "-o", "ControlMaster=auto", "-o", "ControlPersist=600"]
    mux.append(ssh[-1])
    before_rv = [str(args.before.parent / "rv")] if args.before else []
    before_env = dict(env, RV_CONFIG=str(home / "rv-before.toml"), RV_RUNTIME_DIR=str(work / "run-before"))
    before_run_env = dict(
        before_env, RV_CONFIG=str(home / "rv-before-run.toml"), RV_STATE_DIR=str(home / "state-before-run")
    )
    if args.before:
        (work / "run-before").mkdir(mode=0o700)
        for config_env, root in ((before_env, f"{base}/ps"), (before_run_env, f"{base}/run-before")):
            run_ok(
                [*before_rv, "init", "--profile", "bench", "--host", "127.0.0.1", "--port", port, "--user",
                 user, "--identity-file", key, "--known-hosts", known, "--remote-root", root, "--yes"],
                config_env,
            )  # fmt: skip
    rsync_dest = f"{base}/by-hand"
    run_ok([*ssh, f"mkdir -p {rsync_dest}"], env)

    def by_hand(over: list[str]) -> list[str]:
        # What a user would type to resubmit by hand: copy the repo, queue a job (held: cancelled).
        remote_shell = " ".join(shlex.quote(w) for w in over[:-1])
        return [
            "sh", "-c",
            f"rsync -a --delete -e {shlex.quote(remote_shell)} ./ {over[-1]}:{rsync_dest}/ && "
            f"{' '.join(shlex.quote(w) for w in over)} 'cd {rsync_dest} && {HELD}'",
        ]  # fmt: skip

    jobs: list[str] = []

    def cancel_jobs() -> None:
        while jobs:
            batch, jobs[:] = jobs[:500], jobs[500:]
            run_ok([*mux, "scancel " + " ".join(batch)], env)

    cases: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    timed([*mux, "true"], env)  # the master is up for the whole benchmark
    if args.queued:
        run_ok([*mux, f"for i in $(seq {args.queued}); do {HELD} >/dev/null || exit 1; done"], env)
    queue_length = run_ok([*mux, "squeue -h -u $(id -un) | wc -l"], env).stdout.strip()
    try:
        for round_ in range(args.runs):
            row: dict[str, float] = {}
            yard: dict[str, str] = {}
            row["ssh host squeue (a fresh OpenSSH connection)"] = timed([*ssh, "squeue"], env)
            row["ssh host squeue through a ControlMaster"] = timed([*mux, "squeue"], env)
            for cmd in [c for c in ("ps", "status") if c in groups]:
                stop_warm(runtime, server=True)
                row[f"rv {cmd}, cold"] = timed([*rv, cmd], env)
                wait_server(runtime)
                stop_warm(runtime, server=False)
                row[f"rv {cmd}, cold connection"] = timed([*rv, cmd], env)
                row[f"rv {cmd}, warm at once"] = timed([*rv, cmd], env)
                time.sleep(PAUSE_S)
                row[f"rv {cmd}, warm"] = timed([*rv, cmd], env)
            if "ps" in groups:
                for what, (profile, extra) in MECHANISMS.items():
                    if what == "everything on":
                        continue
                    cmd_env = dict(env, **extra)
                    run_ok([*rv, "-p", profile, "ps"], cmd_env)  # its connection warm, as in the case above
                    time.sleep(PAUSE_S)
                    row[f"rv ps, warm, {what}"] = timed([*rv, "-p", profile, "ps"], cmd_env)
                if args.before:
                    for cmd in ("ps", "status"):
                        run_ok([*before_rv, cmd], before_env)
                        time.sleep(PAUSE_S)
                        row[f"before (the other install): rv {cmd}, warm"] = timed(
                            [*before_rv, cmd], before_env
                        )
            if "exec" in groups:
                # A command that is not an agent call: what the hot shell alone is for.
                for what in (
                    "everything on",
                    "no hot shell (and so no agents)",
                    "no warm connection (and so no server)",
                ):
                    profile, extra = MECHANISMS[what]
                    cmd_env = dict(env, **extra)
                    run_ok([*rv, "-p", profile, "exec", "true"], cmd_env)
                    time.sleep(PAUSE_S)
                    row[f"rv exec true, warm, {what}"] = timed([*rv, "-p", profile, "exec", "true"], cmd_env)
            if "resubmit" in groups:
                resubmit = ["run", "-g", "0", "--mem", "100M", "--", "sh", "job.sh"]
                changed = repo / "pkg0" / "mod0.py"
                for what, (profile, extra) in MECHANISMS.items():
                    cmd_env = dict(run_env, **extra)
                    # Its connection warm (the cold cases above stopped every one), as in the cases above.
                    run_ok([*rv, "-p", profile, "ps"], cmd_env)
                    for change in (True, False):
                        if change:
                            changed.write_text(f"# changed in round {round_}, {what}\n")
                        time.sleep(PAUSE_S)
                        name = f"resubmit, {'one file changed' if change else 'nothing changed'}, {what}"
                        row[name], proc = timed_run([*rv, "-p", profile, *resubmit], cmd_env, cwd=repo)
                        jobs.extend(re.findall(r"^(\d+)\s*$", proc.stdout, re.M))
                        yard[name] = "by hand, fresh"
                if args.before:
                    run_ok([*before_rv, "ps"], before_run_env)  # its connection warm, as above
                    for change in (True, False):
                        if change:
                            changed.write_text(f"# changed in round {round_}, before\n")
                        time.sleep(PAUSE_S)
                        what = "one file changed" if change else "nothing changed"
                        name = f"before (the other install): resubmit, {what}"
                        row[name], proc = timed_run([*before_rv, *resubmit], before_run_env, cwd=repo)
                        jobs.extend(re.findall(r"^(\d+)\s*$", proc.stdout, re.M))
                        yard[name] = "by hand, fresh"
                for label, over in (("fresh", ssh), ("ControlMaster", mux)):
                    changed.write_text(f"# changed in round {round_} by hand\n")
                    name = f"by hand: rsync, then ssh host sbatch ({label})"
                    row[name], proc = timed_run(by_hand(over), env, cwd=repo)
                    jobs.extend(re.findall(r"^(\d+)", proc.stdout, re.M))
                    yard[name] = "by hand, fresh"
                cancel_jobs()
            squeue = row["ssh host squeue (a fresh OpenSSH connection)"]
            fresh_by_hand = row.get("by hand: rsync, then ssh host sbatch (fresh)")
            for name, value in row.items():
                cases.setdefault(name, []).append(value)
                base_value = fresh_by_hand if yard.get(name) and fresh_by_hand else squeue
                ratios.setdefault(name, []).append(value / base_value)
    finally:
        stop_warm(runtime, server=True)
        stop_warm(work / "run-before", server=True)
        cancel_jobs()
        if args.queued:
            held = run_ok([*mux, "squeue -h -u $(id -un) -n rv-bench-held -o %i"], env).stdout.split()
            jobs.extend(held)
            cancel_jobs()
        mux_stop = subprocess.run([*mux[:-1], "-O", "exit", mux[-1]], capture_output=True, text=True)
        if mux_stop.returncode != 0:
            print(f"note: could not stop the ssh master: {mux_stop.stderr.strip()}", file=sys.stderr)

    local: dict[str, list[float]] = {}
    dry = ["run", "--dry-run", "-g", "1", "-t", "a6000", "--", "python", "job.sh"]
    if "local" in groups:
        local = {"rv --help": [], "rv run --dry-run": []}
        if args.before:
            local.update({"before: rv --help": [], "before: rv run --dry-run": []})
        for _ in range(args.runs):
            local["rv --help"].append(timed([*rv, "--help"], env))
            local["rv run --dry-run"].append(timed([*rv, *dry], env, cwd=repo))
            if args.before:
                local["before: rv --help"].append(timed([*before_rv, "--help"], before_env))
                local["before: rv run --dry-run"].append(timed([*before_rv, *dry], before_env, cwd=repo))
        stop_warm(runtime, server=True)
        stop_warm(work / "run-before", server=True)

    print(
        f"{state.name} loopback cluster as {user}, {queue_length} jobs of the user queued, rv from "
        f"{rv_dir.parent}; {args.runs} interleaved rounds; median (min-max); ratio per round to "
        "ssh squeue (resubmits: to rsync + ssh sbatch over fresh connections)"
    )
    for name, values in cases.items():
        yardstick = name.startswith("ssh host squeue (a fresh") or name.endswith("sbatch (fresh)")
        print(summary(name, values, None if yardstick else ratios[name]))
    print()
    for name, values in local.items():
        python = args.before if name.startswith("before") else Path(sys.executable)
        count, heavy = imported(["--help"] if name.endswith("rv --help") else dry, env, repo, python)
        print(f"{summary(name, values, None)}   {count} modules; heavy ones: {', '.join(heavy) or 'none'}")
    q = shlex.quote(base)  # snapshots are read-only: make them writable to remove them
    gone = subprocess.run([*ssh, f"chmod -R u+w {q} && rm -rf {q}"], capture_output=True, text=True)
    if gone.returncode != 0:
        print(f"note: could not remove {base}: {gone.stderr[-300:]}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
