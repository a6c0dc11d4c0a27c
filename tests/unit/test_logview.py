from rv.cli.logview import LineCollapser, collapse_line, collapse_progress


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
    assert raw.feed("a\rb") == ""
    assert raw.feed("\nc") == "a\rb\n"
    assert raw.flush() == "c"


def test_rank_picks_its_lines_and_pieces_and_drops_the_label():
    text = "rv: job 7 started\n[2] step 1\n[10] other\n[2] \r[2]  10%\r[1] hi\r[2]  20%\n[2] done\n"
    c = LineCollapser(rank=2)
    assert c.feed(text) == "step 1\n 20%\ndone\n"
    assert LineCollapser(rank=10).feed(text) == "other\n"
    assert LineCollapser(rank=3).feed(text) == ""
    raw = LineCollapser(raw=True, rank=2)
    assert raw.feed(text) == "[2] step 1\n[2] \r[2]  10%\r[2]  20%\n[2] done\n"


def test_rank_lines_cut_by_chunks_come_out_whole():
    c = LineCollapser(rank=1)
    assert c.feed("[1] lo") == ""
    assert c.feed("ng line\n[0] x\n[1] par") == "long line\n"
    assert c.flush() == "par"


def test_collapse_keeps_the_label_of_the_last_redraw():
    assert collapse_line("[2] \r[2]  10%\r[2]  20%\r") == "[2]  20%"
    assert collapse_line("[2] \r") == ""
