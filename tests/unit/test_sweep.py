"""rv.sweep: the points of a sweep, the command each runs, the checks before anything is sent, and
the job arrays that run them."""

from __future__ import annotations

import shlex
import subprocess
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rv.errors import UsageError
from rv.sweep import (
    MAX_POINTS,
    ArrayPart,
    Point,
    build_sweep,
    check_command,
    check_limits,
    dry_run_text,
    env_name,
    parse_point_ref,
    parse_sweep_file,
    parse_sweep_option,
    placeholders,
    plan_arrays,
)

# --- --sweep NAME=... -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("lr=1e-4,3e-4", ("1e-4", "3e-4")),
        ("seed=0..4", ("0", "1", "2", "3", "4")),
        ("seed=0..2,10", ("0", "1", "2", "10")),
        ("shift=-2..1", ("-2", "-1", "0", "1")),
        ("seed=3..3", ("3",)),
        ("opt=adam", ("adam",)),
        ("path=a b,c'd", ("a b", "c'd")),  # kept as typed, spaces and quotes too
        ("path=data/../x,a..b,..", ("data/../x", "a..b", "..")),  # ".." between non-numbers: a value
    ],
)
def test_values_in_the_order_given_ranges_inclusive(text, values):
    assert parse_sweep_option(text)[1] == values


@pytest.mark.parametrize(
    ("text", "message", "hint"),
    [
        ("lr=", "--sweep lr: no values", "--sweep lr=V1,V2"),
        ("lr", "expected NAME=V1,V2", "--sweep seed=0..4"),
        ("lr=1e-4,,1e-3", "an empty value between commas", "--sweep-file"),
        ("lr=1e-4..1e-2", "is not a range of integers", "--sweep lr=1e-4,1e-3,1e-2"),
        ("lr=0.1..0.5", "is not a range of integers", "list the values"),
        ("seed=4..0", "the range '4..0' is empty", "write 0..4"),
        ("seed=1,2,1", "the value '1' is given twice", "list each value once"),
        ("seed=0..2,2", "the value '2' is given twice", "list each value once"),
        ("learning-rate=1", "'learning-rate' is not a usable parameter name", "letters, digits and _"),
        ("2x=1", "'2x' is not a usable parameter name", "RV_SWEEP_<NAME>"),
        ("index=1,2", "the name 'index' is taken", "pick another name"),
    ],
)
def test_bad_sweep_options_say_what_and_what_next(text, message, hint):
    with pytest.raises(UsageError) as err:
        parse_sweep_option(text)
    assert message in err.value.message
    assert hint in (err.value.hint or "")


def test_a_huge_range_fails_before_it_is_made():
    start = time.perf_counter()
    with pytest.raises(UsageError, match="over rv's limit"):
        parse_sweep_option("seed=0..999999999999")
    assert time.perf_counter() - start < 0.5


def test_cartesian_product_first_sweep_varies_slowest():
    sweep = build_sweep(["lr=a,b", "seed=0..1"], parallel=2)
    assert [p.params for p in sweep.points] == [
        (("lr", "a"), ("seed", "0")),
        (("lr", "a"), ("seed", "1")),
        (("lr", "b"), ("seed", "0")),
        (("lr", "b"), ("seed", "1")),
    ]
    assert [p.index for p in sweep.points] == [0, 1, 2, 3]
    assert sweep.names == ("lr", "seed")
    assert sweep.parallel == 2


def test_each_point_sees_its_index_and_upper_cased_names():
    sweep = build_sweep(["lr=a,b", "Seed=7"])
    assert sweep.points[1].env() == {"RV_SWEEP_INDEX": "1", "RV_SWEEP_LR": "b", "RV_SWEEP_SEED": "7"}
    assert env_name("warm_up") == "RV_SWEEP_WARM_UP"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["lr=1", "lr=2"], "'lr' is given twice"),
        (["lr=1", "LR=2"], "the same as 'lr' (RV_SWEEP_LR)"),
    ],
)
def test_duplicate_names_are_refused(options, message):
    with pytest.raises(UsageError) as err:
        build_sweep(options)
    assert message in err.value.message


def test_parallel_must_be_positive_and_a_sweep_needs_points():
    with pytest.raises(UsageError, match="--parallel 0: must be 1 or more"):
        build_sweep(["lr=1"], parallel=0)
    with pytest.raises(UsageError, match="needs --sweep NAME=V1,V2"):
        build_sweep([])


def test_a_product_over_the_limit_fails_before_points_are_made():
    side = int(MAX_POINTS**0.5) + 1
    start = time.perf_counter()
    with pytest.raises(UsageError) as err:
        build_sweep([f"a=1..{side}", f"b=1..{side}"])
    assert f"{side * side:,} points" in err.value.message
    assert time.perf_counter() - start < 0.5


