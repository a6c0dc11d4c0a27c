"""Snapshots and sync against the real loopback cluster: real sshd, real Slurm, the real `rv` CLI.

Both sides are hashed independently: locally from the files the test meant to send (a list written
here, not computed by rv), remotely by a script run over SSH.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ssh_client_port, warm_pids, warm_ports
from projects import store_state

from rv.remote.ssh import AGENT_SPARES

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "protocol.file.allow=always"]

REMOTE_HASH = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1].encode()
out = {}
for d, dirs, files in os.walk(root):
    for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
        p = os.path.join(d, n)
        rel = os.path.relpath(p, root).decode("utf-8", "surrogateescape")
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ["link", os.readlink(p).decode("utf-8", "surrogateescape")]
        else:
            out[rel] = ["file", bool(st.st_mode & 0o100), hashlib.sha256(open(p, "rb").read()).hexdigest(),
                        bool(st.st_mode & 0o222)]
print(json.dumps(out))
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True).stdout.decode()


def write(path: Path, data: str | bytes, mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    if mode is not None:
        path.chmod(mode)
    return path


def remote_tree(transport, path: str) -> dict[str, list]:
    """{path: ["file", exec, sha256, writable] | ["link", target]} computed on the cluster."""
    res = transport.run(f"python3 -c {shlex.quote(REMOTE_HASH)} {shlex.quote(path)}").check(
        "hashing the snapshot"
    )
    return json.loads(res.stdout)


def local_tree(root: Path, paths: list[str]) -> dict[str, list]:
    out = {}
    for rel in paths:
        p = root / rel
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ["link", os.readlink(p)]
        else:
            out[rel] = ["file", bool(st.st_mode & 0o100), hashlib.sha256(p.read_bytes()).hexdigest(), False]
    return out


def rv_json(run_rv, *args, cwd=None) -> dict:
    r = run_rv(*args, "--json", cwd=cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


AWKWARD = ["with space.txt", "ünïcödé ✓.txt", "-leading-dash.txt", "hash#tag.txt", "it's.txt", 'say "hi".txt']


def job_work_dir(transport, remote_root: str, snapshot_id: str, dest: str) -> None:
    """What a job's script does to make its work dir from a snapshot: its own lines, run on the cluster."""
    from rv.layout import RemoteLayout
    from rv.slurm.script import work_dir_script

    script = "set -euo pipefail\n" + work_dir_script(RemoteLayout(remote_root), snapshot_id)
    transport.run(f"RV_WORK_DIR={shlex.quote(dest)} bash -c {shlex.quote(script)}").check("making a work dir")


def without_writable(tree: dict[str, list]) -> dict[str, list]:
    """A tree without its files' write bits: a work dir's files are the user's, the repo's as they are."""
    return {p: v[:3] if v[0] == "file" else v for p, v in tree.items()}


def awkward_repo(tmp_path: Path) -> tuple[Path, list[str]]:
    """The repo of the issue, and the exact list of paths its snapshot must hold."""
    lib = tmp_path / "lib"
    lib.mkdir()
    git(lib, "init", "-q", "-b", "main")
    write(lib / "lib.py", "VALUE = 42\n")
    write(lib / "tools/tool.sh", "#!/bin/sh\necho tool\n", 0o755)
    git(lib, "add", "-A")
    git(lib, "commit", "-q", "-m", "lib")

    repo = tmp_path / "my repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for name in AWKWARD:
        write(repo / "names" / name, f"content of {name}\n")
    write(repo / "empty", b"")
    write(repo / "run.sh", "#!/bin/sh\necho run\n", 0o755)
    write(repo / "train.py", "lr = 1e-3\n")
    write(repo / "doomed.py", "deleted later, unstaged\n")
    write(repo / ".gitignore", "*.pyc\n")
    write(repo / "pkg/.gitignore", "cache/\n")
    write(repo / "pkg/mod.py", "x = 1\n")
    write(repo / "pkg/.rvignore", "*.bin\n!keep.bin\n")
    write(repo / "pkg/keep.bin", b"\x00\x01keep")
    write(repo / "pkg/weights.bin", b"\x00" * 1000)
    write(repo / ".rvignore", "data/\n")
    write(repo / "data/train.csv", "a,b\n1,2\n")
    (repo / "link-to-train").symlink_to("train.py")
    (repo / "names/dangling").symlink_to("../nowhere")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    git(repo, "submodule", "add", "-q", str(lib), "vendor/lib")
    git(repo, "commit", "-q", "-m", "submodule")
    # Working-tree state the snapshot must capture as it is, not as committed:
    write(repo / "train.py", "lr = 3e-4  # uncommitted edit\n")
    (repo / "doomed.py").unlink()
    write(repo / "notes.md", "untracked, not ignored\n")
    write(repo / "x.pyc", b"ignored by .gitignore")
    write(repo / "pkg/cache/blob", "ignored by the nested .gitignore")
    write(repo / "pkg/new.bin", b"ignored by the nested .rvignore")
    intended = [f"names/{n}" for n in AWKWARD] + [
        "names/dangling", "empty", "run.sh", "train.py", ".gitignore", "pkg/.gitignore", "pkg/mod.py",
        "pkg/.rvignore", "pkg/keep.bin", ".rvignore", "link-to-train", ".gitmodules", "notes.md",
        "vendor/lib/lib.py", "vendor/lib/tools/tool.sh",
    ]  # fmt: skip
    return repo, intended


