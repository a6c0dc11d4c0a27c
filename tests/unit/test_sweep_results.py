"""`rv sweep results` and `rv metrics`: the rows, --json, --csv and the terminal views, from the
agent's real replies (its run records and metrics read from a temp remote root, in-process)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rv.agent import metrics as agent_metrics
from rv.agent import rundir as agent_rundir
from rv.agent.segment import ended_record, segment_record
from rv.cli.plot import plot_curve
from rv.cli.sweep import emit_metrics, emit_results, sweep
from rv.cli.sweepview import (
    BEST_MARK,
    SPARK,
    metrics_notes,
    metrics_table,
    render_text,
    results_csv,
    results_footer,
    results_table,
    sparkline,
)
from rv.errors import UsageError
from rv.job.records import parse_runs, run_views
from rv.job.results import (
    PointRow,
    PointRun,
    SortKey,
    guess_direction,
    parse_metrics_reply,
    point_runs,
    result_rows,
    results_json,
    retry_points,
    sweep_counts,
    sweep_summary,
)
from rv.slurm.parse import SQUEUE_FORMAT, parse_squeue

NOW = 1_800_000_000.0


def squeue_line(job: str, name: str, state: str = "RUNNING", elapsed: str = "2:05") -> str:
    fields = [
        job,
        state,
        "None",
        elapsed,
        "1:00:00",
        "1",
        "node1",
        "gres/gpu:a6000:1",
        "gpu",
        "N/A",
        "N/A",
        name,
    ]
    assert len(fields) == SQUEUE_FORMAT.count("|") + 1
    return "|".join(fields)


def point_run(root: Path, index: int, lr: str, *, segments, ended=None, losses=(), project="proj"):
    """A sweep point's run as run-submit and its jobs leave it: run.json (with the sweep), segment
    records, ENDED, and the program's metrics in the run's output folder."""
    run_id = f"run{index}"
    rdir = root / "runs" / run_id
    (rdir / "seg").mkdir(parents=True)
    meta = {
        "project": project, "name": f"grid/{index}", "run_id": run_id, "created": NOW - 1000 + index,
        "max_segments": 10, "gpus": 1, "gpu_type": "a6000", "nodes": 1,
        "sweep": {"name": "grid", "index": index, "params": {"lr": lr}},
    }  # fmt: skip
    (rdir / "run.json").write_text(json.dumps(meta))
    for k, (job, record) in enumerate(segments, start=1):
        (rdir / "seg" / f"{k}.job").write_text(job + "\n")
        if record is not None:
            (rdir / "seg" / f"{k}.json").write_text(json.dumps(record))
    if ended is not None:
        (rdir / "ENDED").write_text(json.dumps(ended))
    if losses:
        out = root / "outputs" / project / "grid" / str(index)
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": v, "acc": 1 - v}) + "\n" for s, v in enumerate(losses, 1))
        )
    return run_id


def ended_seg(k: int, job: str, reason: str, code: int, start: float, end: float):
    return segment_record(k, job, "ended", reason, end, code, start=start)


@pytest.fixture
def sweep_root(tmp_path):
    """Four points: finished, crashed, still running (in squeue), resumed over two segments."""
    root = tmp_path / "remote"
    point_run(
        root, 0, "1e-4", segments=[("100", ended_seg(1, "100", "finished", 0, NOW - 900, NOW - 300))],
        ended=ended_record("finished", 0, 1, NOW - 300), losses=[0.9, 0.5, 0.4],
    )  # fmt: skip
    point_run(
        root, 1, "1e-3", segments=[("101", ended_seg(1, "101", "crashed", 1, NOW - 900, NOW - 800))],
        ended=ended_record("crashed", 1, 1, NOW - 800), losses=[0.8, 3.0],
    )  # fmt: skip
    running = segment_record(1, "102", "running", "", None, start=NOW - 125)
    point_run(root, 2, "1e-2", segments=[("102", running)], losses=[0.7, 0.3])
    point_run(
        root, 3, "1e-1",
        segments=[("103", ended_seg(1, "103", "stopped at time limit", 0, NOW - 900, NOW - 600)),
                  ("110", ended_seg(2, "110", "finished", 0, NOW - 590, NOW - 290))],
        ended=ended_record("finished", 0, 2, NOW - 290), losses=[0.6, 0.45, 0.35, 0.2],
    )  # fmt: skip
    return root


def gather(root: Path, sort: SortKey | None):
    """What `rv sweep results` does with the one reply: the agent's records and metrics (read here
    in-process from the temp root), squeue, rv ps's states."""
    rows = agent_rundir.select_runs(str(root).encode(), {"ids": [f"run{i}" for i in range(4)]})
    runs = parse_runs(rows)
    views = {
        v.run_id: v for v in run_views(runs, parse_squeue(squeue_line("102", "grid/2")), now=NOW) if v.run_id
    }
    found = parse_metrics_reply(
        agent_metrics.read_runs(
            str(root).encode(), [r.run_id for r in runs], [sort.metric] if sort else False
        )
    )
    return result_rows(point_runs(runs, "grid"), views, found, sort)


