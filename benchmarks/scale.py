"""`rv ps`, `rv status` and `rv logs` with 2,000 of your jobs in the queue against the same with 10.

    scripts/testcluster up        (the bare layout: RV_TESTCLUSTER_VARIANT=bare)
    .venv/bin/python benchmarks/scale.py [--runs 10] [--queued 2000]

On the bare loopback cluster as its user: one run is submitted and followed (so `rv logs` has one
to show), 500 ended runs are added to the cluster's records and to the local ones, then held jobs
(`sbatch --hold`) are queued. The three commands run as whole processes on a warm connection in
alternating phases, 10 held jobs and --queued held jobs (10, big, 10, big, 10 with --switches 2),
--runs times in all for each queue size, so the load of this shared machine falls on both alike.
Printed: median (min-max) seconds per queue size and the ratio of the medians. Every job submitted
is cancelled at the end.
"""

from __future__ import annotations

import argparse
import json
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

HELD = "sbatch --hold --parsable -J rv-bench-held -t 1 --mem 10M -o /dev/null --wrap true"
# Run on the cluster as its user (python3, stdlib): N runs that ended a day ago, as jobs write them.
OLD_RUNS = r"""
import json, os, sys, time
root, n = sys.argv[1], int(sys.argv[2])
t = time.time() - 86400
for i in range(n):
    d = os.path.join(root, "runs", "0ld%05x" % i)
    os.makedirs(os.path.join(d, "seg"), mode=0o700)
    end = {"reason": "finished", "exit_code": 0, "segment": 1, "end": t + i + 5}
    files = {"run.json": {"run_id": "0ld%05x" % i, "name": "old-%d" % i, "project": "bench",
                          "created": t + i, "max_segments": 10, "nodes": 1},
             "ENDED": end, "seg/1.json": dict(end, job_id=str(9000000 + i), state="ended")}
    for name, obj in files.items():
        with open(os.path.join(d, name), "w") as fh:
            json.dump(obj, fh)
    with open(os.path.join(d, "seg", "1.job"), "w") as fh:
        fh.write("%d\n" % (9000000 + i))
"""


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)[:200]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    run(cmd, env)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--queued", type=int, default=2000)
    ap.add_argument("--records", type=int, default=500)
    ap.add_argument("--switches", type=int, default=2, help="how many big-queue phases (between small ones)")
    args = ap.parse_args()
    rv_dir = Path(__file__).resolve().parents[1] / "rv"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(rv_dir)], check=True, capture_output=True)
    state = Path(os.environ.get("RV_TESTCLUSTER_BARE_DIR", "/tmp/rv-testcluster-bare"))
    tc = read_env(state / "env")
    work = Path(tempfile.mkdtemp(prefix="rv-bench-scale-", dir="/tmp"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    home = work / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1", RV_RUNTIME_DIR=str(runtime))
    root = f"{tc['RV_TESTCLUSTER_REMOTE_ROOT']}/bench-scale-{os.getpid()}"
    rv = [sys.executable, "-m", "rv"]
    run(
        [*rv, "init", "--profile", "bench", "--host", "127.0.0.1", "--port", tc["RV_TESTCLUSTER_SSH_PORT"],
         "--user", tc["RV_TESTCLUSTER_USER"], "--identity-file", tc["RV_TESTCLUSTER_KEY"],
         "--known-hosts", tc["RV_TESTCLUSTER_KNOWN_HOSTS"], "--remote-root", root,
         "--setup", f"source {tc['RV_TESTCLUSTER_PYENV']}/bin/activate", "--yes"],
        env,
    )  # fmt: skip
    repo = work / "repo"
    repo.mkdir()
    (repo / "hello.sh").write_text("echo hello\n")
    for git in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "i"],
    ):
        subprocess.run(["git", *git], cwd=repo, check=True)
    run(
        [*rv, "run", "-g", "0", "--mem", "200M", "--name", "probe", "-f", "--", "sh", "hello.sh"],
        env,
        cwd=repo,
    )
    # The records: N ended runs on the cluster, and as many local records (their secrets long gone).
    run([*rv, "exec", f"python3 -c {shlex.quote(OLD_RUNS)} {root} {args.records}"], env)
    records_file = next(home.rglob("runs.json"))
    records = json.loads(records_file.read_text())
    model = records["runs"][-1]
    records["runs"] = [
        {**model, "run_id": f"0ld{i:05x}", "name": f"old-{i}", "job_id": str(9000000 + i), "jobs": []}
        for i in range(args.records)
    ] + records["runs"]
    records_file.write_text(json.dumps(records))

    held: list[str] = []

    def hold(n: int) -> None:
        out = run([*rv, "exec", f"for i in $(seq {n}); do {HELD} || exit 1; done"], env)
        held.extend(re.findall(r"^(\d+)", out, re.M))

    def cancel(ids: list[str]) -> None:
        for i in range(0, len(ids), 500):
            run([*rv, "exec", "scancel " + " ".join(ids[i : i + 500])], env)

    commands = {"rv ps": ["ps"], "rv status": ["status"], "rv logs": ["logs", "probe"]}
    # Small and big queue in alternating phases (small, big, small, big, small), so that the load
    # of this shared machine, which drifts over minutes, falls on both alike.
    phases = ["small", "big"] * args.switches + ["small"]
    times: dict[str, dict[str, list[float]]] = {
        "small": {n: [] for n in commands},
        "big": {n: [] for n in commands},
    }
    seen: dict[str, set[str]] = {"small": set(), "big": set()}
    try:
        hold(10)
        small = list(held)
        for phase in phases:
            if phase == "big":
                hold(args.queued - 10)
                per = -(-args.runs // args.switches)
            else:
                cancel([j for j in held if j not in small])
                del held[len(small) :]
                per = -(-args.runs // (args.switches + 1))
            queued = run([*rv, "exec", "squeue -h -u $(id -un) -n rv-bench-held | wc -l"], env).strip()
            seen[phase].add(queued)
            timed([*rv, "ps"], env)  # warm the connection for this phase
            for _ in range(per):
                for name, cmd in commands.items():
                    times[phase][name].append(timed([*rv, *cmd], env))
    finally:
        if held:
            cancel(held)
        q = shlex.quote(root)  # snapshots are read-only: make them writable to remove them
        gone = subprocess.run([*rv, "exec", f"chmod -R u+w {q} && rm -rf {q}"], env=env, capture_output=True)
        if gone.returncode != 0:
            print(f"note: could not remove {root}: {gone.stderr.decode()[-300:]}", file=sys.stderr)
        stop_warm(runtime, server=True)
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"bare loopback cluster as {tc['RV_TESTCLUSTER_USER']}, warm connection, {args.records} runs in the "
        f"records; held jobs squeue showed: small {sorted(seen['small'])}, big {sorted(seen['big'])}"
    )
    n = len(times["big"]["rv ps"])
    print(f"{len(phases)} alternating phases; seconds, median (min-max) of {n} runs each")
    print(f"{'':<10} {'10 queued':>22} {f'{args.queued} queued':>22}   ratio")
    for name in commands:
        small_v, big_v = times["small"][name], times["big"][name]
        cells = [f"{statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})" for v in (small_v, big_v)]
        ratio = statistics.median(big_v) / statistics.median(small_v)
        print(f"{name:<10} {cells[0]:>22} {cells[1]:>22}   {ratio:.2f}x")


if __name__ == "__main__":
    main()
