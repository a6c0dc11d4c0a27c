"""Issue 35 on the real clusters: `rv diff` and `rv checkout`, the code runs ran, from the git store.

From this machine's repository of snapshots when it knows the runs, else from the cluster's store
(another machine: a fresh state and cache folder). Both layouts, as the cluster user.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
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


def test_rv_checkout_and_rv_diff_refuse_clearly_and_leave_nothing_behind(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"a.py": "print('one')\n", "run.sh": "#!/bin/sh\necho hi\n"})
    os.chmod(proj / "run.sh", 0o755)
    subprocess.run(["git", "add", "-A"], cwd=proj, check=True)
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"], cwd=proj, check=True
    )
    (proj / "extra.txt").write_text("carried\n")  # untracked: the run carries it
    started = time.time()
    one = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "one", "-f", "--", "python3", "a.py", cwd=proj
    )
    assert one.returncode == 0, one.stderr[-2000:]
    elsewhere = {"RV_STATE_DIR": str(tmp_path / "state2"), "RV_CACHE_DIR": str(tmp_path / "cache2")}

    # Into a dangling symlink, under a file: refused before anything is done, without a traceback.
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "afile").write_text("f\n")
    for dest, words in (
        (tmp_path / "dangling", "is a symlink to"),
        (tmp_path / "afile" / "sub", "is a file"),
    ):
        r = layout.run_rv("checkout", "one", str(dest), cwd=proj)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "nowhere").exists()

    # Through the cluster as from here: dated now, modes as git checks files out under this umask.
    umask = os.umask(0)
    os.umask(umask)
    for where, env in (("here", None), ("there", elsewhere)):
        made = layout.run_rv("checkout", "one", str(tmp_path / where), cwd=proj, env_extra=env)
        assert made.returncode == 0, made.stderr
        for name, mode in (("a.py", 0o666), ("run.sh", 0o777), ("extra.txt", 0o666)):
            st = os.stat(tmp_path / where / name)
            assert stat.S_IMODE(st.st_mode) == mode & ~umask, (where, name, oct(st.st_mode))
            assert st.st_mtime >= started - 5, (where, name, st.st_mtime)

    # --branch over an untracked file the run carried: git will not switch; no branch is left.
    subprocess.run(["git", "config", "user.email", "me@example.org"], cwd=proj, check=True)
    subprocess.run(["git", "config", "user.name", "Me"], cwd=proj, check=True)
    branch = layout.run_rv("checkout", "one", "--branch", "ran-one", cwd=proj)
    assert branch.returncode == 2, branch.stderr
    assert "extra.txt" in branch.stderr and "nothing was changed" in branch.stderr, branch.stderr
    branches = subprocess.run(["git", "branch"], cwd=proj, capture_output=True, text=True).stdout
    assert "ran-one" not in branches and "* " in branches, branches
    assert (proj / "extra.txt").read_text() == "carried\n"

    # A sweep's name where a run is wanted: said so, from this machine's records and from the cluster's.
    sweep = layout.run_rv(
        "run",
        "-g",
        "0",
        "--mem",
        "100M",
        "--name",
        "sw",
        "--sweep",
        "i=0..1",
        "--",
        "python3",
        "a.py",
        cwd=proj,
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    for env in (None, elsewhere):
        r = layout.run_rv("diff", "sw", "one", cwd=proj, env_extra=env)
        assert r.returncode == 2 and "sw is a sweep of 2 point(s)" in r.stderr and "sw/0" in r.stderr, (
            r.stderr
        )

    # A run whose objects a purge took from the cluster's store: a clear message, no folder left.
    store = Path(layout.remote_root) / "store.git" / "objects"
    for path in store.rglob("*"):
        if path.is_file() and path.parent.name != "info":
            path.unlink()
    lost = layout.run_rv("checkout", "one", str(tmp_path / "lost"), cwd=tmp_path, env_extra=elsewhere)
    assert lost.returncode != 0 and "Traceback" not in lost.stderr, lost.stderr
    assert "no longer holds all of run one's files" in lost.stderr and "nothing was written" in lost.stderr
    assert not (tmp_path / "lost").exists()
