"""Placement, pure parts: sbatch options, GPU types for one run, sbatch --test-only's answers, where a
setting came from, and how a run sent once per GPU type shows in `rv ps`."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from rv.catalog import RIVANNA, GpuType, memory_gb_for
from rv.cli.defaults import BUILT_IN, COMMAND_LINE, Layer, apply_layers, project_layer
from rv.errors import ConfigError, UsageError
from rv.job.records import parse_runs, run_views
from rv.placement import (
    build_placement,
    candidate_types,
    check_sbatch_option,
    parse_test_only,
    plan_requests,
    type_words,
)
from rv.request import build_request
from rv.slurm.parse import SQUEUE_FORMAT, parse_squeue
from rv.slurm.script import ScriptContext, render_script

# --- --sbatch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kept",
    [
        ("--begin=now+1hour", "--begin=now+1hour"),
        ("--mail-type=END", "--mail-type=END"),
        ("--exclusive", "--exclusive"),
        ("--comment rvtest", "--comment=rvtest"),
        ("  --hint=nomultithread ", "--hint=nomultithread"),
    ],
)
def test_sbatch_options_pass_as_written(text, kept):
    assert check_sbatch_option(text) == kept


@pytest.mark.parametrize(
    "text, flag",
    [
        ("--time=1:00:00", "rv run --time"),
        ("-t 10", "rv run --time"),
        ("--gres=gpu:2", "rv run -g/-t"),
        ("--nodes=2", "rv run --nodes"),
        ("--ntasks=8", "one task per node"),
        ("--output=x.log", "rv logs"),
        ("--signal=USR1@60", "rv run --signal"),
        ("--requeue", "requeue"),
        ("--dependency=afterok:1", "chains"),
        ("--job-name=x", "rv run --name"),
        ("--array=1-3", "rv run --sweep"),
        ("--partition=gpu", "rv run --partition"),
        ("-x node3", "rv run --exclude"),
        ("--time-min=1:00:00", "rv run --time-min"),
    ],
)
def test_options_rv_sets_itself_are_refused_naming_the_rv_flag(text, flag):
    with pytest.raises(UsageError) as err:
        check_sbatch_option(text)
    assert "rv sets" in err.value.message and flag in (err.value.hint or "")


@pytest.mark.parametrize(
    "text, owned, flag",
    [
        ("--arr=0-2", "--array", "rv run --sweep"),
        ("--partit=gpu-v100", "--partition", "rv run --partition"),
        ("--partit gpu-v100", "--partition", "rv run --partition"),
        ("-p gpu-v100", "--partition", "rv run --partition"),
        ("-p=gpu-v100", "--partition", "rv run --partition"),
        ("--job-n=x", "--job-name", "rv run --name"),
        ("--j=x", "--job-name", "rv run --name"),
        ("-J x", "--job-name", "rv run --name"),
        ("--depend=afterok:1", "--dependency", "chains"),
        ("-d afterok:1", "--dependency", "chains"),
        ("--sig=USR1@60", "--signal", "rv run --signal"),
        ("-a 1-3", "--array", "rv run --sweep"),
        ("--ntasks-per-g=2", "--ntasks-per-gpu", "one task per node"),
        ("--tasks-per-node=2", "--tasks-per-node", "one task per node"),
        ("-F nodes.txt", "--nodefile", "rv run --nodelist"),
        ("--tres-per-task=gres/gpu:2", "--tres-per-task", "rv run -g/-t"),
        # A short option's value glued on, as getopt reads it (issue 41: "not an sbatch option").
        ("-N3", "--nodes", "rv run --nodes"),
        ("-o/tmp/x", "--output", "rv logs"),
        ("-Jfoo", "--job-name", "rv run --name"),
        ("-wnode1", "--nodelist", "rv run --nodelist"),
        ("-Cib", "--constraint", "rv run --constraint"),
        ("-t1:00", "--time", "rv run --time"),
    ],
)
def test_every_spelling_sbatch_reads_as_an_option_rv_sets_is_refused(text, owned, flag):
    # sbatch (getopt_long) reads any prefix one option has, and short forms: each is that option.
    with pytest.raises(UsageError) as err:
        check_sbatch_option(text)
    assert f"rv sets {owned} itself" in err.value.message and flag in (err.value.hint or ""), (
        err.value.message
    )


@pytest.mark.parametrize(
    "text, why",
    [
        ("--export=NONE", "without ALL"),
        ("--export=HOME,PATH", "without ALL"),
        ("--export", "without ALL"),
        ("--chdir=/tmp", "own copy of the code"),
        ("-D /tmp", "own copy of the code"),
        ("--ch=/tmp", "own copy of the code"),
        ("-M other", "profile's cluster"),
        ("--usage", "queue nothing"),
    ],
)
def test_options_the_job_cannot_run_with_are_refused_with_the_reason(text, why):
    with pytest.raises(UsageError) as err:
        check_sbatch_option(text)
    assert why in err.value.message and err.value.hint, err.value.message


def test_a_prefix_several_options_share_is_refused_naming_them_and_other_options_pass():
    with pytest.raises(UsageError) as err:
        check_sbatch_option("--no=1")
    assert "--nodes" in err.value.message and "--no-kill" in err.value.message
    with pytest.raises(UsageError, match="--time, --time-min"):
        check_sbatch_option("--tim=10")
    assert check_sbatch_option("--export=ALL,FOO=1") == "--export=ALL,FOO=1"
    assert check_sbatch_option("--mail-t=END") == "--mail-t=END"  # sbatch reads it; nothing of rv's
    assert check_sbatch_option("-L lic") == "-L lic"  # getopt would read `-L=lic` as "=lic"
    assert check_sbatch_option("-Llic") == "-L lic"  # glued, as getopt reads it
    with pytest.raises(UsageError, match="followed by more one-letter options"):
        check_sbatch_option("-Hk")  # -H takes no value: getopt reads -H -k
    assert check_sbatch_option("--some-newer-option=1") == "--some-newer-option=1"  # sbatch judges it


def test_the_long_option_list_is_sbatchs_own():
    # What sbatch 22.05 answers for each one-letter prefix (tests/captured): every option it names is
    # in rv's list and rv's list names no other (integration: the cluster's sbatch is asked again).
    from rv.slurmoptions import LONG_OPTIONS, SHORT_OPTIONS

    captured = (Path(__file__).parents[1] / "captured" / "sbatch_long_options_22.05.txt").read_text()
    assert sorted(LONG_OPTIONS) == sorted(options_in_sbatch_answers(captured))
    assert set(SHORT_OPTIONS.values()) <= set(LONG_OPTIONS)


def options_in_sbatch_answers(text: str) -> list[str]:
    """The long options sbatch names in its answers to `sbatch --X`: the possibilities of an ambiguous
    prefix, or the one option a unique prefix is (which, asked without its value, sbatch names)."""
    import re

    names = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if "is ambiguous" in line:
            names += re.findall(r"'--([a-z-]+)'", line.split("possibilities:", 1)[1])
        elif "requires an argument" in line:
            names += re.findall(r"option '--([a-z-]+)'", line)
    return names


@pytest.mark.parametrize("text", ["begin=now", "--comment='two words'", "--comment=a%j", "--x=a b", ""])
def test_what_is_no_sbatch_option_or_cannot_go_into_a_directive_is_refused(text):
    with pytest.raises(UsageError):
        check_sbatch_option(text)


def test_placement_values_are_checked_and_time_min_fits_in_time():
    with pytest.raises(UsageError, match="--qos 'a b' cannot go into an #SBATCH line"):
        build_placement(qos="a b")
    with pytest.raises(UsageError, match="longer than the job's --time"):
        build_placement(time_min="3h", time_seconds=3600)


def test_time_min_errors_name_time_min_and_the_default_time_when_none_was_typed():
    # Issue 33: they named --time (for a bad --time-min), or a --time the user never typed.
    for bad, said in (("90", "--time-min '90' has no unit"), ("soon", "cannot read --time-min 'soon'")):
        with pytest.raises(UsageError) as err:
            build_placement(time_min=bad, time_seconds=3600)
        assert said in err.value.message, err.value.message
    with pytest.raises(UsageError) as err:
        build_placement(time_min="4h", time_seconds=10740, time_typed=False)
    assert err.value.message == (
        "--time-min 4h is longer than the job's --time, rv's default 02:59:00 (no --time was given)"
    )
    with pytest.raises(UsageError, match=r"longer than the job's --time 01:00:00$"):
        build_placement(time_min="3h", time_seconds=3600)
    with pytest.raises(UsageError, match="--max-fault-retries -1"):
        build_placement(max_fault_retries=-1)
    place = build_placement(time_min="30m", time_seconds=3600, exclude="gpu-07", sbatch=["--exclusive"])
    assert (place.time_min_seconds, place.exclude, place.sbatch, place.max_fault_retries) == (
        1800, "gpu-07", ("--exclusive",), 2
    )  # fmt: skip


# --- GPU types --------------------------------------------------------------------------------------


def test_type_words():
    assert type_words(None) is None
    assert type_words("a100, a6000") == ["a100", "a6000"]
    assert type_words("any") == ["any"]
    for bad in ("a100,", "a100,a100", "any,a100"):
        with pytest.raises(UsageError):
            type_words(bad)


def test_any_or_no_type_means_every_full_gpu_type_cheapest_first_never_mig():
    types, notes = candidate_types(RIVANNA, None)
    names = [t.name for t in types]
    assert "mig" not in names and names[0] == "v100" and names[-1] == "h200" and notes == []
    assert [t.name for t in candidate_types(RIVANNA, ["any"])[0]] == names


def test_vram_narrows_the_types_and_says_what_it_left_out():
    catalog = {**RIVANNA, "odd": GpuType("odd", "p", "odd", 4)}
    types, notes = candidate_types(catalog, None, vram_gb=48)
    assert sorted(t.name for t in types) == ["a100", "a40", "a6000", "h200"]
    assert any("odd (memory unknown" in n for n in notes) and any("v100" in n for n in notes)
    with pytest.raises(UsageError, match="no GPU type of this cluster has 500 GB per GPU"):
        candidate_types(RIVANNA, None, vram_gb=500)


def test_vram_on_a_type_of_unknown_memory_says_so_and_nan_or_inf_is_no_amount():
    # Issue 33: `-t v100 --vram 16` said no type has 16 GB, when the catalog only lacked v100's memory.
    catalog = {**RIVANNA, "odd": GpuType("odd", "p", "odd", 4)}
    with pytest.raises(UsageError) as err:
        plan_requests(catalog, ["odd"], gpus=1, mig=False, vram_gb=16, build=lambda name: name)
    assert err.value.message == "--vram 16: the catalog does not know how much memory odd has per GPU"
    assert "drop --vram" in (err.value.hint or "")
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(UsageError, match="must be a number of GB per GPU, more than 0"):
            candidate_types(RIVANNA, None, vram_gb=bad)


def test_an_unknown_type_names_close_ones():
    with pytest.raises(UsageError, match="did you mean a6000"):
        candidate_types(RIVANNA, ["a600"])


def test_memory_of_a_model_only_where_its_name_says_it():
    assert memory_gb_for("a6000") == 48 and memory_gb_for("NVIDIA_A100-SXM4-80GB") == 80
    assert memory_gb_for("a100") is None and memory_gb_for("v100") is None  # sold in two sizes
    assert memory_gb_for("v100-32g") == 32 and memory_gb_for("a10") == 24
    assert memory_gb_for("1g.10gb") is None  # a MIG profile names a slice, not a card


def build_for(**kw):
    return lambda name: build_request(RIVANNA, command=["torchrun", "t.py"], gpu_type=name, **kw)


def test_one_named_type_is_one_request_as_before():
    reqs, notes = plan_requests(RIVANNA, ["a6000"], gpus=2, mig=False, vram_gb=None, build=build_for(gpus=2))
    assert [r.type.name for r in reqs] == ["a6000"] and notes == []


def test_several_types_keep_those_that_can_serve_and_say_why_not_the_others():
    # 8 GPUs in one job: rtx3090 (2 per job), v100 (4 per job) and h200 (4 per job) cannot.
    reqs, notes = plan_requests(RIVANNA, ["any"], gpus=8, mig=False, vram_gb=None, build=build_for(gpus=8))
    assert [r.type.name for r in reqs] == ["a6000", "a40", "a100-40", "a100"]
    assert any(n.startswith("left out v100: -g 8") for n in notes)
    with pytest.raises(UsageError, match="no GPU type can serve this request"):
        plan_requests(RIVANNA, ["v100", "rtx3090"], gpus=8, mig=False, vram_gb=None, build=build_for(gpus=8))


# --- sbatch --test-only ------------------------------------------------------------------------------


def test_test_only_answers():
    ok = parse_test_only(
        "a6000", 0, "sbatch: Job 4000050 to start at 2026-11-25T22:47:49 using 1 processors on nodes gpu-01 "
        "in partition gpu\n"
    )  # fmt: skip
    assert (ok.start, ok.nodes, ok.partition, ok.error) == ("2026-11-25T22:47:49", "gpu-01", "gpu", None)
    bad = parse_test_only(
        "v100", 1, "sbatch: error: Invalid qos specification\nsbatch: error: Batch job submission failed: x\n"
    )
    assert bad.start is None and bad.error == "Invalid qos specification; Batch job submission failed: x"
    assert parse_test_only("t", 1, "").error == "sbatch --test-only exit 1"
    # An option sbatch lacks: its own line, not the one after it (what sbatch 22.05 writes).
    lacks = parse_test_only(
        "t", 255, "sbatch: unrecognized option '--bell'\nTry \"sbatch --help\" for more information\n"
    )
    assert lacks.error == "unrecognized option '--bell'"


# --- the script --------------------------------------------------------------------------------------


def test_directives_carry_the_placement_and_join_constraints():
    req = build_request(RIVANNA, command=["python", "t.py"], gpu_type="a100", time="2h")
    place = build_placement(
        qos="high", constraint="ib", exclude="gpu-07", reservation="course", account="other",
        sbatch=["--begin=now+1hour"], time_min="1h", time_seconds=req.time_seconds, max_fault_retries=1,
    )  # fmt: skip
    ctx = ScriptContext(remote_root="/r", snapshot_id="s1", project="p", run_id="r1", account="mine",
                        placement=place)  # fmt: skip
    script = render_script(req, ctx)
    lines = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --constraint=a100_80gb&ib" in lines  # the type's feature and the user's
    assert "#SBATCH --account=other" in lines and "#SBATCH --account=mine" not in lines
    for want in ("--qos=high", "--exclude=gpu-07", "--reservation=course", "--time-min=01:00:00",
                 "--begin=now+1hour"):  # fmt: skip
        assert f"#SBATCH {want}" in lines
    assert lines[-1] == "#SBATCH --begin=now+1hour"  # the user's own options come last
    assert "rv_exclude=gpu-07 rv_max_fault_retries=1" in script


# --- where a setting came from ------------------------------------------------------------------------


@click.command()
@click.option("-g", "--gpu", "gpus", type=int)
@click.option("--time", "time_")
@click.option("--max-segments", type=int)
@click.option("--setup", multiple=True)
@click.option("--name")
@click.option("-t", "--type", "gpu_type")
@click.option("--vram", type=float)
@click.option("--python", "python_")
@click.option("-f", "--follow", is_flag=True)
@click.pass_context
def tiny(ctx, **_kw):
    sources = apply_layers(
        ctx,
        [Layer("project", ctx.obj["project"]), Layer("profile", ctx.obj["profile"])],
        exclude=("name",),
    )
    click.echo(repr(({k: v for k, v in ctx.params.items()}, sources)))


def run_tiny(args, project, profile):
    result = CliRunner().invoke(tiny, args, obj={"project": project, "profile": profile})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return eval(result.output)


def test_command_line_over_project_over_profile_over_rv():
    params, sources = run_tiny(
        ["--time", "1h"],
        {"time": "4h", "max_segments": 3, "setup": ["module load x"]},
        {"gpu": 2, "max-segments": 9},
    )
    assert params["time_"] == "1h" and sources["time_"] == COMMAND_LINE
    assert params["max_segments"] == 3 and sources["max_segments"] == "project"
    assert params["gpus"] == 2 and sources["gpus"] == "profile"
    assert params["setup"] == ("module load x",) and sources["setup"] == "project"
    assert params["name"] is None and sources["name"] == BUILT_IN


def test_a_bad_defaults_table_says_what_is_valid():
    with pytest.raises(ConfigError) as err:
        run_tiny([], {"gpus_total": 2}, {})
    assert "unknown rv run option 'gpus_total'" in err.value.message and "max-segments" in (
        err.value.hint or ""
    )
    with pytest.raises(ConfigError, match="project: gpu = 'two'"):
        run_tiny([], {"gpu": "two"}, {})
    with pytest.raises(ConfigError, match="setup must be a list"):
        run_tiny([], {"setup": "module load x"}, {})
    with pytest.raises(ConfigError, match="unknown rv run option 'name'"):
        run_tiny([], {"name": "x"}, {})  # what names one run is never a project's default


@pytest.mark.parametrize(
    "table, said",
    [
        ({"gpu": 2.7}, "project: gpu = 2.7 (a number with a point): gpu must be an integer"),
        ({"gpu": True}, "project: gpu = true (true/false): gpu must be an integer"),
        ({"time": 8}, "project: time = 8 (an integer): time must be a string"),
        ({"vram": "40"}, "project: vram = '40' (a string): vram must be a number"),
        ({"follow": "yes"}, "project: follow = 'yes' (a string): follow must be true or false"),
        ({"setup": ["a", 1]}, "setup must be a list of strings"),
        ({"type": ["a100", 3]}, "type must be a list of strings"),
        ({"type": []}, "project: type = [] (a list): type must name at least one GPU type"),
        ({"type": ["a100", " "]}, "type must name at least one GPU type, each not empty"),
        ({"max-segments": 2, "max_segments": 3}, "project: max-segments and max_segments are one key"),
        ({"python_": "3.11"}, "unknown rv run option 'python_'"),
        ({"python-": "3.11"}, "unknown rv run option 'python-'"),
        ({"gpus": 2}, "unknown rv run option 'gpus' (did you mean gpu?)"),
    ],
)
def test_defaults_are_typed_documented_keys_spelt_one_way(table, said):
    # Issue 33: 2.7 and true became 1 or 2 GPUs, internal names were keys, a second spelling lost.
    with pytest.raises(ConfigError) as err:
        run_tiny([], table, {})
    assert said in err.value.message and err.value.hint, err.value.message


def test_the_valid_keys_are_the_options_long_names_and_a_type_list_is_several_types():
    with pytest.raises(ConfigError) as err:
        run_tiny([], {"nope": 1}, {})
    keys = err.value.hint.removeprefix("valid keys: ").split(", ")
    assert keys == ["follow", "gpu", "max-segments", "python", "setup", "time", "type", "vram"]
    params, _ = run_tiny([], {"type": ["a100", "a6000"], "vram": 40, "max_segments": 2}, {})
    assert (params["gpu_type"], params["vram"], params["max_segments"]) == ("a100,a6000", 40.0, 2)


def test_only_some_options_take_defaults_the_rest_are_left_to_rv_run():
    @click.command()
    @click.option("--time", "time_")
    @click.option("--qos")
    @click.pass_context
    def shell(ctx, **_kw):
        sources = apply_layers(ctx, [Layer("project", ctx.obj)], only=("qos",))
        click.echo(repr((ctx.params, sources)))

    # rv run's keys this command lacks (max-segments, even a misspelt one) are rv run's to refuse.
    result = CliRunner().invoke(shell, [], obj={"time": "2d", "qos": "high", "max-segments": 3, "gpux": 1})
    params, sources = eval(result.output)
    assert params == {"time_": None, "qos": "high"} and sources["time_"] == BUILT_IN


def test_rv_up_takes_placement_setup_and_environment_from_the_defaults_never_its_size():
    from rv.cli.layered import UP_DEFAULTS
    from rv.cli.up import up

    names = {p.name for p in up.params}
    assert set(UP_DEFAULTS) <= names  # each one an option of rv up
    assert {"qos", "constraint", "exclude", "sbatch_options", "setup", "env_choice"} <= set(UP_DEFAULTS)
    assert not {"gpus", "gpu_type", "time_", "nodes", "mem", "name", "detach"} & set(UP_DEFAULTS)


def test_project_defaults_live_in_pyproject_or_rv_toml(tmp_path: Path):
    assert project_layer(tmp_path) is None
    (tmp_path / ".rv.toml").write_text('type = "a100,a6000"\n')
    assert project_layer(tmp_path).values == {"type": "a100,a6000"}
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert project_layer(tmp_path).source == ".rv.toml"  # a pyproject without [tool.rv]
    (tmp_path / "pyproject.toml").write_text('[tool.rv]\ntime = "4h"\n')
    with pytest.raises(ConfigError, match="both"):
        project_layer(tmp_path)
    (tmp_path / ".rv.toml").unlink()
    layer = project_layer(tmp_path)
    assert layer.source == "pyproject.toml [tool.rv]" and layer.values == {"time": "4h"}
    (tmp_path / "pyproject.toml").write_text("[tool.rv\n")
    with pytest.raises(ConfigError, match="cannot be read"):
        project_layer(tmp_path)


# --- rv ps -----------------------------------------------------------------------------------------


def squeue_line(job: str, state: str, reason: str, gres: str) -> str:
    fields = {"%i": job, "%T": state, "%r": reason, "%j": "t", "%b": gres}
    return "|".join(fields.get(f, "") for f in SQUEUE_FORMAT.split("|"))


def test_a_run_sent_once_per_type_is_one_line_pending_on_each_then_where_it_landed():
    meta = {"name": "t", "gpus": 1, "gpu_type": "a6000", "gpu_types": ["a6000", "v100"], "created": 1.0}
    segment = {"segment": 1, "job_id": "11", "record": None, "candidates": [["11", "a6000"], ["12", "v100"]]}
    pending = [{"run_id": "r1", "meta": meta, "segments": [segment]}]
    lines = [
        squeue_line("11", "PENDING", "Resources", "gres/gpu:a6000:1"),
        squeue_line("12", "PENDING", "Priority", "gres/gpu:v100:1"),
    ]
    queued = parse_squeue("\n".join(lines))
    (view,) = run_views(parse_runs(pending), queued, now=10.0)
    assert view.state == "PENDING" and view.gpu_type == "a6000|v100" and view.jobs == ("11", "12")
    assert view.reason == "pending on a6000 (Resources), v100 (Priority)"
    record = {"segment": 1, "job_id": "12", "state": "running", "start": 5, "gpu_type": "v100"}
    placed = [{**pending[0], "segments": [{**pending[0]["segments"][0], "job_id": "12", "record": record}]}]
    (view,) = run_views(parse_runs(placed), parse_squeue(squeue_line("12", "RUNNING", "None", "")), now=10.0)
    assert (view.state, view.job_id, view.gpu_type) == ("RUNNING", "12", "v100")


def test_one_reason_for_every_type_is_said_once():
    build = lambda name: build_request(RIVANNA, command=["python", "t.py"], gpu_type=name, gpus=8)  # noqa: E731
    with pytest.raises(UsageError) as err:
        plan_requests(RIVANNA, ["a6000", "a40"], gpus=8, mig=False, vram_gb=None, build=build)
    assert err.value.message.startswith("`python t.py` is one process")


def test_what_one_may_ask_for_in_one_line_each():
    from rv.catalog import Partition
    from rv.probe import usable_lines

    assoc = (("rv", "", "normal", ("normal", "high")), ("rv", "gpu-v100", "", ("normal",)))
    parts = {"a": Partition("a", default=True), "b": Partition("b")}
    assert usable_lines(["rv"], assoc, parts) == [
        ("accounts", "rv (rv run --account)"),
        ("qos", "normal, high (rv run --qos; default normal)"),
        ("partitions", "a (default), b (rv run --partition; your associations name gpu-v100)"),
    ]
    assert usable_lines([], (), {}) == []
