"""The start of a run in a container (issue 43), side by side with the same run without one.

    scripts/testcluster up
    .venv/bin/python benchmarks/containers.py [--runs 5]

Against the default loopback cluster, as its user, with a remote root of the benchmark's own, the
same `rv run -g 0 --env none -f -- python3 first.py` three ways, interleaved per round:

  no container   the cluster's python3 (the jobs' venv of the profile's setup line)
  ch-run dir     `--container <the test image, a directory>` (Charliecloud)
  ch-run sqfs    `--container <the test image, SquashFS>` (Charliecloud, mounted with squashfuse)
  docker://      `--container docker://<the loopback registry's copy of the test image>`: pulled by
                 ch-image and squashed by ch-convert on the first run (measured apart: the pull paid
                 once), found in the remote root's image cache by every later run

Measured: seconds from `rv run` starting to the program's first line (the program prints its clock;
the loopback cluster is this machine, one clock). Printed: medians with min-max, and the difference
each container makes, and the first docker:// run (with its pull) against the later ones.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import timed
from loopback import read_env, stop_warm

FIRST = "import time\nprint('BENCH first %.3f' % time.time(), flush=True)\n"


def med(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} s  ({min(values):.3f}-{max(values):.3f})"


def to_first_line(rv: list[str], args: list[str], env: dict[str, str], repo: Path) -> float:
    start = time.time()
    r = subprocess.run([*rv, "run", *args], env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    m = re.search(r"^(?:\[\d+\] )?BENCH first (\d+\.\d+)$", r.stdout, re.M)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"rv run {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
    return float(m[1]) - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    state = Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster"))
    tc = read_env(state / "env")
    user, port, key, known = (tc["RV_TESTCLUSTER_USER"], tc["RV_TESTCLUSTER_SSH_PORT"],
                              tc["RV_TESTCLUSTER_KEY"], tc["RV_TESTCLUSTER_KNOWN_HOSTS"])  # fmt: skip
    images = {"ch-run dir": tc["RV_TESTCLUSTER_IMAGE"], "ch-run sqfs": tc["RV_TESTCLUSTER_IMAGE_SQFS"],
              "docker://": "docker://" + tc["RV_TESTCLUSTER_REGISTRY_IMAGE"]}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="rv-bench-containers-", dir="/tmp"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    home = work / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1", RV_RUNTIME_DIR=str(runtime))
    root = f"{tc['RV_TESTCLUSTER_REMOTE_ROOT']}/bench-containers-{os.getpid()}"
    rv = [sys.executable, "-m", "rv"]
    setup = f"source {tc['RV_TESTCLUSTER_PYENV']}/bin/activate"
    timed([*rv, "init", "--profile", "bench", "--host", "127.0.0.1", "--port", port, "--user", user,
           "--identity-file", key, "--known-hosts", known, "--remote-root", root, "--setup", setup,
           "--yes"], env)  # fmt: skip
    repo = work / "repo"
    repo.mkdir()
    (repo / "first.py").write_text(FIRST)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    common = ["-g", "0", "--mem", "300M", "--env", "none", "-f"]
    # A first run of each sends the snapshot and the runtime files: not measured.
    to_first_line(rv, [*common, "--", "python3", "first.py"], env, repo)
    # The registry's image: its first run pulls it (the remote root is the benchmark's own, so the
    # cache starts empty); every later run finds it.
    pull_run = to_first_line(
        rv, [*common, "--container", images["docker://"], "--", "python3", "first.py"], env, repo
    )
    rows: dict[str, list[float]] = {}
    for _ in range(args.runs):
        rows.setdefault("no container", []).append(
            to_first_line(rv, [*common, "--", "python3", "first.py"], env, repo)
        )
        for name, image in images.items():
            rows.setdefault(name, []).append(
                to_first_line(rv, [*common, "--container", image, "--", "python3", "first.py"], env, repo)
            )
    timed([*rv, "gc", "--older-than", "0"], env)  # the pulled image (hundreds of MB) goes with the runs
    stop_warm(runtime, server=False)
    print(f"{args.runs} rounds, seconds from `rv run -f` to the program's first line, medians (min-max):")
    for name, values in rows.items():
        print(f"  {name:<14} {med(values)}")
    for name in images:
        extra = [a - b for a, b in zip(rows[name], rows["no container"], strict=True)]
        print(
            f"{name} - no container: {statistics.median(extra):+.3f} s "
            f"({min(extra):+.3f} to {max(extra):+.3f})"
        )
    later = rows["docker://"]
    print(
        f"docker:// first run, pull included: {pull_run:.3f} s; later runs (cached) median "
        f"{statistics.median(later):.3f} s: the pull cost {pull_run - statistics.median(later):+.3f} s, once"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
