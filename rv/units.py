"""Sizes typed on the command line (`--max-file-size 100MB`) and shown (`1.5 MB`), and counts shown
(`1 file`, `2,048 files`); durations are rv.timespec's.

A module of its own so that option parsing imports nothing else (rv.files.sync is heavy to import).
"""

from __future__ import annotations

import re

from rv.errors import UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``100MB``, ``1.5GB``, ``500M``, ``2GiB``, or a number of bytes (decimal units, as `du --si`)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"not a size: {text!r}", hint="use e.g. 100MB, 1.5GB or 500000000")
    unit = m.group(2).lower()
    base = 1024 if unit.endswith("i") else 1000
    power = " kmgt".index(unit[:1] or " ")
    return int(float(m.group(1)) * base**power)


def human_size(n: float) -> str:
    """``1.5 MB``: decimal units, as the size options take them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 file``, ``0 files``, ``2,048 files``: the number and the noun that agrees with it."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
