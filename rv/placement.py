"""Where a run may start: Slurm's placement options, the GPU types it may take, and what to do on a
bad GPU. Pure: the CLI fills a ``PlacementOptions`` (rv.slurmoptions, from its table),
:func:`build_placement` checks it into a ``Placement``, the script renderer writes it, nothing here
talks to the cluster.

* Slurm's own words, each an ``#SBATCH`` line (the table of rv.slurmoptions: ``--partition``,
  ``--qos``, ...), ``--time-min`` (backfill, for programs that follow the stop protocol), and
  ``--sbatch OPT`` for anything else, written as on an ``#SBATCH`` line. What rv sets itself is
  refused in ``--sbatch`` with the rv flag to use instead, so the two never disagree.
* Several GPU types for one run (``-t a100,a6000``, ``-t any``, or no ``-t`` on a cluster of several
  types): :func:`candidate_types`. The run is submitted once per type; the first job to start claims
  the run on the cluster (rv/agent/job.sh, ``rv_claim``) and cancels the others.
* ``--max-fault-retries``: a segment that ends on a GPU or node fault continues on another node
  (job.sh, ``rv_fault``), at most this many times per run.
"""

from __future__ import annotations

import difflib
import math
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rv.catalog import GpuType
from rv.errors import UsageError
from rv.slurmoptions import DEFAULT_MAX_FAULT_RETRIES, Placement, PlacementOptions, refused, resolve

T = TypeVar("T")

# What may go into an #SBATCH value: sbatch splits directive lines on whitespace and reads quotes and
# backslashes itself; '%' is an output-file pattern, '#' would start a comment for a reader.
_UNSAFE = re.compile(r"[\s\"'\\%#]|[\x00-\x1f\x7f]")
_OPTION = re.compile(r"^(--[A-Za-z][A-Za-z0-9-]*|-[A-Za-z])(?:(=|\s+)(.*))?$")
# A short option with its value glued on, as getopt reads it: -N3, -o/tmp/x, -Jfoo, -wnode1.
_GLUED = re.compile(r"^(-[A-Za-z])([^=\s].*)$")
# sbatch's short options that take no value: after one of them getopt reads the next letter as another
# option (-Hk is -H -k), not as a value.
_SHORT_FLAGS = frozenset("hHkOQsvVW")

# Options rv sets itself (rv.slurmoptions.TABLE; rv.slurmoptions.resolve reads every spelling sbatch
# takes), with what the user should type instead. A job with both would be rv's guess against the
# user's: one of them silently loses.
_REFUSED = refused()

# Options every rv job dies of or is lost to, and why (rv/agent/job.sh needs the login environment,
# starts the program in the run's work dir, and rv follows jobs on the profile's cluster only).
_BREAKS: dict[str, tuple[str, str]] = {
    "chdir": ("rv starts each job in its run's own copy of the code ($RV_WORK_DIR)",
              "cd in the command instead: rv run -- bash -c 'cd DIR && ...'"),
    **dict.fromkeys(("clusters", "cluster"), ("rv follows a run's jobs on the profile's cluster only",
                                              "a profile for that cluster: rv init")),
    **dict.fromkeys(("help", "usage", "version"), ("sbatch would print text and queue nothing",
                                                   "man sbatch, on the cluster")),
}  # fmt: skip
_EXPORT_BREAKS = (
    "without ALL the job loses the environment it needs (PATH, HOME: it cannot even start bash)",
    "--sbatch=--export=ALL,NAME=value adds to it",
)


def check_value(flag: str, value: str | None) -> str | None:
    """A placement option's value, refused when it cannot go into an ``#SBATCH`` line."""
    if value is None:
        return None
    value = value.strip()
    if not value or _UNSAFE.search(value):
        raise UsageError(
            f"{flag} {value!r} cannot go into an #SBATCH line",
            hint="no spaces, quotes, backslashes, '%' or '#' (sbatch reads those itself)",
        )
    return value


