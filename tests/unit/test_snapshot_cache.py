"""The listing cache: a resubmit lists and hashes only what changed, and is never wrong for it.

Every cached listing is compared with a listing made from scratch of the same files: whatever the
cache skips, the result must be the same bytes.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest
from test_snapshot import git, new_repo, write

from rv.agent import manifest
from rv.files import listing, provenance
from rv.files.listing import Git, scan_tree
from rv.files.treecache import RACY_NS, TreeCache, stat_key

pytestmark = pytest.mark.usefixtures("hermetic_home")


def same_listing(cached, fresh) -> None:
    assert cached.manifest == fresh.manifest
    assert cached.id == fresh.id == manifest.text_id(fresh.manifest)
    assert (cached.files, cached.total_size, cached.large) == (fresh.files, fresh.total_size, fresh.large)
    assert cached.ignored == fresh.ignored
    assert sorted(cached.warnings) == sorted(fresh.warnings)
    a, b = cached.repo, fresh.repo
    assert (a.commit, a.branch, a.dirty, a.untracked, a.changed) == (
        b.commit,
        b.branch,
        b.dirty,
        b.untracked,
        b.changed,
    )


class CountingGit(Git):
    """Real git, recording each command's first words."""

    def __init__(self) -> None:
        object.__setattr__(self, "calls", [])
        super().__init__()

    def run(self, args, cwd, **kw):  # type: ignore[override]
        self.calls.append(" ".join(args))
        return super().run(args, cwd, **kw)


def test_a_cached_listing_equals_a_fresh_one_whatever_changes(tmp_path):
    repo = new_repo(
        tmp_path / "repo",
        {
            "train.py": "lr = 1\n",
            "pkg/a.py": "A = 1\n",
            "pkg/sub/b.py": "B = 2\n",
            "data/only/deep.txt": "the only file of its folders\n",
            ".gitignore": "*.log\n",
        },
    )
    write(repo / "run.sh", "#!/bin/sh\n", 0o755)
    (repo / "link").symlink_to("train.py")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "more")
    rng = random.Random(11)
    counter = [0]

    def text() -> str:
        counter[0] += 1
        return f"content {counter[0]} " * rng.randint(1, 3) + "\n"

    def tracked() -> list[str]:
        # Ignore files stay files: other steps edit them.
        return [p for p in git(repo, "ls-files", "-z").split("\0")
                if p and (repo / p).is_file() and not os.path.basename(p).startswith(".")]  # fmt: skip

    def pick(paths: list[str]) -> str | None:
        return rng.choice(paths) if paths else None

    def op_edit():
        if p := pick(tracked()):
            write(repo / p, text())

    def op_same_size_edit():
        # Same length, other bytes, mtime put back: only ctime (or the racy rule) can tell.
        if p := pick(tracked()):
            f = repo / p
            st = f.stat()
            data = f.read_bytes()
            f.write_bytes(bytes(reversed(data)) if data != data[::-1] else data + b"")
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))

    def op_untracked():
        write(repo / rng.choice(["new.txt", "pkg/new.py", "fresh/dir/f.txt", "x.log"]), text())

    def op_delete():
        if p := pick([*tracked(), "new.txt", "pkg/new.py"]):
            (repo / p).unlink(missing_ok=True)

    def op_chmod():
        if p := pick(tracked()):
            (repo / p).chmod(0o755 if rng.random() < 0.5 else 0o644)

    def op_symlink():
        if p := pick(tracked()):
            (repo / p).unlink()
            (repo / p).symlink_to("train.py")

    def op_file_to_folder():
        if p := pick(tracked()):
            (repo / p).unlink()
            write(repo / p / "inside.txt", text())

    def op_add_all():
        git(repo, "add", "-A")

    def op_commit():
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--allow-empty", "-m", "step")

    def op_rvignore():
        where = rng.choice(["", "pkg/", "data/"])
        write(repo / f"{where}.rvignore", rng.choice(["*.py\n", "sub/\n", "new.txt\n", "", "only/\n"]))

    def op_gitignore():
        write(repo / ".gitignore", rng.choice(["*.log\n", "*.log\nnew.txt\n", "pkg/sub/\n"]))

    def op_touch():
        if p := pick(tracked()):
            os.utime(repo / p)

    def op_restore():
        git(repo, "checkout", "-q", "--", ".")

    def op_remove_folder():
        shutil.rmtree(repo / "pkg", ignore_errors=True)

    ops = [
        op_edit, op_same_size_edit, op_untracked, op_delete, op_chmod, op_symlink, op_file_to_folder,
        op_add_all, op_commit, op_rvignore, op_gitignore, op_touch, op_restore, op_remove_folder,
    ]  # fmt: skip
    cache = TreeCache(tmp_path / "cache")
    previous = scan_tree(repo, cache=cache)
    for step in range(60):
        op = ops[step % len(ops)] if step < len(ops) else rng.choice(ops)
        op()
        # A new cache object each time: what a new rv process reads back from the folder.
        cached = scan_tree(repo, cache=TreeCache(tmp_path / "cache"))
        fresh = scan_tree(repo)
        try:
            same_listing(cached, fresh)
            if cached.previous is not None:
                assert cached.previous[0] == previous.id
                assert manifest.splice(previous.manifest, cached.previous[1])[0] == cached.manifest
        except AssertionError as exc:
            raise AssertionError(f"step {step}: after {op.__name__}") from exc
        previous = cached


