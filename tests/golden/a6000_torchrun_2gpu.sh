#!/bin/bash
#SBATCH --job-name=train
#SBATCH --partition=gpu-a6000
#SBATCH --gres=gpu:a6000:2
#SBATCH --time=06:00:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=/scratch/u/rv/runs/run0a1b2/logs/%j.out
#SBATCH --error=/scratch/u/rv/runs/run0a1b2/logs/%j.err
#SBATCH --open-mode=append
#SBATCH --requeue
#
# Written by rv for run train (run0a1b2) of project proj-1a2b3c,
# snapshot snap01.
# No `set -x` here: secrets are in this environment. The program's exit code is the job's.

set -euo pipefail
umask 077

# --- run and segment ---------------------------------------------------------------
export RV_RUN_DIR=/scratch/u/rv/runs/run0a1b2 RV_RUN_ID=run0a1b2 RV_RUN_NAME=train
export RV_SEGMENT="${RV_SEGMENT:-1}" RV_MAX_SEGMENTS=10
export RV_JOB_DIR="$RV_RUN_DIR/jobs/$SLURM_JOB_ID"
rv_attempt="${SLURM_RESTART_COUNT:-0}"
rv_started=$(date +%s)
mkdir -p -- "$RV_JOB_DIR" "$RV_RUN_DIR/seg"
printf '%s\n' "$SLURM_JOB_ID" >"$RV_RUN_DIR/seg/$RV_SEGMENT.job"
# The environment the run was submitted with, saved once before rv adds to it (no secrets
# yet), less Slurm's per-job variables: later segments are submitted with exactly this.
if [ ! -e "$RV_RUN_DIR/submit.env" ]; then
    {
        for rv_v in $(compgen -e); do
            case "$rv_v" in SLURM_CONF) ;; SLURM_* | SLURMD_* | CUDA_VISIBLE_DEVICES | GPU_DEVICE_ORDINAL | ROCR_VISIBLE_DEVICES | ENVIRONMENT | RV_SEGMENT | PWD | OLDPWD | SHLVL | _) continue ;; esac
            declare -p "$rv_v"
        done
        declare -fx
    } >"$RV_RUN_DIR/submit.env.tmp"
    mv -f -- "$RV_RUN_DIR/submit.env.tmp" "$RV_RUN_DIR/submit.env"
fi

# --- environment -----------------------------------------------------------------
# Unbuffered, or logs arrive minutes late.
export PYTHONUNBUFFERED=1 SLURM_UNBUFFEREDIO=1
# Caches on scratch: the home quota fills up. A value already set by the user wins.
export HF_HOME="${HF_HOME:-/scratch/u/rv/cache/hf}"
export TORCH_HOME="${TORCH_HOME:-/scratch/u/rv/cache/torch}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/scratch/u/rv/cache/triton}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-/scratch/u/rv/cache/pip}"
export WANDB_DIR="${WANDB_DIR:-/scratch/u/rv/cache/wandb}"
export WANDB_CACHE_DIR="${WANDB_CACHE_DIR:-/scratch/u/rv/cache/wandb/cache}"
export WANDB_DATA_DIR="${WANDB_DATA_DIR:-/scratch/u/rv/cache/wandb/data}"
export XDG_CACHE_HOME="${XDG_CACHE_HOME:-/scratch/u/rv/cache/xdg}"
export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-/scratch/u/rv/cache/xdg/nv}"
export RV_WORK_DIR="$RV_RUN_DIR/work"
# Shared by every run of this name in this project: a run named again resumes from here.
export RV_CHECKPOINT_DIR=/scratch/u/rv/checkpoints/proj-1a2b3c/train RV_OUTPUT_DIR=/scratch/u/rv/outputs/proj-1a2b3c/train
export RV_SNAPSHOT=snap01 RV_PROJECT=proj-1a2b3c
export RV_NODES=1 RV_GPUS=2 RV_GPUS_PER_NODE=2
export RV_STOP_SIGNAL=USR1 RV_STOP_LEAD=300
# One port per job (from its id), so two jobs sharing a node never collide.
export MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
# srun does not inherit sbatch's --cpus-per-task (Slurm 22.05+): without this every task
# would be pinned to one CPU.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi
mkdir -p -- "$RV_CHECKPOINT_DIR" "$RV_OUTPUT_DIR"

