"""Issue 12, items 5-7, on the real two-node cluster: every launcher makes one world across the
nodes, each rank's lines arrive whole and labelled, and a job gets CPUs and memory per GPU.

Each test runs on the bare layout (one mixed partition, no accounting, no `python` on the login PATH),
the one least like the default.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

BARE = pytest.mark.parametrize("layout", ["bare"], indirect=True)

WORLD = """\
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g} "
      f"node={os.environ['SLURM_NODEID']} launcher={os.environ.get('ACCELERATE_DYNAMO_BACKEND', 'torchrun')}")
dist.destroy_process_group()
"""

# Each rank prints LINES lines of WIDTH bytes and, every 1,000th, one of BIG bytes (longer than a
# pipe's 64 KiB), all with print(): the text and the newline are two writes, which is what made
# ranks sharing a log join lines mid-line.
LINES, WIDTH, BIG = 10_000, 1_000, 100_000
SPAM = f"""\
import os
rank = os.environ["RANK"]
for i in range({LINES}):
    width = {BIG} if i % 1000 == 999 else {WIDTH}
    print(f"rank={{rank}} i={{i}} " + rank * width)
"""


def expected_lines(rank: int) -> list[str]:
    return [f"rank={rank} i={i} " + str(rank) * (BIG if i % 1000 == 999 else WIDTH) for i in range(LINES)]


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def project(tmp_path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "world.py").write_text(WORLD)
    (repo / "spam.py").write_text(SPAM)
    (repo / "show.py").write_text(
        "import os\nprint('node', os.environ['SLURM_NODEID'], 'cuda', os.environ.get('CUDA_VISIBLE_DEVICES'),"
        " 'cpus', os.environ.get('SLURM_CPUS_PER_TASK'), 'mem', os.environ.get('SLURM_MEM_PER_NODE'))\n"
    )
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


@pytest.fixture(scope="session")
def uv_bin() -> str:
    """uv, installed for this session with pip from PyPI into a folder the cluster user can read:
    the cluster's Python environment has none."""
    folder = tempfile.mkdtemp(prefix="rv-it-uv-", dir="/tmp")
    os.chmod(folder, 0o755)
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", folder, "uv"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    assert os.access(f"{folder}/bin/uv", os.X_OK)
    yield f"{folder}/bin"
    shutil.rmtree(folder, ignore_errors=True)


def world_lines(output: str) -> list[tuple[str, str, str, str, str]]:
    """(label, rank, world, sum, node) of every rank's line."""
    return re.findall(r"^\[(\d+)\] rank=(\d) world=(\d) sum=(\d+) node=(\d) launcher=(\S+)$", output, re.M)


def assert_one_world_of_four(output: str, launcher: str) -> None:
    lines = world_lines(output)
    assert sorted(label for label, *_ in lines) == ["0", "1", "2", "3"], output
    for label, rank, world, total, _node, how in lines:
        assert (label, world, total, how) == (rank, "4", "10", launcher)
    assert {node for *_, node, _ in lines} == {"0", "1"}  # two ranks on each node


@BARE
def test_uv_run_torchrun_on_two_nodes_is_one_world_of_four(layout, project, uv_bin):
    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "2G", "--setup", f"export PATH={uv_bin}:$PATH", "-f",
        "--", "uv", "run", "--no-project", "torchrun", "world.py", cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_one_world_of_four(r.stdout, "torchrun")


@BARE
def test_torchrun_says_nothing_about_the_flags_rv_adds(layout, project):
    # Every flag rv adds to torchrun, in a real two-node job: torchrun must not warn about one
    # ("node_rank is only used for static rdzv_backend" on every node but the first, before). The
    # one warning it gives of itself, for OMP_NUM_THREADS when it starts several processes per node,
    # is kept out by setting it: any warning left would be about rv's flags.
    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "2G", "--setup", "export OMP_NUM_THREADS=1", "-f",
        "--", "torchrun", "world.py", cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert_one_world_of_four(r.stdout, "torchrun")
    job = re.search(r"^(\d+)$", r.stdout, re.M) or re.search(r"job (\d+)", r.stderr)
    assert job, r.stderr
    logs = sorted(Path(layout.remote_root).glob(f"runs/*/logs/{job.group(1)}*"))
    assert len(logs) >= 4, logs  # .out and .err of both nodes
    text = "".join(p.read_text(errors="replace") for p in logs) + r.stdout + r.stderr
    warnings = [
        line for line in text.splitlines() if re.match(r"(\[\d+\] )?W\d{4} ", line) or "warn" in line.lower()
    ]
    assert warnings == [], "\n".join(warnings)


