from dataclasses import replace

import pytest

from rv.catalog import RIVANNA, GpuType, Partition
from rv.errors import UsageError
from rv.launcher import parse_launcher, parse_torchrun
from rv.misplaced import detect_misplaced_flags as _detect_misplaced_flags
from rv.request import (
    DEFAULT_SIGNAL_LEAD,
    RequestError,
    build_request,
    default_name,
    sanitise_name,
)


def detect_misplaced_flags(command, catalog=None):
    """The check as `rv run` makes it: with the option words of its click command."""
    from rv.cli.run import option_words, run

    return _detect_misplaced_flags(command, catalog, flags=option_words(run))


A6000 = RIVANNA["a6000"]
ONE_TYPE = {"a6000": A6000}
# Rivanna caps v100 jobs at one node's 4 GPUs; without the cap it is a handy 4-per-node type for
# multi-node cases.
CATALOG = {**RIVANNA, "v100": replace(RIVANNA["v100"], max_gpus_per_job=None)}


def req(**kw):
    # A launcher: a plain command on several GPUs or nodes is refused (tests of that below).
    kw.setdefault("command", ["torchrun", "train.py"])
    return build_request(CATALOG, **kw)


def usage_error(**kw) -> UsageError:
    with pytest.raises(UsageError) as err:
        req(**kw)
    return err.value


# --- GPU type -----------------------------------------------------------------------------------


def test_unknown_type_lists_valid_types_and_a_close_match():
    err = usage_error(gpu_type="a600")
    assert "'a600'" in err.message
    assert "did you mean a6000" in err.message
    for name in RIVANNA:
        assert name in err.hint


def test_no_type_with_several_in_catalog_lists_them():
    err = usage_error(gpus=1)
    assert "-t TYPE" in err.hint
    assert "a6000" in err.hint and "v100" in err.hint


def test_no_type_with_one_in_catalog_uses_it():
    r = build_request(ONE_TYPE, command=["torchrun", "x.py"], gpus=2)
    assert r.type == A6000
    assert (r.gpus, r.nodes, r.gpus_per_node) == (2, 1, 2)


def test_default_is_one_gpu():
    r = build_request(ONE_TYPE, command=["python", "x.py"])
    assert r.gpus == 1


def test_cpu_only_job_has_no_type():
    r = req(gpus=0)
    assert r.type is None and r.cpu_only
    assert (r.gpus, r.nodes, r.gpus_per_node) == (0, 1, 0)


def test_cpu_only_with_a_type_is_contradictory():
    err = usage_error(gpus=0, gpu_type="a6000")
    assert "-g 0" in err.message


def test_empty_catalog_needs_cpu_only():
    with pytest.raises(UsageError) as err:
        build_request({}, command=["python", "x.py"])
    assert "no GPU types" in err.value.message
    assert build_request({}, command=["python", "x.py"], gpus=0).cpu_only


# --- MIG ----------------------------------------------------------------------------------------


def test_mig_forces_one_gpu_one_cpu_and_its_memory():
    r = req(mig=True)
    assert r.mig and r.type.name == "mig"
    assert (r.gpus, r.cpus_per_task, r.mem) == (1, 1, "16G")


def test_mig_type_by_name_is_the_same():
    r = req(gpu_type="mig")
    assert r.mig and r.cpus_per_task == 1 and r.mem == "16G"


def test_mig_refuses_more_gpus_cpus_or_memory():
    assert "one GPU" in usage_error(mig=True, gpus=2).message
    assert "exactly 1 CPU" in usage_error(mig=True, cpus=4).message
    assert "at most 16G" in usage_error(mig=True, mem="64G").message
    assert req(mig=True, mem="8G").mem == "8G"


def test_mig_without_mig_type_in_catalog():
    with pytest.raises(UsageError) as err:
        build_request(ONE_TYPE, command=["python", "x.py"], mig=True)
    assert "no type named 'mig'" in err.value.message
    assert "a6000" in err.value.hint


def test_mig_with_other_type_conflicts():
    assert "two different" in usage_error(mig=True, gpu_type="a100").message


# --- nodes --------------------------------------------------------------------------------------


def test_gpus_within_a_node_stay_on_one_node():
    r = req(gpus=8, gpu_type="a6000")
    assert (r.nodes, r.gpus_per_node) == (1, 8)


