"""Job environments (issue 11), side by side with what a user would do by hand.

    scripts/testcluster up
    .venv/bin/python benchmarks/envs.py [--runs 5]

Against the default loopback cluster, as its user, with a remote root of the benchmark's own:

  submit, env exists   `rv run` of a project whose environment is already built (the key check)
  submit, --env none   the same `rv run` with no environment at all
  rv venv build cold   `rv venv build --force` with uv's cache emptied first: resolve, download, install
  uv by hand cold      `ssh HOST 'uv venv X && uv pip install --python X/bin/python -r req.txt'` with an
                       empty cache of its own (same uv binary, same index): what a user types
  second project       `rv venv build` in another repo with the same requirements.txt: nothing built

Cases are interleaved per round. Printed: medians with min-max, and the ratios. Targets: the key
check adds at most one round trip to `rv run`; a cold build <= 1.1x uv by hand; a second project 0 s
of build.
"""

from __future__ import annotations

import argparse
import os
import shlex
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

# A small real project: pure-Python packages and binary wheels (numpy, pandas), no torch.
REQUIREMENTS = """\
numpy==2.1.3
pandas==2.2.3
requests==2.32.3
pyyaml==6.0.2
tqdm==4.66.5
tabulate==0.9.0
"""


def make_repo(path: Path) -> Path:
    path.mkdir()
    (path / "requirements.txt").write_text(REQUIREMENTS)
    (path / "main.py").write_text("import requests, yaml\n")
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=path, check=True)
    return path


def med(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} s  ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    state = Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster"))
    tc = read_env(state / "env")
    user, port, key, known = (tc["RV_TESTCLUSTER_USER"], tc["RV_TESTCLUSTER_SSH_PORT"],
                              tc["RV_TESTCLUSTER_KEY"], tc["RV_TESTCLUSTER_KNOWN_HOSTS"])  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="rv-bench-envs-", dir="/tmp"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    home = work / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(HOME=str(home), RV_CONFIG=str(home / "rv.toml"), NO_COLOR="1", RV_RUNTIME_DIR=str(runtime))
    root = f"{tc['RV_TESTCLUSTER_REMOTE_ROOT']}/bench-envs-{os.getpid()}"
    rv = [sys.executable, "-m", "rv"]
    setup = f"source {tc['RV_TESTCLUSTER_PYENV']}/bin/activate"
    timed([*rv, "init", "--profile", "bench", "--host", "127.0.0.1", "--port", port, "--user", user,
           "--identity-file", key, "--known-hosts", known, "--remote-root", root, "--setup", setup,
           "--yes"], env)  # fmt: skip
    ssh = ["ssh", "-F", "none", "-p", port, "-i", key, "-o", f"UserKnownHostsFile={known}",
           "-o", "BatchMode=yes", f"{user}@127.0.0.1"]  # fmt: skip
    repo, other = make_repo(work / "repo"), make_repo(work / "other")
    timed([*rv, "venv", "build"], env, cwd=repo)  # installs uv once; builds the environment
    uv = f"{root}/tools/uv/bin/uv"
    cache = Path(root) / "cache" / "uv"
    by_hand = "; ".join([
        "set -e", setup, "d=$(mktemp -d /tmp/rv-bench-hand.XXXX)", "cd $d",
        f"printf %s {shlex.quote(REQUIREMENTS)} > req.txt",
        "export UV_CACHE_DIR=$d/cache UV_SYSTEM_CERTS=1",
        f'{uv} venv -q --python "$(command -v python3)" v',
        f"{uv} pip install -q --python v/bin/python -r req.txt", "rm -rf $d",
    ])  # fmt: skip
    rows: dict[str, list[float]] = {}
    for _ in range(args.runs):
        row = {}
        row["submit, env exists"] = timed([*rv, "run", "-g", "0", "--", "python", "main.py"], env, cwd=repo)
        row["submit, --env none"] = timed(
            [*rv, "run", "-g", "0", "--env", "none", "--", "python", "main.py"], env, cwd=repo
        )
        shutil.rmtree(cache, ignore_errors=True)
        row["rv venv build cold"] = timed([*rv, "venv", "build", "--force"], env, cwd=repo)
        row["uv by hand cold"] = timed([*ssh, by_hand], env)
        start = time.perf_counter()
        second = subprocess.run([*rv, "venv", "build"], env=env, cwd=other, capture_output=True, text=True)
        row["second project"] = time.perf_counter() - start
        assert second.returncode == 0 and "building" not in second.stderr, second.stderr
        for name, value in row.items():
            rows.setdefault(name, []).append(value)
    stop_warm(runtime, server=False)
    subprocess.run([*rv, "stop", "--all"], env=env, cwd=repo, capture_output=True)
    print(f"{args.runs} rounds, medians (min-max):")
    for name, values in rows.items():
        print(f"  {name:<20} {med(values)}")
    ratio = [a / b for a, b in zip(rows["rv venv build cold"], rows["uv by hand cold"], strict=True)]
    extra = [a - b for a, b in zip(rows["submit, env exists"], rows["submit, --env none"], strict=True)]
    print(f"cold build / uv by hand: {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})")
    print(f"submit with an existing env - without: {statistics.median(extra) * 1000:+.0f} ms "
          f"({min(extra) * 1000:+.0f} to {max(extra) * 1000:+.0f})")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