# --- records -----------------------------------------------------------------------
# seg/<k>.json: this segment's record, written at its start and rewritten at its end (write,
# then rename). `rv ps -a` and `rv logs` read it where there is no sacct to ask.
rv_jstr() { local v=${1//[\"\\]/}; v=${v//[$'\t\r\n']/ }; printf '"%s"' "$v"; }
rv_jnum() { case "$1" in '' | *[!0-9]*) printf null ;; *) printf %s "$1" ;; esac; }
rv_jopt() { if [ -n "$1" ]; then rv_jstr "$1"; else printf null; fi; }
rv_record() {  # rv_record STATE REASON EXIT_CODE CHECKPOINT_STEP NEXT_JOB_ID
    local f="$RV_RUN_DIR/seg/$RV_SEGMENT.json"
    {
        printf '{"segment": %s, "job_id": %s, "attempt": %s, "nodes": %s, ' \
            "$RV_SEGMENT" "$(rv_jstr "$SLURM_JOB_ID")" "$rv_attempt" "$(rv_jstr "${SLURM_JOB_NODELIST:-}")"
        printf '"start": %s, "end": %s, "state": %s, "reason": %s, "exit_code": %s, ' \
            "$rv_started" "$(rv_jnum "${rv_ended:-}")" "$(rv_jstr "$1")" "$(rv_jstr "$2")" "$(rv_jnum "$3")"
        printf '"start_step": %s, "checkpoint_step": %s, "stop_sent": %s, "next_job_id": %s}\n' \
            "$(rv_jnum "${rv_start_step:-}")" "$(rv_jnum "$4")" "${rv_stop_sent:-false}" "$(rv_jopt "$5")"
    } >"$f.tmp" && mv -f -- "$f.tmp" "$f"
}
# The newest complete checkpoint in rv_train's layout (step_<N>/COMPLETE), if that is the layout.
rv_ckpt_step() {
    local d n best=''
    for d in "$RV_CHECKPOINT_DIR"/step_*/COMPLETE; do
        [ -e "$d" ] || continue
        n="${d%/COMPLETE}"; n="${n##*/step_}"; n="${n#"${n%%[!0]*}"}"; n="${n:-0}"
        case "$n" in *[!0-9]*) continue ;; esac
        if [ -z "$best" ] || [ "$n" -gt "$best" ]; then best="$n"; fi
    done
    printf %s "$best"
}
# What a checkpoint folder holds, as one line: tells progress when a marker names no step.
rv_ckpt_print() {
    find "$RV_CHECKPOINT_DIR" -path "$RV_CHECKPOINT_DIR/PREEMPTED" -prune -o -printf '%P %s %T@\n' \
        2>/dev/null | sort | cksum
}

