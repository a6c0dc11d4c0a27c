"""Issue 10 on the real clusters: immutable job code, following that never lies, nothing left behind.

Faults are real: squeue fails because a failing `squeue` stands first on the cluster user's PATH,
connections drop because a TCP relay between rv and sshd cuts them, and flock fails because the
remote root lives on a real FUSE filesystem that refuses it (noflock_fs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ssh_client_port
from test_runs import git_project, submitted, wait_for

from rv.config import load_config, save_config


def store_git(remote_root: str, *args: str, input: bytes | None = None) -> bytes:
    """git on the cluster's store, read here (loopback: the cluster's disk is this machine's)."""
    cmd = ["git", "-c", "safe.directory=*", "--git-dir", f"{remote_root}/store.git", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(cmd, input=input, env=env, capture_output=True, check=True).stdout


def stored_blobs(remote_root: str) -> list[bytes]:
    """The content of every blob in the cluster's store."""
    out = store_git(
        remote_root, "cat-file", "--batch-all-objects", "--batch-check=%(objecttype) %(objectname)"
    )
    oids = [line.split()[1] for line in out.decode().splitlines() if line.startswith("blob ")]
    return [store_git(remote_root, "cat-file", "blob", oid) for oid in oids]


# --- immutable code --------------------------------------------------------------------------------


def test_a_job_that_edits_its_code_leaves_the_store_and_the_next_job_alone(run_rv, remote_root, tmp_path):
    proj = git_project(tmp_path / "p", {"data.txt": "original\n", "run.sh": "cat data.txt\n"})
    # As the job's own (non-root) user: make everything writable, then edit a file.
    edit = run_rv(
        "run", "-g", "0", "--mem", "200M", "-f", "--",
        "bash", "-c", "chmod -R u+w . && echo x >> data.txt && cat data.txt",
        cwd=proj,
    )  # fmt: skip
    assert edit.returncode == 0, edit.stderr[-2000:]
    assert "original\nx\n" in edit.stdout
    again = run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "bash", "run.sh", cwd=proj)
    assert again.returncode == 0 and "original\n" in again.stdout and "x\n" not in again.stdout
    blobs = stored_blobs(remote_root)
    assert any(b == b"original\n" for b in blobs)
    assert not any(b == b"original\nx\n" for b in blobs)


# --- following never lies ----------------------------------------------------------------------------

COUNTER = """\
import sys, time
for i in range(1, int(sys.argv[1]) + 1):
    print(f"line {i:04d}", flush=True)
    time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[3]))
"""


def login_user(rv_env) -> pwd.struct_passwd:
    profile = load_config(Path(rv_env["RV_CONFIG"])).profile(None)
    return pwd.getpwnam(profile.user)


@pytest.fixture
def failing_squeue(run_rv_bare, bare_rv_env):
    """A `squeue` that fails until a deadline, first on the cluster user's PATH (via ~/.bashrc)."""
    user = login_user(bare_rv_env)
    home = Path(user.pw_dir)
    bindir, until = home / "rv-test-bin", home / "rv-test-squeue-fails-until"
    bindir.mkdir(exist_ok=True)
    (bindir / "squeue").write_text(
        "#!/bin/sh\n"
        f'if [ "$(date +%s)" -lt "$(cat {until} 2>/dev/null || echo 0)" ]; then\n'
        '    echo "squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation" >&2\n'
        "    exit 1\n"
        "fi\n"
        'exec /usr/bin/squeue "$@"\n'
    )
    (bindir / "squeue").chmod(0o755)
    bashrc = home / ".bashrc"
    original = bashrc.read_bytes() if bashrc.exists() else None
    line = f"PATH={bindir}:$PATH  # rv test: failing squeue\n"
    bashrc.write_text(line + (original.decode() if original else ""))
    for path in (bindir, bindir / "squeue", bashrc):
        os.chown(path, user.pw_uid, user.pw_gid)

    def fail_for(seconds: float) -> None:
        until.write_text(str(int(time.time() + seconds)))

    yield fail_for
    if original is None:
        bashrc.unlink()
    else:
        bashrc.write_bytes(original)
    until.unlink(missing_ok=True)


