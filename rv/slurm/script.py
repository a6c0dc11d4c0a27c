"""The sbatch script of a run: one pure function, checked against golden files.

:func:`render_script` turns a validated :class:`~rv.request.JobRequest` and a :class:`ScriptContext`
(where the run's things live on the cluster) into the text handed to ``sbatch``. Nothing here touches
the network, the clock or the environment, so the same input always gives the same bytes
(``tests/golden/*.sh``).

A run is a chain of segments, each one Slurm job running this same script. The job itself keeps the
run's records and decides whether the run goes on, so closing the laptop never stops a chain:

1. ``#SBATCH`` directives. No ``--signal``: Slurm's warning signal reaches every process of a step,
   and Python's default for ``SIGUSR1`` is to die, so a plain program was killed five minutes early.
   rv's own watcher sends the stop signal instead (7). ``--requeue``: after a node failure or a
   preemption Slurm runs the same job again, and the script finds its work dir and secrets.
   Never ``--time-min``: it lets Slurm shorten the time limit.
2. ``set -euo pipefail``, the umask (private by default), the run and segment: ``RV_SEGMENT`` comes
   from whoever submitted this job (``rv run`` for 1, the previous segment for the next). The
   environment the first segment was submitted with is saved, so later segments get the same one.
3. Environment: unbuffered output, caches on scratch, ``RV_*`` paths, ``MASTER_PORT`` from the job id.
4. The end of a segment (EXIT trap): from the program's exit code, the ``PREEMPTED`` marker, whether
   rv sent the stop signal, ``rv stop``'s ``STOP`` file and what ``scontrol`` says (time limit,
   requeue, preemption), it writes why the segment ended, submits the next segment when the program
   stopped cleanly with progress, and otherwise ends the run: ``ENDED`` and no more secrets.
5. Secrets, sourced from the run's 0600 file (never in this text); kept until the run ends.
6. The work dir: the run's own copy of the snapshot (copies, not hard links into the store: a job
   that makes its files writable must not change the store or another run). Made once per run.
7. Setup lines, the env-build hook, GPU and precision, the first node; then the environment the
   program gets, saved as ``$RV_JOB_DIR/env.sh`` for the shells of ``rv ssh`` and ``rv up``.
8. With more than one process, rv's rank labeller (``rv/agent/ranklabel.py``) written into the job's
   folder: each rank runs under it (torchrun's ``PYTHON_EXEC``) and its lines reach the log whole,
   labelled ``[rank]``.
9. The program, one ``srun`` task per node running ``rv_task``: the program in the background and
   rv's stop watcher beside it, which sends ``RV_STOP_SIGNAL`` at ``RV_STOP_LEAD`` seconds before the
   time limit to the program's processes that handle it (never to a torchrun agent), and to none
   when none does. A launcher (torchrun, accelerate launch, either behind ``uv run``) gets the node
   and rendezvous flags it lacks.

The user's command enters once, quoted, inside ``rv_task``; the property test in
``tests/unit/test_script.py`` runs the result with bash and checks argv byte for byte.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from rv.contract import BF16_MIN_MAJOR, PREEMPTED
from rv.errors import ConfigError, UsageError
from rv.layout import RemoteLayout
from rv.request import JobRequest
from rv.slurm import commands
from rv.slurm.launch import RANK_LABEL, program_line

# rv's rank labeller, shipped inside the script of every job with more than one process.
_LABELLER = Path(__file__).resolve().parent.parent / "agent" / "ranklabel.py"
_HEREDOC_END = "RV_RANK_LABEL_END"

# More links under a layer than this: a loop or a damaged store (rv.agent.store.CHAIN_BROKEN, which a
# test holds equal to this; the laptop does not import the agent).
CHAIN_BROKEN = 32

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

# Variables Slurm sets per job: the saved submit environment leaves them out, or the next segment
# would inherit this one's (srun refuses SLURM_MEM_PER_CPU and SLURM_MEM_PER_NODE together).
_PER_JOB_VARIABLES = (
    "SLURM_*",
    "SLURMD_*",
    "CUDA_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ROCR_VISIBLE_DEVICES",
    "ENVIRONMENT",
    "RV_SEGMENT",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
)

# The job's environment file (in $RV_JOB_DIR) that `rv ssh` and `rv up` start their shells from.
JOB_ENV_FILE = "env.sh"
# Exported variables the job's environment file leaves out: Slurm sets them per job and per step (an
# attached shell is a step of its own and gets its own), and the terminal, display and SSH connection
# are the attaching user's (PS1 too: a venv's activate may export its prompt). HOSTNAME: the first
# node's, wrong on any other.
_NOT_IN_JOB_ENV = (
    "SLURM_*",
    "SLURMD_*",
    "PMI_*",
    "PMIX_*",
    "CUDA_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ROCR_VISIBLE_DEVICES",
    "ENVIRONMENT",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "TERM",
    "SSH_*",
    "DISPLAY",
    "HOSTNAME",
    "PS1",
    "BASH_FUNC_*",
)

# Processes that forward signals to workers rather than act on them: the stop signal goes straight to
# the workers, so the launcher sees them exit 0 and exits 0 itself (torchrun's agent dies on USR1
# and prints a traceback on TERM).
_LAUNCHER_PATTERNS = (
    "*/torchrun\\ *",
    "torchrun\\ *",
    "*torch.distributed.run*",
    "*/accelerate\\ launch*",
    "accelerate\\ launch*",
    "*accelerate.commands.launch*",
    "*/uv\\ run\\ *",
    "uv\\ run\\ *",
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ID = re.compile(r"[A-Za-z0-9._-]+")
_UMASK = re.compile(r"0?[0-7]{3}")
# What an #SBATCH value may hold: sbatch splits directive lines on whitespace and reads quotes and
# backslashes itself, and a '%' in a path is an output-file pattern.
_DIRECTIVE_UNSAFE = re.compile(r"[\s\"'\\%]|[\x00-\x1f\x7f]")


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

    @property
    def layout(self) -> RemoteLayout:
        return RemoteLayout(self.remote_root)

    @property
    def run_dir(self) -> str:
        return self.layout.run_dir(self.run_id)


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
    if not _UMASK.fullmatch(ctx.umask):
        raise ValueError(f"umask {ctx.umask!r} must be three octal digits")
    for name, _ in ctx.extra_env:
        if not _ENV_NAME.fullmatch(name):
            raise UsageError(
                f"environment variable name {name!r} is not valid", hint="use [A-Za-z_][A-Za-z0-9_]*"
            )


def _directives(req: JobRequest, ctx: ScriptContext) -> list[str]:
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
    logs = posixpath.join(ctx.run_dir, "logs")
    lines.append(f"#SBATCH --output={logs}/%j.out")
    lines.append(f"#SBATCH --error={logs}/%j.err")
    lines.append("#SBATCH --open-mode=append")
    lines.append("#SBATCH --requeue")
    return lines


def _run(req: JobRequest, ctx: ScriptContext) -> list[str]:
    skip = " | ".join(_PER_JOB_VARIABLES)
    return [
        "# --- run and segment ---------------------------------------------------------------",
        f"export RV_RUN_DIR={_q(ctx.run_dir)} RV_RUN_ID={_q(ctx.run_id)} RV_RUN_NAME={_q(req.name)}",
        f'export RV_SEGMENT="${{RV_SEGMENT:-1}}" RV_MAX_SEGMENTS={req.max_segments}',
        'export RV_JOB_DIR="$RV_RUN_DIR/jobs/$SLURM_JOB_ID"',
        'rv_attempt="${SLURM_RESTART_COUNT:-0}"',
        "rv_started=$(date +%s)",
        'mkdir -p -- "$RV_JOB_DIR" "$RV_RUN_DIR/seg"',
        'printf \'%s\\n\' "$SLURM_JOB_ID" >"$RV_RUN_DIR/seg/$RV_SEGMENT.job"',
        "# The environment the run was submitted with, saved once before rv adds to it (no secrets",
        "# yet), less Slurm's per-job variables: later segments are submitted with exactly this.",
        'if [ ! -e "$RV_RUN_DIR/submit.env" ]; then',
        "    {",
        "        for rv_v in $(compgen -e); do",
        '            case "$rv_v" in SLURM_CONF) ;; ' + skip + ") continue ;; esac",
        '            declare -p "$rv_v"',
        "        done",
        "        declare -fx",
        '    } >"$RV_RUN_DIR/submit.env.tmp"',
        '    mv -f -- "$RV_RUN_DIR/submit.env.tmp" "$RV_RUN_DIR/submit.env"',
        "fi",
    ]


def _environment(req: JobRequest, ctx: ScriptContext) -> list[str]:
    layout = ctx.layout
    checkpoint = ctx.checkpoint_dir or layout.checkpoint_dir(ctx.project, req.name)
    output = ctx.output_dir or layout.output_dir(ctx.project, req.name)
    lines = [
        "# --- environment -----------------------------------------------------------------",
        "# Unbuffered, or logs arrive minutes late.",
        "export PYTHONUNBUFFERED=1 SLURM_UNBUFFEREDIO=1",
        "# Caches on scratch: the home quota fills up. A value already set by the user wins.",
    ]
    for var, sub in CACHE_DIRS:
        lines.append(f'export {var}="${{{var}:-{_q(posixpath.join(layout.cache, sub))}}}"')
    lines += [
        'export RV_WORK_DIR="$RV_RUN_DIR/work"',
        "# Shared by every run of this name in this project: a run named again resumes from here.",
        f"export RV_CHECKPOINT_DIR={_q(checkpoint)} RV_OUTPUT_DIR={_q(output)}",
        f"export RV_SNAPSHOT={_q(ctx.snapshot_id)} RV_PROJECT={_q(ctx.project)}",
        f"export RV_NODES={req.nodes} RV_GPUS={req.gpus} RV_GPUS_PER_NODE={req.gpus_per_node}",
        f"export RV_STOP_SIGNAL={req.signal} RV_STOP_LEAD={req.signal_lead_seconds}",
        "# One port per job (from its id), so two jobs sharing a node never collide.",
        f"export MASTER_PORT=$(({MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_SPAN}))",
        "# srun does not inherit sbatch's --cpus-per-task (Slurm 22.05+): without this every task",
        "# would be pinned to one CPU.",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
        'mkdir -p -- "$RV_CHECKPOINT_DIR" "$RV_OUTPUT_DIR"',
    ]
    for name, value in ctx.extra_env:
        lines.append(f"export {name}={_q(value)}")
    return lines


def _records() -> list[str]:
    return [
        "# --- records -----------------------------------------------------------------------",
        "# seg/<k>.json: this segment's record, written at its start and rewritten at its end (write,",
        "# then rename). `rv ps -a` and `rv logs` read it where there is no sacct to ask.",
        'rv_jstr() { local v=${1//[\\"\\\\]/}; v=${v//[$\'\\t\\r\\n\']/ }; printf \'"%s"\' "$v"; }',
        'rv_jnum() { case "$1" in \'\' | *[!0-9]*) printf null ;; *) printf %s "$1" ;; esac; }',
        'rv_jopt() { if [ -n "$1" ]; then rv_jstr "$1"; else printf null; fi; }',
        "rv_record() {  # rv_record STATE REASON EXIT_CODE CHECKPOINT_STEP NEXT_JOB_ID",
        '    local f="$RV_RUN_DIR/seg/$RV_SEGMENT.json"',
        "    {",
        '        printf \'{"segment": %s, "job_id": %s, "attempt": %s, "nodes": %s, \' \\',
        '            "$RV_SEGMENT" "$(rv_jstr "$SLURM_JOB_ID")" "$rv_attempt" '
        '"$(rv_jstr "${SLURM_JOB_NODELIST:-}")"',
        '        printf \'"start": %s, "end": %s, "state": %s, "reason": %s, "exit_code": %s, \' \\',
        '            "$rv_started" "$(rv_jnum "${rv_ended:-}")" "$(rv_jstr "$1")" "$(rv_jstr "$2")" '
        '"$(rv_jnum "$3")"',
        '        printf \'"start_step": %s, "checkpoint_step": %s, "stop_sent": %s, '
        '"next_job_id": %s}\\n\' \\',
        '            "$(rv_jnum "${rv_start_step:-}")" "$(rv_jnum "$4")" "${rv_stop_sent:-false}" '
        '"$(rv_jopt "$5")"',
        '    } >"$f.tmp" && mv -f -- "$f.tmp" "$f"',
        "}",
        "# The newest complete checkpoint in rv_train's layout (step_<N>/COMPLETE), if that is the layout.",
        "rv_ckpt_step() {",
        "    local d n best=''",
        '    for d in "$RV_CHECKPOINT_DIR"/step_*/COMPLETE; do',
        '        [ -e "$d" ] || continue',
        '        n="${d%/COMPLETE}"; n="${n##*/step_}"; n="${n#"${n%%[!0]*}"}"; n="${n:-0}"',
        '        case "$n" in *[!0-9]*) continue ;; esac',
        '        if [ -z "$best" ] || [ "$n" -gt "$best" ]; then best="$n"; fi',
        "    done",
        '    printf %s "$best"',
        "}",
        "# What a checkpoint folder holds, as one line: tells progress when a marker names no step.",
        "rv_ckpt_print() {",
        f'    find "$RV_CHECKPOINT_DIR" -path "$RV_CHECKPOINT_DIR/{PREEMPTED}" -prune '
        "-o -printf '%P %s %T@\\n' \\",
        "        2>/dev/null | sort | cksum",
        "}",
    ]


def _end_of_segment(req: JobRequest, ctx: ScriptContext) -> list[str]:
    sbatch_next = commands.shell(commands.sbatch(commands.raw('"$4"'), after=commands.raw('"$3"')))
    show_job = commands.shell(commands.scontrol_show_job(commands.raw('"$SLURM_JOB_ID"')))
    lines = [
        "# --- end of a segment --------------------------------------------------------------",
        "# Runs however the script ends: the program finished, crashed or stopped, the time limit,",
        "# scancel, rv stop, a requeue. Why this segment ended, whether the run goes on (in a new job:",
        "# a requeue would wait about two minutes to start again), and the run's end.",
        "rv_program_ran=0 rv_got_term=0 rv_failed_at='' rv_exit_code=0 rv_stop_sent=false",
        "rv_on_exit() {",
        "    local rc=$?",
        "    trap '' TERM INT HUP  # Slurm keeps signalling: finish the records first",
        "    set +eu",
        f'    rm -f -- "$RV_JOB_DIR/{JOB_ENV_FILE}"  # it holds the secrets: gone with the job',
        '    rv_end_segment "$rc"',
        '    exit "$rv_exit_code"',
        "}",
        "# The next segment: same script, same run, submitted with the environment segment 1 had.",
        "rv_submit_next() {",
        "    local out",
        '    out="$(env -i "$BASH" -c \'set -a; . "$1" || exit 1; set +a; export RV_SEGMENT="$2"; \'\\',
        f"'exec {sbatch_next}' \\",
        '        rv "$RV_RUN_DIR/submit.env" "$((RV_SEGMENT + 1))" "$SLURM_JOB_ID" '
        '"$RV_RUN_DIR/job.sbatch" 2>&1)" || {',
        "        printf '%s' \"$out\" | tail -n 2 | tr '\\n' ' '",
        "        return 1",
        "    }",
        '    out="${out##*$\'\\n\'}"; out="${out%%;*}"',
        '    printf \'%s\\n\' "$out" >"$RV_RUN_DIR/seg/$((RV_SEGMENT + 1)).job"',
        "    # rv stop writes STOP before it cancels what it finds: look again now that this job exists.",
        '    if [ -e "$RV_RUN_DIR/STOP" ]; then',
        f"        {commands.shell(commands.scancel([commands.raw(chr(34) + '$out' + chr(34))]))} 2>/dev/null",
        "        printf 'cancelled by rv stop'",
        "        return 1",
        "    fi",
        "    printf '%s' \"$out\"",
        "}",
        "rv_end_segment() {",
        '    local rc="$1" slurm restarts why step="" next="" over=1 f',
        "    rv_ended=$(date +%s)",
        f'    slurm=" $({show_job} 2>/dev/null) "',
        "    restarts=\"$(printf '%s' \"$slurm\" | sed -n 's/.* Restarts=\\([0-9]*\\) .*/\\1/p')\"",
        '    if [ "${restarts:-0}" -gt "$rv_attempt" ]; then',
        "        # Slurm runs this job again (node failure, preemption, scontrol requeue): same job id, same",
        "        # segment. Keep the secrets and the work dir for it.",
        '        rv_record requeued "requeued by Slurm" "$rc" "" ""',
        '        rv_exit_code="$rc"',
        "        return",
        "    fi",
        '    for f in "$RV_JOB_DIR"/stop-node*; do',
        '        [ -e "$f" ] || continue',
        '        case "$(cat -- "$f")" in *\' \'*) rv_stop_sent=true ;; esac',
        "    done",
        '    local limit=0 preempted=0 marker="$RV_CHECKPOINT_DIR/' + PREEMPTED + '"',
        '    case "$slurm" in *" Reason=TimeLimit "*) limit=1 ;; esac',
        '    case "$slurm" in *PREEMPT*) preempted=1 ;; esac',
        '    if [ -e "$RV_RUN_DIR/STOP" ]; then',
        '        why="cancelled by rv stop"',
        '    elif [ "$rv_program_ran" = 1 ] && [ -e "$marker" ]; then',
        "        # The program stopped cleanly: it saved and wrote the marker (removed before it started,",
        "        # so this one is its own).",
        "        step=\"$(sed -n '1s/^[[:space:]]*\\([0-9][0-9]*\\)[[:space:]]*$/\\1/p; "
        's/.*"step"[[:space:]]*:[[:space:]]*\\([0-9][0-9]*\\).*/\\1/p\' "$marker" | sed -n 1p)"',
        '        if [ "$rv_stop_sent" = true ] || [ "$limit" = 1 ]; then why="stopped at time limit"',
        '        elif [ "$preempted" = 1 ]; then why="preempted"',
        '        elif [ "$rv_got_term" = 1 ]; then why="cancelled"',
        '        else why="stopped"; fi',
        '        if [ "$why" != cancelled ]; then',
        '            if [ -n "$step" ] && [ -n "${rv_start_step:-}" ] \\',
        '                && [ "$step" -le "$rv_start_step" ]; then',
        '                why="$why with no progress (step $step, as when it started): not continued"',
        '            elif [ -z "$step" ] && [ "$(rv_ckpt_print)" = "$rv_start_print" ]; then',
        '                why="$why with nothing new in the checkpoint folder: not continued"',
        '            elif [ "$RV_SEGMENT" -ge "$RV_MAX_SEGMENTS" ]; then',
        '                why="$why; all $RV_MAX_SEGMENTS segments used (--max-segments)"',
        '            elif next="$(rv_submit_next)"; then',
        "                over=0",
        "            else",
        '                why="$why; the next segment could not be submitted: $next"',
        '                next=""',
        "            fi",
        "        fi",
        '    elif [ "$limit" = 1 ]; then why="time limit"',
        '    elif [ "$preempted" = 1 ]; then why="preempted"',
        '    elif [ "$rv_got_term" = 1 ]; then why="cancelled"',
        '    elif [ "$rv_program_ran" = 0 ]; then',
        '        why="failed before the program started: ${rv_failed_at:-setup}"',
        '    elif [ "$rc" = 0 ]; then why="finished"',
        '    else why="crashed"; fi',
        '    rv_record ended "$why" "$rc" "$step" "$next"',
    ]
    for path in req.outputs:
        lines.append(f"    rv_keep_output {_q(path)}")
    lines += [
        '    rv_exit_code="$rc"',
        '    if [ "$over" = 1 ]; then',
        "        # The run's own exit code: 0 only when the program finished.",
        '        local code="$rc"',
        '        if [ "$why" != finished ] && [ "$code" = 0 ]; then code=1; fi',
        '        printf \'{"reason": %s, "exit_code": %s, "segment": %s, "end": %s}\\n\' \\',
        '            "$(rv_jstr "$why")" "$code" "$RV_SEGMENT" "$rv_ended" >"$RV_RUN_DIR/ENDED.tmp" \\',
        '            && mv -f -- "$RV_RUN_DIR/ENDED.tmp" "$RV_RUN_DIR/ENDED"',
    ]
    if ctx.has_secrets:
        lines.append('        rm -f -- "$RV_RUN_DIR/secrets.env"')
    lines += [
        '        echo "rv: run $RV_RUN_NAME ended after segment $RV_SEGMENT: $why (exit code $code)"',
        "    else",
        '        echo "rv: run $RV_RUN_NAME $why at step ${step:-?};" \\',
        '            "segment $((RV_SEGMENT + 1)) is job $next"',
        "    fi",
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
        "# scancel and the time limit send TERM; before the program runs that ends the script, after",
        "# it the script waits for srun to return the program's own exit code.",
        "trap 'rv_got_term=1; [ \"$rv_program_ran\" = 1 ] || exit 143' TERM",
        "trap 'rv_got_term=1; [ \"$rv_program_ran\" = 1 ] || exit 130' INT",
        "trap 'rv_got_term=1; [ \"$rv_program_ran\" = 1 ] || exit 129' HUP",
    ]
    return lines


def _secrets(ctx: ScriptContext) -> list[str]:
    if not ctx.has_secrets:
        return []
    return [
        "# --- secrets ---------------------------------------------------------------------",
        "# Uploaded with mode 0600 before sbatch, never written into this script; present in every",
        "# segment and requeue, removed when the run ends.",
        'if [ -r "$RV_RUN_DIR/secrets.env" ]; then',
        '    set -a; . "$RV_RUN_DIR/secrets.env"; set +a',
        "else",
        '    rv_failed_at="the secrets file $RV_RUN_DIR/secrets.env is missing"',
        '    echo "rv: $rv_failed_at" >&2',
        "    exit 1",
        "fi",
    ]


def _work_dir(ctx: ScriptContext) -> list[str]:
    return [
        "# --- work dir ----------------------------------------------------------------------",
        "# The run's own copy of its snapshot, made once and kept by later segments and requeues.",
        "# Copies (reflinks where the filesystem has them), never hard links into the store: a job may",
        "# make its files writable and edit them without touching the store or another run. Files",
        "# that are hard links of each other in the snapshot (same content) become separate files.",
        "# A snapshot is a full tree, or a layer over another snapshot (what differs from it): then the",
        "# full one at the bottom is copied and each layer up to this one applied in order: the paths",
        "# it lists in `remove` deleted, its own files copied in.",
        *work_dir_lines(ctx.layout, ctx.snapshot_id),
        'cd "$RV_WORK_DIR"',
    ]


def work_dir_lines(layout: RemoteLayout, snapshot_id: str) -> list[str]:
    """Bash that makes ``$RV_WORK_DIR`` a private, writable copy of a snapshot (full, or layers)."""
    snaps = _q(layout.snapshots)
    copy = "cp -R -P --preserve=mode,timestamps --reflink=auto --"
    fail = 'echo "rv: $rv_failed_at" >&2; exit 1'
    return [
        'if [ ! -d "$RV_WORK_DIR" ]; then',
        '    rm -rf -- "$RV_WORK_DIR.tmp"',
        f"    rv_snap={_q(snapshot_id)} rv_layers='' rv_depth=0",
        f'    while [ -d {snaps}/"$rv_snap.layer" ]; do  # down the layers to the full snapshot',
        '        rv_layers="$rv_snap $rv_layers" rv_depth=$((rv_depth + 1))',
        f'        rv_snap=$(cat {snaps}/"$rv_snap.layer/base")',
        '        case "$rv_snap" in',
        f'            ""|*[!0-9a-f]*) rv_failed_at="a layer under snapshot {snapshot_id} has no base"',
        f"                {fail} ;;",
        "        esac",
        f'        if [ "$rv_depth" -gt {CHAIN_BROKEN} ]; then',
        f'            rv_failed_at="snapshot {snapshot_id}: layers with no end"; {fail}',
        "        fi",
        "    done",
        f'    if [ ! -d {snaps}/"$rv_snap" ]; then',
        f'        rv_failed_at="snapshot $rv_snap not found"; {fail}',
        "    fi",
        f'    {copy} {snaps}/"$rv_snap" "$RV_WORK_DIR.tmp"',
        '    chmod -R u+w -- "$RV_WORK_DIR.tmp"',
        "    for rv_layer in $rv_layers; do  # the lowest first",
        f'        (cd "$RV_WORK_DIR.tmp" && xargs -0 -r rm -rf -- < {snaps}/"$rv_layer.layer/remove")',
        f'        {copy} {snaps}/"$rv_layer.layer/tree/." "$RV_WORK_DIR.tmp"',
        "        # cp gave the folders it wrote into the layer's read-only modes: the next layer deletes",
        "        # in them.",
        f'        (cd {snaps}/"$rv_layer.layer/tree" && find . -type d -print0) |',
        '            (cd "$RV_WORK_DIR.tmp" && xargs -0 chmod u+w --)',
        "    done",
        '    chmod -R u+w -- "$RV_WORK_DIR.tmp"',
        '    mv -- "$RV_WORK_DIR.tmp" "$RV_WORK_DIR"',
        "fi",
    ]


def _setup(req: JobRequest, ctx: ScriptContext) -> list[str]:
    lines = [
        "# --- setup (rv run --setup), before anything else of the user's ----------------------",
        "# Without nounset: activate scripts and module systems read unset variables.",
        "rv_setup_failed() {",
        "    local rc=$?",
        '    rv_failed_at="setup line $1 failed with exit code $rc"',
        '    echo "rv: $rv_failed_at" >&2',
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
        f'[ "${{RV_GPU_CC%%.*}}" -ge {BF16_MIN_MAJOR} ]'
        if cc is not None
        else f'[ -n "$RV_GPU_CC" ] && [ "${{RV_GPU_CC%%.*}}" -ge {BF16_MIN_MAJOR} ]'
    )
    return [
        "# --- GPU and precision -------------------------------------------------------------",
        f"# BF16 needs compute capability {BF16_MIN_MAJOR}.0 or newer. Ask the GPU; when nvidia-smi is",
        "# missing or prints nothing usable, fall back to the catalog's value for "
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
    hostnames = commands.shell(commands.scontrol_hostnames(commands.raw('"$SLURM_JOB_NODELIST"')))
    show_node = commands.shell(commands.scontrol_show_node(commands.raw('"$RV_HEAD_NODE"')))
    return [
        "# --- first node --------------------------------------------------------------------",
        "# The first node hosts the rendezvous. Node names need not resolve as host names, so use its",
        "# NodeAddr as Slurm knows it (on most clusters that is the host name).",
        f'RV_HEAD_NODE="$({hostnames} | sed -n 1p)" || RV_HEAD_NODE=""',
        'RV_HEAD_NODE="${RV_HEAD_NODE:-$(hostname)}"',
        f'RV_HEAD_ADDR="$({show_node} 2>/dev/null \\',
        '    | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' | sed -n 1p)" || RV_HEAD_ADDR=""',
        'export RV_HEAD_NODE RV_HEAD_ADDR="${RV_HEAD_ADDR:-$RV_HEAD_NODE}"',
        'export MASTER_ADDR="$RV_HEAD_ADDR"',
    ]


def _job_env() -> list[str]:
    skip = " | ".join(_NOT_IN_JOB_ENV)
    return [
        "# --- the job's environment, for rv ssh and rv up -----------------------------------",
        "# What the program gets (exported variables and functions, less Slurm's per-step ones) and",
        "# where it starts, as a file: `rv ssh` and `rv up` start their shells from it, so setup lines,",
        "# the env-build hook, secrets, RV_* and caches reach them by this one path. 0600 (it holds",
        "# the secrets) and removed when the job ends. An interactive shell reads ~/.bashrc first.",
        "rv_save_env() {",
        f'    local f="$RV_JOB_DIR/{JOB_ENV_FILE}" v',
        "    (",
        "        umask 077",
        "        {",
        "            echo '# rv: the environment of the program of this job (rv ssh, rv up)'",
        "            echo 'case $- in *i*) [ -r ~/.bashrc ] && . ~/.bashrc ;; esac'",
        "            for v in $(compgen -e); do",
        '                case "$v" in ' + skip + ") continue ;; esac",
        '                [ -n "${!v+x}" ] || continue',
        '                printf \'export %s=%q\\n\' "$v" "${!v}"',
        "            done",
        "            declare -fx",
        "            printf 'cd -- %q\\n' \"$PWD\"",
        "            echo 'case $- in *i*) PS1=\"(rv $RV_RUN_NAME) $PS1\" ;; esac'",
        '        } >"$f.tmp" && mv -f -- "$f.tmp" "$f"',
        "    )",
        "}",
        'rv_save_env || echo "rv: warning: could not save the job\'s environment (rv ssh, rv up)" >&2',
    ]


def _segment_start(req: JobRequest) -> list[str]:
    if req.type is None:
        what = f"{req.nodes} node(s), CPU only"
        gpu = ""
    else:
        what = f"{req.nodes} node(s) x {req.gpus_per_node} {req.type.name}"
        gpu = ", cc=${RV_GPU_CC:-unknown} precision=$RV_PRECISION"
    return [
        "# --- segment start -----------------------------------------------------------------",
        "# A marker left by an earlier segment is moved aside: one found after the program ends is",
        "# then this segment's own. Where the run starts from is remembered, to tell progress.",
        f'if [ -e "$RV_CHECKPOINT_DIR/{PREEMPTED}" ]; then',
        f'    mv -f -- "$RV_CHECKPOINT_DIR/{PREEMPTED}" "$RV_JOB_DIR/{PREEMPTED}.before"',
        "fi",
        'rv_start_step="$(rv_ckpt_step)"',
        'if [ -z "$rv_start_step" ] && [ "$RV_SEGMENT" -gt 1 ]; then',
        '    rv_start_step="$(sed -n \'s/.*"checkpoint_step": \\([0-9][0-9]*\\).*/\\1/p\' \\',
        '        "$RV_RUN_DIR/seg/$((RV_SEGMENT - 1)).json" 2>/dev/null || true)"',
        "fi",
        'rv_start_print="$(rv_ckpt_print)"',
        'rv_record running "" "" "" ""',
        f'echo "rv: run $RV_RUN_NAME, segment $RV_SEGMENT/$RV_MAX_SEGMENTS: job $SLURM_JOB_ID on '
        f"$SLURM_JOB_NODELIST, {what}{gpu}, snapshot $RV_SNAPSHOT"
        '${rv_start_step:+, from step $rv_start_step}"',
    ]


def _rank_labels(req: JobRequest) -> list[str]:
    """rv's rank labeller (rv/agent/ranklabel.py), written into the job's folder for the tasks."""
    if not req.labeled:
        return []
    source = _LABELLER.read_text(encoding="utf-8")
    # Without its docstring (the why, in rv's source): the job needs only the code.
    shebang, _, rest = source.partition("\n")
    code = rest.split('"""', 2)[2].lstrip("\n")
    note = "# rv's rank labeller: rv/agent/ranklabel.py in rv's source says how and why."
    source = f"{shebang}\n{note}\n\n{code}"
    if _HEREDOC_END in source.splitlines():
        raise ValueError(f"{_LABELLER} holds the line {_HEREDOC_END!r} that ends the heredoc")
    return [
        "# --- rank labels ---------------------------------------------------------------------",
        "# More than one process writes into each log: every line of a rank goes through this labeller,",
        "# which prefixes it with the rank ([3] ...) and appends it whole (see its docstring).",
        "# torchrun (and accelerate, which runs torchrun) starts each rank as $PYTHON_EXEC -u ...",
        f"cat >\"$RV_JOB_DIR/rank-label.py.tmp\" <<'{_HEREDOC_END}'",
        *source.rstrip("\n").splitlines(),
        _HEREDOC_END,
        'chmod 700 "$RV_JOB_DIR/rank-label.py.tmp"',
        'mv -f -- "$RV_JOB_DIR/rank-label.py.tmp" "$RV_JOB_DIR/rank-label.py"',
        'export RV_RANK_LABEL="$RV_JOB_DIR/rank-label.py"',
    ]