# --- end of a segment --------------------------------------------------------------
# Runs however the script ends: the program finished, crashed or stopped, the time limit,
# scancel, rv stop, a requeue. Why this segment ended, whether the run goes on (in a new job:
# a requeue would wait about two minutes to start again), and the run's end.
rv_program_ran=0 rv_got_term=0 rv_failed_at='' rv_exit_code=0 rv_stop_sent=false
rv_on_exit() {
    local rc=$?
    trap '' TERM INT HUP  # Slurm keeps signalling: finish the records first
    set +eu
    rm -f -- "$RV_JOB_DIR/env.sh"  # it holds the secrets: gone with the job
    rv_end_segment "$rc"
    exit "$rv_exit_code"
}
# The next segment: same script, same run, submitted with the environment segment 1 had.
rv_submit_next() {
    local out
    out="$(env -i "$BASH" -c 'set -a; . "$1" || exit 1; set +a; export RV_SEGMENT="$2"; '\
'exec sbatch --parsable --dependency=afterany:"$3" --kill-on-invalid-dep=yes "$4"' \
        rv "$RV_RUN_DIR/submit.env" "$((RV_SEGMENT + 1))" "$SLURM_JOB_ID" "$RV_RUN_DIR/job.sbatch" 2>&1)" || {
        printf '%s' "$out" | tail -n 2 | tr '\n' ' '
        return 1
    }
    out="${out##*$'\n'}"; out="${out%%;*}"
    printf '%s\n' "$out" >"$RV_RUN_DIR/seg/$((RV_SEGMENT + 1)).job"
    # rv stop writes STOP before it cancels what it finds: look again now that this job exists.
    if [ -e "$RV_RUN_DIR/STOP" ]; then
        scancel "$out" 2>/dev/null
        printf 'cancelled by rv stop'
        return 1
    fi
    printf '%s' "$out"
}
rv_end_segment() {
    local rc="$1" slurm restarts why step="" next="" over=1 f
    rv_ended=$(date +%s)
    slurm=" $(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null) "
    restarts="$(printf '%s' "$slurm" | sed -n 's/.* Restarts=\([0-9]*\) .*/\1/p')"
    if [ "${restarts:-0}" -gt "$rv_attempt" ]; then
        # Slurm runs this job again (node failure, preemption, scontrol requeue): same job id, same
        # segment. Keep the secrets and the work dir for it.
        rv_record requeued "requeued by Slurm" "$rc" "" ""
        rv_exit_code="$rc"
        return
    fi
    for f in "$RV_JOB_DIR"/stop-node*; do
        [ -e "$f" ] || continue
        case "$(cat -- "$f")" in *' '*) rv_stop_sent=true ;; esac
    done
    local limit=0 preempted=0 marker="$RV_CHECKPOINT_DIR/PREEMPTED"
    case "$slurm" in *" Reason=TimeLimit "*) limit=1 ;; esac
    case "$slurm" in *PREEMPT*) preempted=1 ;; esac
    if [ -e "$RV_RUN_DIR/STOP" ]; then
        why="cancelled by rv stop"
    elif [ "$rv_program_ran" = 1 ] && [ -e "$marker" ]; then
        # The program stopped cleanly: it saved and wrote the marker (removed before it started,
        # so this one is its own).
        step="$(sed -n '1s/^[[:space:]]*\([0-9][0-9]*\)[[:space:]]*$/\1/p; s/.*"step"[[:space:]]*:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$marker" | sed -n 1p)"
        if [ "$rv_stop_sent" = true ] || [ "$limit" = 1 ]; then why="stopped at time limit"
        elif [ "$preempted" = 1 ]; then why="preempted"
        elif [ "$rv_got_term" = 1 ]; then why="cancelled"
        else why="stopped"; fi
        if [ "$why" != cancelled ]; then
            if [ -n "$step" ] && [ -n "${rv_start_step:-}" ] \
                && [ "$step" -le "$rv_start_step" ]; then
                why="$why with no progress (step $step, as when it started): not continued"
            elif [ -z "$step" ] && [ "$(rv_ckpt_print)" = "$rv_start_print" ]; then
                why="$why with nothing new in the checkpoint folder: not continued"
            elif [ "$RV_SEGMENT" -ge "$RV_MAX_SEGMENTS" ]; then
                why="$why; all $RV_MAX_SEGMENTS segments used (--max-segments)"
            elif next="$(rv_submit_next)"; then
                over=0
            else
                why="$why; the next segment could not be submitted: $next"
                next=""
            fi
        fi
    elif [ "$limit" = 1 ]; then why="time limit"
    elif [ "$preempted" = 1 ]; then why="preempted"
    elif [ "$rv_got_term" = 1 ]; then why="cancelled"
    elif [ "$rv_program_ran" = 0 ]; then
        why="failed before the program started: ${rv_failed_at:-setup}"
    elif [ "$rc" = 0 ]; then why="finished"
    else why="crashed"; fi
    rv_record ended "$why" "$rc" "$step" "$next"
    rv_exit_code="$rc"
    if [ "$over" = 1 ]; then
        # The run's own exit code: 0 only when the program finished.
        local code="$rc"
        if [ "$why" != finished ] && [ "$code" = 0 ]; then code=1; fi
        printf '{"reason": %s, "exit_code": %s, "segment": %s, "end": %s}\n' \
            "$(rv_jstr "$why")" "$code" "$RV_SEGMENT" "$rv_ended" >"$RV_RUN_DIR/ENDED.tmp" \
            && mv -f -- "$RV_RUN_DIR/ENDED.tmp" "$RV_RUN_DIR/ENDED"
        echo "rv: run $RV_RUN_NAME ended after segment $RV_SEGMENT: $why (exit code $code)"
    else
        echo "rv: run $RV_RUN_NAME $why at step ${step:-?};" \
            "segment $((RV_SEGMENT + 1)) is job $next"
    fi
}
trap rv_on_exit EXIT
# scancel and the time limit send TERM; before the program runs that ends the script, after
# it the script waits for srun to return the program's own exit code.
trap 'rv_got_term=1; [ "$rv_program_ran" = 1 ] || exit 143' TERM
trap 'rv_got_term=1; [ "$rv_program_ran" = 1 ] || exit 130' INT
trap 'rv_got_term=1; [ "$rv_program_ran" = 1 ] || exit 129' HUP

