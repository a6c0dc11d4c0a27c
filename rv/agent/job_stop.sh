# shellcheck shell=bash disable=SC2154
# (SC2154: the batch script and job.sh set the job's values before any of these functions runs.)
# rv's job runtime, the stop watcher: a part of job.sh, shipped joined to it as one file (job.sh's header
# says how). Functions and constants only.
#
# In each node's task, beside the program: RV_STOP_SIGNAL, RV_STOP_LEAD seconds before the time
# limit, to the program's processes that handle it (never a launcher's agent), and to none when none does.

rv_stop_watch() {  # rv_stop_watch PID: at the lead time, rv_stop_deliver PID
    local end left
    # It waits in `read -t` on a pipe no one writes to (rv_nap_fd, also rv_stop_deliver's): a builtin,
    # so killing the watcher leaves no `sleep` behind holding the job's output open.
    exec {rv_nap_fd}<> <(:)
    while :; do
        # Asked again every minute at most: Slurm may move the limit (scontrol update).
        end="$(env SLURM_TIME_FORMAT=standard squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null | sed -n 1p)"
        # An empty answer must stay empty: `date -d ''` is midnight, a limit long past.
        if [ -n "$end" ]; then end="$(date -d "$end" +%s 2>/dev/null)" || end=""; fi
        if [ -n "$end" ]; then
            left=$((end - RV_STOP_LEAD - $(date +%s)))
            if [ "$left" -le 0 ]; then
                rv_stop_deliver "$1"
                return 0
            fi
            [ "$left" -le 60 ] || left=60
        else
            left=60  # no answer (or no limit): never signal on a guess
        fi
        read -r -t "$left" -u "$rv_nap_fd" || :
    done
}

rv_stop_deliver() {  # rv_stop_deliver PID: RV_STOP_SIGNAL to the processes under PID handling it
    # A program may install its handler late (a long start-up in a short job): until one does, look
    # again every few seconds; the first time, say that nothing handles it yet.
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
        if [ -z "$mask" ] || ! (((16#$mask >> bit) & 1)); then continue; fi
        ! rv_is_launcher "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || continue
        kill -s "$RV_STOP_SIGNAL" "$pid" 2>/dev/null && sent="$sent $pid"
    done
    [ -n "$sent" ] || return 1
    printf '%s%s\n' "$(date +%s)" "$sent" >"$RV_JOB_DIR/stop-node${SLURM_NODEID:-0}"
    echo "rv: $RV_STOP_LEAD s before the time limit: sent $RV_STOP_SIGNAL to pid(s)$sent on $(hostname)" >&2
}