def check_sbatch_option(text: str) -> str:
    """One ``--sbatch`` value: an sbatch option as on an ``#SBATCH`` line, never one rv sets itself.

    ``--begin=now+1hour``, ``--mail-type=END``, ``--exclusive``, ``-L lic`` pass through (sbatch
    itself checks them: ``rv run`` asks ``sbatch --test-only`` before anything is sent). An option rv
    sets (``--time=1h``, and ``--tim``, ``-t 1:00``: every spelling sbatch reads as it) is refused
    with the rv flag to use; one the job cannot run with (``--chdir``, ``--export=NONE``) with why.
    """
    text = text.strip()
    m = _OPTION.match(text)
    glued = None if m else _GLUED.match(text)
    if m:
        word, value = m.group(1), m.group(3)
    elif glued:
        word, value = glued.group(1), glued.group(2)
        if word[1] in _SHORT_FLAGS:
            raise UsageError(
                f"--sbatch {text!r}: sbatch reads it as {word} followed by more one-letter options",
                hint="one option per --sbatch: --sbatch=-H --sbatch=...",
            )
    else:
        raise UsageError(
            f"--sbatch {text!r} is not an sbatch option",
            hint="write it as on an #SBATCH line, e.g. --sbatch=--begin=now+1hour",
        )
    option = resolve(word)
    if option.candidates:
        raise UsageError(
            f"--sbatch {text!r}: {word} could be any of "
            + ", ".join(f"--{name}" for name in option.candidates),
            hint="write the option's whole name (sbatch refuses a prefix that several options share)",
        )
    spelled = (
        ""
        if option.name is None or word == f"--{option.name}"
        else f" (sbatch reads {word} as --{option.name})"
    )
    instead = _REFUSED.get(option.name or "")
    if instead is not None:
        raise UsageError(f"--sbatch {text!r}: rv sets --{option.name} itself{spelled}", hint=f"use {instead}")
    breaks = _BREAKS.get(option.name or "")
    if option.name == "export" and "ALL" not in (value or "").split(","):
        breaks = _EXPORT_BREAKS
    if breaks is not None:
        raise UsageError(f"--sbatch {text!r}: {breaks[0]}{spelled}", hint=breaks[1])
    if value is not None and (not value or _UNSAFE.search(value)):
        raise UsageError(
            f"--sbatch {text!r}: the value cannot go into an #SBATCH line",
            hint="no spaces, quotes, backslashes, '%' or '#' in it",
        )
    if value is None:
        return word
    # A short option's value is its next word: getopt would read `-L=lic` as the value "=lic".
    return f"{word}={value}" if word.startswith("--") else f"{word} {value}"


def build_placement(
    typed: PlacementOptions | None = None,
    /,
    *,
    sbatch: Sequence[str] = (),
    time_min: str | None = None,
    time_seconds: int | None = None,
    time_typed: bool = True,
    max_fault_retries: int | None = None,
    **values: str | None,
) -> Placement:
    """Check every placement option (before any network call) and return them as a Placement.
    ``typed``: the options as a command took them; or each as a keyword (``qos="high"``, ``sbatch=``).
    ``time_typed``: whether the job's --time was given (else ``time_seconds`` is rv's default)."""
    from rv.timespec import format_slurm_time, parse_duration

    if typed is None:
        typed = PlacementOptions(sbatch=sbatch, **values)
    elif sbatch or values:
        raise TypeError("build_placement takes the options as one PlacementOptions or as keywords, not both")
    time_min_seconds = None
    if time_min is not None:
        time_min_seconds = parse_duration(time_min, flag="--time-min")
        if time_seconds is not None and time_min_seconds > time_seconds:
            limit = format_slurm_time(time_seconds)
            which = f"--time {limit}" if time_typed else f"--time, rv's default {limit} (no --time was given)"
            raise UsageError(
                f"--time-min {time_min} is longer than the job's {which}",
                hint=f"--time-min is the least time a segment may get: at most {limit} (or a longer --time)",
            )
    if max_fault_retries is not None and max_fault_retries < 0:
        raise UsageError(
            f"--max-fault-retries {max_fault_retries}: must be 0 or more", hint="0 never retries"
        )
    return Placement(
        **{name: check_value(f"--{name}", value) for name, value in typed.values},
        sbatch=tuple(check_sbatch_option(text) for text in typed.sbatch),
        time_min_seconds=time_min_seconds,
        max_fault_retries=DEFAULT_MAX_FAULT_RETRIES if max_fault_retries is None else max_fault_retries,
    )


