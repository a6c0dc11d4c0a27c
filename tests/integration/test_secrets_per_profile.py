"""Secrets that belong to a profile, on both loopback clusters side by side as the non-root cluster
user: a job gets its profile's secrets and the global ones (its profile's win), never another
profile's, and neither cluster holds the other's secret anywhere."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_remote_dir
from projects import SHOW_ENV, git_project

from rv.config import load_config, save_config


@pytest.fixture
def project(tmp_path) -> Path:
    return git_project(tmp_path / "proj", {"show.py": SHOW_ENV})


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def shown(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if line.split(" ", 1)[0].isupper())


def test_secrets_reach_only_their_profiles_jobs_and_global_ones_reach_all(
    run_rv, rv_env, remote_root, bare_cluster, bare_session_config, bare_remote_root, project
):
    # One machine, both clusters: the default layout's profile and the bare layout's beside it.
    config = load_config(Path(rv_env["RV_CONFIG"]))
    bare = load_config(bare_session_config).profile(bare_cluster["RV_TESTCLUSTER_PROFILE"])
    save_config(config.with_profile(replace(bare, remote_root=bare_remote_root), make_default=False))
    make_remote_dir(bare_remote_root, bare_cluster["RV_TESTCLUSTER_USER"])
    bare_name = bare.name

    pem = "-----BEGIN KEY-----\nAAAA\nBBBB\n-----END KEY-----"
    assert run_rv("env", "set", "ALPHA_ONLY=for-alpha").returncode == 0  # the default profile's
    assert run_rv("env", "set", "--profile", bare_name, "BARE_ONLY=for-bare").returncode == 0
    assert run_rv("env", "set", "--global", "SHARED=everywhere").returncode == 0
    assert run_rv("env", "set", "--global", "CLASH=global").returncode == 0
    assert run_rv("-p", bare_name, "env", "set", "CLASH=bare-wins").returncode == 0
    piped = run_rv("env", "set", "PEM", input=pem + "\n")  # piped: every line of it
    assert piped.returncode == 0 and "Warning" not in piped.stderr, piped.stderr

    cmd = ("run", "-g", "0", "--mem", "500M", "-f", "--", "python", "show.py")
    on_default = run_rv(*cmd, cwd=project)
    assert on_default.returncode == 0, on_default.stderr
    assert shown(on_default.stdout) == {
        "ALPHA_ONLY": sha("for-alpha"), "BARE_ONLY": "MISSING", "SHARED": sha("everywhere"),
        "CLASH": sha("global"), "PEM": sha(pem),
    }  # fmt: skip
    on_bare = run_rv("-p", bare_name, *cmd, cwd=project)
    assert on_bare.returncode == 0, on_bare.stderr
    assert shown(on_bare.stdout) == {
        "ALPHA_ONLY": "MISSING", "BARE_ONLY": sha("for-bare"), "SHARED": sha("everywhere"),
        "CLASH": sha("bare-wins"), "PEM": "MISSING",
    }  # fmt: skip
    # Neither cluster holds the other's secret anywhere: not in its files, not in its logs.
    for root, foreign in ((remote_root, "for-bare"), (bare_remote_root, "for-alpha")):
        for path in Path(root).rglob("*"):
            if path.is_file():
                assert foreign.encode() not in path.read_bytes(), path
