"""A connection cut in the middle of an agent call: after the call ran on the cluster, before its
answer reached rv. What is safe to repeat is asked again over a fresh connection, with one line on
stderr; a submission is first looked for on the cluster, and never sent twice.

rv's profile connects through a TCP proxy on loopback (:class:`Cutter`) to the layout's sshd. Armed
with an agent mode, the proxy watches the cluster's processes (this machine's) for that agent call
of this test (its arguments name the test's remote root), stops passing the server's bytes on the
moment it starts, lets it run to its end, then drops the connection: the call ran, its answer is lost.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
import time
import zlib
from dataclasses import replace
from pathlib import Path

from conftest import jobs_under
from projects import git_project

from rv.config import load_config, save_config

# Agent calls take a channel of their own, the mode on the agent's command line, where the watcher
# reads it (a pre-started agent reads its mode from stdin). The warm connection still carries them.
ENV = {"RV_PRESTART_AGENTS": "0"}


def _agent_call(pid: str) -> tuple[str, dict] | None:
    """(mode, arguments) of the rv agent running as process ``pid``, or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if len(argv) < 7 or argv[1:4] != [b"-I", b"-S", b"-c"]:
            return None
        raw = argv[6]
        if raw.startswith(b"z:"):  # rv.remote.agent_client.encode_args: long arguments come compressed
            raw = zlib.decompress(base64.b64decode(raw[2:]))
        return argv[5].decode(), json.loads(raw)
    except (OSError, ValueError, zlib.error):
        return None  # gone, or not an agent


class Cutter:
    """A TCP proxy to ``port`` that drops its connections in the middle of one agent call."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[dict] = []
        self.lock = threading.Lock()
        self.cut: list[str] = []  # the modes whose call was cut
        self.watcher: threading.Thread | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self.upstream))
            conn = {"client": client, "server": server, "frozen": False}
            with self.lock:
                self.conns.append(conn)
            threading.Thread(target=self._pass, args=(conn, client, server), daemon=True).start()
            threading.Thread(target=self._pass, args=(conn, server, client), daemon=True).start()

    def _pass(self, conn: dict, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                if src is conn["server"] and conn["frozen"]:
                    continue  # the answer of the call being cut: never reaches rv
                dst.sendall(data)
        except OSError:
            pass  # dropped
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def arm(self, mode: str, root: str, limit: float = 300) -> None:
        """Cut the connections that carry the next agent call of ``mode`` under ``root``."""
        self.watcher = threading.Thread(target=self._watch, args=(mode, root, limit), daemon=True)
        self.watcher.start()

    def _watch(self, mode: str, root: str, limit: float) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                call = _agent_call(pid)
                if call is None or call[0] != mode or call[1].get("root") != root:
                    continue
                with self.lock:
                    conns = list(self.conns)
                for conn in conns:
                    conn["frozen"] = True
                while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)  # the call runs to its end on the cluster
                for conn in conns:
                    for s in (conn["client"], conn["server"]):
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)
                self.cut.append(mode)
                return
            time.sleep(0.003)

    def wait(self) -> list[str]:
        assert self.watcher is not None
        self.watcher.join(timeout=60)
        return self.cut

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for conn in self.conns:
                for s in (conn["client"], conn["server"]):
                    with contextlib.suppress(OSError):
                        s.close()


def through_cutter(layout, tmp_path: Path) -> Cutter:
    """The layout's profile, for this test, connecting through a Cutter (its host key under the
    proxy's port too)."""
    values = layout.cluster
    cutter = Cutter(int(values["RV_TESTCLUSTER_SSH_PORT"]))
    known = Path(values["RV_TESTCLUSTER_KNOWN_HOSTS"]).read_text()
    ours = tmp_path / "known_hosts"
    ours.write_text(known.replace(f"]:{values['RV_TESTCLUSTER_SSH_PORT']} ", f"]:{cutter.port} "))
    config = Path(layout.rv_env["RV_CONFIG"])
    cfg = load_config(config)
    profile = replace(cfg.profile(values["RV_TESTCLUSTER_PROFILE"]), port=cutter.port, known_hosts=str(ours))
    save_config(replace(cfg.with_profile(profile, make_default=True), path=config))
    return cutter


NOTE = "rv: note: connection to 127.0.0.1 was lost while a command ran; reconnected"


def test_a_connection_cut_mid_call_is_healed_and_a_submission_is_not_sent_twice(layout, tmp_path):
    cutter = through_cutter(layout, tmp_path)
    root = layout.remote_root
    proj = git_project(tmp_path / "p", {"a.py": "print(1)\n"})
    try:
        # rv run: its submission ran (the job is queued), its answer was lost. rv asks the cluster
        # whether the run arrived before sending it again: it did, so it is not sent again.
        cutter.arm("run-submit", root)
        r = layout.run_rv(
            "run", "-g", "0", "--mem", "200M", "--name", "cut", "--", "sleep", "600", cwd=proj, env_extra=ENV
        )  # fmt: skip
        assert cutter.wait() == ["run-submit"]
        assert r.returncode == 0, r.stderr
        assert f"{NOTE}: it had reached the cluster, and was not sent again\n" in r.stderr, r.stderr
        jobs = jobs_under(layout.cluster, root)
        assert len(jobs) == 1 and r.stdout.split()[0] == jobs[0], (jobs, r.stdout)

        # rv ps: its listing is asked again; the run is there.
        cutter.arm("runs", root)
        r = layout.run_rv("ps", env_extra=ENV)
        assert cutter.wait() == ["run-submit", "runs"]
        assert r.returncode == 0, r.stderr
        assert r.stderr.count(NOTE) == 1 and f"{NOTE} and asked again\n" in r.stderr, r.stderr
        assert "cut" in r.stdout and jobs[0] in r.stdout, r.stdout

        # rv stop: the stop ran, its answer was lost; asked again, it stops the run all the same.
        cutter.arm("run-stop", root)
        r = layout.run_rv("stop", "cut", env_extra=ENV)
        assert cutter.wait() == ["run-submit", "runs", "run-stop"]
        assert r.returncode == 0, r.stderr
        assert r.stderr.count(NOTE) == 1 and f"{NOTE} and asked again\n" in r.stderr, r.stderr
        deadline = time.monotonic() + 60
        while jobs_under(layout.cluster, root) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert jobs_under(layout.cluster, root) == []
    finally:
        cutter.close()
