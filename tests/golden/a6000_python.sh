#!/bin/bash
#SBATCH --job-name=train
#SBATCH --partition=gpu-a6000
#SBATCH --gres=gpu:a6000:1
#SBATCH --time=02:59:00
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --output=/scratch/u/rv/logs/train-%j.out
#SBATCH --error=/scratch/u/rv/logs/train-%j.err
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
export RV_CHECKPOINT_DIR=/scratch/u/rv/checkpoints/proj-1a2b3c/train
export RV_SNAPSHOT=snap01 RV_PROJECT=proj-1a2b3c RV_RUN_NAME=train
export RV_NODES=1 RV_GPUS=1 RV_GPUS_PER_NODE=1
# One port per job (from its id), so two jobs sharing a node never collide.
export MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))
# srun does not inherit sbatch's --cpus-per-task (Slurm 22.05+): without this every task
# would be pinned to one CPU.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi

# --- end of job ------------------------------------------------------------------
# Runs however the script ends (program failed, time limit, scancel): remove the secrets,
# keep the outputs, and leave with the program's exit code.
rv_on_exit() {
    local rc=$?
    set +e
    echo "rv: job ${SLURM_JOB_ID} ended with exit code $rc"
    exit "$rc"
}
trap rv_on_exit EXIT
# Time limit and scancel send TERM: leave through the EXIT trap with the usual 128+N code.
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

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

echo "rv: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: 1 node(s) x 1 a6000, cc=${RV_GPU_CC:-unknown} precision=$RV_PRECISION, snapshot $RV_SNAPSHOT"

# --- the program -------------------------------------------------------------------
# Always an srun step, one task per node: --signal reaches job steps, not the batch shell.
# --kill-on-bad-exit: one dead node must not leave the others waiting at a collective.
rv_rc=0
srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
    bash -c 'exec python train.py --lr 3e-4' \
    || rv_rc=$?
exit "$rv_rc"
