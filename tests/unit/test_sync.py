"""push / pull / watch: pure plans, and end to end through LocalTransport into a temp "cluster"."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_snapshot import git, new_repo, write
from test_snapshot_store import local_python_first, tree_state

from rv.errors import NotFound, UsageError
from rv.files.listing import MODE_EXEC, MODE_FILE, MODE_LINK, Entry, blob_id
from rv.files.pull import PullLedger, _PullWriter, plan_pull, pull
from rv.files.sync import (
    PushPlan,
    RemoteEntry,
    parse_size,
    plan_push,
    push,
    tree_id,
    watch,
)
from rv.files.treecache import TreeCache
from rv.remote.transport import LocalTransport

pytestmark = pytest.mark.usefixtures("hermetic_home")


@pytest.fixture
def transport() -> LocalTransport:
    return LocalTransport(env=local_python_first())


# -- parsers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("100MB", 100_000_000),
        ("1.5GB", 1_500_000_000),
        ("500M", 500_000_000),
        ("2GiB", 2 << 30),
        ("123", 123),
        ("10kb", 10_000),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_parse_size_rejects():
    with pytest.raises(UsageError, match="not a size"):
        parse_size("lots")


# -- push plan (pure) ----------------------------------------------------------------------------

T0 = 1_700_000_000_123_456_789  # not a whole second: see the whole-seconds test


def local_file(path: str, data: bytes, mtime: int = T0, mode: int = MODE_FILE) -> Entry:
    return Entry(path, mode, blob_id(data), len(data), mtime)


def remote_file(
    path: str, data: bytes, mtime: int = T0, mode: int = 0o644, hashed: bool = False
) -> RemoteEntry:
    return RemoteEntry(path, "f", mode, len(data), mtime, blob_id(data) if hashed else None)


def test_plan_push_cases():
    local = [
        local_file("same.txt", b"same"),
        local_file("new.txt", b"new"),
        local_file("changed.txt", b"after"),
        local_file("touched.txt", b"same content", mtime=T0 + 5),
        local_file("exec.sh", b"run", mode=MODE_EXEC),
        local_file("dir/now_file", b"x"),
        Entry("link", MODE_LINK, blob_id(b"same.txt"), 8),
        Entry("link_ok", MODE_LINK, blob_id(b"t"), 1),
    ]
    remote = [
        remote_file("same.txt", b"same"),
        RemoteEntry("changed.txt", "f", 0o644, 5, T0 + 1, blob_id(b"befor")),  # same size, other content
        RemoteEntry("touched.txt", "f", 0o644, 12, T0, blob_id(b"same content")),
        remote_file("exec.sh", b"run", mode=0o644),
        remote_file("stale.txt", b"old"),
        RemoteEntry("dir", "d", 0o755, 0, T0),
        RemoteEntry("gone", "d", 0o755, 0, T0),
        remote_file("gone/x", b"x"),
        RemoteEntry("outputs", "d", 0o755, 0, T0),
        remote_file("outputs/ckpt.pt", b"weights"),
        RemoteEntry("link", "f", 0o644, 3, T0),
        RemoteEntry("link_ok", "l", 0o777, 1, T0, "t"),
    ]
    plan = plan_push(local, remote, {"link": "same.txt", "link_ok": "t"}, protected={"outputs"})
    assert [e.path for e in plan.upload] == ["new.txt", "changed.txt", "dir/now_file"]  # dir/ was a folder
    assert plan.touch == (("touched.txt", T0 + 5),)
    assert plan.chmod == (("exec.sh", 0o755),)
    assert plan.symlink == (("link", "same.txt"),)
    assert plan.delete == ("gone/x", "stale.txt")
    assert plan.rmdir == ("gone",)
    assert plan.kept == ("outputs/ckpt.pt",)
    assert plan.unchanged == 3  # same.txt, exec.sh's content, link_ok


def test_plan_push_whole_seconds_mtime_counts_as_equal():
    # Some cluster file systems keep whole seconds: the mtime rv set comes back truncated.
    local = [local_file("a", b"x", mtime=T0)]
    remote = [remote_file("a", b"x", mtime=T0 - T0 % 10**9)]
    assert plan_push(local, remote, {}, set()).empty
    assert not plan_push(local, [remote_file("a", b"x", mtime=T0 - T0 % 10**9 + 1)], {}, set()).empty


def test_plan_lines_are_what_dry_run_prints():
    plan = PushPlan(
        upload=(local_file("b", b"12"),),
        delete=("a",),
        rmdir=("z",),
        chmod=(("c", 0o755),),
        symlink=(("l", "b"),),
    )
    assert plan.lines() == ["delete  a", "upload  b (2 B)", "chmod   c 755", "link    l -> b", "rmdir   z/"]


# -- push end to end -------------------------------------------------------------------------------


def test_push_mirrors_with_deletions_and_keeps_ignored_outputs(tmp_path, transport, layout):
    repo = new_repo(tmp_path / "repo", {"a.py": "a\n", "lib/b.py": "b\n", ".gitignore": "outputs/\n*.log\n"})
    write(repo / "run.sh", "#!/bin/sh\n", 0o755)
    (repo / "link").symlink_to("a.py")
    first = push(transport, layout, repo, "ws")
    dest = Path(layout.root) / "ws"
    assert first.applied and first.remote_resolved == str(dest)
    want = {"a.py", "lib/b.py", ".gitignore", "run.sh", "link"}
    assert set(tree_state(dest)) == want
    assert tree_state(dest) == {k: v for k, v in tree_state(repo).items() if k in want}
    # The cluster side grows outputs (ignored here) and a stray file; locally a file goes away.
    write(dest / "outputs/ckpt.pt", "weights")
    write(dest / "train.log", "log")
    write(dest / "stray.txt", "not in the repo")
    (repo / "lib/b.py").unlink()
    write(repo / "a.py", "a2\n")
    dry = push(transport, layout, repo, "ws", dry_run=True)
    assert not dry.applied
    assert dry.plan.lines() == ["upload  a.py (3 B)", "delete  lib/b.py", "rmdir   lib/", "delete  stray.txt"]
    assert (dest / "stray.txt").exists()  # a dry run changes nothing
    real = push(transport, layout, repo, "ws", force=True)
    assert real.plan.lines() == dry.plan.lines()
    assert set(tree_state(dest)) == {"a.py", ".gitignore", "run.sh", "link", "outputs/ckpt.pt", "train.log"}
    assert (dest / "a.py").read_text() == "a2\n" and not (dest / "lib").exists()
    assert push(transport, layout, repo, "ws").plan.empty


def test_push_outside_workspaces_needs_force_to_delete(tmp_path, transport, layout):
    repo = new_repo(tmp_path / "repo", {"a.py": "a\n"})
    target = tmp_path / "somewhere"
    write(target / "precious.txt", "do not lose me")
    with pytest.raises(UsageError, match=r"would delete 1 file\(s\) there that are not here: precious\.txt"):
        push(transport, layout, repo, str(target))
    assert (target / "precious.txt").exists() and not (target / "a.py").exists()


def test_push_default_is_the_branch_workspace_and_deletes_freely(tmp_path, transport, layout, monkeypatch):
    repo = new_repo(tmp_path / "repo", {"a.py": "a\n", "b.py": "b\n", "sub/c.py": "c\n"})
    git(repo, "checkout", "-q", "-b", "feature/x")
    monkeypatch.chdir(repo / "sub")  # anywhere in the repo: the whole repo is pushed
    first = push(transport, layout)
    (repo / "b.py").unlink()
    second = push(transport, layout)
    assert first.remote == second.remote
    assert first.remote.startswith(f"{layout.root}/workspaces/repo-") and first.remote.endswith("/feature_x")
    assert second.plan.delete == ("b.py",) and not (Path(first.remote) / "b.py").exists()
    assert (Path(first.remote) / "sub/c.py").read_text() == "c\n"


def test_push_same_content_new_mtime_only_touches(tmp_path, transport, layout):
    repo = new_repo(tmp_path / "repo", {"big.bin": "z" * 100_000})
    push(transport, layout, repo, "ws")
    st = (repo / "big.bin").stat()
    os.utime(repo / "big.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
    plan = push(transport, layout, repo, "ws").plan
    assert plan.upload == () and [p for p, _ in plan.touch] == ["big.bin"]
    assert (Path(layout.root) / "ws/big.bin").stat().st_mtime_ns == st.st_mtime_ns + 7_000_000_000


def test_push_refuses_large_files_before_connecting(tmp_path, layout):
    class NoNetwork:
        def __getattr__(self, name):
            raise AssertionError("push touched the transport before its local checks")

    repo = new_repo(tmp_path / "repo")
    write(repo / "weights.bin", b"\0" * 5000)
    with pytest.raises(UsageError, match=r"weights\.bin"):
        push(NoNetwork(), layout, repo, "ws", max_file_size=1000)


# -- pull ---------------------------------------------------------------------------------------


def test_plan_pull_cases():
    remote = [
        RemoteEntry("d", "d", 0o755, 0, T0),
        RemoteEntry("same", "f", 0o644, 4, T0),
        RemoteEntry("changed", "f", 0o644, 4, T0 + 1),
        RemoteEntry("new", "f", 0o644, 9, T0),
        RemoteEntry("link", "l", 0o777, 4, T0, "same"),
    ]

    def st(mode: int, size: int = 0, mtime: int = T0) -> SimpleNamespace:
        return SimpleNamespace(st_mode=mode, st_size=size, st_mtime_ns=mtime)

    local = {
        "d": None,
        "same": st(stat.S_IFREG | 0o644, 4),
        "changed": st(stat.S_IFREG | 0o644, 4),
        "new": None,
        "link": st(stat.S_IFLNK | 0o777, 4),
    }
    plan = plan_pull(tuple(remote), local, {"changed": "abc", "link": "same"})
    assert plan.download == (("changed", "abc"), ("new", None))
    assert plan.mkdir == ("d",) and plan.symlink == () and plan.unchanged == 2 and plan.total_bytes == 13


def test_pull_folder_sends_only_changed_and_new_files(tmp_path, transport, layout):
    src = Path(layout.root) / "jobs/7/output"
    for i in range(20):
        write(src / f"f{i}.txt", f"file {i}\n")
    write(src / "run.sh", "#!/bin/sh\n", 0o755)
    (src / "sub").mkdir()
    (src / "link").symlink_to("f1.txt")
    dest = tmp_path / "out"
    ledger = PullLedger(None)  # what rv pulled, so later pulls may replace those files
    first = pull(transport, layout, "jobs/7/output", dest, ledger=ledger)
    assert first.downloaded == 21 and tree_state(dest) == tree_state(src)
    assert (dest / "sub").is_dir()
    write(src / "f3.txt", "changed!\n")
    write(src / "new.txt", "new\n")
    os.utime(src / "f5.txt")  # newer mtime, same content: compared by blob id, not sent
    second = pull(transport, layout, "jobs/7/output", dest, ledger=ledger)
    assert (second.downloaded, second.downloaded_bytes) == (2, len("changed!\n") + len("new\n"))
    assert second.same_content == 1 and second.unchanged == 20 - 2 + 2  # 18 files + run.sh + link
    assert tree_state(dest) == tree_state(src)
    assert (dest / "f5.txt").stat().st_mtime_ns == (src / "f5.txt").stat().st_mtime_ns
    third = pull(transport, layout, "jobs/7/output", dest, ledger=ledger)
    assert third.downloaded == 0 and third.same_content == 0


def test_pull_single_file_into_a_folder_and_missing_path(tmp_path, transport, layout):
    write(Path(layout.root) / "logs/run-1.out", "hello\n")
    here = tmp_path / "here"
    here.mkdir()
    result = pull(transport, layout, "logs/run-1.out", here)
    assert result.local == here / "run-1.out" and (here / "run-1.out").read_text() == "hello\n"
    with pytest.raises(NotFound, match="does not exist on the cluster"):
        pull(transport, layout, "logs/nope.out", here)


def test_pull_stream_parser_handles_any_chunking(tmp_path):
    import struct

    from rv.agent import manifest

    def f_frame(idx: int, data: bytes) -> bytes:
        h = manifest.blob_hasher(len(data))
        h.update(data)
        return b"F" + struct.pack(">IQqI", idx, len(data), T0, 0o755) + data + h.digest() + b"\0"

    msg = b"Permission denied"
    stream = f_frame(0, b"abc" * 1000) + b"X" + struct.pack(">II", 1, len(msg)) + msg + f_frame(2, b"") + b"E"
    for size in (1, 7, len(stream)):
        dest = tmp_path / f"out{size}"
        dest.mkdir()
        w = _PullWriter(dest, ["a", "b", "c"], 3000, None)
        for i in range(0, len(stream), size):
            w.feed(stream[i : i + size])
        assert w.finished and (dest / "a").read_bytes() == b"abc" * 1000 and (dest / "c").read_bytes() == b""
        assert (dest / "a").stat().st_mode & 0o100 and (dest / "a").stat().st_mtime_ns == T0
        assert w.warnings == ["b: not downloaded (Permission denied)"]


# -- watch ------------------------------------------------------------------------------------------


def test_watch_pushes_once_per_burst_of_changes(tmp_path):
    # A scripted clock: the tree id each poll sees, and the pushes that result.
    ids = iter(["A", "A", "B", "C", "C", "C", "D", "D"])
    pushed: list[str] = []
    current = {"id": "A"}

    def current_id(cache):
        current["id"] = next(ids)
        return current["id"]

    class Result:
        def __init__(self, tid):
            self.tree_id = tid

    def push_once(cache):
        pushed.append(current["id"])
        return Result(current["id"])

    state = watch(push_once, current_id, sleep=lambda s: None, max_pushes=3)
    # Initial push (A); B then C arrives while debouncing: one push of C; then D settles: push D.
    assert pushed == ["A", "C", "D"] and state.pushes == 3


def test_watch_keeps_going_after_a_failed_push():
    ids = iter(["A", "B", "B", "C", "C"])
    outcomes = iter([UsageError("too big"), None, None])
    seen: list[str] = []

    class Result:
        tree_id = "C"

    def push_once(cache):
        exc = next(outcomes)
        if exc:
            raise exc
        return Result()

    state = watch(
        push_once,
        lambda c: next(ids),
        sleep=lambda s: None,
        on_error=lambda e: seen.append(str(e)),
        max_pushes=1,
    )
    assert seen == ["too big"] and state.pushes == 1


def test_tree_id_sees_edits_and_uses_the_cache(tmp_path):
    repo = new_repo(tmp_path / "repo", {"a": "1"})
    write(repo / "untracked.txt", "u")
    cache = TreeCache()
    first = tree_id(repo, cache=cache)
    assert "untracked.txt" in cache.state(repo)["hashed"] and tree_id(repo, cache=cache) == first
    time.sleep(0.01)
    write(repo / "untracked.txt", "v")
    assert tree_id(repo, cache=cache) != first
