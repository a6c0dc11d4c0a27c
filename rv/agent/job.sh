# shellcheck shell=bash disable=SC2154
# (SC2154: the batch script sets the job's values, rv_cache and friends, before sourcing this file.)
# rv's job runtime: what every job rv submits does, as one shell file.
#
# Its parts: this file, and beside it job_workdir.sh (the work dir, -o outputs), job_store.sh (git on
# the snapshot store), job_stop.sh (the stop watcher) and job_notify.sh (--notify). rv joins them, in
# that order, into one file (rv.slurm.script.JOB_RUNTIME_PARTS) and ships it into the remote root
# once per content (<root>/runtime/job-<hash>.sh, read-only, written whole): one name hashed over
# every part, so a part changed ships a new file, and no job ever sources one part without the
# others. Each job's batch script (rv.slurm.script: #SBATCH lines, the job's values, the user's setup
# lines and command) sources it. It defines functions and constants only; the batch script calls
#
#   rv_begin      the run and segment, the exit handler, secrets, rv's environment, the work dir
#   (setup)       the user's --setup lines and rv's env-build hook, at the batch script's top level
#   rv_start      GPU and precision, the first node, the job's environment file, the segment's record
#   rv_launch     one srun task per node running rv_task (the program and the stop watcher); exits
#
# A run is a chain of segments, each one Slurm job running the same batch script. The job itself
# keeps the run's records and decides whether the run goes on, so closing the laptop stops nothing:
#
# * Records: seg/<k>.job (the job id, written first), seg/<k>.json (the segment's record, written at
#   its start and rewritten at its end; its fields are rv.agent.segment's), ENDED (the run's end).
# * The end of a segment (EXIT trap): from the program's exit code, the PREEMPTED marker, whether
#   rv sent the stop signal, rv stop's STOP file and what scontrol says (time limit, requeue,
#   preemption), why the segment ended; the next segment is submitted when the program stopped
#   cleanly with progress, otherwise the run ends: ENDED, and no more secrets. rv_end_segment gathers
#   those facts, rv_end_decide decides (no command, no file: unit-tested case by case), rv_end_act acts.
# * No #SBATCH --signal: Slurm's warning signal reaches every process of a step, and Python's
#   default for SIGUSR1 is to die. rv's stop watcher sends RV_STOP_SIGNAL RV_STOP_LEAD seconds before
#   the limit to the program's processes that handle it (never to a torchrun agent), and to none
#   when none does.
#
# The batch script sets, before sourcing (plain variables; rv_begin exports the RV_* ones once the
# submit environment is saved): RV_RUN_DIR RV_RUN_ID RV_RUN_NAME RV_MAX_SEGMENTS RV_CHECKPOINT_DIR
# RV_OUTPUT_DIR RV_METRICS RV_SNAPSHOT RV_PROJECT RV_NODES RV_GPUS RV_GPUS_PER_NODE RV_STOP_SIGNAL
# RV_STOP_LEAD, and rv_cache (the cache root), rv_store (the snapshot store, a git repository),
# rv_store_prog (its repairs and background gc, rv/agent/storecheck.py), rv_gpu_type and rv_gpu_cc
# (the catalog's compute capability: the fallback when nvidia-smi says nothing; both empty for a
# CPU job), rv_secrets (1: the run has a secrets file), rv_labeled (1: ranks' lines are labelled),
# rv_launcher (1: a launcher starts ranks as $PYTHON_EXEC), rv_outputs (array: -o paths),
# RV_RANK_LABEL (the labeller, with rv_labeled), rv_exclude (the user's --exclude, kept when a fault
# excludes more) and rv_max_fault_retries; with --notify, rv_notify_mail (addresses, comma-separated),
# rv_notify_hooks (secret names) and rv_notify_prog (the notifier); with --work-dir node, rv_work_node=1
# and rv_work_base (the profile's folder on each node, or empty). The program is the function rv_program.
#
# A run over several GPU types: the submitter sends one job per type and lists them in
# seg/<k>.candidates ("JOB TYPE" lines); the run folder's `candidates` file names each type's batch
# script. The first of them to start takes the segment (rv_claim) and cancels the others.
#
# Style: no `set -x` anywhere (secrets are in this environment); every variable of rv's own starts
# with rv_ or RV_; every command that can fail before the program runs goes through rv_try, so the
# record says which step failed and why.

# MASTER_PORT = base + job id % span: ports 15000-29999, below Linux's ephemeral range (32768+), so a
# port picked for a job is never one the kernel handed to some client socket.
RV_MASTER_PORT_BASE=15000
RV_MASTER_PORT_SPAN=15000
RV_MARKER=PREEMPTED
RV_JOB_ENV_FILE=env.sh

# --- the start: run, segment, exit handler -------------------------------------------------------

rv_begin() {
    export RV_SEGMENT="${RV_SEGMENT:-1}"
    rv_job_name
    rv_claim
    RV_JOB_DIR="$RV_RUN_DIR/jobs/$rv_job"
    rv_attempt="${SLURM_RESTART_COUNT:-0}"
    rv_started=$(date +%s)
    rv_program_ran=0 rv_got_term=0 rv_failed_at='' rv_exit_code=0 rv_stop_sent=false
    # Without these two folders there is nowhere to write a record: the one step before the handler.
    mkdir -p -- "$RV_JOB_DIR" "$RV_RUN_DIR/seg"
    printf '%s\n' "$rv_job" >"$RV_RUN_DIR/seg/$RV_SEGMENT.job"
    rv_save_submit_env
    export RV_RUN_DIR RV_RUN_ID RV_RUN_NAME RV_MAX_SEGMENTS RV_JOB_DIR RV_CHECKPOINT_DIR RV_OUTPUT_DIR \
        RV_METRICS RV_SNAPSHOT RV_PROJECT RV_NODES RV_GPUS RV_GPUS_PER_NODE RV_STOP_SIGNAL RV_STOP_LEAD
    rv_work_place
    rv_runtime_keep
    # The exit handler is in place before any step that can fail: every end is recorded.
    trap rv_on_exit EXIT
    # scancel and the time limit send TERM; before the program runs that ends the script, after it
    # the script waits for srun to return the program's own exit code.
    trap 'rv_got_term=1; [ "$rv_program_ran" = 1 ] || exit 143' TERM
    trap 'rv_got_term=1; [ "$rv_program_ran" = 1 ] || exit 130' INT
    trap 'rv_got_term=1; [ "$rv_program_ran" = 1 ] || exit 129' HUP
    # rv stop marks the run, then cancels its jobs: one that started in between ends here.
    [ ! -e "$RV_RUN_DIR/STOP" ] || exit 0
    rv_load_secrets
    rv_environment
    rv_try "making the checkpoint and output folders" mkdir -p -- "$RV_CHECKPOINT_DIR" "$RV_OUTPUT_DIR"
    rv_metrics_newline
    rv_work_dir
    cd -- "$RV_WORK_DIR" || rv_fail "cannot enter the work dir $RV_WORK_DIR"
}