def _task(req: JobRequest) -> list[str]:
    end_time = commands.shell(commands.squeue_end_time(commands.raw('"$SLURM_JOB_ID"')))
    launchers = " | ".join(_LAUNCHER_PATTERNS)
    lines = [
        "# --- the program, on each node -----------------------------------------------------",
        "# Each srun task (one per node) runs rv_task: the program in the background and rv's stop",
        "# watcher beside it. RV_STOP_LEAD seconds before the time limit the watcher sends",
        "# RV_STOP_SIGNAL to every process of the program that has a handler for it, and to no other:",
        "# a plain program is never signalled early and runs on to Slurm's own limit.",
        "rv_task() {",
        "    export -n -f rv_task rv_stop_watch rv_stop_deliver rv_stop_send  # not the program's",
    ]
    if req.labeled:
        log = '"$RV_RUN_DIR/logs/$SLURM_JOB_ID' + ("-node$SLURM_NODEID" if req.nodes > 1 else "")
        lines += [
            "    # The labeller appends to this node's log files (a one-node srun's stdout is a pipe).",
            f'    export RV_LOG_OUT={log}.out" RV_LOG_ERR={log}.err"',
        ]
        if req.launch is not None:
            lines += [
                "    # torchrun runs each rank as $PYTHON_EXEC -u ...: the labeller, then the real Python.",
                f'    export RV_PYTHON_EXEC="${{PYTHON_EXEC:-}}" PYTHON_EXEC={RANK_LABEL}',
            ]
    lines += [
        "    # `trap -`: a background job of a script would otherwise ignore INT and QUIT.",
        f"    ( trap - INT QUIT; exec {program_line(req)} ) &",
        "    local program=$! watcher rc",
        '    rv_stop_watch "$program" &',
        "    watcher=$!",
        "    # Slurm's own signals reach the program directly; this shell only waits for its exit code.",
        "    trap : TERM INT HUP USR1 USR2 QUIT",
        "    while :; do",
        '        wait "$program"; rc=$?',
        '        kill -0 "$program" 2>/dev/null || break',
        "    done",
        "    # KILL, not TERM: the watcher has nothing to finish, and a TERM trap of bash 5.2 was seen",
        "    # lost under load (the watcher lived on, and this wait with it).",
        '    kill -KILL "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null || :',
    ]
    if req.nodes > 1:
        lines.append('    printf \'%s\\n\' "$rc" >"$RV_JOB_DIR/node$SLURM_NODEID.exit"')
    lines += [
        '    return "$rc"',
        "}",
        "rv_stop_watch() {  # rv_stop_watch PID: at the lead time, rv_stop_deliver PID",
        "    local end left",
        "    # It waits in `read -t` on a pipe no one writes to (rv_nap_fd, also rv_stop_deliver's): a",
        "    # builtin, so killing the watcher leaves no `sleep` behind holding the job's output open.",
        "    exec {rv_nap_fd}<> <(:)",
        "    while :; do",
        "        # Asked again every minute at most: Slurm may move the limit (scontrol update).",
        f'        end="$({end_time} 2>/dev/null | sed -n 1p)"',
        "        # An empty answer must stay empty: `date -d ''` is midnight, a limit long past.",
        '        [ -n "$end" ] && end="$(date -d "$end" +%s 2>/dev/null)" || end=""',
        '        if [ -n "$end" ]; then',
        "            left=$((end - RV_STOP_LEAD - $(date +%s)))",
        '            if [ "$left" -le 0 ]; then rv_stop_deliver "$1"; return 0; fi',
        '            [ "$left" -le 60 ] || left=60',
        "        else",
        "            left=60  # no answer (or no limit): never signal on a guess",
        "        fi",
        '        read -r -t "$left" -u "$rv_nap_fd" || :',
        "    done",
        "}",
        "rv_stop_deliver() {  # rv_stop_deliver PID: RV_STOP_SIGNAL to the processes under PID handling it",
        "    # A program may install its handler late (a long start-up in a short job): until one does,",
        "    # look again every few seconds; the first time, say that nothing handles it yet.",
        "    local said=''",
        '    until rv_stop_send "$1"; do',
        '        if [ -z "$said" ]; then',
        '            echo "rv: $RV_STOP_LEAD s before the time limit: no process handles" \\',
        '                "$RV_STOP_SIGNAL; the program runs on until the limit" >&2',
        '            date +%s >"$RV_JOB_DIR/stop-node${SLURM_NODEID:-0}"',
        "            said=1",
        "        fi",
        '        read -r -t 5 -u "$rv_nap_fd" || :',
        "    done",
        "}",
        "rv_stop_send() {  # rv_stop_send PID: signal the handlers under PID; fails when there are none",
        '    local bit pid mask sent=""',
        '    bit=$(($(kill -l "$RV_STOP_SIGNAL") - 1))',
        '    for pid in $(ps -e -o pid= -o ppid= | awk -v root="$1" \'{ up[$1] = $2 }',
        "        END { for (p in up) { q = p; n = 0; while (q != root && (q in up) && n++ < 64) q = up[q];",
        "              if (q == root) print p } }'); do",
        '        mask="$(sed -n \'s/^SigCgt:[[:space:]]*//p\' "/proc/$pid/status" 2>/dev/null)"',
        '        [ -n "$mask" ] && (((16#$mask >> bit) & 1)) || continue',
        "        case \"$(tr '\\0' ' ' <\"/proc/$pid/cmdline\" 2>/dev/null)\" in",
        f"            {launchers}) continue ;;",
        "        esac",
        '        kill -s "$RV_STOP_SIGNAL" "$pid" 2>/dev/null && sent="$sent $pid"',
        "    done",
        '    [ -n "$sent" ] || return 1',
        '    printf \'%s%s\\n\' "$(date +%s)" "$sent" >"$RV_JOB_DIR/stop-node${SLURM_NODEID:-0}"',
        '    echo "rv: $RV_STOP_LEAD s before the time limit: sent $RV_STOP_SIGNAL to pid(s)$sent" \\',
        '        "on $(hostname)" >&2',
        "}",
        "export -f rv_task rv_stop_watch rv_stop_deliver rv_stop_send",
    ]
    return lines