def test_auto_split_over_the_fewest_nodes_when_even():
    # v100 nodes have 4 GPUs; 6 = 2 x 3.
    r = req(gpus=6, gpu_type="v100")
    assert (r.nodes, r.gpus_per_node) == (2, 3)
    r = req(gpus=8, gpu_type="v100")
    assert (r.nodes, r.gpus_per_node) == (2, 4)


def test_uneven_split_says_how():
    cat = {"g": GpuType("g", "p", "g", 8)}
    with pytest.raises(UsageError) as err:
        build_request(cat, command=["torchrun", "x.py"], gpus=9)
    e = err.value
    assert "-g 9 on g (8 per node)" in e.message and "2 nodes" in e.message
    assert e.hint == "use -g 8 (1 node) or -g 10 (2 nodes of 5) or --nodes 3 for 3 per node"
    # A command without a launcher runs on one GPU unless told otherwise: only -g 1 would be taken.
    with pytest.raises(UsageError) as err:
        build_request(cat, command=["python", "x.py"], gpus=9)
    assert err.value.hint == "use -g 1 (1 node)"


def test_uneven_split_over_more_nodes():
    # 14 on 4-per-node: 4 nodes needed, 14 is not a multiple of 4; 7 nodes of 2 would do.
    with pytest.raises(UsageError) as err:
        req(gpus=14, gpu_type="v100")
    assert err.value.hint == "use -g 12 (3 nodes of 4) or -g 16 (4 nodes of 4) or --nodes 7 for 2 per node"


def test_explicit_nodes_must_divide_and_fit():
    r = req(gpus=4, gpu_type="a6000", nodes=2)
    assert (r.nodes, r.gpus_per_node) == (2, 2)
    assert "does not split evenly over --nodes 4" in usage_error(gpus=6, gpu_type="a6000", nodes=4).message
    e = usage_error(gpus=8, gpu_type="v100", nodes=1)
    assert "8 per node" in e.message and "have 4" in e.message
    assert "--nodes 2" in e.hint


def test_more_nodes_than_the_type_has():
    # Slurm would keep such a job pending forever.
    cat = {"x": GpuType("x", "p", "x", 4, nodes=2)}
    with pytest.raises(UsageError) as err:
        build_request(cat, command=["torchrun", "x.py"], gpus=12)
    assert err.value.message == "-g 12: the cluster has 2 x node(s) of 4, 8 GPUs in all"
    assert err.value.hint == "use -g 8 (2 nodes of 4)"
    assert build_request(cat, command=["torchrun", "x.py"], gpus=8).nodes == 2


def test_nodes_must_be_positive():
    assert "--nodes 0" in usage_error(nodes=0, gpu_type="a6000").message


# --- limits -------------------------------------------------------------------------------------


def test_per_job_limit_in_message():
    e = usage_error(gpus=16, gpu_type="a6000")
    assert "at most 8 GPU(s) per job" in e.message
    assert "-g 8" in e.hint


def test_per_user_limit_alone_is_an_error():
    cat = {"x": GpuType("x", "p", "x", 8, max_gpus_per_user=4)}
    with pytest.raises(UsageError) as err:
        build_request(cat, command=["python", "x.py"], gpus=6)
    assert "at most 4 GPU(s) per user" in err.value.message


def test_time_over_type_max_names_the_max():
    e = usage_error(gpu_type="rtx3090", time="1d")
    assert "12:00:00" in e.message and "--time 1d" in e.message


def test_default_time():
    assert req(gpu_type="a6000").time_seconds == 2 * 3600 + 59 * 60


def test_bad_time_is_usage_error():
    assert "'soon'" in usage_error(gpu_type="a6000", time="soon").message


def test_cpus_and_mem():
    r = req(gpu_type="a6000", cpus=16, mem="64gb")
    assert (r.cpus_per_task, r.mem) == (16, "64G")
    assert req(gpu_type="a6000").cpus_per_task is None  # the cluster's default applies


def test_cpus_per_gpu_scales_with_gpus_per_node():
    cat = {"x": GpuType("x", "p", "x", 4, cpus_per_gpu=8, mem_per_gpu="32G")}
    r = build_request(cat, command=["torchrun", "x.py"], gpus=8)
    assert (r.nodes, r.gpus_per_node, r.cpus_per_task, r.mem) == (2, 4, 32, "128G")
    assert (r.cpus_source, r.mem_source) == ("catalog", "catalog")


def test_empty_command():
    assert "no command" in usage_error(command=[]).message
    assert "no command" in usage_error(command=[""]).message


