"""A 100-point sweep against 100 `rv run`s in a shell loop; `rv sweep results` against asking each run.

    scripts/testcluster up
    .venv/bin/python benchmarks/sweeps.py [--points 100] [--results-rounds 5]

On the default loopback layout, as the cluster user, each `rv` a process of its own as a user's shell
would start it (rv's warm connection on, as by default). The program of every point is the same small
one: it writes three metrics lines to $RV_METRICS and ends.

Submitting (one round each; the jobs of each side run to their end before the other starts):
  rv run --sweep     one command: one snapshot, one job array, each point a run of its own
  shell loop         `for v in ...; do rv run --name loop-i -- python3 point.py $v; done`

Reading the results, once every point has ended (median of --results-rounds):
  rv sweep results   one command, one round trip: every point's state and last metrics
  rv metrics loop    `rv metrics loop-i` for each run of the loop, what one does without a sweep

Printed: wall time and round trips to the cluster, counted at the agent calls (rv.remote.agent_client) in
each rv process; for the loops, their sum over the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopback import COUNTED_RV, read_env

PROGRAM = """\
import json, os, sys
for step in (1, 2, 3):
    with open(os.environ["RV_METRICS"], "a") as fh:
        fh.write(json.dumps({"step": step, "loss": float(sys.argv[1]) / step}) + "\\n")
"""


class Bench:
    def __init__(self, state: Path) -> None:
        self.tc = read_env(state / "env")
        self.work = Path(tempfile.mkdtemp(prefix="rv-bench-sweeps-"))
        self.proj = self.work / "proj"
        self.proj.mkdir()
        (self.proj / "point.py").write_text(PROGRAM)
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "init"]):
            subprocess.run(
                ["git", "-c", "user.email=b@b", "-c", "user.name=b", *args], cwd=self.proj, check=True
            )
        self.env = dict(os.environ, RV_PROFILE=self.tc["RV_TESTCLUSTER_PROFILE"], RV_WARM_SECONDS="30")
        self.env.setdefault("RV_CONFIG", str(state / "rv-config.toml"))
        self.env["RV_STATE_DIR"] = str(self.work / "state")
        self.env["RV_CACHE_DIR"] = str(self.work / "cache")
        self.env["RV_RUNTIME_DIR"] = str(self.work / "rt")

    def rv(self, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        """One rv process; its agent calls."""
        r = subprocess.run([sys.executable, "-c", COUNTED_RV, *args], env=self.env, cwd=self.proj,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"rv {' '.join(args)} failed: {r.stderr[-2000:]}")
        line = next(x for x in r.stderr.splitlines() if x.startswith("AGENT_CALLS"))
        return r, [c for c in line.split(" ", 1)[1].split(",") if c] if " " in line else []

    def wait_ended(self, names: list[str], timeout: float = 900) -> None:
        """Until every run named has ended (rv ps -a, its records)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = json.loads(self.rv("ps", "-a", "--json")[0].stdout)
            states = {row["name"]: row["state"] for row in rows if row["run_id"]}
            if all(states.get(n) not in (None, "PENDING", "RUNNING") for n in names):
                return
            time.sleep(3)
        raise SystemExit(f"runs still going after {timeout} s")


def timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=100)
    ap.add_argument("--results-rounds", type=int, default=5)
    args = ap.parse_args()
    bench = Bench(Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster")))
    values = [f"{(i + 1) / 1000:.3f}" for i in range(args.points)]
    tag = os.getpid()
    common = ["-g", "0", "--mem", "100M"]

    sweep = f"sw-{tag}"
    sweep_args = ["run", *common, "--name", sweep, "--sweep", "lr=" + ",".join(values), "--", "python3",
                  "point.py", "{lr}"]  # fmt: skip
    sweep_wall, (_, sweep_calls) = timed(lambda: bench.rv(*sweep_args))
    print(f"rv run --sweep: {sweep_wall:.2f} s", file=sys.stderr)
    bench.wait_ended([f"{sweep}/{i}" for i in range(args.points)])

    loop_calls: list[str] = []
    loop_names = [f"loop-{tag}-{i}" for i in range(args.points)]

    def loop() -> None:
        for name, value in zip(loop_names, values, strict=True):
            loop_calls.extend(bench.rv("run", *common, "--name", name, "--", "python3", "point.py", value)[1])

    loop_wall, _ = timed(loop)
    print(f"shell loop: {loop_wall:.2f} s", file=sys.stderr)
    bench.wait_ended(loop_names)

    results_walls, results_calls, rows = [], [], 0
    for _ in range(args.results_rounds):
        took, (r, calls) = timed(lambda: bench.rv("sweep", "results", sweep, "--json"))
        results_walls.append(took)
        results_calls = calls
        points = json.loads(r.stdout)["points"]
        rows = sum(1 for p in points if p["state"] == "COMPLETED" and "loss" in p["metrics"])
    metrics_calls: list[str] = []

    def each() -> None:
        for name in loop_names:
            metrics_calls.extend(bench.rv("metrics", name, "--json")[1])

    metrics_wall, _ = timed(each)

    n = args.points
    print(f"\nSubmitting {n} points (default layout, warm connection as by default):")
    print(f"{'':<26} {'wall (s)':>9} {'round trips':>12} {'vs sweep':>9}")
    trips = ", ".join(sweep_calls)
    print(f"{'rv run --sweep':<26} {sweep_wall:9.2f} {len(sweep_calls):12d} {1:8.2f}x   ({trips})")
    print(f"{f'{n} rv run in a shell loop':<26} {loop_wall:9.2f} {len(loop_calls):12d} "
          f"{loop_wall / sweep_wall:8.2f}x")  # fmt: skip
    med = statistics.median(results_walls)
    print(f"\nReading the results of {n} points ({rows} rows with their metrics):")
    print(f"{'rv sweep results':<26} {med:9.2f} {len(results_calls):12d} {1:8.2f}x   "
          f"(median of {len(results_walls)}, {min(results_walls):.2f}-{max(results_walls):.2f}; "
          f"{', '.join(results_calls)})")  # fmt: skip
    print(
        f"{f'{n} rv metrics RUN':<26} {metrics_wall:9.2f} {len(metrics_calls):12d} {metrics_wall / med:8.2f}x"
    )
    shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()
