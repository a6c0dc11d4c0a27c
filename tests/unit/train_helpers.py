"""Shared helpers for the rv_train tests: launch real trainer processes, read their outputs.

Multi-rank runs go through real ``torchrun`` processes on gloo; nothing in torch.distributed is mocked.
Every launch has a timeout so a deadlock fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rv_train.dist import cleanup_distributed
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


class SignalAtStep2(Reversal):
    """Injected stop: the process sends itself SIGUSR2 while scoring step 2 (16 prompts × 8 per step)."""

    calls = 0

    def score(self, completion, finished, example):
        SignalAtStep2.calls += 1
        if SignalAtStep2.calls == 16 * 8 + 1:
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().score(completion, finished, example)


@pytest.fixture
def one_rank(monkeypatch):
    """For in-process runs: no launcher variables (main() then makes a one-process gloo group), no rv
    variables from the developer's shell, one thread; the group is destroyed afterwards."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var in (
        "RV_PRECISION",
        "ACCELERATE_MIXED_PRECISION",
        "RV_OUTPUT_DIR",
        "RV_CHECKPOINT_DIR",
        "RV_JOB_DIR",
    ):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    cleanup_distributed()
    torch.set_num_threads(threads)


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


def torchrun(
    nproc: int, *trainer_args: str, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_cmd(nproc, *trainer_args),
        cwd=REPO,
        env={**env_for_ranks(), **(extra_env or {})},
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


def fsdp_generation_worker(rank: int, world_size: int, out_dir: str) -> None:
    """One rank of the generation test: FSDP2-wrapped TinyLM, ranks stopping at different lengths.

    Rank 1 treats every token as EOS (it stops after one token); rank 0 knows no EOS at all (it runs to
    max_new_tokens). Sharded decoding would deadlock here; the 30 s group timeout turns that into an
    error instead of a hang.
    """
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    from rv_train.dist import DistEnv

    torch.set_num_threads(1)
    # A file store, not a TCP port: a port picked free here could be taken by another job before use.
    store = f"file://{Path(out_dir) / 'store'}"
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    env = DistEnv(rank, world_size, rank, torch.device("cpu"), "gloo", None)
    try:
        result = _generate_and_train(rank, env)  # the FSDP model lives and dies in there
        # Freed while every rank is still connected, as rv_train.trainer.main does: torn down after the
        # group was destroyed, it aborted ("terminate called without an active exception").
        gc.collect()
        dist.barrier()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    finally:
        cleanup_distributed()


def _generate_and_train(rank: int, env) -> dict:
    import copy

    from rv_train.dist import Precision, wrap_model
    from rv_train.model import build_tiny
    from rv_train.rollout import generation_model, left_pad, sample

    model = build_tiny(14, 24, 0, 32, 2, 4)
    unsharded = copy.deepcopy(model).eval()
    wrapped = wrap_model(model, "fsdp", Precision("fp32", "test"), env)
    ids, mask = left_pad([[10, 1, 2, 11], [10, 3, 11]], 13, env.device)
    eos = (99,) if rank == 0 else tuple(range(14))
    kwargs = dict(num_generations=3, max_new_tokens=8, temperature=1.0, eos_ids=eos, pad_id=13, seed=rank)
    with generation_model(wrapped) as gen:
        out = sample(gen, ids, mask, **kwargs)
    expected = sample(unsharded, ids, mask, **kwargs)
    # Training still works after the units are resharded.
    loss = wrapped(out.input_ids, out.attention_mask, out.position_ids).float().logsumexp(-1).mean()
    loss.backward()
    return {
        "rank": rank,
        "length": out.completion_ids.shape[1],
        "same_as_unsharded": torch.equal(out.completion_ids, expected.completion_ids),
        "grad_finite": all(torch.isfinite(p.grad.full_tensor()).all().item() for p in wrapped.parameters()),
    }
