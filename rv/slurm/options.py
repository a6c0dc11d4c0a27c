"""sbatch's own option names, and how sbatch reads a word as one of them. Pure.

sbatch reads its options (on the command line and on ``#SBATCH`` lines alike) with glibc's
``getopt_long``: a long option may be written as any prefix that only one option has (``--arr`` is
``--array``, ``--partit`` is ``--partition``), and a value follows ``=`` or comes as the next word.
A guard on what users may pass must therefore resolve a word the way sbatch does, against sbatch's
real list: :data:`LONG_OPTIONS` is that list for Slurm 22.05 (tests/captured holds sbatch's own
answer it was read from; an integration test asks the loopback cluster's sbatch again).
"""

from __future__ import annotations

from dataclasses import dataclass

# Every long option of sbatch 22.05, as its getopt table holds them (the ones `sbatch --help` leaves
# out included: --ntasks-per-tres, --cluster, --tasks-per-node, ...).
LONG_OPTIONS: tuple[str, ...] = (
    "account", "acctg-freq", "array",
    "batch", "bb", "bbf", "begin",
    "chdir", "cluster", "cluster-constraint", "clusters", "comment", "constraint", "container", "context",
    "contiguous", "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu", "cpus-per-task",
    "deadline", "delay-boot", "dependency", "distribution",
    "error", "exclude", "exclusive", "export", "export-file", "extra-node-info",
    "get-user-env", "gid", "gpu-bind", "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket",
    "gpus-per-task", "gres", "gres-flags",
    "help", "hint", "hold",
    "ignore-pbs", "input",
    "job-name",
    "kill-on-invalid-dep",
    "licenses",
    "mail-type", "mail-user", "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus",
    "network", "nice", "no-kill", "no-requeue", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core",
    "ntasks-per-gpu", "ntasks-per-node", "ntasks-per-socket", "ntasks-per-tres",
    "open-mode", "output", "overcommit", "oversubscribe",
    "parsable", "partition", "power", "prefer", "priority", "profile", "propagate",
    "qos", "quiet",
    "reboot", "requeue", "reservation",
    "signal", "sockets-per-node", "spread-job", "switches",
    "tasks-per-node", "test-only", "thread-spec", "threads-per-core", "time", "time-min", "tmp",
    "uid", "usage", "use-min-nodes",
    "verbose", "version",
    "wait", "wait-all-nodes", "wckey", "wrap",
)  # fmt: skip

# Options of later Slurm versions that ask for what rv sets itself (a GPU request by another name):
# known here so that a cluster newer than 22.05 cannot take them past the guard either.
LATER_OPTIONS: tuple[str, ...] = ("tres-per-task", "tres-bind")

# sbatch's one-letter options, by the long option each stands for (`sbatch --help`).
SHORT_OPTIONS: dict[str, str] = {
    "a": "array", "A": "account", "b": "begin", "B": "extra-node-info", "c": "cpus-per-task",
    "C": "constraint", "d": "dependency", "D": "chdir", "e": "error", "F": "nodefile", "G": "gpus",
    "h": "help", "H": "hold", "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses",
    "m": "distribution", "M": "clusters", "n": "ntasks", "N": "nodes", "o": "output", "O": "overcommit",
    "p": "partition", "q": "qos", "Q": "quiet", "s": "oversubscribe", "S": "core-spec", "t": "time",
    "v": "verbose", "V": "version", "w": "nodelist", "W": "wait", "x": "exclude",
}  # fmt: skip


@dataclass(frozen=True)
class Resolved:
    """What sbatch makes of one option word: the option (``name``), or why none."""

    word: str  # as typed: "--partit", "-p"
    name: str | None  # the long option sbatch reads, without dashes: "partition"
    candidates: tuple[str, ...] = ()  # a prefix several options share: sbatch refuses it as ambiguous


def resolve(word: str) -> Resolved:
    """The option sbatch reads for ``word`` (``--NAME`` or a prefix of it, or ``-X``).

    As getopt_long does: an exact name wins; else the one option the prefix begins (several:
    ambiguous, sbatch refuses it). A word of no known option resolves to None and no candidates:
    sbatch judges it (a newer Slurm may know it).
    """
    if not word.startswith("--"):
        return Resolved(word, SHORT_OPTIONS.get(word[1:]))
    text = word[2:]
    known = (*LONG_OPTIONS, *LATER_OPTIONS)
    if text in known:
        return Resolved(word, text)
    matches = tuple(name for name in known if name.startswith(text))
    if len(matches) == 1:
        return Resolved(word, matches[0])
    return Resolved(word, None, matches)
