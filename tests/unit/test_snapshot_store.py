"""The content-addressed store end to end through LocalTransport (the agent runs as a real subprocess).

Each test's "cluster" is a temp folder: the agent (rv.agent) runs in python3 exactly as it
would over SSH, reading the same stdin stream.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_snapshot import git, new_repo, write

from rv.agent.manifest import manifest_text as agent_text
from rv.agent.manifest import text_id
from rv.agent.store import LAYER_DEPTH
from rv.errors import RemoteError, UsageError
from rv.files.listing import blob_id
from rv.files.snapshot import make_snapshot, prepare_snapshot
from rv.files.treecache import StoreCache, TreeCache
from rv.job.cleanup import collect_garbage
from rv.layout import RemoteLayout
from rv.remote.agent_client import frame
from rv.remote.transport import LocalTransport
from rv.slurm.script import work_dir_script

pytestmark = pytest.mark.usefixtures("hermetic_home")


def local_python_first() -> dict[str, str]:
    # The agent runs as `python3`; make that the interpreter running the tests (fast, known version).
    bindir = Path(sys.executable).parent
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


@pytest.fixture
def transport() -> LocalTransport:
    return LocalTransport(env=local_python_first())


def tree_state(root: Path) -> dict[str, tuple]:
    """Every file under root: (kind, exec bit, sha256 or link target). Folders are implied."""
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        for name in files + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = (
                    "file",
                    bool(st.st_mode & 0o100),
                    hashlib.sha256(Path(p).read_bytes()).hexdigest(),
                )
    return out


def expected_state(repo: Path, paths: list[str]) -> dict[str, tuple]:
    out = {}
    for rel in paths:
        p = repo / rel
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = ("file", bool(p.stat().st_mode & 0o100), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def objects_are_sound(layout: RemoteLayout) -> int:
    """Every object's content hashes to its name; returns how many there are."""
    n = 0
    for fan in Path(layout.objects).iterdir():
        if not fan.is_dir():
            continue
        for obj in fan.iterdir():
            assert blob_id(obj.read_bytes()) == obj.name[:40], f"bad object {obj}"
            n += 1
    return n


def job_copy(layout: RemoteLayout, sid: str, dest: Path) -> Path:
    """The work dir a job makes of snapshot ``sid`` (full or a layer), by the job script's own lines."""
    script = "set -euo pipefail\n" + work_dir_script(layout, sid)
    subprocess.run(["bash", "-c", script], env={**os.environ, "RV_WORK_DIR": str(dest)}, check=True)
    return dest


def leftover_temps(layout: RemoteLayout) -> list[str]:
    tmp = Path(layout.tmp)
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


def sample_repo(tmp_path: Path) -> Path:
    repo = new_repo(tmp_path / "repo", {"train.py": "print('train')\n", "lib/util.py": "X = 1\n"})
    write(repo / "run.sh", "#!/bin/sh\necho run\n", 0o755)
    write(repo / "same_as_run.sh", "#!/bin/sh\necho run\n", 0o644)  # same blob as run.sh, not executable
    write(repo / "empty", b"")
    (repo / "link").symlink_to("train.py")
    write(repo / "odd name #1 'q\".txt", "odd\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "files")
    write(repo / "train.py", "print('edited')\n")
    return repo


def test_snapshot_on_the_cluster_equals_the_local_tree(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    summaries: list[str] = []
    result = make_snapshot(transport, layout, repo, on_summary=summaries.append)
    snap = Path(result.remote_path)
    assert result.created and result.remote_path == layout.snapshot(result.id)
    want = expected_state(
        repo, ["train.py", "lib/util.py", "run.sh", "same_as_run.sh", "empty", "link", "odd name #1 'q\".txt"]
    )
    assert tree_state(snap) == want
    assert snap.stat().st_mode & 0o222 == 0 and (snap / "lib").stat().st_mode & 0o222 == 0
    assert (snap / "train.py").stat().st_mode & 0o222 == 0
    meta = json.loads(Path(result.meta_path).read_text())
    assert meta["id"] == result.id and meta["provenance"]["dirty"] is True
    assert "+print('edited')" in meta["provenance"]["diff"]
    assert summaries == [result.summary]
    assert summaries[0].startswith(f"snapshot {result.id[:12]}: 7 files, ")
    assert "6 new objects" in summaries[0]  # run.sh and same_as_run.sh share one blob
    assert objects_are_sound(layout) == 7  # ... plus its executable twin <oid>.x
    assert leftover_temps(layout) == []


def test_unchanged_resnapshot_is_one_round_trip(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    first = make_snapshot(transport, layout, repo)
    transport.calls.clear()
    again = make_snapshot(transport, layout, repo)
    assert len(transport.calls) == 1
    assert (again.id, again.created, again.new_objects) == (first.id, False, 0)
    assert "already on the cluster" in again.summary


def test_one_changed_file_sends_only_that_file_in_one_round_trip(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    for i in range(300):
        write(repo / "many" / f"f{i}.txt", f"file {i}\n" * 50)
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "many/f7.txt", "changed\n")
    transport.calls.clear()
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert (second.new_objects, second.new_bytes) == (1, len("changed\n"))
    assert len(transport.calls) == 1  # the new object went with the manifest, unasked
    # The manifest went as a delta against the one sent before: a fraction of the 300-entry list.
    full_manifest = frame({"entries": [e.row() for e in prepare_snapshot(repo).tree.entries]})
    assert second.sent_bytes < len(full_manifest) / 4
    # On the cluster: a layer over the first snapshot holding that one file.
    assert second.base == first.id and second.remote_path == layout.snapshot_layer(second.id)
    layer = Path(second.remote_path)
    assert sorted(str(p.relative_to(layer / "tree")) for p in (layer / "tree").rglob("*") if p.is_file()) == [
        "many/f7.txt"
    ]
    work = job_copy(layout, second.id, tmp_path / "work")
    assert (work / "many/f7.txt").read_text() == "changed\n"
    assert tree_state(work) == tree_state(job_copy(layout, first.id, tmp_path / "w1")) | {
        "many/f7.txt": tree_state(work)["many/f7.txt"]
    }


def test_a_base_the_store_does_not_have_falls_back_to_the_full_list(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    cache_dir = tmp_path / "cache"
    snap = prepare_snapshot(repo)
    rows = [e.row() for e in snap.tree.entries]
    stale = agent_text(rows[:-1])
    TreeCache(cache_dir).put_text(text_id(stale), stale)
    StoreCache(cache_dir, layout.root).add(snap.project, text_id(stale))  # a base the cluster never had
    write(repo / "extra.txt", "x")
    transport.calls.clear()
    result = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert result.created and (Path(result.remote_path) / "extra.txt").read_text() == "x"
    assert len(transport.calls) == 3  # the delta, refused; the full list; the objects
    assert StoreCache(cache_dir, layout.root).known(snap.project) == [result.id]


def test_later_edits_do_not_change_a_snapshot(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    first = make_snapshot(transport, layout, repo)
    before = tree_state(Path(first.remote_path))
    write(repo / "train.py", "print('after submission')\n")
    (repo / "run.sh").chmod(0o644)
    second = make_snapshot(transport, layout, repo)
    assert second.id != first.id
    assert tree_state(Path(first.remote_path)) == before
    assert (Path(second.remote_path) / "train.py").read_text() == "print('after submission')\n"


class CutAfter(LocalTransport):
    """Delivers only the first ``limit`` bytes of a snap-put stream, then closes stdin: a dropped link."""

    def __init__(self, limit: int, **kw) -> None:
        super().__init__(**kw)
        self.limit = limit

    def run(self, command, *, stdin=None, timeout=None):
        if "snap-put" in command:
            stdin = self._cut(stdin)
        return super().run(command, stdin=stdin, timeout=timeout)

    def _cut(self, chunks):
        left = self.limit
        for chunk in chunks:
            if left <= 0:
                return
            yield chunk[:left]
            left -= len(chunk)


def test_interrupted_upload_leaves_no_partial_object_and_a_rerun_completes(tmp_path, layout):
    repo = sample_repo(tmp_path)
    for i in range(12):
        write(repo / "blobs" / f"b{i}.bin", os.urandom(300_000))
    cut = CutAfter(1_500_000, env=local_python_first())
    with pytest.raises(RemoteError, match="snap-put failed"):
        make_snapshot(cut, layout, repo)
    landed = objects_are_sound(layout)
    assert 0 < landed < 18
    assert leftover_temps(layout) == []
    assert not Path(layout.snapshots).exists() or not any(Path(layout.snapshots).iterdir())
    result = make_snapshot(LocalTransport(env=local_python_first()), layout, repo)
    assert result.created and result.new_objects == 18 - landed
    paths = [str(p.relative_to(repo)) for p in (repo / "blobs").iterdir()] + ["train.py", "run.sh", "link"]
    snap_state = tree_state(Path(result.remote_path))
    assert {k: snap_state[k] for k in paths} == expected_state(repo, paths)
    objects_are_sound(layout)


def test_file_changing_while_sent_is_refused_not_stored(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    write(repo / "grows.log", "a" * 1000)

    def edit_between_query_and_upload(_summary: str) -> None:
        write(repo / "grows.log", "b" * 1000)  # same size, other content

    with pytest.raises(RemoteError, match=r"changed while being sent: grows\.log"):
        make_snapshot(transport, layout, repo, on_summary=edit_between_query_and_upload)
    objects_are_sound(layout)
    assert not any(p.name.endswith(blob_id(b"a" * 1000)) for p in Path(layout.objects).rglob("*"))
    assert leftover_temps(layout) == []


# -- gc ----------------------------------------------------------------------------------------


@pytest.fixture
def fake_squeue(tmp_path) -> Path:
    """`squeue` that prints what the test writes into the returned file (or fails if it holds FAIL)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    out = tmp_path / "squeue.out"
    out.write_text("")
    script = bindir / "squeue"
    script.write_text(
        f'#!/bin/sh\nif grep -q FAIL {out}; then echo "slurm_load_jobs error" >&2; exit 1; fi\ncat {out}\n'
    )
    script.chmod(0o755)
    return out


def gc_transport(tmp_path) -> LocalTransport:
    env = local_python_first()
    env["PATH"] = f"{tmp_path / 'fakebin'}:{env['PATH']}"
    return LocalTransport(env=env)


def snapshot_of(transport, layout, repo: Path, files: dict[str, str]):
    for name, content in files.items():
        write(repo / name, content)
    return make_snapshot(transport, layout, repo)


def backdate(layout: RemoteLayout, sid: str, days: float) -> None:
    t = time.time() - days * 86400
    os.utime(layout.snapshot_meta(sid), (t, t))


def fake_run(layout: RemoteLayout, run_id: str, name: str, snapshot: str, job: str, ended_days: float | None):
    """A run as the jobs leave it: run.json, its segment's job id, ENDED when it ended."""
    rdir = Path(layout.run_dir(run_id))
    (rdir / "seg").mkdir(parents=True)
    (rdir / "work").mkdir()
    (rdir / "work" / "train.py").write_text("a private copy\n" * 100)
    (rdir / "logs").mkdir()
    (rdir / "logs" / f"{job}.out").write_text("log line\n" * 1000)
    meta = {"name": name, "project": "proj", "snapshot": snapshot, "created": time.time() - 40 * 86400}
    (rdir / "run.json").write_text(json.dumps(meta))
    (rdir / "seg" / "1.job").write_text(job + "\n")
    if ended_days is not None:
        end = time.time() - ended_days * 86400
        (rdir / "ENDED").write_text(json.dumps({"reason": "finished", "exit_code": 0, "end": end}))
    ckpt = Path(layout.checkpoint_dir("proj", name))
    ckpt.mkdir(parents=True)
    (ckpt / "state.bin").write_bytes(os.urandom(20000))
    old = time.time() - 40 * 86400
    os.utime(ckpt / "state.bin", (old, old))
    os.utime(ckpt, (old, old))


def du(path: str) -> int:
    """Bytes on disk under path, each inode once (what `du -s -B1` counts)."""
    seen, total = set(), 0
    for dirpath, dirs, files in os.walk(path):
        for name in [*dirs, *files, "."] if dirpath == path else [*dirs, *files]:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def test_gc_keeps_live_and_recent_runs_and_frees_exactly_what_it_reports(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    repo = new_repo(tmp_path / "repo", {"shared.txt": "in every snapshot\n"})
    live = snapshot_of(t, layout, repo, {"v.txt": "live run\n"})
    done = snapshot_of(t, layout, repo, {"v.txt": "finished run\n"})
    old = snapshot_of(t, layout, repo, {"v.txt": "old, unused\n"})
    young = snapshot_of(t, layout, repo, {"v.txt": "recent\n"})
    for sid in (live.id, done.id, old.id):
        backdate(layout, sid, 30)
    fake_run(layout, "live0001", "still-going", live.id, "101", ended_days=None)
    fake_run(layout, "done0001", "finished", done.id, "102", ended_days=20)
    fake_run(layout, "new00001", "just-ended", young.id, "103", ended_days=1)
    fake_squeue.write_text("101|RUNNING|None\n555_[1-3]|PENDING|Priority\n")  # 101 running, an array pending

    def files_but_locks() -> dict:
        # The store lock's file holds a note of its last holder (to name it when busy): not data.
        return {k: v for k, v in tree_state(Path(layout.root)).items() if not k.endswith(".lock")}

    listing = files_but_locks()
    dry = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=True, dry_run=True)
    assert files_but_locks() == listing  # a dry run changes nothing
    before = du(layout.root)
    assert [r["run_id"] for r in dry["runs_removed"]] == ["done0001"]
    assert sorted(r["id"] for r in dry["removed"]) == sorted([done.id, old.id])

    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=True, dry_run=False)
    after = du(layout.root)
    assert report["bytes_freed"] == before - after == dry["bytes_freed"]  # measured, and exact
    assert [r["run_id"] for r in report["runs_removed"]] == ["done0001"]
    assert [(c["project"], c["name"]) for c in report["checkpoints_removed"]] == [("proj", "finished")]
    kept = {k["run_id"]: k["why"] for k in report["runs_kept"]}
    assert kept == {"live0001": "live (job 101)", "new00001": "ended 1d ago"}
    assert sorted(r["id"] for r in report["removed"]) == sorted([done.id, old.id])
    assert not Path(layout.run_dir("done0001")).exists()
    assert (Path(layout.run_dir("live0001")) / "work" / "train.py").exists()  # the live run stays whole
    assert Path(layout.checkpoint_dir("proj", "still-going")).exists()
    assert (Path(live.remote_path) / "v.txt").read_text() == "live run\n"
    assert (Path(young.remote_path) / "shared.txt").read_text() == "in every snapshot\n"
    kept_oids = {blob_id(b"in every snapshot\n"), blob_id(b"live run\n"), blob_id(b"recent\n")}
    assert {p.name for p in Path(layout.objects).glob("*/*")} == kept_oids
    # A snapshot made again after gc is rebuilt from scratch, correctly.
    again = snapshot_of(t, layout, repo, {"v.txt": "old, unused\n"})
    assert again.id == old.id and again.created


def test_gc_removes_runtime_files_only_when_no_run_sources_them(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    runtime = Path(layout.runtime)
    runtime.mkdir(parents=True)
    names = {
        "live": "job-" + "a" * 16 + ".sh",
        "done": "job-" + "b" * 16 + ".sh",
        "young": "job-" + "c" * 16 + ".sh",
    }
    for name in names.values():
        (runtime / name).write_text("# a runtime\n")
        if name != names["young"]:
            os.utime(runtime / name, (time.time() - 86400,) * 2)
    fake_run(layout, "live0001", "still-going", "nosnapshot", "101", ended_days=None)
    fake_run(layout, "done0001", "finished", "nosnapshot", "102", ended_days=20)
    for run_id, which in (("live0001", "live"), ("done0001", "done")):
        script = f". {layout.runtime_file(names[which])}\n"
        (Path(layout.run_dir(run_id)) / "job.sbatch").write_text(script)
    fake_squeue.write_text("101|RUNNING|None\n")
    dry = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=True)
    assert dry["runtime_removed"] == [names["done"]] and (runtime / names["done"]).exists()
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    # The live run's runtime stays, the removed run's goes, a new one (a submit in progress) stays.
    assert report["runtime_removed"] == [names["done"]]
    assert sorted(p.name for p in runtime.iterdir()) == sorted([names["live"], names["young"]])


def test_gc_keeps_checkpoints_without_the_flag(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    fake_run(layout, "done0001", "finished", "nosnapshot", "102", ended_days=20)
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert [r["run_id"] for r in report["runs_removed"]] == ["done0001"]
    assert report["checkpoints_removed"] == [] and Path(layout.checkpoint_dir("proj", "finished")).exists()


def test_gc_removes_nothing_when_squeue_fails(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    repo = new_repo(tmp_path / "repo")
    snap = make_snapshot(t, layout, repo)
    backdate(layout, snap.id, 30)
    fake_run(layout, "done0001", "finished", snap.id, "102", ended_days=20)
    fake_squeue.write_text("FAIL")
    with pytest.raises(RemoteError, match=r"squeue failed"):
        collect_garbage(t, layout.root, older_than=0, checkpoints=True, dry_run=False)
    assert Path(snap.remote_path).exists() and Path(layout.run_dir("done0001")).exists()


def test_gc_grace_protects_a_submission_in_progress(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    snap = make_snapshot(t, layout, new_repo(tmp_path / "repo"))
    report = collect_garbage(t, layout.root, older_than=0, checkpoints=False, dry_run=False)
    assert report["removed"] == [] and Path(snap.remote_path).exists()


def test_delta_against_a_base_whose_tree_is_gone_checks_every_object(tmp_path, transport, layout):
    # A manifest left behind without its tree (a build that died, a half-finished gc) must not be
    # trusted to vouch for objects: they may be gone.
    repo = sample_repo(tmp_path)
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    subprocess.run(["chmod", "-R", "u+w", layout.snapshot(first.id)], check=True)
    shutil.rmtree(layout.snapshot(first.id))
    shutil.rmtree(layout.objects)
    write(repo / "train.py", "print('third')\n")
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert second.created and second.new_objects == 6  # every distinct blob again
    assert (
        tree_state(Path(second.remote_path))["lib/util.py"]
        == expected_state(repo, ["lib/util.py"])["lib/util.py"]
    )


def test_file_systems_without_hard_links_get_copies(tmp_path, monkeypatch):
    # The agent's own functions, called in-process, with os.link failing as on a FS that refuses it.
    import errno

    from rv.agent import manifest, store

    root = str(tmp_path / "store").encode()
    for data in (b"plain", b"#!/bin/sh\n"):
        oid = blob_id(data)
        dest = store.object_path(root, oid)
        os.makedirs(os.path.dirname(dest))
        Path(os.fsdecode(dest)).write_bytes(data)
        os.chmod(dest, 0o444)
    os.makedirs(os.path.join(root, b"tmp"))

    def refuse(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(store.os, "link", refuse)
    text = manifest.manifest_text(
        [
            ["a.txt", manifest.MODE_FILE, blob_id(b"plain"), 5],
            ["bin/run", manifest.MODE_EXEC, blob_id(b"#!/bin/sh\n"), 10],
        ]
    )
    sid = manifest.text_id(text)
    assert store.build_snapshot(root, sid, text, {}) == "created"
    snap = Path(os.fsdecode(store.snapshot_dir(root, sid)))
    assert (snap / "a.txt").read_bytes() == b"plain" and (snap / "a.txt").stat().st_nlink == 1
    # Private by default (the agent's umask is 077 unless the profile shares with the group).
    assert stat.S_IMODE((snap / "a.txt").stat().st_mode) == 0o400
    assert stat.S_IMODE((snap / "bin/run").stat().st_mode) == 0o500


def test_a_local_error_abandons_the_early_query_cleanly(tmp_path, transport, layout):
    # make_snapshot starts its first remote command before listing; a file over the limit must still
    # fail with the size message, and the abandoned command must leave nothing behind.
    repo = sample_repo(tmp_path)
    write(repo / "weights.bin", b"\0" * 5000)
    with pytest.raises(UsageError, match=r"weights\.bin"):
        make_snapshot(transport, layout, repo, max_file_size=1000)
    assert len(transport.calls) == 1 and "snap-put" in transport.calls[0]
    assert not Path(layout.snapshots).exists()
    assert leftover_temps(layout) == []


def test_a_remote_file_system_error_names_the_path(tmp_path, transport):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the remote root's parent should be")
    repo = sample_repo(tmp_path)
    # Issue 33: the message began with rv's internal step, "remote snap-put: "; now the words alone.
    with pytest.raises(RemoteError, match=r"^Not a directory: .*/not-a-folder/root$") as err:
        make_snapshot(transport, RemoteLayout(str(blocker / "root")), repo)
    assert err.value.hint


# -- layers ------------------------------------------------------------------------------------


def listed_paths(repo: Path) -> list[str]:
    return [e.path for e in prepare_snapshot(repo).tree.entries]


def folders(root: Path) -> set[str]:
    return {str(Path(d).relative_to(root)) for d, _dirs, _files in os.walk(root) if Path(d) != root}


def test_a_layer_makes_the_same_work_dir_as_a_full_snapshot_whatever_changed(tmp_path, transport, layout):
    repo = new_repo(tmp_path / "repo", {"a/b/c.txt": "c\n", "a/keep.txt": "keep\n", "d/x.txt": "x\n",
                                        "f/deep/g.txt": "the only file under f\n"})  # fmt: skip
    write(repo / "e.sh", "#!/bin/sh\n", 0o755)
    (repo / "lnk").symlink_to("a")
    for i in range(300):
        write(repo / "many" / f"f{i}.txt", f"{i}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "all")
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert first.base is None and first.remote_path == layout.snapshot(first.id)
    # Every kind of change a layer has to express:
    write(repo / "a/keep.txt", "kept, edited\n")  # content
    (repo / "f/deep/g.txt").unlink()  # the last file of two folders
    shutil.rmtree(repo / "d")
    write(repo / "d", "a file where a folder was\n")  # folder -> file
    (repo / "e.sh").unlink()
    (repo / "e.sh").symlink_to("a/keep.txt")  # file -> symlink
    (repo / "lnk").unlink()
    write(repo / "lnk/inner.txt", "a folder where a symlink was\n")  # symlink -> folder
    (repo / "a/b/c.txt").chmod(0o755)  # mode only
    write(repo / "new/dir/file.txt", "new\n")  # new folders
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert second.base == first.id and Path(layout.snapshot_layer(second.id)).is_dir()
    assert not Path(layout.snapshot(second.id)).exists()
    # The layer keeps its whole manifest too: the next layer starts from it.
    assert Path(layout.snapshot(second.id) + ".manifest").read_bytes() == prepare_snapshot(repo).tree.manifest
    work = job_copy(layout, second.id, tmp_path / "w2")
    paths = listed_paths(repo)
    assert tree_state(work) == expected_state(repo, paths)
    # No folder the new tree lacks (f/ and f/deep/ went with their last file; d/ became a file).
    assert folders(work) == {str(q) for p in paths for q in Path(p).parents if str(q) != "."}
    # The next layer sits on that layer, holding only what changed since it.
    write(repo / "a/keep.txt", "keep\n")  # back as in the first snapshot
    write(repo / "many/f1.txt", "third\n")
    third = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert third.base == second.id
    assert tree_state(job_copy(layout, third.id, tmp_path / "w3")) == expected_state(repo, listed_paths(repo))
    meta = json.loads(Path(layout.snapshot_meta(third.id)).read_text())
    assert sorted(r[0] for r in meta["layer"]["upsert"]) == ["a/keep.txt", "many/f1.txt"]
    assert meta["layer"]["remove"] == [] and meta["depth"] == 2
    # Permissions: the layer is as private and read-only as a full snapshot.
    layer = Path(layout.snapshot_layer(third.id))
    assert (
        stat.S_IMODE(layer.stat().st_mode) == 0o500
        and stat.S_IMODE((layer / "remove").stat().st_mode) == 0o400
    )
    assert stat.S_IMODE((layer / "tree/many/f1.txt").stat().st_mode) == 0o400
    # Past the share of files a layer may hold, the snapshot is a full tree again.
    for i in range(300):
        write(repo / "many" / f"f{i}.txt", f"rewritten {i}\n")
    fourth = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert fourth.base is None and fourth.remote_path == layout.snapshot(fourth.id)
    assert tree_state(Path(fourth.remote_path)) == expected_state(repo, listed_paths(repo))


def expected_folders(repo: Path) -> set[str]:
    return {str(q) for p in listed_paths(repo) for q in Path(p).parents if str(q) != "."}


def test_layers_stack_up_to_a_bound_and_each_makes_the_right_work_dir(tmp_path, transport, layout):
    # A resubmit's layer holds what changed since the snapshot before it, however much is uncommitted,
    # so a job applies a chain of them; past LAYER_DEPTH the next is one layer over the full snapshot.
    repo = new_repo(tmp_path / "repo", {**{f"src/f{i}.txt": f"{i}\n" for i in range(40)}, "d/x.txt": "x\n"})
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    edits = [
        lambda: write(repo / "src/f0.txt", "edited\n"),
        lambda: (repo / "src/f1.txt").unlink(),
        lambda: (shutil.rmtree(repo / "d"), write(repo / "d", "a file where a folder was\n")),
        lambda: ((repo / "d").unlink(), write(repo / "d/y.txt", "a folder again\n")),
        lambda: write(repo / "new/a/b.txt", "new folders\n"),
        lambda: (shutil.rmtree(repo / "new"), write(repo / "top.txt", "t\n")),  # folders go with their file
        lambda: (repo / "src/f2.txt").chmod(0o755),
        lambda: write(repo / "src/f0.txt", "0\n"),  # back as in the first snapshot
    ]
    assert len(edits) == LAYER_DEPTH
    below = first
    for depth, edit in enumerate(edits, start=1):
        edit()
        snap = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
        meta = json.loads(Path(layout.snapshot_meta(snap.id)).read_text())
        assert (snap.base, meta["depth"]) == (below.id, depth)
        assert len(meta["layer"]["upsert"]) + len(meta["layer"]["remove"]) <= 2  # this edit only
        work = job_copy(layout, snap.id, tmp_path / f"w{depth}")
        assert tree_state(work) == expected_state(repo, listed_paths(repo)), f"layer {depth}"
        assert folders(work) == expected_folders(repo), f"layer {depth}"
        below = snap
    # The chain is full: the next layer sits on the full snapshot, holding all that differs from it.
    write(repo / "src/f3.txt", "edited\n")
    merged = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    meta = json.loads(Path(layout.snapshot_meta(merged.id)).read_text())
    assert (merged.base, meta["depth"]) == (first.id, 1)
    assert sorted(r[0] for r in meta["layer"]["upsert"]) == ["d/y.txt", "src/f2.txt", "src/f3.txt", "top.txt"]
    assert meta["layer"]["remove"] == ["d/x.txt", "src/f1.txt"]
    assert tree_state(job_copy(layout, merged.id, tmp_path / "m")) == expected_state(repo, listed_paths(repo))
    # ... and the one after it on that layer again.
    write(repo / "src/f4.txt", "edited\n")
    after = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert after.base == merged.id
    assert tree_state(job_copy(layout, after.id, tmp_path / "wa")) == expected_state(repo, listed_paths(repo))


def remove_snapshot(layout: RemoteLayout, sid: str) -> None:
    for path in Path(layout.snapshots).glob(f"{sid}*"):
        if path.is_dir():
            subprocess.run(["chmod", "-R", "u+w", str(path)], check=True)
            shutil.rmtree(path)
        else:
            path.unlink()


def test_a_layer_whose_chain_lost_a_link_is_no_base(tmp_path, transport, layout):
    # Only a person (or an older rv's gc, which kept one level) removes a snapshot under a layer: a
    # layer over it would make jobs that fail, so the client is asked for the full list instead.
    repo = new_repo(tmp_path / "repo", {f"f{i}.txt": f"{i}\n" for i in range(40)})
    cache_dir = tmp_path / "cache"
    make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "f1.txt", "one\n")
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "f2.txt", "two\n")
    third = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert third.base == second.id
    remove_snapshot(layout, second.id)
    write(repo / "f3.txt", "three\n")
    fourth = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert fourth.base is None and fourth.remote_path == layout.snapshot(fourth.id)
    assert tree_state(job_copy(layout, fourth.id, tmp_path / "w")) == expected_state(repo, listed_paths(repo))


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_a_layer_without_a_sound_manifest_file_still_serves_as_a_base(tmp_path, transport, layout, damage):
    # Layers of an earlier rv have no manifest file (they are spliced from the base's); a damaged one
    # must cost time, never a wrong tree.
    repo = new_repo(tmp_path / "repo", {f"f{i}.txt": f"{i}\n" for i in range(40)})
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "f1.txt", "one\n")
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert second.base == first.id
    kept = Path(layout.snapshot(second.id) + ".manifest")
    if damage == "missing":
        kept.unlink()
    else:
        kept.chmod(0o600)
        kept.write_bytes(kept.read_bytes().replace(b"f1.txt", b"f9.txt", 1))
    write(repo / "f2.txt", "two\n")
    third = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert tree_state(job_copy(layout, third.id, tmp_path / "w")) == expected_state(repo, listed_paths(repo))
    if damage == "missing":  # spliced from the base's manifest, as before: a layer again
        assert third.base == second.id
        meta = json.loads(Path(layout.snapshot_meta(third.id)).read_text())
        assert [r[0] for r in meta["layer"]["upsert"]] == ["f2.txt"]
    else:  # the id check failed, the client sent the full list: a full tree, built right
        assert third.base is None


def test_gc_keeps_every_snapshot_under_a_kept_layer(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    repo = new_repo(tmp_path / "repo", {f"f{i}.txt": f"{i}\n" for i in range(20)})
    cache_dir = tmp_path / "cache"
    chain = [make_snapshot(t, layout, repo, cache_dir=cache_dir)]
    for i in range(3):
        write(repo / f"f{i}.txt", f"layer {i}\n")
        chain.append(make_snapshot(t, layout, repo, cache_dir=cache_dir))
        assert chain[-1].base == chain[-2].id
    for snap in chain[:-1]:
        backdate(layout, snap.id, 30)
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert report["removed"] == []
    reasons = {k["id"]: k["reason"] for k in report["kept"]}
    for below, above in itertools.pairwise(chain):
        assert reasons[below.id] == f"the base of kept layer {above.id}"
    top = job_copy(layout, chain[-1].id, tmp_path / "w")
    assert tree_state(top) == expected_state(repo, listed_paths(repo))
    backdate(layout, chain[-1].id, 30)
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert sorted(r["id"] for r in report["removed"]) == sorted(s.id for s in chain)
    assert sorted(p.name for p in Path(layout.snapshots).iterdir()) == []
    assert not any(Path(layout.objects).glob("*/*"))


def test_snapshots_of_the_earlier_format_are_still_used_by_jobs_and_collected(tmp_path, layout, fake_squeue):
    # Stores written by rv 0.1 hold full trees whose meta file lists the entries (version 1).
    t = gc_transport(tmp_path)
    repo = new_repo(tmp_path / "repo", {"a.txt": "old store\n"})
    new = make_snapshot(t, layout, repo)  # objects and folders exist; make an old-format twin of it
    old_id = "0123456789abcdef01234567"
    subprocess.run(["cp", "-a", layout.snapshot(new.id), layout.snapshot(old_id)], check=True)
    rows = [["a.txt", 0o100644, blob_id(b"old store\n"), 10]]
    Path(layout.snapshot_meta(old_id)).write_text(json.dumps({"version": 1, "id": old_id, "entries": rows}))
    assert tree_state(job_copy(layout, old_id, tmp_path / "w")) == expected_state(repo, ["a.txt"])
    subprocess.run(["chmod", "-R", "u+w", layout.snapshot(new.id)], check=True)
    shutil.rmtree(layout.snapshot(new.id))
    os.unlink(layout.snapshot_meta(new.id))
    os.unlink(Path(layout.snapshot(new.id + ".manifest")))
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert report["removed"] == [] and report["objects_removed"] == 0  # its entries keep its objects
    backdate(layout, old_id, 30)
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert [r["id"] for r in report["removed"]] == [old_id] and report["objects_removed"] == 1


# What a delta may add to the changed files' bytes: per object its frame (tag, 20-byte id, 8-byte
# size) and its manifest row (path, mode, id, size; zlib-compressed JSON, ~70 B for the paths
# below); per call the header's id and base, the provenance frame (no diff: the edits are
# committed) and the end tag.
FRAMING_PER_FILE = 29 + 80
FRAMING_PER_CALL = 2048


@pytest.mark.parametrize("edited", [1, 40, 400])
def test_an_edit_of_n_files_sends_their_bytes_plus_bounded_framing_in_one_round_trip(
    tmp_path, transport, layout, edited
):
    files = {f"src/pkg{i % 9}/mod_{i:04d}.py": f"# module {i}\n" + "x = 1\n" * (i % 50) for i in range(1000)}
    repo = new_repo(tmp_path / "repo", files)
    cache_dir = tmp_path / "cache"
    make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    names = sorted(files)[:: 1000 // edited][:edited]
    for name in names:
        with open(repo / name, "a") as fh:
            fh.write(f"y = {name!r}\n" * 20)
    git(repo, "commit", "-qam", "edits")
    changed = sum((repo / name).stat().st_size for name in names)
    transport.calls.clear()
    result = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert len(transport.calls) == 1  # the objects went with the manifest, unasked
    assert (result.new_objects, result.new_bytes) == (edited, changed)
    framing = result.sent_bytes - result.new_bytes
    assert 0 < framing <= edited * FRAMING_PER_FILE + FRAMING_PER_CALL, framing
    work = job_copy(layout, result.id, tmp_path / "work")
    assert all((work / name).read_bytes() == (repo / name).read_bytes() for name in names)


class DropLast(LocalTransport):
    """Delivers the second snap-put stream (the one with the objects) without its last chunk (the
    provenance frame), then closes stdin."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.puts = 0

    def run(self, command, *, stdin=None, timeout=None):
        if "snap-put" in command:
            self.puts += 1
            if self.puts == 2:
                stdin = self._all_but_last(stdin)
        return super().run(command, stdin=stdin, timeout=timeout)

    @staticmethod
    def _all_but_last(chunks):
        held = None
        for chunk in chunks:
            if held is not None:
                yield held
            held = chunk


def test_a_client_gone_before_the_provenance_leaves_objects_but_no_snapshot(tmp_path, layout):
    # The cluster builds the tree while the client still makes the provenance (it follows the
    # objects); a client gone before sending it must leave no snapshot and no build folder.
    repo = sample_repo(tmp_path)
    with pytest.raises(RemoteError, match="snap-put failed"):
        make_snapshot(DropLast(env=local_python_first()), layout, repo)
    assert objects_are_sound(layout) == 7
    snapshots = Path(layout.snapshots)
    assert not snapshots.exists() or not [p for p in snapshots.iterdir() if p.is_dir()]
    assert leftover_temps(layout) == []
    result = make_snapshot(LocalTransport(env=local_python_first()), layout, repo)
    assert result.created and result.new_objects == 0
    assert json.loads(Path(result.meta_path).read_text())["provenance"]["dirty"] is True