# --- GPU types -------------------------------------------------------------------------------------

ANY = "any"


def is_mig(gpu: GpuType) -> bool:
    """A MIG slice (a part of a GPU): never picked for a run that did not name it."""
    return gpu.name == "mig" or gpu.fixed_cpus == 1 or bool(re.fullmatch(r"\d+g\.\d+gb", gpu.gres))


def type_words(text: str | None) -> list[str] | None:
    """``-t`` as typed: None (not given), ``["any"]``, or the names in order of preference."""
    if text is None:
        return None
    words = [w.strip() for w in text.split(",")]
    if not all(words):
        raise UsageError(f"-t {text!r} has an empty type name", hint="e.g. -t a100,a6000 or -t any")
    if len(set(words)) != len(words):
        raise UsageError(f"-t {text!r} names a type twice")
    if ANY in words and len(words) > 1:
        raise UsageError(f"-t {text!r}: 'any' already means every type", hint="-t any, or a list of types")
    return words


def one_type(text: str | None, command: str) -> str | None:
    """``-t`` of a command that holds one allocation (``rv up``): one type, never a list or ``any``."""
    words = type_words(text)
    if words is None:
        return None
    if len(words) > 1 or words == [ANY]:
        raise UsageError(
            f"{command} takes one GPU type, not {text}: it holds one allocation, where rv run may start on "
            "the first of several",
            hint=f"name one, e.g. -t {words[0] if words != [ANY] else 'TYPE'} (rv status lists them)",
        )
    return words[0]


def candidate_types(
    catalog: Mapping[str, GpuType], words: list[str] | None, *, vram_gb: float | None = None
) -> tuple[list[GpuType], list[str]]:
    """The GPU types a run may take, in order of preference, and notes on the ones left out.

    ``words`` None (no ``-t``) or ``["any"]``: every full-GPU type of the catalog (never a MIG slice,
    which must be named), cheapest first where the catalog knows the rates. ``vram_gb``: only types
    with at least that much memory per GPU, as the catalog knows it (a type of unknown memory is left
    out). Whether each can serve the request (limits, time) is decided later, type by type.
    """
    notes: list[str] = []
    if words is None or words == [ANY]:
        pool = [t for t in catalog.values() if not is_mig(t)]
        pool.sort(key=lambda t: (t.su_per_gpu_hour is None, t.su_per_gpu_hour or 0.0, t.name))
    else:
        pool = []
        for word in words:
            if word not in catalog:
                close = difflib.get_close_matches(word, list(catalog), n=2)
                maybe = f" (did you mean {' or '.join(close)}?)" if close else ""
                raise UsageError(
                    f"unknown GPU type {word!r}{maybe}", hint=f"valid types: {', '.join(sorted(catalog))}"
                )
            pool.append(catalog[word])
    if vram_gb is not None:
        if not math.isfinite(vram_gb) or vram_gb <= 0:
            raise UsageError(
                f"--vram {vram_gb:g}: must be a number of GB per GPU, more than 0", hint="e.g. --vram 40"
            )
        unknown = [t.name for t in pool if t.vram_gb is None]
        small = [t.name for t in pool if t.vram_gb is not None and t.vram_gb < vram_gb]
        if unknown:
            notes.append(f"--vram {vram_gb:g}: left out {', '.join(unknown)} (memory unknown to the catalog)")
        if small:
            notes.append(f"--vram {vram_gb:g}: left out {', '.join(small)} (less memory per GPU)")
        pool = [t for t in pool if t.vram_gb is not None and t.vram_gb >= vram_gb]
    if not pool:
        named = [catalog[w] for w in words or () if w in catalog]
        if vram_gb is not None and named and all(t.vram_gb is None for t in named):
            which = ", ".join(t.name for t in named)
            raise UsageError(
                f"--vram {vram_gb:g}: the catalog does not know how much memory {which} has per GPU",
                hint=f"drop --vram to run on {which}, or set vram_gb for it in the profile's catalog",
            )
        if vram_gb is not None:
            raise UsageError(
                f"no GPU type of this cluster has {vram_gb:g} GB per GPU",
                hint=f"types and memory: {_memory_list(catalog)}",
            )
        raise UsageError("no GPU types are configured", hint="run rv init, or -g 0 for a CPU-only job")
    return pool, notes


