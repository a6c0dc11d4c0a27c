"""Rough edges of `rv run` a user hit, through the real CLI and without a network: rv's own options
typed after the command, where `-o` paths start, pure JSON on stdout, the snapshot's warnings."""

from __future__ import annotations

import json
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


# --- -o paths start where the program starts ------------------------------------------------------


def test_output_paths_are_relative_to_the_folder_rv_run_is_typed_in(setup):
    repo, env = setup
    r = rv("run", "--dry-run", "-g", "0", "-o", "out.txt", "-o", "../shared/x", "--", "python", "eval.py",
           cwd=repo / "exp", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "\ncd exp\n" in r.stdout  # the program starts in exp/ ...
    assert "rv_outputs=(exp/out.txt shared/x)\n" in r.stdout  # ... and so does -o out.txt
    r = rv(
        "run", "--dry-run", "-g", "0", "-o", "../../x", "--", "python", "eval.py", cwd=repo / "exp", env=env
    )
    assert r.returncode == 2
    assert (
        "-o '../../x' must be a path inside the project (relative to exp/, where the program starts)"
        in r.stderr
    )


def test_output_help_says_where_paths_start(setup):
    repo, env = setup
    r = rv("run", "--help", cwd=repo, env=env)
    assert "relative to the folder you type rv run in" in " ".join(r.stdout.split())


# --- --json: nothing but JSON on stdout -----------------------------------------------------------


def test_dry_run_with_json_prints_one_json_document(setup):
    repo, env = setup
    r = rv("run", "--dry-run", "--json", "-g", "0", "--", "python", "train.py", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # the whole of stdout
    assert data["dry_run"] is True and data["files"] == 2
    assert data["script"].startswith("#!/bin/bash") and "train.py" in data["script"]
    assert "dry run: nothing was sent" in r.stderr


# --- the snapshot's warnings ----------------------------------------------------------------------


def test_rv_run_shows_the_snapshots_warnings_on_stderr(setup, tmp_path):
    repo, env = setup
    # A submodule that is not checked out, a file over the size limit, an uncommitted change.
    sub = tmp_path / "lib"
    sub.mkdir()
    (sub / "a.py").write_text("x = 1\n")
    git("init", "-q", cwd=sub)
    git("add", ".", cwd=sub)
    git("commit", "-qm", "lib", cwd=sub)
    git("submodule", "add", "-q", str(sub), "vendor/lib", cwd=repo)
    git("commit", "-qm", "submodule", cwd=repo)
    git("submodule", "deinit", "-q", "-f", "vendor/lib", cwd=repo)
    with open(repo / "weights.bin", "wb") as fh:  # sparse: over the 100 MB guard without the disk
        fh.truncate(101_000_000)
    (repo / "train.py").write_text("print('changed')\n")
    r = rv("run", "--dry-run", "--allow-large", "--", "python", "train.py", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert "warning: submodule vendor/lib is not checked out" in err
    assert "warning: sending 1 file(s) over the size limit (--allow-large): weights.bin (101.0 MB)" in err
    assert "warning: the snapshot holds uncommitted changes (untracked: weights.bin)" in err
    assert "recorded as master@" in err or "recorded as main@" in err
    assert "not checked out" not in r.stdout and "uncommitted" not in r.stdout  # stdout is the script