def test_snapshot_of_an_awkward_repo_is_exact(run_rv, tmp_path, ssh_transport):
    repo, intended = awkward_repo(tmp_path)
    r = run_rv("sync", "snapshot", "--json", cwd=repo)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert f"{len(intended)} files" in r.stderr
    assert "left out 3 files" in r.stderr  # data/train.csv, pkg/weights.bin, pkg/new.bin
    assert snap["remote_path"].endswith("/store.git") and snap["ref"] == f"refs/rv/snapshots/{snap['id']}"
    root = str(Path(snap["remote_path"]).parent)
    work = f"{root}/check-awkward"
    job_work_dir(ssh_transport, root, snap["id"], work)
    assert without_writable(remote_tree(ssh_transport, work)) == without_writable(local_tree(repo, intended))
    meta = json.loads(ssh_transport.run(f"cat {shlex.quote(snap['meta_path'])}").check("reading meta").stdout)
    prov = meta["provenance"]
    assert prov["branch"] == "main" and prov["dirty"] is True and prov["commit"] == snap["commit"]
    assert "+lr = 3e-4  # uncommitted edit" in prov["diff"] and "-deleted later, unstaged" in prov["diff"]
    assert snap["project"].startswith("my-repo-") and len(snap["project"]) == len("my-repo-") + 10
    # Same tree again: the same snapshot, nothing sent.
    again = run_rv("sync", "snapshot", "--json", cwd=repo / "pkg")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["id"] == snap["id"] and "nothing to send" in again.stderr
    assert json.loads(again.stdout)["subdir"] == "pkg"


def test_editing_after_a_snapshot_does_not_change_it(run_rv, tmp_path, ssh_transport, remote_root):
    repo, intended = awkward_repo(tmp_path)
    first = rv_json(run_rv, "sync", "snapshot", cwd=repo)
    job_work_dir(ssh_transport, remote_root, first["id"], f"{remote_root}/check-first")
    before = remote_tree(ssh_transport, f"{remote_root}/check-first")
    write(repo / "train.py", "lr = 1.0  # edited after submission\n")
    (repo / "run.sh").chmod(0o644)
    write(repo / "names/with space.txt", "changed too\n")
    second = rv_json(run_rv, "sync", "snapshot", cwd=repo)
    assert second["id"] != first["id"] and second["new_objects"] == 2
    job_work_dir(ssh_transport, remote_root, first["id"], f"{remote_root}/check-first-again")
    assert remote_tree(ssh_transport, f"{remote_root}/check-first-again") == before
    job_work_dir(ssh_transport, remote_root, second["id"], f"{remote_root}/check-work")
    got = remote_tree(ssh_transport, f"{remote_root}/check-work")
    assert without_writable(got) == without_writable(local_tree(repo, intended))


