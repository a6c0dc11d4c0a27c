"""How long the everyday commands take, side by side with a bare `ssh host squeue`.

    scripts/testcluster up
    .venv/bin/python benchmarks/cli.py [--runs 15] [--before /path/to/an/older/checkout]

Cases, measured in interleaved rounds (one of each per round, so load on this shared machine hits
them alike), each a whole process as a user types it:

  ssh squeue       ssh -F none ... HOST squeue: a fresh OpenSSH connection (the yardstick)
  ssh mux squeue   the same through an OpenSSH ControlMaster that is already up (for comparison)
  rv ps cold       `rv ps` with nothing of rv's running: no command server, no warm connection
                   (the first command of the day: Python imports everything, then connects)
  rv ps cold conn  `rv ps` with the command server up (it outlives connections: 30 minutes idle)
                   but no warm connection (the first command after a five-minute pause)
  rv ps warm at once  `rv ps` again at once (within ~10 ms of the last command's end, as in a
                   script): the agent the connection keeps started on the cluster was taken by the
                   last command, and its successor is still starting
  rv ps warm       `rv ps` again a second later (PAUSE_S: a person's pace), within RV_WARM_SECONDS
  rv status cold / warm
  rv ps direct     RV_WARM_SECONDS=0: no background process, connect in-process every time
  before: rv ps    with --before: the same command from another checkout (e.g. main), direct

and, locally: `rv --help` and `rv run --dry-run`, with the modules each imports.

Printed: the median and the spread (min-max) of wall seconds, and per case the median of the
per-round ratio to `ssh squeue` with its min-max. Targets (issue 13): rv ps and rv status <= 1.0x
cold, <= 0.5x warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PAUSE_S = 1.0  # between a command and the "warm" case: a person reads the output before typing again


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.removeprefix("export ").strip()
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k] = v.strip("'\"")
    return out


def timed(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    """Wall seconds of one successful run. The loopback Slurm is shared with other work on this
    machine and now and then times out (`Socket timed out on send/recv`): such a run is repeated
    (at most twice, said on stderr), never counted."""
    for _attempt in range(3):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
        took = time.perf_counter() - start
        if proc.returncode == 0:
            return took
        print(
            f"note: retrying ({proc.stderr.strip().splitlines()[-1:]}): {' '.join(cmd[:6])} ...",
            file=sys.stderr,
        )
    raise SystemExit(f"benchmark step failed 3 times: {' '.join(cmd)}\n{proc.stderr[-2000:]}")


def wait_server(runtime: Path) -> None:
    """Wait until the command server a cold command started is listening (it imports ~400 modules
    in the background after the command ends), so the next case finds it up."""
    for _ in range(500):
        if list(runtime.glob("cmd-*.pid")):
            return
        time.sleep(0.01)
    raise SystemExit(f"the command server did not start (see {runtime}/cmd-*.log)")


def stop_warm(runtime: Path, *, server: bool = False) -> None:
    """Stop the background connections this benchmark's rv commands started (by their pid files),
    and with ``server`` the command server too."""
    for f in runtime.glob("*.pid"):
        if f.name.startswith("cmd-") and not server:
            continue
        try:
            pid = int(f.read_text())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)


def imported(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, list[str]]:
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
    r = subprocess.run([sys.executable, "-c", probe, *args], env=env, cwd=cwd, capture_output=True, text=True)
    line = next(x for x in r.stderr.splitlines() if x.startswith("IMPORTS"))
    _, count, heavy = line.split()
    return int(count), [] if heavy == "-" else heavy.split(",")


def summary(name: str, values: list[float], ratios: list[float] | None) -> str:
    med = statistics.median(values)
    text = f"{name:<20} {med:6.3f} s  ({min(values):.3f}-{max(values):.3f})"
    if ratios:
        text += f"   {statistics.median(ratios):5.2f}x ssh  ({min(ratios):.2f}-{max(ratios):.2f})"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--before", type=Path, help="another checkout of rv to time `rv ps` from (PYTHONPATH)")
    args = ap.parse_args()
    # An installed rv has its bytecode compiled (pip does it); a checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would recompile every module on every command. Compile once first.
    for tree in (REPO_ROOT / "rv", *([args.before / "rv"] if args.before else [])):
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree)], check=True, capture_output=True)
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
    root = f"{tc['RV_TESTCLUSTER_REMOTE_ROOT']}/bench-cli-{os.getpid()}"
    # The `rv` program as installed (its front end hands commands to the command server), as a user
    # types it; `python -m rv` always runs in-process.
    rv = [str(Path(sys.executable).parent / "rv")]
    init = [
        *rv, "init", "--profile", "bench", "--host", "127.0.0.1", "--port", port, "--user", user,
        "--identity-file", key, "--known-hosts", known, "--remote-root", root, "--yes",
    ]  # fmt: skip
    timed(init, env)
    repo = work / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    ssh = [
        "ssh", "-F", "none", "-p", port, "-i", key, "-o", f"UserKnownHostsFile={known}",
        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", f"{user}@127.0.0.1",
    ]  # fmt: skip
    mux = [
        *ssh[:-1],
        "-o",
        f"ControlPath={work}/mux",
        "-o",
        "ControlMaster=auto",
        "-o",
        "ControlPersist=600",
        ssh[-1],
    ]
    direct_env = dict(env, RV_WARM_SECONDS="0")
    before_env = dict(direct_env, PYTHONPATH=str(args.before)) if args.before else None

    cases: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    timed([*mux, "true"], env)  # the master is up for the whole benchmark
    for _ in range(args.runs):
        row = {"ssh squeue": timed([*ssh, "squeue"], env), "ssh mux squeue": timed([*mux, "squeue"], env)}
        for cmd in ("ps", "status"):
            stop_warm(runtime, server=True)
            row[f"rv {cmd} cold"] = timed([*rv, cmd], env)
            wait_server(runtime)
            stop_warm(runtime)
            row[f"rv {cmd} cold conn"] = timed([*rv, cmd], env)
            row[f"rv {cmd} warm at once"] = timed([*rv, cmd], env)
            time.sleep(PAUSE_S)
            row[f"rv {cmd} warm"] = timed([*rv, cmd], env)
        row["rv ps direct"] = timed([*rv, "ps"], direct_env)
        if before_env is not None:
            row["before: rv ps"] = timed([*rv, "ps"], before_env)
        for name, value in row.items():
            cases.setdefault(name, []).append(value)
            ratios.setdefault(name, []).append(value / row["ssh squeue"])
    stop_warm(runtime, server=True)
    mux_stop = subprocess.run([*mux[:-1], "-O", "exit", mux[-1]], capture_output=True, text=True)
    if mux_stop.returncode != 0:
        print(f"note: could not stop the ssh master: {mux_stop.stderr.strip()}", file=sys.stderr)

    local: dict[str, list[float]] = {"rv --help": [], "rv run --dry-run": []}
    dry = [*rv, "run", "--dry-run", "-g", "1", "-t", "a6000", "--", "python", "train.py"]
    for _ in range(args.runs):
        local["rv --help"].append(timed([*rv, "--help"], env))
        local["rv run --dry-run"].append(timed(dry, env, cwd=repo))

    print(f"loopback cluster as {user}, {args.runs} interleaved rounds; median (min-max)")
    for name, values in cases.items():
        print(summary(name, values, ratios[name] if name != "ssh squeue" else None))
    print()
    for name, values in local.items():
        count, heavy = imported(
            ["--help"]
            if name == "rv --help"
            else ["run", "--dry-run", "-g", "1", "-t", "a6000", "--", "python", "train.py"],
            env,
            repo,
        )
        print(f"{summary(name, values, None)}   {count} modules; heavy ones: {', '.join(heavy) or 'none'}")
    stop_warm(runtime, server=True)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
