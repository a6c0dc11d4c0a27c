"""The `rv` front end's pure parts: which commands the command server runs (rv.remote.connect decides, from
the one command table, rv.commands), the request format, and how background processes start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rv import commands, entry, forkserver, runtime
from rv.cli.main import cli
from rv.remote import connect


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
    assert connect.command_of(argv) == command


def test_only_non_interactive_commands_are_served() -> None:
    env: dict[str, str] = {}
    assert connect.in_process_reason(["ps"], env) is None
    assert connect.in_process_reason(["-p", "x", "ls"], env) is None
    # They need the terminal as their own: job control, window size, a hidden prompt on /dev/tty.
    for interactive in ("ssh", "up", "init", "env", "forward"):
        assert (
            connect.in_process_reason([interactive], env)
            == f"`rv {interactive}` needs this terminal as its own"
        )
    assert connect.in_process_reason(["--help"], env) is not None
    assert connect.in_process_reason(["nosuch"], env) is not None


@pytest.mark.parametrize("value", ["0", "0.0", "-1", "soon"])
def test_warm_seconds_zero_or_invalid_runs_in_process(value: str) -> None:
    # Invalid: the in-process CLI reports it (rv.remote.connect.warm_seconds), the server never sees it.
    assert connect.in_process_reason(["ps"], {"RV_WARM_SECONDS": value}) is not None


def test_the_command_server_can_be_switched_off_alone() -> None:
    assert connect.in_process_reason(["ps"], {"RV_COMMAND_SERVER": "0"}) == "RV_COMMAND_SERVER=0"
    assert connect.in_process_reason(["ps"], {"RV_COMMAND_SERVER": "1", "RV_WARM_SECONDS": "60"}) is None


def test_the_command_table_is_the_clis_and_the_servers() -> None:
    # One table: the group lists exactly its commands, resolves every alias, and each entry names
    # the module and function of a real click command.
    ctx = cli.make_context("rv", ["ps"], resilient_parsing=True)
    assert cli.list_commands(ctx) == list(commands.COMMANDS)
    for name in [*commands.COMMANDS, *commands.ALIASES]:
        found = cli.get_command(ctx, name)
        assert found is not None and found.name == commands.lookup(name).attr.rstrip("_"), name
    served = {n for n, c in commands.COMMANDS.items() if c.served}
    assert served == {n for n in commands.COMMANDS if connect.in_process_reason([n], {}) is None}
    assert not {"init", "up", "ssh", "env", "forward"} & served


def test_channels_follow_their_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RV_HOT_SHELL", raising=False)
    monkeypatch.delenv("RV_PRESTART_AGENTS", raising=False)
    assert connect.channels() == {"hot_shell": True, "agents": True}
    monkeypatch.setenv("RV_PRESTART_AGENTS", "0")
    assert connect.channels() == {"hot_shell": True, "agents": False}
    monkeypatch.setenv("RV_PRESTART_AGENTS", "1")
    monkeypatch.setenv("RV_HOT_SHELL", "0")  # the agents wait in such a shell: both go
    assert connect.channels() == {"hot_shell": False, "agents": False}


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
    # __future__ may already be loaded at start-up (an editable install's .pth hook imports it).
    assert set(eval(out)) - {"__future__"} == {
        "rv",
        "rv.commands",
        "rv.remote",
        "rv.remote.connect",
        "rv.entry",
        "rv.runtime",
    }


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


def test_a_background_python_finds_what_an_import_hook_finds(tmp_path: Path) -> None:
    # `pip install -e .` (setuptools' default) puts no folder on the search path: a .pth file in the
    # venv's site-packages installs a finder, and a child started without site processing (as the
    # command server was) could not import rv at all. Here a finder of the same kind, in a fresh
    # venv, is the only way to a package; a child that process starts must find it too.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    pkg = tmp_path / "elsewhere" / "hookpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 'found through the hook'\n")
    Path(purelib, "hook_finder.py").write_text(
        "import importlib.util, sys\n"
        "class Finder:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name == 'hookpkg':\n"
        f"            return importlib.util.spec_from_file_location(name, {str(pkg / '__init__.py')!r})\n"
        "def install():\n"
        "    sys.meta_path.append(Finder)\n"
    )
    Path(purelib, "__editable__.hookpkg.pth").write_text("import hook_finder; hook_finder.install()\n")
    out, log = tmp_path / "out.txt", tmp_path / "child.log"
    probe = (
        "import sys, hookpkg\n"
        "from rv import runtime\n"
        "boot = 'import hookpkg;open(sys.argv[1],\"w\").write(hookpkg.VALUE)'\n"
        "runtime.spawn_python(boot, {}, args=(sys.argv[1],), log=sys.argv[2]).wait()\n"
    )
    rv_home = str(Path(runtime.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=rv_home)  # rv itself for the probe; the child gets its path
    subprocess.run([python, "-c", probe, str(out), str(log)], env=env, check=True, timeout=60)
    assert out.exists(), log.read_text()
    assert out.read_text() == "found through the hook"
