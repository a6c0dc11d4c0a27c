"""Private by default, no surprise overwrites, visible progress: through LocalTransport and the real agent."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest
from test_snapshot import git, new_repo, write
from test_snapshot_store import local_python_first, tree_state

from rv.files.listing import redact_url
from rv.files.progress import TransferProgress
from rv.files.pull import PullConflict, PullLedger, pull
from rv.files.snapshot import make_snapshot
from rv.files.sync import push
from rv.layout import RemoteLayout
from rv.remote.transport import LocalTransport, TransferError

pytestmark = pytest.mark.usefixtures("hermetic_home")


@pytest.fixture
def transport() -> LocalTransport:
    return LocalTransport(env=local_python_first())


def modes_under(root: Path) -> dict[str, int]:
    """Permission bits of the root and everything under it (symlinks: their own, never followed)."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for dirpath, dirnames, files in os.walk(root):
        for name in dirnames + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode):
                out[os.path.relpath(p, root)] = stat.S_IMODE(st.st_mode)
    return out


def sample_repo(tmp_path: Path) -> Path:
    repo = new_repo(tmp_path / "repo", {"train.py": "print(1)\n", "lib/util.py": "x = 1\n"})
    write(repo / "run.sh", "#!/bin/sh\necho hi\n", 0o755)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "more")
    return repo


# -- private by default -------------------------------------------------------------------------------


def test_everything_a_snapshot_and_a_push_write_is_private(tmp_path, transport):
    root = tmp_path / "remote"
    root.mkdir(mode=0o755)  # as an older rv (or a user) left it: the agent narrows it
    layout = RemoteLayout(str(root))
    repo = sample_repo(tmp_path)
    make_snapshot(transport, layout, repo)
    push(transport, layout, repo, "workspaces/p/main")
    modes = modes_under(root)
    assert modes["."] == 0o700
    leaks = {p: oct(m) for p, m in modes.items() if m & 0o077}
    assert leaks == {}, leaks
    # Executables stay executable, for the user only.
    assert modes["workspaces/p/main/run.sh"] == 0o700
    assert modes["workspaces/p/main/train.py"] == 0o600


def test_share_with_group_lets_the_group_read_and_nobody_else(tmp_path, transport):
    root = tmp_path / "remote"
    layout = RemoteLayout(str(root), share_with_group=True)
    repo = sample_repo(tmp_path)
    make_snapshot(transport, layout, repo)
    push(transport, layout, repo, "workspaces/p/main")
    modes = modes_under(root)
    assert modes["."] == 0o750
    assert {p: oct(m) for p, m in modes.items() if m & 0o027} == {}
    assert modes["workspaces/p/main/train.py"] == 0o640


def test_uploaded_files_are_private_unless_the_group_may_read(tmp_path):
    src = write(tmp_path / "tool.sh", "#!/bin/sh\n", 0o775)
    LocalTransport().put_file(src, str(tmp_path / "a"))
    LocalTransport().put_bytes(b"x", str(tmp_path / "b"), mode=0o644)
    LocalTransport(mask=0o027).put_bytes(b"x", str(tmp_path / "c"), mode=0o666)
    assert [stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in "abc"] == [0o700, 0o600, 0o640]


@pytest.mark.parametrize(
    ("url", "clean"),
    [
        ("https://user:ghp_token123@github.com/org/repo.git", "https://github.com/org/repo.git"),
        ("https://ghp_token123@github.com/org/repo.git", "https://github.com/org/repo.git"),
        ("http://u:p@host:8080/x", "http://host:8080/x"),
        ("ssh://git:hunter2@host.example/x.git", "ssh://git@host.example/x.git"),
        ("ssh://git@host.example/x.git", "ssh://git@host.example/x.git"),
        ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
        ("/local/path/repo", "/local/path/repo"),
        (None, None),
    ],
)
def test_remote_urls_lose_their_credentials(url, clean):
    assert redact_url(url) == clean


