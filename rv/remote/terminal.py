"""This terminal, joined to a remote one: what `rv up` and `rv ssh` do once their shell is running.

The channel (rv.remote.ssh.SSHTransport.open_pty) carries a terminal of its own on the cluster, so keys go
there raw, one by one: Ctrl-C, Ctrl-D, arrows and tab completion reach the remote shell, never rv
itself. The local terminal is put in raw mode for that time and always restored, and a resize of
the window is passed on. No paramiko here: any object with ``recv``, ``sendall``, ``resize_pty``,
``shutdown_write``, ``exit_status_ready``, ``recv_exit_status`` and ``fileno`` will do.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

_CHUNK = 1 << 16


def terminal_size(fd: int = 1) -> tuple[int, int]:
    """(columns, rows) of the terminal on ``fd``; 80x24 when it is not one."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return size.columns, size.lines


def term_name() -> str:
    return os.environ.get("TERM") or "xterm"


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """The terminal on ``fd`` in raw mode (no echo, no line editing, no signals from keys), restored
    however the block ends. Not a terminal: nothing to do."""
    if not os.isatty(fd):
        yield
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def relay(channel: Any, *, stdin_fd: int = 0, stdout_fd: int = 1) -> int:
    """Join this terminal to ``channel`` until the remote program exits; its exit code (255 when the
    connection ended without one)."""
    sys.stdout.flush()  # what rv printed before goes first: the relay writes to the fd itself
    resized = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGWINCH"):
        previous = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
    stdin_open = True
    try:
        with raw_mode(stdin_fd):
            while True:
                if resized.is_set():
                    resized.clear()
                    cols, rows = terminal_size(stdout_fd)
                    channel.resize_pty(width=cols, height=rows)
                # A resize (SIGWINCH) does not cut the wait short (PEP 475): it is passed on within
                # half a second.
                ready, _, _ = select.select([channel, stdin_fd] if stdin_open else [channel], [], [], 0.5)
                if channel in ready or channel.recv_ready():
                    data = channel.recv(_CHUNK)
                    if not data:
                        break  # the remote side closed: its exit status follows
                    _write_all(stdout_fd, data)
                if stdin_open and stdin_fd in ready:
                    data = os.read(stdin_fd, _CHUNK)
                    if data:
                        channel.sendall(data)
                    else:
                        stdin_open = False  # local end of input (a pipe): the remote sees EOF
                        channel.shutdown_write()
                if channel.exit_status_ready() and not channel.recv_ready():
                    break
        code = channel.recv_exit_status()
    finally:
        if previous is not None:
            signal.signal(signal.SIGWINCH, previous)
        channel.close()
    return 255 if code == -1 else int(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