# A segment killed while its program wrote a metrics line leaves that line without its newline; the
# next segment's first line would be glued to it, and both lost to a reader. End it first.
rv_metrics_newline() {
    [ -s "$RV_METRICS" ] || return 0
    # $(...) drops a trailing newline: empty means the file already ends with one.
    if [ -n "$(tail -c 1 -- "$RV_METRICS" 2>/dev/null)" ]; then printf '\n' >>"$RV_METRICS" || :; fi
}

# rv_job: the id rv knows this job by, in seg/<k>.job, records, log and folder names. A task of a job
# array (a sweep's point, its first segment) is ARRAY_TASK, as squeue -r, sacct and scancel name it
# and as the array's #SBATCH --output (%A_%a) names its logs; any other job is its own id. (Slurm's
# numeric id of a task, SLURM_JOB_ID, stays right for squeue -j, scontrol and dependencies.)
rv_job_name() {
    if [ -n "${SLURM_ARRAY_JOB_ID:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
        rv_job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    else
        rv_job="$SLURM_JOB_ID"
    fi
}

# A segment submitted once per GPU type is taken by the first of its jobs to start: one atomic symlink,
# seg/<k>.claim -> its job id. The taker cancels the others; a job that starts and finds the segment
# taken ends at once, before anything of the run is touched: the program never runs twice. Slurm may
# requeue the taker: the claim is then its own.
rv_claim() {
    local seg="$RV_RUN_DIR/seg/$RV_SEGMENT" owner others
    [ -e "$seg.candidates" ] || return 0
    if ln -s -- "$rv_job" "$seg.claim" 2>/dev/null; then
        printf '%s\n' "$rv_job" >"$seg.job"
        others="$(awk -v me="$rv_job" '$1 != me { print $1 }' "$seg.candidates")"
        # shellcheck disable=SC2086  # job ids, one word each
        [ -z "$others" ] || scancel $others 2>/dev/null || :
        echo "rv: run $RV_RUN_NAME, segment $RV_SEGMENT: job $rv_job (${rv_gpu_type:-CPU}) started first;" \
            "cancelled the others: ${others//$'\n'/ }"
        return 0
    fi
    owner="$(readlink -- "$seg.claim")" || owner=""
    [ "$owner" != "$rv_job" ] || return 0
    echo "rv: run $RV_RUN_NAME, segment $RV_SEGMENT runs as job ${owner:-?}: this copy" \
        "(job $rv_job, ${rv_gpu_type:-CPU}) ends without running the program"
    exit 0
}

# Variables Slurm sets per job: the saved submit environment leaves them out, or the next segment
# would inherit this one's (srun refuses SLURM_MEM_PER_CPU and SLURM_MEM_PER_NODE together).
rv_save_submit_env() {
    # The environment the run was submitted with, saved once before rv adds to it (no secrets yet):
    # later segments are submitted with exactly this.
    [ ! -e "$RV_RUN_DIR/submit.env" ] || return 0
    local v
    {
        for v in $(compgen -e); do
            case "$v" in
                SLURM_CONF) ;;
                SLURM_* | SLURMD_* | CUDA_VISIBLE_DEVICES | GPU_DEVICE_ORDINAL | ROCR_VISIBLE_DEVICES | \
                    ENVIRONMENT | RV_SEGMENT | PWD | OLDPWD | SHLVL | _) continue ;;
            esac
            declare -p "$v"
        done
        declare -fx
    } >"$RV_RUN_DIR/submit.env.tmp"
    mv -f -- "$RV_RUN_DIR/submit.env.tmp" "$RV_RUN_DIR/submit.env"
}

# The runtime files this job uses, kept in memory: a scratch filesystem's purge may delete them while
# the run goes on (each segment reads them once, at its start), and the segment that submits the next
# one writes them again when they are gone (rv_runtime_mend), as they were.
rv_runtime_keep() {
    local f
    rv_runtime_files=("${rv_runtime:-}" "${RV_RANK_LABEL:-}" "${rv_notify_prog:-}" "${rv_store_prog:-}"
        "${rv_stats_prog:-}")
    rv_runtime_texts=()
    for f in "${rv_runtime_files[@]}"; do
        if [ -n "$f" ]; then rv_runtime_texts+=("$(cat -- "$f" 2>/dev/null)"); else rv_runtime_texts+=(''); fi
    done
}

rv_runtime_mend() {
    local i f mode
    for i in "${!rv_runtime_files[@]}"; do
        f="${rv_runtime_files[i]}"
        if [ -z "$f" ] || [ -e "$f" ]; then continue; fi
        if [ -z "${rv_runtime_texts[i]}" ]; then
            printf "rv's runtime file %s is gone (a purge of the filesystem?): \`rv run --name %s\` resumes" \
                "$f" "$RV_RUN_NAME"
            return 1
        fi
        echo "rv: rv's runtime file $f was deleted (a purge of the filesystem?): written again for the" \
            "next segment" >&2
        case "$f" in *.py) mode=500 ;; *) mode=400 ;; esac
        { mkdir -p -- "$(dirname -- "$f")" && printf '%s\n' "${rv_runtime_texts[i]}" >"$f.tmp.$$" \
            && chmod "$mode" -- "$f.tmp.$$" && mv -f -- "$f.tmp.$$" "$f"; } 2>/dev/null || {
            printf "rv's runtime file %s is gone and could not be written again" "$f"
            return 1
        }
    done
}

# rv_try WHAT COMMAND...: run a step before the program; on failure record WHAT and its error, exit.
# The command runs in a subshell (its output is captured): never one that must change this shell.
rv_try() {
    local what="$1" out rc=0
    shift
    out="$("$@" 2>&1)" || rc=$?
    [ -z "$out" ] || printf '%s\n' "$out" >&2
    if [ "$rc" != 0 ]; then
        out="${out//$'\n'/ }"
        rv_failed_at="$what: ${out:-exit code $rc}"
        echo "rv: $rv_failed_at" >&2
        exit 1
    fi
}

