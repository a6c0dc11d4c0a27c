"""rv's temporary folders, and the ones a killed rv left behind.

A SIGKILL (an OOM killer, a `kill -9`, a closed laptop's lost session) runs no cleanup: each
``rv-KIND-*`` folder then stays in the temporary folder for good (20 of them, up to 240 KB each, after
24 killed `rv run`s). So each is named with the id of the process that made it,
``rv-KIND-PID-RANDOM``, and the first one a process makes sweeps away those of this user whose
process is gone. A folder whose process still runs (or whose id a new process took since) is left.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KINDS = ("links", "diff", "checkout", "ls", "ignore", "secrets", "git")
_NAME = re.compile(r"^rv-(?:" + "|".join(KINDS) + r")-(\d+)-[A-Za-z0-9_]+$")
_swept: set[str] = set()  # the temporary folders this process has swept already


@contextmanager
def temp_dir(kind: str) -> Iterator[str]:
    """A private temporary folder (0700) for one use, removed after it; stale ones swept first."""
    assert kind in KINDS, kind
    sweep_once()
    with tempfile.TemporaryDirectory(prefix=f"rv-{kind}-{os.getpid()}-") as tmp:
        yield tmp


def sweep_once() -> None:
    """Sweep the temporary folder of what killed rvs left, once per process and folder: on the first
    temporary folder a process makes, and where a snapshot starts (an upload of edited files may
    make none, and the next rv must still clean up after a killed one)."""
    root = tempfile.gettempdir()
    if root not in _swept:
        _swept.add(root)
        sweep_stale(Path(root))


def sweep_stale(root: Path) -> list[Path]:
    """Remove the ``rv-KIND-PID-*`` folders under ``root`` that this user owns and whose process is
    gone; the folders removed."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:  # no temporary folder to read: nothing of ours can be in it
        return []
    uid = os.getuid()
    for entry in entries:
        m = _NAME.match(entry.name)
        if not m:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:  # gone meanwhile (its own process removed it)
            continue
        if process_alive(int(m.group(1))):
            continue
        # Best effort, never the command's failure: what cannot be removed now is tried next time.
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (another user's counts: it may be a reused id)."""
    if pid <= 0:
        return True  # not a process id rv writes: leave the folder
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
