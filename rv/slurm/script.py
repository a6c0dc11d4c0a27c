"""The batch script of a run: the job's ``#SBATCH`` lines, its values and the user's own lines.

:func:`render_script` turns a validated :class:`~rv.request.JobRequest` and a :class:`ScriptContext`
(where the run's things live on the cluster) into the text handed to ``sbatch``. Nothing here touches
the network, the clock or the environment, so the same input always gives the same bytes
(``tests/golden/*.sh``).

What every job does is not here: it is rv's job runtime, the shell file ``rv/agent/job.sh`` and its
parts beside it joined into one (:data:`JOB_RUNTIME_PARTS`), which rv ships into the remote root once
per content (:func:`runtime_files`, ``<root>/runtime/``) and the batch script sources. So the script
holds only what differs between jobs:

1. ``#SBATCH`` directives. No ``--signal`` (job.sh says why), never ``--time-min`` (it lets Slurm
   shorten the time limit), ``--requeue`` (after a node failure or a preemption Slurm runs the same
   job again, and the runtime finds its work dir and secrets).
2. The job's values as plain shell variables (job.sh's header lists them): the run's paths and
   sizes, the GPU type and the catalog's compute capability (the fallback for precision), what the
   run has (secrets, labelled ranks, ``-o`` paths).
3. ``rv_begin``; the profile's environment, the setup lines and rv's env-build hook, at the
   script's top level (module systems and activate scripts expect that); ``rv_start``.
4. The program, as the function ``rv_program`` that each ``srun`` task runs under rv's stop watcher
   (``rv_task`` in job.sh); ``rv_launch``.

The user's command enters once, quoted, in ``rv_program``; the property test in
``tests/unit/test_script.py`` runs the result with bash and checks argv byte for byte.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from rv.agent import layout as remote_layout
from rv.errors import ConfigError, UsageError
from rv.layout import RemoteLayout
from rv.request import JobRequest
from rv.slurm import container
from rv.slurm.container import Container
from rv.slurm.launch import program_line
from rv.slurmoptions import ACCOUNT, CONSTRAINT, PARTITION, Placement
from rv.timespec import IDLE_GPU_DEFAULT, format_slurm_time

_AGENT = Path(__file__).resolve().parent.parent / "agent"
# The job's runtime and the rank labeller: shipped beside each other into <root>/runtime/.
JOB_RUNTIME = _AGENT / "job.sh"
# The runtime's parts, joined in this order into the one file a job sources (job.sh's header says why
# one file: a single name hashed over all of them, written whole).
JOB_RUNTIME_PARTS = (
    JOB_RUNTIME,
    *(_AGENT / f"job_{part}.sh" for part in ("workdir", "store", "stop", "notify")),
)
RANK_LABELLER = _AGENT / "ranklabel.py"
# What posts a run's end (or late start) to the user's webhooks, from the compute node.
NOTIFIER = _AGENT / "notify.py"
# The store's repairs (a damaged pack set aside) and the job's background gc.
STORE_CHECK = _AGENT / "storecheck.py"
# rv's meter: each node's task runs the program under it (CPU time, peak memory, GPU samples; rv stats).
METER = _AGENT / "stats.py"

# The job's environment file (in $RV_JOB_DIR) that `rv ssh` and `rv up` start their shells from.
JOB_ENV_FILE = remote_layout.JOB_ENV

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ID = re.compile(r"[A-Za-z0-9._-]+")
_UMASK = re.compile(r"0?[0-7]{3}")
# What an #SBATCH value may hold: sbatch splits directive lines on whitespace and reads quotes and
# backslashes itself, and a '%' in a path is an output-file pattern.
_DIRECTIVE_UNSAFE = re.compile(r"[\s\"'\\%]|[\x00-\x1f\x7f]")


@functools.cache
def runtime_files() -> dict[str, str]:
    """The files every job sources or runs, by the name they have under ``<root>/runtime/``.

    Named by a hash of their content, so a file there never changes: a job queued by an older rv
    finds the runtime it was written for, and an upgrade ships new names beside the old ones.
    """
    files = {}
    for path, stem, suffix in (
        (JOB_RUNTIME, "job", ".sh"),
        (RANK_LABELLER, "rank-label", ".py"),
        (NOTIFIER, "notify", ".py"),
        (STORE_CHECK, "store-check", ".py"),
        (METER, "stats", ".py"),
    ):
        text = job_runtime() if path == JOB_RUNTIME else path.read_text(encoding="utf-8")
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        files[f"{stem}-{digest}{suffix}"] = text
    return files


def job_runtime() -> str:
    """The job's runtime as shipped: its parts (:data:`JOB_RUNTIME_PARTS`) joined, in order."""
    return "\n".join(part.read_text(encoding="utf-8") for part in JOB_RUNTIME_PARTS)


