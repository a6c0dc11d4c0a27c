"""The contract between rv, which writes a job, and the program the job runs (rv_train among them).

Imported by ``rv`` on the laptop and by ``rv_train`` on the cluster, so it holds only the standard
library and plain values: the ``RV_*`` variables a job sees, the precision rule, and the stop protocol.

The stop protocol, for any program:

1. Before the time limit (``--signal NAME@SECONDS``, default ``USR1@300``) rv sends ``RV_STOP_SIGNAL``
   to every process of the program that has a handler installed for it. A program without a handler
   is never signalled early: it runs until Slurm's own limit.
2. The program saves into ``RV_CHECKPOINT_DIR``, writes the marker file ``PREEMPTED`` there (the
   checkpoint step as a number, or JSON with ``"step"``) and exits.
3. rv removes an old marker before each segment starts, so a marker found after the program ended is
   this segment's own. With a step beyond the previous segment's, the run continues in a new job.
"""

from __future__ import annotations

import json
import re

# --- what a job sees ------------------------------------------------------------------------------
# The job's runtime (rv/agent/job.sh) exports RV_WORK_DIR (the run's private copy of its snapshot,
# where the program starts), RV_CHECKPOINT_DIR (one per run name: save here, resume from here),
# RV_OUTPUT_DIR, RV_JOB_DIR, RV_RUN_ID, RV_RUN_NAME, RV_SEGMENT, RV_MAX_SEGMENTS and the names below,
# which programs read through this module.
RV_STOP_SIGNAL = "RV_STOP_SIGNAL"  # e.g. "USR1": the signal that means "save and exit now"
RV_PRECISION = "RV_PRECISION"  # bf16 | fp16 | no
ACCELERATE_MIXED_PRECISION = "ACCELERATE_MIXED_PRECISION"  # set to the same value, for accelerate
PRECISION_VARIABLES = (RV_PRECISION, ACCELERATE_MIXED_PRECISION)

# --- the stop protocol ----------------------------------------------------------------------------
PREEMPTED = "PREEMPTED"  # marker file in RV_CHECKPOINT_DIR
DEFAULT_STOP_SIGNAL = "USR1"
DEFAULT_STOP_LEAD_SECONDS = 300
# Signals a program can sensibly catch to checkpoint. TERM is what Slurm sends at the limit itself,
# on scancel and on preemption: a program that saves on it loses less when the warning came too late.
STOP_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "QUIT")
# What a program following the protocol should catch: the stop signal, plus TERM.
ALWAYS_CAUGHT = ("TERM",)


def signals_to_catch(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Signal names (no SIG prefix) a protocol-following program installs handlers for."""
    import os

    env = os.environ if environ is None else environ
    first = (env.get(RV_STOP_SIGNAL) or DEFAULT_STOP_SIGNAL).upper().removeprefix("SIG")
    names = [first] + [s for s in ("USR1", "USR2", *ALWAYS_CAUGHT) if s != first]
    return tuple(names)


def marker_text(step: int, **info: object) -> str:
    """The marker's content: JSON with the checkpoint step first (rv reads ``"step"``)."""
    return json.dumps({"step": int(step), **info}, indent=1)


_LEADING_INT = re.compile(r"\s*(\d+)\s*$")


def marker_step(text: str) -> int | None:
    """The checkpoint step a marker names: a bare number, or JSON with ``"step"``; else None."""
    m = _LEADING_INT.match(text)
    if m:
        return int(m.group(1))
    try:
        data = json.loads(text)
    except ValueError:
        return None
    step = data.get("step") if isinstance(data, dict) else None
    return step if isinstance(step, int) and step >= 0 else None


# --- precision ------------------------------------------------------------------------------------
BF16_MIN_MAJOR = 8  # BF16 needs compute capability 8.0 (Ampere) or newer


def precision_for_capability(major: int | None) -> str:
    """bf16 from compute capability 8.0, fp16 below it (the job's runtime makes the same test)."""
    return "bf16" if major is not None and major >= BF16_MIN_MAJOR else "fp16"
