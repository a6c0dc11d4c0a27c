"""Issue 12, items 1-4, against the real two-node cluster: rv up, rv ssh, rv gpu, rv forward.

Interactive commands run in a pseudo-terminal (tests/integration/terminal.py), as in a terminal
window. On the loopback cluster every node is this machine: `hostname` prints the same name on both,
so "which node" is told by Slurm's name for it ($SLURMD_NODENAME: gpu-02, node2), and every NodeAddr
is 127.0.0.1 while node names do not resolve at all, so a tunnel that reaches a job proves it went to
the address Slurm gives, not to the node's name.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from terminal import Terminal
from test_envs import make_project
from test_jobs import git

# Held by every process torchrun starts; on the node of rank 1 (the second node), serves HTTP on a
# free port and says which in its log.
SERVE = """\
import http.server, os, socketserver, sys, time
node = os.environ.get("SLURMD_NODENAME", "?")
if os.environ.get("SLURM_NODEID") != "1":
    time.sleep(900)
    sys.exit(0)
body = f"hello from {node} in job {os.environ['SLURM_JOB_ID']}\\n".encode()
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
with socketserver.TCPServer(("0.0.0.0", 0), Hello) as server:
    sys.stdout.write(f"serving on {node} port {server.server_address[1]}\\n")
    sys.stdout.flush()
    server.serve_forever()
"""
HOLD = "import time\ntime.sleep(900)\n"
SECRET = "in$ide 'secret'"


@pytest.fixture
def project(tmp_path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "serve.py").write_text(SERVE)
    (repo / "hold.py").write_text(HOLD)
    (repo / "marker.txt").write_text("from the snapshot\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


def rv_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "rv", *args]


def start_two_node_run(run_rv, project: Path, name: str, script: str) -> str:
    """A torchrun job over both nodes (one GPU each); its job id."""
    r = run_rv("run", "-g", "2", "-t", "a6000", "--nodes", "2", "--mem", "1G", "--name", name, "--",
               "torchrun", script, cwd=project)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[0]


def wait_for(what: str, check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def env_saved(remote_root: str, job: str) -> bool:
    """The job has built its environment (what a shell attaches to): its env.sh exists."""
    return any(Path(remote_root).glob(f"runs/*/jobs/{job}/env.sh"))


def queued(ssh, job: str) -> str:
    """The job's state in squeue; "" once it has left the queue (its allocation is released)."""
    result = ssh.run(f"squeue -h -j {job} -o %T")
    if result.exit_code != 0:
        assert "Invalid job id" in result.err, result.err
        return ""
    return result.out.strip()


def wait_gone(ssh, job: str, timeout: float = 90) -> None:
    wait_for(f"job {job} leaving the queue", lambda: queued(ssh, job) == "", timeout)


# --- rv ssh and rv gpu -------------------------------------------------------------------------------