def runtime_path(layout: RemoteLayout, stem: str) -> str:
    """Where the runtime file ``stem`` (``job``, ``rank-label``, ``notify``, ``store-check``,
    ``stats``) lives on the cluster."""
    (name,) = (n for n in runtime_files() if n.rsplit("-", 1)[0] == stem)
    return layout.runtime_file(name)


@dataclass(frozen=True)
class ScriptContext:
    """Where the run's things live on the cluster, and what the profile adds to the request."""

    remote_root: str  # absolute, already expanded (no ~ or $HOME: #SBATCH lines are not expanded)
    snapshot_id: str
    project: str  # project key, used in the checkpoint and output paths
    run_id: str
    account: str | None = None
    has_secrets: bool = False  # <run>/secrets.env exists (uploaded with mode 0600 before sbatch)
    checkpoint_dir: str | None = None  # default: <root>/checkpoints/<project>/<name>
    output_dir: str | None = None  # default: <root>/outputs/<project>/<name>
    compute_capability: float | None = None  # fallback when nvidia-smi says nothing; default: the type's
    extra_env: tuple[tuple[str, str], ...] = ()  # exported after rv's own, so they win
    partition: str | None = None  # overrides the type's partition; the only partition of a CPU job
    env_build: tuple[str, ...] = ()  # lines for the environment-build hook (run after setup)
    umask: str = "077"  # what the job creates is the user's alone; "027" shares it with the group
    placement: Placement = field(default_factory=Placement)  # Slurm's options (rv.slurmoptions)
    # A sweep's point: RV_SWEEP_INDEX and RV_SWEEP_<NAME> (rv.sweep.Point.env), its program's values.
    sweep_env: tuple[tuple[str, str], ...] = ()
    # Where the run's end is told (rv.notify: "mail:ADDRESS", "secret:NAME", "desktop"), checked.
    notify: tuple[str, ...] = ()
    # Where the program's work dir is (rv.job.workdir): "shared" (the run's folder) or "node" (each
    # node's local disk, in node_work_dir when the profile names one); checked.
    work_dir: str = "shared"
    node_work_dir: str | None = None
    # The image the program runs in (rv.job.container: resolved on the cluster), or None.
    container: Container | None = None
    # --idle-gpu: seconds every GPU of a node stays under 5% before the run's log (and --notify) says
    # so (rv/agent/stats.py); 0: never.
    idle_gpu_seconds: int = IDLE_GPU_DEFAULT

    @property
    def layout(self) -> RemoteLayout:
        return RemoteLayout(self.remote_root)

    @property
    def run_dir(self) -> str:
        return self.layout.run_dir(self.run_id)


def work_dir_script(layout: RemoteLayout, snapshot_id: str) -> str:
    """Bash that makes ``$RV_WORK_DIR`` from a snapshot exactly as a job does (the runtime's own step)."""
    return "\n".join(
        [
            runtime_files()[posixpath.basename(runtime_path(layout, "job"))],
            f"RV_SNAPSHOT={_q(snapshot_id)} rv_store={_q(layout.store)}",
            f"rv_store_prog={_q(runtime_path(layout, 'store-check'))}",
            "rv_work_dir",
        ]
    )


def _q(value: str) -> str:
    return shlex.quote(value)


def _directive(flag: str, value: str, what: str, error: type[UsageError | ConfigError] = UsageError) -> str:
    if not value or _DIRECTIVE_UNSAFE.search(value):
        raise error(
            f"{what} {value!r} cannot go into an #SBATCH line",
            hint="no spaces, quotes, backslashes or '%' (sbatch reads those itself)",
        )
    return f"#SBATCH --{flag}={value}"


