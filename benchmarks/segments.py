"""A run across segments: the gap between a stop and the next training step, and the work lost.

    scripts/testcluster up
    .venv/bin/python benchmarks/segments.py [--segments 5] [--requeue-segments 3] [--profile testcluster]

One program, two ways of carrying it across 1-minute Slurm jobs on the loopback cluster:

  rv        `rv run --time 1m --signal USR1@40 --max-segments N`: the job sends USR1 to the
            program 40 s before the limit; the program saves and writes PREEMPTED; the job submits
            the next segment (a new job, after this one) before it ends
  requeue   what a careful user writes by hand (submitit's way): `#SBATCH --signal=B:USR1@40
            --requeue`, a batch-shell trap that forwards USR1 to the program, waits for it to save,
            then `scontrol requeue $SLURM_JOB_ID`

The program imports torch (as a trainer would), then steps every 0.25 s, saving every 20 steps and
on the signal. Printed per segment: the gap from the program's exit (after saving) to its first step
in the next segment, and the steps lost (done after the last checkpoint, so done again). The loopback
nodes are free, so the gap is rv's (or Slurm's) own overhead plus the program's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

PROGRAM = r"""
import json, os, signal, sys, time
started = time.time()
import torch  # noqa: F401  (a trainer's import cost)
ckpt = os.environ.get("RV_CHECKPOINT_DIR") or os.environ["BENCH_CKPT"]
os.makedirs(ckpt, exist_ok=True)
state = os.path.join(ckpt, "state.json")
step = json.load(open(state))["step"] if os.path.exists(state) else 0
stop = []
signal.signal(signal.SIGUSR1, lambda s, f: stop.append(s))
print(f"BENCH start {step} {started:.3f}", flush=True)

def save(step):
    tmp = state + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.replace(tmp, state)
    print(f"BENCH saved {step} {time.time():.3f}", flush=True)

while step < int(sys.argv[1]):
    time.sleep(0.25)
    step += 1
    print(f"BENCH step {step} {time.time():.3f}", flush=True)
    if step % 20 == 0:
        save(step)
    if stop:
        save(step)
        open(os.path.join(ckpt, "PREEMPTED"), "w").write(json.dumps({"step": step}))
        print(f"BENCH exit {step} {time.time():.3f}", flush=True)
        sys.exit(0)
print(f"BENCH done {step} {time.time():.3f}", flush=True)
"""

REQUEUE_SCRIPT = """#!/bin/bash
#SBATCH --time=1 --signal=B:USR1@40 --requeue --open-mode=append --mem=300M
#SBATCH --output={log}
source {activate}
export BENCH_CKPT={ckpt}
python3 {program} {steps} &
prog=$!
forward() {{ kill -USR1 $prog; wait $prog; scontrol requeue $SLURM_JOB_ID; exit 0; }}
trap forward USR1
wait $prog
"""


def events(text: str) -> list[tuple[str, int, float]]:
    return [(k, int(s), float(t)) for k, s, t in re.findall(r"BENCH (\w+) (\d+) ([\d.]+)", text)]


def per_segment(evs: list[tuple[str, int, float]]) -> list[dict]:
    """Split the program's events at each start; gap and lost steps between consecutive segments."""
    segments: list[list[tuple[str, int, float]]] = []
    for ev in evs:
        if ev[0] == "start":
            segments.append([])
        if segments:
            segments[-1].append(ev)
    rows = []
    for i, seg in enumerate(segments):
        steps = [s for k, s, _ in seg if k == "step"]
        saved = [s for k, s, _ in seg if k == "saved"]
        row = {"segment": i + 1, "last_step": max(steps, default=None), "saved": max(saved, default=None)}
        row["lost"] = (row["last_step"] - row["saved"]) if steps and saved else None
        if i + 1 < len(segments):
            ends = [t for k, _, t in seg if k in ("exit", "step", "saved")]
            first = [t for k, _, t in segments[i + 1] if k == "step"]
            row["gap_s"] = (min(first) - max(ends)) if ends and first else None
        rows.append(row)
    return rows