# --- --sweep-file ---------------------------------------------------------------------------------


def test_json_lines_keep_the_spelling_of_numbers():
    text = (
        '{"lr": 1e-4, "seed": 0, "opt": "adam", "ema": true}\n\n'
        '{"lr": 3.0E-4, "seed": 12, "opt": "sgd", "ema": false}\n'
    )
    names, rows, fmt = parse_sweep_file(text, "grid.jsonl")
    assert fmt == "JSON lines"
    assert names == ("lr", "seed", "opt", "ema")
    assert rows == [(1, ("1e-4", "0", "adam", "true")), (3, ("3.0E-4", "12", "sgd", "false"))]


def test_csv_with_a_header_and_quoted_commas():
    text = 'lr,tag\n1e-4,"a,b"\n3e-4,plain\n'
    names, rows, fmt = parse_sweep_file(text, "grid.csv")
    assert (names, fmt) == (("lr", "tag"), "CSV")
    assert rows == [(2, ("1e-4", "a,b")), (3, ("3e-4", "plain"))]


def test_csv_with_a_byte_order_mark_and_padded_cells_reads_as_typed_without_the_padding(tmp_path):
    # Issue 33: Excel's "CSV UTF-8" starts with a byte-order mark, which made the first name
    # unusable; cells kept the spaces around them though names lose theirs.
    from rv.sweep import read_sweep_file

    path = tmp_path / "grid.csv"
    path.write_bytes('\ufefflr, tag\r\n 1e-4 , " a,b " \r\n3e-4,plain\r\n'.encode())
    names, rows, _ = parse_sweep_file(*read_sweep_file(path))
    assert names == ("lr", "tag") and rows == [(2, ("1e-4", "a,b")), (3, ("3e-4", "plain"))]
    with pytest.raises(UsageError, match="no value for tag"):
        parse_sweep_file("lr,tag\n1e-4,  \n", "g.csv")


def test_sweep_values_lose_the_spaces_around_them_as_names_do():
    assert parse_sweep_option(" lr = 1e-4 , 3e-4 ") == ("lr", ("1e-4", "3e-4"))
    assert parse_sweep_option("seed= 0..2 ")[1] == ("0", "1", "2")
    with pytest.raises(UsageError, match="an empty value between commas"):
        parse_sweep_option("lr=1e-4, ,3e-4")
    with pytest.raises(UsageError, match="the value '1' is given twice"):
        parse_sweep_option("seed=1, 1")


@pytest.mark.parametrize(
    ("name", "text", "fmt"),
    [
        ("points.txt", '{"a": 1}\n', "JSON lines"),
        ("points", '  \n{"a": 1}\n', "JSON lines"),
        ("points.txt", "a\n1\n", "CSV"),
        ("points.ndjson", '{"a": 1}\n', "JSON lines"),
    ],
)
def test_the_format_by_extension_else_by_content(name, text, fmt):
    assert parse_sweep_file(text, name)[2] == fmt


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "g.jsonl",
            '{"a": 1}\n{"a": 2, "b": 3}\n',
            "g.jsonl:2: adds b (every line names the same parameters: a)",
        ),
        ("g.jsonl", '{"a": 1, "b": 2}\n{"a": 2}\n', "g.jsonl:2: lacks b"),
        ("g.jsonl", '{"a": 1}\n{"a": null}\n', "g.jsonl:2: a is null"),
        ("g.jsonl", '{"a": [1, 2]}\n', "g.jsonl:1: a is a list"),
        ("g.jsonl", '{"a": {"b": 1}}\n', "g.jsonl:1: a is an object"),
        ("g.jsonl", '{"a": 1}\n{"a": 1 \n', "g.jsonl:2: not a JSON object"),
        ("g.jsonl", "[1, 2]\n", "g.jsonl:1: not a JSON object with parameters"),
        ("g.jsonl", '{"a": 1, "a": 2}\n', "g.jsonl:1: the key 'a' appears twice"),
        ("g.jsonl", '{"a-b": 1}\n', "'a-b' is not a usable parameter name"),
        ("g.jsonl", '{"a": 1}\n{"a": 2}\n{"a": 1}\n', "g.jsonl:3: the same point as line 1 (a=1)"),
        ("g.csv", "a,b\n1,2\n3\n", "g.csv:3: 1 value(s), but the header names 2 (a, b)"),
        ("g.csv", "a,b\n1,\n", "g.csv:2: no value for b"),
        ("g.csv", "a\n", "no points in it (read as CSV)"),
        ("g.jsonl", "\n\n", "no points in it (read as JSON lines)"),
    ],
)
def test_bad_sweep_files_name_the_line(name, text, message):
    with pytest.raises(UsageError) as err:
        parse_sweep_file(text, name)
    assert message in err.value.message


