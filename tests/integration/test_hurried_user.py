"""Issue 28 against the real loopback clusters, as the non-root cluster user: secrets that belong to
a profile, run names taken as typed, requests refused before anything is sent, --setup syntax."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_remote_dir

from rv.config import load_config, save_config


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def project(tmp_path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "show.py").write_text(
        "import hashlib, os\n"
        "for name in ('ALPHA_ONLY', 'BARE_ONLY', 'SHARED', 'CLASH', 'PEM'):\n"
        "    v = os.environ.get(name)\n"
        "    print(name, 'MISSING' if v is None else hashlib.sha256(v.encode()).hexdigest()[:16])\n"
    )
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


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