# --- work dir ----------------------------------------------------------------------
# The run's own copy of its snapshot, made once and kept by later segments and requeues.
# Copies (reflinks where the filesystem has them), never hard links into the store: a job may
# make its files writable and edit them without touching the store or another run. Files
# that are hard links of each other in the snapshot (same content) become separate files.
# A snapshot is a full tree, or a layer over another snapshot (what differs from it): then the
# full one at the bottom is copied and each layer up to this one applied in order: the paths
# it lists in `remove` deleted, its own files copied in.
if [ ! -d "$RV_WORK_DIR" ]; then
    rm -rf -- "$RV_WORK_DIR.tmp"
    rv_snap=snap01 rv_layers='' rv_depth=0
    while [ -d /scratch/u/rv/snapshots/"$rv_snap.layer" ]; do  # down the layers to the full snapshot
        rv_layers="$rv_snap $rv_layers" rv_depth=$((rv_depth + 1))
        rv_snap=$(cat /scratch/u/rv/snapshots/"$rv_snap.layer/base")
        case "$rv_snap" in
            ""|*[!0-9a-f]*) rv_failed_at="a layer under snapshot snap01 has no base"
                echo "rv: $rv_failed_at" >&2; exit 1 ;;
        esac
        if [ "$rv_depth" -gt 32 ]; then
            rv_failed_at="snapshot snap01: layers with no end"; echo "rv: $rv_failed_at" >&2; exit 1
        fi
    done
    if [ ! -d /scratch/u/rv/snapshots/"$rv_snap" ]; then
        rv_failed_at="snapshot $rv_snap not found"; echo "rv: $rv_failed_at" >&2; exit 1
    fi
    cp -R -P --preserve=mode,timestamps --reflink=auto -- /scratch/u/rv/snapshots/"$rv_snap" "$RV_WORK_DIR.tmp"
    chmod -R u+w -- "$RV_WORK_DIR.tmp"
    for rv_layer in $rv_layers; do  # the lowest first
        (cd "$RV_WORK_DIR.tmp" && xargs -0 -r rm -rf -- < /scratch/u/rv/snapshots/"$rv_layer.layer/remove")
        cp -R -P --preserve=mode,timestamps --reflink=auto -- /scratch/u/rv/snapshots/"$rv_layer.layer/tree/." "$RV_WORK_DIR.tmp"
        # cp gave the folders it wrote into the layer's read-only modes: the next layer deletes
        # in them.
        (cd /scratch/u/rv/snapshots/"$rv_layer.layer/tree" && find . -type d -print0) |
            (cd "$RV_WORK_DIR.tmp" && xargs -0 chmod u+w --)
    done
    chmod -R u+w -- "$RV_WORK_DIR.tmp"
    mv -- "$RV_WORK_DIR.tmp" "$RV_WORK_DIR"
fi
cd "$RV_WORK_DIR"