def _launch(req: JobRequest, ctx: ScriptContext) -> list[str]:
    srun = [
        f"srun --nodes={req.nodes} --ntasks={req.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
    ]
    if req.nodes > 1:
        logs = posixpath.join(ctx.run_dir, "logs")
        out, err = _q(f"{logs}/%j-node%n.out"), _q(f"{logs}/%j-node%n.err")
        srun.append(f"    --open-mode=append --output={out} --error={err} \\")
    lines = [
        "# --- launch ------------------------------------------------------------------------",
        "# Always an srun step, one task per node. --kill-on-bad-exit: one dead node must not leave",
        "# the others waiting at a collective.",
    ]
    if req.nodes > 1:
        lines += [
            "# One log per node; the batch log keeps rv's own lines.",
            'rm -f -- "$RV_JOB_DIR"/node*.exit',
        ]
    lines += [
        "rv_program_ran=1 rv_rc=0",
        *srun,
        "    bash -c rv_task || rv_rc=$?",
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
        f"# Written by rv for run {req.name} ({ctx.run_id}) of project {ctx.project},",
        f"# snapshot {ctx.snapshot_id}.",
        "# No `set -x` here: secrets are in this environment. The program's exit code is the job's.",
        "",
        "set -euo pipefail",
        f"umask {ctx.umask}",
    ]
    sections = [
        _directives(req, ctx) + header,
        _run(req, ctx),
        _environment(req, ctx),
        _records(),
        _end_of_segment(req, ctx),
        _secrets(ctx),
        _work_dir(ctx),
        _setup(req, ctx),
        _gpu(req, ctx),
        _head_node(),
        _job_env(),
        _segment_start(req),
        _rank_labels(req),
        _task(req),
        _launch(req, ctx),
    ]
    return "\n\n".join("\n".join(section) for section in sections if section) + "\n"
