"""What a run records of the repository it was sent from (issue 34): its top folder, HEAD, branch,
whether it was dirty, and its remote without credentials; in the run's record (`rv run --json`), in
run.json on the cluster, and in `rv ps --json`, for a run and for each point of a sweep."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "facts"
    repo.mkdir()
    (repo / "main.py").write_text("print('facts')\n")
    git(repo, "init", "-q", "-b", "trunk")
    # A token in the remote URL must reach no record: the recorded remote is the URL without it.
    git(repo, "remote", "add", "origin", "https://someone:tok3n-secret@example.com/lab/facts.git")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


def rows_of(layout, run_ids: set[str]) -> list[dict]:
    r = layout.run_rv("ps", "-a", "--json")
    assert r.returncode == 0, r.stderr
    return [row for row in json.loads(r.stdout) if row["run_id"] in run_ids]


def test_a_run_records_the_repositorys_facts(layout, repo):
    (repo / "main.py").write_text("print('facts, edited')\n")  # dirty: an edit not committed
    head = git(repo, "rev-parse", "HEAD")
    r = layout.run_rv(
        "run",
        "-g",
        "0",
        "--mem",
        "200M",
        "--env",
        "none",
        "--json",
        "-f",
        "--",
        "python3",
        "main.py",
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    facts = {
        "root": str(repo),
        "head": head,
        "branch": "trunk",
        "dirty": True,
        "remote": "https://example.com/lab/facts.git",
    }
    assert record["git"] == facts
    assert record["commit"] == head and record["dirty"] is True  # the snapshot's own, as before
    # On the cluster, and so in `rv ps --json` from anywhere.
    run_json = Path(layout.remote_root) / "runs" / record["run_id"] / "run.json"
    assert json.loads(run_json.read_text())["git"] == facts
    [row] = rows_of(layout, {record["run_id"]})
    assert row["git"] == facts
    # No copy of the token anywhere rv wrote.
    local = list(Path(layout.rv_env["HOME"]).rglob("runs.json"))
    assert local and all("tok3n" not in p.read_text() for p in local)
    assert "tok3n" not in run_json.read_text()


def test_each_point_of_a_sweep_records_them_on_a_detached_head(layout, repo):
    git(repo, "checkout", "-q", "--detach")
    head = git(repo, "rev-parse", "HEAD")
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--env", "none", "--json", "--sweep", "x=1,2", "--",
        "python3", "main.py", cwd=repo,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    points = json.loads(r.stdout)["points"]
    rows = rows_of(layout, {p["run_id"] for p in points})
    assert len(rows) == 2
    for row in rows:
        assert row["git"] == {
            "root": str(repo),
            "head": head,
            "branch": None,
            "dirty": False,
            "remote": "https://example.com/lab/facts.git",
        }