# rv_fail WHAT...: a step found something wrong (no command to blame): record it and exit.
rv_fail() {  # (the words of several arguments are joined by spaces)
    rv_failed_at="$*"
    echo "rv: $rv_failed_at" >&2
    exit 1
}

# --- secrets -------------------------------------------------------------------------------------

# Uploaded with mode 0600 before sbatch, never written into any script; present in every segment and
# requeue, removed when the run ends. rv's own variables and the ones that run the job cannot be
# secrets (rv env refuses them): one that slipped through (a secrets file edited by hand) is ignored
# with a warning, so a secret never overrides what rv sets.
rv_load_secrets() {
    [ "${rv_secrets:-0}" = 1 ] || return 0
    [ -r "$RV_RUN_DIR/secrets.env" ] || rv_fail "the secrets file $RV_RUN_DIR/secrets.env is missing"
    local line name
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in export\ *=*) ;; *) continue ;; esac
        name="${line#export }"
        name="${name%%=*}"
        if rv_reserved_name "$name"; then
            echo "rv: warning: secret $name ignored: rv, Slurm or the job's shell own that name" >&2
        fi
    done <"$RV_RUN_DIR/secrets.env"
    local saved
    saved="$(rv_reserved_state)"
    set -a
    # shellcheck disable=SC1091  # written by rv at submission
    . "$RV_RUN_DIR/secrets.env" || rv_fail "the secrets file $RV_RUN_DIR/secrets.env could not be read"
    set +a
    rv_unset_reserved
    eval "$saved"
}

# rv_reserved_name NAME: true for names rv or Slurm own and the ones that run the job: rv.secrets's
# RESERVED (a unit test keeps the two equal), and rv_* (this file's own).
rv_reserved_name() {
    case "$1" in
        RV_* | SLURM_* | SLURMD_* | SRUN_* | SBATCH_* | SALLOC_* | SQUEUE_* | SACCT_* | SINFO_* | \
            PMI_* | PMIX_* | MASTER_ADDR | MASTER_PORT | WORLD_SIZE | RANK | LOCAL_RANK | \
            LOCAL_WORLD_SIZE | NODE_RANK | GROUP_RANK | ROLE_RANK | TORCHELASTIC_* | \
            ACCELERATE_MIXED_PRECISION | CUDA_VISIBLE_DEVICES | ROCR_VISIBLE_DEVICES | \
            HIP_VISIBLE_DEVICES | GPU_DEVICE_ORDINAL | PATH | HOME | USER | LOGNAME | SHELL | PWD | \
            OLDPWD | TMPDIR | IFS | ENV | BASH_ENV | BASHOPTS | SHELLOPTS | CDPATH | GLOBIGNORE | \
            PS4 | _ | LD_* | PYTHON* | VIRTUAL_ENV | rv_*)
            return 0 ;;
    esac
    return 1
}

# The reserved variables now set, as `declare` lines that set them again (global, exported as now).
rv_reserved_state() {
    local v
    for v in $(compgen -v); do
        if ! rv_reserved_name "$v" || rv_shell_own "$v"; then continue; fi
        declare -p "$v" 2>/dev/null | sed '1s/^declare /declare -g /'
    done
}

# Variables bash itself keeps (read-only, or rewritten by every command): never saved or unset.
rv_shell_own() {
    case "$1" in
        BASH_ENV) return 1 ;;
        BASH | BASH_* | BASHOPTS | SHELLOPTS | UID | EUID | PPID | FUNCNAME | _) return 0 ;;
    esac
    return 1
}

rv_unset_reserved() {
    local v
    for v in $(compgen -v); do
        if ! rv_reserved_name "$v" || rv_shell_own "$v"; then continue; fi
        case "$v" in rv_*) continue ;; esac
        unset "$v" 2>/dev/null || :
    done
}

# --- rv's environment ----------------------------------------------------------------------------

rv_environment() {
    # Unbuffered, or logs arrive minutes late.
    export PYTHONUNBUFFERED=1 SLURM_UNBUFFEREDIO=1
    # Caches on scratch: the home quota fills up. A value already set by the user wins.
    export HF_HOME="${HF_HOME:-$rv_cache/hf}"
    export TORCH_HOME="${TORCH_HOME:-$rv_cache/torch}"
    export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$rv_cache/triton}"
    export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$rv_cache/pip}"
    export WANDB_DIR="${WANDB_DIR:-$rv_cache/wandb}"
    export WANDB_CACHE_DIR="${WANDB_CACHE_DIR:-$rv_cache/wandb/cache}"
    export WANDB_DATA_DIR="${WANDB_DATA_DIR:-$rv_cache/wandb/data}"
    export XDG_CACHE_HOME="${XDG_CACHE_HOME:-$rv_cache/xdg}"
    export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$rv_cache/xdg/nv}"  # CUDA's JIT cache defaults to ~/.nv
    # One port per job (from its id), so two jobs sharing a node never collide.
    export MASTER_PORT=$((RV_MASTER_PORT_BASE + SLURM_JOB_ID % RV_MASTER_PORT_SPAN))
    # srun does not inherit sbatch's --cpus-per-task (Slurm 22.05+): without this every task would
    # be pinned to one CPU.
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi
}

# --- records -------------------------------------------------------------------------------------

# JSON values from shell words: a string without quotes, backslashes or control characters; a
# number or null; a string or null.
rv_jstr() {
    local v=${1//[\"\\]/}
    v=${v//[$'\t\r\n']/ }
    printf '"%s"' "$v"
}
rv_jnum() { case "$1" in '' | *[!0-9]*) printf null ;; *) printf %s "$1" ;; esac; }
rv_jopt() { if [ -n "$1" ]; then rv_jstr "$1"; else printf null; fi; }

