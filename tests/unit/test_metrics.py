"""rv.agent.metrics: each run's RV_METRICS file summed up in one call, run for real on temp folders
(in-process, and as the agent program the laptop sends, in a subprocess, reply and all)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from rv.agent import metrics
from rv.remote.agent_client import agent_command


def write_lines(path: Path, objects, tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for obj in objects:
            fh.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        fh.write(tail)
    return path


def summary(path: Path, series=True, limit=100):
    return metrics.summarise_file(str(path).encode(), series, limit)


def test_last_lowest_highest_and_their_steps(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl", [{"step": s, "loss": (s - 3) ** 2, "lr": 0.1} for s in range(1, 7)]
    )
    out = summary(path)
    loss = out["metrics"]["loss"]
    assert (loss["last"], loss["last_x"]) == (9, 6)
    assert (loss["min"], loss["min_x"], loss["max"], loss["max_x"]) == (0, 3, 9, 6)
    assert loss["count"] == 6
    assert loss["series"] == [[s, (s - 3) ** 2] for s in range(1, 7)]
    assert out["x"] == "step"
    assert "step" not in out["metrics"]
    assert (out["lines"], out["bad_lines"], out["partial"], out["rewinds"]) == (6, 0, False, 0)


def test_only_finite_numbers_are_metrics_and_nested_objects_are_flattened(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl",
        [
            {
                "step": 1,
                "loss": 1.5,
                "name": "x",
                "ok": True,
                "none": None,
                "list": [1],
                "eval": {"acc": 0.5},
            },
            '{"step": 2, "loss": NaN, "gn": Infinity, "eval": {"acc": 0.75, "deep": {"f1": 0.1}}}',
        ],
    )
    out = summary(path)
    assert sorted(out["metrics"]) == ["eval/acc", "eval/deep/f1", "loss"]
    assert out["metrics"]["loss"]["count"] == 1  # NaN is no value
    assert out["metrics"]["eval/acc"]["last"] == 0.75


def test_a_half_written_last_line_is_left_out(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [{"step": 1, "loss": 2.0}], tail='{"step": 2, "loss": 1.')
    out = summary(path)
    assert out["partial"] is True
    assert out["bad_lines"] == 0
    assert out["metrics"]["loss"]["last"] == 2.0
    # A last line whose inner object is closed but the outer not is still a write in progress.
    path = write_lines(
        tmp_path / "n.jsonl", [{"step": 1, "loss": 2.0}], tail='{"step": 2, "eval": {"acc": 1}'
    )
    out = summary(path)
    assert out["partial"] is True
    assert "eval/acc" not in out["metrics"]


def test_a_complete_last_line_without_its_newline_counts(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [{"step": 1, "loss": 2.0}], tail='{"step": 2, "loss": 1.0}')
    out = summary(path)
    assert (out["partial"], out["metrics"]["loss"]["last"]) == (False, 1.0)


def test_bad_lines_in_the_middle_are_counted_and_skipped(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl", [{"step": 1, "loss": 3}, "not json", "[1, 2]", {"step": 2, "loss": 1}, ""]
    )
    out = summary(path)
    assert (out["bad_lines"], out["first_bad_line"]) == (2, 2)
    assert out["metrics"]["loss"]["series"] == [[1, 3], [2, 1]]


def test_a_deeply_nested_or_huge_line_is_one_bad_line(tmp_path, monkeypatch):
    # json.loads of [[[[... raises RecursionError, not ValueError (issue 33): still one bad line, and
    # the line after it counts. A line over MAX_LINE is never read whole.
    monkeypatch.setattr(metrics, "MAX_LINE", 4096)
    deep = "[" * 100_000 + "]" * 100_000
    deep_object = '{"a": ' * 5000 + "1" + "}" * 5000
    braces = "{" * 3000
    huge = '{"step": 3, "loss": "' + "x" * 20_000 + '"}'
    path = write_lines(
        tmp_path / "m.jsonl",
        [{"step": 1, "loss": 3}, deep, deep_object, braces, huge, {"step": 2, "loss": 1}],
        tail=huge,  # a write in progress: partial, not bad
    )
    out = summary(path)
    assert (out["bad_lines"], out["first_bad_line"], out["partial"]) == (4, 2, True)
    assert out["metrics"]["loss"]["series"] == [[1, 3], [2, 1]]


def test_one_runs_malformed_file_never_hides_another_runs_metrics(tmp_path):
    root = tmp_path / "remote"
    make_run(root, "r1", "proj", "grid/0")
    make_run(root, "r2", "proj", "grid/1")
    write_lines(root / "outputs" / "proj" / "grid" / "0" / "metrics.jsonl", ["[" * 50_000])
    write_lines(root / "outputs" / "proj" / "grid" / "1" / "metrics.jsonl", [{"step": 1, "loss": 1}])
    bad, good = metrics.read_runs(str(root).encode(), ["r1", "r2"], ["loss"], 100)
    assert (bad["bad_lines"], bad["metrics"]) == (1, {})
    assert good["metrics"]["loss"]["last"] == 1


def test_a_resumed_segment_supersedes_the_steps_it_repeats(tmp_path):
    # Segment 1 reached step 10 and saved at step 6; segment 2 starts from there and writes 7.. again.
    seg1 = [{"step": s, "loss": 100 + s} for s in range(1, 11)]
    seg2 = [{"step": s, "loss": float(s)} for s in range(7, 13)]
    path = write_lines(tmp_path / "m.jsonl", seg1 + seg2)
    out = summary(path)
    loss = out["metrics"]["loss"]
    assert [x for x, _ in loss["series"]] == list(range(1, 13))
    assert dict(loss["series"])[8] == 8.0  # segment 2's value, not segment 1's 108
    assert (loss["max"], loss["max_x"]) == (106, 6)  # 110 at step 10 was superseded
    assert loss["count"] == 12
    assert out["rewinds"] == 4


def test_lines_sharing_a_step_without_going_back_all_count(tmp_path):
    path = write_lines(
        tmp_path / "m.jsonl",
        [
            {"step": 1, "loss": 2},
            {"step": 1, "eval_loss": 3},
            {"step": 2, "loss": 1},
            {"step": 2, "eval_loss": 2},
        ],
    )
    out = summary(path)
    assert out["rewinds"] == 0
    assert out["metrics"]["eval_loss"]["series"] == [[1, 3], [2, 2]]


def test_rewinds_within_rewinds(tmp_path):
    steps = [*range(1, 11), *range(5, 9), *range(3, 6)]
    path = write_lines(tmp_path / "m.jsonl", [{"step": s, "v": i} for i, s in enumerate(steps)])
    out = summary(path)
    assert [x for x, _ in out["metrics"]["v"]["series"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in out["metrics"]["v"]["series"]] == [0, 1, 14, 15, 16]


def test_a_killed_segments_half_line_joined_to_the_next_segments_first(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [{"step": 1, "loss": 5}], tail='{"step": 2, "loss": 4.')
    write_lines(path, [{"step": 2, "loss": 3}, {"step": 3, "loss": 2}])
    out = summary(path)
    assert out["joined_lines"] == 1
    assert out["bad_lines"] == 0
    assert out["metrics"]["loss"]["series"] == [[1, 5], [2, 3], [3, 2]]


def test_without_steps_the_x_axis_is_the_line_and_stepless_lines_join_the_step_before(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", [{"loss": 3}, {"loss": 2}, {"loss": 1}])
    out = summary(path)
    assert out["x"] == "line"
    assert out["metrics"]["loss"]["series"] == [[1, 3], [2, 2], [3, 1]]
    path = write_lines(
        tmp_path / "b.jsonl", [{"step": 10, "loss": 3}, {"eval_acc": 0.5}, {"step": 20, "loss": 1}]
    )
    out = summary(path)
    assert out["x"] == "step"
    assert out["metrics"]["eval_acc"]["series"] == [[10, 0.5]]


def test_series_only_for_the_metrics_asked(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [{"step": 1, "loss": 1, "acc": 0.5}])
    out = summary(path, series=["loss"])
    assert "series" in out["metrics"]["loss"]
    assert "series" not in out["metrics"]["acc"]
    assert "series" not in summary(path, series=False)["metrics"]["loss"]


@pytest.mark.parametrize("n", [1, 7, 99, 100, 101, 250, 12345])
def test_series_are_thinned_evenly_with_the_first_and_last(tmp_path, n):
    path = write_lines(tmp_path / "m.jsonl", [{"step": s, "v": s * 2} for s in range(n)])
    series = summary(path, limit=100)["metrics"]["v"]["series"]
    assert len(series) == min(n, 100)
    assert series[0] == [0, 0]
    assert series[-1] == [n - 1, 2 * (n - 1)]
    xs = [x for x, _ in series]
    assert xs == sorted(set(xs))
    if n > 100:
        gaps = [b - a for a, b in itertools.pairwise(xs)]
        assert max(gaps) <= 3 * n / 100  # evenly spread: no gap far wider than the average


def test_a_long_file_is_read_quickly_in_bounded_memory(tmp_path):
    path = tmp_path / "m.jsonl"
    with path.open("w") as fh:
        for s in range(200_000):
            fh.write(json.dumps({"step": s, "loss": 1 / (s + 1), "acc": s / 200_000, "lr": 1e-4}) + "\n")
    start = time.perf_counter()
    out = summary(path, limit=100)
    took = time.perf_counter() - start
    assert all(len(m["series"]) == 100 for m in out["metrics"].values())
    assert out["metrics"]["loss"]["last_x"] == 199_999
    print(f"200,000 lines, 3 metrics: {took:.2f} s")


# --- runs: where the file is, and the agent mode ---------------------------------------------------


def make_run(root: Path, run_id: str, project: str, name: str, **meta) -> Path:
    rdir = root / "runs" / run_id
    rdir.mkdir(parents=True)
    (rdir / "run.json").write_text(json.dumps({"project": project, "name": name, "run_id": run_id, **meta}))
    return rdir


def test_read_runs_finds_each_runs_file_in_its_output_folder(tmp_path):
    root = tmp_path / "remote"
    make_run(root, "r1", "proj", "grid/0")
    make_run(root, "r2", "proj", "grid/1")
    elsewhere = write_lines(tmp_path / "custom" / "m.jsonl", [{"step": 1, "loss": 7}])
    make_run(root, "r3", "proj", "other", metrics=str(elsewhere))
    write_lines(root / "outputs" / "proj" / "grid" / "0" / "metrics.jsonl", [{"step": 1, "loss": 1}])
    rows = metrics.read_runs(str(root).encode(), ["r1", "r2", "r3", "gone", "../x"], ["loss"], 100)
    assert [r["run_id"] for r in rows] == ["r1", "r2", "r3", "gone", "../x"]
    assert rows[0]["path"] == str(root / "outputs" / "proj" / "grid" / "0" / "metrics.jsonl")
    assert rows[0]["metrics"]["loss"]["last"] == 1
    assert rows[1]["exists"] is False and "metrics" not in rows[1]
    assert rows[2]["path"] == str(elsewhere) and rows[2]["metrics"]["loss"]["last"] == 7
    assert rows[3] == {"run_id": "gone", "error": "no such run"}
    assert rows[4] == {"run_id": "../x", "error": "bad run id"}


def test_the_mode_as_the_agent_program_runs_it(tmp_path):
    """The agent program exactly as the laptop sends it (rv.remote.agent_client.agent_command: every module
    of AGENT_MODULES, the one mode table) answers ``metrics``, reply encoding and errors included."""
    root = tmp_path / "remote"
    make_run(root, "r1", "proj", "grid/0")
    write_lines(
        root / "outputs" / "proj" / "grid" / "0" / "metrics.jsonl",
        [{"step": s, "loss": 1 / s} for s in (1, 2, 4)],
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}

    def agent(args: dict) -> dict:
        done = subprocess.run(
            ["bash", "-c", agent_command("metrics", args)], capture_output=True, check=True, env=env
        )
        return json.loads(zlib.decompress(done.stdout))

    (row,) = agent({"root": str(root), "runs": ["r1"], "series": True, "points": 2})["runs"]
    assert row["metrics"]["loss"]["series"] == [[1, 1.0], [4, 0.25]]
    assert row["metrics"]["loss"]["min"] == 0.25
    assert agent({"root": str(root), "runs": "r1"}) == {
        "error": "runs must be a list of run ids",
        "code": "usage",
    }


def test_a_metrics_path_that_is_a_folder_says_so_and_notes_name_the_point(tmp_path):
    # Issue 33: a folder "did not exist", and the notes named points by run id.
    from rv.cli.sweepview import metrics_notes
    from rv.job.results import parse_metrics_reply

    root = tmp_path / "remote"
    folder = tmp_path / "m"
    folder.mkdir()
    make_run(root, "r1", "proj", "grid/0", metrics=str(folder))
    make_run(root, "r2", "proj", "grid/1")
    write_lines(root / "outputs" / "proj" / "grid" / "1" / "metrics.jsonl", ["not json", {"loss": 1}])
    found = parse_metrics_reply(metrics.read_runs(str(root).encode(), ["r1", "r2"], False, 10))
    (said,) = metrics_notes(found["r1"], "grid/0")
    assert said == f"grid/0: {folder} is a folder: RV_METRICS names a file the program appends lines to"
    assert metrics_notes(found["r2"], "grid/1")[0].startswith("grid/1: 1 line(s) of ")
    assert found["r2"].notes("grid/1")[0].startswith("grid/1: ")
