"""Every error rv reports to a user, with its exit code and the next step to take.

Exit codes (also in docs/reference.md). Commands that run something remote (``rv exec``, ``rv run -f``)
exit with the remote program's own code when it ran; ``rv wait`` with the run's (the program's, or 1
for a run that ended without the program failing: stopped, cancelled, a time limit; several runs: 0
when all finished, else the first's that did not); rv's own failures use these:

====  ===========================================================================
code  meaning
====  ===========================================================================
0     success
1     unexpected error (a bug: rerun with RV_DEBUG=1 and report the traceback)
2     bad input: unknown option or value, a request the cluster would refuse
3     configuration: no config yet, unknown profile, invalid config file
4     cannot connect: host unreachable, connection refused, timeout
5     authentication refused
6     host key unknown and not accepted, or changed
7     a required command is missing on the cluster (sbatch, squeue, ...)
8     a remote operation failed (sbatch rejected the job, a transfer failed)
9     a job or file named on the command line does not exist
130   interrupted (Ctrl-C)
====  ===========================================================================
"""

from __future__ import annotations

# The next step when sbatch refuses a job (rv run, rv up, before or at submission).
PLACEMENT_HINT = (
    "check --partition, --qos, --account, --constraint, --exclude, --sbatch (rv status lists yours)"
)


class RvError(Exception):
    """An error with one clear line for the user and, where there is one, the next step."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(RvError):
    """Bad input, caught before anything touches the network."""

    exit_code = 2


class ConfigError(RvError):
    exit_code = 3


class ConnectError(RvError):
    exit_code = 4


class ConnectionLost(ConnectError):
    """The connection dropped while a command ran, before its exit status came: the command may have
    run. rv.remote.agent_client decides whether an agent call may be asked again (ON_LOST)."""


class AuthError(RvError):
    exit_code = 5


class HostKeyError(RvError):
    exit_code = 6


class RemoteCommandMissing(RvError):
    exit_code = 7


class RemoteError(RvError):
    exit_code = 8


class NotFound(RvError):
    exit_code = 9


EXIT_INTERRUPTED = 130


class Interrupted(RvError):
    """Ctrl-C, with what is known of what it cut short (sent, not sent, maybe sent)."""

    exit_code = EXIT_INTERRUPTED