# --- setup (rv run --setup), before anything else of the user's ----------------------
# Without nounset: activate scripts and module systems read unset variables.
rv_setup_failed() {
    local rc=$?
    rv_failed_at="setup line $1 failed with exit code $rc"
    echo "rv: $rv_failed_at" >&2
    exit "$rc"
}
set +u
# --- env build hook ----------------------------------------------------------------
# rv builds the project's environment here (after setup, so setup's modules are loaded).
set -u

# --- GPU and precision -------------------------------------------------------------
# BF16 needs compute capability 8.0 or newer. Ask the GPU; when nvidia-smi is
# missing or prints nothing usable, fall back to the catalog's value for a6000 (8.6).
RV_GPU_CC="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
    | sed -n 1p | tr -d '[:space:]')" || RV_GPU_CC=""
case "$RV_GPU_CC" in
    [0-9].[0-9] | [0-9][0-9].[0-9]) ;;
    *) RV_GPU_CC=8.6 ;;
esac
if [ "${RV_GPU_CC%%.*}" -ge 8 ]; then RV_PRECISION=bf16; else RV_PRECISION=fp16; fi
export RV_GPU_TYPE=a6000 RV_GPU_CC RV_PRECISION
export ACCELERATE_MIXED_PRECISION="$RV_PRECISION"

# --- first node --------------------------------------------------------------------
# The first node hosts the rendezvous. Node names need not resolve as host names, so use its
# NodeAddr as Slurm knows it (on most clusters that is the host name).
RV_HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)" || RV_HEAD_NODE=""
RV_HEAD_NODE="${RV_HEAD_NODE:-$(hostname)}"
RV_HEAD_ADDR="$(scontrol show node "$RV_HEAD_NODE" 2>/dev/null \
    | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | sed -n 1p)" || RV_HEAD_ADDR=""
export RV_HEAD_NODE RV_HEAD_ADDR="${RV_HEAD_ADDR:-$RV_HEAD_NODE}"
export MASTER_ADDR="$RV_HEAD_ADDR"

# --- the job's environment, for rv ssh and rv up -----------------------------------
# What the program gets (exported variables and functions, less Slurm's per-step ones) and
# where it starts, as a file: `rv ssh` and `rv up` start their shells from it, so setup lines,
# the env-build hook, secrets, RV_* and caches reach them by this one path. 0600 (it holds
# the secrets) and removed when the job ends. An interactive shell reads ~/.bashrc first.
rv_save_env() {
    local f="$RV_JOB_DIR/env.sh" v
    (
        umask 077
        {
            echo '# rv: the environment of the program of this job (rv ssh, rv up)'
            echo 'case $- in *i*) [ -r ~/.bashrc ] && . ~/.bashrc ;; esac'
            for v in $(compgen -e); do
                case "$v" in SLURM_* | SLURMD_* | PMI_* | PMIX_* | CUDA_VISIBLE_DEVICES | GPU_DEVICE_ORDINAL | ROCR_VISIBLE_DEVICES | ENVIRONMENT | PWD | OLDPWD | SHLVL | _ | TERM | SSH_* | DISPLAY | HOSTNAME | PS1 | BASH_FUNC_*) continue ;; esac
                [ -n "${!v+x}" ] || continue
                printf 'export %s=%q\n' "$v" "${!v}"
            done
            declare -fx
            printf 'cd -- %q\n' "$PWD"
            echo 'case $- in *i*) PS1="(rv $RV_RUN_NAME) $PS1" ;; esac'
        } >"$f.tmp" && mv -f -- "$f.tmp" "$f"
    )
}
rv_save_env || echo "rv: warning: could not save the job's environment (rv ssh, rv up)" >&2

# --- segment start -----------------------------------------------------------------
# A marker left by an earlier segment is moved aside: one found after the program ends is
# then this segment's own. Where the run starts from is remembered, to tell progress.
if [ -e "$RV_CHECKPOINT_DIR/PREEMPTED" ]; then
    mv -f -- "$RV_CHECKPOINT_DIR/PREEMPTED" "$RV_JOB_DIR/PREEMPTED.before"