def _check_context(ctx: ScriptContext) -> None:
    if not ctx.remote_root.startswith("/"):
        raise ConfigError(
            f"remote root {ctx.remote_root!r} is not an absolute path",
            hint="use the expanded path, e.g. /scratch/USER/rv: #SBATCH lines expand no ~ or $VARS",
        )
    _directive("output", ctx.remote_root, "remote root", ConfigError)
    for label, value in (
        ("snapshot id", ctx.snapshot_id),
        ("project key", ctx.project),
        ("run id", ctx.run_id),
    ):
        if not _ID.fullmatch(value) or value.startswith((".", "-")):
            raise ValueError(f"{label} {value!r} must match [A-Za-z0-9._-]+ and not start with '.' or '-'")
    if ctx.work_dir not in ("shared", "node"):
        raise ValueError(f"work dir {ctx.work_dir!r} must be shared or node")
    if not _UMASK.fullmatch(ctx.umask):
        raise ValueError(f"umask {ctx.umask!r} must be three octal digits")
    for name, _ in (*ctx.extra_env, *ctx.sweep_env):
        if not _ENV_NAME.fullmatch(name):
            raise UsageError(
                f"environment variable name {name!r} is not valid", hint="use [A-Za-z_][A-Za-z0-9_]*"
            )


def _directives(req: JobRequest, ctx: ScriptContext) -> list[str]:
    place = ctx.placement
    lines = ["#!/bin/bash", _directive("job-name", req.name, "job name")]
    partition = place.partition or ctx.partition or (req.type.partition if req.type else None)
    if partition:
        lines.append(_directive(PARTITION, partition, "partition"))
    if req.type is not None and req.gpus_per_node > 0:
        gres = f"gpu:{req.type.gres}:{req.gpus_per_node}" if req.type.gres else f"gpu:{req.gpus_per_node}"
        lines.append(_directive("gres", gres, "gres"))
    # The type's own feature (how some clusters tell models apart) and the user's, both required.
    features = [f for f in (req.type.constraint if req.type else None, place.constraint) if f]
    if features:
        lines.append(_directive(CONSTRAINT, "&".join(features), CONSTRAINT))
    lines.append(_directive("time", req.time_slurm, "time"))
    if place.time_min_seconds is not None:
        lines.append(_directive("time-min", format_slurm_time(place.time_min_seconds), "time-min"))
    account = place.account or ctx.account
    if account:
        lines.append(_directive(ACCOUNT, account, "account", ConfigError))
    # The rest of Slurm's options as typed, in the table's order (rv.slurmoptions.TABLE).
    lines += [_directive(name, value, name) for name, value in place.table_lines()]
    lines.append(f"#SBATCH --nodes={req.nodes}")
    lines.append("#SBATCH --ntasks-per-node=1")
    if req.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={req.cpus_per_task}")
    if req.mem is not None:
        lines.append(_directive("mem", req.mem, "memory"))
    logs = posixpath.join(ctx.run_dir, remote_layout.LOGS)
    lines.append(f"#SBATCH --output={logs}/%j.out")
    lines.append(f"#SBATCH --error={logs}/%j.err")
    lines.append("#SBATCH --open-mode=append")
    lines.append("#SBATCH --requeue")
    lines += [f"#SBATCH {text}" for text in place.sbatch]  # checked by rv.placement
    return lines


def probe_directives(req: JobRequest, ctx: ScriptContext) -> list[str]:
    """The ``#SBATCH`` lines ``sbatch --test-only`` judges before anything is sent."""
    return _directives(req, ctx)[1:]


# The JSON-lines file a program writes its metrics to ($RV_METRICS), in the run's output folder: it
# outlives the run's records (rv gc), each run name has its own, and later segments append to it.
METRICS_FILE = remote_layout.METRICS_FILE


@dataclass(frozen=True)
class RunPaths:
    """Where a run's program keeps what outlives its jobs: shared by every run of the name."""

    checkpoint_dir: str
    output_dir: str
    metrics: str  # RV_METRICS


