"""Showing a run as it is followed (`rv run -f`, `rv logs [-f]`): output, separators, state lines."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from rv.cli.common import err_console
from rv.cli.logview import LineCollapser


def separator(segment: int, max_segments: int, job_id: str, record: dict[str, Any] | None) -> str:
    """The one line that heads a segment's output in `rv logs`."""
    parts = [f"segment {segment}/{max_segments}", f"job {job_id}"]
    rec = record or {}
    if rec.get("nodes"):
        parts.append(str(rec["nodes"]))
    if rec.get("start_step") is not None:
        parts.append(f"from step {rec['start_step']}")
    return f"── rv: {' · '.join(parts)} ──\n"


def state_line(frame: dict[str, Any]) -> str | None:
    """``job 123: PENDING (Priority), expected start 2026-...`` from a follower's state frame."""
    from rv.slurm.parse import parse_squeue

    jobs = parse_squeue(frame.get("squeue") or "")
    if not jobs:
        return None
    job = jobs[0]
    text = f"job {job.job_id}: {job.state}"
    if job.state == "PENDING":
        if job.reason:
            text += f" ({job.reason})"
        if job.start:
            text += f", expected start {job.start}"
    elif job.node_list:
        text += f" on {','.join(job.node_list)}"
    return text


class TerminalView:
    """Output to ``out`` (and ``err`` for stderr unless ``merge``), chatter as dim lines on stderr."""

    def __init__(
        self,
        *,
        max_segments: int,
        separators: bool,
        raw: bool = False,
        rank: int | None = None,
        merge: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        own: TextIO | None = None,
    ) -> None:
        self.max_segments = max_segments
        self.separators = separators
        self.out = out or sys.stdout
        self.err = self.out if merge else (err or sys.stderr)
        # `rv run -f`: rv's own lines (a segment's heading, the job runtime's "rv: ..." lines in the
        # job's stdout log) go here, so that stdout carries the program's output alone.
        self.own = own
        self.raw, self.rank = raw, rank
        # One per log file: chunks of two files (two nodes) arrive interleaved, each may end mid-line.
        self._collapsers: dict[tuple[str, str], LineCollapser] = {}
        self.segments_seen = 0
        self._last_state: str | None = None

    def _sink(self, stream: str) -> TextIO:
        return self.err if stream == "err" else self.out

    def output(self, stream: str, data: bytes, source: str = "") -> None:
        collapser = self._collapsers.get((stream, source))
        if collapser is None:
            collapser = self._collapsers[stream, source] = LineCollapser(raw=self.raw, rank=self.rank)
        self._write(stream, collapser.feed(data.decode("utf-8", errors="replace")))

    def _write(self, stream: str, text: str) -> None:
        """Complete lines to their sink, rv's own to ``own`` when it is set (in order)."""
        sink = self._sink(stream)
        if self.own is None or stream != "out" or "rv: " not in text:
            sink.write(text)
            sink.flush()
            return
        for line in text.splitlines(keepends=True):
            to = self.own if line.startswith("rv: ") else sink
            to.write(line)
            to.flush()

    def flush(self) -> None:
        for (stream, _), collapser in self._collapsers.items():
            rest = collapser.flush()
            if rest:
                self._write(stream, rest + ("\n" if not rest.endswith("\n") else ""))

    def segment(self, frame: dict[str, Any]) -> None:
        self.segments_seen += 1
        if self.separators or frame["segment"] > 1:
            self.flush()
            to = self.own or self.out
            to.write(separator(frame["segment"], self.max_segments, frame["job_id"], frame.get("record")))
            to.flush()

    def segment_end(self, frame: dict[str, Any]) -> None:
        self.flush()

    def state(self, frame: dict[str, Any]) -> None:
        line = state_line(frame)
        if line and line != self._last_state:  # squeue's elapsed time changes every poll; the state not
            self._last_state = line
            self._dim(line)

    def warning(self, message: str) -> None:
        self._dim(message)

    def reconnecting(self, error: str, wait: float) -> None:
        self._dim(f"{error}; reconnecting in {wait:g} s (the run is not affected)")

    def _dim(self, text: str) -> None:
        err_console.print(text, style="dim", markup=False, highlight=False, soft_wrap=True)
