"""rv's own options typed after the program: ``rv run python train.py -g 4`` hands ``-g 4`` to the
program, and :func:`detect_misplaced_flags` says so before anything is sent."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from rv.catalog import GpuType
from rv.contract import STOP_SIGNALS
from rv.errors import UsageError
from rv.timespec import parse_duration, parse_mem


def _looks_like_rv_value(flag: str, value: str, catalog: Mapping[str, GpuType] | None) -> bool:
    """Whether ``value`` is something rv's ``flag`` takes, to keep programs' own ``-o`` quiet."""
    if flag in ("-g", "--gpu", "--cpus", "--nodes", "--max-segments"):
        return value.isdigit()
    if flag in ("-t", "--type"):
        return catalog is None or value in catalog
    if flag == "--time":
        try:
            parse_duration(value)
        except UsageError:
            return False
        return True
    if flag == "--mem":
        try:
            parse_mem(value)
        except UsageError:
            return False
        return True
    if flag == "--signal":
        name = value.partition("@")[0].upper().removeprefix("SIG")
        return name in STOP_SIGNALS
    return True


def detect_misplaced_flags(
    command: Sequence[str],
    catalog: Mapping[str, GpuType] | None = None,
    *,
    flags: Mapping[str, bool],
) -> list[str]:
    """Warnings for rv options that ended up in the program's arguments.

    ``rv run python train.py -g 4`` hands ``-g 4`` to train.py. ``flags`` maps every option word of
    `rv run` to whether it takes a value; the CLI derives it from its click command, so an option
    added there is known here at once. Only words that look like rv's own (``-g`` with a number,
    ``-t`` with a known type, ``--time`` with a duration, ...) count, so a program's own
    ``-g fast`` raises nothing. The CLI should skip this when the user wrote ``--``.
    """
    found: list[tuple[int, int, str]] = []  # (start, length, text)
    i = 1
    while i < len(command):
        word = command[i]
        if word == "--":
            break
        flag, eq, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        if flag not in flags:
            i += 1
            continue
        takes_value = flags[flag]
        if not takes_value:
            if eq:
                i += 1
                continue
            # -f is common in programs (-f FILE); only a lone -f at the very end looks like rv's.
            if flag == "-f" and i != len(command) - 1:
                i += 1
                continue
            found.append((i, 1, flag))
            i += 1
            continue
        if eq:
            if _looks_like_rv_value(flag, inline, catalog):
                found.append((i, 1, f"{flag} {inline}"))
            i += 1
            continue
        if i + 1 < len(command) and _looks_like_rv_value(flag, command[i + 1], catalog):
            found.append((i, 2, f"{flag} {shlex.quote(command[i + 1])}"))
            i += 2
            continue
        i += 1
    if not found:
        return []
    moved = " ".join(text for _, _, text in found)
    taken = {j for start, length, _ in found for j in range(start, start + length)}
    remaining = [w for j, w in enumerate(command) if j not in taken]
    fix = f"rv run {moved} -- {shlex.join(remaining)}"
    return [
        f"{text} went to the program, not to rv; put rv options before the command: {fix}"
        for _, _, text in found
    ]
