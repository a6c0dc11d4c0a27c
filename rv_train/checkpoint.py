"""Atomic, sharded, resumable checkpoints.

Layout under the checkpoint folder (``--checkpoint-dir``, else ``RV_CHECKPOINT_DIR``)::

    step_0000040/          a complete checkpoint: it has COMPLETE
        model_optim/       model and optimizer, torch.distributed.checkpoint (DCP) shards
        state.json         step, data position, breaker streaks, counters, scaler, config
        rng/rank<r>.pt     torch, CUDA, Python and NumPy RNG state of each rank
        COMPLETE           written last
    step_0000050.tmp/      being written, or left by a crash: ignored, deleted at the next start
    PREEMPTED              written after the checkpoint saved on a signal; removed when a run resumes

Every rank writes its own shards into ``step_N.tmp``; after a barrier rank 0 writes ``state.json``,
renames the folder and writes ``COMPLETE``. A reader only trusts folders with ``COMPLETE``, so a job
killed mid-save leaves nothing that looks valid. DCP is used for DDP too (it writes replicated tensors
once), so one code path covers both strategies and a checkpoint can be read at another world size.
The folder must be shared by all nodes (it is on a cluster's scratch).

The reference model is never saved: it is rebuilt from the original weights, not from the resumed
policy (which would silently move the KL anchor).

rv reads this layout too (``rv ckpt``, ``--from RUN@STEP``, the job's resume step): its copy of the
names is ``rv/agent/layout.py``. rv_train takes only :mod:`rv.contract` from rv, so the names are
spelled here as well, and ``tests/unit/test_layout.py`` holds the two equal.

Below the layout, what a run keeps in ``state.json`` and how a run resumes: :func:`resume` and
:func:`save_run`, which the trainer calls.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rv.contract import PREEMPTED, marker_text
from rv_train.dist import DistEnv, broadcast_object

STEP_PREFIX = "step_"
STEP_DIGITS = 7
COMPLETE = "COMPLETE"
PARTIAL = ".tmp"  # a step's folder while it is written
STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_NAME.match(p.name)
        if m and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def remove_partial(root: Path) -> list[Path]:
    """Delete half-written checkpoints (call on rank 0 before anything saves)."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.endswith(PARTIAL) and p.is_dir():
                shutil.rmtree(p)
                removed.append(p)
    return removed


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, keep_last: int
) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    final = step_dir(root, step)
    if (final / COMPLETE).is_file():  # already saved at this step (a periodic save, then a stop)
        return final
    tmp = final.with_name(final.name + PARTIAL)
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "model_optim")
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        write_atomic(tmp / "state.json", json.dumps(state, indent=1))
        os.replace(tmp, final)
        write_atomic(final / COMPLETE, json.dumps({"step": step}))
        if keep_last > 0:
            for old in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Collective. Restores model and optimizer in place and this rank's RNG; returns state.json."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=path / "model_optim")
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng_file.is_file():  # absent when resuming at a larger world size: those ranks keep their seed
        _set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: Python RNG tuples
    return json.loads((path / "state.json").read_text(encoding="utf-8"))


def write_preempted(root: Path, step: int, **info: object) -> None:
    """The stop protocol's marker (:mod:`rv.contract`): rv reads the step to decide on continuing."""
    write_atomic(root / PREEMPTED, marker_text(step, **info))


def clear_preempted(root: Path) -> None:
    (root / PREEMPTED).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------
# a run's checkpoint: what state.json holds, and the resume


@dataclass
class TrainState:
    """Everything besides weights and optimizer that a resume needs."""

    step: int = 0
    prompts_seen: int = 0  # the data position: global prompts consumed
    zero_reward_streak: int = 0
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    resumes: int = 0
    micro_batch_size: int = 0  # what --micro-batch-size auto settled on (0: not yet), kept across resumes


# Options that do not change what is learned: changing them on a resume deserves no warning.
FREE_ON_RESUME = {
    "steps", "output_dir", "checkpoint_dir", "save_every", "skip_final_save", "keep_last", "breaker_steps",
    "max_nonfinite_steps", "stop_at_reward", "signals", "log_samples_every", "log_with", "tracker_project",
    "threads", "dist_timeout",
}  # fmt: skip


def jsonable(value):
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Resumed:
    """Where a run starts: the checkpoint it resumed from (None: a fresh start) and what it held."""

    path: Path | None
    state: TrainState
    tracker_ids: dict[str, str]  # the trackers' runs to continue
    changed: dict[str, tuple[object, object]]  # option -> (in the checkpoint, now), learning options only


def resume(
    checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scaler, cfg, env: DistEnv
) -> Resumed:
    """Collective: half-written checkpoints removed, the newest complete one loaded into ``model``,
    ``optimizer`` and ``scaler`` (every rank loads the one rank 0 picked), its PREEMPTED marker removed.
    ``cfg``: the run's options (a dataclass), compared with the checkpoint's."""
    state = TrainState()
    tracker_ids: dict[str, str] = {}
    changed: dict[str, tuple[object, object]] = {}
    if env.is_main:
        for partial in remove_partial(checkpoint_dir):
            print(f"removed a half-written checkpoint: {partial}", flush=True)
    # Rank 0 picks the checkpoint for everyone: ranks that disagreed would hang in the load's collectives.
    latest = broadcast_object(latest_checkpoint(checkpoint_dir) if env.is_main else None, env)
    if latest is not None:
        saved = load_checkpoint(latest, model, optimizer)
        state = TrainState(**saved["train_state"])
        state.resumes += 1
        if scaler is not None and saved.get("scaler"):
            scaler.load_state_dict(saved["scaler"])
        tracker_ids = saved.get("tracker_runs") or {}
        changed = {
            k: (v, getattr(cfg, k))
            for k, v in saved["config"].items()
            if k not in FREE_ON_RESUME and v != jsonable(getattr(cfg, k))
        }
    dist.barrier()  # every rank has read the checkpoint before rank 0 touches the folder
    if latest is not None and env.is_main:
        clear_preempted(checkpoint_dir)
    return Resumed(latest, state, tracker_ids, changed)


def save_run(
    checkpoint_dir: Path,
    state: TrainState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler,
    cfg,
    tracker_ids: dict[str, str],
    keep_last: int,
) -> Path:
    """Collective: the run's checkpoint at ``state.step``, with what :func:`resume` reads back."""
    saved = {
        "train_state": dataclasses.asdict(state),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "config": {k: jsonable(v) for k, v in dataclasses.asdict(cfg).items()},
        "tracker_runs": tracker_ids,  # rank 0's (it writes state.json): a resume continues them
    }
    return save_checkpoint(checkpoint_dir, state.step, model, optimizer, saved, keep_last)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