def test_one_row_per_point_with_states_as_rv_ps_spells_them(sweep_root):
    rows = gather(sweep_root, None)
    assert [(r.index, r.state, r.segments, r.wall_seconds) for r in rows] == [
        (0, "COMPLETED", 1, 600),
        (1, "FAILED", 1, 100),
        (2, "RUNNING", 1, 125),  # its live segment's time per squeue (2:05)
        (3, "COMPLETED", 2, 600),
    ]
    assert [r.metrics["loss"] for r in rows] == [0.4, 3.0, 0.3, 0.2]
    assert not any(r.best for r in rows)


def test_json_has_exactly_the_documented_shape(sweep_root):
    data = results_json(gather(sweep_root, SortKey.parse("loss:min")))
    assert list(data) == ["points"]
    first = data["points"][0]
    assert first == {
        "index": 3, "params": {"lr": "1e-1"}, "state": "COMPLETED", "segments": 2, "wall_seconds": 600,
        "metrics": {"acc": 0.8, "loss": 0.2},
    }  # fmt: skip
    assert [p["index"] for p in data["points"]] == [3, 2, 0, 1]
    for point in data["points"]:
        assert list(point) == ["index", "params", "state", "segments", "wall_seconds", "metrics"]


def test_sorted_best_first_and_the_best_marked(sweep_root):
    rows = gather(sweep_root, SortKey.parse("acc"))  # acc: higher is better, from its name
    assert [r.index for r in rows] == [3, 2, 0, 1]
    assert [r.best for r in rows] == [True, False, False, False]
    assert rows[0].trend == (0.4, 0.55, 0.65, 0.8)
    rows = gather(sweep_root, SortKey.parse("loss:max"))
    assert [r.index for r in rows] == [1, 0, 2, 3]


def test_points_without_the_metric_or_a_run_go_last():
    rows = result_rows(
        [PointRun(0, {"lr": "a"}, None), PointRun(1, {"lr": "b"}, "r1")],
        {},
        parse_metrics_reply([{"run_id": "r1", "exists": True, "metrics": {}}]),
        SortKey.parse("loss"),
    )
    assert [(r.index, r.state, r.best) for r in rows] == [(0, "UNKNOWN", False), (1, "UNKNOWN", False)]
    assert results_footer(rows, SortKey.parse("loss"))[-1] == "no point has written loss yet"


def test_csv_one_row_per_point(sweep_root):
    text = results_csv(gather(sweep_root, SortKey.parse("loss")), SortKey.parse("loss"))
    lines = text.splitlines()
    assert lines[0] == "index,lr,state,segments,wall_seconds,loss,acc"
    assert lines[1] == "3,1e-1,COMPLETED,2,600,0.2,0.8"
    assert lines[4] == "1,1e-3,FAILED,1,100,3,-2"  # integers as integers


def test_the_terminal_table_marks_the_best_and_draws_the_trend(sweep_root):
    sort = SortKey.parse("loss")
    rows = gather(sweep_root, sort)
    text = render_text(results_table(rows, sort), width=160)
    lines = text.splitlines()
    assert lines[0].split() == ["POINT", "lr", "STATE", "SEG", "WALL", "loss", "acc", "loss", "TREND"]
    assert lines[1].split() == [BEST_MARK, "3", "1e-1", "COMPLETED", "2", "0:10:00", "0.2", "0.8", "█▅▄▁"]
    assert lines[2].split() == ["2", "1e-2", "RUNNING", "1", "0:02:05", "0.3", "0.7", "█▁"]
    # Levels 0..7 at (v - 0.2) / 0.4 * 7, rounded.
    assert sparkline([0.6, 0.45, 0.35, 0.2]) == SPARK[7] + SPARK[4] + SPARK[3] + SPARK[0]
    assert results_footer(rows, sort) == [
        "4 point(s): 2 completed, 1 failed, 1 running",
        f"{BEST_MARK} best: the lowest last loss (from its name; say :min or :max)",
    ]


