"""The user's SSH setup as OpenSSH reads it: an Included config file and a two-hop ProxyJump.

Two extra sshd run on loopback for the jump hosts (free ports, their own host keys, the cluster's
user and key), started by the fixture and stopped by pid at teardown. Their logs show which host
each one was asked to forward to, so the order of the hops is checked, not only that it worked.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import base_env, run_cli

SSHD = "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def public_key(private: str) -> str:
    pub = Path(private + ".pub")
    if pub.exists():
        return pub.read_text().strip()
    return subprocess.run(
        ["ssh-keygen", "-y", "-f", private], capture_output=True, text=True, check=True
    ).stdout.strip()


class JumpHost:
    """One sshd on 127.0.0.1:<free port> that allows TCP forwarding; stopped by its pid."""

    def __init__(self, folder: Path, user_key: str) -> None:
        self.folder = folder
        folder.mkdir()
        self.port = free_port()
        key = folder / "host_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        self.host_key = (folder / "host_key.pub").read_text().split()[:2]
        authorized = folder / "authorized_keys"
        authorized.write_text(public_key(user_key) + "\n")
        authorized.chmod(0o644)  # sshd reads it as the logging-in user
        self.log = folder / "sshd.log"
        config = folder / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {key}\nPidFile {folder}/sshd.pid\n"
            f"AuthorizedKeysFile {authorized}\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            "AllowTcpForwarding yes\nLogLevel DEBUG1\n"
        )
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=self.log.open("w")
        )
        end = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"jump sshd did not start: {self.log.read_text()[-500:]}")
            time.sleep(0.05)

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {' '.join(self.host_key)}\n"

    def forwarded_to(self) -> list[str]:
        """The "host port" targets it was asked to open direct-tcpip channels to."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if "server_request_direct_tcpip" in line and "target" in line:
                out.append(line.split("target ", 1)[1].strip())
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(params=["default", "bare"])
def target(request) -> dict[str, str]:
    """The cluster behind the jump hosts, once per layout (the bare one has its own sshd, key, root)."""
    return request.getfixturevalue("cluster" if request.param == "default" else "bare_cluster")


@pytest.fixture
def jump_hosts(target):
    if not os.path.exists(SSHD):
        pytest.fail(f"{SSHD} is missing (scripts/testcluster up installs openssh-server)")
    # World-traversable, so sshd can read authorized_keys as the cluster user.
    folder = Path(tempfile.mkdtemp(prefix="rv-jumps-", dir="/tmp"))
    folder.chmod(0o755)
    hosts = []
    try:
        hosts.append(JumpHost(folder / "hop1", target["RV_TESTCLUSTER_KEY"]))
        hosts.append(JumpHost(folder / "hop2", target["RV_TESTCLUSTER_KEY"]))
        yield hosts
    finally:
        for h in hosts:
            h.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_an_included_alias_behind_two_jump_hosts(target, jump_hosts, tmp_path):
    hop1, hop2 = jump_hosts
    user = target.get("RV_TESTCLUSTER_USER", "root")
    known = tmp_path / "known_hosts"
    known.write_text(
        Path(target["RV_TESTCLUSTER_KNOWN_HOSTS"]).read_text()
        + hop1.known_hosts_line()
        + hop2.known_hosts_line()
    )
    conf_d = tmp_path / "ssh.d"
    conf_d.mkdir()
    # The alias and the hops exist only in an Included file (paramiko's parser ignores Include).
    (conf_d / "cluster.conf").write_text(
        f"Host hop1\n  HostName 127.0.0.1\n  Port {hop1.port}\n"
        f"Host hop2\n  HostName 127.0.0.1\n  Port {hop2.port}\n"
        f"Host behind-jumps\n  HostName 127.0.0.1\n  Port {target['RV_TESTCLUSTER_SSH_PORT']}\n"
        "  ProxyJump hop1,hop2\n"
        f"Host *\n  User {user}\n  IdentityFile {target['RV_TESTCLUSTER_KEY']}\n"
        f"  UserKnownHostsFile {known}\n"
    )
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Include {conf_d}/*.conf\n")
    env = dict(base_env(tmp_path, tmp_path / "rv.toml"), RV_SSH_CONFIG=str(ssh_config))
    root = f"{target['RV_TESTCLUSTER_REMOTE_ROOT']}/tests/jumps-{uuid.uuid4().hex[:8]}"
    try:
        init = run_cli(
            ["init", "--profile", "jumps", "--host", "behind-jumps", "--remote-root", root, "--yes"], env
        )
        assert init.returncode == 0, init.stderr
        seen = [run_cli(["exec", 'echo "$SSH_CONNECTION"'], env) for _ in range(3)]
        assert all(r.returncode == 0 for r in seen), [r.stderr for r in seen]
        assert seen[0].stdout.split()[2:] == ["127.0.0.1", target["RV_TESTCLUSTER_SSH_PORT"]]
        # The first connects directly and starts the warm connection, through the same hops.
        assert seen[1].stdout == seen[2].stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # rv -> hop1 -> hop2 -> the cluster, in that order (rv used to skip hop2).
    assert f"127.0.0.1 port {hop2.port}" in hop1.forwarded_to()
    assert f"127.0.0.1 port {target['RV_TESTCLUSTER_SSH_PORT']}" in hop2.forwarded_to()


def test_an_unknown_jump_host_key_is_refused_by_name(target, jump_hosts, tmp_path):
    hop1, hop2 = jump_hosts
    known = tmp_path / "known_hosts"
    known.write_text(Path(target["RV_TESTCLUSTER_KNOWN_HOSTS"]).read_text() + hop1.known_hosts_line())
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"Host behind\n  HostName 127.0.0.1\n  Port {target['RV_TESTCLUSTER_SSH_PORT']}\n"
        f"  ProxyJump 127.0.0.1:{hop1.port},127.0.0.1:{hop2.port}\n"
        f"Host *\n  User {target.get('RV_TESTCLUSTER_USER', 'root')}\n"
        f"  IdentityFile {target['RV_TESTCLUSTER_KEY']}\n  UserKnownHostsFile {known}\n"
    )
    env = dict(base_env(tmp_path, tmp_path / "rv.toml"), RV_SSH_CONFIG=str(ssh_config))
    r = run_cli(
        ["init", "--host", "behind", "--remote-root", "/tmp/never-made", "--known-hosts", str(known)], env
    )
    assert r.returncode == 6, r.stderr
    assert f"host key of [127.0.0.1]:{hop2.port} is not known" in r.stderr
