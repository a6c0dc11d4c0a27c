"""rv's temporary folders: named by process, and those of a gone process swept (issue 41)."""

from __future__ import annotations

import os
import subprocess
import sys

from rv.files import tmpdirs


def gone_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_only_folders_of_gone_processes_are_swept(tmp_path):
    gone = gone_pid()
    names = {
        f"rv-links-{gone}-abc": False,  # its process is gone: swept
        f"rv-checkout-{gone}-x_1": False,
        f"rv-diff-{os.getpid()}-abc": True,  # this process: kept
        "rv-diff-abc": True,  # not a name rv writes
        f"rv-other-{gone}-abc": True,  # not a kind of rv's
        f"rv-links-{gone}": True,  # no random part: not rv's
    }
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"rv-ls-{gone}-file").write_text("a file, not a folder")
    removed = tmpdirs.sweep_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted(n for n, kept in names.items() if not kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [n for n, kept in names.items() if kept] + [f"rv-ls-{gone}-file"]
    )
    assert tmpdirs.process_alive(os.getpid()) and not tmpdirs.process_alive(gone)


def test_a_temp_dir_is_named_by_its_process_and_removed_after_use(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / f"rv-diff-{gone_pid()}-old"
    stale.mkdir()
    with tmpdirs.temp_dir("links") as made:
        assert os.path.basename(made).startswith(f"rv-links-{os.getpid()}-")
        assert oct(os.stat(made).st_mode & 0o777) == "0o700"
        assert not stale.exists()
    assert not os.path.exists(made)
