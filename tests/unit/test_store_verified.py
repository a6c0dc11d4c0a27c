"""The store's record of snapshots found whole (rv.agent.store.whole_snapshot_missing): trusted while
every file that held the store's objects is still there, unchanged; walked again otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rv.agent import store as agent_store


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def packed(tmp_path: Path) -> tuple[bytes, str, list[str]]:
    """A bare store whose one commit (two files) lives in one pack: (store, commit, [first, second])."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    (src / "b.txt").write_text("b\n")
    git("init", "-q", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "one", cwd=src)
    first = git("rev-parse", "HEAD", cwd=src).strip()
    (src / "b.txt").write_text("b, edited\n")
    git("commit", "-q", "-am", "two", cwd=src)
    second = git("rev-parse", "HEAD", cwd=src).strip()
    git("clone", "-q", "--bare", str(src), str(tmp_path / "store.git"), cwd=tmp_path)
    git("repack", "-a", "-d", "-q", cwd=tmp_path / "store.git")
    return os.fsencode(tmp_path / "store.git"), first, [first, second]


def walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = agent_store._walk

    def counted(store, commit, env=None, bases=()):  # type: ignore[no-untyped-def]
        seen.append(commit)
        return real(store, commit, env, bases)

    monkeypatch.setattr(agent_store, "_walk", counted)
    return seen


def the_pack(store: bytes) -> Path:
    (pack,) = Path(os.fsdecode(store), "objects", "pack").glob("pack-*.pack")
    return pack


def test_a_snapshot_found_whole_is_not_walked_again_while_its_pack_stays(packed, monkeypatch):
    store, commit, _ = packed
    seen = walks(monkeypatch)
    assert agent_store.whole_snapshot_missing(store, commit) == []
    assert agent_store.whole_snapshot_missing(store, commit) == []
    assert seen == [commit]
    assert Path(os.fsdecode(store), "rv-verified").exists()


def test_a_pack_copied_over_itself_same_name_and_size_new_inode_makes_it_walk_again(packed, monkeypatch):
    store, commit, _ = packed
    seen = walks(monkeypatch)
    assert agent_store.whole_snapshot_missing(store, commit) == []
    pack = the_pack(store)
    shutil.copyfile(pack, pack.with_suffix(".tmp"))
    os.replace(pack.with_suffix(".tmp"), pack)
    assert agent_store.whole_snapshot_missing(store, commit) == []
    assert seen == [commit, commit]


def test_a_pack_gone_after_the_snapshot_was_verified_is_found_missing(packed, monkeypatch):
    store, commit, _ = packed
    assert agent_store.whole_snapshot_missing(store, commit) == []
    for p in the_pack(store).parent.glob("pack-*"):
        p.unlink()
    assert agent_store.whole_snapshot_missing(store, commit) == [commit]


def test_a_loose_object_gone_after_the_snapshot_was_verified_is_found_missing(packed, monkeypatch):
    store, commit, _ = packed
    # The commit's blob of b.txt as a loose object instead (a store may hold some: git's own gc).
    blob = agent_store.run_git(store, ["rev-parse", commit + ":b.txt"])[1].decode().strip()
    data = agent_store.run_git(store, ["cat-file", "blob", blob])[1]
    for p in the_pack(store).parent.glob("pack-*"):
        p.unlink()
    git(
        "--git-dir",
        os.fsdecode(store),
        "fetch",
        "-q",
        os.fsdecode(store) + "/../src",
        cwd=Path(os.fsdecode(store)),
    )
    assert agent_store.whole_snapshot_missing(store, commit) == []
    loose = Path(os.fsdecode(store), "objects", blob[:2], blob[2:])
    assert loose.exists() and agent_store.run_git(store, ["cat-file", "blob", blob])[1] == data
    loose.unlink()  # a purge: the folder stays, its mtime changes
    assert agent_store.whole_snapshot_missing(store, commit) == [blob]


