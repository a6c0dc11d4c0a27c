"""Durations and memory sizes: what a user types, and what Slurm prints.

Two directions, kept apart on purpose:

* :func:`parse_duration` reads a duration a user typed (``--time``, ``rv gc --older-than``: ``30m``,
  ``2h``, ``1d12h``, ``2:59:00``, ``1-12``) and raises :class:`~rv.errors.UsageError` naming the
  flag, the value and the accepted forms.
* :func:`parse_slurm_time` reads what ``squeue``/``sacct``/``sinfo`` print (``1-02:03:04``, ``2:03``,
  ``UNLIMITED``); it returns None for "no limit" words and raises ValueError on garbage, because
  garbage there is a parser problem, not the user's.

Slurm's own colon forms are ambiguous in a way users trip over: ``59:00`` is 59 *minutes*
(``MM:SS``), not 59 hours, and a bare ``30`` is 30 minutes. We accept the colon forms exactly as
Slurm reads them, and refuse a bare number because nobody agrees what it means.
"""

from __future__ import annotations

import math
import re

from rv.errors import UsageError

# Just under 3 hours: Rivanna's backfill scheduler starts jobs shorter than its 3 h window first,
# so the default asks for 2:59 rather than 3:00.
DEFAULT_TIME = "2:59:00"

DURATION_FORMS = "30m, 2h, 1h30m, 1d12h, 90s, 2:59:00 (H:MM:SS), 59:00 (MM:SS), 1-12:00:00 or 1-12 (D-HH)"
MEM_FORMS = "a number with a unit K, M, G or T, e.g. 16G or 500M"

_UNIT_SECONDS = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
}  # fmt: skip
_UNIT_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)")
_UNIT_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?\s*[a-z]+\s*)+")
# Slurm's forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_SLURM_DAYS = re.compile(r"(\d+)-(\d+)(?::(\d+))?(?::(\d+))?")
_SLURM_COLON = re.compile(r"(\d+)(?::(\d+))?(?::(\d+))?")
_SLURM_FRACTION = re.compile(r"(.*?)(\.\d+)?")

# Words Slurm prints where a time would be, meaning "none" or "not known".
_NO_TIME_WORDS = {
    "",
    "unlimited",
    "infinite",
    "invalid",
    "not_set",
    "n/a",
    "none",
    "partition_limit",
    "unknown",
}


def _slurm_colon_seconds(text: str) -> int | None:
    """Seconds of a Slurm time string, or None if it is not one. Fractions of a second are dropped."""
    text, _frac = _SLURM_FRACTION.fullmatch(text).groups()  # type: ignore[union-attr]
    m = _SLURM_DAYS.fullmatch(text)
    if m:
        days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    m = _SLURM_COLON.fullmatch(text)
    if m:
        parts = [int(g) for g in m.groups() if g is not None]
        if len(parts) == 1:  # MM
            return parts[0] * 60
        if len(parts) == 2:  # MM:SS
            return parts[0] * 60 + parts[1]
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]  # HH:MM:SS
    return None


def parse_duration(text: str, *, flag: str = "--time", allow_zero: bool = False) -> int:
    """A duration the user typed for ``flag``, in seconds. Raises UsageError naming that flag, the
    value and the accepted forms.

    ``allow_zero`` for a flag where zero means something (``rv gc --older-than 0``: everything that
    has ended); a bare ``0`` is then read as zero too, since zero is zero in every unit.
    """
    raw = text
    text = text.strip().lower()
    seconds: float | None = None
    if allow_zero and re.fullmatch(r"0+", text):
        return 0
    if re.fullmatch(r"\d+", text):
        why = f": Slurm would read it as {text} minutes" if flag == "--time" else ""
        raise UsageError(
            f"{flag} {raw!r} has no unit{why}",
            hint=f"write {text}m or {text}h; accepted forms: {DURATION_FORMS}",
        )
    if _UNIT_WHOLE.fullmatch(text):
        seconds = 0.0
        for number, unit in _UNIT_PART.findall(text):
            if unit not in _UNIT_SECONDS:
                seconds = None
                break
            seconds += float(number) * _UNIT_SECONDS[unit]
    elif "." not in text:
        colon = _slurm_colon_seconds(text)
        seconds = float(colon) if colon is not None else None
    if seconds is None:
        raise UsageError(f"cannot read {flag} {raw!r}", hint=f"accepted forms: {DURATION_FORMS}")
    result = math.ceil(seconds)
    if result <= 0 and not allow_zero:
        raise UsageError(f"{flag} {raw!r} is zero", hint=f"accepted forms: {DURATION_FORMS}")
    return result