def test_nul_in_command():
    assert "NUL" in usage_error(command=["python", "a\0b"], gpu_type="a6000").message


# --- name ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["torchrun", "train.py"], "train"),
        (["torchrun", "--nproc_per_node=2", "scripts/train.py", "--lr", "1"], "train"),
        (["python3", "-u", "scripts/finetune.py"], "finetune"),
        (["python", "-m", "rv_train.grpo"], "grpo"),
        (["python3.11", "-m", "torch.distributed.run", "--standalone", "t.py"], "t"),
        (["torchrun", "-m", "pkg.mod"], "mod"),
        (["bash", "run.sh"], "run"),
        (["./run.sh"], "run"),
        (["nvidia-smi"], "nvidia-smi"),
        (["uv", "run", "python", "x.py"], "x"),
        (["python", "-c", "print(1)"], "python"),
        (["/usr/bin/.hidden"], "hidden"),
        (["---"], "job"),
    ],
)
def test_default_name(command, name):
    assert default_name(command) == name


@pytest.mark.parametrize(
    ("typed", "problem"),
    [
        ("lr 0.1", "characters a run name cannot have (' ')"),
        ("lr/0.1", "characters a run name cannot have ('/')"),
        ("lr?0.1", "characters a run name cannot have ('?')"),
        ("ünï", "characters a run name cannot have ('ü', 'ï')"),
        ("my run/1 ü", "(' ', '/', 'ü')"),
        ("///", "('/')"),
        ("-rf", "starts with '-'"),
        (".hidden", "starts with '.'"),
        ("x" * 65, "is 65 characters long, over the 64"),
        ("", "is empty"),
    ],
)
def test_a_name_that_cannot_be_used_as_typed_is_refused_saying_what_is_allowed(typed, problem):
    err = usage_error(gpu_type="a6000", name=typed)
    assert err.message.startswith(f"--name {typed!r} ") and problem in err.message
    assert "ASCII letters, digits, '.', '_' and '-', at most 64" in err.hint


def test_names_are_taken_exactly_as_typed_so_different_names_stay_different_runs():
    typed = ["lr-0.1", "lr_0.1", "lr.0.1", "LR-0.1", "a" * 64, "a" * 63 + "b", "_x", "0"]
    names = [req(gpu_type="a6000", name=n).name for n in typed]
    assert names == typed and len(set(names)) == len(typed)
    assert not req(gpu_type="a6000", name="lr-0.1").warnings


@pytest.mark.parametrize(
    ("raw", "clean"),
    [("-rf", "rf"), ("..", ""), (".hidden", "hidden"), ("a" * 100, "a" * 64), ("ok.name_1-2", "ok.name_1-2")],
)
def test_sanitise_name_only_derives_default_names(raw, clean):
    assert sanitise_name(raw) == clean


# --- misplaced flags ----------------------------------------------------------------------------


def test_misplaced_gpu_flag():
    warnings = detect_misplaced_flags(["python", "train.py", "-g", "4"])
    assert warnings == [
        "-g 4 went to the program, not to rv; put rv options before the command: "
        "rv run -g 4 -- python train.py"
    ]


def test_misplaced_several_flags_fix_moves_all():
    warnings = detect_misplaced_flags(
        ["python", "train.py", "--time=2h", "-t", "a6000", "--lr", "3"], RIVANNA
    )
    assert len(warnings) == 2
    assert warnings[0].startswith("--time 2h went to the program")
    assert warnings[0].endswith("rv run --time 2h -t a6000 -- python train.py --lr 3")


@pytest.mark.parametrize(
    "command",
    [
        ["python", "train.py", "-g", "fast"],  # not a number
        ["python", "train.py", "-t", "bert"],  # not a known type
        ["python", "train.py", "--time", "now"],
        ["python", "train.py", "-f", "config.yaml"],
        ["python", "train.py", "--", "-g", "4"],
    ],
)
def test_program_flags_that_are_not_rv_like_are_quiet(command):
    assert detect_misplaced_flags(command, RIVANNA) == []


def test_output_flag_takes_any_path_so_it_is_reported():
    # rv's -o takes any path, so a program's own -o cannot be told apart: a warning, not an error.
    found = detect_misplaced_flags(["python", "train.py", "-o", "out.txt"])
    assert found == [
        "-o out.txt went to the program, not to rv; put rv options before the command: "
        "rv run -o out.txt -- python train.py"
    ]


