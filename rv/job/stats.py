"""`rv stats`: what a run used and cost, from what its jobs measured on every node (rv.agent.stats).

Pure: a run's records, its node records (``{segment: [node record]}``) and the profile's GPU catalog
in; figures, advice and lines out. Per segment: wall time (the job's start to its end, or now), the
GPUs and their type, CPU efficiency (the program's CPU seconds over the cores allocated times the
program's own wall time on that node), peak memory per node against what was asked, each GPU's
utilization (mean, max) and peak memory, and SUs (the catalog's rate × GPUs × hours). The run: the
sum of its segments; a sweep: one line per point and the total.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rv.catalog import GpuType
from rv.job.records import ClusterRun, Segment
from rv.slurm.parse import expand_hostlist

LOW_CPU = 0.25  # CPU efficiency under this is worth a word
GIB = 1 << 30  # memory is shown in GiB: what nvidia-smi's MiB and a card's nominal "80 GB" are counted in
GPU_HEADROOM = 1.15  # a cheaper type must hold the peak GPU memory with this much to spare


@dataclass(frozen=True)
class GpuFigures:
    node: str
    index: int
    name: str
    util_mean: float | None
    util_max: float | None
    memory_peak_bytes: int | None
    memory_total_bytes: int | None


@dataclass(frozen=True)
class NodeFigures:
    node: str
    cpus: int | None
    cpu_seconds: float | None
    program_seconds: float
    cpu_efficiency: float | None
    peak_memory_bytes: int | None
    mem_asked_bytes: int | None
    final: bool  # measured at the program's end (not only sampled while it ran)
    gpu_error: str | None  # why this node has no GPU figures ("a CPU job" for one)
    sampler_cpu_seconds: float = 0.0
    samples: int = 0


@dataclass(frozen=True)
class SegmentStats:
    index: int
    job_id: str | None
    state: str
    gpu_type: str | None
    gpus: int
    wall_seconds: float
    nodes: tuple[NodeFigures, ...]
    gpu: tuple[GpuFigures, ...]
    su: float | None
    su_why: str | None  # why there is no SU figure
    missing: tuple[str, ...] = ()  # "NODE: why" for each node with nothing measured

    @property
    def cpu_efficiency(self) -> float | None:
        return _efficiency(self.nodes)

    @property
    def peak_memory_bytes(self) -> int | None:
        peaks = [n.peak_memory_bytes for n in self.nodes if n.peak_memory_bytes is not None]
        return max(peaks) if peaks else None


@dataclass(frozen=True)
class RunStats:
    run_id: str
    name: str
    segments: tuple[SegmentStats, ...]
    advice: tuple[str, ...] = field(default=())

    @property
    def wall_seconds(self) -> float:
        return sum(s.wall_seconds for s in self.segments)

    @property
    def cpu_efficiency(self) -> float | None:
        return _efficiency([n for s in self.segments for n in s.nodes])

    @property
    def peak_memory_bytes(self) -> int | None:
        peaks = [s.peak_memory_bytes for s in self.segments if s.peak_memory_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def su(self) -> float | None:
        if not self.segments or any(s.su is None for s in self.segments):
            return None
        return sum(s.su or 0.0 for s in self.segments)

    @property
    def su_why(self) -> str | None:
        whys = [s.su_why for s in self.segments if s.su is None and s.su_why]
        return whys[0] if whys else ("no segment ran" if not self.segments else None)

    @property
    def gpus(self) -> list[GpuFigures]:
        """Each GPU over the whole run (by node and index): mean of the segments' means weighted by wall."""
        seen: dict[tuple[str, int], list[tuple[GpuFigures, float]]] = {}
        for s in self.segments:
            for g in s.gpu:
                seen.setdefault((g.node, g.index), []).append((g, s.wall_seconds))
        out = []
        for (node, index), got in seen.items():
            means = [(g.util_mean, w) for g, w in got if g.util_mean is not None]
            weight = sum(w for _, w in means)
            mean = sum(m * w for m, w in means) / weight if weight else (means[0][0] if means else None)
            maxes = [g.util_max for g, _ in got if g.util_max is not None]
            mems = [g.memory_peak_bytes for g, _ in got if g.memory_peak_bytes is not None]
            out.append(GpuFigures(
                node, index, got[0][0].name, round(mean, 1) if mean is not None else None,
                max(maxes) if maxes else None, max(mems) if mems else None, got[0][0].memory_total_bytes,
            ))  # fmt: skip
        return out


