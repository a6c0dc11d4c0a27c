"""The `rv` program's command server (rv.entry, rv.forkserver) against the real cluster and sshd.

Every command here is the installed `rv` program, as a user types it, in a subprocess (or on a real
pseudo-terminal); the server is the real one it starts. What shows a command was served: the
server's log names each command it forked, with the copy's pid, under the server's own pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import RUNTIME, STATES, run_in_process, wait_gone, warm_pids
from projects import git_project
from terminal import Terminal

from rv.config import load_config, save_config

pytestmark = pytest.mark.integration

RV = Path(sys.executable).parent / "rv"


@pytest.fixture
def runtime() -> Path:
    """A private runtime folder of this test's own: its server and connections, stopped after."""
    path = Path(tempfile.mkdtemp(prefix="rv-cs-", dir="/tmp"))
    os.chmod(path, 0o700)
    yield path
    for pid_file in path.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            os.kill(pid, signal.SIGTERM)
            wait_gone(pid)
    shutil.rmtree(path, ignore_errors=True)


def front(
    env: dict[str, str], *args: str, cwd: Path | None = None, **extra: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RV), *args], env=dict(env, **extra), cwd=cwd, capture_output=True, text=True, timeout=300
    )


def server_pid(runtime: Path, other_than: int | None = None, limit: float = 60.0) -> int:
    """The pid of the command server listening under ``runtime`` (waiting for one to start)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        for pid_file in runtime.glob("cmd-*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text())
                if pid != other_than and list(runtime.glob("cmd-*.sock")):
                    os.kill(pid, 0)
                    return pid
        time.sleep(0.05)
    raise AssertionError(f"no command server started; log: {server_log(runtime)}")


def server_log(runtime: Path) -> str:
    return "".join(p.read_text() for p in sorted(runtime.glob("cmd-*.log")))


def served(runtime: Path, server: int, command: str) -> list[int]:
    """The pids of the copies ``server`` forked for ``rv COMMAND``."""
    return [int(p) for p in re.findall(rf"\[{server}\] command (\d+): rv {command}\b", server_log(runtime))]


def started_server(env: dict[str, str]) -> int:
    """Run one command (in-process: no server yet), which starts the server; its pid."""
    assert front(env, "exec", "true").returncode == 0
    return server_pid(Path(env["RV_RUNTIME_DIR"]))


def test_a_served_command_behaves_as_in_process(rv_env, runtime):
    env = dict(rv_env, RV_RUNTIME_DIR=str(runtime))
    server = started_server(env)

    script = "echo out; echo err >&2; exit 7"
    served_run = front(env, "exec", script)
    in_process = front(env, "exec", script, RV_WARM_SECONDS="0")
    assert (served_run.returncode, served_run.stdout, served_run.stderr) == (7, "out\n", "err\n")
    assert (in_process.returncode, in_process.stdout, in_process.stderr) == (7, "out\n", "err\n")

    bad = front(env, "ps", "--bogus")
    assert bad.returncode == 2 and "No such option '--bogus'" in bad.stderr, bad.stderr

    listed = front(env, "ps", "--json")
    assert listed.returncode == 0, listed.stderr
    # The cluster user is shared with whatever else runs on the loopback cluster: its jobs are in
    # both listings, where their age may differ, and a job may come or go between the two.
    served_rows, in_process_rows = (
        _comparable(out) for out in (listed.stdout, front(env, "ps", "--json", RV_WARM_SECONDS="0").stdout)
    )
    both = served_rows.keys() & in_process_rows.keys()
    assert [served_rows[k] for k in both] == [in_process_rows[k] for k in both]

    # All three went through the server (the in-process ones did not), with their exit codes.
    log = server_log(runtime)
    assert len(served(runtime, server, "exec")) == 1 and len(served(runtime, server, "ps")) == 2, log
    assert f"[{server}] command {served(runtime, server, 'exec')[0]}: exit 7" in log
    assert re.search(rf"\[{server}\] command \d+: exit 2", log), log


def _comparable(listing: str) -> dict[str, dict]:
    """`rv ps --json` rows by job id, without what changes from one second to the next."""
    rows = json.loads(listing)
    assert isinstance(rows, list)
    volatile = ("elapsed_seconds", "state", "live")
    return {str(row.get("job_id")): {k: v for k, v in row.items() if k not in volatile} for row in rows}


def test_one_server_serves_each_callers_folder_environment_and_profile(
    rv_env, bare_rv_env, runtime, tmp_path
):
    # The bare layout (one mixed partition, no accounting) and the default one, from one server.
    env, bare_env = (dict(e, RV_RUNTIME_DIR=str(runtime)) for e in (rv_env, bare_rv_env))
    server = started_server(env)
    repo = tmp_path / f"proj-{uuid.uuid4().hex[:6]}"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "train.py"], cwd=repo, check=True)
    dry = ["run", "--dry-run", "-g", "1", "-t", "a6000", "--", "python", "train.py"]

    default_script = front(env, *dry, cwd=repo)
    bare_script = front(bare_env, *dry, cwd=repo)
    assert default_script.returncode == 0, default_script.stderr
    assert bare_script.returncode == 0, bare_script.stderr
    assert len(served(runtime, server, "run")) == 2
    # Each came from its own config (RV_CONFIG in its environment) and the folder it was typed in.
    assert "#SBATCH --partition=gpu-a6000" in default_script.stdout
    assert "#SBATCH --partition=gpu\n" in bare_script.stdout
    assert repo.name in default_script.stdout and repo.name in bare_script.stdout
    # The same as in-process, line for line, but for what is new each time (ids, times).
    in_process = front(bare_env, *dry, cwd=repo, RV_WARM_SECONDS="0")
    assert _stable(in_process.stdout) == _stable(bare_script.stdout)


def _stable(script: str) -> list[str]:
    # Run names (train-3f9a), ids and stamps differ from one call to the next; the rest may not.
    return [re.sub(r"[0-9a-f]{4,}", "#", line) for line in script.splitlines()]


def test_ctrl_c_on_a_terminal_and_a_killed_front_end_end_the_command(rv_env, runtime):
    env = dict(rv_env, RV_RUNTIME_DIR=str(runtime))
    server = started_server(env)

    term = Terminal([str(RV), "exec", "sleep 20"], env=env)
    try:
        copy = _wait_served(runtime, server, "exec", 1)
        term.send("\x03")  # Ctrl-C: the terminal signals its foreground group, the front end
        assert term.wait(60) == 130, term.text
        term.expect("rv: interrupted")
    finally:
        term.close()
    assert wait_gone(copy)
    assert f"command {copy}: exit 130" in server_log(runtime)

    proc = subprocess.Popen(
        [str(RV), "exec", "sleep 20"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    copy = _wait_served(runtime, server, "exec", 2)
    proc.kill()  # SIGKILL: nothing can be passed on
    proc.communicate(timeout=60)
    assert wait_gone(copy), "the command outlived the rv program that ran it"
    assert f"command {copy}: its front end went away" in server_log(runtime)


def _wait_served(runtime: Path, server: int, command: str, count: int) -> int:
    end = time.monotonic() + 60
    while len(copies := served(runtime, server, command)) < count:
        assert time.monotonic() < end, server_log(runtime)
        time.sleep(0.05)
    return copies[-1]


def test_the_host_key_prompt_is_answered_on_the_callers_terminal(rv_env, runtime, tmp_path):
    env = dict(rv_env, RV_RUNTIME_DIR=str(runtime))
    server = started_server(env)
    known = tmp_path / "known_hosts_new"
    cfg = load_config(Path(env["RV_CONFIG"]))
    profile = cfg.profile(cfg.default)
    save_config(cfg.with_profile(replace(profile, known_hosts=str(known)), make_default=True))

    term = Terminal([str(RV), "exec", "echo answered"], env=env)
    try:
        term.expect(r"Trust it and remember it\?")
        term.send("y\n")
        term.expect("answered")
        assert term.wait(60) == 0
    finally:
        term.close()
    assert served(runtime, server, "exec"), server_log(runtime)
    assert "127.0.0.1" in known.read_text()


def test_a_dead_or_stale_server_is_replaced_and_the_command_still_runs(rv_env, runtime, tmp_path):
    # A copy of rv that this test may edit (never the installed package): the program imports it
    # first, and so does every server it starts.
    copy = tmp_path / "site"
    shutil.copytree(
        Path(__import__("rv").__file__).parent, copy / "rv", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = dict(rv_env, RV_RUNTIME_DIR=str(runtime), PYTHONPATH=str(copy))
    where = subprocess.run(
        [sys.executable, "-c", "import rv; print(rv.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(copy)), where
    first = started_server(env)

    os.kill(first, signal.SIGKILL)  # its socket file stays behind
    assert wait_gone(first)
    r = front(env, "exec", "echo ran")
    assert (r.returncode, r.stdout) == (0, "ran\n"), r.stderr
    second = server_pid(runtime, other_than=first)

    # rv's code changes under a running server (an edit, an upgrade): it must not run the old code.
    edited = copy / "rv" / "errors.py"
    edited.write_text(edited.read_text() + "# edited while a server ran\n")
    r = front(env, "exec", "echo ran again")
    assert (r.returncode, r.stdout) == (0, "ran again\n"), r.stderr
    assert wait_gone(second)
    assert f"[{second}] rv changed since this server started: exiting" in server_log(runtime)
    assert not served(runtime, second, "exec")


def _handshakes(variant: str) -> int:
    """Connections the variant's sshd accepted so far, by its own log."""
    return (STATES[variant] / "log" / "sshd.log").read_text().count("Accepted publickey")


