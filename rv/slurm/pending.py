"""Why a job waits, in words: Slurm's pending reasons, the limits they name, the queue ahead (rv why).

Pure parsers of what Slurm prints about a pending job, each tested against captured output
(``tests/captured/``), and the table that turns Slurm's one-word reason (``Priority``,
``QOSMaxJobsPerUserLimit``, ``AssocGrpGRESMinutes``) into what it means and, for a limit, which
``sacctmgr`` field holds its value.

* ``scontrol -o show job J``: one line per job, ``Key=Value`` pairs (:func:`parse_scontrol_jobs`).
* ``squeue -p PART``: the jobs of the job's partition (:data:`QUEUE_FORMAT`, :func:`parse_queue`).
* ``sacctmgr -nP show qos`` / ``show assoc``: the limits (:data:`QOS_FIELDS`, :data:`ASSOC_FIELDS`).
* ``scontrol show config``: the backfill window (:func:`parse_backfill_window`).

Times are asked as epoch seconds (``SLURM_TIME_FORMAT=%s``, rv.slurm.commands): the cluster's own
clock and time zone then never need guessing to tell how far away a start is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rv.slurm.parse import _blank, _int, _seconds

# --- scontrol -o show job --------------------------------------------------------------------------

# A key starts after a space: letters, digits and Slurm's own punctuation (AllocNode:Sid, CPUs/Task).
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_line(line: str) -> dict[str, str]:
    """One ``scontrol -o show ...`` line -> {key: value}. A value runs to the next `` Key=``, so one
    holding spaces (``Reason=ReqNodeNotAvail, UnavailableNodes:node2``, a command) stays whole."""
    found = list(_KEY.finditer(line))
    out = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol -o show job`` says of one job (what rv why reads)."""

    job_id: str
    state: str
    reason: str | None  # None: "None"
    priority: int | None
    partition: str
    qos: str | None
    account: str | None
    time_limit_seconds: int | None
    submit: int | None  # epoch seconds
    start: int | None  # the expected start while pending (what squeue --start shows), else the start
    end: int | None
    dependency: str | None
    reservation: str | None
    nodes: int | None
    tres: Mapping[str, str]  # ReqTRES (pending) or TRES: {"cpu": "1", "gres/gpu": "2", ...}
    node_list: str | None  # where it runs (NodeList) or asked to (ReqNodeList)
    exit_code: str | None


def parse_scontrol_jobs(text: str) -> list[SlurmJob]:
    jobs = []
    for line in text.splitlines():
        f = parse_scontrol_line(line)
        if "JobId" not in f:
            continue
        tres_text = _blank(f.get("ReqTRES", "")) or _blank(f.get("TRES", "")) or ""
        tres = dict(item.split("=", 1) for item in tres_text.split(",") if "=" in item)
        job_id = f["JobId"]
        if _blank(f.get("ArrayJobId", "")) and _blank(f.get("ArrayTaskId", "")):
            job_id = f"{f['ArrayJobId']}_{f['ArrayTaskId']}"
        jobs.append(
            SlurmJob(
                job_id=job_id,
                state=f.get("JobState", ""),
                # scontrol writes "ReqNodeNotAvail,_UnavailableNodes:node2" where squeue has a space.
                reason=_blank(f.get("Reason", "").replace(",_", ", ")),
                priority=_int(f.get("Priority", "")),
                partition=f.get("Partition", ""),
                qos=_blank(f.get("QOS", "")),
                account=_blank(f.get("Account", "")),
                time_limit_seconds=_seconds(f.get("TimeLimit", "")),
                submit=_int(f.get("SubmitTime", "")),
                start=_int(f.get("StartTime", "")),
                end=_int(f.get("EndTime", "")),
                dependency=_blank(f.get("Dependency", "")),
                reservation=_blank(f.get("Reservation", "")),
                nodes=_int(f.get("NumNodes", "").split("-")[0]),
                tres=tres,
                node_list=_blank(f.get("NodeList", "")) or _blank(f.get("ReqNodeList", "")),
                exit_code=_blank(f.get("ExitCode", "")),
            )
        )
    return jobs


# --- the partition's queue ------------------------------------------------------------------------

QUEUE_FIELDS = ("%i", "%u", "%T", "%Q", "%S", "%l", "%D", "%b", "%r")
QUEUE_FORMAT = "|".join(QUEUE_FIELDS)


@dataclass(frozen=True)
class QueueEntry:
    job_id: str
    user: str
    state: str
    priority: int | None
    start: int | None  # epoch: expected start of a pending job (None when not planned), else its start
    time_limit_seconds: int | None
    nodes: int | None
    tres_per_node: str | None
    reason: str | None