# A value each of rv run's options would accept; an option added later gets "x" (any text).
SAMPLE_VALUES = {"gpus": "4", "gpu_type": "a6000", "time_": "2h", "mem": "64G", "cpus": "8", "nodes": "2",
                 "signal": "USR1@60", "max_segments": "3", "from_": "old@100"}  # fmt: skip


def _every_option_word():
    import click

    from rv.cli.run import run

    for param in run.params:
        if isinstance(param, click.Option):
            value = None if param.is_flag else SAMPLE_VALUES.get(param.name or "", "x")
            for word in param.opts:
                yield pytest.param(word, value, id=word)


@pytest.mark.parametrize(("word", "value"), list(_every_option_word()))
def test_every_option_of_rv_run_is_known_to_the_check(word, value):
    # Derived from the click command: an option added to `rv run` is caught after the command too.
    command = ["python", "x.py", word, *([value] if value is not None else [])]
    found = detect_misplaced_flags(command, RIVANNA)
    shown = f"{word} {value}" if value is not None else word
    assert found and found[0].startswith(f"{shown} went to the program"), found


def test_misplaced_boolean_flags():
    assert detect_misplaced_flags(["python", "x.py", "--mig"])[0].startswith("--mig went")
    assert detect_misplaced_flags(["python", "x.py", "--dry-run"])[0].startswith("--dry-run went")
    assert detect_misplaced_flags(["python", "x.py", "-f"])[0].startswith("-f went")


# --- torchrun -----------------------------------------------------------------------------------


def test_parse_torchrun_forms():
    tr = parse_torchrun(
        ["torchrun", "--nproc_per_node", "4", "--nnodes=2", "--standalone", "train.py", "--nnodes", "9"]
    )
    assert tr.launcher == ("torchrun",)
    assert tr.options == ("--nproc_per_node", "4", "--nnodes=2", "--standalone")
    assert tr.program == ("train.py", "--nnodes", "9")  # the script's own --nnodes is not torchrun's
    assert tr.value("nproc-per-node") == "4" and tr.value("nnodes") == "2" and tr.has("standalone")


def test_parse_torchrun_python_module_forms():
    tr = parse_torchrun(["python3", "-u", "-m", "torch.distributed.run", "--nproc-per-node=2", "t.py"])
    assert tr.launcher == ("python3", "-u", "-m", "torch.distributed.run")
    assert tr.value("nproc-per-node") == "2" and tr.program == ("t.py",)
    assert parse_torchrun(["/opt/venv/bin/torchrun", "t.py"]).launcher == ("/opt/venv/bin/torchrun",)
    assert parse_torchrun(["python", "-m", "torch.distributed.launch", "t.py"]) is None
    assert parse_torchrun(["python", "t.py"]) is None
    assert parse_torchrun(["python", "-c", "x", "-m", "torch.distributed.run"]) is None


def test_parse_torchrun_prefix_short_and_unknown_options():
    tr = parse_torchrun(["torchrun", "--nproc", "2", "-t3", "--future-flag", "--x=1", "t.py"])
    assert tr.value("nproc-per-node") == "2"
    assert tr.value("tee") == "3"
    assert tr.has("future-flag") and tr.value("x") == "1"
    assert tr.program == ("t.py",)


def test_parse_torchrun_missing_value():
    with pytest.raises(UsageError) as err:
        parse_torchrun(["torchrun", "--nproc-per-node"])
    assert "needs a value" in err.value.message


@pytest.mark.parametrize("flag", ["--nproc-per-node=8", "--nproc_per_node=8", "--nproc_per_node 8"])
def test_nproc_must_match_gpus_per_node(flag):
    # -g 8 on v100 (4 per node) is 2 x 4: the user's 8 per node would start 16 workers.
    e = usage_error(gpus=8, gpu_type="v100", command=["torchrun", *flag.split(" "), "train.py"])
    assert "--nproc-per-node=8" in e.message
    assert "rv sets --nproc-per-node=4" in e.hint


def test_nproc_matching_or_symbolic_is_fine():
    req(gpus=8, gpu_type="v100", command=["torchrun", "--nproc-per-node=4", "t.py"])
    req(gpus=8, gpu_type="v100", command=["torchrun", "--nproc-per-node=gpu", "t.py"])


