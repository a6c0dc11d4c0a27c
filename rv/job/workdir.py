"""Where a job's work dir lives, and what a run costs the shared filesystem in files.

``--work-dir shared`` (rv's default): each run checks its snapshot out into its own folder on the
shared filesystem, as many files as the snapshot holds. ``--work-dir node``: each node of each job
checks it out on its own local disk, and only what the program changed goes back to the run's
folder, as one tar (rv/agent/job.sh: rv_work_save). Sites cap files per user (1 M is common on
Lustre scratch) and their metadata servers suffer first, so ``rv run`` says when a run or a sweep
would create many files there, and when it would pass 90% of the user's file quota.
"""

from __future__ import annotations

from rv.config import WORK_DIRS
from rv.errors import UsageError

# A run or sweep that would create more work-dir files than this on the shared filesystem is told so.
MANY_FILES = 100_000

# What a run creates on the shared filesystem besides its work dir: run.json, the script, segment
# records, logs, a job folder per segment (a chain of ten segments: a few dozen).
RUN_FILES = 30


def check_work_dir(value: str | None) -> str:
    """``--work-dir`` (or the project's or profile's ``work-dir``): shared or node."""
    if value is None:
        return "shared"
    if value not in WORK_DIRS:
        raise UsageError(
            f"--work-dir {value!r}: expected shared (the run's folder on the shared filesystem) or node "
            "(each node's local disk)",
            hint="rv run --work-dir node -- ...",
        )
    return value


def shared_files(files: int, points: int, work_dir: str) -> int:
    """Files a run (``points`` 1) or a sweep would create on the shared filesystem for work dirs."""
    return files * points if work_dir == "shared" else 0


def many_files_warning(files: int, points: int, work_dir: str) -> str | None:
    """What ``rv run`` says before sending a run or sweep whose work dirs would multiply files."""
    total = shared_files(files, points, work_dir)
    if total <= MANY_FILES:
        return None
    what = f"{points} points x {files:,} files" if points > 1 else f"{files:,} files"
    return (
        f"this {'sweep' if points > 1 else 'run'} creates {total:,} files on the cluster's shared filesystem "
        f"({what} in its work dir{'s' if points > 1 else ''}); sites cap files per user (often 1 M): "
        "--work-dir node checks the code out on each node's local disk instead"
    )


def node_work_dir_warning(nodes: int, work_dir: str) -> str | None:
    """What ``rv run --work-dir node`` says before sending a run over several nodes: each node has a
    work dir of its own, and only the first node's changes are kept for the next segment."""
    if work_dir != "node" or nodes <= 1:
        return None
    return (
        f"--work-dir node on {nodes} nodes: each node checks the code out on its own disk, and only the "
        "first node's changes to its work dir are kept for the next segment (the other nodes' work dirs are "
        "removed with what their programs wrote there); write what every node must keep under "
        "$RV_CHECKPOINT_DIR or $RV_OUTPUT_DIR, or use --work-dir shared"
    )
