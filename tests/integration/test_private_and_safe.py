"""Private by default and no surprise overwrites, with the real CLI against the real cluster."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

from conftest import base_env, run_cli


def git(cwd: Path, *args: str) -> None:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*cmd, *args], cwd=cwd, check=True, capture_output=True)


def make_repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "train.py").write_text("print('hi')\n")
    (path / "run.sh").write_text("#!/bin/sh\necho run\n")
    (path / "run.sh").chmod(0o755)
    (path / "lib").mkdir()
    (path / "lib" / "util.py").write_text("X = 1\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    git(path, "remote", "add", "origin", "https://me:ghp_TOKEN123@github.com/me/project.git")
    return path


def open_to_others(root: str) -> dict[str, str]:
    """Everything under root (root included) that anyone but its owner could read, write or enter."""
    leaks = {}
    for dirpath, dirnames, files in os.walk(root):
        for name in [".", *dirnames, *files]:
            p = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                leaks[os.path.relpath(p, root)] = oct(stat.S_IMODE(st.st_mode))
    return leaks


def test_snapshot_push_and_pull_leave_nothing_readable_by_others(run_rv, tmp_path, remote_root):
    os.chmod(remote_root, 0o755)  # as a test fixture (or an older rv) made it
    repo = make_repo(tmp_path / "repo")
    snap = run_rv("sync", "snapshot", "--json", cwd=repo)
    assert snap.returncode == 0, snap.stderr
    push = run_rv("sync", "push", str(repo), "workspaces/p/main", cwd=repo)
    assert push.returncode == 0, push.stderr
    pull = run_rv("sync", "pull", "workspaces/p/main", str(tmp_path / "back"), cwd=repo)
    assert pull.returncode == 0, pull.stderr
    assert open_to_others(remote_root) == {}
    ws = Path(remote_root) / "workspaces/p/main"
    assert stat.S_IMODE(os.stat(ws / "run.sh").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ws / "train.py").st_mode) == 0o600
    meta = Path(json.loads(snap.stdout)["meta_path"]).read_text()
    assert "ghp_TOKEN123" not in meta and "https://github.com/me/project.git" in meta
    assert "ghp_TOKEN123" not in snap.stdout + snap.stderr


def test_a_pull_never_overwrites_local_edits_unless_told(run_rv, tmp_path, remote_root):
    results = Path(remote_root) / "results"
    results.mkdir()
    for name in ("a.txt", "b.txt"):
        (results / name).write_text(f"cluster {name}\n")
    owner = os.stat(remote_root)
    for p in (results, *results.iterdir()):
        os.chown(p, owner.st_uid, owner.st_gid)  # as the cluster user wrote them
    local = tmp_path / "results"
    first = run_rv("sync", "pull", "results", str(local))
    assert first.returncode == 0, first.stderr
    (local / "a.txt").write_text("my analysis\n")
    for name in ("a.txt", "b.txt"):
        (results / name).write_text(f"cluster {name}, rerun\n")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in local.iterdir()}

    refused = run_rv("sync", "pull", "results", str(local))
    assert refused.returncode == 2
    assert "a.txt" in refused.stderr and "b.txt" not in refused.stderr.split("next:")[0].split(": ")[-1]
    assert "--force" in refused.stderr and "--keep-local" in refused.stderr
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in local.iterdir()} == before

    kept = run_rv("sync", "pull", "results", str(local), "--keep-local")
    assert kept.returncode == 0, kept.stderr
    assert (local / "a.txt").read_text() == "my analysis\n"
    assert (local / "b.txt").read_text() == "cluster b.txt, rerun\n"

    forced = run_rv("sync", "pull", "results", str(local), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (local / "a.txt").read_text() == "cluster a.txt, rerun\n"


def test_init_expands_a_home_relative_root_on_the_cluster_and_keeps_it_private(cluster, tmp_path):
    env = base_env(tmp_path, tmp_path / "rv.toml")
    user = cluster.get("RV_TESTCLUSTER_USER", "root")
    name = f"rv-home-test-{uuid.uuid4().hex[:8]}"
    args = [
        "init", "--profile", "home", "--host", "127.0.0.1", "--port", cluster["RV_TESTCLUSTER_SSH_PORT"],
        "--user", user, "--identity-file", cluster["RV_TESTCLUSTER_KEY"],
        "--known-hosts", cluster["RV_TESTCLUSTER_KNOWN_HOSTS"], "--remote-root", f"~/{name}", "--yes",
    ]  # fmt: skip
    r = run_cli(args, env)
    home = run_cli(["exec", 'printf %s "$HOME"'], env).stdout
    expanded = f"{home}/{name}"
    try:
        assert r.returncode == 0, r.stderr
        assert home.startswith("/")
        assert f"remote root  {expanded} (from ~/{name}); only you can read it" in r.stdout
        assert f'remote_root = "{expanded}"' in (tmp_path / "rv.toml").read_text()
        assert stat.S_IMODE(os.stat(expanded).st_mode) == 0o700
    finally:
        shutil.rmtree(expanded, ignore_errors=True)
