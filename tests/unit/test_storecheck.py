"""The store's repairs (rv/agent/storecheck.py) and rv gc's git gc, on real git repositories: a pack
with bytes written over, a ref to lost objects, a background gc that fails, and gc without cruft
packs (git older than 2.37, which the loopback cluster's git is not)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rv.agent import store as agent_store
from rv.agent import storecheck

STORE_CHECK = Path(storecheck.__file__)


WHO = {f"GIT_{r}_{k}": v for r in ("AUTHOR", "COMMITTER") for k, v in (("NAME", "rv"), ("EMAIL", "rv@x"))}


def git(store: Path, *args: str, stdin: bytes | None = None) -> str:
    env = {**storecheck.git_env(str(store)), **WHO}
    out = subprocess.run(["git", *args], input=stdin, capture_output=True, env=env, check=True)
    return out.stdout.decode().strip()


def snapshot(store: Path, sid: str, files: dict[str, bytes]) -> str:
    """A snapshot's commit and ref, its objects in a pack of their own; its meta file beside the store."""
    lines = []
    for path, data in files.items():
        oid = git(store, "hash-object", "-w", "--stdin", stdin=data)
        lines.append(f"100644 {oid}\t{path}")
    index = store / "tmp-index"
    env = {**storecheck.git_env(str(store)), "GIT_INDEX_FILE": str(index)}
    subprocess.run(
        ["git", "update-index", "--index-info"], input="\n".join(lines).encode(), env=env, check=True
    )
    tree = (
        subprocess.run(["git", "write-tree"], env=env, capture_output=True, check=True)
        .stdout.decode()
        .strip()
    )
    index.unlink()
    commit = git(store, "commit-tree", tree, "-m", sid, stdin=b"")
    git(store, "update-ref", f"refs/rv/snapshots/{sid}", commit)
    git(store, "repack", "-d", "-q")  # the loose objects into a pack of their own
    (store.parent / "snapshots").mkdir(exist_ok=True)
    (store.parent / "snapshots" / f"{sid}.git.json").write_text("{}")
    return commit


def new_store(tmp_path: Path) -> Path:
    store = tmp_path / "store.git"
    subprocess.run(["git", "init", "-q", "--bare", "--template=", str(store)], check=True)
    return store


def blob(name: str, size: int = 5000) -> bytes:
    return (name * size).encode()[:size]


