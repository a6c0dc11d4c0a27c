"""Process group, collectives, precision choice, DDP/FSDP wrapping and the gradient scaler.

Process group: under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set) NCCL on GPU, gloo
on CPU; run without a launcher, a one-process group on an in-memory store, so the loop has one code
path. Python objects go over a separate gloo group, because NCCL only moves GPU tensors.

Precision (:func:`choose_precision`), in order:

1. ``--precision fp32|bf16|fp16`` when given, on any device (CPU tests use it for the fp16 path);
2. ``RV_PRECISION``, else ``ACCELERATE_MIXED_PRECISION`` (rv's job script sets both), on a GPU. bf16 on
   a GPU below compute capability 8.0 becomes fp16. On CPU the variables are logged and ignored: rv's
   loopback test cluster sets them on machines with fake GPUs and no CUDA, and CPU runs want fp32;
3. the device: bf16 at compute capability ≥ 8.0, fp16 below it, fp32 on CPU.

bf16 and fp16 mean autocast with fp32 master weights (never ``.half()``: the scaler then fails with
"Attempting to unscale FP16 gradients"); fp16 adds a ``GradScaler``, ``ShardedGradScaler`` under FSDP
(it all-reduces found-inf so every rank skips together). Under FSDP the all-gathers also run in the
compute dtype (``MixedPrecisionPolicy``), gradients are reduced in fp32.

Accelerate — what it does for us and what it does not. Its ``Accelerator`` would own this whole module:
process group, DDP/FSDP wrapping, autocast, the scaler. We do not use it for the loop, because on the
CPU machines where the tests run it silently changes what is tested: with ``mixed_precision="fp16"`` it
makes no autocast and no scaler (measured: outputs stay fp32, ``accelerator.scaler`` is None), and with
an FSDP plugin under two gloo ranks it wraps the model in DDP instead. The generation recipe also needs
FSDP2's ``unshard()`` on every unit, and the resume needs our atomic checkpoint layout, neither of which
``prepare``/``save_state`` offer. What Accelerate still does: ``transformers`` relies on it for
memory-light loading of pretrained weights; its trackers take the metrics (``--log-with``, trackers.py);
its ``find_executable_batch_size`` halves the micro-batch until it fits (``--micro-batch-size auto``,
microbatch.py); and we honour its ``ACCELERATE_MIXED_PRECISION`` variable, so an ``accelerate launch
--mixed_precision`` config means the same here. Everything it would have
hidden is a few lines of plain torch below.
"""

from __future__ import annotations

import hashlib
import os
import resource
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from rv.contract import BF16_MIN_MAJOR, PRECISION_VARIABLES, precision_for_capability

STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    object_group: dist.ProcessGroup | None  # gloo group for Python objects; None = the default group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 1800.0) -> DistEnv:
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    # A launcher (torchrun, accelerate) sets RANK; MASTER_ADDR alone says nothing, since rv's job
    # script exports it for every program, a plain `python train.py` included.
    if "RANK" in os.environ or world_size > 1:
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    else:  # plain `python`: a one-rank group, so collectives, DCP and FSDP work unchanged
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    object_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return DistEnv(rank, world_size, local_rank, device, backend, object_group)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Collectives. Every stop decision goes through these: a rank must never branch on its own data before
# a collective, or the others wait forever.


def all_reduce_sum(values: Mapping[str, float], device: torch.device) -> dict[str, float]:
    return _all_reduce(values, dist.ReduceOp.SUM, device)


def all_reduce_max(values: Mapping[str, float], device: torch.device) -> dict[str, float]:
    return _all_reduce(values, dist.ReduceOp.MAX, device)


def _all_reduce(values: Mapping[str, float], op, device: torch.device) -> dict[str, float]:
    keys = sorted(values)  # the same order on every rank
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist(), strict=True))


def broadcast_object(obj, env: DistEnv):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=env.object_group)
    return box[0]


def gather_objects(obj, env: DistEnv) -> list:
    out = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.object_group)
    return out


# ---------------------------------------------------------------------------------------------------
# Precision


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16
    reason: str  # what was asked, by whom, and why this was chosen: logged at start-up

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.name]

    @property
    def use_scaler(self) -> bool:
        return self.name == "fp16"


def _normalise(value: str, source: str) -> str:
    v = value.strip().lower()
    if v in ("no", "fp32", "32", "float32"):
        return "fp32"
    if v in ("bf16", "bfloat16"):
        return "bf16"
    if v in ("fp16", "float16", "16"):
        return "fp16"
    raise ValueError(f"{source}={value!r}: expected one of bf16, fp16, fp32 (or 'no')")


def choose_precision(
    cli: str, env: Mapping[str, str], device_type: str, capability: tuple[int, int] | None
) -> Precision:
    """Pure: the precision to train in, from the flag, the environment and the device (see module doc)."""
    if cli != "auto":
        name = _normalise(cli, "--precision")
        return Precision(name, f"--precision {name}")
    requested = next(((k, env[k]) for k in PRECISION_VARIABLES if env.get(k)), None)
    if device_type != "cuda":
        if requested:
            var, value = requested
            return Precision(
                "fp32", f"{var}={value} asked, fp32 used on {device_type} (force with --precision)"
            )
        return Precision("fp32", f"{device_type}: fp32")
    major = capability[0] if capability else 0
    cc = f"compute capability {capability[0]}.{capability[1]}" if capability else "unknown capability"
    if requested:
        var, value = requested
        name = _normalise(value, var)
        if name == "bf16" and major < BF16_MIN_MAJOR:
            return Precision("fp16", f"{var}={value} asked, but bf16 needs capability >= 8.0 ({cc}): fp16")
        return Precision(name, f"{var}={value}")
    if precision_for_capability(major) == "bf16":
        return Precision("bf16", f"{cc} >= {BF16_MIN_MAJOR}.0: bf16")
    return Precision("fp16", f"{cc} < {BF16_MIN_MAJOR}.0: fp16 with a gradient scaler")


def autocast(precision: Precision, device: torch.device):
    if precision.amp_dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=precision.amp_dtype)


def make_scaler(precision: Precision, strategy: str, device: torch.device):
    if not precision.use_scaler:
        return None
    if strategy == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


# ---------------------------------------------------------------------------------------------------
# Wrapping


def wrap_model(model: nn.Module, strategy: str, precision: Precision, env: DistEnv) -> nn.Module:
    """DDP, or FSDP2 with one unit per transformer block (the classes in ``_no_split_modules``)."""
    model.to(env.device)
    if strategy == "ddp":
        return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    if strategy != "fsdp":
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=precision.amp_dtype, reduce_dtype=torch.float32)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)  # the root holds embeddings and the head (tied in Qwen: one unit)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
    if set_sync is not None:
        set_sync(enabled)
    try:
        yield
    finally:
        if set_sync is not None:
            set_sync(True)


def full_norm(norm: torch.Tensor) -> float:
    """clip_grad_norm_ returns a DTensor under FSDP2."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def param_checksum(model: nn.Module) -> str:
    """sha256 of every full parameter in name order: equal on all ranks unless they diverged.

    Under FSDP each parameter is gathered one at a time (a collective, in the same order everywhere),
    so memory stays at one parameter.
    """
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(unwrap(model).named_parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(name.encode())
            h.update(full.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
