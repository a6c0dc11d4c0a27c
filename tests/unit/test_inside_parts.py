"""Working inside a job, without a cluster: nvidia-smi and scontrol parsing on captured output, the
Slurm command lines, the shell the step starts, the port forwarder's relay, and rv ssh's stderr."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from rv.cli.ssh import SrunExitFilter
from rv.errors import UsageError
from rv.gpustat import GpuProcess, NodeGpus, parse_apps, parse_gpus, parse_report
from rv.job.inside import ATTACH, JobPlace, attach_command
from rv.remote.tunnel import Forwarder, bind_local, parse_ports
from rv.slurm import commands
from rv.slurm.parse import NodeAddress, parse_node_addresses

CAPTURED = Path(__file__).resolve().parent.parent / "captured"


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


# --- nvidia-smi ------------------------------------------------------------------------------------


def test_gpu_rows_with_numbers_and_na():
    gpus = parse_gpus(captured("nvidia_smi_gpus_handwritten.txt"))
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    first = gpus[0]
    assert (first.name, first.utilization, first.memory_used_mib, first.memory_total_mib) == (
        "NVIDIA A100-SXM4-80GB", 97, 71234, 81920,
    )  # fmt: skip
    assert (first.temperature_c, first.power_w, first.power_limit_w) == (63, 348.21, 400.0)
    assert gpus[3].utilization is None  # [N/A]: a GPU in MIG mode reports no utilisation


def test_gpu_rows_where_power_is_not_supported():
    gpus = parse_gpus(captured("nvidia_smi_v100_handwritten.txt"))
    assert [(g.name, g.utilization, g.power_w, g.power_limit_w) for g in gpus] == [
        ("Tesla V100-SXM2-32GB", 41, None, None),
        ("Tesla V100-SXM2-32GB", 0, None, None),
    ]


def test_processes_keep_a_path_holding_the_separator_and_unknown_memory():
    apps = parse_apps(captured("nvidia_smi_apps_handwritten.txt"))
    assert [(uuid[:12], p.pid, p.name, p.used_mib) for uuid, p in apps] == [
        ("GPU-8f6c2b8e", 2345678, "/home/abc1de/.venv/bin/python", 71230),
        ("GPU-1a2b3c4d", 2345679, "/home/abc1de/.venv/bin/python", 71176),
        ("GPU-8f6c2b8e", 2346001, "/scratch/abc1de/runs/lr=3e-4,bs=64/eval", 1024),
        ("GPU-1a2b3c4d", 2340117, "[Insufficient Permissions]", None),
        ("GPU-9e8d7c6b", 2346310, "/scratch/abc1de/runs/exp 3, retry/bin/python", 2048),
    ]


def test_report_of_two_nodes_one_without_a_driver():
    nodes = parse_report(captured("rv_gpu_report_handwritten.txt"))
    assert [n.node for n in nodes] == ["udc-an36-25", "udc-an37-1"]  # task order, not line order
    good, broken = nodes
    assert [g.index for g in good.gpus] == [0, 1]
    assert good.gpus[0].processes == (GpuProcess(2345678, "/home/abc1de/.venv/bin/python", 71230),)
    assert good.errors == ()
    assert broken.gpus == () and not broken.missing
    assert len(broken.errors) == 2
    assert all("couldn't communicate with the NVIDIA driver" in e and "code 9" in e for e in broken.errors)


def test_report_of_a_node_without_nvidia_smi_and_of_nothing():
    text = "0: @@node gpu-01\n0: @@missing\n"
    assert parse_report(text) == [NodeGpus(node="gpu-01", missing=True)]
    assert parse_report("") == []


def test_the_node_script_prints_what_the_parser_reads(tmp_path):
    # The script for real, with a stand-in nvidia-smi that prints the captured rows, labelled as
    # srun --label would.
    fake = tmp_path / "nvidia-smi"
    gpus, apps = CAPTURED / "nvidia_smi_gpus_handwritten.txt", CAPTURED / "nvidia_smi_apps_handwritten.txt"
    fake.write_text(
        f'#!/bin/bash\ncase "$1" in --query-gpu=*) cat {shlex.quote(str(gpus))} ;; '
        f"*) cat {shlex.quote(str(apps))} ;; esac\n"
    )
    fake.chmod(0o755)
    from rv.gpustat import NODE_SCRIPT

    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURMD_NODENAME": "gpu-07"}
    out = subprocess.run(
        ["bash", "-c", NODE_SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout
    labelled = "".join(f"0: {line}\n" for line in out.splitlines())
    (node,) = parse_report(labelled)
    assert node.node == "gpu-07" and len(node.gpus) == 4 and node.errors == ()
    assert [p.pid for p in node.gpus[0].processes] == [2345678, 2346001]
    # Without nvidia-smi on PATH: said, not an error.
    env["PATH"] = "/usr/bin/nonexistent"
    bare = subprocess.run(["/bin/bash", "-c", NODE_SCRIPT], env=env, capture_output=True, text=True)
    assert bare.stdout.splitlines() == ["@@node gpu-07", "@@missing"]


# --- where nodes are -------------------------------------------------------------------------------


def test_node_addresses_from_scontrol_captured_on_the_bare_cluster():
    nodes = parse_node_addresses(captured("scontrol_nodes_bare.txt"))
    assert nodes == {
        "gpu-01": NodeAddress("gpu-01", "127.0.0.1", "localhost"),
        "gpu-02": NodeAddress("gpu-02", "127.0.0.1", "localhost"),
    }
    assert nodes["gpu-02"].reach == "127.0.0.1"  # the address, never the node name


def test_node_address_falls_back_to_the_host_name():
    line = (
        "NodeName=udc-an37-1 Arch=x86_64 NodeAddr=(null) NodeHostName=udc-an37-1.hpc OS=Linux 5.14 #1 SMP\n"
    )
    (node,) = parse_node_addresses(line).values()
    assert node.reach == "udc-an37-1.hpc"


# --- Slurm command lines ---------------------------------------------------------------------------


def test_attach_and_each_node_steps():
    assert commands.srun_attach("123", "gpu-02", ["hostname"]) == [
        "srun", "--jobid=123", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu-02", "hostname",
    ]  # fmt: skip
    assert "--pty" in commands.srun_attach("123", "gpu-02", ["bash"], pty=True)
    assert commands.srun_each_node("123", 2, ["true"]) == [
        "srun", "--jobid=123", "--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--label",
        "true",
    ]  # fmt: skip
    assert commands.scontrol_show_nodes(["a", "b"]) == ["scontrol", "-o", "show", "node", "a,b"]


PLACE = JobPlace("/scratch/u/rv", "run0a1b2", "4242")


def test_attach_line_quotes_the_users_command_once():
    line = attach_command(PLACE, "gpu-01", "echo 'a b' $HOME", pty=False)
    words = shlex.split(line)
    assert words[:7] == [
        "srun",
        "--jobid=4242",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=gpu-01",
        "bash",
    ]
    assert words[-3:] == [PLACE.env_file, PLACE.work_dir, "echo 'a b' $HOME"]
    assert PLACE.env_file == "/scratch/u/rv/runs/run0a1b2/jobs/4242/env.sh"


def _attach(tmp_path: Path, env_file: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", ATTACH, "rv-ssh", str(env_file), str(tmp_path / "work"), *command],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def test_the_step_runs_the_command_in_the_saved_environment_with_its_exit_code(tmp_path):
    (tmp_path / "work" / "sub").mkdir(parents=True)
    env_file = tmp_path / "env.sh"
    env_file.write_text(f"export FROM_JOB='x y'\ncd -- {shlex.quote(str(tmp_path / 'work' / 'sub'))}\n")
    r = _attach(tmp_path, env_file, 'echo "$FROM_JOB"; pwd; exit 7')
    assert (r.returncode, r.stdout) == (7, f"x y\n{tmp_path}/work/sub\n")
    assert r.stderr == ""


def test_without_a_saved_environment_the_step_says_so_and_starts_in_the_work_dir(tmp_path):
    (tmp_path / "work").mkdir()
    r = _attach(tmp_path, tmp_path / "missing.sh", "pwd")
    assert (r.returncode, r.stdout) == (0, f"{tmp_path}/work\n")
    assert "saved no environment" in r.stderr


# --- rv ssh's stderr ------------------------------------------------------------------------------


def test_srun_exit_line_is_dropped_and_everything_else_passes_whole():
    out: list[bytes] = []
    f = SrunExitFilter(out.append)
    for chunk in (b"warn", b"ing: x\nsrun: error: gpu-02: task 0: Exited wi", b"th exit code 3\n", b"tail"):
        f.write(chunk)
    f.close()
    assert b"".join(out) == b"warning: x\ntail"


def test_ssh_refuses_an_empty_command_and_a_shell_without_a_terminal(tmp_path, monkeypatch):
    from rv.cli.main import cli

    monkeypatch.setenv("RV_CONFIG", str(tmp_path / "none.toml"))
    runner = CliRunner()
    r = runner.invoke(cli, ["ssh", "myrun", "--"])
    assert r.exit_code == 2 and "nothing after --" in r.output
    r = runner.invoke(cli, ["ssh", "myrun"])  # CliRunner's stdin is no terminal
    assert r.exit_code == 2 and "needs a terminal" in r.output
    r = runner.invoke(cli, ["up", "-g", "0"])
    assert r.exit_code == 2 and "rv up needs a terminal" in r.output


# --- rv forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "ports"), [("8888", (8888, 8888)), ("6006:16006", (6006, 16006)), ("8888:0", (8888, 0))]
)
def test_port_specs(spec, ports):
    assert parse_ports(spec) == ports


@pytest.mark.parametrize("spec", ["", "http", "0", "70000", "80:-1", "80:x", "1:2:3"])
def test_bad_port_specs(spec):
    with pytest.raises(UsageError):
        parse_ports(spec)


def test_a_busy_local_port_is_refused_with_the_way_out():
    taken = bind_local(0)
    try:
        with pytest.raises(UsageError) as info:
            bind_local(taken.getsockname()[1])
        assert "already in use" in info.value.message and "PORT:LOCALPORT" in (info.value.hint or "")
    finally:
        taken.close()


class SocketChannel:
    """A paramiko channel's surface, over a socket: the other end plays the job's server."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def recv_ready(self) -> bool:
        return False

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def test_forwarder_relays_both_ways_and_passes_a_half_close_on():
    listener = bind_local(0)
    servers: list[socket.socket] = []

    def open_channel() -> SocketChannel:
        ours, theirs = socket.socketpair()
        servers.append(theirs)
        return SocketChannel(ours)

    errors: list[str] = []
    fwd = Forwarder(listener, open_channel, errors.append)
    port = listener.getsockname()[1]
    serving = threading.Thread(target=fwd.serve, daemon=True)
    serving.start()
    try:
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        client.sendall(b"GET / HTTP/1.0\r\n\r\n")
        client.shutdown(socket.SHUT_WR)  # the client is done sending: the server must see EOF
        while not servers:
            threading.Event().wait(0.01)
        server = servers[0]
        server.settimeout(10)
        got = b""
        while chunk := server.recv(1024):
            got += chunk
        assert got == b"GET / HTTP/1.0\r\n\r\n"
        server.sendall(b"HTTP/1.0 200 OK\r\n\r\nhello" * 1000)
        server.close()
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
        assert reply == b"HTTP/1.0 200 OK\r\n\r\nhello" * 1000
        assert errors == [] and fwd.connections == 1
    finally:
        fwd.close()
        serving.join(timeout=5)
    assert not serving.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)  # the port is free again


