"""Slurm's options: the ones rv takes or writes (:data:`TABLE`, one row each), sbatch's own names, and
how sbatch reads a word as one of them. Pure.

:data:`TABLE` is the one place a Slurm option rv knows is spelled. From it come ``rv run``'s and
``rv up``'s flags (rv.cli.layered, and so ``rv code``'s and ``rv jupyter``'s, which take rv up's), the
profile's keys (rv.config; ``[tool.rv]`` takes every flag), the run's ``#SBATCH`` lines
(rv.slurm.script) and the ``--sbatch`` guard (rv.placement: what rv sets itself is refused there).
Adding an option is a row here and a test (tests/unit/test_slurm_options.py shows each product).

sbatch reads its options (on the command line and on ``#SBATCH`` lines alike) with glibc's
``getopt_long``: a long option may be written as any prefix that only one option has (``--arr`` is
``--array``, ``--partit`` is ``--partition``), and a value follows ``=`` or comes as the next word.
A guard on what users may pass must therefore resolve a word the way sbatch does, against sbatch's
real list: :data:`LONG_OPTIONS` is that list for Slurm 22.05 (tests/captured holds sbatch's own
answer it was read from; an integration test asks the loopback cluster's sbatch again).
"""

from __future__ import annotations

from collections.abc import Iterable
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


# --- the table: every Slurm option rv takes as typed or writes itself --------------------------------

# The options rv's own code reads by name (the others it only passes on): named once, here.
PARTITION, QOS, CONSTRAINT, EXCLUDE, ACCOUNT = "partition", "qos", "constraint", "exclude", "account"


@dataclass(frozen=True)
class SlurmOption:
    """One row of :data:`TABLE`: an sbatch option that ``rv run`` and ``rv up`` take as typed (``help``
    set), or one rv writes from its own flags (``instead`` set), which ``--sbatch`` must not repeat."""

    name: str  # sbatch's long name: the flag (--NAME), the config key and the #SBATCH line's word
    help: str | None = None  # rv run's flag --NAME, with this help; None: rv's own flags ask for it
    metavar: str | None = None
    # The flag repeats, its config key a list of strings: --sbatch's texts, each a whole option of its
    # own (PlacementOptions.sbatch). Else one string, for one #SBATCH line (PlacementOptions.values).
    multiple: bool = False
    param: str | None = None  # click's parameter name, when not NAME (--sbatch's is sbatch_options)
    up: bool = True  # rv up takes it too (and so rv code and rv jupyter, which take rv up's options)
    # A profile may set it: a key of its name, the flag's default there (rv.config's Profile.placement).
    # account and sbatch are the profile's own older keys (Profile.account, Profile.sbatch).
    profile: bool = True
    # rv.slurm.script writes its #SBATCH line with the others the table writes, in the table's order;
    # False: the script writes it itself, where it always has, from the GPU type's and the profile's
    # values too (the partition, the type's node feature beside the user's, the profile's account).
    line: bool = True
    # An option rv writes from its own flags: what to use instead of --sbatch=--NAME (the guard).
    # Every option taken as typed is refused there too, pointing at its own flag.
    instead: str | None = None
    same: tuple[str, ...] = ()  # other sbatch options that ask for the same thing: refused alike

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def param_name(self) -> str:
        return self.param or self.name.replace("-", "_")

    @property
    def config_type(self) -> type:
        """What its key must hold in a profile and in ``[tool.rv]`` (rv.config, rv.cli.defaults)."""
        return list if self.multiple else str

    @property
    def typed(self) -> bool:
        """Taken as typed, one value: a string that goes into one #SBATCH line."""
        return self.help is not None and not self.multiple

    @property
    def refused_with(self) -> str | None:
        """What ``--sbatch=--NAME`` is refused with: the rv flag to use (None: it passes)."""
        return self.instead or (f"rv run {self.flag}" if self.typed else None)


_ONE_TASK = "nothing: rv runs one task per node and the launcher starts the ranks"
_LOGS = "nothing: rv keeps each job's logs (rv logs)"

