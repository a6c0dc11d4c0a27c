"""Fixtures for tests against the real loopback cluster (`scripts/testcluster up`).

Nothing here is faked: a real sshd on 127.0.0.1, real Slurm daemons, the real `rv` program run as a
subprocess, as a user types it: the installed entry point of this venv, whose front end hands each
command to the command server (rv.entry, rv.forkserver), started by the session's first command and
kept for the whole session. ``run_in_process`` runs ``python -m rv`` instead, for the tests that are
about the CLI in one process. A missing cluster is a test failure, not a skip: a skipped integration
test proves nothing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from rv.config import load_config, save_config

REPO = Path(__file__).resolve().parents[2]
# The `rv` program as installed in this venv (pyproject's [project.scripts]): what users run.
RV_PROGRAM = Path(sys.executable).parent / "rv"
# A test run started in the background by a non-interactive shell (`scripts/test &`) inherits SIGINT
# ignored, and so would every rv it starts: the Ctrl-C tests need rv to see SIGINT as a user's would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# The two layouts `scripts/testcluster` starts side by side (RV_TESTCLUSTER_VARIANT), each with its
# state folder; `scripts/test` passes the folders down as RV_TESTCLUSTER_DIR and RV_TESTCLUSTER_BARE_DIR.
STATES = {
    "default": Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster")),
    "bare": Path(os.environ.get("RV_TESTCLUSTER_BARE_DIR", "/tmp/rv-testcluster-bare")),
}


def _read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export ") :]
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key] = value.strip().strip("'\"")
    return values


def make_remote_dir(path: Path | str, user: str) -> None:
    """`mkdir -p` for a folder on the cluster, each folder it creates owned by the cluster user.

    The tests run as root and the cluster is this machine: a folder root made would be one the
    user's jobs and rv cannot write to, which is not what a real remote root looks like.
    """
    path = Path(path)
    created = []
    while not path.exists():
        created.append(path)
        path = path.parent
    for folder in reversed(created):
        folder.mkdir()
        shutil.chown(folder, user, pwd.getpwnam(user).pw_gid)


def _load_cluster(variant: str) -> dict[str, str]:
    """The env file `scripts/testcluster up` wrote for the variant, once its daemons are checked."""
    state = STATES[variant]
    up = f"RV_TESTCLUSTER_VARIANT={variant} RV_TESTCLUSTER_DIR={state} scripts/testcluster up"
    env_file = state / "env"
    if not env_file.exists():
        pytest.fail(f"the loopback cluster ({variant}) is not up ({env_file} missing): run `{up}`")
    values = _read_env_file(env_file)
    if values.get("RV_TESTCLUSTER_VARIANT", "default") != variant:
        pytest.fail(f"{state} holds the {values.get('RV_TESTCLUSTER_VARIANT')!r} layout, not {variant!r}")
    alive = subprocess.run(
        [str(REPO / "scripts/testcluster"), "status"],
        env=dict(os.environ, RV_TESTCLUSTER_VARIANT=variant, RV_TESTCLUSTER_DIR=str(state)),
        capture_output=True,
        text=True,
    )
    if alive.returncode != 0:
        pytest.fail(
            f"the loopback cluster ({variant}) is not healthy: run `{up}`\n{alive.stdout}{alive.stderr}"
        )
    if "RV_TESTCLUSTER_USER" not in values:
        pytest.fail(f"{env_file} was written by an older scripts/testcluster (no cluster user): run `{up}`")
    # Per-test remote roots go under <remote root>/tests, which must be the user's (rv init makes
    # folders there as the user).
    user = values["RV_TESTCLUSTER_USER"]
    tests = Path(values["RV_TESTCLUSTER_REMOTE_ROOT"]) / "tests"
    make_remote_dir(tests, user)
    shutil.chown(tests, user, pwd.getpwnam(user).pw_gid)  # made by root before there was a user
    return values


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    """The default layout's env file (RV_TESTCLUSTER_*): accounting, a partition per GPU type."""
    return _load_cluster("default")


@pytest.fixture(scope="session")
def bare_cluster() -> dict[str, str]:
    """The bare layout's env file: no accounting, one mixed partition, gpu-01/gpu-02, no `python`."""
    return _load_cluster("bare")


# Warm connections (rv.remote.warm) of every test's rv commands: sockets in one short private folder for the
# session, each background process gone a minute after its test's last command (and stopped, by the
# pid it wrote, when the session ends). The socket path must stay short (sun_path is ~100 bytes).
RUNTIME = Path(tempfile.mkdtemp(prefix="rv-it-", dir="/tmp"))


def base_env(home: Path, config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "SSH_AUTH_SOCK", "XDG_"))}
    # Hermetic: a temp HOME (no ~/.ssh of the developer's; state and cache under it), a temp config,
    # no ssh-agent.
    env.update(
        HOME=str(home),
        RV_CONFIG=str(config),
        NO_COLOR="1",
        COLUMNS="200",
        RV_RUNTIME_DIR=str(RUNTIME),
        RV_WARM_SECONDS="60",
    )
    return env