def test_a_new_snapshot_is_walked_against_the_last_one_found_whole(packed, monkeypatch):
    store, first, (_, second) = packed
    bases: list[tuple[str, ...]] = []
    real = agent_store._walk

    def recorded(store, commit, env=None, bases_=(), **kw):  # type: ignore[no-untyped-def]
        bases.append(tuple(kw.get("bases", bases_)))
        return real(store, commit, env, kw.get("bases", bases_))

    monkeypatch.setattr(agent_store, "_walk", recorded)
    assert agent_store.whole_snapshot_missing(store, first) == []
    assert agent_store.whole_snapshot_missing(store, second) == []
    first_tree = agent_store.run_git(store, ["rev-parse", first + "^{tree}"])[1].decode().strip()
    assert bases == [(), (first_tree,)]
    assert agent_store.whole_snapshot_missing(store, first) == []  # both remembered
    assert len(bases) == 2


# -- a store holding fewer objects than the snapshot has files: listed once, not looked up --------


def test_the_index_sizes_count_the_objects_of_the_packs(packed):
    store, _, _ = packed
    count = agent_store.run_git(store, ["count-objects", "-v"])[1].decode()
    in_pack = int(next(line.split()[1] for line in count.splitlines() if line.startswith("in-pack:")))
    assert (
        agent_store.stored_objects(agent_store.object_files(store)) == in_pack == 7
    )  # 2 commits, trees; 3 blobs


def test_a_store_with_fewer_objects_than_files_is_listed_and_finds_what_the_walk_finds(packed, monkeypatch):
    store, _, (_, second) = packed
    # The second commit's objects without its two blobs (its trees there): what a first send's
    # trees leave, as the walk and the listing both see it.
    blobs = {
        agent_store.run_git(store, ["rev-parse", f"{second}:{name}"])[1].decode().strip()
        for name in ("a.txt", "b.txt")
    }
    listed_all = agent_store.run_git(store, ["rev-list", "--objects", "--all"])[1].decode().split()
    keep = [o for o in listed_all if len(o) == 40 and o not in blobs]
    for p in the_pack(store).parent.glob("pack-*"):
        data = p.read_bytes() if p.suffix == ".pack" else None
        p.unlink()
        if data is not None:
            agent_store.run_git(store, ["unpack-objects", "-q"], stdin=data)
    for oid in blobs:
        Path(os.fsdecode(store), "objects", oid[:2], oid[2:]).unlink()
    packed_again = os.fsdecode(store) + "/objects/pack/pack"
    agent_store.run_git(
        store, ["pack-objects", "-q", packed_again], stdin="".join(o + "\n" for o in keep).encode()
    )
    agent_store.run_git(store, ["prune-packed"])
    held = agent_store.run_git(store, ["cat-file", "--batch-all-objects", "--batch-check=%(objectname)"])[1]
    assert set(keep) == set(held.decode().split())
    walked = agent_store._walk(store, second)
    listed = agent_store._walk_listed(store, second)
    assert sorted(listed[0]) == sorted(walked[0]) == sorted(blobs) and listed[1] == walked[1]
    used: list[str] = []
    real = agent_store._walk_listed
    monkeypatch.setattr(agent_store, "_walk_listed", lambda s, c: used.append(c) or real(s, c))
    # 5 objects here against a snapshot of 1,000 files: listed; of 10 files: walked.
    assert sorted(agent_store.whole_snapshot_missing(store, second, files=1000)) == sorted(blobs)
    assert sorted(agent_store.whole_snapshot_missing(store, second, files=10)) == sorted(blobs)
    assert used == [second]


def test_a_tree_missing_from_a_listed_store_is_named_as_the_walk_names_it(packed):
    store, _, (_, second) = packed
    tree = agent_store.run_git(store, ["rev-parse", second + "^{tree}"])[1].decode().strip()
    for p in the_pack(store).parent.glob("pack-*"):
        data = p.read_bytes() if p.suffix == ".pack" else None
        p.unlink()
        if data is not None:
            agent_store.run_git(store, ["unpack-objects", "-q"], stdin=data)
    Path(os.fsdecode(store), "objects", tree[:2], tree[2:]).unlink()
    assert agent_store._walk_listed(store, second)[0] == agent_store._walk(store, second)[0] == [tree]