TABLE: tuple[SlurmOption, ...] = (
    # Taken as typed by rv run and rv up, in the order their help lists them.
    SlurmOption(PARTITION, help="Slurm partition (default: the GPU type's).", line=False),
    SlurmOption(QOS, help="Slurm QoS, where the cluster requires or offers one."),
    SlurmOption(CONSTRAINT, help="Node features the job needs, e.g. ib or 'a100_80gb&ib'.", line=False),
    SlurmOption(EXCLUDE, help="Nodes never to run on, e.g. gpu-07,gpu-[10-12].", metavar="NODES"),
    SlurmOption("nodelist", help="Nodes to run on.", metavar="NODES", same=("nodefile",)),
    SlurmOption("reservation", help="A Slurm reservation to run in."),
    SlurmOption(ACCOUNT, help="Slurm account to charge (default: the profile's).", profile=False, line=False),
    # Not an sbatch option: every other one, as typed on an #SBATCH line (rv.placement checks each
    # against this table; rv.slurm.script writes them last).
    SlurmOption(
        "sbatch", help="Any other sbatch option, as on an #SBATCH line, e.g. --sbatch=--begin=now+1hour "
        "(repeatable). Options rv sets itself are refused with the rv flag to use.",
        metavar="OPT", multiple=True, param="sbatch_options", profile=False, line=False,
    ),
    # Written by rv from its own flags (rv.slurm.script), or never wanted: refused in --sbatch.
    SlurmOption("time", instead="rv run --time"),
    SlurmOption("time-min", instead="rv run --time-min"),
    SlurmOption("gres", instead="rv run -g/-t", same=(
        "gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket", "tres-per-task", "tres-bind")),
    SlurmOption("nodes", instead="rv run --nodes"),
    SlurmOption("ntasks-per-node", instead=_ONE_TASK, same=(
        "ntasks", "tasks-per-node", "ntasks-per-core", "ntasks-per-socket", "ntasks-per-gpu",
        "ntasks-per-tres")),
    SlurmOption("cpus-per-task", instead="rv run --cpus", same=("cpus-per-gpu",)),
    SlurmOption("mem", instead="rv run --mem", same=("mem-per-cpu", "mem-per-gpu")),
    SlurmOption("output", instead=_LOGS, same=("error", "open-mode", "input")),
    SlurmOption("signal", instead="rv run --signal"),
    SlurmOption("requeue", instead="nothing: rv's jobs requeue, and the runtime continues them",
                same=("no-requeue",)),
    SlurmOption("dependency", instead="nothing: rv chains a run's segments itself",
                same=("kill-on-invalid-dep",)),
    SlurmOption("job-name", instead="rv run --name"),
    SlurmOption("array", instead="rv run --sweep"),
    SlurmOption("wrap", instead="rv run -- COMMAND"),
    SlurmOption("parsable", instead="nothing: rv submits the job itself", same=("test-only", "wait")),
)  # fmt: skip

# What follows reads TABLE when asked, never a copy made at import: a row added is in every product.


def typed_names() -> tuple[str, ...]:
    """The options taken as typed, one string each (a PlacementOptions' keys), in the table's order."""
    return tuple(row.name for row in TABLE if row.typed)


def profile_keys() -> tuple[str, ...]:
    """The profile's keys that are flags' defaults (rv.config, rv.cli.layered), in the table's order."""
    return tuple(row.name for row in TABLE if row.help is not None and row.profile)


def flag_rows(*, up: bool = False) -> tuple[SlurmOption, ...]:
    """The rows ``rv run`` (``up``: ``rv up``) takes as flags, in the order its help lists them."""
    return tuple(row for row in TABLE if row.help is not None and (row.up or not up))


def refused() -> dict[str, str]:
    """The --sbatch guard: each sbatch option rv sets itself, with the rv flag to use instead."""
    return {name: row.refused_with for row in TABLE if row.refused_with for name in (row.name, *row.same)}


DEFAULT_MAX_FAULT_RETRIES = 2


@dataclass(frozen=True, init=False)
class PlacementOptions:
    """Slurm's options as typed (`rv run` and `rv up` take them alike): a value for each row of
    :data:`TABLE` given (``PlacementOptions(qos="high")``), and --sbatch's texts; not checked yet."""

    values: tuple[tuple[str, str], ...]  # (option, value) of each one given, in the table's order
    sbatch: tuple[str, ...]  # extra #SBATCH option texts, as typed ("--begin=now+1hour")

    def __init__(self, *, sbatch: Iterable[str] = (), **values: str | None) -> None:
        names = typed_names()
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise TypeError(f"{unknown[0]!r} is no option of rv.slurmoptions.TABLE")
        given = tuple((name, value) for name in names if (value := values.get(name)) is not None)
        object.__setattr__(self, "values", given)
        object.__setattr__(self, "sbatch", tuple(sbatch))

    def get(self, name: str) -> str | None:
        return next((value for key, value in self.values if key == name), None)

    @property
    def partition(self) -> str | None:
        return self.get(PARTITION)

    @property
    def qos(self) -> str | None:
        return self.get(QOS)

    @property
    def constraint(self) -> str | None:
        return self.get(CONSTRAINT)

    @property
    def exclude(self) -> str | None:
        return self.get(EXCLUDE)

    @property
    def account(self) -> str | None:
        return self.get(ACCOUNT)

    def table_lines(self) -> list[tuple[str, str]]:
        """(option, value) of each one given whose #SBATCH line the table writes (``line``), in order."""
        written = {row.name for row in TABLE if row.line}
        return [(name, value) for name, value in self.values if name in written and value]


@dataclass(frozen=True, init=False)
class Placement(PlacementOptions):
    """Slurm's options of one run, already checked (``#SBATCH``-safe) by rv.placement.build_placement,
    with what the run adds to them."""

    time_min_seconds: int | None
    max_fault_retries: int

    def __init__(
        self,
        *,
        time_min_seconds: int | None = None,
        max_fault_retries: int = DEFAULT_MAX_FAULT_RETRIES,
        sbatch: Iterable[str] = (),
        **values: str | None,
    ) -> None:
        super().__init__(sbatch=sbatch, **values)
        object.__setattr__(self, "time_min_seconds", time_min_seconds)
        object.__setattr__(self, "max_fault_retries", max_fault_retries)

    def sbatch_judges(self) -> bool:
        """Whether it holds what only sbatch can judge (a QoS, a node list, nodes to leave out...):
        then ``sbatch --test-only`` is asked before anything is sent, by ``rv run`` and ``rv up``."""
        return bool(any(value for _, value in self.values) or self.sbatch or self.time_min_seconds)