def test_nnodes_must_match():
    e = usage_error(gpus=8, gpu_type="v100", command=["torchrun", "--nnodes=1", "t.py"])
    assert "--nnodes=1" in e.message and "rv sets --nnodes=2" in e.hint
    req(gpus=8, gpu_type="v100", command=["torchrun", "--nnodes=2:2", "t.py"])


def test_standalone_on_several_nodes():
    e = usage_error(gpus=8, gpu_type="v100", command=["torchrun", "--standalone", "t.py"])
    assert "--standalone" in e.message and "2 nodes" in e.message
    assert req(gpus=2, gpu_type="a6000", command=["torchrun", "--standalone", "t.py"]).torchrun.has(
        "standalone"
    )


@pytest.mark.parametrize(
    "flag",
    ["--rdzv-endpoint=localhost:29500", "--master_addr=10.0.0.1", "--node-rank=0", "--rdzv-backend=etcd"],
)
def test_rendezvous_flags_refused_on_several_nodes(flag):
    e = usage_error(gpus=8, gpu_type="v100", command=["torchrun", flag, "t.py"])
    assert "drop it" in e.hint


def test_a_static_or_c10d_rendezvous_of_the_users_own_is_kept_on_several_nodes():
    for backend in ("static", "c10d"):
        r = req(gpus=8, gpu_type="v100", command=["torchrun", f"--rdzv-backend={backend}", "t.py"])
        assert r.torchrun.value("rdzv-backend") == backend


def test_node_rank_on_one_node():
    req(gpus=2, gpu_type="a6000", command=["torchrun", "--node-rank=0", "t.py"])
    assert (
        "--node-rank=1"
        in usage_error(gpus=2, gpu_type="a6000", command=["torchrun", "--node_rank", "1", "t.py"]).message
    )


def test_torchrun_without_script():
    assert "no training script" in usage_error(gpu_type="a6000", command=["torchrun", "--standalone"]).message


# --- signal and outputs -------------------------------------------------------------------------


def test_signal_defaults_and_forms():
    r = req(gpu_type="a6000")
    assert (r.signal, r.signal_lead_seconds) == ("USR1", DEFAULT_SIGNAL_LEAD)
    assert (
        req(gpu_type="a6000", signal="SIGUSR2@120").signal,
        req(gpu_type="a6000", signal="usr2@120").signal_lead_seconds,
    ) == ("USR2", 120)
    short = req(gpu_type="a6000", time="4m")
    assert short.signal_lead_seconds == 120  # half of a short job


def test_signal_errors():
    assert "unknown signal" in usage_error(gpu_type="a6000", signal="KILL").message
    assert "at once" in usage_error(gpu_type="a6000", time="5m", signal="USR1@600").message
    assert "1 to 65535" in usage_error(gpu_type="a6000", signal="USR1@x").message


def test_outputs_normalised_and_confined():
    r = req(gpu_type="a6000", outputs=["runs/exp1/", "./model.pt", "model.pt"])
    assert r.outputs == ("runs/exp1", "model.pt")
    for bad in ["/etc/passwd", "../up", "a/../../b", ".", ""]:
        assert "-o" in usage_error(gpu_type="a6000", outputs=[bad]).message


def test_outputs_are_relative_to_the_folder_the_program_starts_in():
    r = req(gpu_type="a6000", outputs=["out.txt", "../shared/x", "."], start_dir="exp/a")
    assert r.outputs == ("exp/a/out.txt", "exp/shared/x", "exp/a")  # relative to the work dir
    message = usage_error(gpu_type="a6000", outputs=["../../../x"], start_dir="exp/a").message
    assert "(relative to exp/a/, where the program starts)" in message


def test_setup_lines_kept_in_order_blank_dropped():
    r = req(gpu_type="a6000", setup=["module load cuda", "  ", "source .venv/bin/activate"])
    assert r.setup == ("module load cuda", "source .venv/bin/activate")