def run_paths(req: JobRequest, ctx: ScriptContext) -> RunPaths:
    layout = ctx.layout
    output = ctx.output_dir or layout.output_dir(ctx.project, req.name)
    return RunPaths(
        checkpoint_dir=ctx.checkpoint_dir or layout.checkpoint_dir(ctx.project, req.name),
        output_dir=output,
        metrics=posixpath.join(output, METRICS_FILE),
    )


def _values(req: JobRequest, ctx: ScriptContext) -> list[str]:
    layout = ctx.layout
    paths = run_paths(req, ctx)
    cc = (
        ctx.compute_capability
        if ctx.compute_capability is not None
        else (req.type.compute_capability if req.type is not None else None)
    )
    place = ctx.placement
    gpu_type = _q(req.type.name) if req.type is not None else "''"
    gpu_cc = f"{cc:.1f}" if req.type is not None and cc is not None else "''"
    lines = [
        "# --- this job's values (rv/agent/job.sh lists what each means) ---------------------------",
        f"RV_RUN_DIR={_q(ctx.run_dir)} RV_RUN_ID={_q(ctx.run_id)} RV_RUN_NAME={_q(req.name)}",
        f"RV_PROJECT={_q(ctx.project)} RV_SNAPSHOT={_q(ctx.snapshot_id)} RV_MAX_SEGMENTS={req.max_segments}",
        "# Shared by every run of this name in this project: a run named again resumes from here.",
        f"RV_CHECKPOINT_DIR={_q(paths.checkpoint_dir)}",
        f"RV_OUTPUT_DIR={_q(paths.output_dir)} RV_METRICS={_q(paths.metrics)}",
        f"RV_NODES={req.nodes} RV_GPUS={req.gpus} RV_GPUS_PER_NODE={req.gpus_per_node}",
        f"RV_STOP_SIGNAL={req.signal} RV_STOP_LEAD={req.signal_lead_seconds}",
        f"rv_cache={_q(layout.cache)} rv_store={_q(layout.store)}",
        f"rv_store_prog={_q(runtime_path(layout, 'store-check'))}",
        f"rv_gpu_type={gpu_type} rv_gpu_cc={gpu_cc}",
        f"rv_secrets={int(ctx.has_secrets)} rv_labeled={int(req.labeled)} "
        f"rv_launcher={int(req.labeled and req.launch is not None)}",
        f"rv_outputs=({' '.join(_q(p) for p in req.outputs)})",
        f"rv_exclude={_q(place.exclude or '')} rv_max_fault_retries={place.max_fault_retries}",
        f"rv_stats_prog={_q(runtime_path(layout, 'stats'))} rv_idle_gpu={int(ctx.idle_gpu_seconds)}",
    ]
    if req.labeled:
        lines.append(f"export RV_RANK_LABEL={_q(runtime_path(layout, 'rank-label'))}")
    if ctx.work_dir == "node":
        lines.append("# --work-dir node: the work dir on each node's own disk; the run keeps what changed.")
        lines.append(f"rv_work_node=1 rv_work_base={_q(ctx.node_work_dir or '')}")
    lines += _notify_values(ctx)
    if ctx.container is not None:
        lines += container_values(req, ctx)
    if ctx.sweep_env:
        lines.append("# This point of the sweep: its program reads its values here too.")
        lines.append("export " + " ".join(f"{name}={_q(value)}" for name, value in ctx.sweep_env))
    return lines


def container_folders(req: JobRequest, ctx: ScriptContext) -> list[str]:
    """What a container binds at its own path: the remote root, the run's folders outside it, and
    the node's work dir for --work-dir node."""
    paths = run_paths(req, ctx)
    others = [paths.checkpoint_dir, paths.output_dir]
    if ctx.work_dir == "node" and ctx.container is not None and ctx.container.runtime == "pyxis":
        others.append(ctx.node_work_dir or "/tmp")  # Pyxis mounts at srun's start, once per job
    return container.binds(ctx.remote_root, others)


def container_values(req: JobRequest, ctx: ScriptContext) -> list[str]:
    assert ctx.container is not None
    return [
        f"# The program runs in {container.describe(ctx.container)} (rv run --container).",
        *container.srun_values(ctx.container, folders=container_folders(req, ctx)),
    ]


