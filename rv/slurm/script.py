"""The sbatch script for a job: one pure function, checked against golden files.

:func:`render_script` turns a validated :class:`~rv.request.JobRequest` and a
:class:`ScriptContext` (where things live on the cluster) into the text handed to ``sbatch``.
Nothing here touches the network, the clock or the environment, so the same input always gives
the same bytes (``tests/golden/*.sh``).

What the script does, in order, and the trap each step avoids:

1. ``#SBATCH`` directives. ``--signal=USR1@N`` without ``B:``: with ``B:`` only the batch shell is
   signalled and srun'd torchrun agents never hear it; without it every *step* is signalled and
   the batch shell is not, which is why the program always runs as an ``srun`` step (below).
   Never ``--time-min``: it lets Slurm shorten the time limit. ``--open-mode=append`` keeps the logs
   of a requeued job.
2. ``set -euo pipefail``, an EXIT trap that removes the secrets file and copies ``-o`` outputs even
   when the program failed, and re-raises the program's exit code. No ``set -x`` anywhere: secrets
   are in the environment.
3. Environment: unbuffered output (or logs arrive minutes late), caches on scratch (home quotas
   fill up), ``RV_*`` paths, and ``MASTER_PORT`` from the job id (two jobs on one node collided).
4. Secrets, sourced from a file uploaded with mode 0600 *before* sbatch; never in this text.
5. Work dir: a hard-link farm of the immutable snapshot, so the job never sees later edits.
6. Setup lines, then the environment-build hook.
7. GPU compute capability at job start (BF16 from 8.0), falling back to the catalog.
8. The program: one ``srun`` task per node; torchrun gets its multi-node flags injected, with
   per-task values (``$SLURM_NODEID``) expanded inside each task, not in the batch shell.

The user's command is quoted twice, on purpose: once into the words of the inner ``bash -c``
command line, and that line once more as one word of the batch script. The property test in
``tests/unit/test_script.py`` runs the result with bash and checks argv byte for byte.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

from rv.errors import ConfigError, UsageError
from rv.layout import RemoteLayout
from rv.request import JobRequest, TorchrunArgs

# Signals torchrun should forward to its workers: its defaults plus the two Slurm uses for warnings.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
# MASTER_PORT = BASE + job id % SPAN: ports 15000-29999, below Linux's ephemeral range (32768+) so
# a port picked for us is never one the kernel handed to some client socket.
MASTER_PORT_BASE = 15000
MASTER_PORT_SPAN = 15000

# Cache variables and their folder under <root>/cache (see rv.layout).
CACHE_DIRS: tuple[tuple[str, str], ...] = (
    ("HF_HOME", "hf"),
    ("TORCH_HOME", "torch"),
    ("TRITON_CACHE_DIR", "triton"),
    ("PIP_CACHE_DIR", "pip"),
    ("WANDB_DIR", "wandb"),
    ("WANDB_CACHE_DIR", "wandb/cache"),
    ("WANDB_DATA_DIR", "wandb/data"),
    ("XDG_CACHE_HOME", "xdg"),
    ("CUDA_CACHE_PATH", "xdg/nv"),  # CUDA's JIT cache defaults to ~/.nv
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ID = re.compile(r"[A-Za-z0-9._-]+")
# What an #SBATCH value may hold: sbatch splits directive lines on whitespace and reads quotes and
# backslashes itself, and a '%' in a path is an output-file pattern.
_DIRECTIVE_UNSAFE = re.compile(r"[\s\"'\\%]|[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class ScriptContext:
    """Where the job's things live on the cluster, and what the profile adds to the request."""

    remote_root: str  # absolute, already expanded (no ~ or $HOME: #SBATCH lines are not expanded)
    snapshot_id: str
    project: str  # project key, used in the checkpoint path
    account: str | None = None
    secrets_file: str | None = None  # uploaded with mode 0600 before sbatch; deleted when the job ends
    checkpoint_dir: str | None = None  # default: <root>/checkpoints/<project>/<name>
    compute_capability: float | None = None  # fallback when nvidia-smi says nothing; default: the type's
    extra_env: tuple[tuple[str, str], ...] = ()  # exported after rv's own, so they win
    partition: str | None = None  # overrides the type's partition; the only partition of a CPU job
    env_build: tuple[str, ...] = ()  # lines for the environment-build hook (run after setup)

    @property
    def layout(self) -> RemoteLayout:
        return RemoteLayout(self.remote_root)


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
    for label, value in (("snapshot id", ctx.snapshot_id), ("project key", ctx.project)):
        if not _ID.fullmatch(value) or value.startswith((".", "-")):
            raise ValueError(f"{label} {value!r} must match [A-Za-z0-9._-]+ and not start with '.' or '-'")
    for name, _ in ctx.extra_env:
        if not _ENV_NAME.fullmatch(name):
            raise UsageError(
                f"environment variable name {name!r} is not valid", hint="use [A-Za-z_][A-Za-z0-9_]*"
            )