def test_an_edit_does_not_reread_the_index_and_a_git_add_does(tmp_path):
    repo = new_repo(tmp_path / "repo", {f"f{i}.txt": f"{i}\n" for i in range(50)})
    cache = TreeCache(tmp_path / "cache")
    scan_tree(repo, cache=cache)
    write(repo / "f7.txt", "edited\n")
    g = CountingGit()
    tree = scan_tree(repo, git=g, cache=TreeCache(tmp_path / "cache"))
    assert "diff-files -z --name-only --ignore-submodules=all" in g.calls
    assert "ls-files -z -s -v" not in g.calls  # the file list came from the cache
    assert tree.previous is not None and list(tree.previous[1]) == ["f7.txt"]
    git(repo, "add", "f7.txt")
    g = CountingGit()
    scan_tree(repo, git=g, cache=TreeCache(tmp_path / "cache"))
    assert "ls-files -z -s -v" in g.calls  # the index changed: read again


def test_unchanged_files_are_not_hashed_again(tmp_path, monkeypatch):
    repo = new_repo(tmp_path / "repo")
    for i in range(20):
        write(repo / f"untracked{i}.txt", f"{i}\n")
    cache = TreeCache()
    scan_tree(repo, cache=cache)
    # As if those files had been written a while before that listing: their ids can be trusted.
    for entry in cache.state(repo)["hashed"].values():
        entry[2] += 2 * RACY_NS
    hashed: list[str] = []
    real = listing.hash_path
    monkeypatch.setattr(listing, "hash_path", lambda p: hashed.append(os.path.basename(p)) or real(p))
    write(repo / "untracked3.txt", "changed\n")
    tree = scan_tree(repo, cache=cache)
    assert hashed == ["untracked3.txt"]
    assert listing.blob_id(b"changed\n") in tree.manifest.decode()