def node_peak(rec: Mapping[str, Any]) -> int | None:
    """A node's peak memory (rv.agent.stats.node_peak: the agent's files are not laptop imports; a
    unit test holds the two equal): the job's cgroup where Slurm made one, else the larger of the
    largest process and the sampled sum of the program's processes."""
    if isinstance(rec.get("cgroup_peak_bytes"), int):
        return int(rec["cgroup_peak_bytes"])
    got = [int(v) for v in (rec.get("maxrss_bytes"), rec.get("rss_peak_bytes")) if isinstance(v, int)]
    return max(got) if got else None


def _efficiency(nodes: Sequence[NodeFigures]) -> float | None:
    got = [n for n in nodes if n.cpus and n.cpu_seconds is not None and n.program_seconds > 0]
    asked = sum((n.cpus or 0) * n.program_seconds for n in got)
    return sum(n.cpu_seconds or 0.0 for n in got) / asked if asked else None


def _node(rec: Mapping[str, Any]) -> NodeFigures:
    cpus = rec.get("cpus") if isinstance(rec.get("cpus"), int) else None
    cpu = rec.get("cpu_seconds")
    cpu = float(cpu) if isinstance(cpu, int | float) else None
    start, end = rec.get("start"), rec.get("end")
    program = float(end - start) if isinstance(start, int | float) and isinstance(end, int | float) else 0.0
    eff = cpu / (cpus * program) if cpu is not None and cpus and program > 0 else None
    mem = rec.get("mem_asked_bytes")
    return NodeFigures(
        node=str(rec.get("node") or "?"), cpus=cpus, cpu_seconds=cpu, program_seconds=max(program, 0.0),
        cpu_efficiency=eff, peak_memory_bytes=node_peak(rec), final=bool(rec.get("final")),
        mem_asked_bytes=mem if isinstance(mem, int) else None,
        gpu_error=rec.get("gpu_error") if isinstance(rec.get("gpu_error"), str) else None,
        sampler_cpu_seconds=float(rec.get("sampler_cpu_seconds") or 0.0),
        samples=int(rec.get("samples") or 0),
    )  # fmt: skip


def _gpus(rec: Mapping[str, Any]) -> list[GpuFigures]:
    out = []
    for g in rec.get("gpus") or []:
        if not isinstance(g, dict) or not isinstance(g.get("index"), int):
            continue
        out.append(GpuFigures(
            node=str(rec.get("node") or "?"), index=g["index"], name=str(g.get("name") or ""),
            util_mean=g.get("util_mean"), util_max=g.get("util_max"),
            memory_peak_bytes=g.get("memory_peak_bytes"), memory_total_bytes=g.get("memory_total_bytes"),
        ))  # fmt: skip
    return out


def segment_stats(
    seg: Segment, records: Sequence[Mapping[str, Any]], gpus: int, gpu_type: str | None,
    catalog: Mapping[str, GpuType], now: float,
) -> SegmentStats:  # fmt: skip
    start = seg.start
    end = seg.end if seg.end is not None else (now if seg.state == "running" else start)
    wall = max(0.0, (end or 0.0) - start) if start is not None else 0.0
    nodes = tuple(_node(r) for r in records)
    measured = {n.node for n in nodes}
    expected = expand_hostlist(seg.nodes) if seg.nodes else []
    missing = [
        f"{n}: nothing measured (no python3 on the node, or the job's runtime predates rv stats)"
        for n in expected
        if n not in measured
    ]
    if not records and not expected and start is not None:
        missing.append("nothing measured (no python3 on the nodes, or the job's runtime predates rv stats)")
    if gpus:
        missing += [f"{n.node}: no GPU figures: {n.gpu_error}" for n in nodes if n.gpu_error]
    su, why = None, None
    if not gpus:
        why = "a CPU job: the catalog prices GPU hours only"
    elif gpu_type is None or gpu_type not in catalog:
        why = f"GPU type {gpu_type or '?'} is not in the profile's catalog"
    elif catalog[gpu_type].su_per_gpu_hour is None:
        why = f"no SU rate for {gpu_type} in the profile's catalog (su_per_gpu_hour)"
    else:
        su = (catalog[gpu_type].su_per_gpu_hour or 0.0) * gpus * wall / 3600
    gpu = tuple(g for r in records for g in _gpus(r))
    return SegmentStats(
        seg.index, seg.job_id, seg.state, gpu_type, gpus, wall, nodes, gpu, su, why, tuple(missing)
    )


