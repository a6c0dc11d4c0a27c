"""Private by default, on the real loopback cluster as the non-root cluster user: what rv, uv and
pip write under the remote root is readable by the user only (or the group, when shared), no file rv
writes holds a remote URL's credentials, and untracked files that look like secrets stay on this
machine unless named."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import base_env, run_cli

pytestmark = pytest.mark.integration


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True, capture_output=True
    )


def project(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", ".")
    git(path, "commit", "-q", "-m", "init")
    return path


# --- what uv writes under the remote root ------------------------------------------------------------


def loose_paths(root: Path, allowed: int) -> list[str]:
    """Paths under ``root`` with permission bits beyond ``allowed`` (symlinks have none of their own;
    the root itself is the test fixture's)."""
    found = []
    for path in root.rglob("*"):
        st = path.lstat()
        if not path.is_symlink() and st.st_mode & 0o777 & ~allowed:
            found.append(f"{oct(st.st_mode & 0o777)} {path.relative_to(root)}")
    return found


def share_with_group(rv_env: dict[str, str]) -> None:
    """The test's profile with ``share_with_group = true`` (``rv init --share-with-group``)."""
    from dataclasses import replace

    from rv.config import load_config, save_config

    cfg = load_config(Path(rv_env["RV_CONFIG"]))
    profile = replace(cfg.profile(cfg.default), share_with_group=True)
    save_config(replace(cfg.with_profile(profile, make_default=True), path=Path(rv_env["RV_CONFIG"])))


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
@pytest.mark.parametrize("allowed", [0o700, 0o750], ids=["private", "group"])
def test_everything_uv_writes_is_private_and_a_failed_build_leaves_no_lock(layout, tmp_path, allowed):
    root = Path(layout.remote_root)
    if allowed == 0o750:
        share_with_group(layout.rv_env)
    proj = project(tmp_path / "p", {"requirements.txt": "six==1.16.0\n", "main.py": "import six\n"})
    built = layout.run_rv("venv", "build", "--no-system-site-packages", cwd=proj)
    assert built.returncode == 0, built.stderr
    (key,) = [p.name for p in (root / "envs").iterdir() if not p.name.endswith(".lock")]
    # uv's own lock files were 0666 whatever the folder: created by uv, not by rv.
    loose = loose_paths(root, allowed)
    assert not loose, "\n".join(loose)
    for lock in (root / "cache" / "uv" / ".lock", root / "envs" / key / ".lock"):
        assert lock.exists(), lock
        assert lock.stat().st_mode & 0o777 == 0o666 & allowed, (lock, oct(lock.stat().st_mode))

    (proj / "requirements.txt").write_text("rv-no-such-package-anywhere==1.0\n")
    git(proj, "commit", "-qam", "a requirement nobody can meet")
    failed = layout.run_rv("venv", "build", "--no-system-site-packages", cwd=proj)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "rv-no-such-package-anywhere" in failed.stderr
    # The failed build's lock file is gone: the complete environment and its lock are all there is.
    left = sorted(p.name for p in (root / "envs").iterdir())
    assert left == [key, f"{key}.lock"], left
    loose = loose_paths(root, allowed)
    assert not loose, "\n".join(loose)


# --- no credential in a file rv writes ----------------------------------------------------------------

TOKEN = "ghp_rvTestToken0123456789"  # a made-up token the test looks for


def files_holding(folder: Path, needle: bytes) -> list[str]:
    """Every regular file under ``folder`` whose bytes hold ``needle``."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
            found.append(str(path))
    return found


@pytest.mark.parametrize(
    ("url", "recorded"),
    [
        (f"https://bob:{TOKEN}@git.example.invalid/lab/p.git", "https://git.example.invalid/lab/p.git"),
        (f"https://{TOKEN}@github.invalid/x.git", "https://github.invalid/x.git"),  # the user part alone
    ],
)
def test_no_file_rv_writes_holds_the_remote_urls_token(run_rv, rv_env, remote_root, tmp_path, url, recorded):
    proj = project(tmp_path / "p", {"job.py": "print('ran')\n"})
    git(proj, "remote", "add", "origin", url)
    # A first submit (a full listing), then an edit and a resubmit (the cached listing's path), and
    # a snapshot of the edited tree.
    for text in ("print('ran')\n", "print('ran')  # edited\n"):
        (proj / "job.py").write_text(text)
        r = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "job.py", cwd=proj)
        assert r.returncode == 0, r.stderr
        assert "ran" in r.stdout and TOKEN not in r.stdout + r.stderr
    snap = run_rv("sync", "snapshot", cwd=proj)
    assert snap.returncode == 0, snap.stderr
    home = Path(rv_env["HOME"])
    assert len(list(home.rglob("*"))) > 5, home  # rv wrote its config, state and cache there
    assert files_holding(home, TOKEN.encode()) == []
    assert files_holding(Path(rv_env["RV_RUNTIME_DIR"]), TOKEN.encode()) == []
    assert files_holding(Path(remote_root), TOKEN.encode()) == []
    # The URL itself is kept, without the token: the snapshot says where its code came from.
    metas = [json.loads(p.read_text()) for p in (Path(remote_root) / "snapshots").glob("*.json")]
    assert metas and {m.get("provenance", m).get("remote_url") for m in metas} == {recorded}, metas


# --- files that look like secrets ---------------------------------------------------------------------

SHOW = "import os\nprint('files:', sorted(f for f in os.listdir('.') if not f.startswith('.git')))\n"


def test_secret_looking_files_stay_on_this_machine_unless_named(run_rv, remote_root, tmp_path):
    proj = project(tmp_path / "p", {"show.py": SHOW})
    first = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "show.py", cwd=proj)
    assert first.returncode == 0, first.stderr
    # Between two submits: an untracked .env and a key appear. The resubmit lists from the cache.
    (proj / ".env").write_text("WANDB_API_KEY=rv-test-secret-value\n")
    (proj / "deploy.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    (proj / "notes.txt").write_text("sent\n")
    second = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "show.py", cwd=proj)
    assert second.returncode == 0, second.stderr
    assert "files: ['notes.txt', 'show.py']" in second.stdout
    assert "left out 2 untracked file(s) that look like secrets: .env, deploy.pem" in second.stderr
    assert "add the line `!.env` to the top .rvignore" in second.stderr
    assert files_holding(Path(remote_root), b"rv-test-secret-value") == []
    # Named in .rvignore: sent (and said no more).
    (proj / ".rvignore").write_text("!.env\n")
    third = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "show.py", cwd=proj)
    assert third.returncode == 0, third.stderr
    assert "files: ['.env', '.rvignore', 'notes.txt', 'show.py']" in third.stdout
    assert "look like secrets: deploy.pem" in third.stderr


# --- snapshots, pushes, pulls and the remote root -----------------------------------------------------


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
