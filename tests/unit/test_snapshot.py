"""What a snapshot holds: file selection, blob ids, the manifest id, size guards, project key, provenance.

Real git on temporary repositories (hermetic HOME); nothing touches a network.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rv.agent import manifest
from rv.errors import UsageError
from rv.files import listing, packs
from rv.files.listing import (
    MODE_EXEC,
    MODE_FILE,
    MODE_LINK,
    Entry,
    blob_id,
    scan_tree,
    snapshot_id,
)
from rv.files.provenance import project_key, provenance
from rv.files.snapshot import check_sizes, prepare_snapshot
from rv.remote import agent_client


def git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "protocol.file.allow=always"]
    return subprocess.run([*cmd, *args], cwd=cwd, check=True, capture_output=True).stdout.decode()


def write(path: Path, data: str | bytes, mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    if mode is not None:
        path.chmod(mode)
    return path


def new_repo(path: Path, files: dict[str, str] | None = None, commit: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    for name, content in (files or {"README.md": "hello\n"}).items():
        write(path / name, content)
    if commit:
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", "init")
    return path


pytestmark = pytest.mark.usefixtures("hermetic_home")


def paths(tree) -> set[str]:
    return {e.path for e in tree.entries}


def by_path(tree) -> dict[str, Entry]:
    return {e.path: e for e in tree.entries}


def hash_object(path: Path) -> str:
    return subprocess.run(
        ["git", "hash-object", "--no-filters", str(path)], check=True, capture_output=True, text=True
    ).stdout.strip()


# -- blob ids ------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"hello\n", bytes(range(256)) * 1000])
def test_blob_id_is_gits(tmp_path, data):
    f = write(tmp_path / "f", data)
    assert blob_id(data) == hash_object(f)
    assert listing.hash_path(f)[1] == hash_object(f)


def test_symlink_blob_is_its_target(tmp_path):
    (tmp_path / "link").symlink_to("some/where")
    mode, oid, size, _ = listing.hash_path(tmp_path / "link")
    assert (mode, oid, size) == (MODE_LINK, blob_id(b"some/where"), 10)


# -- file selection ------------------------------------------------------------------------------


def test_repo_selection_rules(tmp_path):
    repo = new_repo(
        tmp_path / "repo",
        {
            "a.py": "print(1)\n",
            "gone.py": "x\n",
            "data/big.bin": "b" * 10,
            "sub/keep.bin": "k\n",
            "sub/drop.bin": "d\n",
            "sub/deep/x.bin": "x\n",
            ".gitignore": "*.log\n",
            "sub/.rvignore": "*.bin\n!keep.bin\n",
            ".rvignore": "data/\n",
        },
    )
    (repo / "gone.py").unlink()  # deleted, not staged
    write(repo / "a.py", "print(2)\n")  # uncommitted edit
    write(repo / "new.txt", "untracked\n")
    write(repo / "debug.log", "ignored by git\n")
    write(repo / "data/untracked.txt", "under an rvignored folder\n")
    write(repo / "sub/new.bin", "untracked and rvignored\n")
    tree = scan_tree(repo)
    assert paths(tree) == {"a.py", ".gitignore", ".rvignore", "sub/.rvignore", "sub/keep.bin", "new.txt"}
    assert by_path(tree)["a.py"].oid == hash_object(repo / "a.py")
    assert {p for p, _ in tree.ignored} == {
        "data/big.bin",
        "data/untracked.txt",
        "sub/drop.bin",
        "sub/deep/x.bin",
        "sub/new.bin",
    }
    assert tree.repo.dirty and tree.repo.untracked == ("new.txt",)


def test_modes_symlinks_and_names(tmp_path):
    repo = new_repo(tmp_path / "repo")
    write(repo / "run.sh", "#!/bin/sh\necho hi\n", 0o755)
    write(repo / "empty", b"")
    (repo / "link").symlink_to("README.md")
    (repo / "dangling").symlink_to("nowhere/at/all")
    awkward = [
        "with space.txt",
        "ünïcödé.txt",
        "-leading-dash",
        "hash#tag",
        "quote'single",
        'quote"double',
        "tab\there",
    ]
    for name in awkward:
        write(repo / "odd dir" / name, name)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "more")
    tree = scan_tree(repo)
    e = by_path(tree)
    assert e["run.sh"].mode == MODE_EXEC and e["README.md"].mode == MODE_FILE
    assert e["empty"].size == 0 and e["empty"].oid == blob_id(b"")
    assert (e["link"].mode, e["link"].oid) == (MODE_LINK, blob_id(b"README.md"))
    assert (e["dangling"].mode, e["dangling"].oid) == (MODE_LINK, blob_id(b"nowhere/at/all"))
    for name in awkward:
        assert e[f"odd dir/{name}"].oid == blob_id(name.encode())
    # chmod -x of a committed executable is seen even though the content is unchanged
    (repo / "run.sh").chmod(0o644)
    assert by_path(scan_tree(repo))["run.sh"].mode == MODE_FILE


def test_clean_tracked_files_are_not_hashed(tmp_path, monkeypatch):
    repo = new_repo(tmp_path / "repo", {f"f{i}.txt": f"{i}\n" * i for i in range(40)})
    write(repo / "f3.txt", "edited\n")
    write(repo / "new.txt", "new\n")
    hashed: list[str] = []
    real = listing.hash_path
    monkeypatch.setattr(listing, "hash_path", lambda p: hashed.append(os.path.basename(p)) or real(p))
    tree = scan_tree(repo)
    assert sorted(hashed) == ["f3.txt", "new.txt"]
    assert all(e.oid == hash_object(repo / e.path) for e in tree.entries)


def test_touched_but_unchanged_file_is_not_dirty(tmp_path):
    repo = new_repo(tmp_path / "repo", {"a.txt": "same\n"})
    st = (repo / "a.txt").stat()
    os.utime(repo / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    tree = scan_tree(repo)
    assert not tree.repo.dirty
    assert by_path(tree)["a.txt"].oid == hash_object(repo / "a.txt")


def test_clean_filter_means_working_tree_content_is_hashed(tmp_path):
    # Like git-lfs: the blob in the index differs from the file on disk, so the index id is not used.
    repo = new_repo(tmp_path / "repo", {".gitattributes": "*.dat filter=upper\n"})
    git(repo, "config", "filter.upper.clean", "tr a-z A-Z")
    git(repo, "config", "filter.upper.smudge", "cat")
    write(repo / "x.dat", "lower case\n")
    git(repo, "add", "x.dat")
    git(repo, "commit", "-q", "-m", "dat")
    index_oid = git(repo, "ls-files", "-s", "x.dat").split()[1]
    entry = by_path(scan_tree(repo))["x.dat"]
    assert entry.oid == blob_id(b"lower case\n") != index_oid


def test_submodule_and_nested_repo_files_are_included(tmp_path):
    lib = new_repo(tmp_path / "lib", {"lib.py": "L = 1\n", "inner/.rvignore": "*.tmp\n", "inner/x.tmp": "t"})
    repo = new_repo(tmp_path / "repo", {".rvignore": "*.ckpt\n"})
    git(repo, "submodule", "add", "-q", str(lib), "vendor/lib")
    git(repo, "commit", "-q", "-m", "submodule")
    write(repo / "vendor/lib/edited.py", "untracked in the submodule\n")
    write(repo / "vendor/lib/model.ckpt", "excluded by the parent's .rvignore\n")
    new_repo(repo / "scratch", {"notes.md": "an untracked repo inside\n"})
    tree = scan_tree(repo)
    got = paths(tree)
    assert {
        "vendor/lib/lib.py",
        "vendor/lib/edited.py",
        "vendor/lib/inner/.rvignore",
        "scratch/notes.md",
    } <= got
    assert "vendor/lib/model.ckpt" not in got and "vendor/lib/inner/x.tmp" not in got
    assert not any(".git" in p.split("/") for p in got)
    assert ".gitmodules" in got


def test_uninitialised_submodule_is_a_warning(tmp_path):
    lib = new_repo(tmp_path / "lib", {"lib.py": "L = 1\n"})
    repo = new_repo(tmp_path / "repo")
    git(repo, "submodule", "add", "-q", str(lib), "lib")
    git(repo, "commit", "-q", "-m", "submodule")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))  # without --recurse-submodules
    tree = scan_tree(clone)
    assert not any(p.startswith("lib/") for p in paths(tree))
    assert any("submodule lib is not checked out" in w for w in tree.warnings)


def test_outside_a_repo_takes_every_file_minus_rvignore(tmp_path):
    folder = tmp_path / "plain"
    write(folder / "a.txt", "a")
    write(folder / "d/b.txt", "b")
    write(folder / "big/huge.bin", "h")
    write(folder / "d/c.log", "c")
    write(folder / ".rvignore", "big/\n*.log\n")
    tree = scan_tree(folder)
    assert paths(tree) == {"a.txt", "d/b.txt", ".rvignore"}
    assert any("not in a git repository" in w for w in tree.warnings)
    assert {p for p, _ in tree.ignored} == {"big/", "d/c.log"}
    assert tree.repo is None


def test_special_files_are_left_out(tmp_path):
    repo = new_repo(tmp_path / "repo", {"README.md": "x", "was_a_file": "y"})
    os.mkfifo(repo / "pipe")  # git does not list it at all
    (repo / "was_a_file").unlink()
    os.mkfifo(repo / "was_a_file")  # tracked, now a fifo: left out, and said so
    tree = scan_tree(repo)
    assert paths(tree) == {"README.md"}
    assert tree.warnings == ("left out was_a_file: not a regular file or symlink",)


# -- manifest ----------------------------------------------------------------------------------


def test_snapshot_id_depends_on_content_mode_and_path_only():
    a = Entry("a", MODE_FILE, blob_id(b"1"), 1, mtime_ns=5)
    b = Entry("b/c", MODE_EXEC, blob_id(b"22"), 2)
    assert snapshot_id([a, b]) == snapshot_id([b, Entry("a", MODE_FILE, blob_id(b"1"), 1, mtime_ns=9)])
    assert snapshot_id([a, b]) != snapshot_id([a, Entry("b/c", MODE_FILE, b.oid, 2)])
    assert snapshot_id([a, b]) != snapshot_id([a, Entry("b/d", MODE_EXEC, b.oid, 2)])
    assert len(snapshot_id([a])) == 24


def test_what_goes_against_a_snapshot_the_store_holds_is_only_what_it_lacks(tmp_path):
    # rv's own repository builds both snapshots' commits; against the first, the second sends its
    # new blob and the trees above it; against nothing, everything; an unknown base counts as none.
    repo = new_repo(tmp_path / "repo", {f"d{i % 3}/f{i}.txt": f"{i}\n" for i in range(30)})
    first = prepare_snapshot(repo)
    local = packs.open_local_store(tmp_path / "cache", first.tree, first.git)
    c1 = local.build(first.tree)
    write(repo / "d1/f1.txt", "new\n")
    second = prepare_snapshot(repo)
    c2 = local.build(second.tree)
    sizes = {e.oid: e.size for e in second.tree.entries}
    sends = local.objects(c2, [c1], sizes)
    assert [(o.path, o.size) for o in sends.blobs] == [("d1/f1.txt", 4)] and sends.bases == [c1]
    assert sorted(o.path for o in sends.structure) == ["", "", "d1"]  # the commit, its tree, d1
    everything = local.objects(c2, [], sizes)
    assert len(everything.blobs) == 30 and len(everything.structure) == 5
    assert local.objects(c2, ["0" * 40], sizes).bases == []
    # The same files make the same commit, in any repository of rv's.
    other = packs.open_local_store(tmp_path / "cache2", second.tree, second.git)
    assert other.build(second.tree) == c2


def test_edited_files_blobs_go_into_one_pack_of_rvs_repository_none_loose(tmp_path):
    repo = new_repo(tmp_path / "repo", {f"d/f{i}.txt": f"{i}\n" for i in range(20)})
    first = prepare_snapshot(repo)
    local = packs.open_local_store(tmp_path / "cache", first.tree, first.git)
    local.build(first.tree)
    for i in range(5):
        write(repo / f"d/f{i}.txt", f"edited {i}\n")
    write(repo / "d/f6.txt", "edited 0\n")  # the same bytes as another edit: one object
    os.symlink("d/f1.txt", repo / "link")
    second = prepare_snapshot(repo)
    commit = local.build(second.tree)
    objects = local.path / "objects"
    loose = "".join(f"{p.parent.name}{p.name}\n" for p in objects.glob("??/*"))
    kinds = subprocess.run(
        ["git", "--git-dir", str(local.path), "cat-file", "--batch-check=%(objecttype)"],
        input=loose, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert "blob" not in kinds and "tree" in kinds  # git's write-tree writes the trees loose
    assert len(list((objects / "pack").glob("pack-*.pack"))) == 1
    got = subprocess.run(
        ["git", "--git-dir", str(local.path), "cat-file", "-p", f"{commit}:d/f3.txt"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    assert got == b"edited 3\n"
    target = subprocess.run(
        ["git", "--git-dir", str(local.path), "cat-file", "-p", f"{commit}:link"],
        capture_output=True,
        check=True,
    ).stdout
    assert target == b"d/f1.txt"
    fsck = subprocess.run(
        ["git", "--git-dir", str(local.path), "fsck", "--full", "--strict", "--no-dangling"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert fsck.returncode == 0, fsck.stderr


def test_manifest_text_splices_like_a_rebuild():
    rows = [[f"d{i % 7}/f{i}", MODE_FILE, blob_id(str(i).encode()), i] for i in range(200)]
    text = manifest.manifest_text(rows)
    changes = {
        "d3/f3": None,
        "d0/new": ["d0/new", MODE_EXEC, blob_id(b"n"), 1],
        "d5/f5": ["d5/f5", MODE_LINK, blob_id(b"t"), 1],
    }
    spliced, old = manifest.splice(text, changes)
    by_path = {r[0]: r for r in rows}
    for p, r in changes.items():
        by_path.pop(p, None) if r is None else by_path.__setitem__(p, r)
    assert spliced == manifest.manifest_text(list(by_path.values()))
    assert old == {"d3/f3": rows[3], "d0/new": None, "d5/f5": rows[5]}
    assert manifest.has_under(spliced, "d0") and not manifest.has_under(spliced, "d")
    assert (
        manifest.row_at(spliced, "d0/new") == changes["d0/new"] and manifest.row_at(spliced, "d3/f3") is None
    )


# -- guards, project, provenance ----------------------------------------------------------------


def test_size_guard_names_the_file(tmp_path):
    repo = new_repo(tmp_path / "repo")
    write(repo / "weights.bin", b"\0" * 2000)
    tree = scan_tree(repo)
    with pytest.raises(UsageError) as err:
        check_sizes(tree, 1000, allow_large=False)
    assert "weights.bin (2.0 kB)" in err.value.message and "1.0 kB limit" in err.value.message
    assert ".rvignore" in err.value.hint and "--allow-large" in err.value.hint
    assert check_sizes(tree, 1000, allow_large=True) == (("weights.bin", 2000),)
    with pytest.raises(UsageError):
        prepare_snapshot(repo, max_file_size=1000)


def test_project_key_is_unique_to_the_repo_not_its_folder_name(tmp_path):
    one = new_repo(tmp_path / "a" / "proj", {"x": "1"})
    two = new_repo(tmp_path / "b" / "proj", {"x": "2"})
    k1, k2 = project_key(scan_tree(one)), project_key(scan_tree(two))
    root1 = git(one, "rev-list", "--max-parents=0", "HEAD").strip()
    assert k1 == f"proj-{root1[:10]}" and k1 != k2
    write(one / "y", "more")
    git(one, "add", "-A")
    git(one, "commit", "-q", "-m", "second")
    assert project_key(scan_tree(one), cache_dir=tmp_path / "cache") == k1
    assert project_key(scan_tree(one), cache_dir=tmp_path / "cache") == k1  # from the cache
    bare = new_repo(tmp_path / "c" / "proj", commit=False)
    assert project_key(scan_tree(bare)).startswith("proj-") and project_key(scan_tree(bare)) != k1


def test_provenance_of_a_dirty_tree(tmp_path):
    repo = new_repo(tmp_path / "repo", {"train.py": "lr = 1\n"})
    git(repo, "remote", "add", "origin", "git@example.org:me/repo.git")
    write(repo / "train.py", "lr = 2\n")
    snap = prepare_snapshot(repo)
    prov = snap.provenance
    assert prov["branch"] == "main" and prov["commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert prov["dirty"] is True and prov["remote_url"] == "git@example.org:me/repo.git"
    assert prov["diff"] is None  # computed only when the snapshot is new (see upload)
    full = provenance(snap.tree, snap.project, snap.subdir)
    assert "+lr = 2" in full["diff"] and full["diff_truncated"] is False
    assert snap.subdir == ""
    write(repo / "sub/x.py", "x")
    assert prepare_snapshot(repo / "sub").subdir == "sub"
    git(repo, "checkout", "-q", "--", "train.py")
    (repo / "sub/x.py").unlink()
    clean = prepare_snapshot(repo)
    assert clean.provenance["dirty"] is False
    assert provenance(clean.tree, clean.project, "")["diff"] == ""


# -- the agent ------------------------------------------------------------------------------------


def test_agent_command_quotes_its_arguments():
    cmd = agent_client.agent_command("scan", {"root": "/x/it's here", "path": "$(rm -rf ~)"})
    assert cmd.startswith('p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" -I -S -c ')
    assert "'\"'\"'" in cmd  # the single quote in the root is shell-quoted
    assert "$(rm -rf ~)" in cmd and '\'{"root"' in cmd


def test_a_repository_git_refuses_is_an_error_not_a_plain_folder(tmp_path):
    repo = new_repo(tmp_path / "repo")
    (repo / ".git" / "HEAD").write_text("garbage\n")  # git no longer recognises it as a repo
    with pytest.raises(UsageError, match="git cannot read the repository at"):
        scan_tree(repo)
