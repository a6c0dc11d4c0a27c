"""Temporary folders a killed rv left behind are removed by the next rv, and only those whose process
is gone (issue 41: ~24 SIGKILLs of `rv run` left 20 `rv-links-*`/`rv-diff-*` folders in /tmp). A SIGKILL
leaves a folder named as rv names them, rv-KIND-PID-RANDOM: the test makes such leftovers itself.
Through the real program, with a temporary folder of the test's own (TMPDIR): the shared /tmp is not
touched. Both layouts, a run each."""

from __future__ import annotations

import os
import subprocess
import sys

from projects import git_project


def a_gone_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_a_killed_rvs_temp_folders_are_removed_on_the_next_start_and_a_live_ones_kept(layout, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    proj = git_project(tmp_path / "p", {"a.py": "print('ran')\n", "notes.txt": "x\n"})
    (proj / "notes.txt").write_text("changed, not committed\n")  # a dirty tree: rv-diff is used
    gone = a_gone_pid()
    stale = [tmp / f"rv-links-{gone}-a1b2c3", tmp / f"rv-diff-{gone}-d4e5f6"]
    live = tmp / f"rv-diff-{os.getpid()}-keepme"  # this test's process runs: its folder is kept
    other = tmp / "rv-links-notapid"  # not a name rv writes: left alone
    for folder in (*stale, live, other):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "index").write_bytes(b"x" * 1000)
    assert all(f.is_dir() for f in stale)  # the positive case: they were there
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "100M", "-f", "--", "python3", "a.py", cwd=proj, env_extra=env
    )
    assert r.returncode == 0 and r.stdout == "ran\n", r.stderr[-2000:]
    assert not any(f.exists() for f in stale), sorted(p.name for p in tmp.iterdir())
    assert live.is_dir() and other.is_dir()
    # And the run's own folders are gone with it: only the kept two remain.
    assert sorted(p.name for p in tmp.iterdir()) == sorted([live.name, other.name])