@BARE
def test_torchruns_thread_banner_shows_once_for_two_nodes_and_every_rank_has_one_thread(layout, project):
    # Issue 33: the demo showed torchrun's OMP_NUM_THREADS banner once per node.
    (project / "threads.py").write_text("import os\nprint('threads', os.environ['OMP_NUM_THREADS'])\n")
    git(project, "add", "threads.py")
    git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "threads")
    r = layout.run_rv("run", "-g", "4", "-t", "a6000", "--mem", "2G", "-f", "--", "torchrun", "threads.py",
                      cwd=project)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    said = r.stdout + r.stderr
    assert said.count("Setting OMP_NUM_THREADS environment variable for each process") == 1, said
    assert sorted(re.findall(r"threads (\S+)", r.stdout)) == ["1"] * 4, r.stdout  # as torchrun sets it


@BARE
def test_accelerate_launch_on_two_nodes_is_one_world_of_four(layout, project):
    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "2G", "-f", "--", "accelerate", "launch", "world.py",
        cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # accelerate's own workers carry its settings in the environment (ACCELERATE_DYNAMO_BACKEND=NO)
    assert_one_world_of_four(r.stdout, "NO")


PRECISION = """\
import os
print(f"rank={os.environ['RANK']} accelerate={os.environ['ACCELERATE_MIXED_PRECISION']} "
      f"rv={os.environ['RV_PRECISION']}")
"""


@BARE
def test_accelerate_workers_get_the_precision_rv_picked_unless_the_config_sets_it(layout, project):
    # accelerate launch without --mixed_precision exported ACCELERATE_MIXED_PRECISION=no to its
    # workers, over the job's bf16: every accelerate job ran in fp32.
    (project / "precision.py").write_text(PRECISION)
    (project / "fp16.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: fp16\n"
    )
    git(project, "add", ".")
    git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "precision")
    runs = {
        "flag": [],
        "config": ["--config_file", "fp16.yaml"],  # the user's file says fp16: rv's flag would override it
    }
    for case, options in runs.items():
        r = layout.run_rv(
            "run", "-g", "4", "-t", "a6000", "--mem", "2G", "-f", "--", "accelerate", "launch", *options,
            "precision.py", cwd=project,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        lines = re.findall(r"^\[\d\] rank=(\d) accelerate=(\S+) rv=(\S+)$", r.stdout, re.M)
        assert sorted(rank for rank, _, _ in lines) == ["0", "1", "2", "3"], r.stdout
        picked = {rv for _, _, rv in lines}
        assert picked == {"bf16"}, lines  # a6000: compute capability 8.6
        expected = "bf16" if case == "flag" else "fp16"
        assert {seen for _, seen, _ in lines} == {expected}, (case, r.stdout)
        assert "`--mixed_precision` was set to a value of `'no'`" not in r.stderr + r.stdout


@BARE
def test_a_plain_command_on_two_nodes_is_refused_and_each_node_runs_one_copy_per_node(layout, project):
    remote_root = layout.remote_root
    before = sorted(os.listdir(remote_root))
    r = layout.run_rv("run", "-g", "4", "-t", "a6000", "--", "python3", "show.py", cwd=project)
    assert r.returncode == 2
    assert "`python3 show.py` on 2 nodes would run 2 separate copies" in r.stderr
    assert "torchrun" in r.stderr and "--each-node" in r.stderr
    assert sorted(os.listdir(remote_root)) == before  # refused before anything was sent
    contradicts = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--", "accelerate", "launch", "--num_processes", "3", "world.py",
        cwd=project,
    )  # fmt: skip
    assert contradicts.returncode == 2
    assert "--num_processes=3 does not match the 4 GPU(s)" in contradicts.stderr
    assert "rv sets --num_processes=4" in contradicts.stderr
    assert sorted(os.listdir(remote_root)) == before

    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "1G", "--each-node", "-f", "--", "python3", "show.py",
        cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    copies = re.findall(r"^\[(\d)\] node (\d) cuda (\S+)", r.stdout, re.M)
    assert sorted(copies) == [("0", "0", "0,1"), ("1", "1", "0,1")], r.stdout