def test_following_survives_squeue_failing_and_exits_with_the_jobs_code(
    run_rv_bare, failing_squeue, tmp_path
):
    proj = git_project(tmp_path / "p", {"count.py": COUNTER})
    failing_squeue(20)  # squeue fails for the first 20 s of a 30 s job
    r = run_rv_bare(
        "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "count.py", "60", "0.5", "3", cwd=proj
    )
    assert r.returncode == 3, r.stderr[-3000:]
    assert re.findall(r"line (\d+)", r.stdout) == [f"{i:04d}" for i in range(1, 61)]
    assert "squeue failed (squeue: error: slurm_load_jobs error" in r.stderr
    assert re.search(r"asking again in \d+ s", r.stderr)


class Relay:
    """A TCP relay between rv and sshd that the test can cut, as a dropped Wi-Fi would."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0
        # The local port of each connection it opened to sshd: sshd puts it in the session's
        # SSH_CONNECTION, which is how the test knows the cluster-side processes of its own rv.
        self.ports: set[int] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self.ports.add(upstream.getsockname()[1])
                self.pairs.append((client, upstream))
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass  # the other direction was cut: this one ends with it
        for s in (src, dst):
            with contextlib.suppress(OSError):  # already closed by the other direction
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every connection now open (both ends see it close)."""
        with self._lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):  # closed already
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.server.close()
        self.cut()


@pytest.fixture
def relayed(rv_env, cluster, tmp_path):
    """rv's environment with its profile pointed at a relay to the cluster's sshd."""
    config_path = Path(rv_env["RV_CONFIG"])
    cfg = load_config(config_path)
    profile = cfg.profile(None)
    relay = Relay(int(profile.port or 22))
    known = tmp_path / "known_hosts"
    lines = Path(profile.known_hosts).read_text().splitlines()
    key = lines[0].split(" ", 1)[1]
    known.write_text(f"[127.0.0.1]:{relay.port} {key}\n")
    config = tmp_path / "relayed.toml"
    new = replace(profile, port=relay.port, known_hosts=str(known))
    save_config(replace(cfg.with_profile(new, make_default=True), path=config))
    yield relay, dict(rv_env, RV_CONFIG=str(config))
    relay.close()


