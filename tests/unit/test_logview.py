from rv.logview import LineCollapser, collapse_line, collapse_progress


def test_collapse_keeps_last_redraw():
    assert collapse_line("  0%|\r 50%|#####\r100%|##########") == "100%|##########"
    assert collapse_line("done\r") == "done"
    assert collapse_line("plain") == "plain"
    assert collapse_progress("a\nb\r c\nd\r") == "a\n c\nd"


def test_streaming_holds_back_unfinished_line():
    c = LineCollapser()
    assert c.feed("step 1\n 10%\r 20%") == "step 1\n"
    assert c.feed("\r 30%\nstep") == " 30%\n"
    assert c.flush() == "step"
    raw = LineCollapser(raw=True)
    assert raw.feed("a\rb") == "a\rb"