def warm_pids(runtime: Path = RUNTIME) -> dict[str, int]:
    """rv's background processes alive under ``runtime``: socket key -> pid (from their pid files).
    The command server's keys start with ``cmd-``; the others are warm connections."""
    pids = {}
    for f in runtime.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(f.read_text())
            os.kill(pid, 0)
            pids[f.stem] = pid
    return pids


def ssh_client_port(pid: str) -> int | None:
    """The client port of the SSH session a process was started in (its SSH_CONNECTION), or None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None  # gone meanwhile
    for entry in environ.split(b"\0"):
        if entry.startswith(b"SSH_CONNECTION="):
            return int(entry.split(b"=", 1)[1].split()[1])
    return None


def warm_ports() -> set[int]:
    """The local TCP ports of this session's warm connections (their sockets, read from /proc): the
    client port each one's SSH sessions on the loopback cluster see in their SSH_CONNECTION."""
    inodes = set()
    for pid in warm_pids().values():
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def stop_warm(*, server: bool = False) -> None:
    """End every background connection and wait for it: tests run one at a time, so each test's
    sessions on the cluster end with it and the next test sees only its own. The command server
    (which holds no connection) stays for the next test unless ``server``."""
    pids = [pid for key, pid in warm_pids().items() if server or not key.startswith("cmd-")]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.05)


