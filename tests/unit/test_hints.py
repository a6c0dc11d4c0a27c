"""Error messages name only options the command has (issue 28, item 9).

Each common error a user meets before rv connects is made with the real CLI, and every option its
message and hint name is looked up in the click command that printed it (or in the one command the
hint names by name, e.g. "rv run --env none" from `rv venv build`). Following the size guard's
advice then works.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from rv.cli.main import COMMANDS, cli

CONFIG = """
default = "lab"

[profiles.lab]
host = "nowhere.invalid"
remote_root = "/scratch/me/rv"

[profiles.lab.gpus.a6000]
partition = "gpu-a6000"
gres = "a6000"
gpus_per_node = 2
nodes = 2
"""

# An option word: `--name` or `-g`, not part of a longer word (non-UTF-8, a6000-x).
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")


def command_options(path: str) -> set[str]:
    """Every option word of `rv PATH` (e.g. "sync push"), "" for the `rv` group itself."""
    words = path.split()
    command: click.Command = cli
    if words:
        found = COMMANDS[words[0]]
        command = getattr(importlib.import_module(found.module), found.attr)
        for word in words[1:]:
            assert isinstance(command, click.Group)
            command = command.commands[word]
    return {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}


def assert_options_exist(r: subprocess.CompletedProcess, path: str, **elsewhere: str) -> set[str]:
    """Every option the error names is one of `rv PATH`'s, or of the command ``elsewhere`` says."""
    said = "\n".join(line for line in r.stderr.splitlines() if line.startswith(("rv: error:", "  next:")))
    assert said, r.stderr
    named = set(_OPTION.findall(said))
    own = command_options(path)
    for option in named:
        other = elsewhere.get(option.lstrip("-").replace("-", "_"))
        if other is not None:
            assert " ".join(["rv", *other.split(), option]) in said, said  # the hint says whose it is
            assert option in command_options(other), f"{option} is not an option of `rv {other}`"
        else:
            assert option in own, f"`rv {path}` has no {option}, but its error names it:\n{said}"
    return named


@pytest.fixture
def env(tmp_path):
    (tmp_path / "rv.toml").write_text(CONFIG)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "XDG_"))}
    e.update(
        RV_CONFIG=str(tmp_path / "rv.toml"), RV_STATE_DIR=str(tmp_path / "state"),
        RV_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path), NO_COLOR="1", RV_CONNECT_TIMEOUT="1",
    )  # fmt: skip
    return e


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def rv(env, cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", ["run", "up"])
def test_the_size_guard_names_options_the_command_has_and_its_advice_works(env, repo, command):
    with open(repo / "weights.bin", "wb") as f:
        f.truncate(150 * 1000 * 1000)  # sparse: 150 MB on paper, nothing on disk
    args = (
        ["up", "--detach", "-g", "0"] if command == "up" else ["run", "-g", "0", "--", "python", "train.py"]
    )
    r = rv(env, repo, *args)
    assert r.returncode == 2 and "over the 100.0 MB limit" in r.stderr, r.stderr
    assert {"--allow-large", "--max-file-size"} <= assert_options_exist(r, command)
    if command == "run":  # the advice, followed: the limit raised, the file goes
        ok = rv(
            env, repo, "run", "--max-file-size", "200MB", "--dry-run", "-g", "0", "--", "python", "train.py"
        )
        assert ok.returncode == 0, ok.stderr


def test_common_errors_of_each_command_name_only_its_options(env, repo, tmp_path):
    cases: list[tuple[list[str], str, dict[str, str]]] = [
        (["run", "-g", "3", "-t", "a6000", "--", "torchrun", "train.py"], "run", {}),
        (["run", "--time", "5", "--", "python", "train.py"], "run", {}),
        (["run", "--mem", "0G", "--", "python", "train.py"], "run", {}),
        (["run", "-g", "2", "-t", "a6000", "--", "python", "train.py"], "run", {}),
        (["run", "-g", "4", "-t", "a6000", "--", "python", "train.py"], "run", {}),
        (["run", "--name", "lr 0.1", "-g", "0", "--", "python", "train.py"], "run", {}),
        (["run", "--setup", "}", "-g", "0", "--", "python", "train.py"], "run", {}),
        (["run", "-g", "0", "-t", "a6000", "--", "python", "train.py"], "run", {}),
        (["up", "--detach", "-g", "3", "-t", "a6000"], "up", {}),
        (["stop"], "stop", {}),
        (["sync", "pull", "--force", "--keep-local", "a", "b"], "sync pull", {}),
        (["init", "--yes"], "init", {}),
        (["env", "set", "--global", "--profile", "lab", "K=v"], "env set", {}),
        (["env", "set", "PATH=/x"], "env set", {"setup": "run"}),
    ]
    for args, path, elsewhere in cases:
        r = rv(env, repo, *args)
        assert r.returncode != 0, (args, r.stderr)
        assert_options_exist(r, path, **elsewhere)
    # Without a default among several profiles, the profile is chosen with rv's own --profile.
    two = tmp_path / "two.toml"
    two.write_text(CONFIG.replace('default = "lab"', "") + '\n[profiles.other]\nhost = "x.invalid"\n')
    r = rv({**env, "RV_CONFIG": str(two)}, repo, "run", "-g", "0", "--", "python", "train.py")
    assert r.returncode == 3 and "rv --profile NAME" in r.stderr
    assert_options_exist(r, "run", profile="")
    # `rv venv build` builds an environment: the way out of a broken pyproject is rv run's --env none.
    (repo / "pyproject.toml").write_text("[project\n")
    r = rv(env, repo, "venv", "build")
    assert r.returncode == 2 and "not valid TOML" in r.stderr
    assert_options_exist(r, "venv build", env="run")