def test_a_served_command_with_no_warm_connection_shakes_hands_once(bare_rv_env, runtime):
    # The bare layout. The copy forks the profile's background connection and waits for it, rather
    # than connecting itself beside it: one SSH handshake (sshd's log counts them), which the next
    # command reuses.
    env = dict(bare_rv_env, RV_RUNTIME_DIR=str(runtime))
    server = started_server(env)
    for key, pid in warm_pids(runtime).items():
        if not key.startswith("cmd-"):
            os.kill(pid, signal.SIGTERM)  # the connection the first (in-process) command started
            assert wait_gone(pid)

    before = _handshakes("bare")
    listed = front(env, "ps", "--json")
    assert listed.returncode == 0, listed.stderr
    assert served(runtime, server, "ps"), server_log(runtime)
    assert _handshakes("bare") - before == 1
    connections = [pid for key, pid in warm_pids(runtime).items() if not key.startswith("cmd-")]
    assert len(connections) == 1

    again = front(env, "exec", "echo again")
    assert (again.returncode, again.stdout) == (0, "again\n"), again.stderr
    assert _handshakes("bare") - before == 1


def test_a_host_that_never_answers_is_tried_once(rv_env, runtime):
    # A login node that accepts TCP and never speaks SSH (hung): the served command waits for the
    # connection it forked, whose one attempt times out. It must not be tried a second time for the
    # same command (that would double the wait of a user whose VPN is down).
    env = dict(rv_env, RV_RUNTIME_DIR=str(runtime), RV_CONNECT_TIMEOUT="2")
    server = started_server(env)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        cfg = load_config(Path(env["RV_CONFIG"]))
        profile = cfg.profile(cfg.default)
        save_config(cfg.with_profile(replace(profile, port=silent.getsockname()[1]), make_default=True))
        r = front(env, "exec", "true")
        assert r.returncode != 0 and "rv: error:" in r.stderr, r.stderr
        assert served(runtime, server, "exec"), server_log(runtime)
        silent.setblocking(False)
        attempts = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                silent.accept()[0].close()
                attempts += 1
        assert attempts == 1
    finally:
        silent.close()