def test_a_file_crossed_with_sweep_options():
    sweep = build_sweep(["seed=0..1"], file_text="lr,wd\n1,0.1\n2,0.2\n", file_name="pairs.csv")
    assert [p.values for p in sweep.points] == [
        {"lr": "1", "wd": "0.1", "seed": "0"},
        {"lr": "1", "wd": "0.1", "seed": "1"},
        {"lr": "2", "wd": "0.2", "seed": "0"},
        {"lr": "2", "wd": "0.2", "seed": "1"},
    ]
    assert "pairs.csv (CSV, 2 line(s))" in sweep.source
    with pytest.raises(UsageError, match="'seed' is given twice"):
        build_sweep(["seed=0..1"], file_text='{"seed": 1}\n', file_name="s.jsonl")


# --- the command ------------------------------------------------------------------------------------


def test_placeholders_are_replaced_in_argv_words():
    point = Point(3, (("lr", "0.1"), ("seed", "7")))
    argv = ["python", "train.py", "--lr={lr}", "--out=run-{lr}-{seed}", "{seed}", "--tag={{lr}}"]
    assert point.command(argv) == ("python", "train.py", "--lr=0.1", "--out=run-0.1-7", "7", "--tag={lr}")


@pytest.mark.parametrize(
    "word",
    ["${HOME}", "${{lr}}", '{"lr": 1}', "{a,b}", "{{ jinja }}", "{}", "{1}", "{lr"],
)
def test_other_braces_are_left_alone(word):
    assert Point(0, (("lr", "X"),)).command([word]) == (word,)
    assert placeholders(word) == []


# Values a program may be given: they must arrive byte for byte through the job's shell, where rv
# quotes each word of the command once (rv.slurm.launch.program_line uses shlex.quote per word).
TRICKY = ["0.1", "a b", "it's", '"q"', "$HOME", "`id`", "a\\b", "x\ny", "*", "-n", "--", "ünï", ""]


def _argv_through_bash(argv):
    out = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + " ".join(shlex.quote(w) for w in argv)],
        capture_output=True,
        check=True,
    ).stdout
    return out.decode().split("\0")[:-1]


def test_values_reach_the_program_byte_for_byte():
    for value in TRICKY:
        argv = Point(0, (("v", value),)).command(["--v={v}", "{v}", "pre{v}post"])
        assert _argv_through_bash(argv) == [f"--v={value}", value, f"pre{value}post"]


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=20))
def test_any_value_reaches_the_program_byte_for_byte(value):
    argv = Point(0, (("v", value),)).command(["--v={v}"])
    assert _argv_through_bash(argv) == [f"--v={value}"]


def test_a_placeholder_with_no_sweep_is_an_error():
    sweep = build_sweep(["lr=1,2"])
    with pytest.raises(UsageError) as err:
        check_command(sweep, ["python", "t.py", "--seed={seed}"])
    assert err.value.message == "the command uses {seed} but no --sweep seed gives it values"
    assert "{{seed}}" in (err.value.hint or "")
    with pytest.raises(UsageError) as err:
        check_command(sweep, ["python", "t.py", "--lr={LR}"])
    assert "write {lr} (names are case-sensitive)" in (err.value.hint or "")


def test_a_sweep_the_command_never_uses_is_a_warning():
    sweep = build_sweep(["lr=1,2", "seed=0..1", "wd=0,1"])
    warnings = check_command(sweep, ["python", "t.py", "--lr={lr}", "--wd=$RV_SWEEP_WD"])
    assert warnings == [
        "--sweep seed: the command never uses {seed}; each point's program sees it only as $RV_SWEEP_SEED"
    ]
    with pytest.raises(UsageError, match="needs a command"):
        check_command(sweep, [])


def test_values_a_shell_script_word_would_reread_are_refused():
    safe = build_sweep(["lr=1e-4,0.1"])
    assert check_command(safe, ["bash", "-lc", "python t.py --lr={lr} && echo done"]) == []
    unsafe = build_sweep(["tag=plain,two words"])
    with pytest.raises(UsageError) as err:
        check_command(unsafe, ["/bin/sh", "-c", "python t.py --tag={tag}"])
    assert "'two words' (point 1) would be split or expanded" in err.value.message
    assert '"$RV_SWEEP_TAG"' in (err.value.hint or "")
    # Not a shell script: the word is the program's own, any value is fine.
    assert check_command(unsafe, ["python", "-c", "print('{tag}')"]) == []


# --- limits and arrays ------------------------------------------------------------------------------


