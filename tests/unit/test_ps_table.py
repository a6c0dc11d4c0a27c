"""`rv ps`'s table (rv/cli/ps.py render_table, pure): names whole, and a segment count that does not
read as "stopped early" (issue 24, item 10)."""

from __future__ import annotations

from dataclasses import replace

from rv.cli.ps import render_table
from rv.job.records import RunView

BASE = RunView(
    name="grpo-demo", run_id="r1", segment=1, max_segments=10, state="COMPLETED", job_id="251", live=False,
    reason="finished", exit_code=0, gpus=4, gpu_type="a6000", nodes=2, elapsed_seconds=17,
    source="main@ae87391", created=3.0,
)  # fmt: skip


def cells(line: str) -> list[str]:
    return line.split()


def test_an_ended_run_shows_how_many_segments_it_ran_and_a_live_one_its_ceiling():
    live = replace(BASE, name="long", run_id="r2", segment=2, state="RUNNING", live=True, reason=None)
    lines = render_table([BASE, live])
    assert cells(lines[0])[:3] == ["NAME", "SEG", "STATE"]
    assert cells(lines[1])[:3] == ["grpo-demo", "1", "COMPLETED"]  # was 1/10: "stopped after 1 of 10"
    assert cells(lines[2])[:3] == ["long", "2/10", "RUNNING"]


def test_names_and_states_are_never_cut_and_columns_stay_aligned():
    name = "sweep-lr3e-4-warmup500-seed1234-qwen"  # 36 characters; cut at 22 it was "sweep-lr3e-4-warmup500"
    oom = replace(BASE, name=name, state="OUT_OF_MEMORY", exit_code=137, reason="out of memory")
    lines = render_table([BASE, oom])
    assert cells(lines[2])[:5] == [name, "1", "OUT_OF_MEMORY", "137", "251"]
    assert {line.index("main@") for line in lines[1:]} == {lines[0].index("SOURCE")}  # aligned


def test_ps_a_shows_what_each_ended_run_and_sweep_cost():
    from rv.cli.ps import su_column

    live = replace(BASE, name="long", run_id="r2", state="RUNNING", live=True, reason=None)
    p0 = replace(BASE, name="grid/0", run_id="p0", sweep="grid", sweep_index=0)
    p1 = replace(BASE, name="grid/1", run_id="p1", sweep="grid", sweep_index=1)
    folded = [BASE, live, replace(BASE, name="grid", run_id=None, points=2)]
    sus = su_column(folded, [BASE, live, p0, p1], {"r1": 1234.5, "p0": 10.0, "p1": 2.5})
    assert sus == {"grpo-demo": "1,234.5", "grid": "12.5"}  # the live run: not yet
    lines = render_table(folded, sus)
    assert cells(lines[0])[7:] == ["ELAPSED", "SU", "SOURCE"]
    assert [cells(line)[8] for line in lines[1:]] == ["1,234.5", "-", "12.5"]
    assert su_column(folded, [p0, p1], {"p0": 10.0, "p1": None})["grid"] == "?"  # a point without a rate