def rv_process(env: dict, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rv", *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


class Reader:
    """Collects a process's output in the background, so the test can wait for a line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.out: list[str] = []
        self.err: list[str] = []
        self.threads = [
            threading.Thread(target=self._read, args=(proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, self.err), daemon=True),
        ]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink.append(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        wait_for(lambda: any(re.search(pattern, line) for line in self.out), timeout, pattern, step=0.2)

    def join(self) -> tuple[str, str]:
        for t in self.threads:
            t.join(timeout=30)
        return "".join(self.out), "".join(self.err)


def test_following_reconnects_after_a_drop_and_loses_no_line_nor_repeats_one(relayed, tmp_path):
    relay, env = relayed
    proj = git_project(tmp_path / "p", {"count.py": COUNTER})
    proc = rv_process(
        env, "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "count.py", "50", "0.3", "4", cwd=proj
    )
    out = Reader(proc)
    out.wait_for(r"line 0010")
    relay.cut()
    out.wait_for(r"line 0030")
    relay.cut()
    assert proc.wait(timeout=300) == 4
    stdout, stderr = out.join()
    assert re.findall(r"line (\d+)", stdout) == [f"{i:04d}" for i in range(1, 51)], stdout
    assert stderr.count("reconnecting in") >= 2 and relay.accepted >= 3


# --- nothing rv starts on the cluster outlives it ----------------------------------------------------


def rv_started_processes(user: str, ports: set[int]) -> list[str]:
    """The user's processes on the login node started by this test's rv: in an SSH session that came
    through the test's relay (its SSH_CONNECTION names one of ``ports``), whether its session is still
    open or it outlived it; never a job's processes (under slurmstepd). Other tests' rv, running
    beside this one as the same cluster user, never count."""
    ps = subprocess.run(
        ["ps", "-e", "-ww", "-o", "pid=,ppid=,user=,comm=,args="], capture_output=True, text=True
    )
    rows = {}
    for line in ps.stdout.splitlines():
        pid, ppid, owner, comm, *args = line.split(None, 4)
        rows[pid] = (ppid, owner, comm, args[0] if args else "")
    found = []
    parents = {ppid for ppid, *_ in rows.values()}
    for pid, (ppid, owner, comm, args) in rows.items():
        if owner != user or comm.startswith("sshd"):
            continue  # sshd's own per-session process belongs to the connection, not to rv's commands
        if ssh_client_port(pid) not in ports:
            continue  # not started through this test's relay: another test's, or no SSH session's
        if "__rv_cmd" in args and pid not in parents:
            continue  # an idle pre-started shell of a warm connection (rv.remote.ssh.HOT_SHELL), no command
        if "H=sys.stdin.buffer;b=H.read(4)" in args and pid not in parents:
            continue  # rv's agent started ahead by a warm connection, waiting; it ends with it
        up, seen = ppid, 0
        while up in rows and seen < 50 and not rows[up][2].startswith("slurmstepd"):
            up, seen = rows[up][0], seen + 1
        if up not in rows or not rows[up][2].startswith("slurmstepd"):
            found.append(f"{pid} {comm} {args[:120]}")
    return found


def assert_none_left(user: str, ports: set[int]) -> None:
    # sshd needs a moment to notice a closed connection and end the session's processes.
    try:
        wait_for(lambda: not rv_started_processes(user, ports), 10, "rv's remote processes to end", step=0.25)
    except AssertionError:
        tree = subprocess.run(
            ["ps", "-ww", "-u", user, "-o", "pid,ppid,etime,args", "--forest"], capture_output=True, text=True
        )
        raise AssertionError(
            f"left on the login node: {rv_started_processes(user, ports)}\n{tree.stdout}"
        ) from None


def test_nothing_rv_starts_outlives_it(relayed, rv_env, tmp_path):
    relay, env = relayed
    user = login_user(rv_env).pw_name
    proj = git_project(tmp_path / "p", {"count.py": COUNTER})
    ports = relay.ports  # filled as rv connects: the sessions of this test's rv, and no other's
    # A normal end.
    rv = [sys.executable, "-m", "rv", "run", "-g", "0", "--mem", "200M"]
    done = subprocess.run(
        [*rv, "-f", "--", "python3", "count.py", "5", "0.2", "0"],
        env=env, cwd=proj, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_none_left(user, ports)
    # A long job, then each way a follow can end early.
    long = subprocess.run(
        [*rv, "--name", "long", "--", "python3", "count.py", "600", "0.5", "0"],
        env=env, cwd=proj, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    submitted(long)
    for how in ("ctrl-c", "sigkill", "dropped"):
        proc = rv_process(env, "logs", "-f", "long", cwd=proj)
        reader = Reader(proc)
        reader.wait_for(r"line \d+")
        assert rv_started_processes(user, ports), "the follower should be running now"
        if how == "ctrl-c":
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 130
        elif how == "sigkill":
            proc.kill()
            proc.wait(timeout=30)
        else:
            # The connection drops and rv reconnects: the old session's follower must end, and
            # only the new one remain; then rv goes, and that one ends too.
            old = set(rv_started_processes(user, ports))
            relay.cut()

            def survivors(old=old):
                return sorted(set(rv_started_processes(user, ports)) & old)

            # A liveness bound, not a timing claim: 15 s ran out twice in full CI runs, and 30 s once
            # (never alone, in a dozen tries and three more after that); a follower that never ends
            # still fails here, with the user's tree.
            try:
                wait_for(lambda: not survivors(), 60, "the old follower to end", step=0.5)
            except AssertionError as e:
                tree = subprocess.run(["ps", "-ww", "-u", user, "-o", "pid,ppid,etime,args", "--forest"],
                                      capture_output=True, text=True)  # fmt: skip
                raise AssertionError(f"{e}; still there: {survivors()}\n{tree.stdout}") from None
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        reader.join()
        assert_none_left(user, ports)
    stop = subprocess.run(
        [sys.executable, "-m", "rv", "stop", "long"], env=env, capture_output=True, text=True
    )
    assert stop.returncode == 0, stop.stderr
    assert_none_left(user, ports)


# --- cleanup that is true ---------------------------------------------------------------------------------


def du(path: Path) -> int:
    return int(
        subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True).stdout.split()[0]
    )


def listing(path: Path) -> dict[str, int]:
    return {
        str(p.relative_to(path)): p.lstat().st_size for p in path.rglob("*") if not p.name.endswith(".lock")
    }


def run_dir(root: Path, name: str) -> Path:
    runs = (root / "runs").iterdir()
    return next(p for p in runs if json.loads((p / "run.json").read_text())["name"] == name)


def test_gc_frees_exactly_what_it_reports_and_keeps_the_live_run(run_rv, remote_root, tmp_path):
    proj = git_project(tmp_path / "p", {"count.py": COUNTER, "big.bin": "0123456789abcdef" * 65536})
    for name in ("old1", "old2"):
        r = run_rv(
            "run",
            "-g",
            "0",
            "--mem",
            "200M",
            "--name",
            name,
            "-f",
            "--",
            "python3",
            "count.py",
            "3",
            "0",
            "0",
            cwd=proj,
        )
        assert r.returncode == 0, r.stderr
    (proj / "count.py").write_text(COUNTER + "# a new snapshot for the live run\n")
    live = run_rv(
        "run",
        "-g",
        "0",
        "--mem",
        "200M",
        "--name",
        "live",
        "--",
        "python3",
        "count.py",
        "1",
        "300",
        "0",
        cwd=proj,
    )
    submitted(live)
    try:
        root = Path(remote_root)
        wait_for(lambda: "RUNNING" in run_rv("ps").stdout, 60, "the live run to start")
        wait_for(lambda: "line 0001" in run_rv("logs", "live").stdout, 60, "its first line")
        time.sleep(2)  # the ended runs are now older than --older-than 1s
        # gc keeps any snapshot used in the last 15 minutes (an `rv run` may be between upload and sbatch):
        # age the ended runs' one past that.
        old_snapshot = json.loads(run_dir(root, "old1").joinpath("run.json").read_text())["snapshot"]
        month_ago = time.time() - 30 * 86400
        os.utime(root / "snapshots" / f"{old_snapshot}.git.json", (month_ago, month_ago))
        # ... and its pack: git prunes what no snapshot reaches once it is older than the grace period.
        for pack in (root / "store.git" / "objects" / "pack").iterdir():
            os.utime(pack, (month_ago, month_ago))
        before = listing(root)
        dry = run_rv("gc", "--older-than", "1s", "--checkpoints", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert listing(root) == before  # the dry run changed nothing
        du_before = du(root)
        report = run_rv("gc", "--older-than", "1s", "--checkpoints", "--json")
        assert report.returncode == 0, report.stderr
        data = json.loads(report.stdout)
        freed = du_before - du(root)
        assert data["bytes_freed"] == freed > 0  # measured
        assert json.loads(dry.stdout)["bytes_freed"] > 0  # estimated: git's repack may free a little more
        assert sorted(r["name"] for r in data["runs_removed"]) == ["old1", "old2"]
        kept = {k["name"]: k["why"] for k in data["runs_kept"]}
        assert kept["live"].startswith("live (job ")
        live_dir = run_dir(root, "live")
        assert (live_dir / "work" / "count.py").exists() and (live_dir / "job.sbatch").exists()
        assert list((root / "checkpoints").glob("*/live")) and not list((root / "checkpoints").glob("*/old1"))
        # The live run's snapshot is kept; the ended runs' one goes, and with it the one object only it used
        # (the old count.py: big.bin is shared with the live snapshot).
        live_snapshot = json.loads((live_dir / "run.json").read_text())["snapshot"]
        assert {k["id"]: k["reason"] for k in data["kept"]}[live_snapshot] == "used by a run that is kept"
        assert [r["id"] for r in data["removed"]] == [old_snapshot]
        live_files = store_git(remote_root, "ls-tree", "--name-only", f"refs/rv/snapshots/{live_snapshot}")
        assert b"count.py" in live_files.split(b"\n")
        assert data["objects_removed"] == 3  # the old count.py, the tree holding it, its commit
    finally:  # a failed check must not leave the live run holding a node
        assert run_rv("stop", "live").returncode == 0


# --- locking where flock fails ----------------------------------------------------------------------


@pytest.fixture
def noflock_root(rv_env, cluster, tmp_path):
    """A remote root on a FUSE filesystem whose flock fails (ENOLCK), owned by the cluster user."""
    user = login_user(rv_env)
    # Unique per test session: tmp_path's name repeats across sessions, and this folder outlives them.
    base = Path(cluster["RV_TESTCLUSTER_DIR"]) / "noflock" / f"{tmp_path.name}-{os.getpid()}"
    backing, mount = base / "backing", base / "mnt"
    for d in (backing, mount):
        d.mkdir(parents=True)
    os.chown(backing, user.pw_uid, user.pw_gid)
    fs = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("noflock_fs.py")), str(backing), str(mount)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_for(lambda: os.path.ismount(mount) or fs.poll() is not None, 20, "the FUSE mount", step=0.1)
    assert os.path.ismount(mount), fs.stdout.read().decode() if fs.stdout else ""
    config_path = Path(rv_env["RV_CONFIG"])
    cfg = load_config(config_path)
    profile = replace(cfg.profile(None), remote_root=str(mount / "rv"))
    save_config(replace(cfg.with_profile(profile, make_default=True), path=config_path))
    yield mount / "rv"
    subprocess.run(["fusermount", "-u", str(mount)], check=False)
    fs.terminate()
    fs.wait(timeout=10)
    if not os.path.ismount(mount):
        shutil.rmtree(base, ignore_errors=True)


def test_locking_works_where_flock_fails_and_a_busy_lock_names_its_holder(
    run_rv, rv_env, noflock_root, tmp_path
):
    import fcntl

    probe = noflock_root.parent / "probe.lock"
    with open(probe, "w") as fh, pytest.raises(OSError, match="No locks available"):
        fcntl.flock(fh, fcntl.LOCK_EX)  # the premise: this filesystem refuses flock
    proj = git_project(tmp_path / "p", {"hello.py": "print('hello from a no-flock root')\n"})
    r = run_rv("run", "-g", "0", "--mem", "200M", "--name", "nf", "-f", "--", "python3", "hello.py", cwd=proj)
    assert r.returncode == 0, r.stderr[-2000:]  # the name lock and the store lock, without flock
    assert "hello from a no-flock root" in r.stdout
    assert run_rv("gc", "--dry-run").returncode == 0
    # Another rv (on another login node) holds the store: gc waits, then says who holds it.
    held = noflock_root / "objects" / ".lock.d"
    held.mkdir()
    note = {"host": "login7", "pid": 4242, "since": time.time(), "what": "rv gc"}
    (held / "holder").write_text(json.dumps(note))
    owner = login_user(rv_env)
    for path in (held, held / "holder"):
        os.chown(path, owner.pw_uid, owner.pw_gid)
    busy = run_rv("gc", env_extra={"RV_LOCK_WAIT": "1"})
    assert busy.returncode != 0
    assert re.search(r"is busy: held by rv gc \(pid 4242 on login7, since \d\d:\d\d:\d\d\)", busy.stderr), (
        busy.stderr
    )
    # A holder that died on this very host is taken over at once.
    note.update(host=socket.gethostname(), pid=2**22 + 7)
    (held / "holder").write_text(json.dumps(note))
    assert run_rv("gc", env_extra={"RV_LOCK_WAIT": "1"}).returncode == 0
    assert not held.exists()