def _directives(req: JobRequest, ctx: ScriptContext) -> list[str]:
    layout = ctx.layout
    lines = ["#!/bin/bash", _directive("job-name", req.name, "job name")]
    partition = ctx.partition or (req.type.partition if req.type else None)
    if partition:
        lines.append(_directive("partition", partition, "partition"))
    if req.type is not None and req.gpus_per_node > 0:
        gres = f"gpu:{req.type.gres}:{req.gpus_per_node}" if req.type.gres else f"gpu:{req.gpus_per_node}"
        lines.append(_directive("gres", gres, "gres"))
        if req.type.constraint:
            lines.append(_directive("constraint", req.type.constraint, "constraint"))
    lines.append(_directive("time", req.time_slurm, "time"))
    if ctx.account:
        lines.append(_directive("account", ctx.account, "account", ConfigError))
    lines.append(f"#SBATCH --nodes={req.nodes}")
    lines.append("#SBATCH --ntasks-per-node=1")
    if req.cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={req.cpus_per_task}")
    if req.mem is not None:
        lines.append(_directive("mem", req.mem, "memory"))
    lines.append(f"#SBATCH --output={posixpath.join(layout.logs, req.name + '-%j.out')}")
    lines.append(f"#SBATCH --error={posixpath.join(layout.logs, req.name + '-%j.err')}")
    lines.append("#SBATCH --open-mode=append")
    lines.append(f"#SBATCH --signal={req.signal}@{req.signal_lead_seconds}")
    return lines


def _environment(req: JobRequest, ctx: ScriptContext) -> list[str]:
    layout = ctx.layout
    checkpoint = ctx.checkpoint_dir or layout.checkpoint_dir(ctx.project, req.name)
    lines = [
        "# --- environment -----------------------------------------------------------------",
        "# Unbuffered, or logs arrive minutes late.",
        "export PYTHONUNBUFFERED=1 SLURM_UNBUFFEREDIO=1",
        "# Caches on scratch: the home quota fills up. A value already set by the user wins.",
    ]
    for var, sub in CACHE_DIRS:
        lines.append(f'export {var}="${{{var}:-{_q(posixpath.join(layout.cache, sub))}}}"')
    lines += [
        f'export RV_JOB_DIR={_q(layout.jobs)}/"$SLURM_JOB_ID"',
        'export RV_WORK_DIR="$RV_JOB_DIR/work"',
        'export RV_OUTPUT_DIR="$RV_JOB_DIR/output"',
        "# Stable across resubmits of the same named run of this project: resume from here.",
        f"export RV_CHECKPOINT_DIR={_q(checkpoint)}",
        f"export RV_SNAPSHOT={_q(ctx.snapshot_id)} RV_PROJECT={_q(ctx.project)} RV_RUN_NAME={_q(req.name)}",
        f"export RV_NODES={req.nodes} RV_GPUS={req.gpus} RV_GPUS_PER_NODE={req.gpus_per_node}",
        "# One port per job (from its id), so two jobs sharing a node never collide.",
        f"export MASTER_PORT=$(({MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_SPAN}))",
        "# srun does not inherit sbatch's --cpus-per-task (Slurm 22.05+): without this every task",
        "# would be pinned to one CPU.",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
    ]
    for name, value in ctx.extra_env:
        lines.append(f"export {name}={_q(value)}")
    return lines


def _exit_trap(req: JobRequest, ctx: ScriptContext) -> list[str]:
    lines = [
        "# --- end of job ------------------------------------------------------------------",
        "# Runs however the script ends (program failed, time limit, scancel): remove the secrets,",
        "# keep the outputs, and leave with the program's exit code.",
        "rv_on_exit() {",
        "    local rc=$?",
        "    set +e",
    ]
    if ctx.secrets_file:
        lines.append(f"    rm -f -- {_q(ctx.secrets_file)}")
    for path in req.outputs:
        lines.append(f"    rv_keep_output {_q(path)}")
    lines += [
        '    echo "rv: job ${SLURM_JOB_ID} ended with exit code $rc"',
        '    exit "$rc"',
        "}",
    ]
    if req.outputs:
        lines += [
            "# Copy one -o path from the work dir into $RV_OUTPUT_DIR; a missing one is a warning only.",
            "rv_keep_output() {",
            '    local src="$RV_WORK_DIR/$1" dst="$RV_OUTPUT_DIR/$1"',
            '    if [ ! -e "$src" ] && [ ! -L "$src" ]; then',
            '        echo "rv: warning: output $1 not found in the work dir; nothing copied"',
            "        return 0",
            "    fi",
            '    mkdir -p -- "$(dirname -- "$dst")" && rm -rf -- "$dst" && cp -a -- "$src" "$dst" \\',
            '        || echo "rv: warning: could not copy output $1"',
            "}",
        ]
    lines += [
        "trap rv_on_exit EXIT",
        "# Time limit and scancel send TERM: leave through the EXIT trap with the usual 128+N code.",
        "trap 'exit 143' TERM",
        "trap 'exit 130' INT",
        "trap 'exit 129' HUP",
    ]
    return lines


