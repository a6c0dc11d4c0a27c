"""A sweep: one command run at many points, each a run of its own, submitted as Slurm job arrays.

Pure: what the user typed in, a validated :class:`Sweep` (or a :class:`~rv.errors.UsageError` naming
the value and the next step) out, before anything touches the network. The rules, exactly:

Points
    ``--sweep NAME=V1,V2,...`` (repeatable): the Cartesian product of the value lists, the first
    ``--sweep`` varying slowest (``--sweep lr=a,b --sweep seed=0,1``: ``a 0``, ``a 1``, ``b 0``,
    ``b 1``). An item ``A..B`` is the integers A to B inclusive (``seed=0..4``, ``seed=0..2,10``);
    ranges are of integers only: ``lr=1e-4..1e-2`` is refused, since no step would be the obvious one
    (list the values instead). Values are text, kept as typed (``1e-4`` stays ``1e-4``) but for the
    spaces around each, which go as they do around names (``lr= 1e-4, 3e-4``); a value holding a
    comma, or spaces at its ends, needs ``--sweep-file`` as JSON lines.

    ``--sweep-file FILE``: explicit points, one per line. JSON lines (one object per line; picked for a
    name ending ``.jsonl``, ``.ndjson`` or ``.json``) or CSV with a header row (``.csv``); any other
    name is read as JSON lines when its first non-blank character is ``{``, else as CSV. Every point
    names the same parameters. JSON numbers keep their spelling (``1e-4``), ``true``/``false`` become
    those words, strings are kept exactly; ``null``, lists and objects are refused. CSV cells lose
    the spaces around them, quoted or not (spreadsheets pad cells; CSV quotes are for commas), and an
    empty cell is refused (write ``""`` or ``" x "`` in JSON lines for such a value). A UTF-8
    byte-order mark (a spreadsheet's "CSV UTF-8") is no part of the first name. Together with
    ``--sweep``: each line of the file crossed with every combination of the ``--sweep`` values (the
    file's lines varying slowest).

    Two points with the same values are refused, and so is a sweep over :data:`MAX_POINTS` points
    (checked before the points are made, so ``seed=0..99999999`` fails at once).

Names
    ``[A-Za-z_][A-Za-z0-9_]*``. Each point's program sees ``RV_SWEEP_<NAME>`` with NAME upper-cased
    (``lr`` -> ``RV_SWEEP_LR``) and ``RV_SWEEP_INDEX`` (0, 1, ...; the point's place in the order
    above), so two names that differ only in case are duplicates, and ``INDEX`` is taken.

The command
    ``{NAME}`` in a word of the command is replaced by the point's value. The command is an argv
    list and the replacement happens in its words, never in shell text: ``--lr={lr}`` becomes the
    one word ``--lr=0.1``, which rv quotes as a whole for the job's shell like any other word, so the
    value reaches the program byte for byte whatever it holds (spaces, quotes, ``$``). ``{{NAME}}``
    is a literal ``{NAME}``; ``${...}`` is shell syntax and left alone (``${HOME}``); every other
    brace is literal (JSON in a word is untouched). A word that a shell reads as a script (the word
    after ``bash -c``, ``sh -lc``, ...) is different: a value there is re-read by that shell, so one
    the shell would split or expand is refused, pointing at ``"$RV_SWEEP_<NAME>"``, which the shell
    expands byte for byte. A ``{NAME}`` with no ``--sweep NAME`` is an error; a ``--sweep`` the
    command never uses is a warning (the program may read ``RV_SWEEP_<NAME>`` itself).

Arrays
    One Slurm job array runs the points; ``--parallel K`` caps how many run at once (``%K``). Slurm's
    ``MaxArraySize`` bounds the largest array *index*, not the count (see :func:`plan_arrays`), so a
    sweep of more points than that is split into several arrays whose task ids each start at 0; a
    task's point is the array's offset plus ``SLURM_ARRAY_TASK_ID``.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import posixpath
import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rv.errors import UsageError
from rv.names import point_name as point_name  # SWEEP/INDEX, how every view names a point

# A sweep this large is far more likely a typo (seed=0..1000000) than a plan: refused before the
# points are made. The user's queue limit (MaxSubmitJobs) is usually far lower and checked as well.
MAX_POINTS = 100_000

# Slurm's default MaxArraySize (slurm.conf(5)): what to assume when the cluster does not say.
SLURM_DEFAULT_MAX_ARRAY_SIZE = 1001

ENV_PREFIX = "RV_SWEEP_"
INDEX_ENV = "RV_SWEEP_INDEX"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
# Two numbers around "..": meant as a range, but not of integers. Other values holding ".." (a path
# like data/../x) are plain values.
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_ANY_RANGE = re.compile(_NUMBER + r"\.\." + _NUMBER)
# Left to right, the first that matches: shell parameter syntax (kept), an escaped placeholder, a
# placeholder. So `${HOME}` and `${{x}}` stay as typed and `{{x}}` is a literal `{x}`.
_TOKEN = re.compile(r"\$\{[^}]*\}|\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SHELLS = frozenset({"sh", "bash", "zsh", "dash", "ksh", "mksh"})
_SHELL_C = re.compile(r"-[A-Za-z]*c[A-Za-z]*")


@dataclass(frozen=True)
class Point:
    """One point: its index (``RV_SWEEP_INDEX``) and its value for each parameter, in the sweep's order."""

    index: int
    params: tuple[tuple[str, str], ...]

    @property
    def values(self) -> dict[str, str]:
        return dict(self.params)

    def env(self) -> dict[str, str]:
        """What the point's program sees beside rv's own variables."""
        return {INDEX_ENV: str(self.index), **{env_name(n): v for n, v in self.params}}

    def command(self, argv: Sequence[str]) -> tuple[str, ...]:
        """``argv`` with each ``{NAME}`` replaced by this point's value (see the module's rules)."""
        values = self.values
        return tuple(_substitute(word, values.__getitem__) for word in argv)


