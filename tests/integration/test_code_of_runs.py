"""Issue 35 on the real clusters: `rv diff` and `rv checkout`, the code runs ran, from the git store.

From this machine's repository of snapshots when it knows the runs, else from the cluster's store
(another machine: a fresh state and cache folder). Both layouts, as the cluster user.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from projects import git_project

FILES = {
    "a.py": "print('one')\n",
    "run.sh": "#!/bin/sh\necho hi\n",
    "-dash name.txt": "odd\n",
    "keep.txt": "k\n",
}


def tree_of(folder: Path) -> dict[str, tuple[str, str]]:
    """Every file under ``folder`` but git's own: (kind and exec bit, content or link target)."""
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            p = Path(dirpath, name)
            rel = str(p.relative_to(folder))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            else:
                mode = "exec" if os.stat(p).st_mode & stat.S_IXUSR else "file"
                out[rel] = (mode, p.read_text())
    return out


def test_rv_diff_and_rv_checkout_show_and_write_what_each_run_ran(layout, tmp_path):
    proj = git_project(tmp_path / "p", FILES)
    os.chmod(proj / "run.sh", 0o755)
    os.symlink("a.py", proj / "link")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "add", "-A"], cwd=proj, check=True)
    subprocess.run([*git, "commit", "-qm", "exec and link"], cwd=proj, check=True)
    first = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "one", "-f", "--", "python3", "a.py", cwd=proj
    )
    assert first.returncode == 0, first.stderr[-2000:]
    expected_one = tree_of(proj)
    (proj / "a.py").write_text("print('two')\n")  # uncommitted edits: the run has them, HEAD not
    (proj / "new.txt").write_text("new\n")
    second = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "two", "-f", "--", "python3", "a.py", cwd=proj
    )
    assert second.returncode == 0 and "two" in second.stdout, second.stderr[-2000:]

    # From this machine: no call to the cluster needed.
    here = layout.run_rv("diff", "one", "two", cwd=proj)
    assert here.returncode == 0, here.stderr
    assert "-print('one')\n+print('two')\n" in here.stdout
    assert "diff --git a/new.txt b/new.txt\nnew file mode 100644" in here.stdout
    assert "from this machine's repository of snapshots" in here.stderr
    # Another machine (no records, no repository of snapshots): the cluster's store, the same bytes.
    elsewhere = {"RV_STATE_DIR": str(tmp_path / "state2"), "RV_CACHE_DIR": str(tmp_path / "cache2")}
    there = layout.run_rv("diff", "one", "two", cwd=tmp_path, env_extra=elsewhere)
    assert there.returncode == 0, there.stderr
    assert there.stdout == here.stdout and "from the cluster's store" in there.stderr
    same = layout.run_rv("diff", "one", "one", cwd=proj)
    assert same.returncode == 0 and same.stdout == "" and "the same files" in same.stderr

    # The exact files, exec bits and links: from here, and from the cluster's store.
    made = layout.run_rv("checkout", "one", str(tmp_path / "one-here"), cwd=proj)
    assert made.returncode == 0, made.stderr
    ran = expected_one
    assert tree_of(tmp_path / "one-here") == ran
    remote = layout.run_rv("checkout", "one", str(tmp_path / "one-there"), cwd=tmp_path, env_extra=elsewhere)
    assert remote.returncode == 0, remote.stderr
    assert tree_of(tmp_path / "one-there") == ran
    refused = layout.run_rv("checkout", "one", str(tmp_path / "one-here"), cwd=proj)
    assert refused.returncode == 2 and "exists and is not an empty folder" in refused.stderr

    # --branch: never over uncommitted changes (a.py is edited), then on a clean tree a new branch.
    nobody = layout.run_rv("checkout", "two", "--branch", "ran-two", cwd=proj)
    assert nobody.returncode == 2 and "git does not know who you are" in nobody.stderr, nobody.stderr
    subprocess.run(["git", "config", "user.email", "me@example.org"], cwd=proj, check=True)
    subprocess.run(["git", "config", "user.name", "Me"], cwd=proj, check=True)
    dirty = layout.run_rv("checkout", "two", "--branch", "ran-two", cwd=proj)
    assert dirty.returncode == 2 and "uncommitted changes" in dirty.stderr, dirty.stderr
    assert "ran-two" not in subprocess.run(["git", "branch"], cwd=proj, capture_output=True, text=True).stdout
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=proj, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(["git", "checkout", "-q", "--", "a.py"], cwd=proj, check=True)
    os.remove(proj / "new.txt")
    branch = layout.run_rv("checkout", "two", "--branch", "ran-two", cwd=proj)
    assert branch.returncode == 0, branch.stderr
    now = subprocess.run(["git", "branch", "--show-current"], cwd=proj, capture_output=True, text=True).stdout
    assert now.strip() == "ran-two"
    assert (proj / "a.py").read_text() == "print('two')\n" and (proj / "new.txt").read_text() == "new\n"
    parent = subprocess.run(["git", "rev-parse", "HEAD^"], cwd=proj, capture_output=True, text=True).stdout
    assert parent.strip() == head  # the commit the run was made from
    again = layout.run_rv("checkout", "two", "--branch", "ran-two", cwd=proj)
    assert again.returncode == 2 and "exists already" in again.stderr
    # From another machine: the run's objects come from the cluster's store as one pack.
    fetched = layout.run_rv("checkout", "one", "--branch", "ran-one", cwd=proj, env_extra=elsewhere)
    assert fetched.returncode == 0, fetched.stderr
    assert tree_of(proj) == ran
    parent = subprocess.run(["git", "rev-parse", "HEAD^"], cwd=proj, capture_output=True, text=True).stdout
    assert parent.strip() == head