def rv(env: dict, *args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def run_rv_chain(env: dict, segments: int, workdir: Path) -> list[dict]:
    proj = workdir / "proj"
    proj.mkdir()
    (proj / "program.py").write_text(PROGRAM)
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "b"],
    ):
        subprocess.run(["git", *args], cwd=proj, check=True)
    # Enough steps for the run to need every segment: ~80 steps fit in one (20 s at 4 steps/s).
    steps = str(80 * segments + 40)
    r = rv(env, "run", "-g", "0", "--mem", "300M", "--time", "1m", "--signal", "USR1@40", "--max-segments",
           str(segments), "-f", "--", "python3", "program.py", steps, cwd=proj)  # fmt: skip
    if r.returncode not in (0, 1):
        raise SystemExit(f"rv run failed ({r.returncode}): {r.stderr[-2000:]}")
    return per_segment(events(r.stdout))


def run_requeue_chain(env: dict, segments: int, workdir: Path) -> list[dict]:
    profile_env = {**os.environ, "SLURM_CONF": env["SLURM_CONF"]}
    program = workdir / "program.py"
    program.write_text(PROGRAM)
    log, ckpt = workdir / "requeue.log", workdir / "ckpt"
    activate = Path(env.get("RV_BENCH_ACTIVATE") or Path(sys.executable).parent / "activate")
    script = workdir / "requeue.sbatch"
    steps = 80 * segments + 40
    script.write_text(
        REQUEUE_SCRIPT.format(log=log, activate=activate, ckpt=ckpt, program=program, steps=steps)
    )
    submit = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=profile_env, capture_output=True, text=True, check=True
    )
    job = submit.stdout.strip().split(";")[0]
    deadline = time.time() + segments * 240
    while time.time() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.count("BENCH start") >= segments and "BENCH exit" in text.rsplit("BENCH start", 1)[1]:
            break
        if "BENCH done" in text:
            break
        time.sleep(2)
    subprocess.run(["scancel", job], env=profile_env, check=False)
    return per_segment(events(log.read_text()))[:segments]


def summary(name: str, rows: list[dict]) -> dict:
    gaps = [r["gap_s"] for r in rows if r.get("gap_s") is not None]
    lost = [r["lost"] for r in rows if r.get("lost") is not None]
    return {
        "name": name,
        "gap_median": statistics.median(gaps) if gaps else None,
        "gap_max": max(gaps) if gaps else None,
        "lost_total": sum(lost) if lost else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=5)
    ap.add_argument("--requeue-segments", type=int, default=3, help="0 skips the requeue alternative")
    args = ap.parse_args()
    state = Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster"))
    env = {**os.environ, "RV_CONFIG": os.environ.get("RV_CONFIG", str(state / "rv-config.toml"))}
    env["SLURM_CONF"] = str(state / "slurm.conf")
    pyenv = state / "pyenv" / "bin" / "activate"
    if pyenv.exists():
        env["RV_BENCH_ACTIVATE"] = str(pyenv)
    workdir = Path(tempfile.mkdtemp(prefix="rv-segments-"))
    os.chmod(workdir, 0o755)
    try:
        results = {"rv": run_rv_chain(env, args.segments, workdir)}
        if args.requeue_segments:
            results["requeue"] = run_requeue_chain(env, args.requeue_segments, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name, rows in results.items():
        print(f"\n{name}:  segment  last step  saved  lost  gap to next first step")
        for r in rows:
            gap = f"{r['gap_s']:.1f} s" if r.get("gap_s") is not None else "-"
            print(
                f"{'':>7}{r['segment']:>8} {r['last_step']!s:>10} {r['saved']!s:>6} {r['lost']!s:>5}  {gap}"
            )
    sums = {name: summary(name, rows) for name, rows in results.items()}
    print("\n" + json.dumps(sums, indent=1))
    if "requeue" in sums and sums["rv"]["gap_median"] and sums["requeue"]["gap_median"]:
        print(f"gap rv / requeue: {sums['rv']['gap_median'] / sums['requeue']['gap_median']:.2f}x (median)")


if __name__ == "__main__":
    main()