def wait_gone(pid: int, limit: float = 30.0) -> bool:
    """Liveness bound for a process to exit (not a timing claim)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pytest_sessionfinish(session, exitstatus):
    stop_warm(server=True)
    shutil.rmtree(RUNTIME, ignore_errors=True)


# The time limit of every job a test starts with `rv run` or `rv up` without --time of its own: rv's
# default (2:59:00) let a job a failed test left behind hold the loopback nodes for three hours.
TEST_TIME = "20m"


def with_test_time(args) -> list[str]:
    """``args`` of `rv run`/`rv up` with --time TEST_TIME first, unless the test gives a --time."""
    args = list(args)
    if not args or args[0] not in ("run", "up"):
        return args
    own = args[: args.index("--")] if "--" in args else args
    if any(a == "--time" or a.startswith("--time=") for a in own):
        return args
    return [args[0], "--time", TEST_TIME, *args[1:]]


def run_cli(args, env, cwd=None, input=None, timeout=300) -> subprocess.CompletedProcess:
    """``rv ARGS...``: the installed program (front end and command server, when one is up)."""
    return subprocess.run(
        [str(RV_PROGRAM), *with_test_time(args)],
        env=env,
        cwd=cwd,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_in_process(args, env, cwd=None, input=None, timeout=300) -> subprocess.CompletedProcess:
    """``python -m rv ARGS...``: the CLI in one process, never served."""
    return subprocess.run(
        [sys.executable, "-m", "rv", *with_test_time(args)],
        env=env,
        cwd=cwd,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _session_config(values: dict[str, str], home: Path) -> Path:
    """One real `rv init --yes` per layout and session, as the cluster user, with the cluster-side
    venv as setup (as `scripts/testcluster up` writes the profile); tests copy it with their own
    remote root."""
    config = home / "rv.toml"
    init = run_cli(
        [
            "init", "--profile", values["RV_TESTCLUSTER_PROFILE"], "--host", "127.0.0.1",
            "--port", values["RV_TESTCLUSTER_SSH_PORT"], "--user", values["RV_TESTCLUSTER_USER"],
            "--identity-file", values["RV_TESTCLUSTER_KEY"],
            "--known-hosts", values["RV_TESTCLUSTER_KNOWN_HOSTS"],
            "--remote-root", values["RV_TESTCLUSTER_REMOTE_ROOT"] + "/tests/session",
            "--setup", f"source {values['RV_TESTCLUSTER_PYENV']}/bin/activate",
            "--system-site-packages", "--yes",
        ],
        base_env(home, config),
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    return config


@pytest.fixture(scope="session")
def session_config(cluster, tmp_path_factory) -> Path:
    return _session_config(cluster, tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="session")
def bare_session_config(bare_cluster, tmp_path_factory) -> Path:
    return _session_config(bare_cluster, tmp_path_factory.mktemp("home-bare"))


def _remote_root(values: dict[str, str], request) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name[:40]) + "-" + uuid.uuid4().hex[:8]
    return f"{values['RV_TESTCLUSTER_REMOTE_ROOT']}/tests/{name}"


@pytest.fixture
def remote_root(cluster, request) -> str:
    return _remote_root(cluster, request)


@pytest.fixture
def bare_remote_root(bare_cluster, request) -> str:
    return _remote_root(bare_cluster, request)


def jobs_under(values: dict[str, str], remote_root: str) -> list[str]:
    """The jobs in the queue (pending, running, completing) whose batch script lives under
    ``remote_root``: the jobs of the test that owns that root, and no other's (an array once)."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%F|%o"],
        env=dict(os.environ, SLURM_CONF=values["SLURM_CONF"]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = [line.split("|", 1) for line in out.splitlines() if "|" in line]
    return sorted({job for job, script in found if script.startswith(remote_root.rstrip("/") + "/")})


def cancel_jobs_under(values: dict[str, str], remote_root: str) -> None:
    """Cancel the test's jobs and wait until they have left the queue: whatever the test did or
    failed to do, the next test finds the nodes as this one found them."""
    env = dict(os.environ, SLURM_CONF=values["SLURM_CONF"])
    deadline = time.monotonic() + 60
    while jobs := jobs_under(values, remote_root):
        subprocess.run(["scancel", *jobs], env=env, capture_output=True, check=False)
        if time.monotonic() > deadline:
            raise AssertionError(
                f"jobs {jobs} of {remote_root} are still in the queue a minute after scancel"
            )
        time.sleep(0.5)


def _rv_env(values, session_config: Path, remote_root: str, home: Path):
    home.mkdir()
    config_path = home / "rv.toml"
    cfg = load_config(session_config)
    profile = replace(cfg.profile(values["RV_TESTCLUSTER_PROFILE"]), remote_root=remote_root)
    save_config(replace(cfg.with_profile(profile, make_default=True), path=config_path))
    make_remote_dir(remote_root, values["RV_TESTCLUSTER_USER"])  # loopback: the "remote" is this machine
    try:
        yield base_env(home, config_path)
    finally:
        try:
            cancel_jobs_under(values, remote_root)
        finally:
            stop_warm()
            shutil.rmtree(remote_root, ignore_errors=True)


@pytest.fixture
def rv_env(cluster, session_config, remote_root, tmp_path) -> dict[str, str]:
    yield from _rv_env(cluster, session_config, remote_root, tmp_path / "home")


@pytest.fixture
def bare_rv_env(bare_cluster, bare_session_config, bare_remote_root, tmp_path) -> dict[str, str]:
    yield from _rv_env(bare_cluster, bare_session_config, bare_remote_root, tmp_path / "home-bare")


def _runner(rv_env: dict[str, str]):
    def run(*args: str, cwd=None, input=None, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
        env = dict(rv_env, **(env_extra or {}))
        return run_cli(list(args), env, cwd=cwd, input=input, timeout=timeout)

    return run


@pytest.fixture
def run_rv(rv_env):
    """`run_rv("exec", "true", cwd=...)`: the real CLI on the default layout, as the cluster user."""
    return _runner(rv_env)


@pytest.fixture
def run_rv_bare(bare_rv_env):
    """`run_rv` on the bare layout."""
    return _runner(bare_rv_env)


def _transport(values: dict[str, str]):
    from rv.remote.ssh import SSHTransport
    from rv.remote.sshconfig import resolve_target

    target = resolve_target(
        "127.0.0.1",
        port=int(values["RV_TESTCLUSTER_SSH_PORT"]),
        user=values["RV_TESTCLUSTER_USER"],
        identity_file=values["RV_TESTCLUSTER_KEY"],
        known_hosts=values["RV_TESTCLUSTER_KNOWN_HOSTS"],
        ssh_config_path="/nonexistent",
    )
    with SSHTransport(target).connect() as transport:
        yield transport


@pytest.fixture
def ssh_transport(cluster):
    """An open connection to the default layout's login node, as the cluster user."""
    yield from _transport(cluster)


@pytest.fixture
def bare_ssh_transport(bare_cluster):
    yield from _transport(bare_cluster)


@dataclass(frozen=True)
class Layout:
    """One layout's fixtures under one name, for tests that run on each (the `layout` fixture)."""

    name: str  # "default" | "bare"
    cluster: dict[str, str]  # its env file: RV_TESTCLUSTER_USER, ..._REMOTE_ROOT, ...
    remote_root: str  # this test's own remote root, owned by the cluster user
    rv_env: dict[str, str]
    run_rv: Callable[..., subprocess.CompletedProcess]
    _request: pytest.FixtureRequest

    @property
    def ssh(self):
        """An open SSH transport to the login node, as the cluster user (opened on first use)."""
        return self._request.getfixturevalue(
            "ssh_transport" if self.name == "default" else "bare_ssh_transport"
        )


@pytest.fixture(params=["default", "bare"])
def layout(request) -> Layout:
    """Runs the test once per layout. One of them only: `@pytest.mark.parametrize("layout", ["bare"],
    indirect=True)`."""
    prefix = "" if request.param == "default" else "bare_"
    return Layout(
        name=request.param,
        cluster=request.getfixturevalue(f"{prefix}cluster"),
        remote_root=request.getfixturevalue(f"{prefix}remote_root"),
        rv_env=request.getfixturevalue(f"{prefix}rv_env"),
        run_rv=request.getfixturevalue("run_rv" if request.param == "default" else "run_rv_bare"),
        _request=request,
    )


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A skipped integration test means a component was missing: that is a failure, never a pass.
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("integration") and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"integration test was skipped, which counts as a failure: {report.longrepr}"
