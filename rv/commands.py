"""rv's commands, written once: the module of each, its help line, and how it reaches the cluster.

Read by the CLI (rv.cli.main: the group and `rv --help`), by the front end (rv.entry, through
rv.remote.connect: which commands the command server runs) and by the command server (rv.forkserver: what
it imports ahead of time). Plain data with no imports: the front end reads it before anything else
is loaded. :func:`load` imports a command's module by its name, when the command is asked for: the
one way a command reaches another (`rv sync gc` is `rv gc`), so no command module imports another.
"""

from __future__ import annotations


class Command:
    """One command of the `rv` group.

    ``served``: the command server may run it in a forked copy (see rv.remote.connect.in_process_reason).
    Not the interactive ones: they need the terminal as their controlling terminal (job control,
    window size, a hidden prompt on /dev/tty).
    ``prewarm``: it only ever talks to the cluster (no local check that could refuse first), so its
    warm connection is started as soon as the profile is known (rv.remote.connect.prewarm).
    """

    __slots__ = ("attr", "help", "module", "prewarm", "served")

    def __init__(self, module: str, attr: str, help: str, *, served: bool, prewarm: bool = False) -> None:
        self.module, self.attr, self.help = module, attr, help
        self.served, self.prewarm = served, prewarm


# In the order `rv --help` lists them.
COMMANDS: dict[str, Command] = {
    "init": Command("rv.cli.init", "init", "Connect rv to a cluster and save a profile.", served=False),
    "exec": Command("rv.cli.exec", "exec_", "Run a command on the login node.", served=True, prewarm=True),
    "run": Command(
        "rv.cli.run", "run", "Snapshot this repo and start a run (continued across jobs).", served=True
    ),
    "ps": Command("rv.cli.ps", "ps", "List your runs and jobs.", served=True, prewarm=True),
    "logs": Command(
        "rv.cli.logs", "logs", "Show or follow a run's output, every segment.", served=True, prewarm=True
    ),
    "stop": Command("rv.cli.stop", "stop", "Stop runs.", served=True),
    "why": Command(
        "rv.cli.why",
        "why",
        "Why a run waits (and what would start it sooner), or why it ended.",
        served=True,
        prewarm=True,
    ),
    "wait": Command(
        "rv.cli.wait", "wait", "Wait until runs end (or run); exit with their code.", served=True
    ),
    "sweep": Command(
        "rv.cli.sweep", "sweep", "A sweep's results table, and a retry of its failed points.", served=True
    ),
    "metrics": Command(
        "rv.cli.sweep", "metrics", "A run's metrics ($RV_METRICS): last, best and trend.", served=True
    ),
    "up": Command(
        "rv.cli.up", "up", "A shell on a new allocation, released when the shell exits.", served=False
    ),
    "ssh": Command("rv.cli.ssh", "ssh", "A shell, or a command, on a node of a running job.", served=False),
    "gpu": Command(
        "rv.cli.gpu", "gpu", "What the GPUs of a running job are doing.", served=True, prewarm=True
    ),
    "code": Command(
        "rv.cli.code", "code", "VS Code (or another editor) on a session's node, by plain SSH.", served=False
    ),
    "jupyter": Command(
        "rv.cli.jupyter", "jupyter", "JupyterLab in a session, on this machine's browser.", served=False
    ),
    "forward": Command(
        "rv.cli.forward", "forward", "Forward a port of a running job's node to this machine.", served=False
    ),
    "status": Command(
        "rv.cli.status",
        "status",
        "Connection, account, storage by kind, jobs and free GPUs.",
        served=True,
        prewarm=True,
    ),
    "ckpt": Command("rv.cli.ckpt", "ckpt", "List and download a run's checkpoints.", served=True),
    "diff": Command("rv.cli.runfiles", "diff", "Show the code difference between two runs.", served=True),
    "checkout": Command(
        "rv.cli.runfiles",
        "checkout",
        "Write the files a run ran into a new folder (or a branch).",
        served=True,
    ),
    "gc": Command("rv.cli.gc", "gc", "Remove what finished runs left on the cluster.", served=True),
    "cost": Command("rv.cli.cost", "cost", "Estimate the SU cost of a job.", served=True),
    "stats": Command(
        "rv.cli.stats", "stats", "What a run used and cost: CPU, memory, GPU use, SUs; advice.", served=True
    ),
    "env": Command("rv.cli.secrets", "env", "Manage secrets passed to jobs.", served=False),
    "venv": Command(
        "rv.cli.venv", "venv", "List, build and remove the Python environments jobs run in.", served=True
    ),
    "sync": Command("rv.cli.sync", "sync", "Push, pull and watch files.", served=True),
    # Not served: a server for as long as it runs, stopped by Ctrl-C in its own terminal.
    "ui": Command(
        "rv.cli.ui", "ui", "A local web page of runs, sweeps, metrics and live logs.", served=False
    ),
}
ALIASES = {"ls": "ps", "cancel": "stop"}


def lookup(name: str) -> Command | None:
    """The command a name (or an alias) stands for; None for one rv does not have."""
    return COMMANDS.get(ALIASES.get(name, name))


def load(name: str) -> object:
    """The click command a name (or an alias) stands for, its module imported now; None for one rv
    does not have, or whose module is not written yet."""
    import importlib

    found = lookup(name)
    if found is None:
        return None
    try:
        module = importlib.import_module(found.module)
    except ModuleNotFoundError as exc:
        if exc.name != found.module:
            raise
        return None  # a command whose module is not written yet simply does not exist
    return getattr(module, found.attr)
