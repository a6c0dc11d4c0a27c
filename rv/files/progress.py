"""Progress of a transfer, reported by the core (snapshot upload, sync push and pull) to a renderer.

The core calls ``on_progress(TransferProgress(...))`` as data moves: after every file and every
MiB or so, at most ~10 times a second, and always once more at the end (``finished``). It never
draws anything: the CLI's renderer (rv.cli.common.progress_renderer) decides whether a bar is
worth showing (a terminal, and a transfer that has run a second) and computes rate and time left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferProgress:
    what: str  # "upload" or "download"
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int

    @property
    def finished(self) -> bool:
        return self.files_done >= self.files_total and self.bytes_done >= self.bytes_total


Progress = Callable[[TransferProgress], None]


class ProgressCounter:
    """Counts files and bytes for one transfer and reports them, throttled, to a callback."""

    INTERVAL = 0.1

    def __init__(self, callback: Progress | None, what: str, files_total: int, bytes_total: int) -> None:
        self.callback = callback
        self.what = what
        self.files_total = files_total
        self.bytes_total = bytes_total
        self.files_done = 0
        self.bytes_done = 0
        self._last = 0.0

    def add(self, nbytes: int = 0, files: int = 0) -> None:
        self.bytes_done += nbytes
        self.files_done += files
        if self.callback is None:
            return
        now = time.monotonic()
        if now - self._last >= self.INTERVAL:
            self._last = now
            self.callback(self.snapshot())

    def done(self) -> None:
        """The final report: always sent, whatever the throttle said."""
        if self.callback is not None:
            self.callback(self.snapshot())

    def snapshot(self) -> TransferProgress:
        return TransferProgress(
            self.what, self.files_done, self.files_total, self.bytes_done, self.bytes_total
        )