def test_ssh_reaches_the_second_node_in_the_jobs_environment_and_passes_exit_codes(layout, project):
    run_rv, node2 = layout.run_rv, "gpu-02" if layout.name == "bare" else "node2"
    assert run_rv("env", "set", f"MY_INSIDE_SECRET={SECRET}").returncode == 0
    job = start_two_node_run(run_rv, project, "hold", "hold.py")
    try:
        wait_for("the job's environment", lambda: env_saved(layout.remote_root, job))

        r = run_rv("ssh", "hold", "--node", "1", "--", "hostname")
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        r = run_rv("ssh", "hold", "--node", "1", "--", "echo", "$SLURMD_NODENAME", "$SLURM_JOB_ID")
        assert r.stdout.split() == [node2, job], r.stderr
        # What the program has: the setup line's venv (the bare login node has no `python`), the
        # secret, RV_* variables, the work dir with the snapshot's files.
        r = run_rv(
            "ssh", "hold", "--",
            'python -c "import os; print(os.environ[\'MY_INSIDE_SECRET\'])"; '
            'echo "$RV_RUN_NAME $SLURMD_NODENAME"; cat marker.txt; '
            'test "$PWD" = "$RV_WORK_DIR" && echo in-work-dir',
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        node1 = "gpu-01" if layout.name == "bare" else "node1"
        assert r.stdout.splitlines() == [SECRET, f"hold {node1}", "from the snapshot", "in-work-dir"]
        # The command's exit code is rv's, with nothing else said.
        r = run_rv("ssh", "hold", "--node", "1", "--", "echo", "out;", "echo", "err", ">&2;", "exit", "7")
        assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
        r = run_rv("ssh", "hold", "--node", "2", "--", "true")
        assert r.returncode == 2 and "runs on 2 node(s)" in r.stderr

        # A shell in a terminal, on the second node.
        term = Terminal(rv_argv("ssh", "hold", "--node", "1"), env=layout.rv_env, cwd=project)
        try:
            term.expect(r"\(rv hold\) ")
            term.send('echo "node=$SLURMD_NODENAME secret=$MY_INSIDE_SECRET"; exit 3\r')
            term.expect(rf"node={node2} secret={re.escape(SECRET)}")
            assert term.wait() == 3
        finally:
            term.close()

        # No nvidia-smi on this cluster: one clear line, and the missing-command exit code.
        r = run_rv("gpu", "hold")
        assert r.returncode == 7, r.stderr
        assert r.stderr.splitlines() == [
            f"rv: error: no nvidia-smi on {node1}, {node2} (job {job}): no GPU statistics to show"
        ]
    finally:
        assert run_rv("stop", "hold").returncode == 0
    wait_gone(layout.ssh, job)
    r = run_rv("ssh", "hold", "--", "true")
    assert r.returncode == 2 and "run hold is not running: it ended" in r.stderr, r.stderr
    assert not env_saved(layout.remote_root, job)  # it held the secrets: gone with the job


# --- rv forward --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_forward_reaches_an_http_server_of_the_job_on_the_second_node(layout, project):
    run_rv = layout.run_rv
    # A busy local port is refused before anything is asked of the cluster.
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    r = run_rv("forward", f"8000:{busy.getsockname()[1]}", "web")
    busy.close()
    assert r.returncode == 2 and "already in use" in r.stderr, r.stderr

    job = start_two_node_run(run_rv, project, "web", "serve.py")
    try:

        def port() -> str | None:
            found = re.search(r"serving on gpu-02 port (\d+)", run_rv("logs", "web").stdout)
            return found.group(1) if found else None

        remote_port = wait_for("the server's port in the log", port)
        fwd = subprocess.Popen(
            rv_argv("forward", f"{remote_port}:0", "web", "--node", "1"),
            env=layout.rv_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert fwd.stdout is not None
            url = fwd.stdout.readline().strip()
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
            for _ in range(2):  # two connections, each its own channel
                with urllib.request.urlopen(url, timeout=30) as reply:
                    assert reply.read().decode() == f"hello from gpu-02 in job {job}\n"
            fwd.send_signal(signal.SIGINT)
            _, err = fwd.communicate(timeout=30)
        finally:
            if fwd.poll() is None:
                fwd.kill()
                fwd.wait()
        assert fwd.returncode == 0, err
        assert "to port" in err and "of gpu-02 (127.0.0.1)" in err
        assert "stopped forwarding (2 connection(s))" in err
    finally:
        assert run_rv("stop", "web").returncode == 0
    wait_gone(layout.ssh, job)
    r = run_rv("forward", "8000:0", "web")
    assert r.returncode == 2 and "run web is not running" in r.stderr, r.stderr


# --- rv up -------------------------------------------------------------------------------------------


def up_job(term: Terminal) -> str:
    return term.expect(r"rv up session \S+: job (\d+)").group(1)


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_up_gives_a_shell_in_the_jobs_environment_and_exit_releases_the_allocation(layout, project):
    assert layout.run_rv("env", "set", f"MY_INSIDE_SECRET={SECRET}").returncode == 0
    term = Terminal(rv_argv("up", "-g", "1", "-t", "a6000", "--name", "dev"), env=layout.rv_env, cwd=project)
    try:
        job = up_job(term)
        term.expect(r"\(rv dev\) ")
        term.send('python -c \'import os; print("job-dir=" + os.environ["RV_JOB_DIR"])\'\r')
        job_dir = term.expect(r"job-dir=(\S+)\r\n").group(1)
        assert re.fullmatch(rf"{re.escape(layout.remote_root)}/runs/[0-9a-f]+/jobs/{job}", job_dir), job_dir
        term.send('echo "$MY_INSIDE_SECRET|$(cat marker.txt)|$RV_GPUS|$SLURM_JOB_ID|$HF_HOME"\r')
        term.expect(re.escape(f"{SECRET}|from the snapshot|1|{job}|{layout.remote_root}/cache/hf"))
        assert queued(layout.ssh, job) == "RUNNING"
        term.send("exit 4\r")
        term.expect(rf"released the allocation \(job {job}\)")
        assert term.wait() == 4  # the shell's exit code
    finally:
        term.close()
    assert queued(layout.ssh, job) == ""  # released before rv said so
    assert not env_saved(layout.remote_root, job)
    # The session is a run like any other: rv ps -a knows how it ended.
    ps = json.loads(layout.run_rv("ps", "-a", "--json").stdout)
    assert [row["state"] for row in ps if row["name"] == "dev"] == ["CANCELLED"]


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_up_and_ssh_shells_run_in_the_projects_python_environment(layout, tmp_path):
    # The project environment (issue 11) is built as for rv run and reaches the shells through the
    # job script's env-build hook, like everything else the program gets.
    proj = make_project(tmp_path / "envproj", "six==1.16.0\n")
    check = "python -c \"import sys, six, mypkg; print('ENV', six.__version__, mypkg.VALUE, sys.prefix)\""
    term = Terminal(rv_argv("up", "-g", "0", "--mem", "500M", "--name", "envup"), env=layout.rv_env, cwd=proj)
    try:
        job = up_job(term)
        term.expect(r"\(rv envup\) ", timeout=300)
        term.send(check + "\r")
        version, value, prefix = term.expect(r"ENV (\S+) (\S+) (\S+)\r\n").groups()
        assert (version, value) == ("1.16.0", "42")  # six from the environment, mypkg from the work dir
        assert re.fullmatch(rf"{re.escape(layout.remote_root)}/envs/\w+", prefix), prefix
        r = layout.run_rv("ssh", "envup", "--", check)
        assert r.stdout.split() == ["ENV", "1.16.0", "42", prefix], r.stderr
        term.send("exit\r")
        term.expect(rf"released the allocation \(job {job}\)")
        assert term.wait() == 0
    finally:
        term.close()


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_up_detach_keeps_the_allocation_for_rv_ssh_until_rv_stop(layout, project):
    # Two nodes: the session holds both, the shell of rv ssh goes to either.
    r = layout.run_rv(
        "up", "--detach", "-g", "0", "--nodes", "2", "--mem", "500M", "--name", "kept", cwd=project
    )
    assert r.returncode == 0, r.stderr
    job = re.search(r"rv up session kept: job (\d+)", r.stderr).group(1)
    assert "rv ssh kept " in r.stderr and "rv stop kept " in r.stderr  # how to attach, how to end it
    # rv has exited; the job is still there, and a shell attaches to it.
    assert queued(layout.ssh, job) == "RUNNING"
    r = layout.run_rv(
        "ssh", "kept", "--node", "1", "--", "echo", "$SLURM_JOB_ID", "$RV_RUN_NAME", "$SLURMD_NODENAME"
    )
    assert r.stdout.split() == [job, "kept", "gpu-02"], r.stderr
    assert layout.run_rv("stop", "kept").returncode == 0
    wait_gone(layout.ssh, job)


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_up_is_released_when_rv_is_killed_running_or_pending_and_on_ctrl_c(layout, project):
    ssh = layout.ssh
    # Running: rv killed outright (no chance to say anything): its connection closes, and the
    # watchdog on the login node cancels the job.
    term = Terminal(
        rv_argv("up", "-g", "0", "--mem", "500M", "--name", "killed"), env=layout.rv_env, cwd=project
    )
    try:
        job = up_job(term)
        term.expect(r"\(rv killed\) ")
        assert queued(ssh, job) == "RUNNING"
        term.kill(signal.SIGKILL)
        wait_gone(ssh, job)
    finally:
        term.close()

    # Pending: a job of ours holds both nodes' v100s, so a session asking for two waits.
    blocker = ssh.run(
        "sbatch --parsable -p gpu --gres=gpu:v100:2 -N 2 --ntasks-per-node=1 --mem=100M --time=5 "
        "-J rv-test-blocker -o /dev/null --wrap 'sleep 280'"
    )
    assert blocker.exit_code == 0, blocker.err
    blocker_id = blocker.out.strip().split(";")[0]
    try:
        wait_for("the blocker running", lambda: queued(ssh, blocker_id) == "RUNNING")
        for how in ("kill", "ctrl-c"):
            argv = rv_argv("up", "-g", "2", "-t", "v100", "--nodes", "1", "--name", f"waits-{how}")
            term = Terminal(argv, env=layout.rv_env, cwd=project)
            try:
                job = up_job(term)
                term.expect(rf"job {job} is pending \(\w+\)")  # the reason (and start, when Slurm has one)
                assert queued(ssh, job) == "PENDING"
                if how == "kill":
                    term.kill(signal.SIGKILL)
                else:
                    term.send("\x03")  # Ctrl-C, typed
                    term.expect(rf"released the allocation \(job {job}\)")
                    assert term.wait() == 130
                wait_gone(ssh, job)
            finally:
                term.close()
    finally:
        ssh.run(f"scancel {blocker_id}")