# seg/<k>.json: this segment's record (rv.agent.segment names the fields), written at its start and
# rewritten at its end (write, then rename). `rv ps -a` and `rv logs` read it where there is no sacct.
rv_record() {  # rv_record STATE REASON EXIT_CODE CHECKPOINT_STEP NEXT_JOB_ID
    local f="$RV_RUN_DIR/seg/$RV_SEGMENT.json"
    {
        printf '{"segment": %s, "job_id": %s, "attempt": %s, "nodes": %s, ' \
            "$RV_SEGMENT" "$(rv_jstr "$rv_job")" "$rv_attempt" "$(rv_jstr "${SLURM_JOB_NODELIST:-}")"
        printf '"start": %s, "end": %s, "state": %s, "reason": %s, "exit_code": %s, ' \
            "$rv_started" "$(rv_jnum "${rv_ended:-}")" "$(rv_jstr "$1")" "$(rv_jstr "$2")" "$(rv_jnum "$3")"
        printf '"start_step": %s, "checkpoint_step": %s, "stop_sent": %s, "next_job_id": %s, ' \
            "$(rv_jnum "${rv_start_step:-}")" "$(rv_jnum "$4")" "${rv_stop_sent:-false}" "$(rv_jopt "$5")"
        printf '"gpu_type": %s}\n' "$(rv_jstr "${rv_gpu_type:-}")"
    } >"$f.tmp" && mv -f -- "$f.tmp" "$f"
}

# The newest complete checkpoint in rv_train's layout (step_<N>/COMPLETE), if that is the layout.
rv_ckpt_step() {
    local d n best=''
    for d in "$RV_CHECKPOINT_DIR"/step_*/COMPLETE; do
        [ -e "$d" ] || continue
        n="${d%/COMPLETE}"
        n="${n##*/step_}"
        n="${n#"${n%%[!0]*}"}"
        n="${n:-0}"
        case "$n" in *[!0-9]*) continue ;; esac
        if [ -z "$best" ] || [ "$n" -gt "$best" ]; then best="$n"; fi
    done
    printf %s "$best"
}

# What a checkpoint folder holds, as one line: tells progress when a marker names no step.
rv_ckpt_print() {
    find "$RV_CHECKPOINT_DIR" -path "$RV_CHECKPOINT_DIR/$RV_MARKER" -prune -o -printf '%P %s %T@\n' \
        2>/dev/null | sort | cksum
}

# --- the end of a segment ------------------------------------------------------------------------

# Runs however the script ends: the program finished, crashed or stopped, the time limit, scancel,
# rv stop, a requeue, a step before the program failed. Why this segment ended, whether the run goes
# on (in a new job: a requeue would wait about two minutes to start again), and the run's end.
rv_on_exit() {
    local rc=$?
    trap '' TERM INT HUP  # Slurm keeps signalling: finish the records first
    set +eu
    rm -f -- "$RV_JOB_DIR/$RV_JOB_ENV_FILE"  # it holds the secrets: gone with the job
    rv_end_segment "$rc"
    exit "$rv_exit_code"
}

# The next segment: same scripts, same run, submitted with the environment segment 1 had, after this
# job (afterany). A run over several GPU types submits one job per type again. $1: nodes to exclude
# (a fault's, with the user's own), or nothing. Prints the first job's id, or why it failed.
rv_submit_next() {
    local exclude="${1:-}" scripts=() types=() ids=() script type out next=$((RV_SEGMENT + 1)) i
    rv_runtime_mend || return 1
    # sbatch starts the next job where it was submitted: never in this job's work dir, which a node
    # work dir removes at this segment's end (slurmstepd: "couldn't chdir to ...").
    cd -- "$RV_RUN_DIR" || { printf 'cannot enter the run folder %s' "$RV_RUN_DIR"; return 1; }
    if [ -e "$RV_RUN_DIR/candidates" ]; then
        while read -r script type; do
            scripts+=("$script")
            types+=("$type")
        done <"$RV_RUN_DIR/candidates"
    else
        scripts=(job.sbatch)
        types=("${rv_gpu_type:-}")
    fi
    for script in "${scripts[@]}"; do
        # shellcheck disable=SC2016  # expanded by the inner shell
        out="$(env -i "$BASH" -c 'set -a; . "$1" || exit 1; set +a; export RV_SEGMENT="$2"; '\
'exec sbatch --parsable --dependency=afterany:"$3" --kill-on-invalid-dep=yes ${5:+"--exclude=$5"} "$4"' \
            rv "$RV_RUN_DIR/submit.env" "$next" "$SLURM_JOB_ID" "$RV_RUN_DIR/$script" "$exclude" 2>&1)" || {
            # One type refused: the ones already queued go too, or they would run without a record.
            [ "${#ids[@]}" = 0 ] || scancel "${ids[@]}" 2>/dev/null
            printf '%s' "$out" | tail -n 2 | tr '\n' ' '
            return 1
        }
        out="${out##*$'\n'}"
        ids+=("${out%%;*}")
    done
    if [ "${#ids[@]}" -gt 1 ]; then
        for i in "${!ids[@]}"; do printf '%s %s\n' "${ids[i]}" "${types[i]}"; done >"$RV_RUN_DIR/seg/$next.candidates"
    fi
    printf '%s\n' "${ids[0]}" >"$RV_RUN_DIR/seg/$next.job"
    # rv stop writes STOP before it cancels what it finds: look again now that these jobs exist.
    if [ -e "$RV_RUN_DIR/STOP" ]; then
        scancel "${ids[@]}" 2>/dev/null
        printf 'cancelled by rv stop'
        return 1
    fi
    printf '%s' "${ids[0]}"
}

# Known last words of a GPU or node that failed under the program (not of a program's own bug):
# extended regular expressions, matched without case in the last lines of the segment's logs.
RV_FAULT_PATTERNS='GPU has fallen off the bus|CUDA error: unknown error|uncorrectable ECC error|'\
'NCCL.*unhandled system error|CUDA-capable device\(s\) is/are busy or unavailable'

# rv_fault: when this segment ended on a GPU or node fault, prints "NODE<tab>WHAT" (the node's Slurm
# name; WHAT: the line that says so, or Slurm's word) and succeeds.
rv_fault() {
    local f line node nodes=() i
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null)
    for f in "$RV_RUN_DIR/logs/$rv_job".out "$RV_RUN_DIR/logs/$rv_job".err \
        "$RV_RUN_DIR/logs/$rv_job"-node*.out "$RV_RUN_DIR/logs/$rv_job"-node*.err; do
        [ -f "$f" ] || continue
        # The message itself, with what precedes it on its line ("RuntimeError: "), never what follows:
        # another process's output may share the line (Python writes a line and its end apart).
        line="$(tail -n 50 -- "$f" 2>/dev/null | grep -E -i -o -m 1 -- ".{0,60}($RV_FAULT_PATTERNS)" |
            sed -n 1p)" || continue
        [ -n "$line" ] || continue
        node="${SLURMD_NODENAME:-${nodes[0]:-$(hostname)}}"
        case "$f" in
            *-node*)
                i="${f##*-node}"
                i="${i%.*}"
                node="${nodes[i]:-$node}"
                ;;
        esac
        line="${line#\[*\] }"  # a rank's label
        printf '%s\t%s\n' "$node" "${line:0:200}"
        return 0
    done
    # A node of the job that Slurm itself now says is down or failing.
    node="$(sinfo -h -N -n "$SLURM_JOB_NODELIST" -t down,drain,fail,failing,no_respond -o %N 2>/dev/null |
        sed -n 1p)"
    if [ -n "$node" ]; then
        printf '%s\t%s\n' "$node" "Slurm marks the node down or failing"
        return 0
    fi
    return 1
}

