#!/bin/bash
#SBATCH --job-name=grpo-2node
#SBATCH --partition=gpu-a6000
#SBATCH --gres=gpu:a6000:2
#SBATCH --time=1-00:00:00
#SBATCH --account=mylab_paid
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --output=/scratch/u/rv/logs/grpo-2node-%j.out
#SBATCH --error=/scratch/u/rv/logs/grpo-2node-%j.err
#SBATCH --open-mode=append
#SBATCH --signal=USR1@300
#
# Written by rv for project proj-1a2b3c, snapshot snap01.
# No `set -x` here: secrets are in this environment. The program's exit code is the job's.

set -euo pipefail

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
export RV_JOB_DIR=/scratch/u/rv/jobs/"$SLURM_JOB_ID"
export RV_WORK_DIR="$RV_JOB_DIR/work"
export RV_OUTPUT_DIR="$RV_JOB_DIR/output"
# Stable across resubmits of the same named run of this project: resume from here.
export RV_CHECKPOINT_DIR=/scratch/u/rv/checkpoints/proj-1a2b3c/grpo-2node
export RV_SNAPSHOT=snap01 RV_PROJECT=proj-1a2b3c RV_RUN_NAME=grpo-2node
export RV_NODES=2 RV_GPUS=4 RV_GPUS_PER_NODE=2
# One port per job (from its id), so two jobs sharing a node never collide.
export MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
# srun does not inherit sbatch's --cpus-per-task (Slurm 22.05+): without this every task
# would be pinned to one CPU.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi
export WANDB_PROJECT=grpo

# --- end of job ------------------------------------------------------------------
# Runs however the script ends (program failed, time limit, scancel): remove the secrets,
# keep the outputs, and leave with the program's exit code.
rv_on_exit() {
    local rc=$?
    set +e
    rm -f -- /scratch/u/rv/secrets/0b1c2d.env
    rv_keep_output runs/exp1
    rv_keep_output model.pt
    echo "rv: job ${SLURM_JOB_ID} ended with exit code $rc"
    exit "$rc"
}
# Copy one -o path from the work dir into $RV_OUTPUT_DIR; a missing one is a warning only.
rv_keep_output() {
    local src="$RV_WORK_DIR/$1" dst="$RV_OUTPUT_DIR/$1"
    if [ ! -e "$src" ] && [ ! -L "$src" ]; then
        echo "rv: warning: output $1 not found in the work dir; nothing copied"
        return 0
    fi
    mkdir -p -- "$(dirname -- "$dst")" && rm -rf -- "$dst" && cp -a -- "$src" "$dst" \
        || echo "rv: warning: could not copy output $1"
}
trap rv_on_exit EXIT
# Time limit and scancel send TERM: leave through the EXIT trap with the usual 128+N code.
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

# --- secrets ---------------------------------------------------------------------
# Uploaded with mode 0600 before sbatch, never written into this script; removed at exit.
if [ -r /scratch/u/rv/secrets/0b1c2d.env ]; then
    set -a; . /scratch/u/rv/secrets/0b1c2d.env; set +a
elif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
    # A requeued run: the previous attempt's exit removed the file.
    echo "rv: warning: secrets file is gone (removed when the previous attempt ended); running without secrets"
else
    echo rv: secrets file /scratch/u/rv/secrets/0b1c2d.env is missing >&2
    exit 1
fi

# --- work dir ----------------------------------------------------------------------
# A hard-link farm of the immutable snapshot: files stay read-only links into the store,
# new files land in this job's own folder. cp -a when the store is on another filesystem.
# A requeued job keeps the work dir it already has.
mkdir -p -- "$RV_OUTPUT_DIR"
if [ ! -d "$RV_WORK_DIR" ]; then
    if [ ! -d /scratch/u/rv/snapshots/snap01 ]; then echo rv: snapshot /scratch/u/rv/snapshots/snap01 not found >&2; exit 1; fi
    rm -rf -- "$RV_WORK_DIR.tmp"
    cp -al -- /scratch/u/rv/snapshots/snap01 "$RV_WORK_DIR.tmp" 2>/dev/null \
        || { rm -rf -- "$RV_WORK_DIR.tmp"; cp -a -- /scratch/u/rv/snapshots/snap01 "$RV_WORK_DIR.tmp"; }
    # Directories only: a chmod on a hard-linked file would change the store's copy too.
    find "$RV_WORK_DIR.tmp" -type d -exec chmod u+w {} +
    mv -- "$RV_WORK_DIR.tmp" "$RV_WORK_DIR"