def test_upload_killed_half_way_then_rerun(rv_env, run_rv, tmp_path, ssh_transport, remote_root):
    repo = tmp_path / "big"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(300):
        write(repo / f"blob{i:03d}.bin", os.urandom(500_000))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "150 MB")
    # Loopback: the cluster's disk is this machine's. Packs of 32 MB: kill once two have landed
    # beside the first (the commit and its trees).
    pack_dir = Path(remote_root) / "store.git" / "objects" / "pack"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rv", "sync", "snapshot"], cwd=repo, env=rv_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if pack_dir.exists() and sum(1 for _ in pack_dir.glob("pack-*.idx")) >= 3:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the upload finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The cluster side notices the dropped connection (stdin ends) and removes its quarantine.
    for _ in range(100):
        state = store_state(ssh_transport, remote_root)
        if not state["temps"]:
            break
        time.sleep(0.1)
    assert state["temps"] == [] and state["fsck"] == 0 and state["refs"] == []
    landed = len(state["objects"])
    assert 20 <= landed < 300
    assert not list(Path(remote_root, "snapshots").glob("*.json"))
    done = rv_json(run_rv, "sync", "snapshot", cwd=repo)
    assert done["created"] and done["new_objects"] == 300 - landed
    job_work_dir(ssh_transport, remote_root, done["id"], f"{remote_root}/check-big")
    assert without_writable(remote_tree(ssh_transport, f"{remote_root}/check-big")) == without_writable(
        local_tree(repo, [f"blob{i:03d}.bin" for i in range(300)])
    )
    final = store_state(ssh_transport, remote_root)
    assert len(final["objects"]) == 300 and final["fsck"] == 0


def test_pull_of_a_folder_sends_only_changed_and_new_files(run_rv, tmp_path, ssh_transport, remote_root):
    q = shlex.quote
    out = f"{remote_root}/outputs/proj/run42"
    ssh_transport.run(
        f"mkdir -p {q(out)}/sub"
        f" && for i in $(seq 1 30); do head -c 20000 /dev/urandom > {q(out)}/f$i.bin; done"
        f" && echo hi > {q(out)}/sub/'a b.txt'"
    ).check("making outputs")
    dest = tmp_path / "out"
    first = rv_json(run_rv, "sync", "pull", "outputs/proj/run42", str(dest))
    assert first["downloaded"] == 31
    ssh_transport.run(
        f"head -c 1234 /dev/urandom > {q(out)}/f7.bin && echo new > {q(out)}/sub/new.txt"
        f" && touch {q(out)}/f9.bin"  # newer mtime, same bytes: compared by hash, not sent
    ).check("changing outputs")
    second = rv_json(run_rv, "sync", "pull", "outputs/proj/run42", str(dest))
    assert (second["downloaded"], second["downloaded_bytes"]) == (2, 1234 + 4)
    assert second["same_content"] == 1
    assert remote_tree(ssh_transport, out) == {k: [*v[:3], True] for k, v in local_tree(dest, sorted(
        str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()
    )).items()}  # fmt: skip