def _secrets(ctx: ScriptContext) -> list[str]:
    if not ctx.secrets_file:
        return []
    f = _q(ctx.secrets_file)
    return [
        "# --- secrets ---------------------------------------------------------------------",
        "# Uploaded with mode 0600 before sbatch, never written into this script; removed at exit.",
        f"if [ -r {f} ]; then",
        f"    set -a; . {f}; set +a",
        'elif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        "    # A requeued run: the previous attempt's exit removed the file.",
        '    echo "rv: warning: secrets file is gone (removed when the previous attempt ended); '
        'running without secrets"',
        "else",
        f"    echo rv: secrets file {_q(ctx.secrets_file)} is missing >&2",
        "    exit 1",
        "fi",
    ]


def _work_dir(ctx: ScriptContext) -> list[str]:
    snap = _q(ctx.layout.snapshot(ctx.snapshot_id))
    return [
        "# --- work dir ----------------------------------------------------------------------",
        "# A hard-link farm of the immutable snapshot: files stay read-only links into the store,",
        "# new files land in this job's own folder. cp -a when the store is on another filesystem.",
        "# A requeued job keeps the work dir it already has.",
        'mkdir -p -- "$RV_OUTPUT_DIR"',
        'if [ ! -d "$RV_WORK_DIR" ]; then',
        f"    if [ ! -d {snap} ]; then echo rv: snapshot {snap} not found >&2; exit 1; fi",
        '    rm -rf -- "$RV_WORK_DIR.tmp"',
        f'    cp -al -- {snap} "$RV_WORK_DIR.tmp" 2>/dev/null \\',
        f'        || {{ rm -rf -- "$RV_WORK_DIR.tmp"; cp -a -- {snap} "$RV_WORK_DIR.tmp"; }}',
        "    # Directories only: a chmod on a hard-linked file would change the store's copy too.",
        '    find "$RV_WORK_DIR.tmp" -type d -exec chmod u+w {} +',
        '    mv -- "$RV_WORK_DIR.tmp" "$RV_WORK_DIR"',
        "fi",
        'cd "$RV_WORK_DIR"',
    ]


def _setup(req: JobRequest, ctx: ScriptContext) -> list[str]:
    lines = [
        "# --- setup (rv run --setup), before anything else of the user's ----------------------",
        "# Without nounset: activate scripts and module systems read unset variables.",
        "rv_setup_failed() {",
        "    local rc=$?",
        '    echo "rv: setup line $1 failed with exit code $rc" >&2',
        '    exit "$rc"',
        "}",
        "set +u",
    ]
    for i, line in enumerate(req.setup, start=1):
        lines += ["{", line, f"}} || rv_setup_failed {i}"]
    lines += [
        "# --- env build hook ----------------------------------------------------------------",
        "# rv builds the project's environment here (after setup, so setup's modules are loaded).",
    ]
    for i, line in enumerate(ctx.env_build, start=1):
        lines += ["{", line, f"}} || rv_setup_failed env-build-{i}"]
    lines.append("set -u")
    return lines