def run_stats(
    run: ClusterRun,
    measured: Mapping[str, Sequence[Mapping[str, Any]]],
    catalog: Mapping[str, GpuType],
    now: float,
) -> RunStats:
    """The run's figures, one per segment that started, and the advice they give."""
    gpus = int(run.meta.get("gpus") or 0)
    segs = []
    for seg in run.segments:
        if seg.start is None:
            continue
        gpu_type = seg.gpu_type or run.meta.get("gpu_type") or None
        segs.append(segment_stats(seg, measured.get(str(seg.index)) or [], gpus, gpu_type, catalog, now))
    rs = RunStats(run.run_id, run.name, tuple(segs))
    return RunStats(rs.run_id, rs.name, rs.segments, tuple(advice(rs, catalog)))


def _bf16(t: GpuType) -> bool:
    """Whether the type runs the program in bf16 (compute capability 8.0+): a type that would change
    its precision to fp16 is no like-for-like advice."""
    return (t.compute_capability or 0) >= 8.0


def advice(rs: RunStats, catalog: Mapping[str, GpuType]) -> list[str]:
    out = []
    eff = rs.cpu_efficiency
    nodes = [n for s in rs.segments for n in s.nodes if n.cpus]
    if eff is not None and eff < LOW_CPU and nodes:
        cpus = max(n.cpus or 0 for n in nodes)
        used = max(1, math.ceil(eff * cpus))
        out.append(
            f"CPU efficiency {eff:.0%} of the {cpus} cores asked (about {used} busy): "
            f"--cpus {used + 1} would do"
        )
    peaks = [g.memory_peak_bytes for g in rs.gpus if g.memory_peak_bytes is not None]
    typed = [s for s in rs.segments if s.gpu_type and s.gpus]
    if not peaks or not typed:
        return out
    peak_gb = max(peaks) / GIB  # the catalog's vram_gb is a card's nominal size, in GiB
    now_type = catalog.get(typed[-1].gpu_type or "")
    if now_type is None or not now_type.su_per_gpu_hour:
        return out
    gpus = typed[-1].gpus
    fits = [
        t for t in catalog.values()
        if t.vram_gb and t.vram_gb >= peak_gb * GPU_HEADROOM and t.su_per_gpu_hour is not None
        and t.su_per_gpu_hour < now_type.su_per_gpu_hour and (t.max_gpus_per_job or gpus) >= gpus
        and _bf16(t) == _bf16(now_type)
    ]  # fmt: skip
    if fits:
        best = min(fits, key=lambda t: (t.su_per_gpu_hour or 0.0, -(t.vram_gb or 0)))
        ratio = (best.su_per_gpu_hour or 0.0) / now_type.su_per_gpu_hour
        total = f"{now_type.vram_gb:g}" if now_type.vram_gb else "?"
        out.append(
            f"peak GPU memory {peak_gb:.1f} of {total} GiB: an {best.name} ({best.vram_gb:g} GiB) "
            f"would have done at {ratio:.2f}× the SUs"
        )
    return out


# --- JSON and text ------------------------------------------------------------------------------------


def _gpu_json(g: GpuFigures) -> dict[str, Any]:
    return {
        "node": g.node, "index": g.index, "name": g.name, "util_mean": g.util_mean, "util_max": g.util_max,
        "memory_peak_bytes": g.memory_peak_bytes, "memory_total_bytes": g.memory_total_bytes,
    }  # fmt: skip


def _node_json(n: NodeFigures) -> dict[str, Any]:
    return {
        "node": n.node, "cpus": n.cpus, "cpu_seconds": n.cpu_seconds,
        "program_seconds": round(n.program_seconds, 1),
        "cpu_efficiency": _round(n.cpu_efficiency), "peak_memory_bytes": n.peak_memory_bytes,
        "mem_asked_bytes": n.mem_asked_bytes, "final": n.final, "gpu_error": n.gpu_error,
        "samples": n.samples, "sampler_cpu_seconds": n.sampler_cpu_seconds,
    }  # fmt: skip


def _round(x: float | None, digits: int = 3) -> float | None:
    return round(x, digits) if x is not None else None