fi
rv_start_step="$(rv_ckpt_step)"
if [ -z "$rv_start_step" ] && [ "$RV_SEGMENT" -gt 1 ]; then
    rv_start_step="$(sed -n 's/.*"checkpoint_step": \([0-9][0-9]*\).*/\1/p' \
        "$RV_RUN_DIR/seg/$((RV_SEGMENT - 1)).json" 2>/dev/null || true)"
fi
rv_start_print="$(rv_ckpt_print)"
rv_record running "" "" "" ""
echo "rv: run $RV_RUN_NAME, segment $RV_SEGMENT/$RV_MAX_SEGMENTS: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, 1 node(s) x 2 a6000, cc=${RV_GPU_CC:-unknown} precision=$RV_PRECISION, snapshot $RV_SNAPSHOT${rv_start_step:+, from step $rv_start_step}"

# --- rank labels ---------------------------------------------------------------------
# More than one process writes into each log: every line of a rank goes through this labeller,
# which prefixes it with the rank ([3] ...) and appends it whole (see its docstring).
# torchrun (and accelerate, which runs torchrun) starts each rank as $PYTHON_EXEC -u ...
cat >"$RV_JOB_DIR/rank-label.py.tmp" <<'RV_RANK_LABEL_END'
#!/usr/bin/env python3
# rv's rank labeller: rv/agent/ranklabel.py in rv's source says how and why.

import os
import re
import select
import signal
import stat
import subprocess
import sys

MAX_PIECE = 1 << 20  # a line with no end yet is written out at this size
READ = 1 << 16
_PIECE = re.compile(b"[^\r\n]*(?:\r\n|\n|\r)")
_HANDLED = [
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
]


def write_all(fd, data):
    """One write() for all of ``data`` (O_APPEND keeps it whole); more only if the kernel cut it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Labeller:
    """Turns a byte stream into whole labelled pieces written to ``fd``."""

    def __init__(self, fd, label):
        self.fd = fd
        self.label = label
        self.pending = b""

    def feed(self, data):
        self.pending += data
        # A "\r" as the very last byte may be the first half of "\r\n": it waits for the next byte.
        limit = len(self.pending) - 1 if self.pending.endswith(b"\r") else len(self.pending)
        end = max(self.pending.rfind(b"\n", 0, limit), self.pending.rfind(b"\r", 0, limit))
        if end < 0:
            if len(self.pending) >= MAX_PIECE:
                self.flush()
            return
        done, self.pending = self.pending[: end + 1], self.pending[end + 1 :]
        write_all(self.fd, b"".join(self.label + piece for piece in _PIECE.findall(done)))

    def flush(self):
        """What has no end yet, as a line of its own: the next rank's line must not join it."""
        if self.pending:
            rest, self.pending = self.pending, b""
            write_all(self.fd, self.label + rest + (b"" if rest.endswith(b"\n") else b"\n"))


def log_fd(fd, env_name):
    """Where labelled lines go: ``fd`` when it is a file; else the file ``$env_name`` names."""
    try:
        is_file = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        is_file = False
    path = os.environ.get(env_name)
    if is_file or not path:
        return fd
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def real_python():
    """The interpreter torchrun would have run: the user's PYTHON_EXEC, else the launcher's own."""
    own = os.environ.get("RV_PYTHON_EXEC")
    if own:
        return own
    try:
        with open("/proc/%d/cmdline" % os.getppid(), "rb") as fh:
            argv0 = fh.read().split(b"\0")[0].decode("utf-8", "surrogateescape")
    except OSError:
        argv0 = ""
    if "/" in argv0:
        # Relative to the launcher's folder, not ours (`.venv/bin/python -m torch.distributed.run`).
        try:
            return os.path.join(os.readlink("/proc/%d/cwd" % os.getppid()), argv0)
        except OSError:
            return os.path.abspath(argv0)
    if argv0:
        for folder in os.environ.get("PATH", "").split(os.pathsep):
            candidate = os.path.join(folder or ".", argv0)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    return sys.executable


