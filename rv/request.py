"""A job request, validated before anything touches the network.

:func:`build_request` turns what the user typed (``rv run -g 4 -t a6000 --time 6h -- torchrun
train.py``) into a :class:`JobRequest` the script renderer can trust, or raises
:class:`~rv.errors.UsageError` with the limit or the valid choices in the message. A bad GPU type
fails here in milliseconds, not after a sync and an sbatch round trip.

Rules that came from other tools' bug trackers (see the project's lessons notes):

* GPUs split over nodes only evenly; torchrun's ``--nproc-per-node`` must equal the GPUs on each
  node (accelerate's ``--num_processes`` the GPUs of all nodes), and a user's value that disagrees is
  refused here rather than deadlocking at rendezvous.
* A command without a launcher is one process per node: on several nodes (N copies that know nothing
  of each other) or on several GPUs of one node (one process, most programs use the first GPU only)
  it is refused unless ``--each-node`` / ``--allow-single-process`` say that is what is meant.
* CPUs and memory per GPU come from the catalog unless ``--cpus`` / ``--mem`` say otherwise.
* MIG slices take exactly one GPU, one CPU and modest memory, or the QOS rejects the job.
* The run name goes into paths and ``#SBATCH`` lines: a ``--name`` outside ``[A-Za-z0-9._-]{1,64}``
  is refused, never changed (two names must not become one run); a default name from the command
  maps what it cannot use, and the run id it ends with keeps it apart.
"""

from __future__ import annotations

import math
import posixpath
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rv.catalog import GpuType, Partition
from rv.contract import DEFAULT_STOP_LEAD_SECONDS, DEFAULT_STOP_SIGNAL, STOP_SIGNALS
from rv.errors import UsageError
from rv.launcher import (
    PYTHON_EXE,
    PYTHON_OPTIONS_WITH_VALUE,
    LaunchArgs,
    check_accelerate,
    check_plain,
    check_torchrun,
    launch_ranks,
    parse_launcher,
)
from rv.names import check_run_name, derive
from rv.timespec import (
    DEFAULT_TIME,
    format_slurm_time,
    mem_megabytes,
    parse_duration,
    parse_mem,
    parse_slurm_time,
    scale_mem,
)

# The stop signal and its lead time (long enough to write a checkpoint of a large model): see the
# stop protocol in rv.contract. rv's own watcher sends it, to the second, only to processes that
# handle it.
DEFAULT_SIGNAL = DEFAULT_STOP_SIGNAL
DEFAULT_SIGNAL_LEAD = DEFAULT_STOP_LEAD_SECONDS
SIGNALS = STOP_SIGNALS
# The longest time limit Slurm can hold: minutes in 32 bits, less INFINITE and NO_VAL.
SLURM_MAX_MINUTES = 0xFFFFFFFF - 2
# How many jobs one run may chain through before it stops continuing (`--max-segments`).
DEFAULT_MAX_SEGMENTS = 10


