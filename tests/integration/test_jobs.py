"""Issue 4 against the real two-node cluster: run, logs, ps, stop, precision, secrets, bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

TRAIN = """\
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
# One write per line: print() writes the text and the newline separately, and two ranks sharing a
# log file can then interleave mid-line.
rank, world, precision = dist.get_rank(), dist.get_world_size(), os.environ.get("RV_PRECISION")
sys.stdout.write(f"rank={rank} world={world} precision={precision} "
                 f"sum={t.item():g} node={os.environ.get('SLURM_NODEID')}\\n")
sys.stdout.flush()
sys.stderr.write(f"to-stderr rank={dist.get_rank()}\\n")
dist.destroy_process_group()
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def project(tmp_path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "train.py").write_text(TRAIN)
    (repo / "data.txt").write_text("original\n")
    (repo / "fail.py").write_text("import sys\nprint('failing now', file=sys.stderr)\nsys.exit(3)\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


def job_id_of(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[0]


def submitted_job(result: subprocess.CompletedProcess) -> str:
    found = re.search(r"submitted run \S+: job (\d+)", result.stderr)
    assert found, result.stderr
    return found.group(1)


def wait_done(run_rv, job_id: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = run_rv("ps", "-a", "--json")
        assert r.returncode == 0, r.stderr
        for job in json.loads(r.stdout):
            live = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")
            if job["job_id"] == job_id and job["state"] not in live:
                return job
        time.sleep(2)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def test_two_gpu_torchrun_bf16_and_stderr(run_rv, project):
    r = run_rv(
        "run", "-g", "2", "-t", "a6000", "--mem", "2G", "-f", "--", "torchrun", "train.py", cwd=project
    )
    assert r.returncode == 0, r.stderr
    assert sorted(re.findall(r"rank=\d world=\d precision=\w+ sum=\d+", r.stdout)) == [
        "rank=0 world=2 precision=bf16 sum=3",
        "rank=1 world=2 precision=bf16 sum=3",
    ]
    err = run_rv("logs", "--err", cwd=project)
    assert err.returncode == 0, err.stderr
    assert "to-stderr rank=0" in err.stdout and "to-stderr rank=1" in err.stdout
    out = run_rv("logs", cwd=project)
    assert "rank=0 world=2" in out.stdout and "to-stderr" not in out.stdout


def test_v100_gets_fp16(run_rv, project):
    r = run_rv("run", "-g", "1", "-t", "v100", "--mem", "1G", "-f", "--", "torchrun", "train.py", cwd=project)
    assert r.returncode == 0, r.stderr
    assert "rank=0 world=1 precision=fp16 sum=1" in r.stdout


def test_four_gpus_span_both_nodes(run_rv, project, remote_root):
    r = run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "2G", "-f", "--", "torchrun", "train.py", cwd=project
    )
    assert r.returncode == 0, r.stderr
    ranks = re.findall(r"rank=(\d) world=(\d) precision=bf16 sum=(\d+) node=(\d)", r.stdout)
    assert sorted(rk for rk, *_ in ranks) == ["0", "1", "2", "3"]
    assert all(world == "4" and total == "10" for _, world, total, _ in ranks)
    assert {node for *_, node in ranks} == {"0", "1"}
    job = submitted_job(r)
    logs = sorted(p.name for p in Path(remote_root).glob("runs/*/logs/*"))
    assert f"{job}-node0.out" in logs and f"{job}-node1.out" in logs
    node1 = run_rv("logs", job, "--node", "1", cwd=project)
    assert node1.returncode == 0
    nodes = re.findall(r"rank=\d world=4 precision=bf16 sum=10 node=(\d)", node1.stdout)
    assert nodes and set(nodes) == {"1"}


def test_exit_codes_ps_and_stop(run_rv, project):
    failed = run_rv("run", "-g", "0", "--mem", "500M", "-f", "--", "python", "fail.py", cwd=project)
    assert failed.returncode == 3, failed.stderr
    assert "failing now" in failed.stderr
    ok_id = job_id_of(run_rv("run", "-g", "0", "--mem", "500M", "--name", "fine", "--", "true", cwd=project))
    sleeper = job_id_of(run_rv("run", "-g", "0", "--mem", "500M", "--", "sleep", "300", cwd=project))
    stop = run_rv("stop", sleeper)
    assert stop.returncode == 0, stop.stderr
    assert wait_done(run_rv, sleeper)["state"] == "CANCELLED"
    done = wait_done(run_rv, ok_id)
    assert (done["state"], done["exit_code"], done["name"]) == ("COMPLETED", 0, "fine")
    jobs = {j["job_id"]: j for j in json.loads(run_rv("ps", "-a", "--json").stdout)}
    failed_id = submitted_job(failed)
    assert (jobs[failed_id]["state"], jobs[failed_id]["exit_code"]) == ("FAILED", 3)
    assert jobs[ok_id]["source"].startswith("main@")
    table = run_rv("ps", "-a")
    assert "FAILED" in table.stdout and "COMPLETED" in table.stdout and "main@" in table.stdout


def test_edit_after_submit_does_not_reach_the_job(run_rv, project):
    job = job_id_of(
        run_rv("run", "-g", "0", "--mem", "500M", "--", "bash", "-c", "sleep 4; cat data.txt", cwd=project)
    )
    (project / "data.txt").write_text("edited after submit\n")
    wait_done(run_rv, job)
    out = run_rv("logs", job, cwd=project)
    assert "original" in out.stdout and "edited" not in out.stdout


def test_secret_reaches_job_but_not_script_or_logs(run_rv, project, remote_root):
    secret = "s3cr3t-$HOME-`x`-'q'"
    assert run_rv("env", "set", f"MY_TEST_SECRET={secret}").returncode == 0
    listing = run_rv("env", "list")
    assert secret not in listing.stdout and "MY_TEST_SECRET=" in listing.stdout
    code = "import os,hashlib;print('sha', hashlib.sha256(os.environ['MY_TEST_SECRET'].encode()).hexdigest())"
    r = run_rv("run", "-g", "0", "--mem", "500M", "-f", "--", "python", "-c", code, cwd=project)
    assert r.returncode == 0, r.stderr
    import hashlib

    assert f"sha {hashlib.sha256(secret.encode()).hexdigest()}" in r.stdout
    root = Path(remote_root)
    for path in root.rglob("*"):
        if path.is_file() and "objects" not in path.parts and "snapshots" not in path.parts:
            assert secret.encode() not in path.read_bytes(), path
    assert not list(root.glob("runs/*/secrets.env"))  # deleted when the run ended


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-t", "h100", "--", "true"], "unknown GPU type 'h100'"),
        (["-g", "6", "-t", "a6000", "--", "true"], "-g 6"),
        (["-g", "3", "-t", "a6000", "--", "true"], "-g 3"),
        (["-g", "0", "--time", "3x", "--", "true"], "--time"),
        (["python", "train.py", "-g", "4"], "-g 4"),
    ],
)
def test_bad_input_fails_fast_and_touches_nothing(run_rv, project, remote_root, args, message):
    before = sorted(os.listdir(remote_root))
    r = run_rv("run", *args, cwd=project)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert sorted(os.listdir(remote_root)) == before


def test_no_such_profile(run_rv, project):
    r = run_rv("run", "--", "true", cwd=project, env_extra={"RV_PROFILE": "nope"})
    assert r.returncode == 3
    assert "unknown profile 'nope'; valid profiles: testcluster" in r.stderr