fi
cd "$RV_WORK_DIR"

# --- setup (rv run --setup), before anything else of the user's ----------------------
# Without nounset: activate scripts and module systems read unset variables.
rv_setup_failed() {
    local rc=$?
    echo "rv: setup line $1 failed with exit code $rc" >&2
    exit "$rc"
}
set +u
{
module load cuda/12.4
} || rv_setup_failed 1
{
source ~/venvs/train/bin/activate
} || rv_setup_failed 2
# --- env build hook ----------------------------------------------------------------
# rv builds the project's environment here (after setup, so setup's modules are loaded).
set -u

# --- GPU and precision -------------------------------------------------------------
# BF16 needs compute capability 8.0 or newer. Ask the GPU; when nvidia-smi is missing or
# prints nothing usable, fall back to the catalog's value for a6000 (8.6).
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

echo "rv: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: 2 node(s) x 2 a6000, cc=${RV_GPU_CC:-unknown} precision=$RV_PRECISION, snapshot $RV_SNAPSHOT"

# --- torchrun signal forwarding ------------------------------------------------------
# torchrun forwards USR1 to its workers only when told to (--signals-to-handle,
# torch 2.9+); an older torchrun refuses the option, so ask this one whether it knows it.
RV_TORCHRUN_SIGNALS=""
rv_help="$(torchrun --help 2>&1)" || true
case "$rv_help" in
    *--signals-to-handle*) RV_TORCHRUN_SIGNALS=--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2 ;;
esac
export RV_TORCHRUN_SIGNALS

# --- the program -------------------------------------------------------------------
# Always an srun step, one task per node: --signal reaches job steps, not the batch shell.
# --kill-on-bad-exit: one dead node must not leave the others waiting at a collective.
# One log per node; the batch log keeps rv's own lines.
rm -f -- "$RV_JOB_DIR"/node*.exit
rv_rc=0
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 \
    --open-mode=append --output=/scratch/u/rv/logs/grpo-2node-%j-node%n.out --error=/scratch/u/rv/logs/grpo-2node-%j-node%n.err \
    bash -c 'trap : USR1 USR2 TERM INT HUP QUIT; torchrun --nnodes=2 --node-rank="$SLURM_NODEID" --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$RV_HEAD_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" ${RV_TORCHRUN_SIGNALS:+"$RV_TORCHRUN_SIGNALS"} --max-restarts=0 train.py --out '"'"'runs/it'"'"'"'"'"'"'"'"'s here'"'"'; rv_rc=$?; printf "%s\n" "$rv_rc" > "$RV_JOB_DIR/node$SLURM_NODEID.exit"; exit "$rv_rc"' \
    || rv_rc=$?
# srun exits with the highest code of all tasks, so the nodes --kill-on-bad-exit stopped
# (143) would hide the one that failed: report the lowest code below 128 a node recorded.
if [ "$rv_rc" -ne 0 ]; then
    rv_first=""
    for rv_f in "$RV_JOB_DIR"/node*.exit; do
        rv_n="$(cat -- "$rv_f" 2>/dev/null)" || continue
        case "$rv_n" in "" | *[!0-9]*) continue ;; esac
        if [ "$rv_n" -gt 0 ] && [ "$rv_n" -lt "${rv_first:-128}" ]; then rv_first="$rv_n"; fi
    done
    rv_rc="${rv_first:-$rv_rc}"
fi
exit "$rv_rc"
