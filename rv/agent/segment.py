"""What a job records about a segment (``seg/<k>.json``) and about its run's end (``ENDED``).

One format, named here: the job's runtime writes it (``rv_record`` and ``rv_end_act`` in
``rv/agent/job.sh``, with exactly these keys, in this order: a unit test holds the two equal), the
agent writes it for segments that never started (``rv stop``), and the laptop reads it
(:func:`rv.job.records.parse_segment`). Values: numbers are integers or null; ``state`` is
``running``, ``requeued`` or ``ended``; ``reason`` is why the segment (or run) ended, worded as
:data:`END_REASONS` begin; ``gpu_type`` is the type the segment got (a run over several types
lands on one; "" for a CPU job).

Imports nothing of the agent: laptop modules import this one (a shared format: see :mod:`rv.agent`).
"""

# seg/<k>.json, in the order the job writes them.
SEGMENT_FIELDS = (
    "segment", "job_id", "attempt", "nodes", "start", "end", "state", "reason", "exit_code", "start_step",
    "checkpoint_step", "stop_sent", "next_job_id", "gpu_type",
)  # fmt: skip

# ENDED, in the order the job writes them.
ENDED_FIELDS = ("reason", "exit_code", "segment", "end")

# How a reason begins -> the state word `rv ps` shows (the first match wins).
END_REASONS = (
    ("finished", "COMPLETED"),
    ("crashed", "FAILED"),
    ("failed before", "FAILED"),
    ("time limit", "TIMEOUT"),
    ("stopped", "STOPPED"),
    ("preempted", "PREEMPTED"),
    ("cancelled", "CANCELLED"),
    ("requeued", "REQUEUED"),
    ("gpu fault", "FAULT"),
    ("ended without a record", "LOST"),
)


def segment_record(segment, job_id, state, reason, end, exit_code=None, **known):
    """A ``seg/<k>.json`` object with every field (what is not known is null)."""
    record = dict.fromkeys(SEGMENT_FIELDS)
    record.update(known, segment=segment, job_id=job_id, state=state, reason=reason, end=end,
                  exit_code=exit_code, stop_sent=bool(known.get("stop_sent")))  # fmt: skip
    unknown = set(record) - set(SEGMENT_FIELDS)
    if unknown:
        raise ValueError("not segment record fields: %s" % ", ".join(sorted(unknown)))
    return record


def ended_record(reason, exit_code, segment, end):
    """An ``ENDED`` object."""
    return {"reason": reason, "exit_code": exit_code, "segment": segment, "end": end}


def end_state(reason):
    """The state word for why a run or segment ended (``ENDED`` when the words are not rv's)."""
    for prefix, word in END_REASONS:
        if reason.startswith(prefix):
            return word
    return "ENDED"