def test_a_tunnel_that_cannot_open_is_told_and_the_next_connection_tried():
    from rv.errors import RemoteError

    listener = bind_local(0)
    calls = []

    def open_channel():
        calls.append(1)
        raise RemoteError("gpu-02 could not connect to 127.0.0.1:9: Connect failed")

    errors: list[str] = []
    fwd = Forwarder(listener, open_channel, errors.append)
    serving = threading.Thread(target=fwd.serve, daemon=True)
    serving.start()
    try:
        for _ in range(2):
            client = socket.create_connection(listener.getsockname(), timeout=10)
            client.settimeout(10)
            assert client.recv(10) == b""  # closed: nothing to reach
            client.close()
        deadline = threading.Event()
        for _ in range(100):
            if len(errors) == 2:
                break
            deadline.wait(0.05)
        assert errors == ["gpu-02 could not connect to 127.0.0.1:9: Connect failed"] * 2
    finally:
        fwd.close()
        serving.join(timeout=5)


def test_attach_env_file_is_the_scripts(tmp_path):
    from rv.agent import layout
    from rv.slurm.script import JOB_ENV_FILE

    # The agent (which cannot import rv.slurm) names the same file the job script writes.
    assert layout.JOB_ENV == JOB_ENV_FILE
    assert os.path.basename(PLACE.env_file) == JOB_ENV_FILE


def test_gpu_table_one_line_per_gpu_and_per_further_process():
    from rv.cli.gpu import render_table

    lines = render_table(parse_report(captured("rv_gpu_report_handwritten.txt")))
    assert lines[0].split() == [
        "NODE",
        "GPU",
        "NAME",
        "UTIL",
        "MEMORY",
        "(MiB)",
        "TEMP",
        "POWER",
        "(W)",
        "PROCESSES",
    ]
    assert lines[1].split() == [
        "udc-an36-25", "0", "NVIDIA", "A100-SXM4-80GB", "97%", "71,234", "/", "81,920", "63C", "348", "/",
        "400", "2345678", "python", "(71,230", "MiB)",
    ]  # fmt: skip
    assert len(lines) == 3  # the node without a driver has no rows (rv gpu warns about it)
    na = render_table(
        [NodeGpus(node="n", gpus=tuple(parse_gpus(captured("nvidia_smi_v100_handwritten.txt"))))]
    )
    assert na[1].split()[-5:] == ["47C", "-", "/", "-", "-"]  # power not supported, no processes
