"""What the GPUs of a running job are doing (`rv gpu`): nvidia-smi's CSV in, dataclasses out.

:data:`NODE_SCRIPT` runs on every node of the job (one ``srun --label`` task each, see
rv.slurm.commands.srun_each_node) and prints, between marker lines, two nvidia-smi queries:

    nvidia-smi --query-gpu=GPU_FIELDS --format=csv,noheader,nounits
    nvidia-smi --query-compute-apps=APP_FIELDS --format=csv,noheader,nounits

:func:`parse_report` reads the labelled output of all nodes. Pure, tested on captured output
(``tests/captured/nvidia_smi_*``). nvidia-smi quirks it handles: ``[N/A]`` and ``[Not Supported]``
in place of a number (power on some boards, utilisation of a GPU in MIG mode), a value holding
nvidia-smi's own ", " separator (a process path), and a node with no nvidia-smi at all.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

GPU_FIELDS = (
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "power.limit",
)
APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")

_QUERY = "--format=csv,noheader,nounits"
# Markers are lines of their own: nvidia-smi's errors (merged into stdout) never start with "@@".
NODE_SCRIPT = (
    'echo "@@node ${SLURMD_NODENAME:-$(hostname)}"\n'
    "if ! command -v nvidia-smi >/dev/null 2>&1; then echo @@missing; exit 0; fi\n"
    "echo @@gpus\n"
    f'nvidia-smi --query-gpu={",".join(GPU_FIELDS)} {_QUERY} 2>&1 || echo "@@failed $?"\n'
    "echo @@apps\n"
    f'nvidia-smi --query-compute-apps={",".join(APP_FIELDS)} {_QUERY} 2>&1 || echo "@@failed $?"\n'
)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int | None


@dataclass(frozen=True)
class GpuStat:
    index: int
    uuid: str
    name: str
    utilization: int | None  # percent
    memory_used_mib: int | None
    memory_total_mib: int | None
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class NodeGpus:
    node: str
    gpus: tuple[GpuStat, ...] = ()
    missing: bool = False  # no nvidia-smi on this node
    errors: tuple[str, ...] = field(default=())  # what a failed nvidia-smi said

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_NA = {"", "[n/a]", "n/a", "[not supported]", "[unknown error]", "[insufficient permissions]"}


def _number(text: str) -> float | None:
    value = text.strip()
    if value.lower() in _NA:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _int(text: str) -> int | None:
    value = _number(text)
    return None if value is None else round(value)


def _split(line: str, count: int, free: int) -> list[str] | None:
    """``line`` split into ``count`` fields at nvidia-smi's ", ", where field ``free`` may itself
    hold one (a process path)."""
    parts = [p.strip() for p in line.split(", ")]
    if len(parts) < count:
        return None
    extra = len(parts) - count
    return [*parts[:free], ", ".join(parts[free : free + extra + 1]), *parts[free + extra + 1 :]]


def parse_gpus(text: str) -> list[GpuStat]:
    """``--query-gpu=GPU_FIELDS`` output; lines that are not rows (errors) are skipped."""
    out = []
    for line in text.splitlines():
        f = _split(line, len(GPU_FIELDS), free=2)
        if f is None or not f[0].isdigit():
            continue
        out.append(
            GpuStat(
                index=int(f[0]),
                uuid=f[1],
                name=f[2],
                utilization=_int(f[3]),
                memory_used_mib=_int(f[4]),
                memory_total_mib=_int(f[5]),
                temperature_c=_int(f[6]),
                power_w=_number(f[7]),
                power_limit_w=_number(f[8]),
            )
        )
    return out


def parse_apps(text: str) -> list[tuple[str, GpuProcess]]:
    """``--query-compute-apps=APP_FIELDS`` output: (GPU uuid, process) per row."""
    out = []
    for line in text.splitlines():
        f = _split(line, len(APP_FIELDS), free=2)
        if f is None or not f[1].isdigit():
            continue
        out.append((f[0], GpuProcess(pid=int(f[1]), name=f[2], used_mib=_int(f[3]))))
    return out


def node_gpus(node: str, gpus_text: str, apps_text: str, *, missing: bool = False) -> NodeGpus:
    """One node's GPUs with their processes attached (by uuid); what nvidia-smi said when it failed."""
    if missing:
        return NodeGpus(node=node, missing=True)
    apps = parse_apps(apps_text)
    gpus = []
    for gpu in parse_gpus(gpus_text):
        procs = tuple(p for uuid, p in apps if uuid == gpu.uuid)
        gpus.append(GpuStat(**{**asdict(gpu), "processes": procs}))
    errors = []
    for text, parsed in ((gpus_text, gpus), (apps_text, apps)):
        said = [line.strip() for line in text.splitlines() if line.strip()]
        if not parsed and said:
            errors.append(" ".join(said)[:300])
    return NodeGpus(node=node, gpus=tuple(gpus), errors=tuple(errors))


_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")


def parse_report(text: str) -> list[NodeGpus]:
    """The labelled output of :data:`NODE_SCRIPT` on every node (``srun --label``), in task order."""
    by_task: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            by_task.setdefault(int(m.group(1)), []).append(m.group(2))
    out = []
    for task in sorted(by_task):
        node, section, missing = f"task {task}", "", False
        parts: dict[str, list[str]] = {"gpus": [], "apps": []}
        for line in by_task[task]:
            if line.startswith("@@node "):
                node = line[len("@@node ") :].strip()
            elif line == "@@missing":
                missing = True
            elif line in ("@@gpus", "@@apps"):
                section = line[2:]
            elif line.startswith("@@failed") and section:
                parts[section].append(f"nvidia-smi exited with code {line.split()[-1]}")
            elif section:
                parts[section].append(line)
        out.append(node_gpus(node, "\n".join(parts["gpus"]), "\n".join(parts["apps"]), missing=missing))
    return out
