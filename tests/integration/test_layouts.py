"""Each loopback layout proves what it is: who runs the jobs, what the login node has, and, for bare,
no accounting, one mixed partition and other node names. A test here that fails says the cluster is
not what the rest of the suite believes it tests against."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_jobs import TRAIN, git


@pytest.fixture
def project(tmp_path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "train.py").write_text(TRAIN)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


def lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_cluster_user_runs_jobs_and_the_login_node_has_python3_only(layout, project):
    user = layout.cluster["RV_TESTCLUSTER_USER"]
    assert user != "root"
    # The login node as rv reaches it: its user, and python3 but no `python` until a venv gives one.
    login = layout.run_rv(
        "exec",
        "id -un; python3 -c 'import sys; print(sys.version_info[0])'; command -v python || echo no-python",
    )
    assert lines(login) == [user, "3", "no-python"]
    # A job runs as that user, in the profile's setup (the cluster-side venv: `python`, torch, rv).
    job = layout.run_rv(
        "run", "-g", "0", "--mem", "500M", "-f", "--", "bash", "-c",
        'whoami; python -c "import rv.contract, torch; print(torch.version.cuda)"; stat -c %U "$RV_JOB_DIR"',
        cwd=project,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    # The job's log: the program's lines between rv's own ("rv: job ..."), which the job script writes.
    assert [x for x in job.stdout.splitlines() if not x.startswith("rv: ")][-3:] == [user, "None", user]
    # What rv made in the remote root belongs to the user too.
    owners = {p.owner() for p in Path(layout.remote_root).iterdir()}
    assert owners == {user}, owners


def test_default_layout_has_accounting_and_a_partition_per_type(run_rv, cluster):
    user = cluster["RV_TESTCLUSTER_USER"]
    assert sorted(lines(run_rv("exec", "sinfo -h -o '%P|%D|%N|%G'"))) == [
        "gpu-a6000*|2|node[1-2]|gpu:a6000:2,gpu:v100:2",
        "gpu-v100|2|node[1-2]|gpu:a6000:2,gpu:v100:2",
    ]
    assoc = run_rv(
        "exec",
        f"sacctmgr -nP show assoc where user={user} format=account,user;"
        f" sacctmgr -nP show user {user} format=defaultaccount",
    )
    assert lines(assoc) == [f"rv|{user}", "rv"]
    assert run_rv("exec", "sacct -X -n -o jobid").returncode == 0


def test_bare_layout_no_accounting_one_mixed_partition_two_nodes(run_rv_bare, bare_cluster, project):
    sacct = run_rv_bare("exec", "sacct")
    assert sacct.returncode != 0
    assert "Slurm accounting storage is disabled" in sacct.stderr
    # One partition, the default, holding both nodes, each with both GPU types.
    assert lines(run_rv_bare("exec", "sinfo -h -o '%P|%D|%N|%G'")) == [
        "gpu*|2|gpu-[01-02]|gpu:a6000:2,gpu:v100:2"
    ]
    config = "\n".join(lines(run_rv_bare("exec", "scontrol show config")))
    assert re.search(r"^ClusterName\s*=\s*barecluster$", config, re.M)
    assert re.search(r"^MinJobAge\s*=\s*10 sec$", config, re.M)

    # Four a6000s span both nodes; the job picks the type by gres alone.
    r = run_rv_bare(
        "run", "-g", "4", "-t", "a6000", "--mem", "2G", "-f", "--", "torchrun", "train.py", cwd=project
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ranks = re.findall(r"rank=(\d) world=(\d) precision=bf16 sum=(\d+) node=(\d)", r.stdout)
    assert sorted(rank for rank, *_ in ranks) == ["0", "1", "2", "3"], r.stdout
    assert all(world == "4" and total == "10" for _, world, total, _ in ranks)
    assert {node for *_, node in ranks} == {"0", "1"}
    job = re.search(r"submitted run \S+: job (\d+)", r.stderr)
    assert job and int(job.group(1)) >= 4000000, r.stderr  # FirstJobId: ids apart from the default's