# --- launchers: uv run, accelerate launch ---------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "launcher", "options", "program"),
    [
        (["uv", "run", "torchrun", "t.py"], ("uv", "run", "torchrun"), (), ("t.py",)),
        (
            [
                "uv",
                "run",
                "--frozen",
                "-p",
                "3.11",
                "--with=x",
                "torchrun",
                "--nproc_per_node",
                "2",
                "t.py",
                "-p",
            ],
            ("uv", "run", "--frozen", "-p", "3.11", "--with=x", "torchrun"),
            ("--nproc_per_node", "2"),
            ("t.py", "-p"),
        ),
        (["uv", "run", "--", "torchrun", "t.py"], ("uv", "run", "--", "torchrun"), (), ("t.py",)),
        (
            ["uv", "run", "-m", "torch.distributed.run", "t.py"],
            ("uv", "run", "-m", "torch.distributed.run"),
            (),
            ("t.py",),
        ),
        (
            [
                "accelerate",
                "launch",
                "--mixed_precision",
                "bf16",
                "--use-fsdp",
                "t.py",
                "--num_processes",
                "9",
            ],
            ("accelerate", "launch"),
            ("--mixed_precision", "bf16", "--use-fsdp"),
            ("t.py", "--num_processes", "9"),
        ),
        (
            ["/v/bin/accelerate-launch", "-m", "pkg.train"],
            ("/v/bin/accelerate-launch",),
            ("-m",),
            ("pkg.train",),
        ),
        (
            ["python3", "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "t.py"],
            ("python3", "-m", "accelerate.commands.launch"),
            ("--config_file", "c.yaml"),
            ("t.py",),
        ),
    ],
)
def test_parse_launcher_forms(command, launcher, options, program):
    la = parse_launcher(command)
    assert (la.launcher, la.options, la.program) == (launcher, options, program)
    assert la.kind == ("accelerate" if "accelerate" in " ".join(launcher) else "torchrun")


def test_not_launchers():
    for command in (["uv", "run", "python", "t.py"], ["accelerate", "config"], ["uv", "pip", "list"],
                    ["python", "-m", "accelerate.commands.config"], ["uv", "run", "-m", "pkg"]):  # fmt: skip
        assert parse_launcher(command) is None, command


def test_accelerate_value_options_and_flags():
    la = parse_launcher(
        ["accelerate", "launch", "--num-processes=4", "--same_network", "--machine_rank", "0", "t.py"]
    )
    assert la.given == (("num_processes", "4"), ("same_network", None), ("machine_rank", "0"))
    with pytest.raises(UsageError, match="accelerate launch option --num_machines needs a value"):
        parse_launcher(["accelerate", "launch", "--num_machines"])


@pytest.mark.parametrize(
    ("flags", "message", "hint"),
    [
        (
            "--num_processes 3",
            "--num_processes=3 does not match the 8 GPU(s) of this job",
            "--num_processes=8",
        ),
        ("--num_machines=1", "--num_machines=1 does not match the 2 node(s)", "--num_machines=2"),
        ("--machine_rank 1", "would give every node the same rank", "--machine_rank=$SLURM_NODEID"),
        ("--main_process_ip 10.0.0.1", "--main_process_ip on a 2-node job", "--main_process_ip=<first node>"),
        ("--main_process_port 1234", "--main_process_port on a 2-node job", "port from the job id"),
    ],
)
def test_accelerate_that_contradicts_the_allocation_is_refused(flags, message, hint):
    e = usage_error(gpus=8, gpu_type="v100", command=["accelerate", "launch", *flags.split(" "), "t.py"])
    assert message in e.message and hint in e.hint


def test_accelerate_that_agrees_is_kept_and_counts_ranks():
    r = req(
        gpus=8,
        gpu_type="v100",
        command=["accelerate", "launch", "--num_processes=8", "--num_machines", "2", "t.py"],
    )
    assert (r.launch.kind, r.ranks, r.labeled) == ("accelerate", 8, True)
    one = req(gpus=1, gpu_type="v100", command=["uv", "run", "accelerate", "launch", "t.py"])
    assert (one.ranks, one.labeled) == (1, False)
    assert (
        "needs two or more processes"
        in usage_error(
            gpus=1, gpu_type="v100", command=["accelerate", "launch", "--multi_gpu", "t.py"]
        ).message
    )
    assert "no training script" in usage_error(gpu_type="v100", command=["accelerate", "launch"]).message


def test_plain_command_on_several_nodes_or_gpus_needs_saying_so():
    e = usage_error(gpus=8, gpu_type="v100", command=["python", "train.py"])
    assert "`python train.py` on 2 nodes would run 2 separate copies" in e.message
    assert "--each-node" in e.hint and "torchrun" in e.hint
    e = usage_error(gpus=2, gpu_type="v100", command=["python", "train.py", "--lr", "1"])
    assert "`python train.py ...` is one process, but this job has 2 GPUs" in e.message
    assert "--allow-single-process" in e.hint
    assert "2 separate copies" in usage_error(gpus=0, nodes=2, command=["bash", "x.sh"]).message
    each = req(gpus=8, gpu_type="v100", command=["python", "train.py"], each_node=True)
    assert (each.ranks, each.labeled, each.each_node) == (2, True, True)
    single = req(gpus=2, gpu_type="v100", command=["python", "train.py"], allow_single_process=True)
    assert (single.ranks, single.labeled) == (1, False)
    assert req(gpus=1, gpu_type="v100", command=["python", "train.py"]).ranks == 1


