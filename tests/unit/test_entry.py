"""The `rv` front end's pure parts: which commands the command server runs, and the request format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rv import entry, forkserver


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["ps"], "ps"),
        (["-p", "bare", "ps", "-a"], "ps"),
        (["--profile", "bare", "logs", "x"], "logs"),
        (["--profile=bare", "status"], "status"),
        (["-pbare", "run", "--", "python", "-p", "x"], "run"),
        (["--help"], None),
        (["--version"], None),
        ([], None),
        (["-p"], None),
    ],
)
def test_command_of_skips_the_group_options(argv: list[str], command: str | None) -> None:
    assert entry.command_of(argv) == command


def test_only_non_interactive_commands_are_served() -> None:
    env: dict[str, str] = {}
    assert entry.served(["ps"], env)
    assert entry.served(["-p", "x", "ls"], env)
    # They need the terminal as their own: job control, window size, a hidden prompt on /dev/tty.
    for interactive in ("ssh", "up", "init", "env", "forward"):
        assert not entry.served([interactive], env)
    assert not entry.served(["--help"], env)


@pytest.mark.parametrize("value", ["0", "0.0", "-1", "soon"])
def test_warm_seconds_zero_or_invalid_runs_in_process(value: str) -> None:
    # Invalid: the in-process CLI reports it (rv.warm.idle_seconds), the server never sees it.
    assert not entry.served(["ps"], {"RV_WARM_SECONDS": value})


def test_request_round_trips_every_byte_of_argv_cwd_and_environment() -> None:
    argv = ["rv", "run", "--", "python", "-c", "print('a b')", "caf\udce9"]  # a non-UTF-8 byte
    env = {"HOME": "/home/me", "EMPTY": "", "EQ": "a=b=c", "WEIRD\udcff": "\udcfe"}
    encodings = ["utf-8", "strict", "utf-8", "surrogateescape", "latin-1", "backslashreplace"]
    raw = entry.encode_request("abc123", argv, "/tmp/some dir", env, encodings)
    assert int.from_bytes(raw[:4], "big") == len(raw) - 4
    key, cwd, got_enc, got_argv, got_env = forkserver.decode_request(raw[4:])
    assert (key, cwd, got_enc, got_argv, got_env) == ("abc123", "/tmp/some dir", encodings, argv, env)


def test_a_request_of_another_protocol_is_refused() -> None:
    with pytest.raises(forkserver.BadRequest):
        forkserver.decode_request(b"rv-entry-0\0" + b"\0".join([b"x"] * 12))


def test_the_front_end_imports_almost_nothing() -> None:
    # What makes a served command quick: Python's start-up, then only C modules and rv.entry.
    probe = (
        "import sys; before = set(sys.modules)\nimport rv.entry\nprint(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["__future__", "rv", "rv.entry"]


def test_package_signature_changes_when_a_module_is_edited_or_added(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "ps.py").write_text("x = 1\n")
    (tmp_path / "cli" / "notes.txt").write_text("not code\n")
    before = forkserver.package_signature(tmp_path)
    assert [os.path.basename(p) for p, _, _ in before] == ["ps.py"]
    (tmp_path / "cli" / "notes.txt").write_text("still not code\n")
    assert forkserver.package_signature(tmp_path) == before
    st = os.stat(tmp_path / "cli" / "ps.py")
    os.utime(tmp_path / "cli" / "ps.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert forkserver.package_signature(tmp_path) != before
    os.utime(tmp_path / "cli" / "ps.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert forkserver.package_signature(tmp_path) == before
    (tmp_path / "new.py").write_text("")
    assert forkserver.package_signature(tmp_path) != before
