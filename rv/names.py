"""Run names: taken exactly as typed, or refused with what is allowed. Never changed.

A run's name keys its checkpoint folder (a run named again resumes from it), its records, its log
files and its ``#SBATCH --job-name``, and every command finds the run by it. An earlier rv replaced
what it could not use with ``-`` and cut names at 64 characters, so ``lr 0.1``, ``lr/0.1`` and
``lr?0.1`` all became ``lr-0.1`` (the second resumed the first's checkpoint), and ``rv logs 'lr 0.1'``
found nothing afterwards. Now a name either is usable as typed, or is refused before anything is sent.

A sweep's points are runs named ``SWEEP/INDEX`` (``lr-grid/3``): the one ``/`` a run name can hold,
made by rv from a sweep name that passed the same check. On the cluster a point's folders are then
``<SWEEP>/<INDEX>`` under the project's (checkpoints, outputs, the name index): a sweep's points
sit together, and no run name typed as ``--name`` (which has no ``/``) can reach them.

Only names rv makes up itself (the default ``train-3f9a``, from the command) map characters: they
end with the run's own id, which keeps them apart.
"""

from __future__ import annotations

import re

from rv.errors import UsageError

MAX_NAME_LEN = 64
ALLOWED = "ASCII letters, digits, '.', '_' and '-', at most 64, not starting with '.' or '-'"
# ASCII only, spelled out: `\w` and str.isalnum() would let 'ü' in, which Slurm's job name, a log file
# name and a terminal on another locale would each handle differently.
_CHAR = re.compile(r"[A-Za-z0-9._-]")
_NOT_CHAR = re.compile(r"[^A-Za-z0-9._-]+")


def name_problem(name: str) -> str | None:
    """What keeps ``name`` from being a run name as typed, or None when it can be one."""
    if not name:
        return "is empty"
    bad = list(dict.fromkeys(c for c in name if not _CHAR.fullmatch(c)))
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5]) + (" and more" if len(bad) > 5 else "")
        return f"has characters a run name cannot have ({shown})"
    if name[0] in ".-":
        return f"starts with {name[0]!r}"
    if len(name) > MAX_NAME_LEN:
        return f"is {len(name)} characters long, over the {MAX_NAME_LEN} a run name may have"
    return None


def suggest(name: str) -> str:
    """A usable name close to ``name``, for the hint only: the user chooses it knowingly."""
    return derive(name) or "run-1"


def check_run_name(name: str, what: str = "--name") -> str:
    """``name`` unchanged when it is usable as a run name, else UsageError saying what is allowed."""
    problem = name_problem(name)
    if problem is None:
        return name
    hint = f"a run name has only {ALLOWED}, e.g. {what} {suggest(name)}"
    if _NOT_CHAR.search(name):
        hint += ": rv never changes a name, so that two names never become one run"
    raise UsageError(f"{what} {name!r} {problem}", hint=hint)


def derive(text: str) -> str:
    """A name made from ``text`` (a script's name): other characters become '-', cut to fit.

    Lossy on purpose, so only for names rv makes up and then makes unique (:func:`default_run_name`);
    '' when nothing usable is left.
    """
    cleaned = _NOT_CHAR.sub("-", text).lstrip("-.")
    return cleaned[:MAX_NAME_LEN].rstrip("-.")


def point_name(sweep: str, index: int) -> str:
    """``SWEEP/INDEX``: the run name of a sweep's point (``sweep`` already checked)."""
    return f"{sweep}/{index}"


def split_point_name(name: str) -> tuple[str, int] | None:
    """``SWEEP/INDEX`` -> (sweep, index); None for any other text (a plain run name included)."""
    sweep, slash, index = name.rpartition("/")
    if not slash or name_problem(sweep) is not None:
        return None
    if not index.isdigit() or not index.isascii() or (len(index) > 1 and index[0] == "0"):
        return None
    return sweep, int(index)


def lookup_hint(ref: str) -> str | None:
    """For a run looked up by ``ref`` and not found: why no run can have that name, or None."""
    if split_point_name(ref) is not None:
        return None
    problem = name_problem(ref) if ref else None
    if problem is None:
        return None
    return f"no run can be named {ref!r}: it {problem}; `rv ps -a` lists the runs"