def test_each_node_and_single_process_are_refused_with_a_launcher():
    e = usage_error(gpus=8, gpu_type="v100", command=["torchrun", "t.py"], each_node=True)
    assert "--each-node is for a command without a launcher: torchrun already starts" in e.message
    e = usage_error(
        gpus=2, gpu_type="v100", command=["accelerate", "launch", "t.py"], allow_single_process=True
    )
    assert "--allow-single-process is for a command without a launcher: accelerate launch" in e.message


def test_torchrun_ranks_follow_nproc():
    assert req(gpus=8, gpu_type="v100", command=["torchrun", "t.py"]).ranks == 8
    assert req(gpus=0, nodes=2, command=["torchrun", "--nproc-per-node=3", "t.py"]).ranks == 6
    auto = req(gpus=0, command=["torchrun", "--nproc-per-node=auto", "t.py"])
    assert (auto.ranks, auto.labeled) == (None, True)
    assert req(gpus=1, gpu_type="v100", command=["torchrun", "t.py"]).labeled is False


def test_run_path_warns_that_lines_are_not_labelled():
    r = req(gpus=2, gpu_type="v100", command=["torchrun", "--run-path", "t.py"])
    assert any("--run-path" in w and "cannot label" in w for w in r.warnings)


# --- --setup lines are checked with bash -n (issue 28, item 8) ------------------------------------


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("}", "syntax error near unexpected token `}'"),
        ("if true; then echo x", "syntax error"),
        ("echo 'unterminated", "unexpected EOF"),
        ("module load cuda }", None),  # a word, as bash reads it: valid
    ],
)
def test_a_setup_line_bash_cannot_parse_is_refused_before_anything_is_sent(line, said):
    setup = ("source ~/venv/bin/activate", line)
    if said is None:
        assert req(gpu_type="a6000", setup=setup).setup == setup
        return
    err = usage_error(gpu_type="a6000", setup=setup)
    assert err.message.startswith(f"setup line {line!r} is not valid bash: ") and said in err.message


def test_valid_bash_4_setup_lines_pass_the_check():
    setup = ("cmd |& tee log", 'x="${HOSTNAME,,}"', "cat <<EOF >f\nhi\nEOF", "for i in 1 2; do :; done")
    assert req(gpu_type="a6000", setup=setup).setup == setup


def test_without_bash_or_with_bash_3_the_check_is_skipped(tmp_path, monkeypatch):
    from rv.request import check_setup_syntax

    monkeypatch.setenv("PATH", str(tmp_path))  # no bash on this machine
    assert req(gpu_type="a6000", setup=("}",)).setup == ("}",)
    # macOS's /bin/bash 3.2 does not parse bash 4 syntax the cluster runs: its "no" is not final.
    bash3 = tmp_path / "bash3"
    bash3.write_text('#!/bin/sh\n[ "$1" = -c ] && { printf 3; exit 0; }\nexit 2\n')
    bash3.chmod(0o755)
    check_setup_syntax(["cmd |& tee log"], bash=str(bash3))


def test_a_lookup_by_a_name_no_run_can_have_says_so():
    from rv.names import lookup_hint

    hint = lookup_hint("lr 0.1")
    assert hint is not None and "no run can be named 'lr 0.1'" in hint
    assert lookup_hint("lr-0.1") is None and lookup_hint("") is None


# --- requests the cluster would never start, and proposals rv would accept (issue 28, item 6) -----

# The loopback cluster's shape: two nodes of 2 a6000 each, in a partition with a 3-day limit, and a
# default (CPU) partition of 2 nodes with a 3-day limit and at most 2 nodes per job.
TWO_NODES = {"a6000": GpuType("a6000", "gpu-a6000", "a6000", 2, nodes=2)}
PARTITIONS = {
    "gpu-a6000": Partition("gpu-a6000", max_time="3-00:00:00", nodes=2),
    "standard": Partition("standard", max_time="3-00:00:00", nodes=4, max_nodes=2, default=True),
}