def _notify_values(ctx: ScriptContext) -> list[str]:
    """Who hears of the run's end (job.sh: rv_notify_end): Slurm's mail to these addresses, and the
    webhooks kept as these secrets (their names only: the URLs reach the job in its secrets file)."""
    mail = [t.split(":", 1)[1] for t in ctx.notify if t.startswith("mail:")]
    hooks = [t.split(":", 1)[1] for t in ctx.notify if t.startswith("secret:")]
    if not mail and not hooks:
        return []
    return [
        "# Told once, by the job that ends the run: Slurm's mail, and webhooks kept as these secrets.",
        f"rv_notify_mail={_q(','.join(mail))} rv_notify_hooks={_q(' '.join(hooks))}",
        f"rv_notify_prog={_q(runtime_path(ctx.layout, 'notify'))}",
    ]


def _user_lines(req: JobRequest, ctx: ScriptContext) -> list[str]:
    lines = []
    if ctx.extra_env:
        lines.append("# The profile's environment: after rv's own, so it wins.")
        lines += [f"export {name}={_q(value)}" for name, value in ctx.extra_env]
    if not req.setup and not ctx.env_build:
        return lines
    lines += [
        "# --- setup (rv run --setup), then rv's env-build hook; without nounset: activate scripts",
        "# and module systems read unset variables.",
        "set +u",
    ]
    for i, line in enumerate(req.setup, start=1):
        lines += ["{", line, f"}} || rv_setup_failed {i}"]
    for i, line in enumerate(ctx.env_build, start=1):
        lines += ["{", line, f"}} || rv_setup_failed env-build-{i}"]
    lines.append("set -u")
    return lines


def _program_body(req: JobRequest, ctx: ScriptContext, program: str) -> list[str]:
    if ctx.container is None:
        return [f"    exec {program}"]
    folders = container_folders(req, ctx)
    return container.program_lines(
        ctx.container, program, folders=folders, gpus=req.gpus > 0, work_bind=ctx.work_dir == "node"
    )


def _enter_lines(req: JobRequest, ctx: ScriptContext) -> list[str]:
    if ctx.container is None:
        return []
    return container.enter_lines(
        ctx.container,
        folders=container_folders(req, ctx),
        gpus=req.gpus > 0,
        work_bind=ctx.work_dir == "node",
    )


def render_script(req: JobRequest, ctx: ScriptContext) -> str:
    """The batch script for ``req`` in ``ctx``: pure, deterministic, ends with a newline."""
    _check_context(ctx)
    runtime = runtime_path(ctx.layout, "job")
    program = program_line(req)
    header = [
        "#",
        f"# Written by rv for run {req.name} ({ctx.run_id}) of project {ctx.project},",
        f"# snapshot {ctx.snapshot_id}.",
        "# What every job does is rv's job runtime, sourced below: rv/agent/job.sh in rv's source.",
        "# No `set -x`: secrets are in this environment. The program's exit code is the job's.",
        "# shellcheck disable=SC2034,SC1090,SC1091  # values the runtime reads; files only the cluster has",
        "set -euo pipefail",
        f"umask {ctx.umask}",
    ]
    sections = [
        _directives(req, ctx) + header,
        _values(req, ctx),
        [
            f"rv_runtime={_q(runtime)}",
            '[ -r "$rv_runtime" ] || { echo "rv: the job runtime $rv_runtime is missing (a purge of the'
            f' filesystem?): rv run --name {req.name} sends it again and resumes" >&2; exit 1; }}',
            '. "$rv_runtime"',
            "rv_begin",
        ],
        _user_lines(req, ctx),
        [
            "rv_start",
            *_enter_lines(req, ctx),
            "# --- the program: each node's task runs it beside rv's stop watcher (job.sh: rv_task)",
            *(
                # accelerate's --mixed_precision is a word-split substitution: it vanishes when
                # accelerate's own config sets the precision (rv.slurm.launch).
                ["# shellcheck disable=SC2046"] if "$(" in program else []
            ),
            "rv_program() {",
            *_program_body(req, ctx, program),
            "}",
            "rv_launch",
        ],
    ]
    return "\n\n".join("\n".join(section) for section in sections if section) + "\n"