# The nodes to exclude after a fault on $1: the user's own --exclude, every earlier fault's, and $1.
rv_excluded_with() {
    {
        [ -z "${rv_exclude:-}" ] || printf '%s\n' "${rv_exclude//,/$'\n'}"
        [ ! -e "$RV_RUN_DIR/faults" ] || cut -f 2 "$RV_RUN_DIR/faults"
        printf '%s\n' "$1"
    } | sort -u | paste -s -d, -
}

# rv_end_decide: why this segment ended and what comes next, from the facts alone (no command, no
# file: a unit test runs it on each case, tests/unit/test_end_decide.py). The shell gathers the
# facts (rv_end_segment) and acts. Facts, in variables: f_requeued f_stop f_ran f_marker f_step
# f_start_step f_same_print f_stop_sent f_limit f_preempted f_term f_rc f_failed_at f_segment f_max
# f_fault f_fault_node f_fault_what f_faults f_max_faults (1/0 flags, f_stop_sent true/false; the rest
# words or numbers, "" when unknown).
# Sets rv_go (requeue: Slurm runs this job again; end: the run ends; next: submit the next segment;
# fault: submit it without f_fault_node), rv_why (the reason; when a segment is submitted, the
# reason if it is) and rv_fail_why (the reason, less ": <sbatch's words>", if it is not).
rv_end_decide() {
    rv_go=end rv_why="" rv_fail_why=""
    if [ "$f_requeued" = 1 ]; then
        rv_go=requeue rv_why="requeued by Slurm"
    elif [ "$f_stop" = 1 ]; then
        rv_why="cancelled by rv stop"
    elif [ "$f_ran" = 1 ] && [ "$f_marker" = 1 ]; then
        # The program stopped cleanly: it saved and wrote the marker.
        if [ "$f_stop_sent" = true ] || [ "$f_limit" = 1 ]; then
            rv_why="stopped at time limit"
        elif [ "$f_preempted" = 1 ]; then
            rv_why="preempted"
        elif [ "$f_term" = 1 ]; then
            rv_why="cancelled"
            return
        else
            rv_why="stopped"
        fi
        if [ -n "$f_step" ] && [ -n "$f_start_step" ] && [ "$f_step" -le "$f_start_step" ]; then
            rv_why="$rv_why with no progress (step $f_step, as when it started): not continued"
        elif [ -z "$f_step" ] && [ "$f_same_print" = 1 ]; then
            rv_why="$rv_why with nothing new in the checkpoint folder: not continued"
        elif [ "$f_segment" -ge "$f_max" ]; then
            rv_why="$rv_why; all $f_max segments used (--max-segments)"
        else
            rv_go=next rv_fail_why="$rv_why; the next segment could not be submitted"
        fi
    elif [ "$f_limit" = 1 ]; then
        rv_why="time limit"
    elif [ "$f_preempted" = 1 ]; then
        rv_why="preempted"
    elif [ "$f_term" = 1 ]; then
        rv_why="cancelled"
    elif [ "$f_ran" = 0 ]; then
        rv_why="failed before the program started: ${f_failed_at:-exit code $f_rc}"
    elif [ "$f_rc" = 0 ]; then
        rv_why="finished"
    elif [ "$f_fault" = 1 ]; then
        # A GPU or node gave out under the program: another node will do, from the newest checkpoint
        # (the program resumes as it would after a stop), a bounded number of times per run.
        local why="gpu fault on $f_fault_node ($f_fault_what)"
        if [ "$f_faults" -ge "$f_max_faults" ]; then
            rv_why="crashed: $why; no fault retries left (--max-fault-retries $f_max_faults)"
        elif [ "$f_segment" -ge "$f_max" ]; then
            rv_why="crashed: $why; all $f_max segments used (--max-segments)"
        else
            rv_go=fault rv_fail_why="crashed: $why; the next segment could not be submitted"
            rv_why="$why: continued without $f_fault_node (fault retry $((f_faults + 1))/$f_max_faults)"
        fi
    else
        rv_why="crashed"
    fi
}

# The end of a segment: the facts (what scontrol says, the markers, the program's exit code, a fault),
# rv_end_decide's decision, then the records, the next segment or the run's end.
rv_end_segment() {
    local rc="$1" slurm f fault="" step="" f_requeued=0 f_stop=0 f_marker=0 f_same_print=0
    local f_limit=0 f_preempted=0 f_fault=0 f_fault_node="" f_fault_what="" f_faults=0
    rv_ended=$(date +%s)
    rv_work_deletions
    slurm=" $(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null) "
    f="$(printf '%s' "$slurm" | sed -n 's/.* Restarts=\([0-9]*\) .*/\1/p')"
    if [ "${f:-0}" -gt "$rv_attempt" ]; then
        # Slurm runs this job again (node failure, preemption, scontrol requeue): same job id, same
        # segment. Keep the secrets and the work dir for it.
        f_requeued=1
    else
        for f in "$RV_JOB_DIR"/stop-node*; do
            [ -e "$f" ] || continue
            case "$(cat -- "$f")" in *' '*) rv_stop_sent=true ;; esac
        done
        case "$slurm" in *" Reason=TimeLimit "*) f_limit=1 ;; esac
        case "$slurm" in *PREEMPT*) f_preempted=1 ;; esac
        [ ! -e "$RV_RUN_DIR/STOP" ] || f_stop=1
        f="$RV_CHECKPOINT_DIR/$RV_MARKER"
        if [ "$f_stop" = 0 ] && [ "$rv_program_ran" = 1 ] && [ -e "$f" ]; then
            # Its own marker (moved aside before it started): the step it names, if any.
            f_marker=1
            step="$(sed -n '1s/^[[:space:]]*\([0-9][0-9]*\)[[:space:]]*$/\1/p; '\
's/.*"step"[[:space:]]*:[[:space:]]*\([0-9][0-9]*\).*/\1/p' "$f" | sed -n 1p)"
            [ -n "$step" ] || [ "$(rv_ckpt_print)" != "$rv_start_print" ] || f_same_print=1
        elif [ "$f_stop$f_limit$f_preempted${rv_got_term:-0}" = 0000 ] && [ "$rv_program_ran" = 1 ] &&
            [ "$rc" != 0 ] && fault="$(rv_fault)"; then
            f_fault=1 f_fault_node="${fault%%$'\t'*}" f_fault_what="${fault#*$'\t'}"
            [ ! -e "$RV_RUN_DIR/faults" ] || f_faults="$(wc -l <"$RV_RUN_DIR/faults")"
        fi
    fi
    local f_ran="$rv_program_ran" f_step="$step" f_start_step="${rv_start_step:-}" f_stop_sent="$rv_stop_sent"
    local f_term="$rv_got_term" f_rc="$rc" f_failed_at="${rv_failed_at:-}" f_segment="$RV_SEGMENT"
    local f_max="$RV_MAX_SEGMENTS" f_max_faults="${rv_max_fault_retries:-0}"
    rv_end_decide
    rv_end_act "$rc" "$step"
}

