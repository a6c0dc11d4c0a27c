"""Issue 9 on the real clusters: runs that outlive their job.

The chain test runs on the `bare` layout (no accounting, one mixed partition, slurmctld forgets jobs
after 10 s), where only rv's own records can tell what happened; the rest on the default layout.
Everything runs as the non-root cluster user.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from projects import git_project, wait_for

REPO = Path(__file__).resolve().parents[2]
SLURM_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def grpo_project(tmp_path: Path) -> Path:
    """A user's repo holding the trainer and the example, as it would be synced."""
    proj = tmp_path / "grpo"
    shutil.copytree(REPO / "rv_train", proj / "rv_train", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "examples" / "grpo", proj / "examples" / "grpo")
    return git_project(proj, {})


def submitted(result: subprocess.CompletedProcess) -> tuple[str, str]:
    """(run name, first job id) from `rv run`'s output."""
    assert result.returncode == 0, result.stderr[-3000:]
    m = re.search(r"submitted run (\S+): job (\d+)", result.stderr)
    assert m, result.stderr
    return m.group(1), m.group(2)


def runs_json(run_rv, all_: bool = True) -> dict[str, dict]:
    r = run_rv("ps", *(["-a"] if all_ else []), "--json")
    assert r.returncode == 0, r.stderr
    return {row["name"]: row for row in json.loads(r.stdout) if row["run_id"]}


def run_dir_of(remote_root: str, name: str) -> Path:
    runs = (Path(remote_root) / "runs").iterdir()
    dirs = [p for p in runs if json.loads((p / "run.json").read_text())["name"] == name]
    assert len(dirs) == 1, dirs
    return dirs[0]


# --- a chain of segments, to the end, with nobody watching ------------------------------------------


# A busy machine starts each segment's four ranks slowly (20 s of a segment's 20 s of training, at a
# load of 4 on two cores): then many more segments, each a minute, than pytest's 10 minutes allow.
@pytest.mark.timeout(1800)
def test_grpo_on_two_nodes_runs_as_a_chain_of_segments_to_its_last_step(run_rv_bare, tmp_path):
    proj = grpo_project(tmp_path)
    # 1-minute jobs (Slurm's shortest), the stop 40 s before the limit: each segment trains about
    # 20 s (50-120 steps on this machine, by load; fewer when other work shares its two cores), then
    # saves, and the job submits the next: 300 steps take 2 to 7 segments on a quiet machine, and
    # up to 30 are allowed so that a busy one still ends the chain. Nothing of rv runs in between:
    # the first `rv run` only submits, and the test follows later with `rv logs -f`.
    r = run_rv_bare(
        "run", "-g", "4", "-t", "a6000", "--mem", "3G", "--time", "1m", "--signal", "USR1@40",
        "--max-segments", "30", "--name", "chain", "--",
        "torchrun", "examples/grpo/train.py", "--steps", "300", "--save-every", "10", cwd=proj,
    )  # fmt: skip
    name, _ = submitted(r)
    follow = run_rv_bare("logs", "-f", name, cwd=proj, timeout=1800)
    assert follow.returncode == 0, follow.stderr[-3000:]
    out = follow.stdout
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    # At least one resume (>= 2 segments): a quiet machine trains ~150 steps a segment, a loaded one 50.
    assert len(resumed) >= 1 and resumed == sorted(resumed), out[-4000:]
    assert re.search(r"step\s+300\b", out) and "Traceback" not in out, out[-4000:]
    separators = re.findall(r"── rv: segment (\d+)/30 · job (\d+)", out)
    assert [int(k) for k, _ in separators] == list(range(1, len(separators) + 1)) and len(separators) >= 2
    err = run_rv_bare("logs", name, "--err", cwd=proj)
    # torchrun's agents meet at an exit barrier in a store the first node's agent holds; when that
    # agent is gone first, the other logs the error with a traceback and still exits 0 (a race in
    # torch, pytorch/pytorch#69520, seen here under load). Only the program's own tracebacks count.
    agent_log = "torch/distributed/elastic/agent/server/api.py:"
    agents = [line for line in err.stdout.splitlines() if agent_log in line]
    assert not agents or "Error waiting on exit barrier" in "\n".join(agents), agents[:20]
    program = "\n".join(line for line in err.stdout.splitlines() if line not in agents)
    assert "Traceback" not in program and "SignalException" not in program, program[-3000:]
    # Without accounting (sacct fails here) and long after slurmctld forgot the jobs, rv ps -a shows
    # the chain from its own records.
    time.sleep(12)
    row = runs_json(run_rv_bare)[name]
    assert (row["state"], row["exit_code"], row["max_segments"]) == ("COMPLETED", 0, 30)
    assert row["segment"] == len(separators) and len(row["jobs"]) == row["segment"]
    assert row["checkpoint_step"] is not None
    table = run_rv_bare("ps", "-a").stdout
    # An ended run's SEG is how many segments it ran (not "5/10", which read as stopped early).
    assert re.search(rf"{name}\s+{row['segment']}\s+COMPLETED\s+0", table), table


