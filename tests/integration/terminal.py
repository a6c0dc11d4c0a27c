"""A pseudo-terminal for the tests of interactive commands (`rv up`, `rv ssh`), stdlib only.

The command runs as a user's would in a terminal window: its stdin, stdout and stderr are the
terminal, which is its controlling terminal (so Ctrl-C typed as ``\\x03`` becomes SIGINT while it is
not in raw mode), with a window size. :meth:`Terminal.expect` waits for a pattern in what it printed.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time


class Terminal:
    def __init__(self, argv, *, env, cwd=None, cols: int = 160, rows: int = 40) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

        def controlling_terminal() -> None:  # in the child, after setsid: the terminal becomes its own
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
            start_new_session=True, preexec_fn=controlling_terminal,
        )  # fmt: skip
        os.close(slave)
        self.master = master
        self.text = ""  # everything printed so far
        self.pos = 0  # where the next expect starts looking

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every process holding the terminal has exited
            data = b""
        if not data:
            return False
        self.text += data.decode("utf-8", "replace")
        return True

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first match of ``pattern`` after the previous match; fails the test after ``timeout``."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            m = regex.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{pattern!r} did not appear in {timeout:g} s; the terminal shows:\n{self.text}"
                )
            if not self._read(min(left, 0.5)) and self.proc.poll() is not None:
                while self._read(0.1):
                    pass
                m = regex.search(self.text, self.pos)
                if m:
                    self.pos = m.end()
                    return m
                raise AssertionError(
                    f"{pattern!r}: the program exited ({self.proc.returncode}) first; "
                    f"the terminal shows:\n{self.text}"
                )

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self, timeout: float = 120) -> int:
        """Its exit code, reading what it prints meanwhile (a full terminal would block it)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the program did not exit in {timeout:g} s; the terminal shows:\n{self.text}"
                )
            self._read(0.2)
        while self._read(0.1):
            pass
        return self.proc.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