def small(**kw):
    kw.setdefault("command", ["torchrun", "train.py"])
    return build_request(TWO_NODES, partitions=PARTITIONS, **kw)


def refused(**kw) -> RequestError:
    with pytest.raises(RequestError) as err:
        small(**kw)
    return err.value


@pytest.mark.parametrize("time", ["4d", "3-00:00:01", "99999999d"])
def test_a_cpu_only_job_over_its_partitions_time_limit_is_refused(time):
    with pytest.raises(UsageError) as caught:
        small(gpus=0, time=time, command=["python", "x.py"])
    err = caught.value
    if time == "99999999d":  # Slurm would wrap it to some 8,000 years without a word
        assert "more than Slurm can hold" in err.message
        assert (
            "more than Slurm can hold" in usage_error(gpus=0, time=time, command=["python", "x.py"]).message
        )
    else:
        assert "over the limit of partition standard (the default, where CPU-only jobs go), 3-00:00:00" in (
            err.message
        )
        assert err.hint == "use --time 3-00:00:00 or less"
    assert small(gpus=0, time="3d", command=["python", "x.py"]).time_seconds == 3 * 86400


def test_a_gpu_job_over_its_partitions_time_limit_is_refused():
    err = refused(gpus=1, time="5d")
    assert "partition gpu-a6000" in err.message and err.suggestions == ({"time": "3-00:00:00"},)


def test_more_nodes_than_the_partition_has_or_allows_is_refused():
    err = refused(gpus=0, nodes=3, command=["python", "x.py"], each_node=True)
    assert "--nodes 3: partition standard (the default, where CPU-only jobs go) allows 2 node(s) per job" in (
        err.message
    )
    assert err.hint == "use --nodes 2"


def test_the_uneven_split_hint_proposes_only_what_fits_the_cluster():
    # The case: -g 5 on two nodes of 2 proposed -g 6 and --nodes 5, both refused next.
    err = refused(gpus=5, gpu_type="a6000")
    assert err.hint == "use -g 4 (2 nodes of 2)"
    assert err.suggestions == ({"gpus": 4},)


FAILING = [
    dict(gpus=5),
    dict(gpus=3),
    dict(gpus=7, nodes=2),
    dict(gpus=3, nodes=2),
    dict(gpus=6, nodes=1),
    dict(gpus=4, nodes=3),
    dict(gpus=9),
    dict(gpus=1, time="4d"),
    dict(gpus=5, time="4d"),
    dict(gpus=0, time="4d", command=["python", "x.py"]),
    dict(gpus=0, nodes=3, command=["python", "x.py"], each_node=True),
    dict(gpus=0, nodes=9, command=["python", "x.py"], each_node=True),
    dict(gpus=3, command=["python", "x.py"]),
    dict(gpus=5, command=["python", "x.py"], allow_single_process=True),
]


@pytest.mark.parametrize("asked", FAILING, ids=lambda a: " ".join(f"{k}={v}" for k, v in a.items()))
def test_every_proposal_rv_makes_is_a_request_rv_accepts(asked):
    """Each refusal's proposals, run through the same validation, are accepted: none is refused next."""
    err = refused(**asked)
    assert err.hint, err.message  # a refusal with proposals to make says something to do
    for change in err.suggestions:
        accepted = small(**{**asked, **change})
        assert accepted.name, (asked, change)
    # The same figures the hint shows are the ones tried.
    for change in err.suggestions:
        for value in change.values():
            assert str(value) in err.hint


@pytest.mark.parametrize(
    ("gpu_type", "gpus", "nodes"),
    [("a6000", 9, None), ("a6000", 16, None), ("h200", 5, None), ("v100", 5, None), ("rtx3090", 3, None),
     ("a100", 12, None), ("a6000", 63, 5), ("a6000", 6, 4), ("v100", 6, 1), ("a40", 7, 2)],
)  # fmt: skip
def test_every_proposal_on_the_builtin_catalog_is_accepted_too(gpu_type, gpus, nodes):
    asked = {"command": ["torchrun", "x.py"], "gpu_type": gpu_type, "gpus": gpus, "nodes": nodes}
    with pytest.raises(RequestError) as err:
        build_request(RIVANNA, **asked)
    assert err.value.suggestions, err.value.message
    for change in err.value.suggestions:
        build_request(RIVANNA, **{**asked, **change})
