"""Issue 35 on the real clusters: how many files and bytes rv keeps there, the site's quota (the
loopback cluster has no quota tool: that path is the one tested here; the tools' text is parsed in
tests/unit/test_quota_parsers.py), and the files `rv gc` frees, counted on the cluster itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

from projects import git_project


def inodes(root: Path) -> int:
    """Files, links and folders under ``root`` (not itself), each inode once: what a file quota counts."""
    seen = set()
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            seen.add((st.st_dev, st.st_ino))
    return len(seen)


def test_status_counts_the_files_rv_keeps_and_gc_reports_the_files_it_freed(layout, tmp_path):
    proj = git_project(
        tmp_path / "p", {"main.py": "print('ran')\n", **{f"d/f{i}": f"{i}\n" for i in range(40)}}
    )
    for name in ("one", "two"):
        r = layout.run_rv(
            "run", "-g", "0", "--mem", "200M", "--name", name, "-f", "--", "python3", "main.py", cwd=proj,
            timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
    root = Path(layout.remote_root)
    status = layout.run_rv("status", "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert data["storage_files"] == inodes(root) == sum(data["storage_files_by_kind"].values())
    # Each run's work dir holds the snapshot's 41 files and its folder d/.
    assert data["storage_files_by_kind"]["work dirs"] == 2 * (41 + 1)
    assert data["quota"] == [] and data["quota_errors"] == []
    text = layout.run_rv("status").stdout
    assert f"in {data['storage_files']:,} files under {layout.remote_root}" in text
    assert "work dirs" in text and "(84 files)" in text
    assert "quota        not known: no quota tool on the login node (lfs, mmlsquota, quota)" in text

    before = inodes(root)
    gc = layout.run_rv("gc", "--older-than", "0", "--json")
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert sorted(r["name"] for r in report["runs_removed"]) == ["one", "two"]
    assert report["files_freed"] == before - inodes(root) > 2 * 42  # measured: the work dirs and more
    said = layout.run_rv("gc", "--older-than", "0")
    assert said.returncode == 0 and "freed 0 B in 0 files" in said.stderr, said.stderr