def test_a_same_size_edit_in_the_same_clock_tick_is_seen(tmp_path, monkeypatch):
    """The racy case: a write right after hashing that leaves size, mtime and ctime unchanged.

    Timestamps have a granularity (a jiffy on ext4, seconds on some file systems): a file written,
    hashed and written again within one tick keeps its stat data. Here the cache entry is made to
    match the new content's stat data exactly, as such a filesystem would have it; the cached id is
    recent (younger than RACY_NS), so it must not be trusted.
    """
    repo = new_repo(tmp_path / "repo")
    f = write(repo / "notes.txt", "aaaa\n")
    cache = TreeCache()
    first = scan_tree(repo, cache=cache)
    write(f, "bbbb\n")  # same size
    entry = cache.state(repo)["hashed"]["notes.txt"]
    entry[1] = list(stat_key(f.stat()))  # what a coarse clock would have left: identical stat data
    second = scan_tree(repo, cache=cache)
    assert second.id != first.id
    assert listing.blob_id(b"bbbb\n") in second.manifest.decode()
    # The same entry made long enough ago is trusted (the cache's premise: a later write would have
    # moved ctime), so stat data alone cannot tell the two contents apart: only the rule above does.
    old_enough = f.stat().st_ctime_ns + RACY_NS + 1
    kept = cache.state(repo)["hashed"]["notes.txt"]
    cache.state(repo)["hashed"]["notes.txt"] = [None, list(stat_key(f.stat())), old_enough, kept[3]]
    hashed: list[str] = []
    real = listing.hash_path
    monkeypatch.setattr(listing, "hash_path", lambda p: hashed.append(os.path.basename(p)) or real(p))
    write(repo / "other.txt", "a change elsewhere\n")
    third = scan_tree(repo, cache=cache)
    assert hashed == ["other.txt"]  # notes.txt's id came from the cache: its stat data vouched for it
    assert listing.blob_id(b"bbbb\n") in third.manifest.decode()


def test_an_in_place_edit_with_the_old_mtime_put_back_is_seen(tmp_path):
    repo = new_repo(tmp_path / "repo")
    f = write(repo / "notes.txt", "aaaa\n")
    cache = TreeCache()
    first = scan_tree(repo, cache=cache)
    for entry in cache.state(repo)["hashed"].values():
        entry[2] += 2 * RACY_NS  # the file had been written a while before it was hashed: trusted
    st = f.stat()
    with open(f, "r+b") as fh:  # same inode, same size
        fh.write(b"bbbb\n")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_ino == st.st_ino
    assert scan_tree(repo, cache=cache).id != first.id  # ctime moved: the change is seen


def test_a_damaged_cache_is_ignored(tmp_path):
    repo = new_repo(tmp_path / "repo", {"a.txt": "a\n"})
    scan_tree(repo, cache=TreeCache(tmp_path / "cache"))
    for f in (tmp_path / "cache").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    write(repo / "a.txt", "b\n")
    same_listing(scan_tree(repo, cache=TreeCache(tmp_path / "cache")), scan_tree(repo))