def test_retry_takes_the_failed_and_the_never_submitted():
    def row(index, state, run_id="r"):
        return PointRow(index, {}, run_id, state, 1, None, {})

    rows = [row(0, "COMPLETED"), row(1, "FAILED"), row(2, "CANCELLED"), row(3, "RUNNING"),
            row(4, "UNKNOWN"), row(5, "TIMEOUT"), row(6, "UNKNOWN", None), row(7, "STOPPED"),
            row(8, "OUT_OF_MEMORY")]  # fmt: skip
    assert retry_points(rows) == [1, 2, 5, 6, 8]


def test_rv_ps_one_line_per_sweep_counts():
    states = ["RUNNING", "PENDING", "PENDING", "COMPLETED", "FAILED", "CANCELLED", "STOPPED", "REQUEUED"]
    assert sweep_counts(states) == {"running": 2, "pending": 2, "finished": 1, "failed": 2, "other": 1}
    assert sweep_summary(states) == "2 running, 2 pending, 1 finished, 2 failed, 1 other"
    assert sweep_summary(["COMPLETED"] * 3) == "3 finished"
    assert sweep_summary([]) == "no points"


def test_point_runs_take_the_newest_run_of_each_index():
    def run(run_id, index, created, name="grid"):
        return {
            "run_id": run_id, "segments": [],
            "meta": {"name": f"{name}/{index}", "created": created,
                     "sweep": {"name": name, "index": index, "params": {"lr": str(index)}}},
        }  # fmt: skip

    runs = parse_runs([run("a", 1, 10), run("b", 0, 11), run("c", 1, 12), run("d", 0, 13, name="other")])
    assert point_runs(runs, "grid") == [PointRun(0, {"lr": "0"}, "b"), PointRun(1, {"lr": "1"}, "c")]


# --- sorting words ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "way"),
    [("loss", "min"), ("train/loss", "min"), ("val_loss", "min"), ("eval-perplexity", "min"),
     ("errors", "min"), ("acc", "max"), ("val_accuracy", "max"), ("reward_mean", "max"), ("f1", "max"),
     ("lr", None), ("grad_norm", None), ("loss_acc", None)],
)  # fmt: skip
def test_direction_guessed_from_whole_words_of_the_name(name, way):
    assert guess_direction(name) == way


def test_sort_keys():
    assert SortKey.parse("loss:max") == SortKey("loss", "max", guessed=False)
    assert SortKey.parse("eval/acc") == SortKey("eval/acc", "max", guessed=True)
    with pytest.raises(UsageError) as err:
        SortKey.parse("grad_norm")
    assert (
        err.value.message
        == "--sort grad_norm: rv cannot tell whether a higher or a lower grad_norm is better"
    )
    assert err.value.hint == "say which: --sort grad_norm:min or --sort grad_norm:max"
    with pytest.raises(UsageError, match="'up' is not a direction"):
        SortKey.parse("loss:up")
    with pytest.raises(UsageError, match="no metric named"):
        SortKey.parse(":min")


# --- trend lines and plots --------------------------------------------------------------------------


def test_sparklines():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == SPARK
    assert sparkline([8, 1]) == SPARK[-1] + SPARK[0]
    assert sparkline([3, 3, 3]) == SPARK[4] * 3
    assert sparkline([]) == ""
    assert len(sparkline(list(range(1000)), 16)) == 16
    assert sparkline(list(range(1000)), 16) == "".join(sorted(sparkline(list(range(1000)), 16)))


def test_plot_of_a_series_is_a_curve_from_its_lowest_to_its_highest():
    series = [(s, float(s)) for s in range(0, 100)]
    lines = plot_curve(series, width=20, height=4)
    assert len(lines) == 4 + 2
    assert lines[0].startswith("99 ┤") and lines[3].startswith(" 0 ┤")
    # A rising line: the top row's dots at the right end, the bottom row's at the left, every column drawn.
    cells = [line[len("99 ┤") :] for line in lines[:4]]
    assert cells[0][-1] != " " and cells[0][0] == " " and cells[3][0] != " " and cells[3][-1] == " "
    assert all(any(row[c] != " " for row in cells) for c in range(20))
    assert all(ch == " " or 0x2800 <= ord(ch) <= 0x28FF for row in cells for ch in row)
    assert lines[4] == "   └" + "─" * 20 and lines[5].split() == ["0", "99"]
    assert plot_curve([], width=10) == []


