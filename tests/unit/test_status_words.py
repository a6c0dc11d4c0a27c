"""`rv status`'s words agree with their numbers: "1 file", never "1 files" (issue 41)."""

from __future__ import annotations

from rv.cli.status import status_lines
from rv.units import count


def test_count_agrees_with_its_number():
    assert [count(n, "file") for n in (0, 1, 2, 2048)] == ["0 files", "1 file", "2 files", "2,048 files"]
    assert count(1, "ended run") == "1 ended run" and count(3, "entry", "entries") == "3 entries"


def data(files: int, by_kind: int, freed: int, runs: int) -> dict:
    return {
        "user": "me", "host": "h", "profile": "p", "connect_ms": 1.0, "round_trip_ms": 1.0, "account": None,
        "storage_bytes": 10, "storage_files": files, "remote_root": "/r",
        "storage_by_kind": {"work dirs": 10}, "storage_files_by_kind": {"work dirs": by_kind},
        "quota": [{"filesystem": "/r", "files_used": 1, "files_limit": None, "bytes_used": 5,
                   "bytes_limit": None, "tool": "quota", "root": True}],
        "quota_errors": [],
        "gc_would_free": {"bytes_freed": 3, "files_freed": freed, "runs": runs, "snapshots": 1, "objects": 1},
        "git": {}, "jobs": {}, "gpus": {}, "container_runtimes": {"found": {}},
    }  # fmt: skip


def test_status_says_one_file_and_two_files():
    one = "\n".join(status_lines(data(1, 1, 1, 1), [], {}))
    assert "10 B in 1 file under /r" in one and "work dirs 10 B (1 file)" in one
    assert "would free 3 B in 1 file (1 ended run older than 14 days, 1 snapshot, 1 object)" in one
    assert "quota        /r: 1 file (no limit), 5 B (quota)" in one
    assert "1 files" not in one and "(s)" not in one
    two = "\n".join(status_lines(data(2, 2, 0, 2), [], {}))
    assert "in 2 files under" in two and "(2 files)" in two and "in 0 files (2 ended runs" in two