# Acts on rv_end_decide's decision: $1 the program's exit code, $2 the checkpoint's step (the fault's
# node and line: rv_end_segment's f_fault_node and f_fault_what).
rv_end_act() {
    local rc="$1" step="$2" next="" over=1 exclude=""
    rv_exit_code="$rc"
    if [ "$rv_go" = requeue ]; then
        rv_record requeued "$rv_why" "$rc" "" ""
        [ "${rv_work_node:-0}" != 1 ] || rv_node_work_end
        return
    fi
    if [ "$rv_go" = next ] || [ "$rv_go" = fault ]; then
        [ "$rv_go" != fault ] || exclude="$(rv_excluded_with "$f_fault_node")"
        if next="$(rv_submit_next "$exclude")"; then
            [ "$rv_go" != fault ] ||
                printf '%s\t%s\t%s\n' "$RV_SEGMENT" "$f_fault_node" "$f_fault_what" >>"$RV_RUN_DIR/faults"
            over=0
        else
            rv_why="$rv_fail_why: $next"
            next=""
        fi
    fi
    rv_record ended "$rv_why" "$rc" "$step" "$next"
    if [ "$rv_program_ran" = 1 ]; then rv_keep_outputs; fi
    # Before the run's end is written: whoever waits for it finds the node's disk freed.
    [ "${rv_work_node:-0}" != 1 ] || rv_node_work_end
    if [ "$over" = 1 ]; then
        # The run's own exit code: 0 only when the program finished.
        local code="$rc"
        if [ "$rv_why" != finished ] && [ "$code" = 0 ]; then code=1; fi
        printf '{"reason": %s, "exit_code": %s, "segment": %s, "end": %s}\n' \
            "$(rv_jstr "$rv_why")" "$code" "$RV_SEGMENT" "$rv_ended" >"$RV_RUN_DIR/ENDED.tmp" \
            && mv -f -- "$RV_RUN_DIR/ENDED.tmp" "$RV_RUN_DIR/ENDED"
        echo "rv: run $RV_RUN_NAME ended after segment $RV_SEGMENT: $rv_why (exit code $code)"
        rv_notify_end
        rm -f -- "$RV_RUN_DIR/secrets.env"
    else
        echo "rv: run $RV_RUN_NAME $rv_why${step:+ at step $step}; segment $((RV_SEGMENT + 1)) is job $next"
    fi
}

# --- setup lines ---------------------------------------------------------------------------------

rv_setup_failed() {  # rv_setup_failed WHICH (called right after the line failed: $? is its code)
    local rc=$?
    rv_failed_at="setup line $1 failed with exit code $rc"
    echo "rv: $rv_failed_at" >&2
    exit "$rc"
}

# --- the segment's start: GPU, first node, the job's environment, the record ---------------------

rv_start() {
    rv_precision
    rv_head_node
    rv_save_env || echo "rv: warning: could not save the job's environment (rv ssh, rv up)" >&2
    # A marker left by an earlier segment is moved aside: one found after the program ends is then
    # this segment's own. Where the run starts from is remembered, to tell progress.
    if [ -e "$RV_CHECKPOINT_DIR/$RV_MARKER" ]; then
        rv_try "moving the last segment's $RV_MARKER aside" \
            mv -f -- "$RV_CHECKPOINT_DIR/$RV_MARKER" "$RV_JOB_DIR/$RV_MARKER.before"
    fi
    rv_start_step="$(rv_ckpt_step)"
    if [ -z "$rv_start_step" ] && [ "$RV_SEGMENT" -gt 1 ]; then
        rv_start_step="$(sed -n 's/.*"checkpoint_step": \([0-9][0-9]*\).*/\1/p' \
            "$RV_RUN_DIR/seg/$((RV_SEGMENT - 1)).json" 2>/dev/null || true)"
    fi
    rv_start_print="$(rv_ckpt_print)"
    rv_record running "" "" "" ""
    local what gpu=''
    if [ -n "$rv_gpu_type" ]; then
        what="$RV_NODES node(s) x $RV_GPUS_PER_NODE $rv_gpu_type"
        gpu=", cc=${RV_GPU_CC:-unknown} precision=$RV_PRECISION"
    else
        what="$RV_NODES node(s), CPU only"
    fi
    echo "rv: run $RV_RUN_NAME, segment $RV_SEGMENT/$RV_MAX_SEGMENTS: job $rv_job on" \
        "$SLURM_JOB_NODELIST, $what$gpu, snapshot $RV_SNAPSHOT${rv_start_step:+, from step $rv_start_step}"
    rv_notify_started
}