def test_submodules_are_listed_from_the_cache_too(tmp_path):
    lib = new_repo(tmp_path / "lib", {"lib.py": "V = 1\n"})
    repo = new_repo(tmp_path / "repo", {"main.py": "import lib\n"})
    subprocess.run(
        ["git", "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "vendor/lib"],
        cwd=repo, check=True, capture_output=True,
    )  # fmt: skip
    git(repo, "commit", "-q", "-m", "sub")
    cache = TreeCache(tmp_path / "cache")
    scan_tree(repo, cache=cache)
    write(repo / "vendor/lib/lib.py", "V = 2\n")
    write(repo / "vendor/lib/new.py", "N = 1\n")
    cached = scan_tree(repo, cache=TreeCache(tmp_path / "cache"))
    same_listing(cached, scan_tree(repo))
    assert cached.previous is not None and sorted(cached.previous[1]) == [
        "vendor/lib/lib.py",
        "vendor/lib/new.py",
    ]
    assert cached.repo.changed == ("vendor/lib",)  # the diff HEAD shows: the submodule, not its files
    git(repo / "vendor/lib", "add", "-A")  # the submodule's own index changes
    same_listing(scan_tree(repo, cache=TreeCache(tmp_path / "cache")), scan_tree(repo))


GIT_DIFF = [
    "diff",
    "HEAD",
    "--no-color",
    "--no-ext-diff",
    "--no-textconv",
    "--submodule=short",
    "--no-renames",
]


def test_the_provenance_diff_is_gits_and_rediffs_only_files_that_changed(tmp_path, monkeypatch):
    names = [f"f{i}.py" for i in range(30)] + ['odd "name"\t.py', "ünï.py", "sp ace.py"]
    repo = new_repo(tmp_path / "repo", {n: f"x = {i}\n" for i, n in enumerate(names)})
    git(repo, "config", "diff.noprefix", "true")  # a user's setting must not change what is recorded
    cache = TreeCache(tmp_path / "cache")
    diffed: list[list[str]] = []
    real = Git.out

    def out(self, args, cwd, **kw):
        if "diff" in args and "HEAD" in args:
            diffed.append(list(args[args.index("--") + 1 :]) if "--" in args else ["<all>"])
        return real(self, args, cwd, **kw)

    monkeypatch.setattr(Git, "out", out)

    def check() -> None:
        tree = scan_tree(repo, cache=cache)
        want = git(repo, "-c", "diff.noprefix=false", *GIT_DIFF)
        assert provenance.diff_head(tree, Git(), cache).decode() == want
        assert provenance.provenance(tree, "p", "", cache=cache)["diff"] == want

    write(repo / "f3.py", "x = 'edited'\n")
    (repo / "f4.py").unlink()
    write(repo / "f5.py", "x = 'staged'\n")
    git(repo, "add", "f5.py")
    write(repo / 'odd "name"\t.py', "quoted\n")
    write(repo / "ünï.py", "unicode\n")
    (repo / "f6.py").chmod(0o755)
    write(repo / "untracked.py", "not in a diff\n")
    check()
    assert diffed[-1] == sorted(["f3.py", "f4.py", "f5.py", "f6.py", 'odd "name"\t.py', "ünï.py"])
    diffed.clear()
    write(repo / "f3.py", "x = 'edited again'\n")
    check()
    assert diffed == [["f3.py"]]  # the one file edited since; the rest (and the second ask) cached
    diffed.clear()
    write(repo / "sp ace.py", "more\n")
    git(repo, "commit", "-q", "-am", "a commit: HEAD changed")
    write(repo / "f7.py", "after the commit\n")
    check()
    assert diffed[0] == ["f7.py"]


def test_with_many_dirty_files_a_resubmit_rediffs_what_changed_and_parses_no_manifest(tmp_path, monkeypatch):
    # Past 64 dirty files the keys of the cached parts came from parsing the whole manifest, every
    # resubmit (0.15 s at 50,000 files); the last listing's changes say which keys can be stale.
    repo = new_repo(tmp_path / "repo", {f"f{i}.py": f"x = {i}\n" for i in range(100)})
    cache = TreeCache(tmp_path / "cache")
    for i in range(80):
        write(repo / f"f{i}.py", f"x = 'dirty {i}'\n")
    want = git(repo, "-c", "diff.noprefix=false", *GIT_DIFF)
    assert provenance.diff_head(scan_tree(repo, cache=cache), Git(), cache).decode() == want
    write(repo / "f3.py", "x = 'edited again'\n")
    (repo / "f90.py").unlink()
    write(repo / "f5.py", "x = 5\n")  # clean again
    tree = scan_tree(repo, cache=cache)
    diffed: list[list[str]] = []
    parsed: list[int] = []
    real_out, real_rows = Git.out, manifest.manifest_rows

    def out(self, args, cwd, **kw):
        if "diff" in args and "HEAD" in args:
            diffed.append(list(args[args.index("--") + 1 :]) if "--" in args else ["<all>"])
        return real_out(self, args, cwd, **kw)

    monkeypatch.setattr(Git, "out", out)
    monkeypatch.setattr(manifest, "manifest_rows", lambda text: parsed.append(1) or real_rows(text))
    want = git(repo, "-c", "diff.noprefix=false", *GIT_DIFF)
    assert provenance.diff_head(tree, Git(), cache).decode() == want
    assert diffed == [["f3.py", "f90.py"]] and parsed == []


def test_an_rvignore_in_a_folder_that_holds_only_folders_applies(tmp_path):
    # rv 0.1 looked for .rvignore files only in folders holding a listed file directly: one kept out
    # of git (a personal one, say) in a folder of folders was never read, and the weights were sent.
    repo = new_repo(tmp_path / "repo", {"pkg/sub/model.py": "M = 1\n", ".gitignore": "pkg/.rvignore\n"})
    write(repo / "pkg/.rvignore", "*.bin\n")
    write(repo / "pkg/sub/weights.bin", b"\0" * 100)
    for cache in (None, TreeCache()):
        tree = scan_tree(repo, cache=cache)
        assert "pkg/sub/weights.bin" not in tree.paths and "pkg/sub/model.py" in tree.paths
        assert tree.ignored == (("pkg/sub/weights.bin", 100),)


def test_many_files_to_diff_go_through_an_index_of_their_own_with_gits_bytes(tmp_path, monkeypatch):
    # Past a few files, the parts come from diffing the work tree against an index holding only
    # HEAD's entries for them: no pathspec per file (git matches each against every index entry)
    # and no diff of every dirty file again. Each part must be exactly what `git diff HEAD` says.
    names = [f"d{i % 4}/f{i}.py" for i in range(60)] + ['odd "name"\t.py', "ünï.py", "link"]
    files = {n: f"x = {i}\n" for i, n in enumerate(names) if n != "link"}
    repo = new_repo(tmp_path / "repo", files)
    os.symlink("d0/f0.py", repo / "link")
    git(repo, "add", "link")
    git(repo, "commit", "-q", "-m", "a link")
    git(repo, "config", "core.splitIndex", "true")  # the diff's own index must not split into .git
    cache = TreeCache(tmp_path / "cache")
    for i in range(0, 40):
        write(repo / f"d{i % 4}/f{i}.py", f"x = 'edited {i}'\n")
    (repo / "d1/f41.py").unlink()  # deleted
    (repo / "d2/f42.py").chmod(0o755)  # mode only
    write(repo / "d3/f43.py", "x = 'staged'\n")
    git(repo, "add", "d3/f43.py")
    write(repo / "d3/f43.py", "x = 'staged, then edited'\n")
    write(repo / "new.py", "x = 'new, staged'\n")  # not in HEAD: by pathspec
    git(repo, "add", "new.py")
    write(repo / 'odd "name"\t.py', "quoted\n")
    write(repo / "ünï.py", "unicode\n")
    (repo / "link").unlink()
    os.symlink("d1/f1.py", repo / "link")
    before = set(os.listdir(repo / ".git"))
    diffed: list[list[str]] = []
    real = Git.out

    def out(self, args, cwd, **kw):
        if "diff" in args:
            what = list(args[args.index("--") + 1 :]) if "--" in args else ["<all>"]
            diffed.append(what if "HEAD" in args else ["<own index>"])
        return real(self, args, cwd, **kw)

    monkeypatch.setattr(Git, "out", out)
    # The route is taken by the size of git's pathspec matching (files to diff × files): a repo of
    # 50,000 files with 500 edited, scaled down.
    monkeypatch.setattr(provenance, "_DIFF_INDEX_MATCHES", 64 * 16)
    tree = scan_tree(repo, cache=cache)
    want = git(repo, "-c", "diff.noprefix=false", *GIT_DIFF)
    assert provenance.diff_head(tree, Git(), cache).decode() == want
    assert sorted(diffed) == [["<own index>"], ["new.py"]]
    assert set(os.listdir(repo / ".git")) == before  # nothing written into the repository
    diffed.clear()
    write(repo / "d0/f0.py", "x = 'again'\n")
    assert provenance.diff_head(scan_tree(repo, cache=cache), Git(), cache).decode() == git(
        repo, "-c", "diff.noprefix=false", *GIT_DIFF
    )
    assert diffed == [["d0/f0.py"]]  # a few files: by pathspec, the rest from the cache