# --------------------------------------------------------------------------------------------------
# Every way users install rv gets the command server (issue 24: `pip install -e .` installs an
# import hook, and a server started without site processing could not import rv at all).


@pytest.fixture(scope="session")
def installable(tmp_path_factory) -> tuple[Path, Path]:
    """(a copy of this checkout's sources, a folder of rv's dependencies): what a fresh venv installs
    rv from, without a network. The dependencies are this test venv's own, linked one by one, rv's
    own entries left out, so nothing but the install under test can make rv importable."""
    base = tmp_path_factory.mktemp("installable")
    src = base / "src"
    src.mkdir()
    repo = Path(__file__).resolve().parents[2]
    for name in ("rv", "rv_train"):
        shutil.copytree(repo / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    deps = base / "deps"
    deps.mkdir()
    import sysconfig

    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name
        if name in ("rv", "rv_train", "__pycache__") or name.startswith(("rv-", "__editable__")):
            continue
        if name.endswith(".pth"):
            continue
        (deps / name).symlink_to(entry)
    return src, deps


def fresh_install(installable: tuple[Path, Path], where: Path, editable: bool, wheel: bool = False) -> Path:
    """A new venv at ``where`` with rv installed by pip as a user would (``-e``, from the source folder,
    or from a wheel built first); its python."""
    src, deps = installable
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "rv_test_deps.pth").write_text(f"{deps}\n")  # pip, setuptools, click, paramiko...
    pip = [str(python), "-m", "pip", "-q"]
    target = str(src)
    if wheel:  # built first, then installed from the .whl file, as a wheel from PyPI would be
        wheels = where.parent / "wheels"
        built = subprocess.run(
            [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert built.returncode == 0, built.stderr
        (found,) = wheels.glob("rv-*.whl")
        target = str(found)
    install = [*pip, "install", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run([*install, *(["-e"] if editable else []), target], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    finder = list(Path(purelib).glob("__editable__*finder*.py"))
    assert bool(finder) == editable, "setuptools' default editable install is an import hook"
    return python


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", ["pip install -e .", "pip install .", "a built wheel", "a tool's venv on PATH"]
)
def test_every_kind_of_install_serves_commands_and_runs_a_job(how, rv_env, installable, runtime, tmp_path):
    python = fresh_install(
        installable, tmp_path / "venv", editable=how == "pip install -e .", wheel=how == "a built wheel"
    )
    env = dict(rv_env, RV_RUNTIME_DIR=str(runtime), RV_DEBUG="1")
    rv = [str(python.parent / "rv")]
    if how == "a tool's venv on PATH":
        # pipx and `uv tool install`: the venv's `rv` linked into a folder on PATH, typed by name.
        on_path = tmp_path / "bin"
        on_path.mkdir()
        (on_path / "rv").symlink_to(python.parent / "rv")
        env["PATH"] = f"{on_path}:{env['PATH']}"
        rv = ["rv"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*rv, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )

    first = run("exec", "echo one")  # no server yet: runs in-process and starts one
    assert (first.returncode, first.stdout) == (0, "one\n"), first.stderr
    assert "rv: debug: started the command server" in first.stderr, first.stderr
    server = server_pid(runtime)
    second = run("exec", "echo two")
    assert (second.returncode, second.stdout) == (0, "two\n"), second.stderr
    assert "rv: debug: served by the command server" in second.stderr, second.stderr
    assert len(served(runtime, server, "exec")) == 1, server_log(runtime)
    # A real job, to its end: `rv run` renders the sbatch script from files of the installed package
    # (rv/agent/job.sh), which a wheel holds only when the package data names them (issue 33).
    hello = "import os\nprint('hello from', os.environ['RV_RUN_NAME'])\n"
    proj = git_project(tmp_path / "proj", {"hello.py": hello})
    job = subprocess.run(
        [*rv, "run", "-g", "0", "--mem", "200M", "--name", "installed", "-f", "--", "python3", "hello.py"],
        env=env, cwd=proj, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    assert "hello from installed" in job.stdout, job.stdout


def test_the_integration_tests_run_the_rv_program_and_it_serves(run_rv, rv_env):
    # conftest's run_rv (every integration test's way to rv) is the installed `rv` program: once the
    # session's command server is up (the first served command of the session starts it), each
    # command goes through it, as a user's does. `python -m rv` never does.
    first = run_rv("exec", "true")
    assert first.returncode == 0, first.stderr
    server = server_pid(RUNTIME)
    r = run_rv("exec", "echo served", env_extra={"RV_DEBUG": "1"})
    assert (r.returncode, r.stdout) == (0, "served\n"), r.stderr
    assert "rv: debug: served by the command server" in r.stderr, r.stderr
    assert served(RUNTIME, server, "exec"), server_log(RUNTIME)
    in_process = run_in_process(["exec", "echo here"], dict(rv_env, RV_DEBUG="1"))
    assert (in_process.returncode, in_process.stdout) == (0, "here\n"), in_process.stderr
    assert "served by the command server" not in in_process.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pip install .", "pip install -e ."])
def test_rv_ui_without_werkzeug_says_what_installs_it_for_this_install(how, rv_env, installable, tmp_path):
    # Issue 41: it said `pip install 'rv[ui]'`, a name on no package index (some other project's).
    src, deps = installable
    bare = tmp_path / "deps-without-werkzeug"
    bare.mkdir()
    for entry in deps.iterdir():
        if not entry.name.lower().startswith(("werkzeug", "markupsafe")):
            (bare / entry.name).symlink_to(entry.resolve())
    assert (deps / "werkzeug").exists()  # the positive case: the test venv has it, this install not
    python = fresh_install((src, bare), tmp_path / "venv", editable=how == "pip install -e .")
    env = dict(rv_env, RV_RUNTIME_DIR=str(tmp_path / "rt"))
    done = subprocess.run(
        [str(python.parent / "rv"), "ui", "--no-browser"], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "rv ui needs Werkzeug" in done.stderr and "'rv[ui]'" not in done.stderr, done.stderr
    said = " ".join(done.stderr.split())
    if how == "pip install .":
        assert f"{python} -m pip install 'werkzeug>=3.0'" in said, done.stderr
    else:
        assert f"{python} -m pip install -e '{src}[ui]'" in said, done.stderr