# BF16 needs compute capability 8.0 or newer. Ask the GPU; when nvidia-smi is missing or prints
# nothing usable, fall back to the catalog's value for the type (rv_gpu_cc, maybe unknown: fp16).
rv_precision() {
    if [ -z "$rv_gpu_type" ]; then
        # A CPU-only job: no mixed precision ("no" is accelerate's word for it); no RV_GPU_* set.
        export RV_PRECISION=no ACCELERATE_MIXED_PRECISION=no
        return
    fi
    RV_GPU_CC="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
        | sed -n 1p | tr -d '[:space:]')" || RV_GPU_CC=""
    case "$RV_GPU_CC" in
        [0-9].[0-9] | [0-9][0-9].[0-9]) ;;
        *) RV_GPU_CC="$rv_gpu_cc" ;;
    esac
    if [ -n "$RV_GPU_CC" ] && [ "${RV_GPU_CC%%.*}" -ge 8 ]; then RV_PRECISION=bf16; else RV_PRECISION=fp16; fi
    export RV_GPU_TYPE="$rv_gpu_type" RV_GPU_CC RV_PRECISION
    export ACCELERATE_MIXED_PRECISION="$RV_PRECISION"
}

# The first node hosts the rendezvous. Node names need not resolve as host names, so use its
# NodeAddr as Slurm knows it (on most clusters that is the host name).
rv_head_node() {
    RV_HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)" || RV_HEAD_NODE=""
    RV_HEAD_NODE="${RV_HEAD_NODE:-$(hostname)}"
    RV_HEAD_ADDR="$(scontrol show node "$RV_HEAD_NODE" 2>/dev/null \
        | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | sed -n 1p)" || RV_HEAD_ADDR=""
    export RV_HEAD_NODE RV_HEAD_ADDR="${RV_HEAD_ADDR:-$RV_HEAD_NODE}"
    export MASTER_ADDR="$RV_HEAD_ADDR"
}

# What the program gets (exported variables and functions, less Slurm's per-step ones) and where it
# starts, as a file: `rv ssh` and `rv up` start their shells from it, so setup lines, the env-build
# hook, secrets, RV_* and caches reach them by this one path. 0600 (it holds the secrets) and removed
# when the job ends. An interactive shell reads ~/.bashrc first. Left out: what Slurm sets per job
# and per step (an attached shell is a step of its own), the attaching user's terminal, display and
# connection, PS1 (a venv's activate may export its prompt), and HOSTNAME (the first node's).
rv_save_env() {
    local f="$RV_JOB_DIR/$RV_JOB_ENV_FILE" v
    (
        umask 077
        {
            echo '# rv: the environment of the program of this job (rv ssh, rv up)'
            # shellcheck disable=SC2016  # written for the attaching shell to expand
            echo 'case $- in *i*) [ -r ~/.bashrc ] && . ~/.bashrc ;; esac'
            for v in $(compgen -e); do
                case "$v" in
                    SLURM_* | SLURMD_* | PMI_* | PMIX_* | CUDA_VISIBLE_DEVICES | GPU_DEVICE_ORDINAL | \
                        ROCR_VISIBLE_DEVICES | ENVIRONMENT | PWD | OLDPWD | SHLVL | _ | TERM | SSH_* | \
                        DISPLAY | HOSTNAME | PS1 | BASH_FUNC_*) continue ;;
                esac
                [ -n "${!v+x}" ] || continue
                printf 'export %s=%q\n' "$v" "${!v}"
            done
            declare -fx
            printf 'cd -- %q\n' "$PWD"
            # shellcheck disable=SC2016  # written for the attaching shell to expand
            echo 'case $- in *i*) PS1="(rv $RV_RUN_NAME) $PS1" ;; esac'
        } >"$f.tmp" && mv -f -- "$f.tmp" "$f"
    )
}

# --- the program, on each node -------------------------------------------------------------------

# Processes that forward signals to workers rather than act on them: the stop signal goes straight
# to the workers, so the launcher sees them exit 0 and exits 0 itself (torchrun's agent dies on USR1
# and prints a traceback on TERM).
rv_is_launcher() {
    case "$1" in
        */torchrun\ * | torchrun\ * | *torch.distributed.run* | */accelerate\ launch* | accelerate\ launch* | \
            *accelerate.commands.launch* | */uv\ run\ * | uv\ run\ *) return 0 ;;
    esac
    return 1
}

# Each srun task (one per node) runs rv_task LABELED LAUNCHER JOB: the program in the background and rv's
# stop watcher beside it. (A task is a new shell: it sees exported variables and functions only.)
rv_task() {
    export -n -f rv_task rv_stop_watch rv_stop_deliver rv_stop_send rv_is_launcher rv_program rv_measured  # not the program's
    local rv_labeled="$1" rv_launcher="$2" rv_job="$3" rv_task_own_dir=''
    if [ "${rv_work_node:-0}" = 1 ]; then rv_task_work_dir || return 1; fi
    if [ "$rv_labeled" = 1 ]; then
        # The labeller appends to this node's log files (a one-node srun's stdout is a pipe).
        local log="$RV_RUN_DIR/logs/$rv_job"
        [ "$RV_NODES" -le 1 ] || log="$log-node$SLURM_NODEID"
        export RV_LOG_OUT="$log.out" RV_LOG_ERR="$log.err"
        if [ "$rv_launcher" = 1 ]; then
            # torchrun runs each rank as $PYTHON_EXEC -u ...: the labeller, then the real Python.
            export RV_PYTHON_EXEC="${PYTHON_EXEC:-}" PYTHON_EXEC="$RV_RANK_LABEL"
        fi
    fi
    if [ "$rv_launcher" = 1 ] && [ "${SLURM_NODEID:-0}" != 0 ] && [ "${RV_GPUS_PER_NODE:-0}" -gt 1 ] &&
        [ -z "${OMP_NUM_THREADS+set}" ]; then
        # torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset, and prints a banner saying
        # so on every node: the same value set here on the other nodes leaves the first node's banner.
        export OMP_NUM_THREADS=1
    fi
    # `trap -`: a background job of a script would otherwise ignore INT and QUIT.
    (
        trap - INT QUIT
        rv_measured
        rv_program
    ) &
    local program=$! watcher rc
    rv_stop_watch "$program" &
    watcher=$!
    # Slurm's own signals reach the program directly; this shell only waits for its exit code.
    trap : TERM INT HUP USR1 USR2 QUIT
    while :; do
        wait "$program"
        rc=$?
        kill -0 "$program" 2>/dev/null || break
    done
    # KILL, not TERM: the watcher has nothing to finish, and a TERM trap of bash 5.2 was seen lost
    # under load (the watcher lived on, and this wait with it).
    kill -KILL "$watcher" 2>/dev/null
    wait "$watcher" 2>/dev/null || :
    if [ "$RV_NODES" -gt 1 ]; then printf '%s\n' "$rc" >"$RV_JOB_DIR/node$SLURM_NODEID.exit"; fi
    # Another node's work dir: only the first node's changes are kept (rv_node_work_end), as rv run
    # said before the run; what this node's program changed there is named as it goes.
    if [ -n "$rv_task_own_dir" ]; then
        rv_task_dropped
        rm -rf -- "$rv_task_own_dir" 2>/dev/null || :
    fi
    return "$rc"
}

