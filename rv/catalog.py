"""The GPU catalog: what GPU types a cluster offers and how to ask Slurm for each.

Two sources:

* ``RIVANNA``: built-in knowledge of UVA's Rivanna (partitions, SU rates, limits), because those
  facts cannot be read from ``sinfo`` (SU rates and per-user limits live in policy, not Slurm).
* discovery (:func:`rv.slurm.parse.discover_catalog`) for any other cluster, from ``sinfo``.

Compute capability decides BF16 vs FP16 at job start when ``nvidia-smi`` cannot tell, so every
type carries one when the model is known (:func:`compute_capability_for`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class GpuType:
    """One selectable GPU type: ``rv run -t NAME``."""

    name: str
    partition: str
    gres: str  # the gres type, as in --gres=gpu:<gres>:N
    gpus_per_node: int
    compute_capability: float | None = None
    constraint: str | None = None  # a node feature it needs, for clusters that tell models apart by feature
    vram_gb: float | None = None
    su_per_gpu_hour: float | None = None  # None: unknown (cost shows "?"); 0: free
    max_gpus_per_job: int | None = None
    max_gpus_per_user: int | None = None
    max_time: str | None = None  # Slurm time string, e.g. "3-00:00:00"
    cpus_per_gpu: int | None = None  # None: let the cluster default apply
    mem_per_gpu: str | None = None  # e.g. "16G"; MIG slices need modest memory or the QOS rejects them
    fixed_cpus: int | None = None  # a job on this type gets exactly this many CPUs (MIG: 1)
    nodes: int | None = None  # how many nodes carry this type (from discovery)

    def to_dict(self) -> dict[str, object]:
        """Plain dict without the ``None`` fields, in field order, for TOML and JSON."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class Partition:
    """What a partition lets one job have, as `rv init` read it from sinfo: a job asking for more is
    refused by rv before anything is sent, instead of pending forever (``PartitionTimeLimit``,
    ``PartitionNodeLimit``)."""

    name: str
    max_time: str | None = None  # Slurm time string, e.g. "3-00:00:00"; None: no limit
    nodes: int | None = None  # nodes in the partition
    max_nodes: int | None = None  # most nodes one job may have (MaxNodes); None: no limit
    default: bool = False  # where a job that names no partition goes: rv's CPU-only jobs
    # The QOS a job of the profile's account gets there without --qos (the association's default),
    # and its MaxWall: a second limit, known only where sacctmgr says (None: none or not known).
    qos: str | None = None
    qos_max_time: str | None = None

    def to_dict(self) -> dict[str, object]:
        """Plain dict without the name and the unset fields, for TOML and JSON."""
        return {k: v for k, v in asdict(self).items() if v not in (None, False) and k != "name"}


# Facts about Rivanna's GPU partitions (UVA Research Computing, 2025-2026). SU rates are per GPU-hour.
# `a100` means the 80 GB card; the 40 GB one is `a100-40`. MIG slices are free and take 1 CPU.
RIVANNA: dict[str, GpuType] = {
    t.name: t
    for t in [
        GpuType(
            "mig",
            "gpu-mig",
            "1g.10gb",
            56,
            8.0,
            vram_gb=10,
            su_per_gpu_hour=0.0,
            max_gpus_per_job=1,
            max_gpus_per_user=28,
            max_time="3-00:00:00",
            fixed_cpus=1,
            mem_per_gpu="16G",
        ),
        GpuType(
            "rtx3090",
            "interactive-rtx3090",
            "rtx3090",
            4,
            8.6,
            vram_gb=24,
            su_per_gpu_hour=113.23,
            max_gpus_per_job=2,
            max_gpus_per_user=2,
            max_time="12:00:00",
        ),
        GpuType(
            "a6000",
            "gpu-a6000",
            "a6000",
            8,
            8.6,
            vram_gb=48,
            su_per_gpu_hour=142.73,
            max_gpus_per_job=8,
            max_gpus_per_user=32,
            max_time="3-00:00:00",
        ),
        GpuType(
            "a40",
            "gpu-a40",
            "a40",
            8,
            8.6,
            vram_gb=48,
            su_per_gpu_hour=186.69,
            max_gpus_per_job=8,
            max_gpus_per_user=32,
            max_time="3-00:00:00",
        ),
        GpuType(
            "a100-40",
            "gpu-a100-40",
            "a100",
            8,
            8.0,
            vram_gb=40,
            su_per_gpu_hour=463.81,
            max_gpus_per_job=8,
            max_gpus_per_user=32,
            max_time="3-00:00:00",
        ),
        GpuType(
            "a100",
            "gpu-a100-80",
            "a100",
            8,
            8.0,
            constraint="a100_80gb",
            vram_gb=80,
            su_per_gpu_hour=508.89,
            max_gpus_per_job=8,
            max_gpus_per_user=32,
            max_time="3-00:00:00",
        ),
        GpuType(
            "v100",
            "gpu-v100",
            "v100",
            4,
            7.0,
            vram_gb=32,
            su_per_gpu_hour=20.96,
            max_gpus_per_job=4,
            max_gpus_per_user=32,
            max_time="3-00:00:00",
        ),
        GpuType(
            "h200",
            "gpu-h200",
            "h200",
            8,
            9.0,
            vram_gb=141,
            su_per_gpu_hour=816.67,
            max_gpus_per_job=4,
            max_gpus_per_user=4,
            max_time="3-00:00:00",
        ),
    ]
}