@dataclass(frozen=True)
class Sweep:
    names: tuple[str, ...]
    points: tuple[Point, ...]
    parallel: int | None  # --parallel K: at most K points at once; None: as many as Slurm starts
    source: str  # how the points were given, for messages

    def __len__(self) -> int:
        return len(self.points)


def env_name(name: str) -> str:
    """``lr`` -> ``RV_SWEEP_LR``: the variable each point's program reads its value from."""
    return ENV_PREFIX + name.upper()


def _substitute(word: str, value: Callable[[str], str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return "{" + m.group(1) + "}"
        if m.group(2) is not None:
            return value(m.group(2))
        return m.group(0)

    return _TOKEN.sub(one, word)


def placeholders(word: str) -> list[str]:
    """The ``{NAME}`` placeholders of one word, in order (escaped ones and ``${...}`` excluded)."""
    return [m.group(2) for m in _TOKEN.finditer(word) if m.group(2) is not None]


# --- parsing what the user typed -----------------------------------------------------------------


def _check_name(name: str, where: str) -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"{where}: {name!r} is not a usable parameter name",
            hint="use letters, digits and _ (not first a digit): each point's program reads it as "
            f"{ENV_PREFIX}<NAME>, so it must make a valid environment variable name",
        )
    if name.upper() == "INDEX":
        raise UsageError(
            f"{where}: the name {name!r} is taken: every point already sees {INDEX_ENV}",
            hint="pick another name for the parameter",
        )
    return name


def _range(item: str, name: str) -> range | None:
    m = _INT_RANGE.fullmatch(item)
    if m is None:
        if _ANY_RANGE.fullmatch(item):
            raise UsageError(
                f"--sweep {name}: {item!r} is not a range of integers: ranges (A..B) are of integers only",
                hint=f"list the values instead, e.g. --sweep {name}=1e-4,1e-3,1e-2",
            )
        return None
    lo, hi = int(m.group(1)), int(m.group(2))
    if lo > hi:
        raise UsageError(
            f"--sweep {name}: the range {item!r} is empty (it counts up: {lo} is above {hi})",
            hint=f"write {hi}..{lo}",
        )
    if hi - lo + 1 > MAX_POINTS:
        raise UsageError(
            f"--sweep {name}: the range {item!r} has {hi - lo + 1:,} values, over rv's limit of "
            f"{MAX_POINTS:,} points",
            hint="a sweep this size is likely a typo; narrow the range",
        )
    return range(lo, hi + 1)


def parse_sweep_option(text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME=V1,V2,A..B`` -> (name, values), the values in the order given, ranges expanded."""
    name, eq, rest = text.partition("=")
    name = name.strip()
    if not eq:
        raise UsageError(
            f"--sweep {text!r}: expected NAME=V1,V2,... (or NAME=A..B)",
            hint="e.g. --sweep lr=1e-4,3e-4 --sweep seed=0..4",
        )
    _check_name(name, f"--sweep {text!r}")
    if not rest.strip():
        raise UsageError(f"--sweep {name}: no values", hint=f"give at least one: --sweep {name}=V1,V2,...")
    values: list[str] = []
    for item in (part.strip() for part in rest.split(",")):
        if item == "":
            raise UsageError(
                f"--sweep {name}={rest}: an empty value between commas",
                hint="remove the extra comma; for a value holding a comma or an empty value use --sweep-file",
            )
        expanded = _range(item, name)
        if expanded is None:
            values.append(item)
        else:
            values.extend(str(i) for i in expanded)
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise UsageError(
                f"--sweep {name}: the value {v!r} is given twice (two points would be the same)",
                hint="list each value once",
            )
        seen.add(v)
    return name, tuple(values)


def _file_format(path: str, text: str) -> str:
    suffix = posixpath.splitext(path)[1].lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "JSON lines"
    if suffix == ".csv":
        return "CSV"
    first = text.lstrip()[:1]
    return "JSON lines" if first == "{" else "CSV"


def _json_value(value: object, key: str, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # numbers too: parsed with parse_int/parse_float=str, as spelled
        return value
    what = (
        "null"
        if value is None
        else type(value).__name__.replace("dict", "an object").replace("list", "a list")
    )
    raise UsageError(
        f"{where}: {key} is {what}; a value must be a string, number or true/false",
        hint="give every parameter a plain value on every line",
    )


def _pairs_without_duplicates(where: str) -> Callable[[list[tuple[str, object]]], dict[str, object]]:
    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        seen: dict[str, object] = {}
        for k, v in pairs:
            if k in seen:
                raise UsageError(f"{where}: the key {k!r} appears twice on the line", hint="keep one")
            seen[k] = v
        return seen

    return hook


def _rows_json(text: str, path: str) -> tuple[tuple[str, ...], list[tuple[int, tuple[str, ...]]]]:
    names: tuple[str, ...] | None = None
    rows: list[tuple[int, tuple[str, ...]]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(
                line, parse_int=str, parse_float=str, object_pairs_hook=_pairs_without_duplicates(where)
            )
        except ValueError as exc:
            raise UsageError(
                f"{where}: not a JSON object ({exc})",
                hint='each line is one object, e.g. {"lr": 1e-4, "seed": 0}',
            ) from None
        if not isinstance(obj, dict) or not obj:
            raise UsageError(
                f"{where}: not a JSON object with parameters",
                hint='each line is one object, e.g. {"lr": 1e-4, "seed": 0}',
            )
        if names is None:
            names = tuple(_check_name(k, where) for k in obj)
        elif set(obj) != set(names):
            missing = [n for n in names if n not in obj]
            extra = [k for k in obj if k not in names]
            said = "; ".join(
                part
                for part in (
                    f"lacks {', '.join(missing)}" if missing else "",
                    f"adds {', '.join(extra)}" if extra else "",
                )
                if part
            )
            raise UsageError(
                f"{where}: {said} (every line names the same parameters: {', '.join(names)})",
                hint="give every parameter a value on every line",
            )
        rows.append((lineno, tuple(_json_value(obj[n], n, where) for n in names)))
    return names or (), rows


def _rows_csv(text: str, path: str) -> tuple[tuple[str, ...], list[tuple[int, tuple[str, ...]]]]:
    # skipinitialspace: a quote after the padding still opens a quoted cell (`a, "b,c"`).
    reader = csv.reader(io.StringIO(text, newline=""), skipinitialspace=True)
    names: tuple[str, ...] | None = None
    rows: list[tuple[int, tuple[str, ...]]] = []
    for cells in reader:
        lineno = reader.line_num
        where = f"{path}:{lineno}"
        if not cells or all(c == "" for c in cells):
            continue
        if names is None:
            names = tuple(_check_name(c.strip(), f"{path}:{lineno} (the header)") for c in cells)
            continue
        cells = [c.strip() for c in cells]
        if len(cells) != len(names):
            raise UsageError(
                f"{where}: {len(cells)} value(s), but the header names {len(names)} ({', '.join(names)})",
                hint="one value per header column on every line",
            )
        for n, c in zip(names, cells, strict=True):
            if c == "":
                raise UsageError(
                    f"{where}: no value for {n}",
                    hint='fill the cell; for an empty value write the points as JSON lines with ""',
                )
        rows.append((lineno, tuple(cells)))
    return names or (), rows


def parse_sweep_file(text: str, path: str) -> tuple[tuple[str, ...], list[tuple[int, tuple[str, ...]]], str]:
    """A sweep file's text -> (names, [(line, values)], format). ``path`` names it in messages."""
    fmt = _file_format(path, text)
    names, rows = _rows_json(text, path) if fmt == "JSON lines" else _rows_csv(text, path)
    if not rows:
        raise UsageError(
            f"--sweep-file {path}: no points in it (read as {fmt})",
            hint='one point per line: {"lr": 1e-4, "seed": 0} (JSON lines) or a CSV header and rows',
        )
    first: dict[tuple[str, ...], int] = {}
    for lineno, values in rows:
        if values in first:
            raise UsageError(
                f"{path}:{lineno}: the same point as line {first[values]} ({_show(names, values)})",
                hint="list each point once",
            )
        first[values] = lineno
    return names, rows, fmt


def _show(names: Sequence[str], values: Sequence[str]) -> str:
    return ", ".join(f"{n}={v}" for n, v in zip(names, values, strict=True))


def build_sweep(
    options: Sequence[str] = (),
    *,
    file_text: str | None = None,
    file_name: str | None = None,
    parallel: int | None = None,
) -> Sweep:
    """The points of ``--sweep`` options and/or a ``--sweep-file`` (its text and name), validated."""
    axes = [parse_sweep_option(o) for o in options]
    file_names: tuple[str, ...] = ()
    file_rows: list[tuple[int, tuple[str, ...]]] = []
    source = []
    if file_text is not None:
        path = file_name or "<sweep file>"
        file_names, file_rows, fmt = parse_sweep_file(file_text, path)
        source.append(f"--sweep-file {path} ({fmt}, {len(file_rows)} line(s))")
    if axes:
        source.append("--sweep " + " x ".join(f"{n} ({len(v)} values)" for n, v in axes))
    if not axes and file_text is None:
        raise UsageError("a sweep needs --sweep NAME=V1,V2,... or --sweep-file FILE")
    names = (*file_names, *(n for n, _ in axes))
    seen: dict[str, str] = {}
    for n in names:
        if n.upper() in seen:
            same = (
                "given twice" if seen[n.upper()] == n else f"the same as {seen[n.upper()]!r} ({env_name(n)})"
            )
            raise UsageError(f"the parameter {n!r} is {same}", hint="each parameter once, in one place")
        seen[n.upper()] = n
    if parallel is not None and parallel < 1:
        raise UsageError(f"--parallel {parallel}: must be 1 or more", hint="e.g. --parallel 4")
    count = max(len(file_rows), 1) * math.prod(len(v) for _, v in axes)
    if count > MAX_POINTS:
        raise UsageError(
            f"the sweep has {count:,} points, over rv's limit of {MAX_POINTS:,}",
            hint="a sweep this size is likely a typo; fewer values, or several sweeps",
        )
    rows: Iterable[tuple[str, ...]] = [v for _, v in file_rows] if file_text is not None else [()]
    points = tuple(
        Point(i, tuple(zip(names, (*row, *combo), strict=True)))
        for i, (row, combo) in enumerate(itertools.product(rows, itertools.product(*(v for _, v in axes))))
    )
    return Sweep(names=names, points=points, parallel=parallel, source="; ".join(source))


def read_sweep_file(path: Path) -> tuple[str, str]:
    """(text, name for messages) of a ``--sweep-file``; a missing or unreadable one is a usage error."""
    try:
        # utf-8-sig: a byte-order mark at the start (Excel's "CSV UTF-8") is read as no text.
        return path.read_text(encoding="utf-8-sig"), str(path)
    except FileNotFoundError:
        raise UsageError(
            f"--sweep-file {path}: no such file", hint="give the path of a JSON lines or CSV file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--sweep-file {path}: cannot be read ({exc})", hint="a UTF-8 text file") from None


# --- the sweep against the command ---------------------------------------------------------------


def _script_words(command: Sequence[str]) -> set[int]:
    """Indexes of words a shell reads as a script: the word after ``-c`` (``-lc``...) of a shell."""
    out = set()
    shell_seen = False
    for i, word in enumerate(command):
        if posixpath.basename(word) in _SHELLS:
            shell_seen = True
        elif shell_seen and _SHELL_C.fullmatch(word) and i + 1 < len(command):
            out.add(i + 1)
    return out


def check_command(sweep: Sweep, command: Sequence[str]) -> list[str]:
    """Refuse a ``{NAME}`` with no ``--sweep NAME`` and unsafe values in shell script words;
    return warnings (a parameter the command never uses)."""
    if not command:
        raise UsageError(
            "a sweep needs a command", hint="rv run --sweep lr=1e-4,1e-3 -- python train.py --lr={lr}"
        )
    known = set(sweep.names)
    used: set[str] = set()
    for word in command:
        for name in placeholders(word):
            if name not in known:
                similar = [n for n in sweep.names if n.lower() == name.lower()]
                raise UsageError(
                    f"the command uses {{{name}}} but no --sweep {name} gives it values",
                    hint=f"write {{{similar[0]}}} (names are case-sensitive)"
                    if similar
                    else f"add --sweep {name}=V1,V2,... ; for a literal {{{name}}} write {{{{{name}}}}}",
                )
            used.add(name)
    for i in sorted(_script_words(command)):
        for name in sorted(set(placeholders(command[i]))):
            for point in sweep.points:
                value = point.values[name]
                if shlex.quote(value) != value:
                    raise UsageError(
                        f"{{{name}}} is in a script a shell reads ({command[i - 1]} ...), and the value "
                        f"{value!r} (point {point.index}) would be split or expanded by that shell",
                        hint=f'write "${env_name(name)}" there instead of {{{name}}}: the shell expands it '
                        "to the value byte for byte",
                    )
    text = "\0".join(command)
    return [
        f"--sweep {name}: the command never uses {{{name}}}; each point's program sees it only as "
        f"${env_name(name)}"
        for name in sweep.names
        if name not in used and env_name(name) not in text
    ]


def check_limits(count: int, *, max_jobs: int | None, queued: int = 0, limit: str = "MaxSubmitJobs") -> None:
    """Refuse more points than the user's queue takes: each array task counts as one job.

    ``max_jobs``: the user's limit (``MaxSubmitJobs`` of their association or QOS; None: no limit
    known); ``queued``: jobs of theirs already in the queue, which count against it too.
    """
    if max_jobs is None:
        return
    room = max_jobs - queued
    if count > room:
        already = f" and {queued} of your jobs are queued already" if queued else ""
        raise UsageError(
            f"the sweep has {count:,} points, but your queue limit ({limit}) is {max_jobs:,} jobs{already}: "
            "nothing was sent",
            hint=f"sweep at most {max(room, 0):,} points now (fewer values, or split the sweep), "
            "or wait for queued jobs to end",
        )


# --- job arrays ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayPart:
    """One ``sbatch --array``: task ``t`` (``SLURM_ARRAY_TASK_ID``) runs point ``points[t]``.

    A first submission's parts hold consecutive points (task ``t`` is point ``offset + t``); a retry's
    part holds whichever points failed. Either way the task ids are ``0..len(points)-1``.
    """

    points: tuple[int, ...]
    parallel: int | None
    after_previous: bool  # submitted with --dependency=afterany:<the previous part's array job>

    @property
    def count(self) -> int:
        return len(self.points)

    @property
    def offset(self) -> int:
        return self.points[0]

    @property
    def consecutive(self) -> bool:
        return self.points == tuple(range(self.offset, self.offset + self.count))

    @property
    def spec(self) -> str:
        """The ``--array=`` value: task ids from 0, ``%K`` when it limits anything."""
        ids = "0" if self.count == 1 else f"0-{self.count - 1}"
        return f"{ids}%{self.parallel}" if self.parallel is not None and self.parallel < self.count else ids

    def point(self, task_id: int) -> int:
        return self.points[task_id]

    def describe(self) -> str:
        if self.consecutive:
            return f"points {self.offset}-{self.points[-1]}" if self.count > 1 else f"point {self.offset}"
        return "points " + ",".join(str(p) for p in self.points)


def plan_arrays(
    points: int | Sequence[int],
    *,
    parallel: int | None,
    max_array_size: int,
    max_array_tasks: int | None = None,
) -> tuple[ArrayPart, ...]:
    """The arrays that run ``points`` (a count: points 0..count-1; or the indexes, e.g. a retry's), in
    order.

    slurm.conf(5), MaxArraySize: "The maximum job array task index value will be one less than
    MaxArraySize to allow for an index value of zero. Configure MaxArraySize to 0 in order to disable
    job array use." The bound is on the index, not the count: a second array cannot go on at index
    MaxArraySize, so every array's task ids start at 0 and the part says which point a task is.
    SchedulerParameters=max_array_tasks may cap the tasks of one array lower still (its default is
    MaxArraySize), hence ``max_array_tasks``.
    https://slurm.schedmd.com/job_array.html: "the minimum index value is zero and the maximum value
    is a Slurm configuration parameter (MaxArraySize minus one)"; "%" caps the tasks running at once.

    ``%K`` caps one array only: when the points need several arrays and ``parallel`` is set, each part
    after the first waits for the previous one to end (``afterany``), so at most K points ever run at
    once (a point's later segments are single jobs, outside any array, as for a plain run).
    """
    indexes = tuple(range(points)) if isinstance(points, int) else tuple(points)
    if not indexes:
        raise UsageError("a sweep needs at least one point")
    if max_array_size <= 0:
        raise UsageError(
            "this cluster disables job arrays (MaxArraySize=0 in its slurm.conf), so a sweep cannot run",
            hint="ask the admins, or run the points one by one with rv run",
        )
    per_array = max_array_size if max_array_tasks is None else max(1, min(max_array_size, max_array_tasks))
    parts: list[ArrayPart] = []
    for start in range(0, len(indexes), per_array):
        chunk = indexes[start : start + per_array]
        parts.append(ArrayPart(chunk, parallel, after_previous=bool(parts) and parallel is not None))
    return tuple(parts)


# --- names of points ----------------------------------------------------------------------------


def parse_point_ref(ref: str) -> tuple[str, int | None]:
    """``SWEEP/INDEX`` -> (sweep, index); ``SWEEP`` -> (sweep, None)."""
    sweep, slash, index = ref.rpartition("/")
    if not slash:
        return ref, None
    if not sweep or not index.isdigit():
        raise UsageError(
            f"{ref!r}: expected SWEEP or SWEEP/INDEX (INDEX a number)", hint="rv ps lists sweeps"
        )
    return sweep, int(index)


# --- --dry-run -----------------------------------------------------------------------------------


def dry_run_text(sweep: Sweep, command: Sequence[str], parts: Sequence[ArrayPart]) -> str:
    """What ``rv run --sweep ... --dry-run`` prints: the plan, then one line per point with the
    command it runs, as the job's shell will read it."""
    axes = ", ".join(sweep.names)
    at_once = (
        f"at most {sweep.parallel} at once"
        if sweep.parallel is not None
        else "as many at once as Slurm starts"
    )
    arrays = "; ".join(
        f"--array={p.spec}"
        + (f" ({p.describe()})" if len(parts) > 1 or not p.consecutive else "")
        + (" after the previous array ends" if p.after_previous else "")
        for p in parts
    )
    lines = [
        f"sweep of {len(sweep)} point(s) over {axes}, {at_once}",
        f"from {sweep.source}",
        f"{len(parts)} job array(s): {arrays}",
        "each point's program also sees " + ", ".join([INDEX_ENV, *(env_name(n) for n in sweep.names)]),
        "",
    ]
    header = ["INDEX", *sweep.names, "COMMAND"]
    rows = [[str(p.index), *(v for _, v in p.params), shlex.join(p.command(command))] for p in sweep.points]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines) + "\n"


def one_type_note(types: Sequence[str]) -> str:
    """What a sweep that could take several GPU types says of the one it takes (the first: each of
    them can serve every point, which all ask for the same). A point's array task is queued on one
    type: a sweep cannot be sent once per type as a run is, or its tasks would hold several places
    and --parallel could not hold."""
    first, others = types[0], types[1:]
    return (
        f"a sweep runs on one GPU type: {first}, the first that can serve it "
        f"(-t picks another: {', '.join(others)})"
    )
