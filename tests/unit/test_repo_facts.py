"""rv.files.repo: the repository's facts a run records, read with GitPython from a real repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rv.files.repo import RepoFacts, facts_soon, read_facts


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    return repo


def commit(repo: Path) -> str:
    (repo / "f.txt").write_text("x\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "c")
    return git(repo, "rev-parse", "HEAD")


def test_a_branch_and_a_remote_without_its_credentials(repo):
    head = commit(repo)
    git(repo, "remote", "add", "origin", "https://user:ghp_token@github.com/lab/x.git")
    assert read_facts(repo, dirty=True) == RepoFacts(
        root=str(repo), head=head, branch="main", dirty=True, remote="https://github.com/lab/x.git"
    )


def test_an_ssh_remote_keeps_its_user_and_loses_its_password(repo):
    commit(repo)
    git(repo, "remote", "add", "origin", "ssh://me:pw@host/x.git")
    assert read_facts(repo, dirty=False).remote == "ssh://me@host/x.git"


def test_a_detached_head_has_no_branch_and_no_origin_no_remote(repo):
    head = commit(repo)
    git(repo, "checkout", "-q", "--detach")
    git(repo, "remote", "add", "upstream", "https://example.com/y.git")  # only origin is recorded
    facts = read_facts(repo, dirty=False)
    assert (facts.head, facts.branch, facts.remote) == (head, None, None)


def test_a_repository_without_a_commit(repo):
    facts = read_facts(repo, dirty=True)
    assert (facts.head, facts.branch) == (None, "main")
    assert facts.to_json() == {
        "root": str(repo),
        "head": None,
        "branch": "main",
        "dirty": True,
        "remote": None,
    }


def test_the_facts_come_from_a_thread_and_none_outside_a_repository(repo):
    head = commit(repo)
    assert facts_soon(repo, dirty=False).result().head == head
    assert facts_soon(None, dirty=False).result() is None


def test_the_cli_and_the_launch_pipeline_do_not_import_gitpython_until_a_run_is_sent():
    # The warm path (rv ps and the like) and a dry run never pay for GitPython's import.
    code = (
        "import sys, rv.cli.main, rv.cli.run, rv.cli.ps, rv.job.launch, rv.files.repo\n"
        "print('git' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