@BARE
def test_one_process_on_two_gpus_needs_allow_single_process(layout, project):
    r = layout.run_rv("run", "-g", "2", "-t", "a6000", "--", "python3", "show.py", cwd=project)
    assert r.returncode == 2 and "is one process, but this job has 2 GPUs" in r.stderr
    assert "--allow-single-process" in r.stderr
    r = layout.run_rv(
        "run", "-g", "2", "-t", "a6000", "--allow-single-process", "-f", "--", "python3", "show.py",
        cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # One process, no label (nothing to tell apart), both GPUs, and the catalog's 2 CPUs and
    # 2000 MB per GPU (the bare nodes: 8 CPUs and 8000 MB over 4 GPUs, as `rv init` found).
    assert re.search(r"^node 0 cuda 0,1 cpus 4 mem 4000$", r.stdout, re.M), r.stdout
    assert "resources: 1 node(s) × 2 a6000; per node 4 CPUs (2 per GPU, from the catalog)" in r.stderr


@BARE
def test_cpus_and_memory_per_gpu_unless_the_options_say_otherwise(layout, project):
    dry = layout.run_rv("run", "--dry-run", "-g", "1", "-t", "v100", "--", "python3", "show.py", cwd=project)
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --cpus-per-task=2" in dry.stdout and "#SBATCH --mem=2000M" in dry.stdout
    assert (
        "resources: 1 node(s) × 1 v100; per node 2 CPUs (2 per GPU, from the catalog), "
        "2000M memory (2000M per GPU, from the catalog)"
    ) in dry.stderr
    r = layout.run_rv(
        "run", "-g", "1", "-t", "v100", "--cpus", "1", "--mem", "1G", "-f", "--", "python3", "show.py",
        cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^node 0 cuda \S+ cpus 1 mem 1024$", r.stdout, re.M), r.stdout


def wait_ended(run_rv, job_id: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = run_rv("ps", "-a", "--json")
        assert r.returncode == 0, r.stderr
        for job in json.loads(r.stdout):
            if job["job_id"] == job_id and job["state"] not in ("PENDING", "RUNNING", "COMPLETING"):
                return job
        time.sleep(3)
    raise AssertionError(f"job {job_id} did not end in {timeout} s")


@BARE
def test_four_ranks_of_long_lines_at_once_never_mix(layout, project):
    remote_root = layout.remote_root
    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "2G", "--name", "spam", "--", "torchrun", "spam.py",
        cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().splitlines()[0]
    job = wait_ended(layout.run_rv, job_id)
    assert job["exit_code"] == 0, job

    # Every line of the node logs, as the ranks' labellers wrote them: whole, labelled, in order.
    seen: dict[int, list[str]] = {rank: [] for rank in range(4)}
    logs = sorted(Path(remote_root).glob(f"runs/*/logs/{job_id}-node*.out"))
    assert [p.name for p in logs] == [f"{job_id}-node0.out", f"{job_id}-node1.out"]
    for path in logs:
        for line in path.read_text().splitlines():
            m = re.fullmatch(r"\[(\d)\] (rank=(\d) i=\d+ (\d+))", line)
            assert m and m.group(1) == m.group(3) and set(m.group(4)) == {m.group(1)}, line[:120]
            seen[int(m.group(1))].append(m.group(2))
    for rank in range(4):
        assert seen[rank] == expected_lines(rank), f"rank {rank}"

    # `rv logs --rank 2`: exactly what rank 2 printed, nothing else.
    two = layout.run_rv("logs", "spam", "--rank", "2", cwd=project)
    assert two.returncode == 0, two.stderr
    assert two.stdout == "".join(line + "\n" for line in expected_lines(2))
    followed = layout.run_rv("logs", "-f", "spam", "--rank", "2", cwd=project)  # the follower's path
    assert followed.returncode == 0, followed.stderr
    assert [line for line in followed.stdout.splitlines() if not line.startswith("── rv:")] == expected_lines(
        2
    )
    # --raw: the file as written, labels included.
    raw = layout.run_rv("logs", "spam", "--raw", "--node", "1", cwd=project)
    assert raw.returncode == 0, raw.stderr
    assert raw.stdout == logs[1].read_text()
    bad = layout.run_rv("logs", "spam", "--rank", "4", cwd=project)
    assert bad.returncode == 2 and "--rank 4: run spam has 4 ranks (0..3)" in bad.stderr