# --- what never continues, and what is never signalled ---------------------------------------------

PLAIN = """\
import signal, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a program that ignores signals, knows nothing of rv
time.sleep(float(sys.argv[1]))
print("plain program done", flush=True)
"""
CRASH = "import sys\nprint('about to crash', flush=True)\nsys.exit(5)\n"


def test_a_plain_program_runs_to_its_own_end_and_a_crash_is_not_continued(run_rv, tmp_path):
    proj = git_project(tmp_path / "p", {"plain.py": PLAIN, "crash.py": CRASH})
    plain = run_rv(
        "run", "-g", "0", "--mem", "300M", "--time", "1m", "--signal", "USR1@50", "-f", "--",
        "python3", "plain.py", "25", cwd=proj, timeout=300,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "plain program done" in plain.stdout
    assert "no process handles USR1; the program runs on until the limit" in plain.stderr
    crash = run_rv("run", "-g", "0", "--mem", "300M", "-f", "--", "python3", "crash.py", cwd=proj)
    assert crash.returncode == 5, crash.stderr[-2000:]
    runs = runs_json(run_rv)
    name = re.search(r"submitted run (\S+): job \d+", crash.stderr).group(1)  # submitted() wants exit 0
    assert (runs[name]["state"], runs[name]["exit_code"], runs[name]["segment"]) == ("FAILED", 5, 1)


# --- names and checkpoint folders ------------------------------------------------------------------

SLEEPER = """\
import os, time
print(os.environ["RV_CHECKPOINT_DIR"], flush=True)
time.sleep(float(os.environ.get("SLEEP", "1")))
"""


def test_unnamed_runs_get_their_own_checkpoints_and_a_live_name_is_refused(run_rv, remote_root, tmp_path):
    proj = git_project(tmp_path / "p", {"train.py": SLEEPER})
    first = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "train.py", cwd=proj)
    second = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "train.py", cwd=proj)
    # The program's last line; the job's log ends with rv's own ("rv: run ... ended after segment 1").
    dirs = [[x for x in r.stdout.splitlines() if not x.startswith("rv: ")][-1] for r in (first, second)]
    assert first.returncode == second.returncode == 0
    assert dirs[0] != dirs[1] and all("/checkpoints/" in d for d in dirs)
    assert submitted(first)[0].startswith("train-") and submitted(first)[0] != submitted(second)[0]

    live = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "exp", "--setup", "export SLEEP=120", "--",
        "python3", "train.py", cwd=proj,
    )  # fmt: skip
    _, job = submitted(live)

    def sent() -> tuple[list[str], ...]:
        root = Path(remote_root)
        return tuple(
            sorted(p.name for p in root.glob(pattern))
            for pattern in (
                "runs/*",
                "store.git/objects/pack/*",
                "store.git/refs/rv/snapshots/*",
                "snapshots/*",
            )
        )

    before = sent()
    (proj / "train.py").write_text(SLEEPER + "# edited: a new snapshot would have to be sent\n")
    again = run_rv("run", "-g", "0", "--mem", "200M", "--name", "exp", "--", "python3", "train.py", cwd=proj)
    assert again.returncode == 2, again.stderr
    assert f"a run named 'exp' is still live (job {job}); nothing was sent" in again.stderr
    assert sent() == before  # no run, no pack, no snapshot
    stop = run_rv("stop", "exp")
    assert stop.returncode == 0 and f"cancelled job {job}" in stop.stderr


# --- requeue -------------------------------------------------------------------------------------

