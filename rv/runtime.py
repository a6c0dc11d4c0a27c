"""The private folder where rv's background processes keep their sockets, pid and log files.

Shared by the warm connections (rv.warm) and the command server (rv.entry, rv.forkserver). Imports
only what Python has loaded before any of rv: the command server's client reads this on every
command, before anything else is imported.
"""

from __future__ import annotations

import os
import stat


class NotPrivate(Exception):
    """The folder exists but others could reach it (or it is not ours): keep nothing there."""


def _temp_root() -> str:
    # tempfile.gettempdir()'s choice, without importing tempfile (random, shutil, ...).
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value and os.path.isdir(value):
            return value
    return "/tmp"


def runtime_dir() -> str:
    """``$RV_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR/rv``, else ``/tmp/rv-<uid>``: made if missing, and
    checked to be a folder of this user that only this user can enter (else NotPrivate)."""
    if os.environ.get("RV_RUNTIME_DIR"):
        path = os.environ["RV_RUNTIME_DIR"]
    elif os.environ.get("XDG_RUNTIME_DIR") and os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        path = os.path.join(os.environ["XDG_RUNTIME_DIR"], "rv")
    else:
        path = os.path.join(_temp_root(), f"rv-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # Someone else's folder, a symlink, or one others can enter: their processes could reach
        # our sockets (or plant one).
        raise NotPrivate(f"{path} is not a private folder of this user (mode {st.st_mode & 0o777:o})")
    return path


def spawn_python(
    boot: str, data: object, *, args: tuple[str, ...] = (), pass_fds: tuple[int, ...] = ()
) -> None:
    """Start ``python -I -S -c BOOT ARGS...`` in a session of its own, in /, with no stdio but
    ``data`` as JSON on its stdin, and return at once. ``-I -S``: no site processing (a venv's .pth
    files, an editable install's finder) and no PYTHON* variables; whatever search path the process
    needs comes in ``data``, as does anything else: never on the command line, which others see."""
    import json
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", boot, *args],
        pass_fds=pass_fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd="/",
    )
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(json.dumps(data).encode())
