"""Pure parsers of what Slurm's commands print: squeue, sacct, sinfo, sacctmgr, Rivanna's allocations.

Each parser reads the output of one command line whose format is fixed by a constant here, so the
remote side and the parser never drift apart:

    squeue --noheader --format=SQUEUE_FORMAT [--me | -u USER] [-j IDS]
    sacct --parsable2 --noheader --format=SACCT_FORMAT -j IDS
    sinfo --Node --noheader --Format=SINFO_NODE_FORMAT
    sacctmgr --noheader --parsable2 show assoc user=USER format=account

Cluster quirks that shaped this module (see the project's lessons notes):

* Columns are split on an explicit ``|``, never on whitespace: a pending job's node list is
  empty, which shifts whitespace-split columns. The job name is the *last* field and is split off
  with a bounded split, so a ``|`` inside someone's job name cannot shift the others either.
* Node lists (``gpu[01-03,07],a100-[1-2]``) are expanded in full, zero padding kept.
* GPU availability is read from each node's gres and gres-used, never guessed from its state
  ("mixed" says nothing about how many GPUs are free). A node in several partitions is counted once.
* Timestamps stay strings in the cluster's own time zone, never the laptop's.
* Multi-cluster sites print ``CLUSTER: name`` before each cluster's rows: skipped, never a row.
  Columns after the ones asked for (sinfo on a site whose wrapper adds some) are ignored.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rv.catalog import GpuType, compute_capability_for, memory_gb_for
from rv.timespec import parse_slurm_time

# --- formats to run on the cluster ---------------------------------------------------------------

# squeue -o: %i job id (123, 123_4, 123_[1-5%2]), %T state, %r reason, %M time used, %l time limit,
# %D node count, %N node list (empty while pending), %b tres-per-node (gres:gpu:a6000:2),
# %P partition, %S start (actual, or expected for a pending job, or N/A), %V submit time,
# %j name: last, see above.
SQUEUE_FIELDS = ("%i", "%T", "%r", "%M", "%l", "%D", "%N", "%b", "%P", "%S", "%V", "%j")
SQUEUE_FORMAT = "|".join(SQUEUE_FIELDS)

# sacct --parsable2 (fields joined by '|', no trailing one). JobName last, as in squeue.
SACCT_FIELDS = (
    "JobID",
    "State",
    "ExitCode",
    "Elapsed",
    "Timelimit",
    "Submit",
    "Start",
    "End",
    "NNodes",
    "NodeList",
    "AllocTRES",
    "ReqTRES",
    "Partition",
    "Reason",
    "JobName",
)
SACCT_FORMAT = ",".join(SACCT_FIELDS)

# sinfo -N -O: ':0' means no padding (sinfo prints the whole value) and '|' is the suffix after
# each field. GresUsed has no -o letter, hence -O. StateComplete gives the base state and every
# flag ("mixed+drain") rather than StateLong's one word with a symbol ("draining").
SINFO_NODE_FIELDS = (
    "NodeList",
    "Partition",
    "StateComplete",
    "Gres",
    "GresUsed",
    "CPUs",
    "Memory",
    "Time",
    "Features",
)
SINFO_NODE_FORMAT = (
    ",".join(f"{field}:0|" for field in SINFO_NODE_FIELDS[:-1]) + f",{SINFO_NODE_FIELDS[-1]}:0"
)

# Job states after which nothing more will happen to the job (unless it is requeued).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)

# Words Slurm prints for "nothing here".
_EMPTY = {"", "(null)", "n/a", "none", "none assigned", "unknown"}


def _blank(value: str) -> str | None:
    value = value.strip()
    return None if value.lower() in _EMPTY else value


def _int(value: str) -> int | None:
    value = value.strip()
    return int(value) if value.isdigit() else None


def _seconds(value: str) -> int | None:
    try:
        return parse_slurm_time(value)
    except ValueError:
        return None


_CLUSTER_LINE = re.compile(r"^\s*CLUSTER:\s*\S*\s*$")


def _rows(text: str, n_fields: int, *, last_takes_rest: bool = True) -> list[list[str]]:
    """Non-empty lines split on '|' into exactly n_fields.

    ``last_takes_rest``: the last field keeps any extra '|' (a job name may hold one); otherwise
    fields after the n-th are columns this parser does not know (a newer Slurm, a site's wrapper)
    and are dropped. ``CLUSTER: name`` lines, which multi-cluster sites (``-M``, or a default
    cluster list) print before each cluster's rows, are skipped.
    """
    rows = []
    for line in text.splitlines():
        if not line.strip() or _CLUSTER_LINE.match(line):
            continue
        fields = line.split("|", n_fields - 1) if last_takes_rest else line.split("|")[:n_fields]
        if len(fields) < n_fields:
            raise ValueError(f"expected {n_fields} '|'-separated fields, got {len(fields)}: {line!r}")
        rows.append(fields)
    return rows


# --- host lists ------------------------------------------------------------------------------------


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets and parentheses: ``a[1,2],b(S:0,1)`` -> two parts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range_list(spec: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        item = item.split("%")[0]  # array throttle "1-5%2"; not part of a host list, harmless here
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
        elif item:
            out.append(item)
    return out


def expand_hostlist(text: str) -> list[str]:
    """``gpu[01-03,07],a100-[1-2]`` -> gpu01 gpu02 gpu03 gpu07 a100-1 a100-2, zero padding kept.

    Several bracket groups in one name multiply out (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), as
    ``scontrol show hostnames`` does. Empty, ``(null)`` and ``None assigned`` give [].
    """
    if _blank(text) is None:
        return []
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_expand_range_list(p[1:-1]) if p.startswith("[") else [p] for p in pieces]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


# --- gres and TRES -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gres:
    """One generic resource: ``gpu:a6000:2`` -> Gres("gpu", "a6000", 2). Untyped: type None."""

    name: str
    type: str | None
    count: int


def parse_gres(text: str) -> tuple[Gres, ...]:
    """Read a gres string as sinfo (Gres, GresUsed) or squeue (%b, tres-per-node) prints it.

    ``gpu:a6000:8(S:0-47)``, ``gpu:a6000:1(IDX:0),gpu:v100:0(IDX:N/A)``, ``gpu:4``,
    ``gres:gpu:a6000:2``, ``gres/gpu:2``, ``(null)``. The parenthesised socket or index lists
    may hold commas of their own. A count with a suffix (``shard:2K``) is read as its number.
    """
    if _blank(text) is None:
        return ()
    result = []
    for item in _split_top_level(text.strip()):
        item = re.sub(r"\([^()]*\)$", "", item)  # the trailing (S:0-47) or (IDX:0-1,5), not a "(null)" type
        for prefix in ("gres:", "gres/"):
            item = item.removeprefix(prefix)
        parts = item.split(":")
        count_text = parts[-1] if len(parts) > 1 else "1"
        m = re.fullmatch(r"(\d+)([KMGT]?)", count_text)
        if m:
            count = int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[m.group(2)]
            type_parts = parts[1:-1]
        else:  # "gres:gpu:a100" (no count) means one
            count = 1
            type_parts = parts[1:]
        gtype = ":".join(type_parts) or None
        if gtype is not None and _blank(gtype) is None:
            gtype = None
        result.append(Gres(parts[0], gtype, count))
    return tuple(result)


def _gpu_count(gres: Iterable[Gres], gpu_type: str | None = None) -> int:
    return sum(g.count for g in gres if g.name == "gpu" and (gpu_type is None or g.type == gpu_type))


def parse_tres(text: str) -> dict[str, str]:
    """``billing=2,cpu=2,gres/gpu:a6000=4,gres/gpu=4,mem=1000M,node=2`` -> a dict, in order."""
    result = {}
    for item in _split_top_level(text.strip()):
        key, eq, value = item.partition("=")
        if eq:
            result[key] = value
    return result


def _tres_gpus(tres: Mapping[str, str]) -> tuple[int, str | None]:
    """(total GPUs, GPU type) of a TRES dict; the type only when exactly one is named."""
    total = int(tres["gres/gpu"]) if tres.get("gres/gpu", "").isdigit() else 0
    types = [k.split(":", 1)[1] for k in tres if k.startswith("gres/gpu:")]
    if not total:
        total = sum(int(tres[k]) for k in tres if k.startswith("gres/gpu:") and tres[k].isdigit())
    return total, types[0] if len(types) == 1 else None


# --- job ids and states --------------------------------------------------------------------------

_JOB_ID = re.compile(r"(\d+)(?:_(\d+|\[[^\]]*\]))?(?:\+(\d+))?(?:\.(.+))?")


@dataclass(frozen=True)
class JobId:
    """``123``, array ``123_4`` / ``123_[1-5%2]``, het ``123+0``, step ``123.batch`` / ``123_4.0``."""

    raw: str
    base: str
    array_task: str | None = None  # "4" or "[1-5%2]" (a pending array's tasks still to run)
    het_offset: str | None = None
    step: str | None = None  # "batch", "extern", "0"

    @property
    def job(self) -> str:
        """The id without the step: the one to pass to scontrol, scancel and sacct -j."""
        return self.raw.split(".", 1)[0]


def parse_job_id(text: str) -> JobId:
    raw = text.strip()
    m = _JOB_ID.fullmatch(raw)
    if not m:
        raise ValueError(f"not a Slurm job id: {text!r}")
    base, task, het, step = m.groups()
    return JobId(raw=raw, base=base, array_task=task, het_offset=het, step=step)


def normalise_state(text: str) -> str:
    """``CANCELLED by 1234`` -> ``CANCELLED``; ``CANCELLED+`` -> ``CANCELLED``; upper case."""
    word = text.strip().split(" ", 1)[0].rstrip("+").upper()
    return word or "UNKNOWN"


# --- squeue ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueuedJob:
    """One line of ``squeue --format=SQUEUE_FORMAT``."""

    id: JobId
    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str | None  # why pending (Priority, Resources, QOSMaxGRESPerUser); None when "None"
    elapsed_seconds: int | None
    time_limit_seconds: int | None  # None: UNLIMITED or NOT_SET
    nodes: int
    node_list: tuple[str, ...]  # expanded; () while pending
    gres_per_node: tuple[Gres, ...]  # from tres-per-node
    partition: str
    start: str | None  # cluster-local "2026-01-01T10:00:00": actual, or expected while pending
    submit: str | None
    name: str

    @property
    def job_id(self) -> str:
        return self.id.raw

    @property
    def gpus_per_node(self) -> int:
        return _gpu_count(self.gres_per_node)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_type(self) -> str | None:
        types = {g.type for g in self.gres_per_node if g.name == "gpu"}
        return types.pop() if len(types) == 1 else None


def parse_squeue(text: str) -> list[QueuedJob]:
    """Jobs from ``squeue --noheader --format=SQUEUE_FORMAT`` output; empty output gives []."""
    jobs = []
    for f in _rows(text, len(SQUEUE_FIELDS)):
        job_id, state, reason, elapsed, limit, nodes, node_list, tres, partition, start, submit, name = f
        jobs.append(
            QueuedJob(
                id=parse_job_id(job_id),
                state=normalise_state(state),
                reason=_blank(reason),
                elapsed_seconds=_seconds(elapsed),
                time_limit_seconds=_seconds(limit),
                nodes=_int(nodes) or 0,
                node_list=tuple(expand_hostlist(node_list)),
                gres_per_node=parse_gres(tres),
                partition=partition.strip(),
                start=_blank(start),
                submit=_blank(submit),
                name=name,
            )
        )
    return jobs


# --- sacct ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AccountedJob:
    """One job (not step) from ``sacct --parsable2 --noheader --format=SACCT_FORMAT``."""

    id: JobId
    state: str  # normalised: "CANCELLED by 0" -> CANCELLED
    exit_code: int | None  # the batch script's exit code: N of ExitCode "N:S"
    exit_signal: int | None  # S of "N:S": the signal that killed it, 0 if none
    elapsed_seconds: int | None
    time_limit_seconds: int | None
    submit: str | None
    start: str | None  # None while pending ("Unknown")
    end: str | None  # None while running
    nodes: int
    node_list: tuple[str, ...]  # () while pending ("None assigned")
    alloc_tres: dict[str, str]
    req_tres: dict[str, str]
    partition: str
    reason: str | None
    name: str

    @property
    def job_id(self) -> str:
        return self.id.raw

    @property
    def gpus(self) -> int:
        """GPUs allocated, or requested while pending."""
        return _tres_gpus(self.alloc_tres)[0] or _tres_gpus(self.req_tres)[0]

    @property
    def gpu_type(self) -> str | None:
        return _tres_gpus(self.alloc_tres)[1] or _tres_gpus(self.req_tres)[1]

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    __hash__ = None  # type: ignore[assignment]  # dict fields: equality only


def _exit_code(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.strip().partition(":")
    return _int(code), _int(sig)


def parse_sacct(text: str) -> list[AccountedJob]:
    """Jobs from sacct output, one per job id, in first-seen order.

    Step rows (``123.batch``, ``123.extern``, ``123.0``) are skipped: the job's own row carries its
    exit code. When a job id appears twice (``--duplicates`` after a requeue), the last row wins.
    """
    jobs: dict[str, AccountedJob] = {}
    for f in _rows(text, len(SACCT_FIELDS)):
        (
            job_id,
            state,
            exit_code,
            elapsed,
            limit,
            submit,
            start,
            end,
            nnodes,
            nodelist,
            alloc,
            req,
            part,
            why,
            name,
        ) = f
        jid = parse_job_id(job_id)
        if jid.step is not None:
            continue
        code, sig = _exit_code(exit_code)
        jobs[jid.raw] = AccountedJob(
            id=jid,
            state=normalise_state(state),
            exit_code=code,
            exit_signal=sig,
            elapsed_seconds=_seconds(elapsed),
            time_limit_seconds=_seconds(limit),
            submit=_blank(submit),
            start=_blank(start),
            end=_blank(end),
            nodes=_int(nnodes) or 0,
            node_list=tuple(expand_hostlist(nodelist)),
            alloc_tres=parse_tres(alloc),
            req_tres=parse_tres(req),
            partition=part.strip(),
            reason=_blank(why),
            name=name,
        )
    return list(jobs.values())


# --- sinfo ----------------------------------------------------------------------------------------

# Node state flags that make a node take no new job (StateComplete words, lower case).
_UNUSABLE_FLAGS = {
    "drain",
    "fail",
    "maintenance",
    "not_responding",
    "reserved",
    "reboot_requested",
    "reboot_issued",
    "invalid_reg",
    "planned",
    "power_down",
    "powering_down",
}
# StateLong/StateCompact words, for output captured with the older formats.
_UNUSABLE_WORDS = {
    "drained",
    "draining",
    "drng",
    "drain",
    "down",
    "fail",
    "failing",
    "maint",
    "reserved",
    "resv",
    "inval",
    "plnd",
    "planned",
}


@dataclass(frozen=True)
class NodeInfo:
    """One node in one partition, from ``sinfo --Node --noheader --Format=SINFO_NODE_FORMAT``."""

    name: str
    partition: str  # without the '*' sinfo adds to the default partition
    default_partition: bool
    state: str  # as printed, lower case: "idle", "mixed", "mixed+drain", "down+not_responding"
    gres: tuple[Gres, ...]
    gres_used: tuple[Gres, ...]
    cpus: int | None
    memory_mb: int | None
    partition_max_time: str | None  # "3-00:00:00"; None for infinite
    features: tuple[str, ...]

    @property
    def base_state(self) -> str:
        return re.split(r"[+*~#!%$@^-]", self.state, maxsplit=1)[0]

    @property
    def usable(self) -> bool:
        """Whether a new job can start here: idle or mixed, no drain, down or similar flag.

        An "allocated" node has no free CPUs, so its free GPUs cannot be used either.
        """
        words = self.state.split("+")
        base, flags = words[0], set(words[1:])
        if flags & _UNUSABLE_FLAGS or base in _UNUSABLE_WORDS:
            return False
        if re.search(r"[*$@^!%-]$", base):  # StateLong suffixes: not responding, maint, reboot, planned
            return False
        return self.base_state in ("idle", "mixed", "mix")

    def gpus(self, gpu_type: str | None = None) -> int:
        return _gpu_count(self.gres, gpu_type)

    def gpus_used(self, gpu_type: str | None = None) -> int:
        return _gpu_count(self.gres_used, gpu_type)

    def gpus_idle(self, gpu_type: str | None = None) -> int:
        if not self.usable:
            return 0
        return max(0, self.gpus(gpu_type) - self.gpus_used(gpu_type))


def parse_sinfo_nodes(text: str) -> list[NodeInfo]:
    """Nodes from sinfo (one row per node and partition); empty output gives []."""
    nodes = []
    for f in _rows(text, len(SINFO_NODE_FIELDS), last_takes_rest=False):
        name, partition, state, gres, used, cpus, memory, max_time, features = (x.strip() for x in f)
        nodes.append(
            NodeInfo(
                name=name,
                partition=partition.rstrip("*"),
                default_partition=partition.endswith("*"),
                state=state.lower(),
                gres=parse_gres(gres),
                gres_used=parse_gres(used),
                cpus=_int(cpus),
                memory_mb=_int(memory),
                partition_max_time=None
                if max_time.lower() in ("infinite", "unlimited", "n/a", "")
                else max_time,
                features=tuple(x for x in (_blank(features) or "").split(",") if x),
            )
        )
    return nodes


def _distinct(nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
    """One row per node name: sinfo repeats a node for every partition it is in."""
    seen: dict[str, NodeInfo] = {}
    for node in nodes:
        seen.setdefault(node.name, node)
    return list(seen.values())


def gpu_availability(nodes: Iterable[NodeInfo]) -> dict[str, tuple[int, int]]:
    """``{gres type: (idle GPUs, total GPUs)}``, counting every node once.

    Idle GPUs are total minus used on nodes that can take a job; drained, down and fully
    allocated nodes contribute to the total only. Untyped GPUs are counted under "gpu".
    """
    result: dict[str, tuple[int, int]] = {}
    for node in _distinct(nodes):
        for gtype in dict.fromkeys(g.type for g in node.gres if g.name == "gpu"):
            key = gtype or "gpu"
            idle, total = result.get(key, (0, 0))
            result[key] = (idle + node.gpus_idle(gtype), total + node.gpus(gtype))
    return result


def availability_by_type(
    nodes: Iterable[NodeInfo], catalog: Mapping[str, GpuType]
) -> dict[str, tuple[int, int]]:
    """``{catalog type: (idle, total)}``: nodes of the type's partition holding its gres type.

    Rivanna's a100 (80 GB) and a100-40 share the gres type "a100" and differ by partition, so a
    gres type alone cannot tell them apart. A type with a simple constraint also needs that feature.
    """
    nodes = list(nodes)
    result = {}
    for name, gpu in catalog.items():
        gtype = gpu.gres or None
        members = [
            n
            for n in nodes
            if n.partition == gpu.partition
            and n.gpus(gtype) > 0
            and (
                not gpu.constraint
                or not re.fullmatch(r"[\w.-]+", gpu.constraint)
                or gpu.constraint in n.features
            )
        ]
        members = _distinct(members)
        result[name] = (sum(n.gpus_idle(gtype) for n in members), sum(n.gpus(gtype) for n in members))
    return result


# --- catalog discovery ------------------------------------------------------------------------------

_MIG_PROFILE = re.compile(r"\d+g\.\d+gb", re.IGNORECASE)


def _type_name(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "gpu"


def discover_catalog(sinfo_text: str) -> dict[str, GpuType]:
    """A GPU catalog from sinfo's per-node output (SINFO_NODE_FORMAT), for clusters rv has no facts on.

    One type per gres type. Its partition: the one whose name contains the type (``gpu-a6000`` for
    a6000) when a type appears in several; else the default partition; else the one with the most
    such nodes. So both partition-per-type clusters and mixed partitions (one ``gpu`` partition,
    types told apart by gres) come out right. When several partitions name the type
    (``gpu-a100-40``, ``gpu-a100-80``), each becomes its own type, named after its partition.
    A single MIG profile (``1g.10gb``) is named ``mig`` so that ``--mig`` finds it.
    ``gpus_per_node`` is the most GPUs of the type on one node of the partition. CPUs and memory per
    GPU are a node's CPUs and memory shared out over all its GPUs (of any type), the least over the
    type's nodes, so a job asking for them fits on every one. SU rates and limits are unknown (None):
    sinfo does not know them.
    """
    nodes = parse_sinfo_nodes(sinfo_text)
    # (gres type, partition) -> {node name: GPUs of that type on it}
    holdings: dict[tuple[str, str], dict[str, int]] = {}
    default_partitions = {n.partition for n in nodes if n.default_partition}
    max_time: dict[str, str | None] = {}
    # node name -> (CPUs per GPU, MB per GPU), over all of the node's GPUs
    share: dict[str, tuple[int | None, int | None]] = {}
    for node in nodes:
        max_time[node.partition] = node.partition_max_time
        gpus_here = sum(g.count for g in node.gres if g.name == "gpu" and g.count > 0)
        if gpus_here:
            share[node.name] = (
                node.cpus // gpus_here if node.cpus else None,
                node.memory_mb // gpus_here if node.memory_mb else None,
            )
        for g in node.gres:
            if g.name != "gpu" or g.count <= 0:
                continue
            key = (g.type or "", node.partition)
            holdings.setdefault(key, {})[node.name] = max(holdings.get(key, {}).get(node.name, 0), g.count)
    gres_types = sorted({gtype for gtype, _ in holdings})
    mig_profiles = [t for t in gres_types if _MIG_PROFILE.fullmatch(t)]
    catalog: dict[str, GpuType] = {}
    for gtype in gres_types:
        partitions = sorted(p for t, p in holdings if t == gtype)
        norm = _type_name(gtype) if gtype else ""
        named = [p for p in partitions if norm and norm in p.lower()] if gtype else []
        if gtype in mig_profiles and len(mig_profiles) == 1:
            named = named or [p for p in partitions if "mig" in p.lower()]
        if named:
            chosen = named
        else:
            defaults = [p for p in partitions if p in default_partitions]
            chosen = defaults or [max(partitions, key=lambda p: (len(holdings[(gtype, p)]), p))]
        for partition in chosen:
            held = holdings[(gtype, partition)]
            if len(chosen) > 1:
                name = _type_name(re.sub(r"^gpu[-_]?", "", partition, flags=re.IGNORECASE) or partition)
            elif gtype in mig_profiles and len(mig_profiles) == 1:
                name = "mig"
            elif gtype:
                name = _type_name(gtype)
            else:
                name = _type_name(re.sub(r"^gpu[-_]?", "", partition, flags=re.IGNORECASE) or partition)
            shares = [share.get(n, (None, None)) for n in held]
            cpus = [c for c, _ in shares if c]
            mems = [m for _, m in shares if m]
            # Only when every node of the type says: a guess from some would not fit the others.
            cpus_per_gpu = min(cpus) if len(cpus) == len(shares) else None
            mem_per_gpu = min(mems) if len(mems) == len(shares) else None
            catalog[name] = GpuType(
                name=name,
                partition=partition,
                gres=gtype,
                gpus_per_node=max(held.values()),
                compute_capability=compute_capability_for(gtype) if gtype else None,
                vram_gb=memory_gb_for(gtype) if gtype else None,
                max_time=max_time.get(partition),
                cpus_per_gpu=cpus_per_gpu,
                mem_per_gpu=f"{mem_per_gpu}M" if mem_per_gpu else None,
                nodes=len(held),
            )
    return dict(sorted(catalog.items()))


# --- accounts ---------------------------------------------------------------------------------------


def parse_sacctmgr_accounts(text: str) -> list[str]:
    """Accounts from ``sacctmgr -nP show assoc user=USER format=account``: distinct, in order.

    sacctmgr prints one row per association (cluster, partition), so an account can repeat.
    """
    return list(dict.fromkeys(line.strip() for line in text.splitlines() if line.strip()))


def account_from_sacctmgr(text: str) -> str | None:
    """The user's account when there is exactly one; None when none or several (ask the user)."""
    accounts = parse_sacctmgr_accounts(text)
    return accounts[0] if len(accounts) == 1 else None


@dataclass(frozen=True)
class Allocation:
    """One row of Rivanna's ``allocations``: service units (SU) of one account."""

    account: str
    balance: float
    reserved: float
    available: float


_ALLOCATION_ROW = re.compile(r"(\S+)\s+([\d,]+(?:\.\d+)?)\s+([\d,]+(?:\.\d+)?)\s+(-?[\d,]+(?:\.\d+)?)\s*")


def parse_allocations(text: str) -> list[Allocation]:
    """Rows of Rivanna's ``allocations`` table (Account, Balance, Reserved, Available).

    Header, dashes and the trailing help lines are skipped: only rows with three numbers count.
    """
    result = []
    for line in text.splitlines():
        m = _ALLOCATION_ROW.fullmatch(line.strip())
        if m and not line.strip().lower().startswith("account"):
            name, *numbers = m.groups()
            balance, reserved, available = (float(n.replace(",", "")) for n in numbers)
            result.append(Allocation(name, balance, reserved, available))
    return result


def account_from_allocations(text: str) -> str | None:
    """The account with the most SUs available (first on a tie), or None when there is none with any."""
    rows = [a for a in parse_allocations(text) if a.available > 0]
    if not rows:
        return None
    return max(rows, key=lambda a: a.available).account


@dataclass(frozen=True)
class NodeAddress:
    """Where a node is reached, as ``scontrol -o show node`` says: node names need not resolve."""

    name: str
    addr: str  # NodeAddr: what other hosts connect to (an IP on the loopback cluster)
    hostname: str | None  # NodeHostName

    @property
    def reach(self) -> str:
        return self.addr or self.hostname or self.name


_NODE_KEY = re.compile(r"(?:^|\s)(NodeName|NodeAddr|NodeHostName)=(\S*)")


def parse_node_addresses(text: str) -> dict[str, NodeAddress]:
    """``scontrol -o show node A,B`` (one line per node) -> {node name: its address}.

    Values may hold spaces elsewhere on the line (``OS=Linux 6.1 #1 SMP``): only the three keys are
    read, each as one word.
    """
    out: dict[str, NodeAddress] = {}
    for line in text.splitlines():
        keys = dict(_NODE_KEY.findall(line))
        name = keys.get("NodeName")
        if not name:
            continue
        addr = _blank(keys.get("NodeAddr", "")) or ""
        out[name] = NodeAddress(name=name, addr=addr, hostname=_blank(keys.get("NodeHostName", "")))
    return out
