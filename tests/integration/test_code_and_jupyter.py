"""Issue 38: `rv code` (plain OpenSSH to a session's node) and `rv jupyter` (JupyterLab in a session).

Through the real `rv` program on the loopback clusters, as the cluster user. The ssh client is plain
OpenSSH with a config of the test's own that includes rv's file: nothing of rv runs between it and
the node. Every node is this machine, so which node and which job a command ran in is told by
Slurm's variables in its environment ($SLURMD_NODENAME, $SLURM_JOB_ID), which only a step of the job
has.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from projects import git_project
from test_inside import queued, wait_gone

FAKE_EDITOR = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/editor-args"
"""


def _session(run_rv, name: str) -> dict:
    listed = json.loads(run_rv("ps", "--json").stdout)
    return next(v for v in listed if v["name"] == name)


def _plain_ssh(home: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    """OpenSSH itself: the test's config (it includes rv's), no agent, the test's HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RV_", "SSH_AUTH_SOCK"))}
    env["HOME"] = str(home)
    return subprocess.run(
        ["ssh", "-F", str(config), "-o", "BatchMode=yes", *args],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _scp_up(home: Path, config: Path, alias: str, local: Path, folder: str) -> None:
    """OpenSSH's scp (the sftp protocol) of ``local`` into ``folder`` on the alias's node."""
    sent = subprocess.run(
        ["scp", "-F", str(config), "-o", "BatchMode=yes", str(local), f"{alias}:{folder}/"],
        env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr


@pytest.fixture
def project(tmp_path) -> Path:
    return git_project(tmp_path / "proj", {"notes.txt": "from the snapshot\n"})


def test_code_makes_the_node_reachable_by_plain_ssh_inside_the_job(layout, project, tmp_path):
    home = Path(layout.rv_env["HOME"])
    # The ssh config OpenSSH reads on the login hop: an empty one, never the real user's.
    (tmp_path / "empty_ssh_config").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "code").write_text(FAKE_EDITOR)
    (bin_dir / "code").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RV_SSH_CONFIG": str(tmp_path / "empty_ssh_config")}
    user_config = home / ".ssh" / "config"
    user_config.parent.mkdir(mode=0o700)
    user_config.write_text("Host elsewhere\n    User someone\n")

    r = layout.run_rv("code", "-g", "0", "--mem", "500M", "--name", "ed", "--yes", cwd=project, env_extra=env)
    assert r.returncode == 0, r.stderr
    alias = r.stdout.strip().splitlines()[-1]
    assert alias == f"ed.{layout.cluster['RV_TESTCLUSTER_PROFILE']}.rv"
    job = _session(layout.run_rv, "ed")["job_id"]
    try:
        assert queued(layout.ssh, job) == "RUNNING"  # detached: it outlives rv code
        # The editor got the host and the run's work dir on the node.
        work = f"{layout.remote_root}/runs/{_session(layout.run_rv, 'ed')['run_id']}/work"
        assert (bin_dir / "editor-args").read_text().splitlines() == ["--remote", f"ssh-remote+{alias}", work]
        # One Include line, at the top of the user's config, the user's own lines kept below it.
        text = user_config.read_text()
        includes = [line for line in text.splitlines() if line.startswith("Include ")]
        assert includes == [f"Include {home}/.ssh/rv/config"]
        assert text.index("Include ") < text.index("Host elsewhere")

        # Plain OpenSSH, through the login node, into a step of the session's job, in its environment.
        config = tmp_path / "ssh_config"
        config.write_text(f"Include {home}/.ssh/rv/config\n")
        node = "gpu-01" if layout.name == "bare" else "node1"
        ran = _plain_ssh(home, config, alias, "echo $SLURM_JOB_ID $SLURMD_NODENAME $RV_RUN_NAME; pwd")
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == [job, node, "ed", work], ran.stderr
        # scp (the sftp protocol) both ways, into and out of the run's work dir.
        (tmp_path / "up.txt").write_text("sent by scp\n")
        _scp_up(home, config, alias, tmp_path / "up.txt", work)
        back = _plain_ssh(home, config, alias, "cat up.txt notes.txt")
        assert back.stdout == "sent by scp\nfrom the snapshot\n", back.stderr
        # The node's host key is checked: a different key under the alias is refused, never accepted.
        known = home / ".ssh" / "rv" / "known_hosts"
        good = known.read_text()
        from rv.remote.nodessh import new_host_key

        known.write_text(f"{alias} {new_host_key()[1]}\n")
        refused = _plain_ssh(home, config, alias, "true")
        assert refused.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in refused.stderr
        known.write_text(good)

        # Again: the live session is reused, and no second Include line is added.
        again = layout.run_rv("code", "--yes", cwd=project, env_extra=env)
        assert again.returncode == 0, again.stderr
        assert again.stdout.strip().splitlines()[-1] == alias
        assert f"session ed: job {job}" in again.stderr
        assert user_config.read_text() == text
        ran = _plain_ssh(home, config, alias, "echo $SLURM_JOB_ID")
        assert ran.stdout.split() == [job], ran.stderr
        # rv ps shows the session's editor host.
        shown = layout.run_rv("ps").stdout
        assert f"ssh {alias}" in shown, shown
    finally:
        assert layout.run_rv("stop", "ed").returncode == 0
    wait_gone(layout.ssh, job)


def test_code_without_the_editor_prints_the_host_and_the_command(layout, project, tmp_path):
    (tmp_path / "empty_ssh_config").write_text("")
    env = {"RV_SSH_CONFIG": str(tmp_path / "empty_ssh_config")}
    r = layout.run_rv(
        "code", "-g", "0", "--mem", "500M", "--name", "noed", "--editor", "no-such-editor", "sub/dir",
        cwd=project, env_extra=env,
    )  # fmt: skip
    try:
        assert r.returncode == 0, r.stderr
        alias = r.stdout.strip().splitlines()[-1]
        run_id = _session(layout.run_rv, "noed")["run_id"]
        work = f"{layout.remote_root}/runs/{run_id}/work"
        assert "no-such-editor is not on PATH" in r.stderr
        assert f"no-such-editor --remote ssh-remote+{alias} {work}/sub/dir" in r.stderr
        # No terminal and no --yes: ~/.ssh/config is left alone, and the line to add is printed.
        assert not (Path(layout.rv_env["HOME"]) / ".ssh" / "config").exists()
        assert "Include " in r.stderr
    finally:
        assert layout.run_rv("stop", "noed").returncode == 0


# ~/.ssh/config as users have it: a latin-1 comment (ssh reads bytes and takes it), and rv's Include
# already there, but inside a Host block, where ssh reads it for that host alone.
LATIN1_CONFIG = (
    b"# caf\xe9 du laboratoire: ce fichier est \xe0 moi\n"
    b"Host lab\n    User someone\n    Include ~/.ssh/rv/config\n"
)


def test_code_reads_a_config_that_is_not_utf8_and_puts_the_include_at_the_top(layout, project, tmp_path):
    home = Path(layout.rv_env["HOME"])
    (tmp_path / "empty_ssh_config").write_text("")
    env = {"RV_SSH_CONFIG": str(tmp_path / "empty_ssh_config")}
    user_config = home / ".ssh" / "config"
    user_config.parent.mkdir(mode=0o700)
    user_config.write_bytes(LATIN1_CONFIG)
    r = layout.run_rv(
        "code", "-g", "0", "--mem", "500M", "--name", "latin", "--yes", "--editor", "no-such-editor",
        cwd=project, env_extra=env,
    )  # fmt: skip
    try:
        assert r.returncode == 0, r.stderr
        data = user_config.read_bytes()
        # rv's line at the top, and the user's bytes below it as they were (the latin-1 kept).
        assert data.startswith(b"# rv code's sessions") and data.endswith(LATIN1_CONFIG), data
        assert data.split(b"\n")[1] == f"Include {home}/.ssh/rv/config".encode()
        # ssh itself reads the result, and finds the session's entry for any host (not only "lab").
        alias = r.stdout.strip().splitlines()[-1]
        shown = subprocess.run(
            ["ssh", "-F", str(user_config), "-G", alias], env={**os.environ, "HOME": str(home)},
            capture_output=True, timeout=30,
        )  # fmt: skip
        assert shown.returncode == 0 and b"proxycommand " in shown.stdout, shown.stderr
    finally:
        assert layout.run_rv("stop", "latin").returncode == 0


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # refused before any job: one layout
def test_code_refuses_a_config_ssh_refuses_before_starting_anything(layout, project):
    home = Path(layout.rv_env["HOME"])
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "config").write_text('Host lab\n    User "someone\n')
    r = layout.run_rv("code", "-g", "0", "--name", "quoted", "--yes", cwd=project)
    assert r.returncode == 2, r.stderr
    assert f"{home}/.ssh/config line 2: a quote is not closed: ssh refuses this file too" in r.stderr
    assert "nothing was started" in r.stderr and "Traceback" not in r.stderr
    rows = json.loads(layout.run_rv("ps", "-a", "--json").stdout)
    assert not [row for row in rows if row["run_id"]], rows  # (sacct's other jobs of the user aside)
    assert not (Path(layout.remote_root) / "runs").exists()


def test_a_session_code_started_is_stopped_when_code_fails_after_starting_it(layout, project, tmp_path):
    home = Path(layout.rv_env["HOME"])
    # rv's known_hosts cannot be written (a folder in its place): found only once the session runs.
    (home / ".ssh" / "rv" / "known_hosts").mkdir(mode=0o700, parents=True)
    (tmp_path / "empty_ssh_config").write_text("")
    r = layout.run_rv(
        "code", "-g", "0", "--mem", "500M", "--name", "doomed", "--yes", "--editor", "no-such-editor",
        cwd=project, env_extra={"RV_SSH_CONFIG": str(tmp_path / "empty_ssh_config")},
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"cannot write rv's SSH files in {home}/.ssh/rv" in r.stderr and "Traceback" not in r.stderr
    assert "stopped session doomed, which this command started" in r.stderr
    rows = json.loads(layout.run_rv("ps", "-a", "--json").stdout)
    (row,) = [row for row in rows if row["run_id"]]  # this test's runs: sacct's other jobs aside
    wait_gone(layout.ssh, row["jobs"][-1])  # the GPU is released


# --- rv jupyter -----------------------------------------------------------------------------------

CELL = (
    "import hashlib, os\n"
    "print(os.environ['SLURMD_NODENAME'], os.environ['SLURM_JOB_ID'], os.environ['RV_PRECISION'],\n"
    "      hashlib.sha256(os.environ['NB_SECRET'].encode()).hexdigest()[:12], os.getcwd())\n"
)


def _run_cell(url: str, code: str) -> str:
    """A notebook's cell, through Jupyter's own API: a notebook made by the contents API, a session
    (and kernel) for it, and the cell run over the kernel's websocket. Returns what it printed."""
    import urllib.request
    import uuid
    from urllib.parse import parse_qs, urlsplit

    import websocket

    parts = urlsplit(url)
    token = parse_qs(parts.query)["token"][0]
    base = f"http://{parts.netloc}"
    headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}

    def call(method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"{}")

    notebook = call("POST", "/api/contents", {"type": "notebook"})
    sess = call(
        "POST", "/api/sessions", {"path": notebook["path"], "type": "notebook", "kernel": {"name": "python3"}}
    )
    kernel = sess["kernel"]["id"]
    ws = websocket.create_connection(
        f"ws://{parts.netloc}/api/kernels/{kernel}/channels?token={token}", timeout=120
    )
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex,
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))  # fmt: skip
        out: list[str] = []
        while True:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                raise AssertionError("the cell failed: " + "\n".join(msg["content"]["traceback"]))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
    finally:
        ws.close()