STEPPER = """\
import json, os, signal, sys, time
ckpt = os.environ["RV_CHECKPOINT_DIR"]
state = os.path.join(ckpt, "state.json")
step = json.load(open(state))["step"] if os.path.exists(state) else 0
print(f"start at step {step}, secret {os.environ.get('MY_TEST_SECRET', 'MISSING')}", flush=True)
while step < int(sys.argv[1]):
    time.sleep(0.5)
    step += 1
    tmp = state + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.replace(tmp, state)
print(f"done at step {step}", flush=True)
"""


def scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, env=SLURM_ENV, timeout=30)


def test_scontrol_requeue_resumes_the_run_with_its_secrets(run_rv, remote_root, cluster, tmp_path):
    proj = git_project(tmp_path / "p", {"stepper.py": STEPPER})
    assert run_rv("env", "set", "MY_TEST_SECRET=requeue-me").returncode == 0
    r = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "rq", "--", "python3", "stepper.py", "40", cwd=proj
    )
    name, job = submitted(r)
    rdir = run_dir_of(remote_root, name)

    def steps_done() -> int:
        found = list((Path(remote_root) / "checkpoints").rglob("state.json"))
        return json.loads(found[0].read_text())["step"] if found else 0

    wait_for(lambda: steps_done() >= 6, 120, "a few steps")
    env = {**SLURM_ENV, "SLURM_CONF": cluster["SLURM_CONF"]}
    assert subprocess.run(["scontrol", "requeue", job], env=env).returncode == 0

    # A requeued job waits ~2 minutes before it may start again; an admin can let it start at once.
    def state() -> str:
        return subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True
        ).stdout

    wait_for(lambda: "PENDING" in state(), 60, "the requeue")
    assert (rdir / "secrets.env").exists()  # kept for the rerun
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    follow = run_rv("logs", "-f", name, cwd=proj, timeout=300)
    assert follow.returncode == 0, follow.stderr[-2000:]
    starts = re.findall(r"start at step (\d+), secret (\S+)", follow.stdout)
    assert len(starts) == 2 and starts[0] == ("0", "requeue-me"), follow.stdout
    assert int(starts[1][0]) >= 6 and starts[1][1] == "requeue-me"  # resumed, with its secrets
    assert "done at step 40" in follow.stdout
    record = json.loads((rdir / "seg" / "1.json").read_text())
    assert (record["attempt"], record["reason"]) == (1, "finished")
    assert not (rdir / "secrets.env").exists()


# --- secrets live exactly as long as the run --------------------------------------------------------


def kill_batch_shell(job: str) -> None:
    """SIGKILL the job's batch shell, as a node crash or the OOM killer would: no trap runs.

    (`scancel --signal=KILL` is not that: Slurm turns it into a cancel, TERM first, and the trap runs.)
    The nodes are this machine, so the shell is found by its environment.
    """
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"slurm_script" in cmdline and f"SLURM_JOB_ID={job}".encode() in environ:
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no batch shell found for job {job}")


@pytest.fixture
def v100_down(cluster):
    """The default layout's v100 partition down for one test: jobs sent there stay pending."""
    env = {**SLURM_ENV, "SLURM_CONF": cluster["SLURM_CONF"]}
    partition = ["scontrol", "update", "PartitionName=gpu-v100"]
    subprocess.run([*partition, "State=DOWN"], env=env, check=True)
    yield
    subprocess.run([*partition, "State=UP"], env=env, check=True)