def format_elapsed(seconds: int | None) -> str:
    """Elapsed time as `rv ps` shows it, Slurm's way: [D-]H:MM:SS; ``-`` when unknown."""
    if seconds is None:
        return "-"
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}-" if d else "") + f"{h:d}:{m:02d}:{s:02d}"


def format_slurm_time(seconds: int) -> str:
    """``D-HH:MM:SS`` from one day up, else ``HH:MM:SS``: forms every Slurm version reads the same way."""
    if seconds < 0:
        raise ValueError(f"negative duration: {seconds}")
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours:02d}:{minutes:02d}:{secs:02d}"


def parse_slurm_time(text: str) -> int | None:
    """Seconds of a time printed by squeue/sacct/sinfo (``1-02:03:04``, ``02:03``, ``0:00``).

    None for the words that mean "no limit" or "not known" (``UNLIMITED``, ``INVALID``,
    ``NOT_SET``, ``Partition_Limit``, ``infinite``, ``N/A``, empty). ValueError for anything else.
    """
    stripped = text.strip()
    if stripped.lower() in _NO_TIME_WORDS:
        return None
    seconds = _slurm_colon_seconds(stripped)
    if seconds is None:
        raise ValueError(f"not a Slurm time: {text!r}")
    return seconds


# --- memory -----------------------------------------------------------------------------------

_MEM = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(?:i?b)?", re.IGNORECASE)
_MEM_UNITS = "KMGT"


def parse_mem(text: str) -> str:
    """A ``--mem`` value normalised for Slurm (``16gb`` -> ``16G``, ``1.5G`` -> ``1536M``).

    A bare number is refused: Slurm reads it as megabytes, so ``--mem 16`` would ask for 16 MB.
    Zero is refused too: ``--mem=0`` means "all the node's memory" to Slurm, never what was meant.
    """
    raw = text
    m = _MEM.fullmatch(text.strip())
    if not m:
        if re.fullmatch(r"\s*\d+\s*", text):
            raise UsageError(
                f"--mem {raw!r} has no unit: Slurm would read it as {text.strip()} megabytes",
                hint=f"write {text.strip()}G; accepted: {MEM_FORMS}",
            )
        raise UsageError(f"cannot read --mem {raw!r}", hint=f"accepted: {MEM_FORMS}")
    number, unit = m.group(1), m.group(2).upper()
    value = float(number)
    index = _MEM_UNITS.index(unit)
    # Slurm wants an integer: step down a unit until the value is whole (1.5G -> 1536M).
    while value != int(value) and index > 0:
        value *= 1024
        index -= 1
    if value != int(value):
        value = math.ceil(value)
    if value <= 0:
        raise UsageError(
            f"--mem {raw!r} is zero (Slurm reads 0 as 'the whole node')", hint=f"accepted: {MEM_FORMS}"
        )
    return f"{int(value)}{_MEM_UNITS[index]}"


def mem_megabytes(text: str) -> int:
    """Megabytes in a memory size (``16G`` -> 16384), rounded up; for comparing sizes."""
    normalised = parse_mem(text)
    value, unit = int(normalised[:-1]), normalised[-1]
    megabytes: int = math.ceil(value * 1024.0 ** (_MEM_UNITS.index(unit) - 1))
    return megabytes


def scale_mem(text: str, factor: int) -> str:
    """A memory size times ``factor`` in the same unit (``16G`` x 4 -> ``64G``)."""
    normalised = parse_mem(text)
    return f"{int(normalised[:-1]) * factor}{normalised[-1]}"


# `rv run --idle-gpu`: how long every GPU of a node may stay under 5% before the run's log says so.
IDLE_GPU_DEFAULT = 15 * 60


def parse_idle_gpu(text: str) -> int:
    """``--idle-gpu`` in seconds: a duration (``15m``, ``1h``, ``90s``) or ``off`` (0)."""
    if text.strip().lower() in ("off", "none", "no"):
        return 0
    return parse_duration(text, flag="--idle-gpu")