def test_more_points_than_the_queue_takes_is_refused_before_anything_is_sent():
    check_limits(100, max_jobs=100)
    check_limits(10**6, max_jobs=None)
    with pytest.raises(UsageError) as err:
        check_limits(90, max_jobs=100, queued=20)
    assert err.value.message == (
        "the sweep has 90 points, but your queue limit (MaxSubmitJobs) is 100 jobs and 20 of your jobs "
        "are queued already: nothing was sent"
    )
    assert "at most 80 points" in (err.value.hint or "")


def test_one_array_when_it_fits():
    (part,) = plan_arrays(6, parallel=2, max_array_size=1001)
    assert (part.spec, part.points, part.after_previous) == ("0-5%2", (0, 1, 2, 3, 4, 5), False)
    assert plan_arrays(6, parallel=None, max_array_size=1001)[0].spec == "0-5"
    assert plan_arrays(3, parallel=8, max_array_size=1001)[0].spec == "0-2"  # %8 would limit nothing
    assert plan_arrays(1, parallel=None, max_array_size=1001)[0].spec == "0"


def test_max_array_size_bounds_the_index_so_larger_sweeps_split():
    # MaxArraySize=4: task ids 0..3 only (slurm.conf: the largest index is MaxArraySize - 1).
    parts = plan_arrays(10, parallel=2, max_array_size=4)
    assert [p.spec for p in parts] == ["0-3%2", "0-3%2", "0-1"]
    assert [p.points for p in parts] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [p.after_previous for p in parts] == [False, True, True]
    assert parts[1].point(3) == 7
    # Without --parallel nothing needs waiting for.
    assert not any(p.after_previous for p in plan_arrays(10, parallel=None, max_array_size=4))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3000), st.integers(1, 1001), st.one_of(st.none(), st.integers(1, 1001)),
    st.one_of(st.none(), st.integers(1, 50)),
)  # fmt: skip
def test_every_point_runs_once_within_slurm_limits(count, max_size, max_tasks, parallel):
    parts = plan_arrays(count, parallel=parallel, max_array_size=max_size, max_array_tasks=max_tasks)
    assert [p for part in parts for p in part.points] == list(range(count))
    for part in parts:
        ids, _, throttle = part.spec.partition("%")
        high = int(ids.rpartition("-")[2])
        assert high == part.count - 1 <= max_size - 1  # every task id exists and is allowed
        assert part.count <= (max_tasks or max_size)
        assert throttle == ("" if parallel is None or parallel >= part.count else str(parallel))


def test_a_retry_array_maps_task_ids_to_the_points_that_failed():
    (part,) = plan_arrays([2, 5, 9], parallel=1, max_array_size=1001)
    assert part.spec == "0-2%1"
    assert [part.point(t) for t in range(3)] == [2, 5, 9]
    assert part.describe() == "points 2,5,9"


def test_a_cluster_without_arrays_is_refused():
    with pytest.raises(UsageError, match="MaxArraySize=0"):
        plan_arrays(3, parallel=None, max_array_size=0)
    with pytest.raises(UsageError, match="at least one point"):
        plan_arrays([], parallel=None, max_array_size=10)


def test_array_part_of_one_point():
    part = ArrayPart((4,), parallel=None, after_previous=False)
    assert (part.spec, part.describe(), part.offset) == ("0", "point 4", 4)


# --- names and the dry run ---------------------------------------------------------------------------


def test_point_references():
    assert parse_point_ref("grid/3") == ("grid", 3)
    assert parse_point_ref("grid") == ("grid", None)
    with pytest.raises(UsageError, match="SWEEP/INDEX"):
        parse_point_ref("grid/x")


def test_the_dry_run_lists_every_point_and_its_command():
    sweep = build_sweep(["lr=1e-4,a b", "seed=0..1"], parallel=2)
    command = ["python", "train.py", "--lr={lr}", "--seed", "{seed}"]
    text = dry_run_text(sweep, command, plan_arrays(len(sweep), parallel=2, max_array_size=3))
    lines = text.splitlines()
    assert lines[0] == "sweep of 4 point(s) over lr, seed, at most 2 at once"
    assert lines[1] == "from --sweep lr (2 values) x seed (2 values)"
    assert lines[2] == (
        "2 job array(s): --array=0-2%2 (points 0-2); --array=0 (point 3) after the previous array ends"
    )
    assert lines[3] == "each point's program also sees RV_SWEEP_INDEX, RV_SWEEP_LR, RV_SWEEP_SEED"
    assert lines[5].split() == ["INDEX", "lr", "seed", "COMMAND"]
    assert lines[6] == "0      1e-4  0     python train.py --lr=1e-4 --seed 0"
    assert lines[9] == "3      a b   1     python train.py '--lr=a b' --seed 1"
    assert len(lines) == 10
