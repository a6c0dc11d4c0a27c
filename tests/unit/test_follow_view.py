"""`rv run -f`'s view: the program's stdout alone on stdout, rv's own lines on the stream given."""

from __future__ import annotations

import io

from rv.cli.following import TerminalView


def test_rvs_own_lines_and_the_segment_heading_go_to_own_and_the_programs_stay_in_order():
    out, err, own = io.StringIO(), io.StringIO(), io.StringIO()
    view = TerminalView(max_segments=3, separators=False, out=out, err=err, own=own)
    view.output("out", b"rv: run r, segment 1/3: job 7 on node1\nhello\nrv: run r stopped")
    view.output("out", b" at step 1; segment 2 is job 8\nworld, no newline")
    view.output("err", b"rv: a warning the runtime wrote to stderr\n")
    view.segment({"segment": 2, "job_id": "8", "record": {}})
    view.output("out", b"bye\n")
    view.flush()
    assert out.getvalue() == "hello\nworld, no newline\nbye\n"
    assert own.getvalue() == (
        "rv: run r, segment 1/3: job 7 on node1\nrv: run r stopped at step 1; segment 2 is job 8\n"
        "── rv: segment 2/3 · job 8 ──\n"
    )
    assert err.getvalue() == "rv: a warning the runtime wrote to stderr\n"


def test_without_own_every_line_stays_where_it_was():
    out = io.StringIO()
    view = TerminalView(max_segments=1, separators=True, out=out, merge=True)
    view.output("out", b"rv: run r ended\nhello\n")
    assert out.getvalue() == "rv: run r ended\nhello\n"