def to_json(rs: RunStats) -> dict[str, Any]:
    return {
        "run_id": rs.run_id, "name": rs.name, "wall_seconds": round(rs.wall_seconds, 1),
        "cpu_efficiency": _round(rs.cpu_efficiency), "peak_memory_bytes": rs.peak_memory_bytes,
        "gpus": [_gpu_json(g) for g in rs.gpus], "su": _round(rs.su, 2),
        "su_why": rs.su_why if rs.su is None else None,
        "advice": list(rs.advice),
        "segments": [
            {
                "segment": s.index, "job_id": s.job_id, "state": s.state, "gpu_type": s.gpu_type,
                "gpu_count": s.gpus,
                "wall_seconds": round(s.wall_seconds, 1), "cpu_efficiency": _round(s.cpu_efficiency),
                "peak_memory_bytes": s.peak_memory_bytes, "su": _round(s.su, 2), "su_why": s.su_why,
                "nodes": [_node_json(n) for n in s.nodes], "gpus": [_gpu_json(g) for g in s.gpu],
                "missing": list(s.missing),
            }
            for s in rs.segments
        ],
    }  # fmt: skip


def gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def wall_text(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def su_text(su: float | None, why: str | None = None) -> str:
    if su is None:
        return "?" + (f" ({why})" if why else "")
    return f"{su:,.1f}"


def pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def render(rs: RunStats) -> list[str]:
    """The figures of one run, segment by segment, then the whole run and the advice."""
    lines = [f"run {rs.name} ({rs.run_id})"]
    for s in rs.segments:
        gpus = f"{s.gpus}× {s.gpu_type}" if s.gpus else "CPU only"
        lines.append(
            f"segment {s.index}: job {s.job_id or '?'} ({s.state}), {wall_text(s.wall_seconds)} wall, "
            f"{gpus}, SUs {su_text(s.su, s.su_why)}"
        )
        for n in s.nodes:
            asked = f" of {gb(n.mem_asked_bytes)} asked" if n.mem_asked_bytes else ""
            sampled = "" if n.final else " (sampled so far: the program had not ended)"
            lines.append(
                f"  {n.node}: CPU {pct(n.cpu_efficiency)} of {n.cpus or '?'} cores "
                f"({n.cpu_seconds or 0:.0f} CPU s in {n.program_seconds:.0f} s), "
                f"peak memory {gb(n.peak_memory_bytes)}{asked}{sampled}"
            )
        for g in s.gpu:
            util = "?" if g.util_mean is None else f"{g.util_mean:.0f}% mean, {g.util_max or 0:.0f}% max"
            total = f" of {gb(g.memory_total_bytes)}" if g.memory_total_bytes else ""
            lines.append(
                f"  {g.node} GPU {g.index} ({g.name}): util {util}, "
                f"peak memory {gb(g.memory_peak_bytes)}{total}"
            )
        lines += [f"  {m}" for m in s.missing]
    lines.append(
        f"total: {wall_text(rs.wall_seconds)} wall, CPU efficiency {pct(rs.cpu_efficiency)}, "
        f"peak memory {gb(rs.peak_memory_bytes)}, SUs {su_text(rs.su, rs.su_why)}"
    )
    lines += [f"advice: {a}" for a in rs.advice]
    return lines


def render_sweep(name: str, points: Sequence[tuple[int, RunStats]]) -> list[str]:
    """One line per point and the total."""
    head = ("POINT", "RUN", "WALL", "CPU", "PEAK MEM", "GPU UTIL", "SU")
    rows = []
    for index, rs in points:
        utils = [g.util_mean for g in rs.gpus if g.util_mean is not None]
        util = f"{sum(utils) / len(utils):.0f}%" if utils else "-"
        rows.append((str(index), rs.name, wall_text(rs.wall_seconds), pct(rs.cpu_efficiency),
                     gb(rs.peak_memory_bytes), util, su_text(rs.su)))  # fmt: skip
    sus = [rs.su for _, rs in points]
    total_su = None if any(s is None for s in sus) else sum(s or 0.0 for s in sus)
    peaks = [rs.peak_memory_bytes for _, rs in points if rs.peak_memory_bytes is not None]
    rows.append(("total", f"{len(points)} points", wall_text(sum(rs.wall_seconds for _, rs in points)), "",
                 gb(max(peaks) if peaks else None), "", su_text(total_su)))  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"sweep {name}"]
    for r in [head, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    whys = {rs.su_why for _, rs in points if rs.su is None and rs.su_why}
    lines += [f"SUs ?: {w}" for w in sorted(whys)]
    return lines


def summary_line(rs: RunStats) -> str:
    """One line for lists and notices: wall, GPU use, peak memory, SUs."""
    utils = [g.util_mean for g in rs.gpus if g.util_mean is not None]
    gpu = f", GPU util {sum(utils) / len(utils):.0f}%" if utils else ""
    peak = gb(rs.peak_memory_bytes)
    return f"{wall_text(rs.wall_seconds)} wall{gpu}, peak memory {peak}, SUs {su_text(rs.su)}"
