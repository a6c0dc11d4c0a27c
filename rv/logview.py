"""Turning job logs into something readable: carriage-return progress bars collapsed to their last state.

tqdm and friends redraw a line with `\\r`; in a log file that is thousands of states on one line.
For display we keep only the last state of each line (what a terminal would show). `--raw` skips this.
"""

from __future__ import annotations


def collapse_line(line: str) -> str:
    """The text a terminal would show for one line containing `\\r` redraws."""
    if "\r" not in line:
        return line
    # A trailing \r (Windows line ends, or a redraw followed by the newline) ends with an empty segment.
    segments = [s for s in line.split("\r") if s != ""]
    return segments[-1] if segments else ""


def collapse_progress(text: str) -> str:
    """Collapse every line of ``text``; newline structure is kept."""
    return "\n".join(collapse_line(line) for line in text.split("\n"))


class LineCollapser:
    """Streaming version: feed chunks as they arrive, get back complete collapsed lines.

    The unfinished last line is held back (it may still be redrawn); :meth:`flush` releases it.
    """

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw
        self._pending = ""

    def feed(self, chunk: str) -> str:
        if self.raw:
            return chunk
        self._pending += chunk
        if "\n" not in self._pending:
            return ""
        complete, _, self._pending = self._pending.rpartition("\n")
        return collapse_progress(complete) + "\n"

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return rest if self.raw else collapse_line(rest)