def _start_jupyter(layout, project, *args: str) -> tuple[subprocess.Popen, str]:
    from tests.integration.conftest import RV_PROGRAM

    proc = subprocess.Popen(
        [str(RV_PROGRAM), "jupyter", "--no-browser", *args], env=layout.rv_env, cwd=project,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = proc.stdout.readline().strip()  # the URL, once JupyterLab listens (or "" if rv failed)
    if not url:
        proc.wait(timeout=60)
        raise AssertionError(f"rv jupyter printed no URL (exit {proc.returncode}): {proc.stderr.read()}")
    return proc, url


def _interrupt(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return err


def test_jupyter_serves_a_lab_page_and_a_kernel_in_the_job(layout, project):
    from browser import chromium, wait_until

    assert layout.run_rv("env", "set", "NB_SECRET=for the kernel only").returncode == 0
    proc, url = _start_jupyter(layout, project, "-g", "1", "-t", "a6000", "--mem", "500M", "--name", "nb")
    try:
        assert url.startswith("http://127.0.0.1:") and "/lab?token=" in url, url
        job = _session(layout.run_rv, "nb")["job_id"]
        # A real browser loads the lab page through the forward: JupyterLab's own page, drawn.
        with chromium() as driver:
            driver.get(url)
            wait_until(
                lambda: driver.find_elements("css selector", "#jp-main-dock-panel"),
                120,
                "JupyterLab's main area",
            )
            assert "JupyterLab" in driver.title
        # A cell runs in the job: its node, its job id, the precision rv chose, the secret, the work dir.
        node = "gpu-01" if layout.name == "bare" else "node1"
        printed = _run_cell(url, CELL).split()
        run_id = _session(layout.run_rv, "nb")["run_id"]
        secret = hashlib.sha256(b"for the kernel only").hexdigest()[:12]
        assert printed[:2] == [node, job] and printed[3:] == [
            secret,
            f"{layout.remote_root}/runs/{run_id}/work",
        ]
        assert printed[2] == "bf16", printed  # an A6000 (compute capability 8.6): bf16, as a job gets
    finally:
        err = _interrupt(proc)
    # Ctrl-C ended the forward, not the session or JupyterLab: rv jupyter again reconnects to both.
    assert proc.returncode == 0, err
    try:
        assert queued(layout.ssh, job) == "RUNNING"
        assert f"nb: notebook {url}" in layout.run_rv("ps").stdout
        again, url2 = _start_jupyter(layout, project)
        try:
            assert url2 == url  # the same server (token) on the same local port
            assert _run_cell(url2, "print(1 + 1)").strip() == "2"
        finally:
            _interrupt(again)
    finally:
        assert layout.run_rv("stop", "nb").returncode == 0
    wait_gone(layout.ssh, job)