def test_plot_joins_few_points_with_lines():
    lines = plot_curve([(1, 1.0), (5, 3.0), (9, 2.0)], width=8, height=2)
    cells = [line[len("3 ┤") :] for line in lines[:2]]
    # Three points across 16 dot columns: the line between them leaves no column empty.
    dots = [[(ord(ch) - 0x2800) if ch != " " else 0 for ch in row] for row in cells]
    left, right = 0x01 | 0x02 | 0x04 | 0x40, 0x08 | 0x10 | 0x20 | 0x80  # a cell's two columns of dots
    columns = [any(row[i] & half for row in dots) for i in range(8) for half in (left, right)]
    assert all(columns), cells
    assert lines[0].startswith("3 ┤") and lines[1].startswith("1 ┤") and lines[3].split() == ["1", "9"]
    flat = plot_curve([(1, 2.0), (2, 2.0)], width=4, height=2)  # one value: a level line mid-plot
    assert flat[0].startswith("2 ┤") and flat[1][len("2 ┤") :].strip()


# --- rv metrics --------------------------------------------------------------------------------------


def test_rv_metrics_table_and_plot_across_segments(sweep_root):
    (row,) = agent_metrics.read_runs(str(sweep_root).encode(), ["run3"], True)
    found = parse_metrics_reply([row])["run3"]
    text = render_text(metrics_table(found), width=120)
    lines = text.splitlines()
    assert lines[0].split() == ["METRIC", "LAST", "AT", "STEP", "BEST", "AT", "STEP", "N", "TREND"]
    assert lines[1].split()[:7] == ["acc", "0.8", "4", "0.8", "↑", "4", "4"]
    assert lines[2].split()[:7] == ["loss", "0.2", "4", "0.2", "↓", "4", "4"]
    out = io.StringIO()
    emit_metrics(found, None, out, width=80)
    assert "\nloss by step:\n" in out.getvalue()
    assert metrics_notes(found) == []


def test_rv_metrics_notes_say_what_was_odd():
    (found,) = parse_metrics_reply(
        [{"run_id": "r", "path": "/o/metrics.jsonl", "exists": True, "partial": True, "bad_lines": 2,
          "first_bad_line": 7, "rewinds": 3, "joined_lines": 1, "metrics": {}}]
    ).values()  # fmt: skip
    assert metrics_notes(found) == [
        "r: 2 line(s) of /o/metrics.jsonl are not JSON objects and were skipped (the first: line 7)",
        "r: 3 line(s) left out: a later segment went back to an earlier step and wrote those steps again",
        "r: 1 line(s) began with a half line a killed segment left; their complete part was read",
        "r: the last line is being written; it is left out",
    ]
    (missing,) = parse_metrics_reply([{"run_id": "r", "path": "/o/m.jsonl", "exists": False}]).values()
    assert metrics_notes(missing) == [
        "r: no metrics yet: /o/m.jsonl does not exist (programs write to $RV_METRICS)"
    ]


# --- the command ----------------------------------------------------------------------------------


def test_emit_json_and_csv_on_stdout(sweep_root):
    sort = SortKey.parse("loss")
    rows = gather(sweep_root, sort)
    out = io.StringIO()
    emit_results(rows, sort, "json", out, width=100)
    assert json.loads(out.getvalue()) == results_json(rows)
    out = io.StringIO()
    emit_results(rows, sort, "csv", out, width=100)
    assert out.getvalue() == results_csv(rows, sort)


def test_bad_input_fails_before_connecting(tmp_path, monkeypatch):
    # No config exists: a command that got as far as connecting would fail with a config error (3).
    monkeypatch.setenv("RV_CONFIG", str(tmp_path / "none.toml"))
    runner = CliRunner()
    result = runner.invoke(sweep, ["results", "grid", "--sort", "grad_norm"])
    assert isinstance(result.exception, UsageError), result.output  # rv's main turns it into exit 2
    assert "grad_norm" in result.exception.message
    result = runner.invoke(sweep, ["results", "grid", "--json", "--csv"])
    assert result.exit_code == 2
    assert "pick one" in result.output
