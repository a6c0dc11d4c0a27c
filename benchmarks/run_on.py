"""The edit-run loop in a held allocation: `rv run --on SESSION -f` to the program's first line, beside
`rv ssh SESSION -- CMD` (a step of the same job, no snapshot) and a plain `rv run -f` (through sbatch).

    scripts/testcluster up
    .venv/bin/python benchmarks/run_on.py [--rounds 3] [--profile testcluster]

Each case is timed from starting `rv` to the program's first line on rv's stdout, with rv's connection
warm (one untimed call first) and nothing changed in the project between rounds; the cases take turns
so that the machine's load falls on each alike. The session is `rv up --detach -g 0`, stopped at the
end. Prints the median of each and its ratio to `rv ssh`. The rv timed is the `rv` program beside this
Python (as a user types it: its front end hands each command to rv's command server, so no command
imports rv); `--python-m` times `python -m rv` instead, which pays the imports every time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "BENCH-FIRST"
SESSION = "bench-held"


def rv_program(python_m: bool) -> list[str]:
    """The `rv` a user types (its front end hands the command to rv's command server, imports done),
    or `python -m rv` (every command imports rv itself)."""
    script = Path(sys.executable).parent / "rv"
    return [sys.executable, "-m", "rv"] if python_m or not script.exists() else [str(script)]


RV: list[str] = []


def first_line(env: dict, args: list[str], cwd: Path) -> float:
    """Seconds from starting rv to MARK on its stdout; rv is then left to end by itself."""
    start = time.monotonic()
    proc = subprocess.Popen([*RV, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if MARK in line:
            took = time.monotonic() - start
            proc.communicate(timeout=300)
            return took
    _, err = proc.communicate(timeout=300)
    raise SystemExit(f"rv {' '.join(args)}: no {MARK} line (exit {proc.returncode}): {err[-500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--python-m", action="store_true", help="run `python -m rv` instead of the rv program")
    o = ap.parse_args()
    RV[:] = rv_program(o.python_m)
    env = dict(os.environ)
    if o.profile:
        env["RV_PROFILE"] = o.profile
    project = Path(tempfile.mkdtemp(prefix="rv-bench-on-"))
    (project / "hello.txt").write_text("hello\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "."], ["-c", "user.email=b@b", "-c", "user.name=b",
                                                             "commit", "-q", "-m", "init"]):  # fmt: skip
        subprocess.run(["git", *cmd], cwd=project, check=True)
    up = ["up", "--detach", "-g", "0", "--mem", "300M", "--time", "30m", "--name", SESSION]
    r = subprocess.run([*RV, *up], cwd=project, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"rv up --detach failed: {r.stderr}")
    cases = {
        "rv ssh SESSION -- CMD": lambda i: ["ssh", SESSION, "--", "echo", MARK],
        "rv run --on SESSION -f": lambda i: [
            "run",
            "--on",
            SESSION,
            "-f",
            "--name",
            f"bench-on-{i}",
            "--",
            "echo",
            MARK,
        ],
        "rv run -f (sbatch)": lambda i: [
            "run",
            "-f",
            "-g",
            "0",
            "--mem",
            "200M",
            "--time",
            "5m",
            "--name",
            f"bench-plain-{i}",
            "--",
            "echo",
            MARK,
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for argv in cases.values():  # warm: the connection, the store, the environment
            first_line(env, argv(0), project)
        for i in range(1, o.rounds + 1):
            for name, argv in cases.items():
                times[name].append(first_line(env, argv(i), project))
    finally:
        subprocess.run([*RV, "stop", SESSION], cwd=project, env=env, capture_output=True)
    base = statistics.median(times["rv ssh SESSION -- CMD"])
    load = os.getloadavg()
    loads = " ".join(f"{x:.2f}" for x in load)
    print(f"load average {loads} on {os.cpu_count()} CPUs; {o.rounds} rounds; {' '.join(RV)}")
    for name, ts in times.items():
        med = statistics.median(ts)
        shown = " ".join(f"{t:.2f}" for t in ts)
        print(f"{name:26s} median {med:5.2f} s  ({shown})  {med / base:4.2f}x rv ssh")


if __name__ == "__main__":
    main()