def parse_args(argv):
    """(label text or None, argv of the program to run)."""
    label = os.environ.get("RANK")
    if argv[:1] != ["--exec"]:
        return label, [real_python()] + argv
    rest = argv[1:]
    if rest[:1] == ["--label"] and len(rest) > 1:
        label, rest = rest[1], rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        sys.stderr.write("rank-label.py: --exec needs a program to run\n")
        sys.exit(2)
    return label, rest


def child_env():
    """The program's environment as it would be without rv's labeller in between."""
    env = dict(os.environ)
    own = env.pop("RV_PYTHON_EXEC", None)
    if own:
        env["PYTHON_EXEC"] = own
    else:
        env.pop("PYTHON_EXEC", None)
    return env


def main(argv):
    label, program = parse_args(argv)
    if label is None:  # not a rank of a launcher: nothing to label, run it as it is
        env = child_env()
        os.execvpe(program[0], program, env)
    inherited = dict((s, signal.getsignal(s)) for s in _HANDLED)
    for s in _HANDLED:
        signal.signal(s, signal.SIG_IGN)

    def restore():
        for s, how in inherited.items():
            # Python's own SIGINT handler stands for "default" in the program that is started.
            signal.signal(s, how if how in (signal.SIG_IGN, signal.SIG_DFL) else signal.SIG_DFL)

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = subprocess.Popen(
            program, stdout=out_w, stderr=err_w, env=child_env(), close_fds=False, preexec_fn=restore
        )
    except OSError as exc:
        sys.stderr.write("rank-label.py: cannot run %s: %s\n" % (program[0], exc))
        return 127
    os.close(out_w)
    os.close(err_w)
    tag = ("[%s] " % label).encode("utf-8", "replace")
    streams = {
        out_r: Labeller(log_fd(1, "RV_LOG_OUT"), tag),
        err_r: Labeller(log_fd(2, "RV_LOG_ERR"), tag),
    }
    running = True
    while streams:
        ready = select.select(list(streams), [], [], 0.5 if running else 0.2)[0]
        for fd in ready:
            data = os.read(fd, READ)
            if data:
                streams[fd].feed(data)
            else:
                streams.pop(fd).flush()
                os.close(fd)
        if running and proc.poll() is not None:
            running = False
        elif not running and not ready:
            # The program has ended and nothing more is waiting: a process it left behind may hold
            # the pipes open for ever, so stop here.
            break
    for labeller in streams.values():
        labeller.flush()
    code = proc.wait()
    if code < 0:  # end as the program ended: killed by the same signal
        try:
            signal.signal(-code, signal.SIG_DFL)  # ignored here (SIGPIPE by Python itself) or handled
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP cannot be changed, and need not be
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
RV_RANK_LABEL_END
chmod 700 "$RV_JOB_DIR/rank-label.py.tmp"
mv -f -- "$RV_JOB_DIR/rank-label.py.tmp" "$RV_JOB_DIR/rank-label.py"
export RV_RANK_LABEL="$RV_JOB_DIR/rank-label.py"

