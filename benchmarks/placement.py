"""Where a run starts when one GPU type is busy, and what a run over several types costs to submit.

    scripts/testcluster up
    .venv/bin/python benchmarks/placement.py [--rounds 2] [--busy 40] [--submits 5]

On the default loopback layout (two nodes, each 2 a6000 and 2 v100), as the cluster user. Each round
takes every a6000 with another job for ``--busy`` seconds, then at once submits the same one-GPU
program (it prints a line, then works for WORK_S seconds) three ways:

  rv two types     rv run -t a6000,v100: one job per type; the first to start takes the run and
                   cancels the other, on the cluster (nothing of rv runs after `rv run` returns)
  rv pinned        rv run -t a6000: the run waits for the busy type
  submit-all rule  the rule of the tool rv replaces, with nobody running it again: the program sent
                   to each type as its own job, losers cancelled only by the next command of that
                   tool, which never comes: every copy runs (and bills)

Printed per case: seconds from the submission to the program's first line (median over rounds), how
many times the program started, and the GPU-seconds the extra starts took. Then the cost of
submitting a run over two types against one type (both free): `rv run`'s wall time (in-process,
direct connection, interleaved) and its round trips to the cluster, counted at the agent calls.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_S = 10
PROGRAM = f"import time; print('first line', flush=True); time.sleep({WORK_S})\n"


class Bench:
    def __init__(self, state: Path) -> None:
        self.tc = read_env(state / "env")
        self.user = self.tc["RV_TESTCLUSTER_USER"]
        self.root = Path(self.tc["RV_TESTCLUSTER_REMOTE_ROOT"])
        self.work = Path(tempfile.mkdtemp(prefix="rv-bench-placement-"))
        self.proj = self.work / "proj"
        self.proj.mkdir()
        (self.proj / "first.py").write_text(PROGRAM)
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "init"]):
            subprocess.run(
                ["git", "-c", "user.email=b@b", "-c", "user.name=b", *args], cwd=self.proj, check=True
            )
        self.env = dict(os.environ, RV_WARM_SECONDS="0", RV_PROFILE=self.tc["RV_TESTCLUSTER_PROFILE"])
        self.env.setdefault("RV_CONFIG", str(state / "rv-config.toml"))
        self.env["RV_STATE_DIR"] = str(self.work / "state")
        self.env["RV_CACHE_DIR"] = str(self.work / "cache")

    def slurm(self, *argv: str, stdin: str | None = None) -> str:
        env = {"PATH": os.environ["PATH"], "SLURM_CONF": self.tc["SLURM_CONF"]}
        r = subprocess.run(["runuser", "-u", self.user, "--", *argv], env=env, cwd="/", input=stdin,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {r.stderr}")
        return r.stdout

    def rv(self, *args: str, counted: bool = False) -> subprocess.CompletedProcess:
        code = COUNTED_RV if counted else "from rv.cli.main import main; import sys; sys.argv[0]='rv'; main()"
        r = subprocess.run([sys.executable, "-c", code, *args], env=self.env, cwd=self.proj,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"rv {' '.join(args)} failed: {r.stderr[-2000:]}")
        return r

    def block_a6000(self, seconds: int) -> str:
        job = self.slurm("sbatch", "--parsable", "-N2", "--gres=gpu:a6000:2", "--mem=100M", "-t", "5",
                         "-o", "/dev/null", "--wrap", f"sleep {seconds}").strip()  # fmt: skip
        while "RUNNING" not in self.slurm("squeue", "-h", "-j", job, "-o", "%T"):
            time.sleep(0.5)
        return job

    def run_dir(self, name: str) -> Path | None:
        for rdir in (self.root / "runs").iterdir() if (self.root / "runs").exists() else []:
            try:
                if json.loads((rdir / "run.json").read_text())["name"] == name:
                    return rdir
            except (OSError, ValueError, KeyError):
                continue
        return None

    def starts_in_run(self, name: str) -> list[float]:
        """When the program printed its first line in each log of the run (the files' birth is not
        kept on every filesystem: the line's appearance is polled for instead, see wait_first)."""
        rdir = self.run_dir(name)
        if rdir is None:
            return []
        return [p.stat().st_mtime for p in (rdir / "logs").glob("*.out") if "first line" in p.read_text()]

    def plain_job(self, gpu: str, out: Path) -> str:
        """The tool-rv-replaces rule: the program as a job of its own on one type (no claim)."""
        return self.slurm("sbatch", "--parsable", f"--gres=gpu:{gpu}:1", f"--partition=gpu-{gpu}",
                          "--mem=200M", "-t", "5", "-o", str(out), "--wrap",
                          f"cd {self.proj} && python3 first.py").strip()  # fmt: skip


def wait_first(check, since: float, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic() - since
        time.sleep(0.2)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=40, help="seconds the a6000s stay taken")
    ap.add_argument("--submits", type=int, default=5, help="rounds of the submission-cost comparison")
    args = ap.parse_args()
    bench = Bench(Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster")))
    outs = bench.work / "plain"
    outs.mkdir()
    os.chmod(bench.work, 0o755)
    os.chmod(outs, 0o777)  # the plain jobs run as the cluster user and write their logs here
    first: dict[str, list[float]] = {"rv two types": [], "rv pinned": [], "submit-all rule": []}
    starts: dict[str, list[int]] = {k: [] for k in first}
    for r in range(args.rounds):
        # Each case alone behind its own blocker: a pending job submitted earlier can hold back the
        # ones after it in Slurm's main scheduling loop, so cases must not share a queue.
        for case in first:
            blocker = bench.block_a6000(args.busy)
            t0 = time.monotonic()
            name = f"{case.split()[-1]}-{r}-{os.getpid()}"
            plain = [outs / f"{r}-{gpu}.out" for gpu in ("a6000", "v100")]
            if case == "submit-all rule":
                for gpu, out in zip(("a6000", "v100"), plain, strict=True):
                    bench.plain_job(gpu, out)

                def seen(files=plain):
                    return sum(p.exists() and "first line" in p.read_text() for p in files)
            else:
                types = "a6000,v100" if case == "rv two types" else "a6000"
                bench.rv("run", "-t", types, "-g", "1", "--mem", "200M", "--name", name, "--",
                         "python3", "first.py")  # fmt: skip

                def seen(n=name):
                    return len(bench.starts_in_run(n))

            took = wait_first(seen, t0, args.busy + 60)
            if took is None:
                raise SystemExit(f"{case}: no first line within {args.busy + 60} s")
            first[case].append(took)
            # Everything ends: the blocker, then what waited for it (the rule's second copy too).
            time.sleep(max(0.0, args.busy - (time.monotonic() - t0)) + WORK_S + 10)
            starts[case].append(seen())
            bench.slurm("scancel", blocker)
            print(f"round {r + 1}: {case} {took:.1f} s, {starts[case][-1]} start(s)", file=sys.stderr)

    print(f"\nFirst line of the program with every a6000 busy for {args.busy} s "
          f"({args.rounds} rounds, default layout, one GPU):")  # fmt: skip
    print(f"{'case':<18} {'first line (s)':>15} {'starts':>7} {'extra GPU-s':>12} {'vs rv':>7}")
    base = statistics.median(first["rv two types"])
    for case, values in first.items():
        med = statistics.median(values)
        extra = (statistics.median(starts[case]) - 1) * WORK_S
        print(
            f"{case:<18} {med:15.1f} {statistics.median(starts[case]):7.0f} {extra:12.0f} {med / base:6.2f}x"
        )

    # Submission cost: one type against two, both free, interleaved.
    walls: dict[str, list[float]] = {"-t a6000": [], "-t a6000,v100": []}
    trips: dict[str, str] = {}
    for i in range(args.submits):
        for types in walls:
            name = f"cost-{i}-{len(types)}-{os.getpid()}"
            start = time.perf_counter()
            r = bench.rv("run", "-t", types.split()[-1], "-g", "1", "--mem", "200M", "--name", name, "--",
                         "python3", "first.py", counted=True)  # fmt: skip
            walls[types].append(time.perf_counter() - start)
            trips[types] = next(x for x in r.stderr.splitlines() if x.startswith("AGENT_CALLS")).split()[1]
            bench.rv("stop", name, "--yes")
    print(f"\nSubmitting one run ({args.submits} rounds each, in-process, direct connection):")
    one = statistics.median(walls["-t a6000"])
    for types, values in walls.items():
        med = statistics.median(values)
        calls = trips[types].split(",")
        print(f"rv run {types:<16} {med:6.2f} s ({min(values):.2f}-{max(values):.2f})  {med / one:5.2f}x  "
              f"{len(calls)} round trips: {', '.join(calls)}")  # fmt: skip
    shutil.rmtree(bench.work, ignore_errors=True)


if __name__ == "__main__":
    main()