BUILTIN_CATALOGS: dict[str, dict[str, GpuType]] = {"rivanna": RIVANNA}

# Compute capability of common models, keyed by a normalised model name (lowercase alphanumerics).
# Longer keys are tried first so "a100" wins over "a10" and "l40s" over "l4".
_COMPUTE_CAPABILITY: dict[str, float] = {
    "k80": 3.7,
    "p100": 6.0,
    "p40": 6.1,
    "titanxp": 6.1,
    "1080ti": 6.1,
    "gtx1080": 6.1,
    "v100": 7.0,
    "titanv": 7.0,
    "t4": 7.5,
    "rtx2080": 7.5,
    "2080ti": 7.5,
    "rtx6000": 7.5,
    "rtx8000": 7.5,
    "titanrtx": 7.5,
    "a100": 8.0,
    "a30": 8.0,
    "a800": 8.0,
    "1g10gb": 8.0,
    "2g20gb": 8.0,
    "3g40gb": 8.0,
    "a6000": 8.6,
    "a5000": 8.6,
    "a4000": 8.6,
    "a40": 8.6,
    "a10": 8.6,
    "a16": 8.6,
    "a2": 8.6,
    "rtx3090": 8.6,
    "3090": 8.6,
    "rtx3080": 8.6,
    "l4": 8.9,
    "l40": 8.9,
    "l40s": 8.9,
    "rtx4090": 8.9,
    "4090": 8.9,
    "rtx6000ada": 8.9,
    "h100": 9.0,
    "h200": 9.0,
    "gh200": 9.0,
    "h800": 9.0,
    "b200": 10.0,
    "gb200": 10.0,
    "b100": 10.0,
}
_KEYS_LONGEST_FIRST = sorted(_COMPUTE_CAPABILITY, key=len, reverse=True)
_VENDOR_WORDS = re.compile(r"nvidia|tesla|geforce|quadro")


def normalise_model_name(name: str) -> str:
    """``"NVIDIA_A100-SXM4-80GB"`` -> ``"a100sxm480gb"``: lowercase alphanumerics, vendor words dropped."""
    return re.sub(r"[^a-z0-9]", "", _VENDOR_WORDS.sub("", name.lower()))


def compute_capability_for(model: str) -> float | None:
    """Compute capability of a GPU model or gres type name, or None when the model is unknown."""
    return _by_model(_COMPUTE_CAPABILITY, _KEYS_LONGEST_FIRST, model)


def _by_model(table: dict[str, float], keys_longest_first: list[str], model: str) -> float | None:
    """``table``'s value for the model ``model`` names: the whole normalised name, else the longest key
    inside it. Short keys ("a2", "t4", "l4") only match as the whole leading token, and no key matches
    where a "0" follows it ("a10" is not "a100")."""
    norm = normalise_model_name(model)
    if norm in table:
        return table[norm]
    for key in keys_longest_first:
        if len(key) <= 2:
            if norm.startswith(key) and not norm[len(key) : len(key) + 1].isdigit():
                return table[key]
        elif key in norm and key + "0" not in norm:
            return table[key]
    return None


# Memory per GPU (GB) of common models, keyed like _COMPUTE_CAPABILITY: `rv run --vram N` picks among
# a cluster's types by it. Models sold with more than one size (A100 40/80, V100 16/32, P100 12/16)
# are known only when the name says the size ("a100_80gb", "v100-32g"): a guess could run a job on a
# card too small for it.
_MEMORY_GB: dict[str, float] = {
    "k80": 12,
    "p40": 24,
    "titanxp": 12,
    "1080ti": 11,
    "titanv": 12,
    "t4": 16,
    "2080ti": 11,
    "rtx6000": 24,
    "rtx8000": 48,
    "titanrtx": 24,
    "a30": 24,
    "a6000": 48,
    "a5000": 24,
    "a4000": 16,
    "a40": 48,
    "a10": 24,
    "a16": 16,
    "a2": 16,
    "rtx3090": 24,
    "3090": 24,
    "l4": 24,
    "l40": 48,
    "l40s": 48,
    "rtx4090": 24,
    "4090": 24,
    "rtx6000ada": 48,
    "h100": 80,
    "h200": 141,
    "gh200": 96,
    "b200": 192,
}
_MEMORY_KEYS_LONGEST_FIRST = sorted(_MEMORY_GB, key=len, reverse=True)
_SIZE_IN_NAME = re.compile(r"(\d{2,3})g(?:b)?(?![a-z0-9])|(\d{2,3})gb")


def memory_gb_for(model: str) -> float | None:
    """Memory per GPU of a model or gres type name, in GB, or None when the name does not tell."""
    size = _SIZE_IN_NAME.search(model.lower().replace("_", "-"))
    if size and not re.fullmatch(r"\d+g\.\d+gb", model.lower()):  # a MIG profile names a slice
        return float(size.group(1) or size.group(2))
    return _by_model(_MEMORY_GB, _MEMORY_KEYS_LONGEST_FIRST, model)