# --- the program, on each node -----------------------------------------------------
# Each srun task (one per node) runs rv_task: the program in the background and rv's stop
# watcher beside it. RV_STOP_LEAD seconds before the time limit the watcher sends
# RV_STOP_SIGNAL to every process of the program that has a handler for it, and to no other:
# a plain program is never signalled early and runs on to Slurm's own limit.
rv_task() {
    export -n -f rv_task rv_stop_watch rv_stop_deliver rv_stop_send  # not the program's
    # The labeller appends to this node's log files (a one-node srun's stdout is a pipe).
    export RV_LOG_OUT="$RV_RUN_DIR/logs/$SLURM_JOB_ID.out" RV_LOG_ERR="$RV_RUN_DIR/logs/$SLURM_JOB_ID.err"
    # torchrun runs each rank as $PYTHON_EXEC -u ...: the labeller, then the real Python.
    export RV_PYTHON_EXEC="${PYTHON_EXEC:-}" PYTHON_EXEC="$RV_RANK_LABEL"
    # `trap -`: a background job of a script would otherwise ignore INT and QUIT.
    ( trap - INT QUIT; exec torchrun --nnodes=1 --node-rank="$SLURM_NODEID" --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$RV_HEAD_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" train.py ) &
    local program=$! watcher rc
    rv_stop_watch "$program" &
    watcher=$!
    # Slurm's own signals reach the program directly; this shell only waits for its exit code.
    trap : TERM INT HUP USR1 USR2 QUIT
    while :; do
        wait "$program"; rc=$?
        kill -0 "$program" 2>/dev/null || break
    done
    # KILL, not TERM: the watcher has nothing to finish, and a TERM trap of bash 5.2 was seen
    # lost under load (the watcher lived on, and this wait with it).
    kill -KILL "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null || :
    return "$rc"
}
rv_stop_watch() {  # rv_stop_watch PID: at the lead time, rv_stop_deliver PID
    local end left
    # It waits in `read -t` on a pipe no one writes to (rv_nap_fd, also rv_stop_deliver's): a
    # builtin, so killing the watcher leaves no `sleep` behind holding the job's output open.
    exec {rv_nap_fd}<> <(:)
    while :; do
        # Asked again every minute at most: Slurm may move the limit (scontrol update).
        end="$(env SLURM_TIME_FORMAT=standard squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | sed -n 1p)"
        # An empty answer must stay empty: `date -d ''` is midnight, a limit long past.
        [ -n "$end" ] && end="$(date -d "$end" +%s 2>/dev/null)" || end=""
        if [ -n "$end" ]; then
            left=$((end - RV_STOP_LEAD - $(date +%s)))
            if [ "$left" -le 0 ]; then rv_stop_deliver "$1"; return 0; fi
            [ "$left" -le 60 ] || left=60
        else
            left=60  # no answer (or no limit): never signal on a guess
        fi
        read -r -t "$left" -u "$rv_nap_fd" || :
    done
}
rv_stop_deliver() {  # rv_stop_deliver PID: RV_STOP_SIGNAL to the processes under PID handling it
    # A program may install its handler late (a long start-up in a short job): until one does,
    # look again every few seconds; the first time, say that nothing handles it yet.
    local said=''
    until rv_stop_send "$1"; do
        if [ -z "$said" ]; then
            echo "rv: $RV_STOP_LEAD s before the time limit: no process handles" \
                "$RV_STOP_SIGNAL; the program runs on until the limit" >&2
            date +%s >"$RV_JOB_DIR/stop-node${SLURM_NODEID:-0}"
            said=1
        fi
        read -r -t 5 -u "$rv_nap_fd" || :
    done
}
rv_stop_send() {  # rv_stop_send PID: signal the handlers under PID; fails when there are none
    local bit pid mask sent=""
    bit=$(($(kill -l "$RV_STOP_SIGNAL") - 1))
    for pid in $(ps -e -o pid= -o ppid= | awk -v root="$1" '{ up[$1] = $2 }
        END { for (p in up) { q = p; n = 0; while (q != root && (q in up) && n++ < 64) q = up[q];
              if (q == root) print p } }'); do
        mask="$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$pid/status" 2>/dev/null)"
        [ -n "$mask" ] && (((16#$mask >> bit) & 1)) || continue
        case "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" in
            */torchrun\ * | torchrun\ * | *torch.distributed.run* | */accelerate\ launch* | accelerate\ launch* | *accelerate.commands.launch* | */uv\ run\ * | uv\ run\ *) continue ;;
        esac
        kill -s "$RV_STOP_SIGNAL" "$pid" 2>/dev/null && sent="$sent $pid"
    done
    [ -n "$sent" ] || return 1
    printf '%s%s\n' "$(date +%s)" "$sent" >"$RV_JOB_DIR/stop-node${SLURM_NODEID:-0}"
    echo "rv: $RV_STOP_LEAD s before the time limit: sent $RV_STOP_SIGNAL to pid(s)$sent" \
        "on $(hostname)" >&2
}
export -f rv_task rv_stop_watch rv_stop_deliver rv_stop_send

# --- launch ------------------------------------------------------------------------
# Always an srun step, one task per node. --kill-on-bad-exit: one dead node must not leave
# the others waiting at a collective.
rv_program_ran=1 rv_rc=0
srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c rv_task || rv_rc=$?
exit "$rv_rc"
