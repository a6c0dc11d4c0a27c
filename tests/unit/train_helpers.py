"""Shared helpers for the rv_train tests: launch real trainer processes, read their outputs.

Multi-rank runs go through real ``torchrun`` processes on gloo; nothing in torch.distributed is mocked.
Every launch has a timeout so a deadlock fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from rv_train.tasks.reversal import Reversal

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve()
TORCHRUN_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


class ZeroReward(Reversal):
    """Injected failure: every completion scores 0, as with a reward function that never matches."""

    def score(self, completion, finished, example):
        return {"zero": 0.0}


class NaNReward(Reversal):
    """Injected failure: a non-finite reward makes the loss non-finite."""

    def score(self, completion, finished, example):
        return {"nan": float("nan")}


def env_for_ranks() -> dict[str, str]:
    """One thread per rank (2 cores, other test runs beside us); the repo importable; no rv env leaking."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def torchrun_cmd(nproc: int, *trainer_args: str, signals: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if signals:
        cmd += [TORCHRUN_SIGNALS, "--shutdown-timeout=60"]
    return [*cmd, "-m", "rv_train", "--dist-timeout", "60", *trainer_args]


def torchrun(nproc: int, *trainer_args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_cmd(nproc, *trainer_args),
        cwd=REPO,
        env=env_for_ranks(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text(encoding="utf-8"))


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


def checkpoint_params(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint, read in this process without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent / (checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint / "model_optim", out)
    return torch.load(out, weights_only=False)["model"]
