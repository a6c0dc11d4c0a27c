"""``rv run --on SESSION``: a run started as a step of a held allocation's job (a session of
``rv up --detach``, ``rv code`` or ``rv jupyter``) instead of through sbatch.

The run is a run of its own (its folder, snapshot, records, logs: ``rv ps``, ``rv logs`` and
``rv stop`` know it); only where it runs differs. So what would need another allocation is refused
here, before anything is sent: more GPUs or nodes than the session holds, another GPU type, a sweep,
more than one segment (no chains: the session's end is the run's end), a time limit past the
session's end. What the user left out is taken from the session: its GPUs, type, nodes, time left
and its container (a step of a session in an image runs in that image, unless ``--container`` says
another or ``none``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rv.errors import UsageError
from rv.job.submit import OnSession
from rv.slurm.container import from_meta
from rv.timespec import format_slurm_time, parse_duration

if TYPE_CHECKING:
    from rv.job.inside import RunningJob
    from rv.job.launch import RunOptions

HINT = "rv run --on runs inside what the session holds; leave --on out for a job of its own"


def refuse_alone(options: RunOptions) -> None:
    """What --on never takes, whatever the session: checked before any network call."""
    if options.sweep or options.sweep_file is not None:
        raise UsageError("--on SESSION runs one command in the session: no --sweep", hint=HINT)
    if options.max_segments is not None and options.max_segments > 1:
        raise UsageError(
            "--on SESSION: the session's time limit ends the run, so it has one segment "
            f"(no chains: --max-segments {options.max_segments})",
            hint=HINT,
        )


def fit(options: RunOptions, session: RunningJob) -> tuple[RunOptions, OnSession]:
    """``options`` with the session's shape filled in; UsageError (nothing sent) when the run needs
    more than the session holds."""
    meta = session.run.meta
    if list(meta.get("command") or [])[3:4] != ["rv-up"]:  # rv.job.up.holder_command: rv up, code, jupyter
        raise UsageError(
            f"--on {session.name}: run {session.name} is not a session (rv up --detach, rv code, rv jupyter)",
            hint="rv ps lists sessions and runs; rv up --detach holds an allocation to run in",
        )
    gpus = int(meta.get("gpus") or 0)
    gpu_type = meta.get("gpu_type")
    nodes = int(meta.get("nodes") or len(session.nodes) or 1)
    holds = (
        f"job {session.job_id}, {gpus} GPU(s)"
        + (f" of type {gpu_type}" if gpu_type else "")
        + f" on {nodes} node(s)"
    )
    left = None
    if session.job.time_limit_seconds is not None:
        left = max(0, session.job.time_limit_seconds - (session.job.elapsed_seconds or 0))
        holds += f", {format_slurm_time(left)} left"
    if options.gpus is not None and options.gpus > gpus:
        raise UsageError(
            f"--on {session.name}: -g {options.gpus} asks more than it holds: {holds}", hint=HINT
        )
    if options.gpu_type is not None and options.gpu_type.lower() != str(gpu_type or "").lower():
        raise UsageError(
            f"--on {session.name}: -t {options.gpu_type} asks another type than it holds: {holds}", hint=HINT
        )
    if options.nodes is not None and options.nodes > nodes:
        raise UsageError(
            f"--on {session.name}: --nodes {options.nodes} asks more than it holds: {holds}", hint=HINT
        )
    time = options.time
    if time is not None and left is not None and parse_duration(time) > left:
        raise UsageError(f"--on {session.name}: --time {time} runs past its end: {holds}", hint=HINT)
    if time is None and left is not None:
        time = format_slurm_time(max(60, left))
    container, runtime = options.container, options.container_runtime
    held_image = from_meta(meta.get("container"))
    if container is None and held_image is not None:
        # The session's image as the cluster resolved it (a pulled reference: its cached file).
        container, runtime = held_image[0].image, runtime or held_image[0].runtime
    fitted = replace(
        options,
        gpus=gpus if options.gpus is None else options.gpus,
        gpu_type=gpu_type if gpus else None,
        nodes=nodes if options.nodes is None else options.nodes,
        time=time,
        max_segments=1,
        container=container,
        container_runtime=runtime,
    )
    return fitted, OnSession(session.name, session.job_id, session.nodes)
