#!/bin/bash
#SBATCH --job-name=prep
#SBATCH --time=02:59:00
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=/scratch/u/rv/runs/run0a1b2/logs/%j.out
#SBATCH --error=/scratch/u/rv/runs/run0a1b2/logs/%j.err
#SBATCH --open-mode=append
#SBATCH --requeue
#
# Written by rv for run prep (run0a1b2) of project proj-1a2b3c,
# snapshot snap01.
# What every job does is rv's job runtime, sourced below: rv/agent/job.sh in rv's source.
# No `set -x`: secrets are in this environment. The program's exit code is the job's.
# shellcheck disable=SC2034,SC1090,SC1091  # values the runtime reads; files only the cluster has
set -euo pipefail
umask 077

# --- this job's values (rv/agent/job.sh lists what each means) ---------------------------
RV_RUN_DIR=/scratch/u/rv/runs/run0a1b2 RV_RUN_ID=run0a1b2 RV_RUN_NAME=prep
RV_PROJECT=proj-1a2b3c RV_SNAPSHOT=snap01 RV_MAX_SEGMENTS=10
# Shared by every run of this name in this project: a run named again resumes from here.
RV_CHECKPOINT_DIR=/scratch/u/rv/checkpoints/proj-1a2b3c/prep
RV_OUTPUT_DIR=/scratch/u/rv/outputs/proj-1a2b3c/prep RV_METRICS=/scratch/u/rv/outputs/proj-1a2b3c/prep/metrics.jsonl
RV_NODES=2 RV_GPUS=0 RV_GPUS_PER_NODE=0
RV_STOP_SIGNAL=USR1 RV_STOP_LEAD=300
rv_cache=/scratch/u/rv/cache rv_store=/scratch/u/rv/store.git
rv_store_prog=/scratch/u/rv/runtime/store-check-e429b27c68a5f56e.py
rv_gpu_type='' rv_gpu_cc=''
rv_secrets=0 rv_labeled=1 rv_launcher=0
rv_outputs=()
rv_exclude='' rv_max_fault_retries=2
rv_stats_prog=/scratch/u/rv/runtime/stats-HASH.py rv_idle_gpu=900
export RV_RANK_LABEL=/scratch/u/rv/runtime/rank-label-HASH.py

rv_runtime=/scratch/u/rv/runtime/job-HASH.sh
[ -r "$rv_runtime" ] || { echo "rv: the job runtime $rv_runtime is missing (a purge of the filesystem?): rv run --name prep sends it again and resumes" >&2; exit 1; }
. "$rv_runtime"
rv_begin

rv_start
# --- the program: each node's task runs it beside rv's stop watcher (job.sh: rv_task)
rv_program() {
    exec "$RV_RANK_LABEL" --exec --label "$SLURM_NODEID" bash prep.sh
}
rv_launch