def overwrite(store: Path, path: str, commit: str) -> Path:
    """Write over the middle of the entry of ``commit``'s file ``path`` in its pack; the pack."""
    oid = git(store, "rev-parse", f"{commit}:{path}")
    for idx in store.glob("objects/pack/*.idx"):
        for line in subprocess.run(
            ["git", "verify-pack", "-v", str(idx)], capture_output=True, text=True
        ).stdout.splitlines():
            f = line.split()
            if f and f[0] == oid:
                pack = idx.with_suffix(".pack")
                with open(pack, "r+b") as fh:
                    fh.seek(int(f[4]) + int(f[3]) // 2)
                    fh.write(b"X" * 16)
                return pack
    raise AssertionError(f"{path} is in no pack")


def test_check_names_the_damaged_files_sets_their_pack_aside_and_drops_the_refs_it_broke(tmp_path):
    store = new_store(tmp_path)
    one = snapshot(store, "a" * 24, {"keep.txt": blob("k"), "bad.txt": blob("b")})
    two = snapshot(store, "b" * 24, {"keep.txt": blob("k"), "bad.txt": blob("b"), "new.txt": blob("n")})
    other = snapshot(store, "c" * 24, {"else.txt": blob("e")})
    pack = overwrite(store, "bad.txt", one)
    found = storecheck.check(str(store), two)
    assert [path for _oid, path in found["damaged"]] == ["bad.txt"] and found["missing"] == []
    assert found["set_aside"] == [pack.name] and not pack.exists()
    assert list(store.glob(f"rv-damaged/*/{pack.name}")) and list(store.glob(f"rv-damaged/*/{pack.stem}.idx"))
    # Both snapshots that had objects in that pack lost their refs and meta files; the other kept its.
    assert sorted(found["dropped"]) == ["a" * 24, "b" * 24]
    assert git(store, "for-each-ref", "--format=%(objectname)") == other
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["c" * 24 + ".git.json"]
    subprocess.run(["git", "fsck", "--full", "--strict"], env=storecheck.git_env(str(store)), check=True)
    text = storecheck.describe(found, "b" * 24)
    assert (
        text.startswith(f"1 object(s) of snapshot {'b' * 24} are damaged in the store")
        and ": bad.txt;" in text
    )
    # As the job runs it: exit 0 and the line when something is damaged, exit 1 when all reads whole.
    run = subprocess.run(
        [sys.executable, str(STORE_CHECK), "check", str(store), other, "c" * 24], capture_output=True
    )
    assert run.returncode == 1 and run.stdout == b""


def test_tidy_drops_a_ref_to_lost_objects_and_packs_unreachable_objects_in_a_cruft_pack(tmp_path):
    store = new_store(tmp_path)
    (store / "config").write_text((store / "config").read_text() + "[gc]\n\tautoPackLimit = 1\n")
    snapshot(store, "a" * 24, {"x.txt": blob("x")})
    b = snapshot(store, "b" * 24, {"y.txt": blob("y")})
    snapshot(store, "c" * 24, {"z.txt": blob("z")})
    git(store, "update-ref", "-d", f"refs/rv/snapshots/{'c' * 24}")  # c unreachable, and recent
    (lost,) = [
        p for p in store.glob("objects/pack/*.idx") if b in git(store, "show-index", stdin=p.read_bytes())
    ]
    for p in store.glob(f"objects/pack/{lost.stem}.*"):
        p.unlink()  # a purge: the ref of b stays, its objects are gone
    (store / storecheck.GC_FAILED).write_text("an old failure\n")
    assert storecheck.tidy(str(store), "job 1 on node1") == 0
    assert git(store, "for-each-ref", "--format=%(refname)") == f"refs/rv/snapshots/{'a' * 24}"
    metas = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert metas == ["a" * 24 + ".git.json", "c" * 24 + ".git.json"]  # b's went with its ref
    assert not (store / storecheck.GC_FAILED).exists()
    assert not list(store.glob("objects/??/*"))  # nothing exploded into loose files
    assert list(store.glob("objects/pack/*.mtimes"))  # c's objects: in a cruft pack
    subprocess.run(["git", "fsck", "--full", "--strict"], env=storecheck.git_env(str(store)), check=True)


def test_a_background_gc_that_fails_writes_why_and_the_next_success_removes_it(tmp_path):
    store = new_store(tmp_path)
    snapshot(store, "a" * 24, {"x.txt": blob("x")})
    config = (store / "config").read_text()
    (store / "config").write_text(config + "[gc]\n\tpruneExpire = not-a-date\n")
    assert storecheck.tidy(str(store), "job 7 on node2") == 1
    line = (store / storecheck.GC_FAILED).read_text()
    assert " job 7 on node2: git gc --auto failed: " in line and "gc.pruneexpire" in line
    assert agent_store.background_gc_failure(str(tmp_path).encode()) == line.strip()
    (store / "config").write_text(config)
    assert storecheck.tidy(str(store), "job 8 on node2") == 0
    assert not (store / storecheck.GC_FAILED).exists()


def test_gc_without_cruft_packs_drops_old_unreachable_objects_keeps_recent_ones_and_explodes_none(tmp_path):
    store = new_store(tmp_path)
    keep = snapshot(store, "a" * 24, {"x.txt": blob("x")})
    old = snapshot(store, "b" * 24, {"y.txt": blob("y")})
    recent = snapshot(store, "c" * 24, {"z.txt": blob("z")})
    for sid in ("b", "c"):
        git(store, "update-ref", "-d", f"refs/rv/snapshots/{sid * 24}")
    hours_ago = time.time() - 7200
    for p in store.glob("objects/pack/*"):
        if p.suffix == ".pack" and git(store, "show-index", stdin=p.with_suffix(".idx").read_bytes()).count(
            old
        ):
            os.utime(p, (hours_ago, hours_ago))  # b's pack: sent 2 h ago, unreachable since
    rc, err = agent_store._gc_without_cruft(str(store).encode(), 900)
    assert rc == 0, err
    have = git(store, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split()
    assert keep in have and recent in have and old not in have  # a send in flight keeps its objects
    assert not list(store.glob("objects/??/*")) and not list(store.glob("objects/pack/*.keep"))
    subprocess.run(["git", "fsck", "--full", "--strict"], env=storecheck.git_env(str(store)), check=True)


def test_rv_gc_sets_aside_a_pack_git_calls_corrupt_and_drops_the_refs_it_held(tmp_path):
    from rv.agent.gc import Freed

    store = new_store(tmp_path)
    one = snapshot(store, "a" * 24, {"x.txt": blob("x")})
    snapshot(store, "b" * 24, {"y.txt": blob("y")})
    pack = overwrite(store, "x.txt", one)
    report: dict = {}
    repairs = agent_store._git_gc(str(tmp_path).encode(), str(store).encode(), 900, report, Freed())
    assert repairs == [f"set aside damaged pack {pack.name}"]
    assert report["broken_removed"] == ["a" * 24]
    assert list(store.glob(f"rv-damaged/*/{pack.name}")) and not pack.exists()
    assert git(store, "for-each-ref", "--format=%(refname)") == f"refs/rv/snapshots/{'b' * 24}"
    subprocess.run(["git", "fsck", "--full", "--strict"], env=storecheck.git_env(str(store)), check=True)
