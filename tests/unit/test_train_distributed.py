"""Two real ranks on CPU/gloo under torchrun: DDP and FSDP learn, ranks agree on every stop, a signal to
the torchrun agent saves and resumes exactly. Budgets are in steps, never seconds."""

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
import torch.multiprocessing as mp
from train_helpers import (
    HELPERS,
    REPO,
    env_for_ranks,
    explain,
    fsdp_generation_worker,
    one_rank,  # noqa: F401  (a fixture)
    read_jsonl,
    summary,
    torchrun,
    torchrun_cmd,
)

from rv_train import EXIT_ZERO_REWARD
from rv_train.checkpoint import COMPLETE, PREEMPTED
from rv_train.trainer import main

pytestmark = pytest.mark.slow

STEP_BUDGET = 150  # the notes measured 0.98 at step 100 for 2 ranks; we see 0.9 near step 66
LEARN = ["--steps", str(STEP_BUDGET), "--stop-at-reward", "0.9", "--save-every", "0"]


def _learned(output_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, explain(proc)
    result = summary(output_dir)
    rows = read_jsonl(output_dir / "metrics.jsonl")
    assert rows[0]["reward_mean"] < 0.2  # it starts from chance...
    assert result["reason"] == "reward target" and result["reward_mean"] >= 0.9  # ...and learns in budget
    assert result["step"] <= STEP_BUDGET
    assert result["world_size"] == 2
    assert len(result["param_checksums"]) == 2 and len(set(result["param_checksums"])) == 1
    return result


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    # Through examples/grpo/train.py from the repo root, the way the README launches it.
    cmd = torchrun_cmd(2, *LEARN, "--output-dir", str(out))
    cmd[cmd.index("-m", 3) : cmd.index("-m", 3) + 2] = ["examples/grpo/train.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=env_for_ranks(), capture_output=True, text=True, timeout=300)
    return out, proc


def test_ddp_reaches_the_reward_target_with_identical_ranks(ddp_run):
    out, proc = ddp_run
    _learned(out, proc)
    assert "rv_train: 2 rank(s), gloo on cpu, strategy ddp" in proc.stdout


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, torchrun(2, *LEARN, "--strategy", "fsdp", "--output-dir", str(out))


def test_fsdp_reaches_the_reward_target_with_identical_ranks(fsdp_run):
    out, proc = fsdp_run
    result = _learned(out, proc)
    assert result["strategy"] == "fsdp"


def test_fsdp_resumes_from_sharded_checkpoints_exactly(fsdp_run, tmp_path):
    reference, _ = fsdp_run
    args = [*LEARN, "--strategy", "fsdp", "--output-dir", str(tmp_path)]
    first = torchrun(2, *[a if a != str(STEP_BUDGET) else "20" for a in args])  # stop at step 20
    assert first.returncode == 0, explain(first)
    assert summary(tmp_path)["step"] == 20
    resumed = _learned(tmp_path, torchrun(2, *args))
    assert resumed["resumes"] == 1
    assert resumed["param_checksums"] == summary(reference)["param_checksums"]


@pytest.mark.usefixtures("one_rank")
def test_a_two_rank_checkpoint_resumes_on_one_rank(ddp_run, tmp_path):
    # The data position is global and DCP reshards, so the world size may change between jobs.
    source, _ = ddp_run
    shutil.copytree(source / "checkpoints", tmp_path / "checkpoints")
    step = summary(source)["step"]
    assert main(["--steps", str(step + 2), "--output-dir", str(tmp_path)]) == 0
    result = summary(tmp_path)
    assert result["step"] == step + 2 and result["resumes"] == 1 and result["world_size"] == 1


def _our_processes(marker: str) -> list[int]:
    """Pids whose command line mentions this test's own folder: workers left behind would show here."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_sigusr1_to_torchrun_saves_marks_and_resumes_exactly(ddp_run, tmp_path):
    reference, _ = ddp_run
    out = tmp_path / "run"
    args = [*LEARN, "--output-dir", str(out)]
    agent = subprocess.Popen(
        torchrun_cmd(2, *args, signals=True),
        cwd=REPO,
        env=env_for_ranks(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or len(read_jsonl(out / "metrics.jsonl")) < 3:
            assert agent.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.2)
        agent.send_signal(signal.SIGUSR1)
        log, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    # torchrun itself exits 1 (it raises SignalException); the workers saved and exited 0.
    assert "stopped by SIGUSR1" in log, log[-3000:]
    stopped = summary(out)
    assert stopped["reason"] == "signal SIGUSR1" and stopped["exit_code"] == 0
    step = stopped["step"]
    assert step < summary(reference)["step"], "the signal came too late to test a resume"
    marker = json.loads((out / "checkpoints" / PREEMPTED).read_text())
    assert marker["step"] == step
    assert (out / "checkpoints" / f"step_{step:07d}" / COMPLETE).is_file()
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert _our_processes(str(out)) == []  # no orphaned workers

    proc = torchrun(2, *args)
    resumed = _learned(out, proc)
    assert f"resumed from {out / 'checkpoints' / f'step_{step:07d}'}" in proc.stdout
    assert not (out / "checkpoints" / PREEMPTED).exists()
    assert resumed["resumes"] == 1
    assert resumed["param_checksums"] == summary(reference)["param_checksums"]  # bitwise the same run
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, resumed["step"] + 1))


def test_circuit_breaker_stops_every_rank_with_its_exit_code(tmp_path):
    proc = torchrun(
        2,
        "--task",
        f"{HELPERS}:ZeroReward",
        "--breaker-steps",
        "3",
        "--steps",
        "50",
        "--output-dir",
        str(tmp_path),
    )
    assert proc.returncode != 0
    exit_codes = re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", proc.stderr)  # torchrun's per-rank report
    assert exit_codes == [str(EXIT_ZERO_REWARD)] * 2, explain(proc)  # both ranks, same decision
    result = summary(tmp_path)
    assert result["exit_code"] == EXIT_ZERO_REWARD and result["step"] == 3
    assert (tmp_path / "checkpoints" / "step_0000003" / COMPLETE).is_file()
    assert "circuit breaker: the mean reward was 0 for 3 steps in a row" in proc.stderr


def test_fsdp_generation_with_ranks_finishing_at_different_lengths(tmp_path):
    mp.start_processes(
        fsdp_generation_worker,
        args=(2, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["length"] for r in results] == [8, 1]  # rank 0 ran 8 decode steps, rank 1 one: no deadlock
    assert all(r["same_as_unsharded"] for r in results)  # bitwise the samples of the plain model
    assert all(r["grad_finite"] for r in results)
