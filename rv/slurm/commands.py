"""The Slurm commands rv runs from Python, built in one place: argv lists in, nothing executed here.

Two kinds of caller use them: the cluster-side agent (argv lists, run without a shell; the laptop
hands them over in its arguments) and shell lines sent over SSH (:func:`shell`). Keeping the formats
here means one ``squeue`` format for the whole program, parsed by :mod:`rv.slurm.parse`.

The job's runtime (rv/agent/job.sh) runs a few of its own, on its own job only: the next segment's
``sbatch`` (with the options of :func:`sbatch`; a unit test holds the two together), ``scancel`` of
a run's other candidates, and ``scontrol``/``sinfo``/``squeue`` about its nodes and end time.

``USER`` in an argv is a placeholder: the agent puts the login name in its place, and :func:`shell`
writes ``"$(id -un)"``. ``squeue --me`` would be simpler but needs Slurm 20.11.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence

from rv.slurm.parse import SACCT_FORMAT, SINFO_NODE_FORMAT, SQUEUE_FORMAT
from rv.slurm.pending import ASSOC_FIELDS, QOS_FIELDS, QUEUE_FORMAT

USER = "{user}"


# squeue and sacct print times as SLURM_TIME_FORMAT says; a user's `relative` would break parsing.
_STANDARD_TIME = ["env", "SLURM_TIME_FORMAT=standard"]
# rv why's asks: times as epoch seconds, so how far away a start is needs no guess at the cluster's zone.
_EPOCH_TIME = ["env", "SLURM_TIME_FORMAT=%s"]


def shell(argv: Sequence[str]) -> str:
    """One shell line for ``argv``: literals quoted once, the ``USER`` placeholder as shell text."""
    return " ".join('"$(id -un)"' if word == USER else shlex.quote(word) for word in argv)


def squeue_user() -> list[str]:
    """All of the user's queued and running jobs, one ``SQUEUE_FORMAT`` line each.

    ``-r``: one line per task of a job array, pending ones too (``123_4``, as a sweep's point's
    seg/1.job names it), never one ``123_[4-9%2]`` line for the tasks still to run.
    """
    return [*_STANDARD_TIME, "squeue", "-h", "-r", "-u", USER, "-o", SQUEUE_FORMAT]


def sacct_user(days: int) -> list[str]:
    """The user's jobs of the last ``days`` days from accounting (fails where there is none)."""
    return [
        *_STANDARD_TIME, "sacct", "-u", USER, "-S", f"now-{int(days)}days", "-n", "--parsable2",
        "-o", SACCT_FORMAT,
    ]  # fmt: skip


def sinfo_nodes() -> list[str]:
    return ["sinfo", "-N", "-h", "-O", SINFO_NODE_FORMAT]


# Per partition (one row per partition and node state): name ('*' marks the default), time limit,
# and the job size in nodes as MIN-MAX ("1-infinite").
SINFO_PARTITION_FORMAT = "%P|%l|%s"


def sinfo_partitions() -> list[str]:
    return ["sinfo", "-h", "-o", SINFO_PARTITION_FORMAT]


def sacctmgr_associations() -> list[str]:
    """The user's associations: account, partition ("" for all), default QoS, the QoS allowed."""
    return ["sacctmgr", "-nP", "show", "assoc", f"user={USER}", "format=account,partition,defaultqos,qos"]


def scontrol_show_config() -> list[str]:
    """The controller's settings, ``Key = Value`` lines (MaxArraySize, SchedulerParameters, ...)."""
    return ["scontrol", "show", "config"]


def sacctmgr_submit_limits() -> list[str]:
    """The user's associations with their job limit: account, partition, MaxSubmitJobs, default QOS."""
    return [
        "sacctmgr",
        "-nP",
        "show",
        "assoc",
        f"user={USER}",
        "format=account,partition,maxsubmitjobs,defaultqos",
    ]


