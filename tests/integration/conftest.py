"""Fixtures for tests against the real loopback cluster (`scripts/testcluster up`).

Nothing here is faked: a real sshd on 127.0.0.1, real Slurm daemons, the real `rv` CLI run as a
subprocess. A missing cluster is a test failure, not a skip: a skipped integration test proves nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from rv.config import load_config, save_config

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("RV_TESTCLUSTER_DIR", "/tmp/rv-testcluster"))


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


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    env_file = STATE / "env"
    if not env_file.exists():
        pytest.fail(f"the loopback cluster is not up ({env_file} missing): run `scripts/testcluster up`")
    values = _read_env_file(env_file)
    alive = subprocess.run([str(REPO / "scripts/testcluster"), "status"], capture_output=True, text=True)
    if alive.returncode != 0:
        pytest.fail(f"the loopback cluster is not healthy: run `scripts/testcluster up`\n{alive.stdout}")
    return values


# Warm connections (rv.warm) of every test's rv commands: sockets in one short private folder for the
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
    """The background connections alive under ``runtime``: socket key -> pid (from their pid files)."""
    pids = {}
    for f in runtime.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(f.read_text())
            os.kill(pid, 0)
            pids[f.stem] = pid
    return pids


def pytest_sessionfinish(session, exitstatus):
    for pid in warm_pids().values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    shutil.rmtree(RUNTIME, ignore_errors=True)


def run_cli(args, env, cwd=None, input=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv", *args],
        env=env,
        cwd=cwd,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def session_config(cluster, tmp_path_factory) -> Path:
    """One real `rv init --yes` for the session; tests copy its profile with their own remote root."""
    home = tmp_path_factory.mktemp("home")
    config = home / "rv.toml"
    init = run_cli(
        [
            "init", "--profile", "testcluster", "--host", "127.0.0.1",
            "--port", cluster["RV_TESTCLUSTER_SSH_PORT"], "--user", "root",
            "--identity-file", cluster["RV_TESTCLUSTER_KEY"],
            "--known-hosts", cluster["RV_TESTCLUSTER_KNOWN_HOSTS"],
            "--remote-root", cluster["RV_TESTCLUSTER_REMOTE_ROOT"] + "/tests/session",
            "--setup", f"source {Path(sys.executable).parent / 'activate'}",
            "--yes",
        ],
        base_env(home, config),
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    return config


@pytest.fixture
def remote_root(cluster, request) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name[:40]) + "-" + uuid.uuid4().hex[:8]
    return f"{cluster['RV_TESTCLUSTER_REMOTE_ROOT']}/tests/{name}"


@pytest.fixture
def rv_env(session_config, remote_root, tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    config_path = home / "rv.toml"
    cfg = load_config(session_config)
    profile = replace(cfg.profile("testcluster"), remote_root=remote_root)
    save_config(replace(cfg.with_profile(profile, make_default=True), path=config_path))
    Path(remote_root).mkdir(parents=True, exist_ok=True)  # loopback: the "remote" is this machine
    yield base_env(home, config_path)
    shutil.rmtree(remote_root, ignore_errors=True)


@pytest.fixture
def run_rv(rv_env):
    def run(*args: str, cwd=None, input=None, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
        env = dict(rv_env, **(env_extra or {}))
        return run_cli(list(args), env, cwd=cwd, input=input, timeout=timeout)

    return run


@pytest.fixture
def ssh_transport(cluster):
    from rv.transport import SSHTransport, resolve_target

    target = resolve_target(
        "127.0.0.1",
        port=int(cluster["RV_TESTCLUSTER_SSH_PORT"]),
        user="root",
        identity_file=cluster["RV_TESTCLUSTER_KEY"],
        known_hosts=cluster["RV_TESTCLUSTER_KNOWN_HOSTS"],
        ssh_config_path="/nonexistent",
    )
    with SSHTransport(target).connect() as transport:
        yield transport


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
