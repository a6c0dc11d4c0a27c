# shellcheck shell=bash disable=SC2154
# (SC2154: the batch script and job.sh set the job's values before any of these functions runs.)
# rv's job runtime, the notifications: a part of job.sh, shipped joined to it as one file (job.sh's header
# says how). Functions and constants only.
#
# rv run --notify: Slurm's mail of the run's end and the webhooks (the notifier, notify.py).

# The run's end is told once, by the job that ends it: only it knows that no segment follows. Slurm's
# own mail: this job asks for it now (scontrol update of its own MailType and MailUser, which Slurm
# lets a user do to a running job) and Slurm sends it as the job ends; every earlier segment's job
# had none. Webhooks: rv_notify_post. Neither can fail the job or hold its end up for long.
rv_notify_end() {
    if [ -n "${rv_notify_mail:-}" ]; then
        scontrol update JobId="$SLURM_JOB_ID" MailType=END MailUser="$rv_notify_mail" >/dev/null 2>&1 \
            && echo "rv: notify: Slurm mails the run's end to $rv_notify_mail" \
            || echo "rv: warning: notify: Slurm refused to mail this job's end (scontrol update)" >&2
    fi
    rv_notify_post end
}

# Segment 1's first start; the notifier says something only when the run waited in the queue.
rv_notify_started() {
    if [ "$RV_SEGMENT" = 1 ] && [ "$rv_attempt" = 0 ]; then rv_notify_post started; fi
}

# rv_notify_post EVENT: the notifier (python3, standard library) posts to each webhook; it reads
# their URLs from the job's environment (the secrets), never from its arguments.
rv_notify_post() {
    [ -n "${rv_notify_hooks:-}" ] || return 0
    # shellcheck disable=SC2086  # secret names, one word each
    python3 "$rv_notify_prog" "$1" "$RV_RUN_DIR" "$rv_job" $rv_notify_hooks </dev/null \
        || echo "rv: warning: notify: the notifier did not run (python3 missing?)" >&2
}