def sacctmgr_qos_submit_limits() -> list[str]:
    """Every QOS with its per-user job limit (MaxSubmitJobsPerUser)."""
    return ["sacctmgr", "-nP", "show", "qos", "format=name,maxsubmitjobsperuser"]


def scancel(job_ids: Iterable[str]) -> list[str]:
    return ["scancel", *job_ids]


def sbatch(script: str, *, after: str | None = None) -> list[str]:
    """Submit ``script``; prints ``ID`` (or ``ID;CLUSTER``). ``after``: start only once that job ended.

    ``afterany`` rather than ``afterok``: a segment that stopped at its time limit may end in any
    state, and the next one must still start. ``--kill-on-invalid-dep`` removes it from the queue
    when the dependency can never be met (the earlier job vanished), instead of pending forever.
    """
    argv = ["sbatch", "--parsable"]
    if after is not None:
        argv += [f"--dependency=afterany:{after}", "--kill-on-invalid-dep=yes"]
    return [*argv, script]


def sbatch_test_only(*, epoch: bool = False) -> list[str]:
    """Judge the script on stdin without submitting it: when and where it would start, or why not.
    ``epoch``: the start as epoch seconds (rv why compares it with the scheduler's plan)."""
    return [*(_EPOCH_TIME if epoch else []), "sbatch", "--test-only"]


def scontrol_show_nodes(nodes: Sequence[str]) -> list[str]:
    """One line per node (``NodeName=`` ... ``NodeAddr=`` ... ``NodeHostName=``), for many at once."""
    return ["scontrol", "-o", "show", "node", ",".join(nodes)]


def srun_attach(
    job_id: str, node: str, command: Sequence[str], *, pty: bool = False, options: Sequence[str] = ()
) -> list[str]:
    """A step of the running job ``job_id`` on ``node`` alone, running ``command`` beside the program.

    ``--overlap`` shares the job's CPUs, memory and GPUs with its other steps (the program's): without
    it srun waits for them to end. ``--pty``: the command's terminal (an interactive shell).
    ``options``: more of srun's (Pyxis's, that enter the job's image).
    """
    argv = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}"]
    if pty:
        argv.append("--pty")
    return [*argv, *options, *command]


def srun_each_node(job_id: str, nodes: int, command: Sequence[str]) -> list[str]:
    """One task on each of the running job's ``nodes`` nodes, beside the program; lines labelled
    with the task number (``0: ...``), so the nodes' output never mixes within a line."""
    return [
        "srun", f"--jobid={job_id}", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}",
        "--ntasks-per-node=1", "--label", *command,
    ]  # fmt: skip


def squeue_job(job_id: str) -> list[str]:
    """One ``SQUEUE_FORMAT`` line for ``job_id`` while it is queued or running; nothing (or an
    "Invalid job id" error, once Slurm has forgotten it) after."""
    return [*_STANDARD_TIME, "squeue", "-h", "-j", job_id, "-o", SQUEUE_FORMAT]


# --- rv why: what Slurm says of a pending job, its partition's queue and the limits ------------------


def scontrol_show_job(job_id: str) -> list[str]:
    """One ``Key=Value`` line for ``job_id``: its reason, priority, QoS, expected start, TRES."""
    return [*_EPOCH_TIME, "scontrol", "-o", "show", "job", job_id]


def squeue_partition(partition: str) -> list[str]:
    """Every user's queued and running jobs in ``partition`` (QUEUE_FORMAT), the jobs a run waits behind."""
    return [*_EPOCH_TIME, "squeue", "-h", "-r", "-p", partition, "-t", "PD,R,CG", "-o", QUEUE_FORMAT]


def sacctmgr_qos_limits() -> list[str]:
    """Every QoS with its limits (fails where there is no accounting)."""
    return ["sacctmgr", "-nP", "show", "qos", "format=" + ",".join(QOS_FIELDS)]


def sacctmgr_assoc_limits() -> list[str]:
    """The user's associations with their limits and the QoS each allows."""
    return ["sacctmgr", "-nP", "show", "assoc", f"user={USER}", "format=" + ",".join(ASSOC_FIELDS)]
