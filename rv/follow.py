"""Reading job logs over SSH: one remote command, output streamed back over the open channel.

Following a running job uses `tail -F` on the cluster rather than polling file sizes from here: new
lines arrive within a fraction of a second instead of every few seconds (a lesson of the old tool).
The remote loop ends by itself when Slurm says the job is over, and a watchdog on stdin ends it when
rv goes away, so nothing is left running on the login node.
"""

from __future__ import annotations

import shlex

# Job states in which more output may still come. Anything else is final.
LIVE_STATES = (
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
    "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
)  # fmt: skip


def tail_command(
    out_paths: list[str],
    err_paths: list[str],
    *,
    job_id: str,
    follow: bool,
    lines: int | None,
) -> str:
    """Shell text that prints the logs: ``out_paths`` on stdout, ``err_paths`` on stderr.

    Without ``follow`` it prints what is there (the last ``lines`` lines of each, or everything).
    With ``follow`` it keeps printing until the job leaves the queue, then ends.
    """
    start = f"-n {int(lines)}" if lines is not None else "-n +1"
    q_out = " ".join(shlex.quote(p) for p in out_paths)
    q_err = " ".join(shlex.quote(p) for p in err_paths)
    if not follow:
        parts = []
        # `-q`: no "==> file <==" headers; 2>/dev/null: a log not created yet is simply empty.
        if out_paths:
            parts.append(f"tail -q {start} {q_out} 2>/dev/null")
        if err_paths:
            parts.append(f"{{ tail -q {start} {q_err} 2>/dev/null; }} >&2")
        return "; ".join(parts) + "; true"
    live = "|".join(LIVE_STATES)
    lines_ = [
        # When rv's side of the channel closes, stdin reaches EOF: stop everything we started.
        # Its output goes to /dev/null: sshd waits for every holder of the channel's stdout/stderr.
        # `<&0`: without an explicit redirection bash gives background jobs /dev/null as stdin.
        "( cat >/dev/null 2>&1; kill 0 ) <&0 >/dev/null 2>&1 &",
        "w=$!",
        "pids=",
    ]
    if out_paths:
        lines_ += [f"tail -q -s 0.2 {start} -F {q_out} 2>/dev/null &", 'pids="$pids $!"']
    if err_paths:
        lines_ += [f"{{ tail -q -s 0.2 {start} -F {q_err} 2>/dev/null; }} >&2 &", 'pids="$pids $!"']
    lines_ += [
        f"while squeue -h -j {shlex.quote(job_id)} -o %T 2>/dev/null | grep -qE '^({live})$'; do",
        "  sleep 2",
        "done",
        # Give tail a moment to print the job's last lines (shared file systems lag a little).
        "sleep 1",
        "kill $pids $w 2>/dev/null",
        "wait 2>/dev/null",
        "true",
    ]
    return "\n".join(lines_)


def job_state_command(job_id: str) -> str:
    """State, reason and expected start of one job, from squeue; empty once squeue forgot it."""
    return f"squeue -h -j {shlex.quote(job_id)} -o '%T|%r|%S' 2>/dev/null; true"


def parse_job_state(text: str) -> tuple[str, str, str] | None:
    line = text.strip().splitlines()[0] if text.strip() else ""
    if not line:
        return None
    state, _, rest = line.partition("|")
    reason, _, start = rest.partition("|")
    return state, reason, start


def exit_code_command(job_id: str) -> str:
    """The job's state and exit code: scontrol while slurmctld remembers it, then sacct (which lags)."""
    q = shlex.quote(job_id)
    return (
        f"scontrol -o show job {q} 2>/dev/null | grep -o -E ' (JobState|ExitCode)=[^ ]*' | tr -d ' ' | "
        "paste -sd' ' -; "
        f"sacct -n -X -P -j {q} -o ExitCode,State 2>/dev/null | head -n1; true"
    )


def parse_exit_code(text: str) -> tuple[int, str] | None:
    """(code, state) from ``JobState=S ExitCode=N:G`` or sacct's ``N:G|STATE``.

    The code is N, or 128+G when signal G killed it, as a shell reports it. A job that ended
    without completing (cancelled while pending, node failure, time limit) but says 0 gets 1, so
    `rv run -f` never reports success for a job that did not finish.
    """
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("JobState="):
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            exit_field, state = fields.get("ExitCode", ""), fields.get("JobState", "")
        else:
            exit_field, _, state = line.partition("|")
        code, _, sig = exit_field.partition(":")
        if not (code.isdigit() and sig.isdigit()):
            continue
        state = state.split()[0] if state.split() else ""
        value = int(code) if int(sig) == 0 else 128 + int(sig)
        if value == 0 and state and state != "COMPLETED":
            value = 1
        return value, state
    return None
