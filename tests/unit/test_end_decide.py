"""How a segment ends, decided: job.sh's ``rv_end_decide`` (facts in, decision out), case by case.

``rv_end_segment`` gathers the facts (scontrol, the markers, the exit code, a fault in the logs) and
``rv_end_act`` acts (the records, the next segment, the run's end); the decision between them is a
shell function that runs no command and reads no file, so each branch is one row here. The whole
job script around it is tested in test_script.py (the ``box``) and on the loopback clusters.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from rv.agent.segment import end_state
from rv.slurm.script import JOB_RUNTIME

# The facts of an ordinary segment: the program ran and exited 0, nothing else happened.
BASE = {
    "f_requeued": "0", "f_stop": "0", "f_ran": "1", "f_marker": "0", "f_step": "", "f_start_step": "",
    "f_same_print": "0", "f_stop_sent": "false", "f_limit": "0", "f_preempted": "0", "f_term": "0",
    "f_rc": "0", "f_failed_at": "", "f_segment": "1", "f_max": "5", "f_fault": "0", "f_fault_node": "",
    "f_fault_what": "", "f_faults": "0", "f_max_faults": "0",
}  # fmt: skip

MARKER = {"f_marker": "1", "f_step": "20", "f_start_step": "10"}  # stopped cleanly, with progress
FAULT = {"f_rc": "1", "f_fault": "1", "f_fault_node": "gpu3", "f_fault_what": "GPU has fallen off the bus"}
GPU3 = "gpu fault on gpu3 (GPU has fallen off the bus)"
NOT_SUBMITTED = "; the next segment could not be submitted"

# (what happened, facts over BASE, (go, why, why if the next segment cannot be submitted))
CASES = [
    ("requeued", {"f_requeued": "1", "f_stop": "1", "f_rc": "1"}, ("requeue", "requeued by Slurm", "")),
    ("rv stop", {"f_stop": "1", **MARKER}, ("end", "cancelled by rv stop", "")),
    ("stop signal", {**MARKER, "f_stop_sent": "true"},
     ("next", "stopped at time limit", "stopped at time limit" + NOT_SUBMITTED)),
    ("time limit, saved", {**MARKER, "f_limit": "1", "f_preempted": "1", "f_term": "1"},
     ("next", "stopped at time limit", "stopped at time limit" + NOT_SUBMITTED)),
    ("preempted, saved", {**MARKER, "f_preempted": "1", "f_term": "1"},
     ("next", "preempted", "preempted" + NOT_SUBMITTED)),
    ("scancel, saved", {**MARKER, "f_term": "1", "f_step": "10"}, ("end", "cancelled", "")),
    ("stopped", MARKER, ("next", "stopped", "stopped" + NOT_SUBMITTED)),
    ("stopped, start step unknown", {**MARKER, "f_start_step": ""},
     ("next", "stopped", "stopped" + NOT_SUBMITTED)),
    ("no step, new files", {**MARKER, "f_step": ""}, ("next", "stopped", "stopped" + NOT_SUBMITTED)),
    ("no progress", {**MARKER, "f_step": "10", "f_stop_sent": "true"},
     ("end", "stopped at time limit with no progress (step 10, as when it started): not continued", "")),
    ("step went back", {**MARKER, "f_step": "7"},
     ("end", "stopped with no progress (step 7, as when it started): not continued", "")),
    ("nothing new", {**MARKER, "f_step": "", "f_same_print": "1"},
     ("end", "stopped with nothing new in the checkpoint folder: not continued", "")),
    ("last segment", {**MARKER, "f_segment": "5"},
     ("end", "stopped; all 5 segments used (--max-segments)", "")),
    ("time limit", {"f_limit": "1", "f_rc": "143", **FAULT}, ("end", "time limit", "")),
    ("preempted", {"f_preempted": "1", "f_term": "1", "f_rc": "143"}, ("end", "preempted", "")),
    ("scancel", {"f_term": "1", "f_rc": "143"}, ("end", "cancelled", "")),
    ("a step failed", {"f_ran": "0", "f_rc": "1", "f_failed_at": "the work dir: no space"},
     ("end", "failed before the program started: the work dir: no space", "")),
    ("failed early", {"f_ran": "0", "f_rc": "2", "f_marker": "1"},
     ("end", "failed before the program started: exit code 2", "")),
    ("finished", {}, ("end", "finished", "")),
    ("crashed", {"f_rc": "1"}, ("end", "crashed", "")),
    ("gpu fault", {**FAULT, "f_faults": "1", "f_max_faults": "3"},
     ("fault", GPU3 + ": continued without gpu3 (fault retry 2/3)", "crashed: " + GPU3 + NOT_SUBMITTED)),
    ("no fault retries", FAULT,
     ("end", f"crashed: {GPU3}; no fault retries left (--max-fault-retries 0)", "")),
    ("fault retries used", {**FAULT, "f_faults": "2", "f_max_faults": "2"},
     ("end", f"crashed: {GPU3}; no fault retries left (--max-fault-retries 2)", "")),
    ("fault, last segment", {**FAULT, "f_max_faults": "2", "f_segment": "5"},
     ("end", f"crashed: {GPU3}; all 5 segments used (--max-segments)", "")),
]  # fmt: skip


def decide(facts: dict[str, str], trace: set[int] | None = None) -> tuple[str, str, str]:
    """rv_end_decide on these facts, in a bash with no PATH: a command it ran would fail. With
    ``trace``, adds the job.sh lines it ran."""
    assigns = " ".join(f"{k}={v!r}" for k, v in {**BASE, **facts}.items())
    call = "PS4='+${LINENO} '; set -x; rv_end_decide; set +x" if trace is not None else "rv_end_decide"
    script = f'. "$1"; {assigns}; {call}; printf "%s\\n" "$rv_go" "$rv_why" "$rv_fail_why"'
    out = subprocess.run(
        ["bash", "-c", f"PATH=/nonexistent; {script}", "rv", str(JOB_RUNTIME)],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    if trace is None:
        assert out.stderr == ""
    else:
        trace.update(int(m) for m in re.findall(r"^\++(\d+) ", out.stderr, re.M))
    go, why, fail = out.stdout.split("\n")[:3]
    return go, why, fail


@pytest.mark.parametrize(("facts", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_end_of_a_segment(facts, want):
    assert decide(facts) == want


def test_each_reason_has_a_state():
    # `rv ps` shows the state END_REASONS gives each reason's beginning; none falls to ENDED.
    reasons = {why for _, _, (_, why, fail) in CASES} | {fail for _, _, (_, _, fail) in CASES if fail}
    states = {end_state(why) for why in reasons}
    assert "ENDED" not in states and {"COMPLETED", "FAILED", "FAULT", "REQUEUED", "STOPPED"} <= states


def test_the_cases_reach_every_branch():
    # Every line of rv_end_decide that decides (sets rv_go, rv_why or returns) runs in some row above:
    # a new branch without its row fails here.
    lines = JOB_RUNTIME.read_text().splitlines()
    start = lines.index("rv_end_decide() {") + 1
    end = lines.index("}", start)
    deciding = {
        n + 1 for n in range(start + 1, end) if re.match(r"\s*(rv_go=|rv_why=|return$)", lines[n])
    }  # fmt: skip
    ran: set[int] = set()
    for _, facts, _ in CASES:
        decide(facts, ran)
    assert len(deciding) > 15 and deciding <= ran, sorted(deciding - ran)