def plan_requests(
    catalog: Mapping[str, GpuType],
    words: list[str] | None,
    *,
    gpus: int | None,
    mig: bool,
    vram_gb: float | None,
    build: Callable[[str | None], T],
) -> tuple[list[T], list[str]]:
    """The validated requests of a run, one per GPU type it may take (preferred first), and notes.

    ``build(type name or None)`` validates one request (``rv.request.build_request``), raising
    :class:`UsageError` when that type cannot serve it. A CPU job, a MIG slice, one named type (or a
    catalog of one type) is one request, exactly as without placement. Several types: each that
    cannot serve the request is left out with its reason; none left is an error with every reason.
    """
    single = words[0] if words and words != [ANY] else None
    if gpus == 0 or mig or (vram_gb is None and ((words is not None and words != [ANY] and len(words) == 1)
                                                 or (words is None and len(catalog) <= 1))):  # fmt: skip
        return [build(single)], []
    types, notes = candidate_types(catalog, words, vram_gb=vram_gb)
    built, refused, errors = [], [], []
    for gpu in types:
        try:
            built.append(build(gpu.name))
        except UsageError as exc:
            refused.append(f"{gpu.name}: {exc.message}")
            errors.append((gpu.name, exc))
    if not built and len({exc.message.replace(name, "") for name, exc in errors}) == 1:
        raise errors[0][1]  # the same reason whatever the type: say it once, as for one type
    if not built:
        raise UsageError(
            "no GPU type can serve this request: " + "; ".join(refused),
            hint="ask for less (-g, --time, --vram), or name a type with -t",
        )
    notes += [f"left out {reason}" for reason in refused]
    return built, notes


def _memory_list(catalog: Mapping[str, GpuType]) -> str:
    return ", ".join(
        f"{t.name} {t.vram_gb:g} GB" if t.vram_gb is not None else f"{t.name} ?" for t in catalog.values()
    )


# --- sbatch --test-only -----------------------------------------------------------------------------

_TEST_ONLY = re.compile(
    r"Job \d+ to start at (?P<start>\S+) using (?P<cpus>\d+) processors on nodes (?P<nodes>\S+)"
    r"(?: in partition (?P<partition>\S+))?"
)


@dataclass(frozen=True)
class Estimate:
    """What ``sbatch --test-only`` said of one candidate: when and where, or why not."""

    gpu_type: str
    start: str | None  # the cluster's local time, e.g. 2026-11-25T22:47:49
    nodes: str | None
    partition: str | None
    error: str | None  # sbatch refused it: the reason, in sbatch's words


def parse_test_only(gpu_type: str, exit_code: int, text: str) -> Estimate:
    """``sbatch --test-only``'s answer (it writes to stderr):
    ``sbatch: Job 4000050 to start at 2026-11-25T22:47:49 using 1 processors on nodes gpu-01 in
    partition gpu``, or ``sbatch: error: ...`` with a non-zero exit code."""
    m = _TEST_ONLY.search(text)
    if exit_code == 0 and m:
        return Estimate(gpu_type, m["start"], m["nodes"], m["partition"], None)
    # sbatch's getopt follows its own line ("sbatch: unrecognized option '--bell'") with a line that
    # says nothing of the job (`Try "sbatch --help" for more information`): the first is the reason.
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("Try ")]
    errors = [ln.split("error:", 1)[1].strip() for ln in lines if "error:" in ln]
    said = [ln.removeprefix("sbatch: ") for ln in lines]
    reason = "; ".join(errors) or ("; ".join(said) if said else f"sbatch --test-only exit {exit_code}")
    return Estimate(gpu_type, None, None, None, reason)


def probe_script(directives: Sequence[str]) -> str:
    """A script for ``sbatch --test-only``: the job's directives and nothing to run."""
    return "\n".join(["#!/bin/bash", *directives, "true"]) + "\n"


def shell_words(values: Sequence[str]) -> str:
    return " ".join(shlex.quote(v) for v in values)