def _gpu(req: JobRequest, ctx: ScriptContext) -> list[str]:
    if req.type is None:
        return [
            "# --- precision ---------------------------------------------------------------------",
            '# A CPU-only job: no mixed precision ("no" is accelerate\'s word for it); no RV_GPU_* set.',
            "export RV_PRECISION=no ACCELERATE_MIXED_PRECISION=no",
        ]
    cc = ctx.compute_capability if ctx.compute_capability is not None else req.type.compute_capability
    fallback = f"{cc:.1f}" if cc is not None else ""
    fallback_word = fallback or '""'
    bf16_test = (
        '[ "${RV_GPU_CC%%.*}" -ge 8 ]'
        if cc is not None
        else '[ -n "$RV_GPU_CC" ] && [ "${RV_GPU_CC%%.*}" -ge 8 ]'
    )
    return [
        "# --- GPU and precision -------------------------------------------------------------",
        "# BF16 needs compute capability 8.0 or newer. Ask the GPU; when nvidia-smi is missing or",
        "# prints nothing usable, fall back to the catalog's value for "
        f"{req.type.name} ({fallback or 'unknown'}).",
        'RV_GPU_CC="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \\',
        '    | sed -n 1p | tr -d \'[:space:]\')" || RV_GPU_CC=""',
        'case "$RV_GPU_CC" in',
        "    [0-9].[0-9] | [0-9][0-9].[0-9]) ;;",
        f"    *) RV_GPU_CC={fallback_word} ;;",
        "esac",
        f"if {bf16_test}; then RV_PRECISION=bf16; else RV_PRECISION=fp16; fi",
        f"export RV_GPU_TYPE={_q(req.type.name)} RV_GPU_CC RV_PRECISION",
        'export ACCELERATE_MIXED_PRECISION="$RV_PRECISION"',
    ]


def _head_node() -> list[str]:
    return [
        "# --- first node --------------------------------------------------------------------",
        "# The first node hosts the rendezvous. Node names need not resolve as host names, so use its",
        "# NodeAddr as Slurm knows it (on most clusters that is the host name).",
        'RV_HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)" || RV_HEAD_NODE=""',
        'RV_HEAD_NODE="${RV_HEAD_NODE:-$(hostname)}"',
        'RV_HEAD_ADDR="$(scontrol show node "$RV_HEAD_NODE" 2>/dev/null \\',
        '    | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' | sed -n 1p)" || RV_HEAD_ADDR=""',
        'export RV_HEAD_NODE RV_HEAD_ADDR="${RV_HEAD_ADDR:-$RV_HEAD_NODE}"',
        'export MASTER_ADDR="$RV_HEAD_ADDR"',
    ]


def _summary(req: JobRequest) -> list[str]:
    if req.type is None:
        what = f"{req.nodes} node(s), CPU only"
        return [f'echo "rv: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: {what}, snapshot $RV_SNAPSHOT"']
    what = f"{req.nodes} node(s) x {req.gpus_per_node} {req.type.name}"
    return [
        f'echo "rv: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: {what}, '
        'cc=${RV_GPU_CC:-unknown} precision=$RV_PRECISION, snapshot $RV_SNAPSHOT"'
    ]


def torchrun_injected_flags(req: JobRequest, tr: TorchrunArgs) -> list[str]:
    """The flags rv adds after the torchrun launcher, as shell words for the inner ``bash -c``.

    Only flags the user did not give. ``$SLURM_NODEID`` and friends are left for the task's own
    shell to expand. On one node, a user's own rendezvous (``--standalone``, ``--master-port``,
    ...) is respected; on several, ``build_request`` already refused one.
    """
    own_rendezvous = req.nodes == 1 and any(
        tr.has(n) for n in ("standalone", "rdzv-endpoint", "rdzv-backend", "master-addr", "master-port")
    )
    flags = []
    if not tr.has("nnodes"):
        flags.append(f"--nnodes={req.nodes}")
    if not own_rendezvous and not tr.has("node-rank"):
        flags.append('--node-rank="$SLURM_NODEID"')
    if req.gpus_per_node > 0 and not tr.has("nproc-per-node"):
        flags.append(f"--nproc-per-node={req.gpus_per_node}")
    if not own_rendezvous:
        if not tr.has("rdzv-backend"):
            flags.append("--rdzv-backend=c10d")
        if not tr.has("rdzv-endpoint"):
            flags.append('--rdzv-endpoint="$RV_HEAD_ADDR:$MASTER_PORT"')
        if not tr.has("rdzv-id"):
            flags.append('--rdzv-id="$SLURM_JOB_ID"')
    if not tr.has("signals-to-handle"):
        # Set (or left empty) by the probe in the batch shell: older torchrun rejects the flag.
        flags.append('${RV_TORCHRUN_SIGNALS:+"$RV_TORCHRUN_SIGNALS"}')
    return flags


def program_line(req: JobRequest) -> str:
    """The user's command as one shell line, torchrun flags injected after the launcher."""
    tr = req.torchrun
    if tr is None:
        return shlex.join(req.command)
    words = [shlex.join(tr.launcher), *torchrun_injected_flags(req, tr)]
    if tr.options or tr.program:
        words.append(shlex.join(tr.options + tr.program))
    return " ".join(words)


# Each task's shell traps (never ignores) these, so it outlives Slurm's signals, which reach every
# process of the step; a trapped signal goes back to its default in the program, an ignored one
# would stay ignored.
_TASK_TRAPPED_SIGNALS = "USR1 USR2 TERM INT HUP QUIT"