def parse_queue(text: str) -> list[QueueEntry]:
    """``squeue -h -p PART -t PD,R,CG -o QUEUE_FORMAT`` (the reason last: it may hold ``|``-free commas)."""
    out = []
    for line in text.splitlines():
        cells = line.split("|", len(QUEUE_FIELDS) - 1)
        if len(cells) != len(QUEUE_FIELDS) or not cells[0].strip():
            continue
        job, user, state, prio, start, limit, nodes, tres, reason = (c.strip() for c in cells)
        entry = QueueEntry(
            job_id=job, user=user, state=state, priority=_int(prio), start=_int(start),
            time_limit_seconds=_seconds(limit), nodes=_int(nodes), tres_per_node=_blank(tres),
            reason=_blank(reason),
        )  # fmt: skip
        out.append(entry)
    return out


# --- limits: sacctmgr -------------------------------------------------------------------------------

QOS_FIELDS = (
    "name", "priority", "maxjobspu", "maxsubmitpu", "maxtrespu", "grptres", "grpjobs", "maxtres", "maxwall",
    "grptresmins", "grptresrunmins", "maxtrespa", "maxjobspa",
)  # fmt: skip
ASSOC_FIELDS = (
    "account", "partition", "qos", "defaultqos", "grptres", "grpjobs", "maxjobs", "maxtres", "maxwall",
    "grptresmins", "grptresrunmins", "maxsubmit",
)  # fmt: skip


def parse_sacctmgr(text: str, fields: tuple[str, ...]) -> list[dict[str, str]]:
    """``sacctmgr -nP show ... format=FIELDS`` -> one {field: value} per row (empty: not set)."""
    rows = []
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) >= len(fields) and cells[0].strip():
            rows.append({f: c.strip() for f, c in zip(fields, cells, strict=False)})
    return rows


def tres_value(text: str, key: str) -> str | None:
    """``gres/gpu=4,cpu=16`` -> the value of ``key`` (``gres/gpu``; ``gres/gpu`` also matches a typed
    ``gres/gpu:a100=2`` when no untyped one is set)."""
    pairs = [item.split("=", 1) for item in text.split(",") if "=" in item]
    for k, v in pairs:
        if k == key:
            return v
    typed = [f"{k}={v}" for k, v in pairs if k.startswith(key + ":")]
    return ",".join(typed) or None


def parse_backfill_window(config_text: str) -> int:
    """``scontrol show config`` -> the backfill scheduler's window in seconds (bf_window, minutes; 1 day
    when not set, Slurm's default)."""
    for line in config_text.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.strip() == "SchedulerParameters":
            for item in value.strip().split(","):
                name, _, number = item.strip().partition("=")
                if name == "bf_window" and number.isdigit():
                    return int(number) * 60
    return 1440 * 60


# --- reasons ----------------------------------------------------------------------------------------

# What a reason is about, for what rv why tries: "priority", "resources", "limit", "dependency",
# "begin", "reservation", "held", "partition", "nodes", "other".


@dataclass(frozen=True)
class Limit:
    """The limit a QoS or association reason names: where its value is (``sacctmgr`` field and TRES)."""

    owner: str  # "qos" or "assoc"
    field: str  # a QOS_FIELDS / ASSOC_FIELDS name
    tres: str | None  # a TRES key in that field ("gres/gpu", "cpu", ...), or None for a plain number
    what: str  # "running jobs per user", "GPUs of all its jobs together", ...


@dataclass(frozen=True)
class Reason:
    code: str
    kind: str
    words: str  # one line: what it means
    limit: Limit | None = None


_PLAIN = {
    "Priority": ("priority", "waiting behind jobs of higher priority"),
    "Resources": ("resources", "waiting for the GPUs, CPUs or memory it asks for to free up"),
    "Dependency": ("dependency", "waiting for a job it depends on to end"),
    "DependencyNeverSatisfied": ("dependency", "its dependency can never be met: it will not start"),
    "BeginTime": ("begin", "its begin time (--begin) has not come yet"),
    "Reservation": ("reservation", "waiting for its reservation to start"),
    "ReqNodeNotAvail": ("nodes", "a node it needs is down, drained, reserved or kept for a job ahead"),
    "NodeDown": ("nodes", "a node it needs is down"),
    "BadConstraints": ("nodes", "no node has the features (--constraint) it asks for"),
    "JobHeldUser": ("held", "held by you: scontrol release JOB lets it go"),
    "JobHeldAdmin": ("held", "held by an administrator"),
    "PartitionTimeLimit": ("partition", "its --time is over the partition's time limit"),
    "PartitionNodeLimit": ("partition", "it asks for more nodes than the partition allows"),
    "PartitionDown": ("partition", "its partition is down"),
    "PartitionInactive": ("partition", "its partition is inactive"),
    "PartitionConfig": ("partition", "the partition does not allow this job (its account, QoS or size)"),
    "InvalidQOS": ("limit", "its QoS is not one its account may use"),
    "InvalidAccount": ("limit", "its account is not valid"),
    "launch failed requeued held": ("held", "its launch failed and Slurm held it"),
    "BurstBufferResources": ("resources", "waiting for burst buffer space"),
    "Licenses": ("resources", "waiting for licenses"),
    "Cleaning": ("other", "Slurm is still cleaning up after a previous run of it"),
    "None": ("other", "not yet looked at by the scheduler"),
}