def test_a_pull_never_overwrites_local_edits_unless_told(run_rv, tmp_path, remote_root):
    results = Path(remote_root) / "results"
    results.mkdir()
    for name in ("a.txt", "b.txt"):
        (results / name).write_text(f"cluster {name}\n")
    owner = os.stat(remote_root)
    for p in (results, *results.iterdir()):
        os.chown(p, owner.st_uid, owner.st_gid)  # as the cluster user wrote them
    local = tmp_path / "results"
    first = run_rv("sync", "pull", "results", str(local))
    assert first.returncode == 0, first.stderr
    (local / "a.txt").write_text("my analysis\n")
    for name in ("a.txt", "b.txt"):
        (results / name).write_text(f"cluster {name}, rerun\n")
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in local.iterdir()}

    refused = run_rv("sync", "pull", "results", str(local))
    assert refused.returncode == 2
    assert "a.txt" in refused.stderr and "b.txt" not in refused.stderr.split("next:")[0].split(": ")[-1]
    assert "--force" in refused.stderr and "--keep-local" in refused.stderr
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in local.iterdir()} == before

    kept = run_rv("sync", "pull", "results", str(local), "--keep-local")
    assert kept.returncode == 0, kept.stderr
    assert (local / "a.txt").read_text() == "my analysis\n"
    assert (local / "b.txt").read_text() == "cluster b.txt, rerun\n"

    forced = run_rv("sync", "pull", "results", str(local), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (local / "a.txt").read_text() == "cluster a.txt, rerun\n"


def test_push_dry_run_shows_exactly_what_push_does(run_rv, tmp_path, ssh_transport):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write(repo / "a.py", "a\n")
    write(repo / "b.py", "b\n")
    write(repo / ".gitignore", "outputs/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "x")
    first = rv_json(run_rv, "sync", "push", cwd=repo)
    ws = first["remote"]
    assert "/workspaces/repo-" in ws and ws.endswith("/main")
    q = shlex.quote
    ssh_transport.run(f"mkdir -p {q(ws)}/outputs && echo w > {q(ws)}/outputs/ckpt").check("job output")
    (repo / "b.py").unlink()
    write(repo / "a.py", "a2\n")
    write(repo / "c.py", "c\n")
    dry = run_rv("sync", "push", "--dry-run", cwd=repo)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == ["upload  a.py (3 B)", "delete  b.py", "upload  c.py (2 B)"]
    real = rv_json(run_rv, "sync", "push", cwd=repo)
    assert [u["path"] for u in real["plan"]["upload"]] == ["a.py", "c.py"] and real["plan"]["delete"] == [
        "b.py"
    ]
    tree = remote_tree(ssh_transport, ws)
    assert set(tree) == {"a.py", "c.py", ".gitignore", "outputs/ckpt"}
    again = run_rv("sync", "push", "--dry-run", cwd=repo)
    assert again.stdout == "" and "up to date" in again.stderr


def test_watch_pushes_an_edit_then_stops_on_ctrl_c(rv_env, tmp_path, ssh_transport, remote_root):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write(repo / "a.py", "v1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "x")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rv", "sync", "watch", "--interval", "0.2", "--debounce", "0.2"],
        cwd=repo, env=rv_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        remote = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and remote is None:
            found = ssh_transport.run(f"ls -d {shlex.quote(remote_root)}/workspaces/*/main 2>/dev/null").out
            remote = found.strip() or None
            time.sleep(0.1)
        assert remote, "the first push never arrived"
        write(repo / "a.py", "v2 after an edit\n")
        content = ""
        while time.monotonic() < deadline and content != "v2 after an edit\n":
            content = ssh_transport.run(f"cat {shlex.quote(remote)}/a.py").out
            time.sleep(0.1)
        assert content == "v2 after an edit\n"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped" in err


def test_api_snapshot_overlaps_its_query_and_survives_a_local_error(tmp_path, ssh_transport, remote_root):
    # make_snapshot (what `rv run` calls) starts its query before listing: over real SSH, a size
    # error must abandon it cleanly and leave the connection usable.
    from rv.errors import UsageError
    from rv.files.snapshot import make_snapshot
    from rv.layout import RemoteLayout

    repo, intended = awkward_repo(tmp_path)
    layout = RemoteLayout(remote_root)
    with pytest.raises(UsageError, match="over the 10 B limit"):
        make_snapshot(ssh_transport, layout, repo, max_file_size=10)
    result = make_snapshot(ssh_transport, layout, repo, cache_dir=tmp_path / "cache")
    job_work_dir(ssh_transport, remote_root, result.id, f"{remote_root}/check-api")
    got = remote_tree(ssh_transport, f"{remote_root}/check-api")
    assert result.created and without_writable(got) == without_writable(local_tree(repo, intended))
    again = make_snapshot(ssh_transport, layout, repo, cache_dir=tmp_path / "cache")
    assert (again.id, again.created, again.new_objects) == (result.id, False, 0)


# -- resubmits: thin packs, the listing cache, the agent started ahead (bare layout) ---------------


def test_a_resubmit_after_edits_ships_a_thin_pack_and_the_job_runs_the_edited_tree(
    run_rv_bare, bare_ssh_transport, bare_remote_root, tmp_path
):
    repo, intended = awkward_repo(tmp_path)
    first = rv_json(run_rv_bare, "sync", "snapshot", cwd=repo)
    assert first["created"] and first["remote_path"] == f"{bare_remote_root}/store.git"
    # Edits of every kind, none of them committed.
    write(repo / "train.py", "lr = 9e-9  # edited for the resubmit\n")
    (repo / "names/with space.txt").unlink()
    (repo / "pkg/mod.py").unlink()
    write(repo / "pkg/mod.py/inside.py", "a folder where a file was\n")
    (repo / "link-to-train").unlink()
    write(repo / "link-to-train", "a file where a symlink was\n")
    write(repo / "brand/new/file.txt", "new\n")
    now = sorted(
        {*intended, "pkg/mod.py/inside.py", "brand/new/file.txt"} - {"names/with space.txt", "pkg/mod.py"}
    )
    second = run_rv_bare("sync", "snapshot", "--json", cwd=repo)
    assert second.returncode == 0, second.stderr
    snap = json.loads(second.stdout)
    assert snap["new_objects"] == 4 and "4 new objects" in second.stderr and "sent" in second.stderr
    work = f"{bare_remote_root}/check-work"
    job_work_dir(bare_ssh_transport, bare_remote_root, snap["id"], work)
    assert without_writable(remote_tree(bare_ssh_transport, work)) == without_writable(local_tree(repo, now))
    # A real job on the bare cluster: `rv run` finds the same snapshot and its work dir is the edit.
    run = run_rv_bare(
        "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "-c",
        "import os; print(open('train.py').read().strip(), sorted(os.listdir('pkg/mod.py')))",
        cwd=repo, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "lr = 9e-9  # edited for the resubmit ['inside.py']" in run.stdout
    assert "already on the cluster, nothing to send" in run.stderr
    # The next resubmit holds only the new edits (one blob; the trees above it, as deltas).
    write(repo / "pkg/mod.py/inside.py", "edited again\n")
    (repo / "link-to-train").unlink()
    third = rv_json(run_rv_bare, "sync", "snapshot", cwd=repo)
    assert third["new_objects"] == 1
    job_work_dir(bare_ssh_transport, bare_remote_root, third["id"], f"{bare_remote_root}/check-work-3")
    now.remove("link-to-train")
    got = remote_tree(bare_ssh_transport, f"{bare_remote_root}/check-work-3")
    assert without_writable(got) == without_writable(local_tree(repo, now))


HOT_AGENT = "H[.]read[(]4"  # a regex matching the pre-started agent's command line, not this one


def hot_agents(transport, ports: set[int]) -> list[str]:
    """The pre-started agents waiting on this session's warm connections (their SSH sessions' client
    ports are ``ports``): other rv processes on the machine (another test run's) keep their own."""
    r = transport.run(f'pgrep -u "$(id -u)" -f {shlex.quote(HOT_AGENT)} || true')
    return [pid for pid in r.out.split() if ssh_client_port(pid) in ports]


def spares(transport) -> list[str]:
    """The agents waiting on the warm connection, once there are as many as it keeps."""
    got = hot_agents(transport, warm_ports())
    return got if len(got) == AGENT_SPARES else []


def wait_for(check, limit: float = 30.0):
    """Liveness bound for something the background process does after a command (not a timing claim)."""
    end = time.monotonic() + limit
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, "never happened"
        time.sleep(0.1)


def test_the_agent_started_ahead_serves_the_next_call_and_its_death_costs_nothing(
    run_rv_bare, bare_ssh_transport, tmp_path
):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write(repo / "a.txt", "a\n")
    for _ in range(3):  # the first command connects directly and leaves the warm connection behind
        r = run_rv_bare("sync", "snapshot", cwd=repo)
        assert r.returncode == 0, r.stderr
    before = wait_for(lambda: spares(bare_ssh_transport))
    write(repo / "a.txt", "b\n")
    r = run_rv_bare("sync", "snapshot", cwd=repo)
    assert r.returncode == 0 and "connecting directly" not in r.stderr, r.stderr
    # Waiting agents did the work (they are gone: the upload took one or two calls) and others wait
    # in their place.
    wait_for(lambda: set(before) - set(hot_agents(bare_ssh_transport, warm_ports())))
    after = wait_for(lambda: spares(bare_ssh_transport))
    assert set(after) - set(before)
    bare_ssh_transport.run(f"kill -9 {' '.join(after)}").check("killing the waiting agents")
    write(repo / "a.txt", "c\n")
    r = run_rv_bare("sync", "snapshot", "--json", cwd=repo)
    assert r.returncode == 0 and "connecting directly" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["created"]
    # A waiting agent belongs to its warm connection: when that goes, however it goes, so does the agent.
    ports = warm_ports()  # before the connection goes: the ports its agents' sessions name
    wait_for(lambda: hot_agents(bare_ssh_transport, ports))
    for pid in warm_pids().values():
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not hot_agents(bare_ssh_transport, ports))
