"""The launchers rv knows in a user's command, and what each may be told.

:func:`parse_launcher` splits ``torchrun ...``, ``accelerate launch ...`` (and their ``python -m`` and
``uv run`` forms) into the launcher, the user's launcher options and the program; the checks refuse
options that contradict the allocation (``--nproc-per-node`` other than the GPUs per node, a
``--master-addr`` on several nodes, ...) and a command without a launcher that would misuse GPUs.
:func:`rv.request.build_request` runs them; rv.slurm.launch adds the flags rv sets on each node.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from rv.errors import UsageError

# torchrun's options (torch 2.13 ``torch.distributed.run.get_args_parser``), canonical name first.
# Only these take no value; every other option takes one, as ``--opt value`` or ``--opt=value``.
_TORCHRUN_FLAGS_WITHOUT_VALUE = {
    "standalone",
    "module",
    "no-python",
    "run-path",
    "virtual-local-rank",
    "help",
}
_TORCHRUN_OPTIONS: dict[str, tuple[str, ...]] = {
    "nnodes": ("--nnodes",),
    "nproc-per-node": ("--nproc-per-node", "--nproc_per_node"),
    "rdzv-backend": ("--rdzv-backend", "--rdzv_backend"),
    "rdzv-endpoint": ("--rdzv-endpoint", "--rdzv_endpoint"),
    "rdzv-id": ("--rdzv-id", "--rdzv_id"),
    "rdzv-conf": ("--rdzv-conf", "--rdzv_conf"),
    "standalone": ("--standalone",),
    "max-restarts": ("--max-restarts", "--max_restarts"),
    "monitor-interval": ("--monitor-interval", "--monitor_interval"),
    "start-method": ("--start-method", "--start_method"),
    "event-log-handler": ("--event-log-handler", "--event_log_handler"),
    "role": ("--role",),
    "module": ("-m", "--module"),
    "no-python": ("--no-python", "--no_python"),
    "run-path": ("--run-path", "--run_path"),
    "log-dir": ("--log-dir", "--log_dir"),
    "redirects": ("-r", "--redirects"),
    "tee": ("-t", "--tee"),
    "local-ranks-filter": ("--local-ranks-filter", "--local_ranks_filter"),
    "duplicate-stdout-filters": ("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
    "duplicate-stderr-filters": ("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
    "node-rank": ("--node-rank", "--node_rank"),
    "master-addr": ("--master-addr", "--master_addr"),
    "master-port": ("--master-port", "--master_port"),
    "local-addr": ("--local-addr", "--local_addr"),
    "logs-specs": ("--logs-specs", "--logs_specs"),
    "numa-binding": ("--numa-binding", "--numa_binding"),
    "signals-to-handle": ("--signals-to-handle", "--signals_to_handle"),
    "shutdown-timeout": ("--shutdown-timeout", "--shutdown_timeout"),
    "virtual-local-rank": ("--virtual-local-rank", "--virtual_local_rank"),
    "help": ("-h", "--help"),
}
_TORCHRUN_SPELLING = {
    spelling: name for name, spellings in _TORCHRUN_OPTIONS.items() for spelling in spellings
}
# accelerate launch's options that take no value (accelerate 1.15, ``launch_command_parser``), with
# ``_`` for ``-`` (both spellings are accepted); every other option takes exactly one value. Its
# parser has ``allow_abbrev=False``: no prefixes.
_ACCELERATE_FLAGS_WITHOUT_VALUE = {
    "help", "quiet", "cpu", "multi_gpu", "tpu", "enable_cpu_affinity", "dynamo_use_fullgraph",
    "dynamo_use_dynamic", "dynamo_use_regional_compilation", "use_deepspeed", "use_fsdp",
    "use_parallelism_config", "use_megatron_lm", "same_network", "module", "no_python", "tpu_cluster",
    "no_tpu_cluster", "tpu_use_sudo", "downcast_bf16", "fp8_use_autocast_during_eval", "debug",
}  # fmt: skip
_ACCELERATE_SHORT = {"-h": "help", "-q": "quiet", "-m": "module", "-t": "tee"}
# accelerate launch's ways of choosing how processes are started: with none of them (and no config
# file) rv adds --multi_gpu for two or more processes, or accelerate starts a single one.
ACCELERATE_MODES = ("multi_gpu", "cpu", "tpu", "use_deepspeed", "use_fsdp", "use_megatron_lm", "config_file")
# `uv run`'s options that take a value (uv 0.13: `uv run --help`); every other one takes none.
_UV_RUN_OPTIONS_WITH_VALUE = {
    "--extra", "--no-extra", "--group", "--no-group", "--only-group", "--no-editable-package",
    "--env-file", "--with", "--with-editable", "--with-requirements", "--package", "--python-platform",
    "--index", "--default-index", "--index-url", "--extra-index-url", "--find-links", "--index-strategy",
    "--keyring-provider", "--upgrade-package", "--upgrade-group", "--resolution", "--prerelease",
    "--prerelease-package", "--fork-strategy", "--exclude-newer", "--exclude-newer-package",
    "--no-sources-package", "--reinstall-package", "--link-mode", "--config-setting",
    "--config-settings-package", "--no-build-isolation-package", "--no-build-package",
    "--no-binary-package", "--cache-dir", "--refresh-package", "--python", "--color",
    "--allow-insecure-host", "--directory", "--project", "--config-file",
    "-w", "-i", "-f", "-P", "-C", "-p",
}  # fmt: skip
PYTHON_EXE = re.compile(r"python(\d+(\.\d+)?)?")
# Python's own options that take a value (``python -W ignore -m torch.distributed.run``).
PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}
TORCHRUN_MODULE = "torch.distributed.run"
ACCELERATE_MODULE = "accelerate.commands.launch"
_LAUNCHER_MODULES = {TORCHRUN_MODULE: "torchrun", ACCELERATE_MODULE: "accelerate"}


@dataclass(frozen=True)
class LaunchArgs:
    """A launcher command split in three: launcher, the user's launcher options, the program.

    ``kind`` is ``torchrun`` (also ``python -m torch.distributed.run``) or ``accelerate``
    (``accelerate launch``, ``python -m accelerate.commands.launch``); ``launcher`` holds every word up
    to the launcher's options, a ``uv run [uv options]`` in front included.
    """

    launcher: tuple[str, ...]  # ("torchrun",), ("uv", "run", "--frozen", "accelerate", "launch"), ...
    options: tuple[str, ...]  # the user's own launcher options, exactly as typed
    program: tuple[str, ...]  # training script (or module with -m) and its arguments
    given: tuple[tuple[str, str | None], ...]  # canonical option name -> value (None for flags)
    kind: str = "torchrun"

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.given)

    def value(self, name: str) -> str | None:
        for n, v in reversed(self.given):  # argparse: the last one wins
            if n == name:
                return v
        return None

    @property
    def display(self) -> str:
        return "torchrun" if self.kind == "torchrun" else "accelerate launch"


TorchrunArgs = LaunchArgs  # the name before accelerate was recognised too


def _uv_run_len(command: Sequence[str]) -> tuple[int, bool]:
    """Words of a leading ``uv run [uv options]`` (0 when there is none), and whether ``-m`` was given."""
    if len(command) < 2 or posixpath.basename(command[0]) != "uv" or command[1] != "run":
        return 0, False
    i, module = 2, False
    while i < len(command):
        word = command[i]
        if word == "--":
            return i + 1, module
        if not word.startswith("-") or word == "-":
            break
        if word in ("-m", "--module"):
            module = True
        key = word.partition("=")[0] if word.startswith("--") else word[:2]
        attached = "=" in word if word.startswith("--") else len(word) > 2
        i += 2 if key in _UV_RUN_OPTIONS_WITH_VALUE and not attached else 1
    return i, module


def _launcher_len(command: Sequence[str]) -> tuple[str | None, int]:
    """(kind, how many leading words launch it), or (None, 0) when no launcher rv knows starts this."""
    start, uv_module = _uv_run_len(command)
    if uv_module:  # `uv run -m torch.distributed.run ...`
        kind = _LAUNCHER_MODULES.get(command[start]) if start < len(command) else None
        return (kind, start + 1) if kind else (None, 0)
    if start >= len(command):
        return None, 0
    exe = posixpath.basename(command[start])
    if exe == "torchrun":
        return "torchrun", start + 1
    if exe == "accelerate-launch":
        return "accelerate", start + 1
    if exe == "accelerate":
        return ("accelerate", start + 2) if list(command[start + 1 : start + 2]) == ["launch"] else (None, 0)
    if not PYTHON_EXE.fullmatch(exe):
        return None, 0
    i = start + 1
    while i < len(command):
        word = command[i]
        module = command[i + 1] if word == "-m" and i + 1 < len(command) else None
        if word.startswith("-m") and len(word) > 2:
            module = word[2:]
        if word.startswith("-m"):
            kind = _LAUNCHER_MODULES.get(module or "")
            return (kind, i + (2 if word == "-m" else 1)) if kind else (None, 0)
        if word in PYTHON_OPTIONS_WITH_VALUE:
            i += 2
            continue
        if word.startswith("-") and word != "-" and not word.startswith("-c"):
            i += 1
            continue
        return None, 0  # a script, -c code, or stdin: no launcher
    return None, 0


def _match_torchrun_option(word: str) -> str | None:
    """Canonical name of a torchrun option word (the part before ``=``), or None if unknown.

    argparse accepts unambiguous prefixes of long options (``--nproc 4``), so we do too.
    """
    if word in _TORCHRUN_SPELLING:
        return _TORCHRUN_SPELLING[word]
    if word.startswith("--"):
        names = {name for spelling, name in _TORCHRUN_SPELLING.items() if spelling.startswith(word)}
        if len(names) == 1:
            return names.pop()
    return None


def _option(kind: str, key: str) -> tuple[str | None, bool]:
    """(canonical name or None when unknown, whether it takes a value) of one option word."""
    if kind == "torchrun":
        name = _match_torchrun_option(key)
        return name, name is not None and name not in _TORCHRUN_FLAGS_WITHOUT_VALUE
    if key in _ACCELERATE_SHORT:
        name = _ACCELERATE_SHORT[key]
    elif key.startswith("--"):
        name = key[2:].replace("-", "_")
    else:
        return None, False
    return name, name not in _ACCELERATE_FLAGS_WITHOUT_VALUE


def parse_launcher(command: Sequence[str]) -> LaunchArgs | None:
    """Split a launcher command, or None when the command starts no launcher rv knows.

    Recognised, each also behind ``uv run [uv options]``: ``torchrun ...`` (any path),
    ``python[X[.Y]] [opts] -m torch.distributed.run ...``, ``accelerate launch ...``,
    ``accelerate-launch ...`` and ``python -m accelerate.commands.launch ...``. Options are read as the
    launcher's argparse reads them: ``--opt=value`` and ``--opt value``, ``-t3``, both ``-`` and ``_``
    spellings, and for torchrun unambiguous prefixes. An option rv does not know is kept as typed and
    assumed to take no value unless written with ``=`` (accelerate: every option but its flags takes
    one). Raises UsageError when an option that needs a value is last.
    """
    kind, n = _launcher_len(command)
    if kind is None:
        return None
    launcher, rest = tuple(command[:n]), list(command[n:])
    given: list[tuple[str, str | None]] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word == "--":  # argparse: everything after is positional
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        if word.startswith("--"):
            key, eq, inline = word.partition("=")
        elif len(word) > 2:  # -t3: short option with its value attached
            key, eq, inline = word[:2], "=", word[2:]
        else:
            key, eq, inline = word, "", ""
        name, takes_value = _option(kind, key)
        if name is None:
            given.append((key.lstrip("-"), inline if eq else None))
            i += 1
        elif not takes_value:
            given.append((name, None))
            i += 1
        elif eq:
            given.append((name, inline))
            i += 1
        elif i + 1 < len(rest):
            given.append((name, rest[i + 1]))
            i += 2
        else:
            shown = "torchrun" if kind == "torchrun" else "accelerate launch"
            raise UsageError(
                f"{shown} option {word} needs a value",
                hint=f"write {word}=VALUE before the script, e.g. {shown} {word}=... train.py",
            )
    return LaunchArgs(
        launcher=launcher, options=tuple(rest[:i]), program=tuple(rest[i:]), given=tuple(given), kind=kind
    )


def parse_torchrun(command: Sequence[str]) -> LaunchArgs | None:
    """:func:`parse_launcher` for torchrun only (``python -m torch.distributed.run`` included)."""
    parsed = parse_launcher(command)
    return parsed if parsed is not None and parsed.kind == "torchrun" else None


def check_torchrun(tr: LaunchArgs, *, nodes: int, gpus_per_node: int) -> None:
    """Refuse torchrun options that contradict the allocation, saying what rv will set instead."""
    nproc = tr.value("nproc-per-node")
    # "gpu" and "auto" count the visible GPUs, which is the allocation; any number must match it.
    if gpus_per_node > 0 and nproc not in (None, "gpu", "auto", str(gpus_per_node)):
        raise UsageError(
            f"torchrun --nproc-per-node={nproc} does not match the {gpus_per_node} GPU(s) per node "
            f"of this job ({nodes} node(s) x {gpus_per_node})",
            hint=f"drop --nproc-per-node: rv sets --nproc-per-node={gpus_per_node}",
        )
    nnodes = tr.value("nnodes")
    if nnodes is not None and nnodes not in (str(nodes), f"{nodes}:{nodes}"):
        raise UsageError(
            f"torchrun --nnodes={nnodes} does not match the {nodes} node(s) of this job",
            hint=f"drop --nnodes: rv sets --nnodes={nodes}, or ask for --nodes {nnodes} with rv",
        )
    if nodes > 1:
        if tr.has("standalone"):
            raise UsageError(
                f"torchrun --standalone runs on one node, but this job has {nodes} nodes",
                hint="drop --standalone: rv sets the rendezvous on the first node (--master-addr/-port)",
            )
        for name in ("rdzv-endpoint", "master-addr", "master-port"):
            if tr.has(name):
                raise UsageError(
                    f"torchrun --{name} on a {nodes}-node job: "
                    "the first node is only known when the job starts",
                    hint="drop it: rv sets --master-addr=<first node> --master-port=<port from the job id> "
                    "(or the c10d endpoint, with --rdzv-backend=c10d)",
                )
        backend = tr.value("rdzv-backend")
        if backend is not None and backend not in ("c10d", "static"):
            raise UsageError(
                f"torchrun --rdzv-backend={backend} on a {nodes}-node job",
                hint="drop it: rv sets a static rendezvous on the first node (or give --rdzv-backend=c10d)",
            )
        rank = tr.value("node-rank")
        if rank is not None:
            raise UsageError(
                f"torchrun --node-rank={rank} would give every node the same rank",
                hint="drop it: rv sets --node-rank=$SLURM_NODEID inside each node's task",
            )
    elif tr.value("node-rank") not in (None, "0"):
        raise UsageError(
            f"torchrun --node-rank={tr.value('node-rank')} on a one-node job",
            hint="drop it: the only node has rank 0",
        )


def accelerate_processes(la: LaunchArgs, *, nodes: int, gpus_per_node: int) -> int:
    """How many processes ``accelerate launch`` starts in all: one per GPU, else one per node."""
    given = la.value("num_processes")
    if gpus_per_node == 0 and given is not None and given.isdigit():
        return int(given)
    return nodes * max(1, gpus_per_node)


def check_accelerate(la: LaunchArgs, *, nodes: int, gpus_per_node: int) -> None:
    """Refuse accelerate launch options that contradict the allocation, saying what rv sets instead."""
    total = nodes * max(1, gpus_per_node)
    shape = f"{nodes} node(s) x {gpus_per_node} GPU(s)" if gpus_per_node else f"{nodes} node(s), no GPU"
    given = la.value("num_processes")
    if given is not None:
        if not given.isdigit() or int(given) < 1:
            raise UsageError(f"accelerate launch --num_processes={given} is not a number of processes")
        if gpus_per_node > 0 and int(given) != total:
            raise UsageError(
                f"accelerate launch --num_processes={given} does not match the {total} GPU(s) of this "
                f"job ({shape}): it counts processes on all nodes together",
                hint=f"drop --num_processes: rv sets --num_processes={total}",
            )
        if gpus_per_node == 0 and int(given) % nodes:
            raise UsageError(
                f"accelerate launch --num_processes={given} does not split evenly over {nodes} nodes",
                hint=f"use a multiple of {nodes}, or drop it: rv starts one process per node",
            )
    machines = la.value("num_machines")
    if machines is not None and machines != str(nodes):
        raise UsageError(
            f"accelerate launch --num_machines={machines} does not match the {nodes} node(s) of this job",
            hint=f"drop --num_machines: rv sets --num_machines={nodes}, or ask for --nodes {machines}",
        )
    if nodes > 1:
        if la.has("machine_rank"):
            raise UsageError(
                f"accelerate launch --machine_rank={la.value('machine_rank')} would give every node the "
                "same rank",
                hint="drop it: rv sets --machine_rank=$SLURM_NODEID inside each node's task",
            )
        for name in ("main_process_ip", "main_process_port"):
            if la.has(name):
                raise UsageError(
                    f"accelerate launch --{name} on a {nodes}-node job: the first node is only known "
                    "when the job starts",
                    hint="drop it: rv sets --main_process_ip=<first node> "
                    "--main_process_port=<port from the job id>",
                )
    elif la.value("machine_rank") not in (None, "0"):
        raise UsageError(
            f"accelerate launch --machine_rank={la.value('machine_rank')} on a one-node job",
            hint="drop it: the only node has rank 0",
        )
    processes = accelerate_processes(la, nodes=nodes, gpus_per_node=gpus_per_node)
    if la.has("multi_gpu") and processes < 2:
        raise UsageError(
            "accelerate launch --multi_gpu needs two or more processes; this job has one",
            hint="drop --multi_gpu, or ask for more GPUs with -g",
        )


def launch_ranks(la: LaunchArgs, *, nodes: int, gpus_per_node: int) -> int | None:
    """Processes the launcher starts over all nodes; None when only the node can tell (``auto``)."""
    if la.kind == "accelerate":
        return accelerate_processes(la, nodes=nodes, gpus_per_node=gpus_per_node)
    nproc = la.value("nproc-per-node")
    if nproc is None:
        return nodes * max(1, gpus_per_node)
    if nproc.isdigit():
        return nodes * int(nproc)
    return nodes * gpus_per_node if nproc == "gpu" and gpus_per_node else None


def check_plain(command: Sequence[str], *, nodes: int, gpus_per_node: int, each_node: bool,
                 allow_single_process: bool) -> None:  # fmt: skip
    """A command without a launcher: one process per node. Refuse what would silently misuse GPUs."""
    shown = shlex.join(command[:2]) + (" ..." if len(command) > 2 else "")
    if nodes > 1 and not each_node:
        raise UsageError(
            f"`{shown}` on {nodes} nodes would run {nodes} separate copies, one per node, that know "
            "nothing of each other",
            hint=f"start it with a launcher, which rv sets up across the nodes (rv run ... -- torchrun "
            f"{command[-1] if len(command) > 1 else 'train.py'}, or accelerate launch ...); or add "
            "--each-node to run one copy per node on purpose (each sees its node's GPUs, "
            "$SLURM_NODEID and $RV_HEAD_ADDR)",
        )
    if nodes == 1 and gpus_per_node > 1 and not (allow_single_process or each_node):
        raise UsageError(
            f"`{shown}` is one process, but this job has {gpus_per_node} GPUs: without a launcher it "
            f"runs once, sees all {gpus_per_node}, and most programs use only the first",
            hint="start one process per GPU with torchrun or accelerate launch (rv run -g "
            f"{gpus_per_node} -- torchrun train.py); or add --allow-single-process if the program uses "
            "every GPU itself (device_map='auto', DataParallel, its own launcher)",
        )