# QOS<rest> and Assoc<rest>: what the rest names. (sacctmgr field, TRES key, words)
_LIMITS: dict[str, tuple[str, str | None, str]] = {
    "MaxJobsPerUserLimit": ("maxjobspu", None, "running jobs per user"),
    "MaxJobsPerAccountLimit": ("maxjobspa", None, "running jobs per account"),
    "MaxSubmitJobPerUserLimit": ("maxsubmitpu", None, "queued jobs per user"),
    "MaxGRESPerUser": ("maxtrespu", "gres/gpu", "GPUs per user"),
    "MaxCpuPerUserLimit": ("maxtrespu", "cpu", "CPUs per user"),
    "MaxMemoryPerUser": ("maxtrespu", "mem", "memory per user"),
    "MaxNodePerUserLimit": ("maxtrespu", "node", "nodes per user"),
    "MaxGRESPerAccount": ("maxtrespa", "gres/gpu", "GPUs per account"),
    "MaxGRESPerJob": ("maxtres", "gres/gpu", "GPUs per job"),
    "MaxCpuPerJobLimit": ("maxtres", "cpu", "CPUs per job"),
    "MaxNodePerJobLimit": ("maxtres", "node", "nodes per job"),
    "MaxWallDurationPerJobLimit": ("maxwall", None, "time per job"),
    "GrpGRES": ("grptres", "gres/gpu", "GPUs of all its jobs together"),
    "GrpCpuLimit": ("grptres", "cpu", "CPUs of all its jobs together"),
    "GrpMemLimit": ("grptres", "mem", "memory of all its jobs together"),
    "GrpNodeLimit": ("grptres", "node", "nodes of all its jobs together"),
    "GrpJobsLimit": ("grpjobs", None, "running jobs of all its users together"),
    "GrpGRESMinutes": ("grptresmins", "gres/gpu", "GPU-minutes (its allocation is used up)"),
    "GrpCPUMinutesLimit": ("grptresmins", "cpu", "CPU-minutes (its allocation is used up)"),
    "GrpGRESRunMinutes": ("grptresrunmins", "gres/gpu", "GPU-minutes its running jobs may still use"),
    "GrpCPURunMinutesLimit": ("grptresrunmins", "cpu", "CPU-minutes its running jobs may still use"),
    # Associations name the per-user job limit without "PerUser": the association is the user's.
    "MaxJobsLimit": ("maxjobs", None, "running jobs"),
    "MaxSubmitJobLimit": ("maxsubmit", None, "queued jobs"),
}


def reason(code: str | None) -> Reason:
    """Slurm's reason ``code`` in words (an unknown one is said as Slurm's own word)."""
    code = (code or "None").strip()
    word = code.split(",", 1)[0].strip()  # "ReqNodeNotAvail, UnavailableNodes:node2"
    if word in _PLAIN:
        kind, words = _PLAIN[word]
        return Reason(code, kind, words)
    for prefix, owner, whose in (("QOS", "qos", "its QoS"), ("Assoc", "assoc", "its account (association)")):
        if word.startswith(prefix):
            rest = word[len(prefix) :]
            if rest in _LIMITS:
                field, tres, what = _LIMITS[rest]
                limit = Limit(owner, field, tres, what)
                return Reason(code, "limit", f"held by a limit of {whose}: {what}", limit)
            return Reason(code, "limit", f"held by a limit of {whose} ({word})")
    return Reason(code, "other", f"Slurm's reason: {word}")


def said_code(code: str | None) -> str | None:
    """Slurm's reason code as worth showing beside its words: None for ``None`` (Slurm's word for no
    reason yet), which read as a bug ("pending (None: not yet looked at by the scheduler)")."""
    code = (code or "None").strip()
    return None if code == "None" else code


def one_line(code: str | None) -> str:
    """`rv ps`'s form: Slurm's word, then what it means (``Priority: waiting behind jobs of higher
    priority``); the words alone when Slurm has none yet."""
    r = reason(code)
    return f"{r.code}: {r.words}" if said_code(code) else r.words
