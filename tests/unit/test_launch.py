"""The program's line in the job (rv/slurm/launch.py), run by a real bash: what `accelerate launch`
receives. A stand-in `accelerate` prints its arguments; the integration test
(tests/integration/test_launchers.py) runs the real one on two nodes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rv.catalog import RIVANNA
from rv.request import build_request
from rv.slurm.launch import program_line

PRECISION = "bf16"


def accelerate_args(command: list[str], tmp_path: Path, *, env: dict[str, str] | None = None) -> list[str]:
    """The arguments `accelerate` gets when the task's shell runs rv's line for ``command``, on one of
    two nodes (as the job does: the line is expanded by bash in the program's folder)."""
    req = build_request(RIVANNA, command=command, gpus=4, gpu_type="a6000", nodes=2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "accelerate"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    job_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "RV_PRECISION": PRECISION,
        "SLURM_NODEID": "1",
        "RV_HEAD_ADDR": "node1",
        "MASTER_PORT": "15042",
        **(env or {}),
    }
    out = subprocess.run(
        ["bash", "-c", program_line(req)],
        cwd=tmp_path,
        env=job_env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def test_accelerate_gets_the_precision_of_the_allocated_gpu(tmp_path):
    # Without it accelerate exports ACCELERATE_MIXED_PRECISION=no to its workers: fp32 on every GPU.
    args = accelerate_args(["accelerate", "launch", "train.py", "--lr", "1"], tmp_path)
    assert args[0] == "launch" and args[-3:] == ["train.py", "--lr", "1"]
    assert f"--mixed_precision={PRECISION}" in args[: args.index("train.py")]


@pytest.mark.parametrize("given", [["--mixed_precision", "fp16"], ["--mixed-precision=no"]])
def test_the_users_own_precision_wins(tmp_path, given):
    args = accelerate_args(["accelerate", "launch", *given, "train.py"], tmp_path)
    assert not [a for a in args if a.startswith("--mixed_precision=")]
    assert given[-1] in args


@pytest.mark.parametrize(
    ("text", "sets"),
    [
        ("compute_environment: LOCAL_MACHINE\nmixed_precision: fp16\n", True),
        ('{"compute_environment": "LOCAL_MACHINE", "mixed_precision": "no"}\n', True),
        ("compute_environment: LOCAL_MACHINE\nfp16: true\n", True),  # the old spelling
        ("compute_environment: LOCAL_MACHINE\nnum_machines: 2\n", False),
        ("deepspeed_config:\n  mixed_precision: fp16\n", False),  # a nested key is not the launch's
    ],
)
def test_a_config_file_that_sets_the_precision_wins(tmp_path, text, sets):
    (tmp_path / "my config.yaml").write_text(text)
    args = accelerate_args(["accelerate", "launch", "--config_file", "my config.yaml", "train.py"], tmp_path)
    assert (f"--mixed_precision={PRECISION}" not in args) is sets


def test_accelerates_default_config_file_counts_unless_cpu(tmp_path):
    hf_home = tmp_path / "hf"
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text("mixed_precision: fp16\n")
    env = {"HF_HOME": str(hf_home)}
    assert f"--mixed_precision={PRECISION}" not in accelerate_args(
        ["accelerate", "launch", "t.py"], tmp_path, env=env
    )
    # accelerate reads no default config with --cpu
    cpu = accelerate_args(["accelerate", "launch", "--cpu", "t.py"], tmp_path, env=env)
    assert f"--mixed_precision={PRECISION}" in cpu
    # XDG_CACHE_HOME, then ~/.cache, when HF_HOME is not set
    xdg = tmp_path / "xdg"
    (xdg / "huggingface" / "accelerate").mkdir(parents=True)
    (xdg / "huggingface" / "accelerate" / "default_config.yaml").write_text("mixed_precision: 'no'\n")
    args = accelerate_args(["accelerate", "launch", "t.py"], tmp_path, env={"XDG_CACHE_HOME": str(xdg)})
    assert f"--mixed_precision={PRECISION}" not in args


def torchrun_line(command: list[str], nodes: int = 2) -> str:
    return program_line(
        build_request(RIVANNA, command=command, gpus=2 * nodes, gpu_type="a6000", nodes=nodes)
    )


def test_torchrun_gets_the_static_rendezvous_and_nothing_it_warns_about():
    # c10d with --node-rank drew "node_rank is only used for static rdzv_backend" on every node but the
    # first, and c10d's closing race "failed to shutdown the rendezvous" in about one job in four.
    assert torchrun_line(["torchrun", "t.py"]) == (
        'torchrun --nnodes=2 --node_rank="$SLURM_NODEID" --nproc_per_node=2 --master_addr="$RV_HEAD_ADDR" '
        '--master_port="$MASTER_PORT" t.py'
    )
    # The user's own c10d: its endpoint and id, and no --node-rank.
    assert torchrun_line(["torchrun", "--rdzv-backend=c10d", "t.py"]) == (
        'torchrun --nnodes=2 --nproc_per_node=2 --rdzv_endpoint="$RV_HEAD_ADDR:$MASTER_PORT" '
        '--rdzv_id="$SLURM_JOB_ID" --rdzv-backend=c10d t.py'
    )
    # One node, the user's own rendezvous: left alone.
    assert torchrun_line(["torchrun", "--standalone", "t.py"], nodes=1) == (
        "torchrun --nnodes=1 --nproc_per_node=2 --standalone t.py"
    )
