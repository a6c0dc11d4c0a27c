"""Job environments (issue 11), on the real loopback cluster with real uv and the package index.

Every test has its own remote root, so each starts on a cluster without uv: rv installs it once
into <root>/tools/uv. Only small pure-Python packages are installed; torch is never downloaded (the
--system-site-packages test proves that, with `torch` in the requirements).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from test_jobs import git

MAIN = """\
import sys
import six
import mypkg
print("ENV-OK", six.__version__, mypkg.VALUE, sys.prefix)
"""


def make_project(root: Path, requirements: str, *, src_layout: bool = True) -> Path:
    root.mkdir()
    (root / "requirements.txt").write_text(requirements)
    pkg = root / ("src/mypkg" if src_layout else "mypkg")
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    (root / "main.py").write_text(MAIN)
    commit(root)
    return root


def commit(repo: Path) -> None:
    if not (repo / ".git").exists():
        git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "change")


def envs(remote_root: str) -> list[str]:
    """Complete environments (and anything else) in <root>/envs, lock files left out."""
    folder = Path(remote_root) / "envs"
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) if folder.exists() else []


def program_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if line.startswith("ENV-OK")]


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_requirements_env_built_once_reused_rebuilt_on_change_and_collected(layout, tmp_path):
    proj = make_project(tmp_path / "proj", "six==1.16.0\n")
    run = layout.run_rv

    first = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert first.returncode == 0, first.stderr
    # uv was missing on the cluster: installed once, then the environment built with it.
    assert "installing it once" in first.stderr
    assert "building environment" in first.stderr and "+ six==1.16.0" not in first.stdout
    (line,) = program_lines(first)
    _, version, value, prefix = line.split()
    # six from the environment, mypkg (src layout) from the job's work dir, the env's own python.
    assert (version, value) == ("1.16.0", "42")
    (key,) = envs(layout.remote_root)
    assert prefix == f"{layout.remote_root}/envs/{key}"
    assert (Path(layout.remote_root) / "tools/uv/bin/uv").exists()

    again = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert again.returncode == 0, again.stderr
    assert "building" not in again.stderr and "Installed" not in again.stderr
    assert "installing it once" not in again.stderr  # uv, too, is reused
    assert program_lines(again)[0].split()[3] == prefix

    (proj / "requirements.txt").write_text("six==1.15.0\n")
    commit(proj)
    changed = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert changed.returncode == 0, changed.stderr
    assert "building environment" in changed.stderr
    assert program_lines(changed)[0].split()[1] == "1.15.0"
    assert len(envs(layout.remote_root)) == 2

    listed = run("venv", "ls", "--json", cwd=proj)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert {r["key"] for r in rows} == set(envs(layout.remote_root))
    assert all(r["meta"]["files"] == "requirements.txt" and r["bytes"] > 0 for r in rows)

    # A forced rebuild replaces the environment under the same key; `rv venv rm` removes one.
    forced = run("venv", "build", "--force", "--no-system-site-packages", cwd=proj)
    assert forced.returncode == 0, forced.stderr
    assert "building environment" in forced.stderr and len(envs(layout.remote_root)) == 2
    assert forced.stdout.strip() in {r["path"] for r in rows}

    # Every run ended: gc removes both environments once unused for --older-than.
    time.sleep(2)
    gc = run("gc", "--older-than", "1s", "--json", cwd=proj)
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert {e["key"] for e in report["envs_removed"]} == {r["key"] for r in rows}
    assert envs(layout.remote_root) == []


def test_two_runs_at_once_build_the_environment_once(run_rv, remote_root, rv_env, tmp_path):
    proj = make_project(tmp_path / "proj", "six==1.16.0\nidna==3.7\ncertifi\n")
    argv = ["python", "-m", "rv", "run", "-g", "0", "--no-system-site-packages", "--", "python", "main.py"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(argv, cwd=proj, env=rv_env, **pipes) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    built = [err for _, err in results if "\nbuilding environment" in "\n" + err]
    assert len(built) == 1, [err for _, err in results]
    # The other one waited for that build, or came after it: either way it reused the environment.
    (other,) = [err for _, err in results if err not in built]
    assert "waiting: " in other or "environment " in other
    assert len(envs(remote_root)) == 1
    # Both jobs run in that one environment.
    for out, _ in results:
        job = out.strip().splitlines()[-1]
        logs = run_rv("logs", "-f", job, cwd=proj)
        assert logs.returncode == 0, logs.stderr
        assert f"{remote_root}/envs/{envs(remote_root)[0]}" in logs.stdout


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_system_site_packages_uses_the_base_torch_and_downloads_none(layout, tmp_path):
    # torch is in the requirements, as users write it: the base interpreter's (the cluster pyenv's
    # CPU build) must satisfy it; a download would be the multi-GB CUDA build.
    proj = make_project(tmp_path / "proj", "six==1.16.0\ntorch\n")
    (proj / "main.py").write_text(
        "import sys, six, torch, mypkg\n"
        "print('ENV-OK', six.__version__, torch.__version__, torch.__file__, sys.prefix)\n"
    )
    commit(proj)
    # Under torchrun (the base's console script): its worker must run with the environment's python.
    r = layout.run_rv(
        "run", "-g", "1", "-t", "a6000", "--system-site-packages", "-f", "--",
        "torchrun", "--nproc-per-node=1", "main.py", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    (line,) = program_lines(r)
    _, six_version, torch_version, torch_file, prefix = line.split()
    assert six_version == "1.16.0" and torch_version.startswith("2.13.0")
    assert torch_file.startswith(layout.cluster["RV_TESTCLUSTER_PYENV"])  # the base's torch
    (key,) = envs(layout.remote_root)
    assert prefix == f"{layout.remote_root}/envs/{key}"
    env = Path(prefix)
    assert not list(env.glob("lib/python*/site-packages/torch")), "torch was installed into the env"
    # uv's cache holds six and index pages (uv reads torch's to resolve), no torch wheel: < 5 MB in all.
    cache = Path(layout.remote_root) / "cache/uv"
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 5e6
    assert not [p for p in files if p.suffix == ".whl" or "torch-" in p.name]


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_bad_input_fails_before_sbatch_and_leaves_nothing(layout, tmp_path):
    proj = make_project(tmp_path / "proj", "six==1.16.0\nrv-no-such-package-xyz==1.0\n")
    r = layout.run_rv("run", "-g", "0", "--", "python", "main.py", cwd=proj)
    assert r.returncode != 0
    assert "requirements.txt" in r.stderr and "rv-no-such-package-xyz" in r.stderr
    assert len(r.stderr.splitlines()) < 30  # uv's first and last lines, not all of them
    assert envs(layout.remote_root) == []  # nothing half-built: no env, no .build- folder
    runs = Path(layout.remote_root) / "runs"
    assert not runs.exists() or not list(runs.iterdir())  # nothing was queued
    ps = layout.run_rv("ps", "-a", "--json", cwd=proj)
    assert ps.returncode == 0 and not [row for row in json.loads(ps.stdout) if row["run_id"]]

    # A Python too old for the project's requires-python: says which interpreter and what to try.
    (proj / "requirements.txt").unlink()
    (proj / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "0"\nrequires-python = ">=3.99"\ndependencies = ["six"]\n'
    )
    commit(proj)
    old = layout.run_rv("run", "-g", "0", "--", "python", "main.py", cwd=proj)
    assert old.returncode != 0
    assert "needs Python >=3.99" in old.stderr and "--python" in old.stderr
    assert envs(layout.remote_root) == []

    # A flag naming a file the snapshot lacks fails before any connection.
    missing = layout.run_rv("run", "-g", "0", "--requirements", "nope.txt", "--", "python", "x.py", cwd=proj)
    assert missing.returncode == 2 and "nope.txt is not in the snapshot" in missing.stderr


def test_env_none_and_env_path(run_rv, cluster, tmp_path):
    proj = make_project(tmp_path / "proj", "six==1.16.0\n")
    show = ["python", "-c", "import os, sys; print('ENV-OK', sys.prefix, os.environ.get('RV_ENV', '-'))"]
    none = run_rv("run", "-g", "0", "--env", "none", "-f", "--", *show, cwd=proj)
    assert none.returncode == 0, none.stderr
    assert "environment" not in none.stderr
    assert program_lines(none)[0].split()[1:] == [cluster["RV_TESTCLUSTER_PYENV"], "-"]

    # An existing prefix on the cluster, used as is (here the cluster's pyenv itself).
    used = run_rv("run", "-g", "0", "--env", cluster["RV_TESTCLUSTER_PYENV"], "-f", "--", *show, cwd=proj)
    assert used.returncode == 0, used.stderr
    assert program_lines(used)[0].split()[2] == cluster["RV_TESTCLUSTER_PYENV"]

    bad = run_rv("run", "-g", "0", "--env", "/nonexistent/venv", "--", *show, cwd=proj)
    assert bad.returncode != 0 and "no bin/python there" in bad.stderr


def test_a_purged_environment_is_built_again_never_used_with_holes(layout, tmp_path):
    """A scratch purge deletes files and leaves folders: one module of the environment, then every
    file of it. Each time the next `rv run` finds the holes, builds it again, and the program runs."""
    proj = make_project(tmp_path / "proj", "six==1.16.0\n")
    run = layout.run_rv
    first = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert first.returncode == 0, first.stderr
    (key,) = envs(layout.remote_root)
    env = Path(layout.remote_root) / "envs" / key
    (six,) = env.glob("lib/python*/site-packages/six.py")
    six.unlink()
    one = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert one.returncode == 0, one.stderr
    assert f"environment {key} lost 1 file(s) (a purge of the filesystem?)" in one.stderr, one.stderr
    assert "site-packages/six.py" in one.stderr and "building environment" in one.stderr
    assert program_lines(one)[0].split()[1] == "1.16.0" and six.exists()

    for path in [p for p in env.rglob("*") if not p.is_dir() or p.is_symlink()]:
        path.unlink()
    assert env.is_dir() and not any(p for p in env.rglob("*") if not p.is_dir())
    every = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert every.returncode == 0, every.stderr
    assert "building environment" in every.stderr
    assert program_lines(every)[0].split()[1] == "1.16.0"
    # Whole again: the next run uses it as it is.
    whole = run("run", "-g", "0", "--no-system-site-packages", "-f", "--", "python", "main.py", cwd=proj)
    assert whole.returncode == 0 and "building" not in whole.stderr and "lost" not in whole.stderr