def inner_command(req: JobRequest) -> str:
    """The shell line each srun task runs.

    One node: ``exec`` the program, so it is the task and its exit code is srun's. Several nodes:
    srun reports the highest code of all tasks, so when one node fails and ``--kill-on-bad-exit``
    stops the others (143), the failure would be hidden; each task therefore records its own
    exit code in ``$RV_JOB_DIR/node<N>.exit`` for the batch shell to report.
    """
    line = program_line(req)
    if req.nodes == 1:
        return "exec " + line
    return (
        f"trap : {_TASK_TRAPPED_SIGNALS}; {line}; rv_rc=$?; "
        'printf "%s\\n" "$rv_rc" > "$RV_JOB_DIR/node$SLURM_NODEID.exit"; exit "$rv_rc"'
    )


def _torchrun_probe(req: JobRequest) -> list[str]:
    tr = req.torchrun
    if tr is None or tr.has("signals-to-handle"):
        return []
    return [
        "# --- torchrun signal forwarding ------------------------------------------------------",
        f"# torchrun forwards {req.signal} to its workers only when told to (--signals-to-handle,",
        "# torch 2.9+); an older torchrun refuses the option, so ask this one whether it knows it.",
        'RV_TORCHRUN_SIGNALS=""',
        f'rv_help="$({shlex.join(tr.launcher)} --help 2>&1)" || true',
        'case "$rv_help" in',
        f"    *--signals-to-handle*) RV_TORCHRUN_SIGNALS=--signals-to-handle={TORCHRUN_SIGNALS} ;;",
        "esac",
        "export RV_TORCHRUN_SIGNALS",
    ]


def _launch(req: JobRequest, ctx: ScriptContext) -> list[str]:
    layout = ctx.layout
    srun = [
        f"srun --nodes={req.nodes} --ntasks={req.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
    ]
    if req.nodes > 1:
        out = _q(posixpath.join(layout.logs, f"{req.name}-%j-node%n.out"))
        err = _q(posixpath.join(layout.logs, f"{req.name}-%j-node%n.err"))
        srun.append(f"    --open-mode=append --output={out} --error={err} \\")
    lines = [
        "# --- the program -------------------------------------------------------------------",
        "# Always an srun step, one task per node: --signal reaches job steps, not the batch shell.",
        "# --kill-on-bad-exit: one dead node must not leave the others waiting at a collective.",
    ]
    if req.nodes > 1:
        lines += [
            "# One log per node; the batch log keeps rv's own lines.",
            'rm -f -- "$RV_JOB_DIR"/node*.exit',
        ]
    lines += [
        "rv_rc=0",
        *srun,
        f"    bash -c {_q(inner_command(req))} \\",
        "    || rv_rc=$?",
    ]
    if req.nodes > 1:
        lines += [
            "# srun exits with the highest code of all tasks, so the nodes --kill-on-bad-exit stopped",
            "# (143) would hide the one that failed: report the lowest code below 128 a node recorded.",
            'if [ "$rv_rc" -ne 0 ]; then',
            '    rv_first=""',
            '    for rv_f in "$RV_JOB_DIR"/node*.exit; do',
            '        rv_n="$(cat -- "$rv_f" 2>/dev/null)" || continue',
            '        case "$rv_n" in "" | *[!0-9]*) continue ;; esac',
            '        if [ "$rv_n" -gt 0 ] && [ "$rv_n" -lt "${rv_first:-128}" ]; then rv_first="$rv_n"; fi',
            "    done",
            '    rv_rc="${rv_first:-$rv_rc}"',
            "fi",
        ]
    lines.append('exit "$rv_rc"')
    return lines


def render_script(req: JobRequest, ctx: ScriptContext) -> str:
    """The batch script for ``req`` in ``ctx``: pure, deterministic, ends with a newline."""
    _check_context(ctx)
    header = [
        "#",
        f"# Written by rv for project {ctx.project}, snapshot {ctx.snapshot_id}.",
        "# No `set -x` here: secrets are in this environment. The program's exit code is the job's.",
        "",
        "set -euo pipefail",
    ]
    sections = [
        _directives(req, ctx) + header,
        _environment(req, ctx),
        _exit_trap(req, ctx),
        _secrets(ctx),
        _work_dir(ctx),
        _setup(req, ctx),
        _gpu(req, ctx),
        _head_node(),
        _summary(req),
        _torchrun_probe(req),
        _launch(req, ctx),
    ]
    return "\n\n".join("\n".join(section) for section in sections if section) + "\n"