def test_no_secrets_file_remains_after_any_way_a_run_can_end(
    run_rv, remote_root, cluster, tmp_path, v100_down
):
    proj = git_project(tmp_path / "p", {"stepper.py": STEPPER, "crash.py": CRASH})
    assert run_rv("env", "set", "MY_TEST_SECRET=short-lived").returncode == 0
    env = {**SLURM_ENV, "SLURM_CONF": cluster["SLURM_CONF"]}

    def secrets_of(name):
        return run_dir_of(remote_root, name) / "secrets.env"

    def start(name, *cmd, pending=False):
        # A pending run goes to the v100 partition, which is down: `scontrol hold` would be a race, as
        # it also "holds" a job the scheduler has already started, without a word.
        where = ("-g", "1", "-t", "v100") if pending else ("-g", "0")
        r = run_rv("run", *where, "--mem", "200M", "--name", name, "--", *cmd, cwd=proj)
        _, job = submitted(r)
        if pending:
            state = subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True
            )
            assert state.stdout.strip() == "PENDING", state
        assert secrets_of(name).exists()
        return job

    # Finished and crashed: the job removes them.
    for name, cmd in (("finished", ("python3", "stepper.py", "2")), ("crashed", ("python3", "crash.py"))):
        start(name, *cmd)
        run_rv("logs", "-f", name, cwd=proj, timeout=300)
        assert not secrets_of(name).exists(), name

    # rv stop, while running and while still pending: rv stop removes them itself.
    def running(name):
        return runs_json(run_rv, all_=False).get(name, {}).get("state") == "RUNNING"

    start("stopped-running", "python3", "stepper.py", "200")
    wait_for(lambda: running("stopped-running"), 60, "running")
    assert run_rv("stop", "stopped-running").returncode == 0
    start("stopped-pending", "python3", "stepper.py", "200", pending=True)
    assert run_rv("stop", "stopped-pending").returncode == 0
    for name in ("stopped-running", "stopped-pending"):
        assert not secrets_of(name).exists(), name
    # scancel while running: the job's own exit trap removes them.
    job = start("scancelled-running", "python3", "stepper.py", "200")
    wait_for(lambda: running("scancelled-running"), 60, "running")
    subprocess.run(["scancel", job], env=env, check=True)
    wait_for(lambda: not secrets_of("scancelled-running").exists(), 60, "the trap to remove the secrets")
    # scancel while pending, and a job killed too hard to run its trap: the next rv command does it.
    # Every rv command that connects sweeps, so from here to the check only Slurm's own tools run.
    killed = start("killed", "python3", "stepper.py", "200")
    wait_for(lambda: running("killed"), 60, "running")
    pending = start("scancelled-pending", "python3", "stepper.py", "200", pending=True)
    subprocess.run(["scancel", pending], env=env, check=True)
    kill_batch_shell(killed)

    def gone() -> bool:
        queue = subprocess.run(
            ["squeue", "-h", "-j", f"{killed},{pending}", "-o", "%i"], env=env, capture_output=True, text=True
        )
        return queue.returncode == 0 and not queue.stdout.strip()

    wait_for(gone, 60, "both jobs to leave the queue")
    assert secrets_of("killed").exists() and secrets_of("scancelled-pending").exists()
    swept = run_rv("ps")
    assert "removed the secrets of run killed" in swept.stderr
    assert "removed the secrets of run scancelled-pending" in swept.stderr
    assert not list(Path(remote_root).rglob("secrets.env"))
    # Nor the jobs' saved environments (for rv ssh), which hold the secrets too.
    assert not list(Path(remote_root).rglob("env.sh"))
    rows = runs_json(run_rv)
    assert (
        rows["killed"]["state"] in ("LOST", "CANCELLED") and rows["stopped-pending"]["state"] == "CANCELLED"
    )


# --- rv run --from RUN@STEP ---------------------------------------------------------------------------


def tree_state(path: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in path.rglob("*")
        if p.is_file()
    }


def test_from_run_at_step_starts_there_and_leaves_the_run_as_it_was(run_rv, remote_root, tmp_path):
    proj = grpo_project(tmp_path)
    base = run_rv(
        "run", "-g", "0", "--mem", "2G", "--name", "base", "-f", "--", "python3", "examples/grpo/train.py",
        "--steps", "20", "--save-every", "5", "--keep-last", "10", cwd=proj, timeout=600,
    )  # fmt: skip
    assert base.returncode == 0, base.stderr[-3000:]
    ckpt = next(Path(remote_root).glob("checkpoints/*/base"))
    before = tree_state(ckpt)
    assert {p.split("/")[0] for p in before if p.startswith("step_")} >= {"step_0000010", "step_0000015"}
    listing = run_rv("ckpt", "ls", "base")
    assert re.search(r"\b15\s+\S+ \S+\s+\S+ \S+\s+complete", listing.stdout), listing.stdout
    branch = run_rv(
        "run", "-g", "0", "--mem", "2G", "--name", "branch", "--from", "base@12", "-f", "--", "python3",
        "examples/grpo/train.py", "--steps", "14", "--save-every", "5", cwd=proj, timeout=600,
    )  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-3000:]
    assert "branch starts from base at step 10" in branch.stderr
    assert re.search(r"resumed from \S+step_0000010 at step 10", branch.stdout), branch.stdout[-3000:]
    assert tree_state(ckpt) == before  # base's checkpoints are as they were
    pulled = run_rv("ckpt", "pull", "base@12", str(tmp_path / "got"), cwd=proj)
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "got" / "COMPLETE").exists() and (tmp_path / "got" / "state.json").exists()
