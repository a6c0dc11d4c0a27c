"""How a launch looks on the terminal (rv.job.launch.LaunchView): notes and warnings on stderr, the
environment's build as a live status line, the upload as a progress bar.

The build's display keeps rv's own lines; uv's lines pass through a status line (the package being
fetched or built, the time so far) on a terminal, and only uv's summary lines stay on the screen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rv.cli.common import err_console, note, progress_renderer, warn

if TYPE_CHECKING:
    from rv.files.progress import Progress

_SUMMARY = ("Resolved ", "Prepared ", "Installed ", "Uninstalled ", "Audited ")


class BuildDisplay:
    """Lines from the cluster while an environment is found or built, or an image pulled: rv's own
    lines printed, the tool's (uv's, the runtime's pull tool's) as a status line on a terminal."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.status: Any = None
        self.what = "building the environment"

    def __call__(self, line: str) -> None:
        if line.startswith("rv: "):
            self._print(line[4:])
            for start, what in (("rv: building", "building the environment"), ("rv: pulling", "pulling")):
                if line.startswith(start) and err_console.is_terminal and self.status is None:
                    self.what = what
                    self.status = err_console.status(what)
                    self.status.start()
            return
        text = line[2:] if line.startswith("| ") else line
        if text.startswith(_SUMMARY):
            self._print(f"  {text.strip()}")
        if self.status is not None:
            from rich.markup import escape

            elapsed = time.monotonic() - self.started
            self.status.update(f"{self.what} ({elapsed:.0f} s): {escape(text.strip()[:100])}")

    def _print(self, text: str) -> None:
        if self.status is not None:
            self.status.console.print(text, markup=False, highlight=False)
        else:
            note(text)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


class TerminalLaunch:
    """rv.job.launch.LaunchView on stderr. ``upload_bar``: a progress bar while the snapshot uploads
    (`rv up` shows none)."""

    def __init__(self, *, upload_bar: bool = True) -> None:
        self.upload_bar = upload_bar

    def note(self, message: str) -> None:
        note(message)

    def warn(self, message: str) -> None:
        warn(message)

    @contextmanager
    def building(self) -> Iterator[Callable[[str], None]]:
        display = BuildDisplay()
        try:
            yield display
        finally:
            display.close()

    @contextmanager
    def uploading(self) -> Iterator[Progress | None]:
        if not self.upload_bar:
            yield None
            return
        with progress_renderer("uploading") as bar:
            yield bar