def test_the_manifest_on_the_cluster_holds_no_token(tmp_path, transport):
    repo = sample_repo(tmp_path)
    git(repo, "remote", "add", "origin", "https://me:ghp_SECRET42@github.com/me/repo.git")
    write(repo / "train.py", "print(2)\n")  # dirty: the diff is recorded too
    result = make_snapshot(transport, RemoteLayout(str(tmp_path / "remote")), repo)
    meta = Path(result.meta_path).read_text()
    assert "ghp_SECRET42" not in meta
    assert json.loads(meta)["provenance"]["remote_url"] == "https://github.com/me/repo.git"
    assert "ghp_SECRET42" not in json.dumps(result.provenance)
    assert stat.S_IMODE(os.stat(result.meta_path).st_mode) == 0o400


# -- progress -------------------------------------------------------------------------------------------


def _check_progress(events: list[TransferProgress], what: str, files: int, nbytes: int) -> None:
    assert events, "no progress reported"
    assert {e.what for e in events} == {what}
    assert all(e.files_total == files and e.bytes_total == nbytes for e in events)
    done = [e.bytes_done for e in events]
    assert done == sorted(done)  # never goes backwards
    assert events[-1].finished and (events[-1].files_done, events[-1].bytes_done) == (files, nbytes)


def test_snapshot_push_and_pull_report_files_and_bytes(tmp_path, transport, layout):
    repo = sample_repo(tmp_path)
    write(repo / "data.bin", os.urandom(3_000_000))  # several MiB chunks
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "data")
    events: list[TransferProgress] = []
    snap = make_snapshot(transport, layout, repo, on_progress=events.append)
    _check_progress(events, "upload", snap.new_objects, snap.new_bytes)

    events = []
    pushed = push(transport, layout, repo, "workspaces/p/main", on_progress=events.append)
    _check_progress(events, "upload", len(pushed.plan.upload), pushed.plan.upload_bytes)

    events = []
    pulled = pull(transport, layout, "workspaces/p/main", tmp_path / "back", on_progress=events.append)
    _check_progress(events, "download", pulled.downloaded, pulled.downloaded_bytes)
    assert pulled.downloaded == 4  # train.py, lib/util.py, run.sh, data.bin


def test_the_renderer_draws_nothing_on_a_pipe(capsys):
    from rv.cli.common import progress_renderer

    with progress_renderer("uploading", delay=0) as update:
        update(TransferProgress("upload", 0, 2, 0, 10))
        update(TransferProgress("upload", 2, 2, 10, 10))
    assert capsys.readouterr() == ("", "")


# -- pull never overwrites work ----------------------------------------------------------------------------


def _results(layout: RemoteLayout) -> Path:
    src = Path(layout.root) / "jobs/7/output"
    for name in ("a.txt", "b.txt", "c.txt"):
        write(src / name, f"cluster {name}\n")
    return src


def _local_state(folder: Path) -> dict[str, tuple]:
    return {
        p: (*v, os.lstat(folder / p).st_mtime_ns) for p, v in tree_state(folder).items()
    }  # content, kind and mtime of every file


def test_pull_refuses_to_overwrite_local_edits_and_changes_nothing(tmp_path, transport, layout):
    src = _results(layout)
    dest = tmp_path / "out"
    ledger = PullLedger(tmp_path / "pulled.json")
    pull(transport, layout, "jobs/7/output", dest, ledger=ledger)
    write(dest / "a.txt", "my notes, not the cluster's\n")  # edited here since the pull
    write(dest / "mine.txt", "only here\n")
    for name in ("a.txt", "b.txt", "c.txt"):
        write(src / name, f"cluster {name}, second run\n")  # everything changed on the cluster too
    before = _local_state(dest)
    with pytest.raises(PullConflict) as info:
        pull(transport, layout, "jobs/7/output", dest, ledger=PullLedger(tmp_path / "pulled.json"))
    assert info.value.paths == ["a.txt"]
    assert "--force" in (info.value.hint or "") and "--keep-local" in (info.value.hint or "")
    assert _local_state(dest) == before  # nothing local changed, not even b.txt

    kept = pull(
        transport, layout, "jobs/7/output", dest, on_conflict="keep-local", ledger=PullLedger(ledger.path)
    )
    assert kept.kept_local == ("a.txt",) and kept.downloaded == 2
    assert (dest / "a.txt").read_text() == "my notes, not the cluster's\n"
    assert (dest / "b.txt").read_text() == "cluster b.txt, second run\n"

    forced = pull(
        transport, layout, "jobs/7/output", dest, on_conflict="force", ledger=PullLedger(ledger.path)
    )
    assert forced.overwritten == ("a.txt",)
    assert (dest / "a.txt").read_text() == "cluster a.txt, second run\n"
    assert (dest / "mine.txt").read_text() == "only here\n"  # not on the cluster: left alone


