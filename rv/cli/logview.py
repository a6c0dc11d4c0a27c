"""Turning job logs into something readable: progress bars collapsed, one rank's lines picked out.

tqdm and friends redraw a line with `\\r`; in a log file that is thousands of states on one line.
For display we keep only the last state of each line (what a terminal would show). `--raw` skips this.

A job with more than one process writes every line (and every `\\r` piece of a line) with its rank in
front, `[3] ...` (rv's rank labeller, rv/agent/ranklabel.py). `--rank R` keeps rank R's pieces and, unless
raw, shows them without the label: exactly what that rank printed. Lines without a label (rv's own,
a launcher's) belong to no rank.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"\[(\d+)\] ")
_PIECES = re.compile(r"[^\r]*\r|[^\r]+")


def collapse_line(line: str) -> str:
    """The text a terminal would show for one line containing `\\r` redraws."""
    if "\r" not in line:
        return line
    # A trailing \r (Windows line ends, or a redraw followed by the newline) ends with an empty segment;
    # a piece that holds only its rank's label is empty too.
    segments = [s for s in line.split("\r") if s != "" and not _LABEL.fullmatch(s)]
    return segments[-1] if segments else ""


def collapse_progress(text: str) -> str:
    """Collapse every line of ``text``; newline structure is kept."""
    return "\n".join(collapse_line(line) for line in text.split("\n"))


def rank_of(piece: str) -> int | None:
    """The rank a labelled line (or `\\r` piece) belongs to, or None when it carries no label."""
    m = _LABEL.match(piece)
    return int(m.group(1)) if m else None


def select_rank(line: str, rank: int, raw: bool = False) -> str | None:
    """Rank ``rank``'s part of one line (no newline), or None when it has none.

    Raw: its pieces as written, labels and `\\r` included. Otherwise: the last state, label removed.
    """
    kept = [p for p in _PIECES.findall(line) if rank_of(p) == rank]
    if not kept:
        return None
    if raw:
        return "".join(kept)
    shown = collapse_line("".join(kept))
    return shown[_LABEL.match(shown).end() :] if _LABEL.match(shown) else shown  # type: ignore[union-attr]


class LineCollapser:
    """Streaming version: feed chunks as they arrive, get back complete lines, collapsed and, with
    ``rank``, only that rank's.

    The unfinished last line is held back (it may still be redrawn, or be cut by the chunking: two
    files' chunks arrive interleaved); :meth:`flush` releases it. Raw keeps every byte of a line.
    """

    def __init__(self, raw: bool = False, rank: int | None = None) -> None:
        self.raw = raw
        self.rank = rank
        self._pending = ""

    def feed(self, chunk: str) -> str:
        self._pending += chunk
        if "\n" not in self._pending:
            return ""
        complete, _, self._pending = self._pending.rpartition("\n")
        return self._lines(complete.split("\n"))

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return self._lines([rest]).removesuffix("\n") if rest else ""

    def _lines(self, lines: list[str]) -> str:
        if self.rank is None:
            return "".join((line if self.raw else collapse_line(line)) + "\n" for line in lines)
        picked = (select_rank(line, self.rank, self.raw) for line in lines)
        return "".join(p + "\n" for p in picked if p is not None)