def resources_line(req: JobRequest) -> str:
    """What the job gets per node, and per GPU, and where each came from: `rv run` shows it."""
    head = (
        f"{req.nodes} node(s), CPU only"
        if req.type is None
        else f"{req.nodes} node(s) × {req.gpus_per_node} {req.type.name}"
    )
    per_gpu = req.gpus_per_node if req.type is not None and req.gpus_per_node > 0 else 0

    def part(value: str | None, source: str, what: str, per: str | None) -> str:
        if value is None:
            return f"the cluster's default {what} (the catalog has none per GPU here)"
        if source == "catalog" and per is not None:
            return f"{value} {what} ({per} per GPU, from the catalog)"
        return f"{value} {what} ({source})"

    cpus_per = str(req.cpus_per_task // per_gpu) if req.cpus_per_task is not None and per_gpu else None
    mem_per = req.type.mem_per_gpu if req.type is not None else None
    cpus = part(str(req.cpus_per_task) if req.cpus_per_task is not None else None, req.cpus_source,
                "CPUs", cpus_per)  # fmt: skip
    mem = part(req.mem, req.mem_source, "memory", mem_per)
    return f"resources: {head}; per node {cpus}, {mem}"


# --- the request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRequest:
    """Everything the script renderer needs from the user, checked. Sizes are per node where Slurm's are."""

    command: tuple[str, ...]
    name: str  # as typed (checked: [A-Za-z0-9._-]{1,64}, not starting with '-' or '.'), or derived
    type: GpuType | None  # None: CPU-only job
    gpus: int  # total over all nodes; 0 for CPU-only
    nodes: int
    gpus_per_node: int  # gpus // nodes
    time_seconds: int
    mem: str | None = None  # per node, Slurm form ("64G"); None: the cluster's default
    cpus_per_task: int | None = None  # one task per node, so CPUs per node; None: cluster default
    setup: tuple[str, ...] = ()  # shell lines run before the program (module load, source activate)
    # Paths relative to the work dir (the repo top), copied to the same place under $RV_OUTPUT_DIR
    # at the end; `-o` gives them relative to ``start_dir``, the folder the program starts in.
    outputs: tuple[str, ...] = ()
    mig: bool = False
    signal: str = DEFAULT_SIGNAL  # without SIG prefix: "USR1"
    signal_lead_seconds: int = DEFAULT_SIGNAL_LEAD
    max_segments: int = DEFAULT_MAX_SEGMENTS  # jobs the run may chain through (1: never continue)
    launch: LaunchArgs | None = None  # torchrun or accelerate launch, flags to add on each node
    each_node: bool = False  # a plain command, one copy per node on purpose (--each-node)
    allow_single_process: bool = False  # a plain command on several GPUs on purpose
    ranks: int | None = 1  # processes of the program over all nodes; None: only the node can tell
    cpus_source: str = "default"  # where cpus_per_task came from: --cpus, catalog, fixed for the type
    mem_source: str = "default"  # where mem came from: --mem, catalog
    warnings: tuple[str, ...] = ()  # for the CLI to print on stderr (renamed job, queue limits)

    @property
    def cpu_only(self) -> bool:
        return self.gpus == 0

    @property
    def torchrun(self) -> LaunchArgs | None:
        return self.launch if self.launch is not None and self.launch.kind == "torchrun" else None

    @property
    def labeled(self) -> bool:
        """Whether each line of output carries its rank (``[3] ...``): more than one process."""
        return self.ranks is None or self.ranks > 1

    @property
    def time_slurm(self) -> str:
        return format_slurm_time(self.time_seconds)


class RequestError(UsageError):
    """A request rv refuses, with what it proposes instead: each proposal (``suggestions``, the
    options to change, as :func:`build_request` keywords) is a request rv accepts."""

    def __init__(
        self, message: str, hint: str | None = None, suggestions: tuple[Mapping[str, Any], ...] = ()
    ) -> None:
        super().__init__(message, hint)
        self.suggestions = suggestions


@dataclass(frozen=True)
class _Option:
    """One proposal: its text in the hint, and the change to the request it stands for."""

    text: str
    change: Mapping[str, Any]


class _Unfit(Exception):
    """A refusal whose hint proposes changes; :func:`build_request` keeps those it would accept.

    Each of ``choices`` is one proposal, or a list of them tried in order of which the first accepted
    one is offered (``-g 8``, else ``-g 7``, ...). ``fallback`` is the hint when none is accepted.
    """

    def __init__(
        self,
        message: str,
        *choices: _Option | Sequence[_Option],
        lead: str = "use ",
        tail: str = "",
        fallback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.choices = choices
        self.lead, self.tail, self.fallback = lead, tail, fallback


def _valid_types(catalog: Mapping[str, GpuType]) -> str:
    return ", ".join(sorted(catalog)) or "(none configured)"


def _close_matches(word: str, choices: Iterable[str]) -> list[str]:
    import difflib

    return difflib.get_close_matches(word, list(choices), n=3, cutoff=0.5)


def _choose_type(
    catalog: Mapping[str, GpuType], gpu_type: str | None, mig: bool, gpus: int
) -> GpuType | None:
    if gpus == 0:
        if gpu_type is not None or mig:
            raise UsageError(
                f"-g 0 asks for no GPU, but {'--mig' if mig else '-t ' + str(gpu_type)} asks for one",
                hint="drop -g 0 for a GPU job, or drop the GPU type for a CPU-only job",
            )
        return None
    if mig:
        if "mig" not in catalog:
            raise UsageError(
                "--mig: this cluster's catalog has no type named 'mig'",
                hint=f"valid types: {_valid_types(catalog)}",
            )
        if gpu_type is not None and gpu_type != "mig":
            raise UsageError(
                f"--mig and -t {gpu_type} ask for two different GPU types",
                hint="use one: --mig for a MIG slice, or -t " + gpu_type,
            )
        return catalog["mig"]
    if gpu_type is None:
        if len(catalog) == 1:
            return next(iter(catalog.values()))
        raise UsageError(
            "which GPU type? this cluster has several" if catalog else "no GPU types are configured",
            hint=f"pass -t TYPE, one of: {_valid_types(catalog)}" if catalog else "run rv init, or -g 0",
        )
    if gpu_type not in catalog:
        close = _close_matches(gpu_type, catalog)
        maybe = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UsageError(
            f"unknown GPU type {gpu_type!r}{maybe}", hint=f"valid types: {_valid_types(catalog)}"
        )
    return catalog[gpu_type]


def _gpus_option(g: int, gpn: int, nodes: int | None = None) -> _Option:
    """``-g G`` as a proposal, with where it would land: "(1 node)", "(2 nodes of 3)"."""
    if nodes is not None:
        return _Option(f"-g {g}", {"gpus": g})
    need = math.ceil(g / gpn)
    where = "1 node" if need == 1 else f"{need} nodes of {g // need}"
    return _Option(f"-g {g} ({where})", {"gpus": g})


def _fewer_gpus(start: int, gpn: int, nodes: int | None = None) -> list[_Option]:
    """``-g`` proposals from ``start`` down to 1: the first that rv accepts is offered."""
    return [_gpus_option(g, gpn, nodes) for g in range(start, 0, -1)]


def _more_gpus(start: int, gpn: int, nodes: int | None = None) -> list[_Option]:
    """``-g`` proposals from ``start`` up (a bounded search): the first that rv accepts is offered."""
    return [_gpus_option(g, gpn, nodes) for g in range(start, start + 64)]


def _split_nodes(gpus: int, gpu: GpuType, nodes: int | None) -> tuple[int, int]:
    """(nodes, gpus per node) for ``gpus`` GPUs of type ``gpu``; raises when they do not split evenly.

    Each refusal proposes the nearest requests that would split, and only those that pass every other
    check too (see :class:`_Unfit`): a proposal the next run refuses is no help.
    """
    gpn = gpu.gpus_per_node
    if nodes is not None:
        if gpus % nodes:
            divisors = sorted((k for k in range(1, gpus + 1) if gpus % k == 0), key=lambda k: abs(k - nodes))
            raise _Unfit(
                f"-g {gpus} does not split evenly over --nodes {nodes}",
                _fewer_gpus(gpus - 1, gpn, nodes),
                _more_gpus(gpus + 1, gpn, nodes),
                [_Option(f"--nodes {k}", {"nodes": k}) for k in divisors],
                fallback=f"ask for a multiple of --nodes {nodes} with -g",
            )
        per = gpus // nodes
        if per > gpn:
            need = math.ceil(gpus / gpn)
            raise _Unfit(
                f"-g {gpus} over --nodes {nodes} is {per} per node, but {gpu.name} nodes have {gpn}",
                [_Option(f"--nodes {k}", {"nodes": k}) for k in range(need, gpus + 1) if gpus % k == 0],
                _fewer_gpus(nodes * gpn, gpn, nodes),
                fallback=f"ask for at most {gpn} GPU(s) per node",
            )
        return nodes, per
    if gpus <= gpn:
        return 1, gpus
    need = math.ceil(gpus / gpn)
    if gpus % need == 0:
        return need, gpus // need
    # Not even over the fewest nodes: say how to get there instead of picking a spread silently.
    spreads = [k for k in range(need + 1, gpus + 1) if gpus % k == 0 and gpus // k <= gpn]
    raise _Unfit(
        f"-g {gpus} on {gpu.name} ({gpn} per node) does not split evenly over {need} nodes",
        _fewer_gpus(gpus - 1, gpn),
        _more_gpus(gpus + 1, gpn),
        [_Option(f"--nodes {k} for {gpus // k} per node", {"nodes": k}) for k in spreads],
        fallback=f"{gpu.name} nodes have {gpn} GPUs: ask for a number that splits evenly over its nodes",
    )


def sanitise_name(name: str) -> str:
    """``[A-Za-z0-9._-]``, at most 64 characters, not starting with ``-`` or ``.``; '' if nothing is left.

    For the names rv derives from a command only (made unique with the run id afterwards): a name
    the user gives is used as typed or refused (:func:`rv.names.check_run_name`).
    """
    return derive(name)


def default_name(command: Sequence[str]) -> str:
    """A job name from the command: ``torchrun train.py`` -> ``train``, ``python -m pkg.grpo`` -> ``grpo``."""
    words = list(command)
    tr = parse_launcher(words)
    if tr is not None:
        words = ["python", *(["-m"] if tr.has("module") else []), *tr.program] if tr.program else [tr.kind]
    if not words:
        return "job"
    exe = posixpath.basename(words[0])
    target = exe
    if PYTHON_EXE.fullmatch(exe) or exe in ("bash", "sh", "zsh", "uv", "uvx"):
        rest = words[1:]
        if exe in ("uv",) and rest[:1] == ["run"]:
            return default_name(rest[1:]) if len(rest) > 1 else "uv"
        i = 0
        while i < len(rest):
            w = rest[i]
            if w == "-m" and i + 1 < len(rest):
                target = rest[i + 1].rsplit(".", 1)[-1]
                break
            if w == "-c":
                break
            if w in PYTHON_OPTIONS_WITH_VALUE:
                i += 2
                continue
            if w.startswith("-"):
                i += 1
                continue
            target = posixpath.basename(w)
            break
    stem = re.sub(r"\.(py|sh|bash)$", "", target)
    return sanitise_name(stem) or sanitise_name(exe) or "job"


def _parse_signal(signal: str | None, time_seconds: int) -> tuple[str, int]:
    if signal is None:
        # A short job still gets its warning, at half its length when that is under the default lead.
        return DEFAULT_SIGNAL, min(DEFAULT_SIGNAL_LEAD, max(1, time_seconds // 2))
    raw = signal
    name, at, lead_text = signal.strip().partition("@")
    name = name.upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise UsageError(
            f"unknown signal {raw!r}",
            hint=f"use one of {', '.join(SIGNALS)}, optionally with @SECONDS of warning, e.g. USR1@300",
        )
    if not at:
        return name, min(DEFAULT_SIGNAL_LEAD, max(1, time_seconds // 2))
    if not lead_text.isdigit() or not 0 < int(lead_text) <= 65535:
        raise UsageError(f"signal lead time in {raw!r} must be 1 to 65535 seconds", hint="e.g. USR1@300")
    lead = int(lead_text)
    if lead >= time_seconds:
        raise UsageError(
            f"signal {raw!r} would fire {lead} s before the end of a {time_seconds} s job, i.e. at once",
            hint="use a shorter lead or a longer --time",
        )
    return name, lead


def _check_outputs(outputs: Sequence[str], start_dir: str = "") -> tuple[str, ...]:
    """``-o`` paths, relative to the folder the program starts in, as paths relative to the work dir."""
    result = []
    where = f" (relative to {start_dir}/, where the program starts)" if start_dir else ""
    for path in outputs:
        if "\0" in path or "\n" in path or not path.strip():
            raise UsageError(
                f"-o {path!r} is not a usable path",
                hint="give a path relative to the folder you run `rv run` in",
            )
        norm = posixpath.normpath(posixpath.join(start_dir, path))
        if posixpath.isabs(path) or norm == ".." or norm.startswith("../") or norm == ".":
            raise UsageError(
                f"-o {path!r} must be a path inside the project{where}, not the project itself",
                hint="outputs are copied from the job's work dir into $RV_OUTPUT_DIR when the job ends",
            )
        result.append(norm)
    return tuple(dict.fromkeys(result))


def _setup_block(line: str) -> str:
    # As the job script runs each setup line: in a group of its own, so one with a stray `}` or an
    # unclosed `if` is an error here too, not a line that swallows the next one.
    return "{\n" + line + "\n}\n"


def check_setup_syntax(setup: Sequence[str], bash: str | None = None) -> None:
    """Refuse a setup line bash cannot parse (``bash -n``), before anything is sent.

    Without it a stray ``}`` failed only once the job had queued and started. Checked with the bash on
    this machine: where there is none, or only bash 3 (macOS's /bin/bash, which does not know bash 4
    syntax such as ``|&`` that the cluster's bash runs), the check is skipped and the job's own run of
    the line is the check.
    """
    lines = [line for line in setup if line.strip()]
    bash = bash or shutil.which("bash")
    if not lines or bash is None:
        return

    def parses(text: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30)

    if parses("".join(_setup_block(line) for line in lines)).returncode == 0:
        return
    version = subprocess.run(
        [bash, "-c", 'printf %s "${BASH_VERSINFO[0]}"'], capture_output=True, text=True, timeout=30
    ).stdout
    if not version.isdigit() or int(version) < 4:
        return
    for line in lines:
        result = parses(_setup_block(line))
        if result.returncode != 0:
            said = result.stderr.strip().splitlines()
            # "/usr/bin/bash: line 2: syntax error ...": the line number is of rv's wrapping, not theirs.
            why = (
                re.sub(r"^\S*bash: (line \d+: )?", "", said[0]) if said else f"exit code {result.returncode}"
            )
            raise UsageError(
                f"setup line {line!r} is not valid bash: {why}",
                hint="fix the line (rv checks each with bash before sending anything); nothing was sent",
            )


def _positive(value: int | None, flag: str, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{flag} {value} must be at least {minimum}")


def build_request(
    catalog: Mapping[str, GpuType],
    *,
    command: Sequence[str],
    gpus: int | None = None,
    gpu_type: str | None = None,
    mig: bool = False,
    time: str | None = None,
    mem: str | None = None,
    cpus: int | None = None,
    name: str | None = None,
    nodes: int | None = None,
    setup: Sequence[str] = (),
    outputs: Sequence[str] = (),
    start_dir: str = "",
    signal: str | None = None,
    max_segments: int | None = None,
    each_node: bool = False,
    allow_single_process: bool = False,
    partitions: Mapping[str, Partition] | None = None,
    partition: str | None = None,
) -> JobRequest:
    """Validate a run request; raise UsageError with the limit or the valid choices when it cannot run.

    ``gpus`` None means 1 (or the MIG slice); 0 is a CPU-only job. ``time`` None means
    :data:`~rv.timespec.DEFAULT_TIME`. ``signal`` is ``NAME[@SECONDS]`` (default USR1, 300 s before
    the end, or half the job when shorter). Going over a type's per-user limit alone is an error (the
    job would never start). ``outputs`` (``-o``) are
    relative to ``start_dir``, the folder the program starts in relative to the repo top.
    ``partitions`` (the profile's, as `rv init` found them) hold the time and node limits of the
    partition each job goes to: ``partition`` (--partition), else its type's; a CPU-only job's is the
    cluster's default partition.

    A refusal that proposes other values (``-g``, ``--nodes``, ``--time``) raises
    :class:`RequestError` whose proposals have each been run through this same validation and
    accepted: a hint never proposes what the next run would refuse.
    """
    asked = {k: v for k, v in locals().items() if k != "catalog"}
    try:
        return _build(catalog, **asked)
    except _Unfit as unfit:
        kept: list[_Option] = []
        for choice in unfit.choices:
            for option in [choice] if isinstance(choice, _Option) else choice:
                if option.text in {k.text for k in kept}:
                    continue
                if _accepted(catalog, asked, option.change):
                    kept.append(option)
                    break
        hint = unfit.lead + " or ".join(o.text for o in kept) + unfit.tail if kept else unfit.fallback
        raise RequestError(
            unfit.message, hint=hint, suggestions=tuple(dict(o.change) for o in kept)
        ) from None


def _accepted(catalog: Mapping[str, GpuType], asked: Mapping[str, Any], change: Mapping[str, Any]) -> bool:
    """Whether the request with ``change`` made passes every check (the setup lines' bash aside)."""
    try:
        _build(catalog, **{**asked, **change}, probe=True)
    except (_Unfit, UsageError):
        return False
    return True


def _build(
    catalog: Mapping[str, GpuType],
    *,
    command: Sequence[str],
    gpus: int | None,
    gpu_type: str | None,
    mig: bool,
    time: str | None,
    mem: str | None,
    cpus: int | None,
    name: str | None,
    nodes: int | None,
    setup: Sequence[str],
    outputs: Sequence[str],
    start_dir: str,
    signal: str | None,
    max_segments: int | None,
    each_node: bool,
    allow_single_process: bool,
    partitions: Mapping[str, Partition] | None,
    partition: str | None = None,
    probe: bool = False,
) -> JobRequest:
    """:func:`build_request`'s checks; ``probe`` (a proposal being tried) skips the bash check."""
    command = tuple(command)
    if not command or not command[0].strip():
        raise UsageError("no command to run", hint="rv run [OPTIONS] -- COMMAND [ARGS...]")
    if any("\0" in word for word in command):
        raise UsageError("the command contains a NUL byte, which no program can receive")
    warnings: list[str] = []
    _positive(gpus, "-g", minimum=0)
    _positive(nodes, "--nodes")
    _positive(cpus, "--cpus")
    _positive(max_segments, "--max-segments")

    wanted = 1 if gpus is None else gpus
    gpu = _choose_type(catalog, gpu_type, mig, wanted)
    is_mig = gpu is not None and (mig or gpu.name == "mig")

    if gpu is not None and is_mig and wanted != 1:
        raise UsageError(
            f"a MIG slice is one GPU; -g {wanted} cannot use --mig", hint="drop -g, or pick a full GPU type"
        )

    target, where = _target_partition(partitions or {}, partition, gpu)
    time_seconds = _checked_time(time or DEFAULT_TIME, gpu, target, where)
    node_count, per_node = _nodes(gpu, wanted, nodes, target, where)
    cpus_per_task, cpus_source = _cpus(gpu, cpus, per_node)
    mem_norm, mem_source = _memory(gpu, mem, per_node, is_mig)
    launch, ranks = _launcher(command, node_count, per_node, each_node, allow_single_process, warnings)

    # A name is used exactly as typed or refused: two names must never become one run.
    job_name = check_run_name(name) if name is not None else default_name(command)

    sig, lead = _parse_signal(signal, time_seconds)

    for line in setup:
        if "\0" in line:
            raise UsageError("a --setup line contains a NUL byte")
    if not probe:
        check_setup_syntax(setup)

    return JobRequest(
        command=command,
        name=job_name,
        type=gpu,
        gpus=wanted if gpu is not None else 0,
        nodes=node_count,
        gpus_per_node=per_node,
        time_seconds=time_seconds,
        mem=mem_norm,
        cpus_per_task=cpus_per_task,
        setup=tuple(line for line in setup if line.strip()),
        outputs=_check_outputs(outputs, start_dir),
        mig=is_mig,
        signal=sig,
        signal_lead_seconds=lead,
        max_segments=DEFAULT_MAX_SEGMENTS if max_segments is None else max_segments,
        launch=launch,
        each_node=each_node,
        allow_single_process=allow_single_process,
        ranks=ranks,
        cpus_source=cpus_source,
        mem_source=mem_source,
        warnings=tuple(warnings),
    )


def _target_partition(
    known: Mapping[str, Partition], named: str | None, gpu: GpuType | None
) -> tuple[Partition | None, str]:
    """The partition the job goes to: the one --partition names, its type's, or for a CPU-only job
    the cluster's default one (one rv does not know is left to sbatch --test-only to judge); and
    how messages name it."""
    if named is not None:
        return known.get(named), f"partition {named}"
    if gpu is not None:
        return known.get(gpu.partition), f"partition {gpu.partition}"
    target = next((p for p in known.values() if p.default), None)
    return target, f"partition {target.name} (the default, where CPU-only jobs go)" if target else ""


def _checked_time(asked_time: str, gpu: GpuType | None, target: Partition | None, where: str) -> int:
    """--time in seconds. Time first: every later message can then quote it. The tightest known
    limit applies: the type's (policy, QOS) and its partition's; over either the job pends forever."""
    time_seconds = parse_duration(asked_time)
    if time_seconds // 60 > SLURM_MAX_MINUTES:
        # Slurm keeps minutes in 32 bits and wraps a larger --time silently (99999999d: 8,000 years).
        raise UsageError(
            f"--time {asked_time} is more than Slurm can hold ({format_slurm_time(SLURM_MAX_MINUTES * 60)})",
            hint="ask for the time the job needs",
        )
    limits = []
    if gpu is not None and gpu.max_time and parse_slurm_time(gpu.max_time) is not None:
        limits.append((parse_slurm_time(gpu.max_time) or 0, f"the {gpu.name} limit of {gpu.max_time}"))
    if target is not None and target.max_time and parse_slurm_time(target.max_time) is not None:
        limits.append((parse_slurm_time(target.max_time) or 0, f"the limit of {where}, {target.max_time}"))
    if target is not None and target.qos_max_time and parse_slurm_time(target.qos_max_time):
        limits.append(
            (
                parse_slurm_time(target.qos_max_time) or 0,
                f"the limit of QOS {target.qos} (your account's there), {target.qos_max_time}",
            )
        )
    if limits:
        limit, which = min(limits)
        if time_seconds > limit:
            longest = format_slurm_time(limit)
            raise _Unfit(
                f"--time {asked_time} is over {which}: the job would wait in the queue forever",
                _Option(f"--time {longest}", {"time": longest}),
                tail=" or less",
                fallback=f"the most it allows is {longest}",
            )
    return time_seconds


def _nodes(
    gpu: GpuType | None, wanted: int, nodes: int | None, target: Partition | None, where: str
) -> tuple[int, int]:
    """(nodes, GPUs per node): the type's per-job and per-user limits first ("at most 8 per job" is
    the more useful thing to hear), then the split, then what the type and the partition have."""
    if gpu is not None:
        if gpu.max_gpus_per_job is not None and wanted > gpu.max_gpus_per_job:
            raise _Unfit(
                f"-g {wanted}: {gpu.name} allows at most {gpu.max_gpus_per_job} GPU(s) per job",
                _fewer_gpus(gpu.max_gpus_per_job, gpu.gpus_per_node, nodes),
            )
        if gpu.max_gpus_per_user is not None and wanted > gpu.max_gpus_per_user:
            raise _Unfit(
                f"-g {wanted}: {gpu.name} allows at most {gpu.max_gpus_per_user} GPU(s) per user",
                _fewer_gpus(gpu.max_gpus_per_user, gpu.gpus_per_node, nodes),
            )

    if gpu is None:
        node_count, per_node = (nodes or 1), 0
    else:
        if gpu.nodes is not None and wanted > gpu.nodes * gpu.gpus_per_node:
            # More than all of them: say that, not how the number fails to split.
            most = gpu.nodes * gpu.gpus_per_node
            raise _Unfit(
                f"-g {wanted}: the cluster has {gpu.nodes} {gpu.name} node(s) of {gpu.gpus_per_node}, "
                f"{most} GPUs in all",
                _fewer_gpus(most, gpu.gpus_per_node, nodes),
                fallback=f"at most {most} GPUs of this type",
            )
        node_count, per_node = _split_nodes(wanted, gpu, nodes)
        # Slurm accepts a job that asks for more nodes than the partition has and leaves it pending
        # forever; say so now instead.
        if gpu.nodes is not None and node_count > gpu.nodes:
            most = gpu.nodes * gpu.gpus_per_node
            raise _Unfit(
                f"-g {wanted} on {gpu.name} needs {node_count} nodes of {per_node} GPU(s), but the "
                f"cluster has {gpu.nodes} {gpu.name} node(s) ({most} GPUs)",
                _fewer_gpus(most, gpu.gpus_per_node, nodes),
                [_Option(f"--nodes {k}", {"nodes": k}) for k in range(gpu.nodes, 0, -1)] if nodes else [],
                fallback=f"the cluster has {gpu.nodes} {gpu.name} node(s)",
            )
    # The partition's own node counts: all of its nodes, and the most one job may have.
    if target is not None:
        asking = f"--nodes {node_count}" if gpu is None else f"-g {wanted} needs {node_count} node(s), but"
        for cap, what in (
            (target.nodes, "has {} node(s)"),
            (target.max_nodes, "allows {} node(s) per job"),
        ):
            if cap is not None and node_count > cap:
                raise _Unfit(
                    f"{asking}: {where} {what.format(cap)}: the job would wait in the queue forever",
                    [_Option(f"--nodes {k}", {"nodes": k}) for k in range(cap, 0, -1)]
                    if gpu is None
                    else _fewer_gpus(cap * gpu.gpus_per_node, gpu.gpus_per_node, nodes),
                    fallback=f"at most {cap} node(s) there",
                )
    return node_count, per_node


def _cpus(gpu: GpuType | None, cpus: int | None, per_node: int) -> tuple[int | None, str]:
    """CPUs per task and where the number came from: MIG (and any type with fixed_cpus) forces its
    own, which QOS insists on."""
    if gpu is not None and gpu.fixed_cpus is not None:
        if cpus is not None and cpus != gpu.fixed_cpus:
            raise UsageError(
                f"--cpus {cpus}: a {gpu.name} job gets exactly {gpu.fixed_cpus} CPU(s)",
                hint="drop --cpus",
            )
        return gpu.fixed_cpus, f"fixed for {gpu.name}"
    if cpus is not None:
        return cpus, "--cpus"
    if gpu is not None and gpu.cpus_per_gpu is not None:
        return gpu.cpus_per_gpu * per_node, "catalog"
    return None, "default"


def _memory(gpu: GpuType | None, mem: str | None, per_node: int, is_mig: bool) -> tuple[str | None, str]:
    """--mem normalised and where it came from: given, the type's per GPU, or Slurm's default; a MIG
    slice may not have more than its own."""
    mem_norm = parse_mem(mem) if mem is not None else None
    mem_source = "--mem" if mem_norm is not None else "default"
    if gpu is not None and gpu.mem_per_gpu is not None:
        type_mem = scale_mem(gpu.mem_per_gpu, per_node)
        if mem_norm is None:
            mem_norm, mem_source = type_mem, "catalog"
        elif is_mig and mem_megabytes(mem_norm) > mem_megabytes(type_mem):
            raise UsageError(
                f"--mem {mem}: a MIG slice job may have at most {type_mem}",
                hint="drop --mem, or pick a full GPU type for more memory",
            )
    return mem_norm, mem_source


def _launcher(
    command: tuple[str, ...],
    node_count: int,
    per_node: int,
    each_node: bool,
    allow_single_process: bool,
    warnings: list[str],
) -> tuple[LaunchArgs | None, int | None]:
    """The command's launcher (torchrun, accelerate) checked against the split, and how many ranks
    the job runs; a plain command is checked for what it would waste."""
    launch = parse_launcher(command)
    if launch is None:
        check_plain(
            command, nodes=node_count, gpus_per_node=per_node, each_node=each_node,
            allow_single_process=allow_single_process,
        )  # fmt: skip
        return None, node_count if each_node else 1
    for flag, given in (("--each-node", each_node), ("--allow-single-process", allow_single_process)):
        if given:
            raise UsageError(
                f"{flag} is for a command without a launcher: {launch.display} already starts one "
                "process per GPU on every node",
                hint=f"drop {flag}",
            )
    if launch.kind == "torchrun":
        check_torchrun(launch, nodes=node_count, gpus_per_node=per_node)
    else:
        check_accelerate(launch, nodes=node_count, gpus_per_node=per_node)
    if not launch.program:
        raise UsageError(
            f"{launch.display} has no training script",
            hint=f"e.g. rv run -g 2 -- {launch.display} train.py",
        )
    if launch.has("run-path"):
        warnings.append(
            "torchrun --run-path runs the ranks inside torchrun's own interpreter, where rv cannot "
            "label their lines: output of different ranks may mix (drop --run-path to label them)"
        )
    return launch, launch_ranks(launch, nodes=node_count, gpus_per_node=per_node)
