"""The CLI without a network: import weight, dry runs, and errors before any connection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = """
[profiles.lab]
host = "nowhere.invalid"
user = "me"
remote_root = "/scratch/me/rv"
account = "lab"

[profiles.lab.gpus.a6000]
partition = "gpu-a6000"
gres = "a6000"
gpus_per_node = 2
compute_capability = 8.6
nodes = 2
"""


def rv(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RV_")}
    env.update(RV_CONFIG=str(tmp_path / "rv.toml"), HOME=str(tmp_path), NO_COLOR="1", RV_CONNECT_TIMEOUT="1")
    return repo, env


def test_importing_the_cli_pulls_neither_torch_nor_paramiko():
    code = (
        "import sys, rv.cli.main; print(sorted(m for m in ('torch', 'paramiko', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dry_run_prints_the_script_and_connects_to_nothing(setup):
    repo, env = setup
    r = rv("run", "--dry-run", "-g", "4", "-t", "a6000", "--", "torchrun", "train.py", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --gres=gpu:a6000:2" in r.stdout and "#SBATCH --nodes=2" in r.stdout
    assert "#SBATCH --account=lab" in r.stdout
    assert "dry run: nothing was sent" in r.stderr


def test_bad_type_lists_valid_ones_without_connecting(setup):
    repo, env = setup
    r = rv("run", "-t", "a100", "--", "python", "train.py", cwd=repo, env=env)
    assert r.returncode == 2
    assert "unknown GPU type 'a100'" in r.stderr and "a6000" in r.stderr
    assert "cannot connect" not in r.stderr


def test_unreachable_host_is_a_connection_error(setup):
    repo, env = setup
    r = rv("exec", "true", cwd=repo, env=env)
    assert r.returncode == 4
    assert r.stderr.startswith("rv: error: cannot connect to me@nowhere.invalid:22")
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback(setup):
    repo, env = setup
    r = rv("exec", "true", cwd=repo, env={**env, "RV_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr
