"""The content-addressed store end to end through LocalTransport (the agent runs as a real subprocess).

Each test's "cluster" is a temp folder: the agent (rv.agent) runs in python3 exactly as it
would over SSH, reading the same stdin stream.
"""

from __future__ import annotations

import hashlib
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

from rv.agent import common as agent_common
from rv.agent import store as agent_store
from rv.errors import RemoteError, UsageError
from rv.files import packs
from rv.files.link import LinkRate
from rv.files.listing import blob_id
from rv.files.snapshot import make_snapshot, prepare_snapshot, upload_snapshot
from rv.files.treecache import StoreCache
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


def store_git(layout: RemoteLayout, *args: str, check: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    proc = subprocess.run(["git", "--git-dir", layout.store, *args], env=env, capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc.stdout


def store_is_sound(layout: RemoteLayout) -> int:
    """git's own check of every object in the store; returns how many blobs it holds."""
    if not Path(layout.store, "objects").is_dir():
        return 0
    store_git(layout, "fsck", "--no-dangling", "--no-progress")
    return len(stored_blobs(layout))


def stored_blobs(layout: RemoteLayout) -> set[str]:
    out = store_git(layout, "cat-file", "--batch-all-objects", "--batch-check=%(objecttype) %(objectname)")
    return {line.split()[1] for line in out.splitlines() if line.startswith("blob ")}


def snapshot_refs(layout: RemoteLayout) -> dict[str, str]:
    if not Path(layout.store, "objects").is_dir():
        return {}
    out = store_git(layout, "for-each-ref", "--format=%(refname) %(objectname)", "refs/rv/snapshots/")
    return {line.split()[0].rsplit("/", 1)[1]: line.split()[1] for line in out.splitlines()}


def packs_in(layout: RemoteLayout) -> list[str]:
    return sorted(p.name for p in Path(layout.store, "objects", "pack").glob("pack-*.pack"))


def job_copy(layout: RemoteLayout, sid: str, dest: Path) -> Path:
    """The work dir a job makes of snapshot ``sid``, by the job script's own lines."""
    script = "set -euo pipefail\n" + work_dir_script(layout, sid)
    subprocess.run(["bash", "-c", script], env={**os.environ, "RV_WORK_DIR": str(dest)}, check=True)
    return dest


def leftover_temps(layout: RemoteLayout) -> list[str]:
    """What an upload leaves while it runs: quarantines, index-pack's temp files, temp files."""
    store = Path(layout.store)
    found = [p.name for p in store.glob("rv-incoming-*")] + [p.name for p in store.glob("objects/pack/tmp_*")]
    tmp = Path(layout.tmp)
    return sorted(found + ([p.name for p in tmp.iterdir()] if tmp.exists() else []))


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
    assert result.created and result.remote_path == layout.store
    want = expected_state(
        repo, ["train.py", "lib/util.py", "run.sh", "same_as_run.sh", "empty", "link", "odd name #1 'q\".txt"]
    )
    assert tree_state(job_copy(layout, result.id, tmp_path / "work")) == want
    # The snapshot is a commit of the store, held by its ref, its files the commit's tree.
    assert snapshot_refs(layout) == {result.id: result.snapshot_commit}
    assert result.ref == f"refs/rv/snapshots/{result.id}"
    listed = store_git(layout, "ls-tree", "-r", "-z", "--name-only", result.snapshot_commit).split("\0")
    assert sorted(p for p in listed if p) == sorted(want)
    meta = json.loads(Path(result.meta_path).read_text())
    assert meta["id"] == result.id and meta["provenance"]["dirty"] is True
    assert meta["commit"] == result.snapshot_commit
    assert "+print('edited')" in meta["provenance"]["diff"]
    assert summaries == [result.summary]
    assert summaries[0].startswith(f"snapshot {result.id[:12]}: 7 files, ")
    assert "6 new objects" in summaries[0]  # run.sh and same_as_run.sh share one blob
    assert store_is_sound(layout) == 6
    assert leftover_temps(layout) == []


def test_a_first_upload_sends_small_objects_in_gits_packs_and_large_blobs_whole(tmp_path, transport, layout):
    # Small objects go through pack-objects and index-pack; blobs from WHOLE_MIN_BYTES go whole and
    # the agent writes their pack: one upload makes both, and git finds the store sound.
    repo = sample_repo(tmp_path)
    large = {f"data/big{i}.bin": os.urandom(packs.WHOLE_MIN_BYTES + i) for i in range(3)}
    for rel, data in large.items():
        write(repo / rel, data)
    write(repo / "data/just_under.bin", os.urandom(packs.WHOLE_MIN_BYTES - 1))
    result = make_snapshot(transport, layout, repo)
    assert result.created
    assert len(packs_in(layout)) == 3  # the commit and trees; the small blobs; the large ones
    paths = [*large, "data/just_under.bin", "train.py", "run.sh", "link", "empty"]
    snap_state = tree_state(job_copy(layout, result.id, tmp_path / "work"))
    assert {k: snap_state[k] for k in paths} == expected_state(repo, paths)
    assert store_is_sound(layout) == 10
    assert leftover_temps(layout) == []


def test_the_same_files_make_the_same_commit_whoever_builds_it(tmp_path, transport, layout):
    # The commit is a function of the tree: rv's repository on another machine (another cache
    # folder) makes the same one, so a store holds each snapshot once.
    repo = sample_repo(tmp_path)
    one = make_snapshot(transport, layout, repo, cache_dir=tmp_path / "c1")
    two = make_snapshot(transport, layout, repo, cache_dir=tmp_path / "c2")
    three = make_snapshot(transport, layout, repo)  # a temporary repository of rv's own
    assert one.snapshot_commit == two.snapshot_commit == three.snapshot_commit
    assert (one.created, two.created, three.created) == (True, False, False)
    # The user's repository is never written: its objects and index are as they were.
    before = sorted(p.name for p in (repo / ".git" / "objects").rglob("*"))
    write(repo / "new.txt", "untracked and new\n")
    make_snapshot(transport, layout, repo, cache_dir=tmp_path / "c1")
    assert sorted(p.name for p in (repo / ".git" / "objects").rglob("*")) == before


def test_unchanged_resnapshot_is_one_round_trip(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    transport.calls.clear()
    again = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert len(transport.calls) == 1
    assert (again.id, again.created, again.new_objects) == (first.id, False, 0)
    assert "already on the cluster" in again.summary


def test_one_changed_file_sends_only_that_file_in_one_round_trip(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    for i in range(300):
        write(repo / "many" / f"f{i}.txt", f"file {i}\n" * 50)
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    packs_before = packs_in(layout)
    write(repo / "many/f7.txt", "changed\n")
    transport.calls.clear()
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert (second.new_objects, second.new_bytes) == (1, len("changed\n"))
    assert len(transport.calls) == 1  # the new objects went with the first call, unasked
    # One thin pack: the blob and the two trees above it, a fraction of the 300-entry list.
    full_manifest = frame({"entries": [e.row() for e in prepare_snapshot(repo).tree.entries]})
    assert second.sent_bytes < len(full_manifest) / 4
    assert len(packs_in(layout)) == len(packs_before) + 1
    work = job_copy(layout, second.id, tmp_path / "work")
    assert (work / "many/f7.txt").read_text() == "changed\n"
    assert tree_state(work) == tree_state(job_copy(layout, first.id, tmp_path / "w1")) | {
        "many/f7.txt": tree_state(work)["many/f7.txt"]
    }


def test_an_edits_blobs_go_whole_and_its_trees_as_deltas(tmp_path, transport, layout):
    # A fast link: no delta search for an edit's files (here and on the cluster); its trees still
    # go as deltas against the snapshot the store holds (a 300-file folder costs a few bytes).
    repo = sample_repo(tmp_path)
    for i in range(300):
        write(repo / "many" / f"f{i}.txt", f"file {i}\n" * 50)
    big = "".join(f"line {i} of a long file\n" for i in range(5000))
    write(repo / "many/big.txt", big)
    cache_dir = tmp_path / "cache"
    make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "many/big.txt", big + "one more line\n")
    second = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    size = len(big) + len("one more line\n")
    assert (second.new_objects, second.new_bytes) == (1, size)
    assert size < second.sent_bytes < size + 4000  # the file whole; the folder's 300 entries a delta
    assert (
        (job_copy(layout, second.id, tmp_path / "w") / "many/big.txt").read_text().endswith("one more line\n")
    )
    # A slow link (measured by an earlier upload): the file as a delta too.
    LinkRate(cache_dir, layout.root).write(1 << 20, 1.0)
    write(repo / "many/big.txt", big + "two more lines\n\n")
    third = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert third.new_objects == 1 and third.sent_bytes < size / 4
    assert (job_copy(layout, third.id, tmp_path / "w3") / "many/big.txt").read_text().endswith("lines\n\n")
    assert store_is_sound(layout) > 0


def test_a_base_the_store_does_not_have_costs_calls_never_a_wrong_snapshot(tmp_path, transport, layout):
    # This machine believes the store holds a snapshot it never had (another store's cache, a store
    # emptied by hand): the thin pack's deltas cannot be resolved, or what it left out is missing;
    # either way the store says so and the whole snapshot arrives.
    repo = sample_repo(tmp_path)
    cache_dir = tmp_path / "cache"
    elsewhere = RemoteLayout(str(tmp_path / "elsewhere"))
    other = make_snapshot(transport, elsewhere, repo, cache_dir=cache_dir)
    project = prepare_snapshot(repo).project
    StoreCache(cache_dir, layout.root).add(project, other.id, other.snapshot_commit)
    write(repo / "extra.txt", "x")
    transport.calls.clear()
    result = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert result.created and (job_copy(layout, result.id, tmp_path / "w") / "extra.txt").read_text() == "x"
    assert 2 <= len(transport.calls) <= 4
    assert store_is_sound(layout) == 7
    assert StoreCache(cache_dir, layout.root).known(project)[0] == result.id


def test_later_edits_do_not_change_a_snapshot(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    first = make_snapshot(transport, layout, repo)
    before = tree_state(job_copy(layout, first.id, tmp_path / "w1"))
    write(repo / "train.py", "print('after submission')\n")
    (repo / "run.sh").chmod(0o644)
    second = make_snapshot(transport, layout, repo)
    assert second.id != first.id
    assert tree_state(job_copy(layout, first.id, tmp_path / "w1b")) == before
    assert (
        job_copy(layout, second.id, tmp_path / "w2") / "train.py"
    ).read_text() == "print('after submission')\n"


class CutAfter(LocalTransport):
    """Delivers only the first ``limit`` bytes of each snap-put stream, then closes stdin: a dropped link."""

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


def test_interrupted_upload_leaves_no_partial_pack_and_a_rerun_sends_only_what_is_missing(
    tmp_path, layout, monkeypatch
):
    # Packs of ~600 kB: the link drops in the third; the two before it are whole in the store.
    monkeypatch.setattr(packs, "CHUNK_BYTES", 600_000)
    repo = sample_repo(tmp_path)
    for i in range(12):
        write(repo / "blobs" / f"b{i}.bin", os.urandom(300_000))
    cut = CutAfter(1_500_000, env=local_python_first())
    with pytest.raises(RemoteError, match="snap-put failed"):
        make_snapshot(cut, layout, repo)
    landed = store_is_sound(layout)
    assert 0 < landed < 18
    assert leftover_temps(layout) == []
    assert snapshot_refs(layout) == {}  # no snapshot: its ref moves last
    result = make_snapshot(LocalTransport(env=local_python_first()), layout, repo)
    assert result.created and result.new_objects == 18 - landed
    paths = [str(p.relative_to(repo)) for p in (repo / "blobs").iterdir()] + ["train.py", "run.sh", "link"]
    snap_state = tree_state(job_copy(layout, result.id, tmp_path / "w"))
    assert {k: snap_state[k] for k in paths} == expected_state(repo, paths)
    assert store_is_sound(layout) == 18


def test_file_changing_while_sent_is_refused_not_stored(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    write(repo / "grows.log", "a" * 1000)

    def edit_after_listing(_snap) -> None:
        write(repo / "grows.log", "b" * 1000)  # same size, other content

    with pytest.raises(RemoteError, match=r"changed while being sent: grows\.log"):
        make_snapshot(transport, layout, repo, on_prepared=edit_after_listing)
    assert blob_id(b"a" * 1000) not in stored_blobs(layout) if Path(layout.store).exists() else True
    assert blob_id(b"b" * 1000) not in (stored_blobs(layout) if Path(layout.store).exists() else set())
    assert snapshot_refs(layout) == {}
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


def age_packs(layout: RemoteLayout, days: float) -> None:
    """Make the store's packs as old as a store used weeks ago (git prunes by a pack's age)."""
    t = time.time() - days * 86400
    for p in Path(layout.store, "objects", "pack").iterdir():
        os.utime(p, (t, t))


def test_gc_keeps_live_and_recent_runs_and_frees_exactly_what_it_reports(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    repo = new_repo(tmp_path / "repo", {"shared.txt": "in every snapshot\n"})
    live = snapshot_of(t, layout, repo, {"v.txt": "live run\n"})
    done = snapshot_of(t, layout, repo, {"v.txt": "finished run\n"})
    old = snapshot_of(t, layout, repo, {"v.txt": "old, unused\n"})
    young = snapshot_of(t, layout, repo, {"v.txt": "recent\n"})
    for sid in (live.id, done.id, old.id):
        backdate(layout, sid, 30)
    age_packs(layout, 30)
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
    # Two blobs and a tree and a commit each only the dropped snapshots reach.
    assert dry["objects_removed"] == 6 and dry["bytes_freed"] > 0

    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=True, dry_run=False)
    after = du(layout.root)
    assert report["bytes_freed"] == before - after  # measured, and exact
    assert [r["run_id"] for r in report["runs_removed"]] == ["done0001"]
    assert [(c["project"], c["name"]) for c in report["checkpoints_removed"]] == [("proj", "finished")]
    kept = {k["run_id"]: k["why"] for k in report["runs_kept"]}
    assert kept == {"live0001": "live (job 101)", "new00001": "ended 1d ago"}
    assert sorted(r["id"] for r in report["removed"]) == sorted([done.id, old.id])
    assert not Path(layout.run_dir("done0001")).exists()
    assert (Path(layout.run_dir("live0001")) / "work" / "train.py").exists()  # the live run stays whole
    assert Path(layout.checkpoint_dir("proj", "still-going")).exists()
    assert (job_copy(layout, live.id, tmp_path / "wl") / "v.txt").read_text() == "live run\n"
    assert (job_copy(layout, young.id, tmp_path / "wy") / "shared.txt").read_text() == "in every snapshot\n"
    assert sorted(snapshot_refs(layout)) == sorted([live.id, young.id])
    kept_oids = {blob_id(b"in every snapshot\n"), blob_id(b"live run\n"), blob_id(b"recent\n")}
    assert stored_blobs(layout) == kept_oids
    store_is_sound(layout)
    # A snapshot made again after gc is sent again from scratch, correctly.
    again = snapshot_of(t, layout, repo, {"v.txt": "old, unused\n"})
    assert again.id == old.id and again.created
    assert (job_copy(layout, again.id, tmp_path / "wa") / "v.txt").read_text() == "old, unused\n"


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
    assert snap.id in snapshot_refs(layout) and Path(layout.run_dir("done0001")).exists()


def test_gc_grace_protects_a_submission_in_progress(tmp_path, layout, fake_squeue):
    t = gc_transport(tmp_path)
    snap = make_snapshot(t, layout, new_repo(tmp_path / "repo"))
    report = collect_garbage(t, layout.root, older_than=0, checkpoints=False, dry_run=False)
    assert report["removed"] == [] and snap.id in snapshot_refs(layout)


def purge(layout: RemoteLayout, kinds: set[str]) -> list[str]:
    """Delete files of the store as a scratch filesystem's purge does (folders stay): ``pack`` (a
    pack and its index), ``idx`` (an index alone), ``pack-only`` (a pack without its index),
    ``ref`` (the snapshot refs' files), ``meta`` (the meta files)."""
    gone = []
    packs_ = sorted(Path(layout.store, "objects", "pack").glob("pack-*.pack"))
    for kind, victims in (
        ("pack", [p for p in packs_[:1]] + [p.with_suffix(".idx") for p in packs_[:1]]),
        ("idx", [p.with_suffix(".idx") for p in packs_[-1:]]),
        ("pack-only", packs_[-1:]),
        (
            "ref",
            [
                *list(Path(layout.store, "refs", "rv", "snapshots").glob("*")),
                Path(layout.store, "packed-refs"),
            ],
        ),
        ("meta", list(Path(layout.snapshots).glob("*.json"))),
    ):
        if kind in kinds:
            for p in victims:
                if p.exists():
                    p.unlink()
                    gone.append(p.name)
    return gone


@pytest.mark.parametrize(
    "kinds", [{"pack"}, {"idx"}, {"pack-only"}, {"ref", "meta"}, {"pack", "ref", "meta"}]
)
def test_a_store_that_lost_files_is_found_out_and_mended_by_the_next_upload(
    tmp_path, transport, layout, kinds
):
    # One check per upload: the store lists what the commit reaches and it lacks, and the laptop
    # sends exactly that (known as held, the snapshot would otherwise go unsent: one round trip).
    repo = sample_repo(tmp_path)
    for i in range(40):
        write(repo / "pkg" / f"m{i}.py", f"X = {i}\n")
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "pkg/m0.py", "X = 'second'\n")
    make_snapshot(transport, layout, repo, cache_dir=cache_dir)  # a second pack, thin
    write(repo / "pkg/m0.py", "X = 0\n")  # back to the first snapshot
    assert purge(layout, kinds)
    again = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert again.id == first.id
    assert tree_state(job_copy(layout, again.id, tmp_path / "w")) == expected_state(repo, listed_paths(repo))
    assert snapshot_refs(layout)[again.id] == again.snapshot_commit
    assert Path(layout.snapshot_meta(again.id)).exists()
    reached = store_git(layout, "rev-list", "--objects", "--missing=print", again.snapshot_commit)
    assert not [line for line in reached.splitlines() if line.startswith("?")]  # whole again
    # Nothing was missing the second time round: one call, nothing sent.
    transport.calls.clear()
    assert make_snapshot(transport, layout, repo, cache_dir=cache_dir).new_objects == 0
    assert len(transport.calls) == 1


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


# -- incremental builds ------------------------------------------------------------------------


def listed_paths(repo: Path) -> list[str]:
    return [e.path for e in prepare_snapshot(repo).tree.entries]


def folders(root: Path) -> set[str]:
    return {str(Path(d).relative_to(root)) for d, _dirs, _files in os.walk(root) if Path(d) != root}


def expected_folders(repo: Path) -> set[str]:
    return {str(q) for p in listed_paths(repo) for q in Path(p).parents if str(q) != "."}


def built_from_scratch(tmp_path: Path, repo: Path, name: str) -> str:
    """The commit of the repo's snapshot from a fresh repository of rv's own: nothing reused."""
    snap = prepare_snapshot(repo)
    return packs.open_local_store(tmp_path / name, snap.tree, snap.git).build(snap.tree)


def test_each_resubmit_makes_the_same_work_dir_as_a_full_snapshot_whatever_changed(
    tmp_path, transport, layout
):
    # rv's index is updated by the rows that changed: its tree must be the one a build from scratch
    # makes (the same commit), through every kind of change, and each makes the right work dir.
    repo = new_repo(tmp_path / "repo", {"a/b/c.txt": "c\n", "a/keep.txt": "keep\n", "d/x.txt": "x\n",
                                        "f/deep/g.txt": "the only file under f\n"})  # fmt: skip
    write(repo / "e.sh", "#!/bin/sh\n", 0o755)
    (repo / "lnk").symlink_to("a")
    for i in range(300):
        write(repo / "many" / f"f{i}.txt", f"{i}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "all")
    cache_dir = tmp_path / "cache"
    make_snapshot(transport, layout, repo, cache_dir=cache_dir)

    def everything_at_once() -> None:
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

    edits = [
        everything_at_once,
        lambda: write(repo / "a/keep.txt", "keep\n"),  # back as in the first snapshot
        lambda: ((repo / "d").unlink(), write(repo / "d/y.txt", "a folder again\n")),
        lambda: (shutil.rmtree(repo / "new"), write(repo / "top.txt", "t\n")),  # folders go with their file
        lambda: [write(repo / "many" / f"f{i}.txt", f"rewritten {i}\n") for i in range(300)],  # most files
    ]
    for n, edit in enumerate(edits):
        edit()
        snap = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
        assert snap.snapshot_commit == built_from_scratch(tmp_path, repo, f"scratch{n}"), f"edit {n}"
        work = job_copy(layout, snap.id, tmp_path / f"w{n}")
        assert tree_state(work) == expected_state(repo, listed_paths(repo)), f"edit {n}"
        assert folders(work) == expected_folders(repo), f"edit {n}"


def test_a_dry_run_between_two_uploads_still_builds_incrementally(tmp_path, transport, layout):
    # `rv run --dry-run` lists without sending: the next listing's changes are then against a
    # manifest rv's index does not hold, and the cached manifests bridge the two.
    repo = new_repo(tmp_path / "repo", {f"f{i}.txt": f"{i}\n" for i in range(50)})
    cache_dir = tmp_path / "cache"
    make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    write(repo / "f1.txt", "one\n")
    prepare_snapshot(repo, cache_dir=cache_dir)  # listed, never built
    write(repo / "f2.txt", "two\n")
    snap = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    assert snap.snapshot_commit == built_from_scratch(tmp_path, repo, "scratch")
    work = job_copy(layout, snap.id, tmp_path / "w")
    assert (work / "f1.txt").read_text() == "one\n" and (work / "f2.txt").read_text() == "two\n"


# What an edit may add to the changed files' bytes: per object its pack entry's header and zlib's
# frame (stored, level 0: ~15 B); the trees above the files (as deltas against the trees the store
# holds: tens of bytes each, at most the 11 folders here); per call the header, the commit, the
# pack's header and checksum, the frames and the provenance frame (no diff: the edits are committed).
# Deltas against the files' earlier versions may make a file cost less than its bytes.
FRAMING_PER_FILE = 29 + 80
FRAMING_PER_CALL = 4096


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
    assert len(transport.calls) == 1  # the objects went with the first call, unasked
    assert (result.new_objects, result.new_bytes) == (edited, changed)
    assert result.sent_bytes <= result.new_bytes + edited * FRAMING_PER_FILE + FRAMING_PER_CALL
    work = job_copy(layout, result.id, tmp_path / "work")
    assert all((work / name).read_bytes() == (repo / name).read_bytes() for name in names)


class DropLast(LocalTransport):
    """Delivers the second snap-put stream (the one with the blobs) without its last chunk (the
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
    # The cluster takes the packs in while the client still makes the provenance (it follows the
    # packs); a client gone before sending it must leave no snapshot, and no quarantine.
    repo = sample_repo(tmp_path)
    with pytest.raises(RemoteError, match="snap-put failed"):
        make_snapshot(DropLast(env=local_python_first()), layout, repo)
    assert store_is_sound(layout) == 6
    assert snapshot_refs(layout) == {} and not list(Path(layout.snapshots).glob("*.json"))
    assert leftover_temps(layout) == []
    result = make_snapshot(LocalTransport(env=local_python_first()), layout, repo)
    assert result.created and result.new_objects == 0
    assert json.loads(Path(result.meta_path).read_text())["provenance"]["dirty"] is True


# -- the store of the previous rv -----------------------------------------------------------------

PREVIOUS = "15a5cf5"  # the last commit whose store was one file per object and trees of hard links
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def previous_rv(tmp_path_factory) -> Path:
    """rv's package as it was at PREVIOUS, from this repository's history."""
    dest = tmp_path_factory.mktemp("rv-previous")
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", PREVIOUS, "rv"], capture_output=True)
    assert archive.returncode == 0, archive.stderr.decode()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def with_previous_rv(previous: Path, code: str, *args: str) -> str:
    """Run ``code`` with the previous rv importable (and its agent as `python3`)."""
    env = {**local_python_first(), "PYTHONPATH": str(previous)}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=previous
    )  # (not this checkout's folder: `python -c` finds the package in its working folder first)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


OLD_SNAPSHOT = """
import os, sys
from rv.layout import RemoteLayout
from rv.snapshot import make_snapshot
from rv.transport import LocalTransport
print(make_snapshot(LocalTransport(env=dict(os.environ)), RemoteLayout(sys.argv[1]), sys.argv[2]).id)
"""

OLD_WORK_DIR = """
import sys
from rv.layout import RemoteLayout
from rv.slurm.script import work_dir_script
print("set -euo pipefail\\n" + work_dir_script(RemoteLayout(sys.argv[1]), sys.argv[2]))
"""


def test_a_store_made_by_the_previous_rv_still_serves_its_jobs_and_is_collected(
    tmp_path, layout, fake_squeue, previous_rv
):
    # Read, not migrated: a job the previous rv queued copies its snapshot's folder by that rv's own
    # runtime, with the git store beside it; new snapshots go into the git store (so the first
    # upload after the upgrade sends the files again); rv gc collects the old folders and objects
    # once no kept run uses them, and never the git store's snapshots by the old rules.
    t = gc_transport(tmp_path)
    repo = sample_repo(tmp_path)
    old_id = with_previous_rv(previous_rv, OLD_SNAPSHOT, layout.root, str(repo))
    assert Path(layout.snapshot(old_id)).is_dir() and Path(layout.objects).is_dir()
    new = make_snapshot(t, layout, repo)
    assert new.id == old_id and new.created and new.new_objects == 6  # the same snapshot, sent anew
    want = expected_state(repo, listed_paths(repo))
    old_script = with_previous_rv(previous_rv, OLD_WORK_DIR, layout.root, old_id)

    def old_job_copy(dest: Path) -> Path:
        subprocess.run(["bash", "-c", old_script], env={**os.environ, "RV_WORK_DIR": str(dest)}, check=True)
        return dest

    assert tree_state(old_job_copy(tmp_path / "old-job")) == want
    assert tree_state(job_copy(layout, new.id, tmp_path / "new-job")) == want
    # A live run of the previous rv keeps its snapshot through gc, old folders and git ref alike.
    fake_run(layout, "live0001", "still-going", old_id, "101", ended_days=None)
    fake_squeue.write_text("101|RUNNING|None\n")
    for path in Path(layout.snapshots).iterdir():
        t30 = time.time() - 30 * 86400
        os.utime(path, (t30, t30), follow_symlinks=False)
    age_packs(layout, 30)
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert report["removed"] == [] and report["warnings"] == []
    assert tree_state(old_job_copy(tmp_path / "old-job-2")) == want
    # Once that run is gone, both go: the old folder and its objects, the ref and its packs' objects.
    fake_squeue.write_text("")
    shutil.rmtree(layout.run_dir("live0001"))
    age_packs(layout, 30)
    report = collect_garbage(t, layout.root, older_than=14 * 86400, checkpoints=False, dry_run=False)
    assert sorted(r["id"] for r in report["removed"]) == [old_id, old_id]
    assert not Path(layout.snapshot(old_id)).exists()
    assert not [p for p in Path(layout.objects).rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert snapshot_refs(layout) == {} and stored_blobs(layout) == set()


# -- a run's check confirming the snapshot (rv run with nothing changed) -----------------------------


def test_a_snapshot_the_runs_check_found_whole_is_not_asked_for_again(tmp_path, transport, layout):
    """The run's check asks the store whether it holds the snapshot this machine believes it holds
    (rv.agent.store.held_whole); yes, and the upload makes no call. Each way the store may have lost
    it says no, and the upload asks snap-put as ever."""
    repo = sample_repo(tmp_path)
    cache_dir = tmp_path / "cache"
    first = make_snapshot(transport, layout, repo, cache_dir=cache_dir)
    cache = StoreCache(cache_dir, layout.root)
    snap = prepare_snapshot(repo, cache_dir=cache_dir)
    held = cache.held(snap.project, snap.id, snap.tree.files)
    assert held == (first.id, first.snapshot_commit, snap.tree.files)
    root = agent_common.root_path(layout.root)
    asked = {"id": held[0], "commit": held[1], "files": held[2]}
    meta = Path(layout.snapshot_meta(first.id))
    os.utime(meta, (1, 1))
    assert agent_store.held_whole(root, asked) is True
    assert meta.stat().st_mtime > 1  # "last used", as snap-put marks it: rv gc measures age from it

    transport.calls.clear()
    result = upload_snapshot(transport, layout, snap, cache=cache, held=first.snapshot_commit)
    assert transport.calls == [] and result.id == first.id and not result.created
    assert "already on the cluster, nothing to send" in result.summary
    # A commit that is not this snapshot's is no answer for it: the upload asks.
    upload_snapshot(transport, layout, snap, cache=cache, held="0" * 40)
    assert len(transport.calls) == 1 and "snap-put" in transport.calls[0]

    assert agent_store.held_whole(root, dict(asked, commit="1" * 40)) is False
    meta.rename(meta.with_suffix(".away"))  # a purge took the meta: snap-put writes it back
    assert agent_store.held_whole(root, asked) is False
    meta.with_suffix(".away").rename(meta)
    ref = Path(layout.store, "refs", "rv", "snapshots", first.id)
    assert ref.exists()
    commit = ref.read_text()
    ref.unlink()
    assert agent_store.held_whole(root, asked) is False
    ref.write_text(commit)
    assert agent_store.held_whole(root, asked) is True
    # The blobs' pack gone after the snapshot was verified: walked again, found lacking.
    (blobs,) = (
        p
        for p in Path(layout.store, "objects", "pack").glob("pack-*.pack")
        if "blob" in store_git(layout, "verify-pack", "-v", str(p.with_suffix(".idx")))
    )
    for p in blobs.parent.glob(blobs.stem + ".*"):
        p.unlink()
    assert agent_store.held_whole(root, asked) is False
    again = upload_snapshot(transport, layout, snap, cache=cache, held=None)
    assert again.new_objects > 0 and store_is_sound(layout) > 0
    assert agent_store.held_whole(root, asked) is True