def test_a_file_never_pulled_is_not_overwritten_but_an_identical_one_is_fine(tmp_path, transport, layout):
    _results(layout)
    dest = tmp_path / "out"
    write(dest / "a.txt", "something else\n")  # was there before any pull
    write(dest / "b.txt", "cluster b.txt\n")  # same content, another mtime: only touched
    with pytest.raises(PullConflict) as info:
        pull(transport, layout, "jobs/7/output", dest, ledger=PullLedger(None))
    assert info.value.paths == ["a.txt"]


def test_an_interrupted_pull_leaves_no_half_file(tmp_path, transport, layout):
    src = Path(layout.root) / "big"
    write(src / "huge.bin", os.urandom(4_000_000))
    dest = tmp_path / "out"
    write(dest / "huge.bin", b"old content")
    ledger = PullLedger(None)
    ledger.record(dest / "huge.bin", None)  # rv's own earlier copy: may be replaced

    def stop(p: TransferProgress) -> None:
        if 0 < p.bytes_done < p.bytes_total:
            raise KeyboardInterrupt  # Ctrl-C half way through the file

    with pytest.raises(KeyboardInterrupt):
        pull(transport, layout, "big", dest, on_progress=stop, ledger=ledger)
    assert (dest / "huge.bin").read_bytes() == b"old content"
    assert sorted(os.listdir(dest)) == ["huge.bin"]  # no temp file left behind


# -- uploads never hang ---------------------------------------------------------------------------------


def test_a_local_read_error_mid_upload_stops_the_command(tmp_path):
    def data():
        yield b"x" * 100_000
        raise OSError(5, "Input/output error")

    result: list[BaseException] = []

    def run() -> None:
        try:
            LocalTransport().run("cat > /dev/null; sleep 30", stdin=data())
        except BaseException as exc:
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)  # a liveness bound, not a timing claim: without the fix this waits for ever
    assert not t.is_alive(), "the upload hung after a local read error"
    assert isinstance(result[0], TransferError) and "Input/output error" in str(result[0])
    leftover = subprocess.run(["pgrep", "-f", "cat > /dev/null; sleep 30"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


# -- the agent's compiled code is cached on the cluster --------------------------------------------------


def test_the_agent_is_compiled_once_and_a_damaged_cache_is_rebuilt(tmp_path, transport, layout):
    from rv.files.sync import scan_remote

    cache = Path(os.environ["HOME"]) / ".cache" / "rv" / "agent"
    (Path(layout.root) / "d").mkdir(parents=True)
    scan_remote(transport, layout, "d")
    [compiled] = list(cache.iterdir())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and stat.S_IMODE(compiled.stat().st_mode) == 0o600
    first = compiled.stat().st_mtime_ns
    assert scan_remote(transport, layout, "d").kind == "dir"
    assert compiled.stat().st_mtime_ns == first  # read, not rewritten
    compiled.write_bytes(b"not marshal data")
    assert scan_remote(transport, layout, "d").kind == "dir"  # recompiled from the sources sent along
    assert compiled.read_bytes() != b"not marshal data"
