"""Rough edges of `rv run` a user hit, through the real CLI and without a network: rv's own options
typed after the command, where `-o` paths start, pure JSON on stdout, the snapshot's warnings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CONFIG = """
[profiles.lab]
host = "nowhere.invalid"
user = "me"
remote_root = "/scratch/me/rv"

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


def git(*args: str, cwd: Path) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "protocol.file.allow=always", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    repo = tmp_path / "repo"
    (repo / "exp").mkdir(parents=True)
    (repo / "train.py").write_text("print('hi')\n")
    (repo / "exp" / "eval.py").write_text("print('eval')\n")
    git("init", "-q", cwd=repo)
    git("add", ".", cwd=repo)
    git("commit", "-qm", "first", cwd=repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    env.update(
        RV_CONFIG=str(tmp_path / "rv.toml"),
        HOME=str(tmp_path),
        NO_COLOR="1",
        RV_CONNECT_TIMEOUT="1",
        GIT_CONFIG_NOSYSTEM="1",
    )
    runtime = tempfile.mkdtemp(prefix="rv-ut-", dir="/tmp")  # sun_path is short: a short folder
    env["RV_RUNTIME_DIR"] = runtime
    yield repo, env
    shutil.rmtree(runtime, ignore_errors=True)


# --- rv's options typed after the command ---------------------------------------------------------


@pytest.mark.parametrize(
    ("words", "reported"),
    [
        (["--signal", "USR1@60"], "--signal USR1@60"),
        (["--allow-large"], "--allow-large"),
        (["--json"], "--json"),
        (["--max-segments", "3"], "--max-segments 3"),
    ],
)
def test_options_the_hand_copied_list_missed_are_caught(setup, words, reported):
    repo, env = setup
    r = rv("run", "--dry-run", "python", "train.py", *words, cwd=repo, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{reported} went to the program, not to rv" in r.stderr
    assert f"rv run {reported} -- python train.py" in r.stderr
    assert r.stdout == ""  # refused before anything was rendered


def test_a_programs_own_help_and_options_after_double_dash_pass(setup):
    repo, env = setup
    r = rv("run", "--dry-run", "python", "train.py", "--help", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    r = rv("run", "--dry-run", "--", "python", "train.py", "--json", "--signal", "USR1", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