rv_task_dropped() {  # in another node's task: say how many changes of its work dir are not kept
    local git=(rv_git "$RV_WORK_DIR.index" -C "$RV_WORK_DIR" --work-tree="$RV_WORK_DIR") n
    n="$({ "${git[@]}" diff-files -z --name-only && "${git[@]}" ls-files -z --others --directory; } |
        tr -cd '\0' | wc -c)" || return 0
    [ "${n:-0}" -gt 0 ] || return 0
    echo "rv: warning: node $SLURM_NODEID ($(hostname)): $n file(s) and folder(s) its program created," \
        "changed or deleted in its work dir are not kept (--work-dir node keeps the first node's)" >&2
}

# The program under rv's meter (rv/agent/stats.py: its CPU time, peak memory and GPU samples, in
# <run>/stats/<segment>/), which waits for it and exits with its code; as it was where the node has
# no python3 (the meter then says nothing, and `rv stats` says which node).
rv_measured() {
    [ -n "${rv_stats_prog:-}" ] && [ -r "$rv_stats_prog" ] && command -v python3 >/dev/null 2>&1 || return 0
    export -n rv_stats_prog
    exec python3 -I -S "$rv_stats_prog" wrap "$RV_RUN_DIR/stats/$RV_SEGMENT" "${SLURMD_NODENAME:-$(hostname)}" \
        -- "$BASH" -c "$(declare -f rv_program); rv_program"
}

# rv_srun_lines LOG: srun's own lines (its stderr) to this script's stderr, each on a line of its own:
# a newline first when LOG (where the program's stderr goes too) does not end with one. It ignores the
# signals Slurm sends the job's processes: srun must never lose its stderr while the program saves.
rv_srun_lines() {
    trap '' TERM INT HUP QUIT USR1 USR2
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        # A log that is not empty and whose last byte is no newline (wc -l counts newlines).
        if [ -s "$1" ] && [ "$(tail -c 1 -- "$1" 2>/dev/null | wc -l)" = 0 ]; then printf '\n' >&2; fi
        printf '%s\n' "$line" >&2
    done
}

# Always an srun step, one task per node. --kill-on-bad-exit: one dead node must not leave the others
# waiting at a collective. Several nodes: one log per node (the batch log keeps rv's own lines).
rv_launch() {
    export -f rv_task rv_stop_watch rv_stop_deliver rv_stop_send rv_is_launcher rv_program rv_measured
    # rv's meter (rv_measured): where it is, when an idle GPU is told, and to whom.
    export rv_stats_prog RV_IDLE_GPU="${rv_idle_gpu:-0}" RV_STATS_JOB="$rv_job" \
        RV_STATS_NOTIFY_PROG="${rv_notify_prog:-}" RV_STATS_NOTIFY_HOOKS="${rv_notify_hooks:-}"
    local io=()
    if [ "$RV_NODES" -gt 1 ]; then
        rm -f -- "$RV_JOB_DIR"/node*.exit
        # Named by rv_job, not srun's %j: an array task's logs carry the array's name for it.
        io=(--open-mode=append --output="$RV_RUN_DIR/logs/$rv_job-node%n.out"
            --error="$RV_RUN_DIR/logs/$rv_job-node%n.err")
    fi
    local task='rv_task "$@"'
    if [ "${rv_work_node:-0}" = 1 ] && [ "$RV_NODES" -gt 1 ]; then
        # Each node makes its own work dir: the task needs the runtime's functions and the store.
        export rv_work_node rv_work_base rv_store rv_runtime
        # shellcheck disable=SC2016  # expanded by the task's shell
        task='. "$rv_runtime" || exit 1; rv_task "$@"'
    fi
    # srun relays a task's stderr in chunks into its own stderr, where its own lines ("srun: error:
    # node1: task 0: Exited with exit code 4") come too, in no set order: a program's last line without
    # its newline got srun's glued on. So one node's stderr goes straight to the batch script's log
    # (--error, appended, written on the node: never through srun), and srun's stderr carries srun's
    # own lines alone, each of which rv_srun_lines starts on a line of its own.
    local err="$RV_RUN_DIR/logs/$rv_job.err"
    if [ "$RV_NODES" -le 1 ] && [ "${rv_labeled:-0}" != 1 ] && [ -f "$err" ] &&
        [ "$(readlink -f -- "/proc/$$/fd/2" 2>/dev/null)" = "$(readlink -f -- "$err")" ]; then
        io=(--open-mode=append --error="$err")
    fi
    rv_program_ran=1 rv_rc=0
    # ${a[@]+...}: an empty array under `set -u` is an error in bash before 4.4 (RHEL 7).
    # rv_srun_container: Pyxis's options (rv run --container with that runtime): the task runs inside.
    {
        srun --nodes="$RV_NODES" --ntasks="$RV_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
            ${io[@]+"${io[@]}"} ${rv_srun_container[@]+"${rv_srun_container[@]}"} \
            bash -c "$task" rv-task "${rv_labeled:-0}" "${rv_launcher:-0}" "$rv_job" 2>&1 >&3 3>&- |
            rv_srun_lines "$err" || rv_rc="${PIPESTATUS[0]}"
    } 3>&1
    if [ "$RV_NODES" -gt 1 ] && [ "$rv_rc" -ne 0 ]; then
        # srun exits with the highest code of all tasks, so the nodes --kill-on-bad-exit stopped (143)
        # would hide the one that failed: report the lowest code below 128 a node recorded.
        local first="" f n
        for f in "$RV_JOB_DIR"/node*.exit; do
            n="$(cat -- "$f" 2>/dev/null)" || continue
            case "$n" in "" | *[!0-9]*) continue ;; esac
            if [ "$n" -gt 0 ] && [ "$n" -lt "${first:-128}" ]; then first="$n"; fi
        done
        rv_rc="${first:-$rv_rc}"
    fi
    exit "$rv_rc"
}
