"""The git store damaged and collected, through the `rv` program on both layouts, on a store that saw
several runs: a pack with bytes written over (every file still there), and `rv gc` after old runs
went (git's gc explodes unreachable objects into loose files; a ref to a purged pack fails it).
Each ends with `git fsck --full --strict` clean, run on the cluster as its user.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from projects import git_project, wait_for
from test_store import ended, logs, run_folder

pytestmark = pytest.mark.integration

PROGRAM = (
    "import hashlib\nprint('program ran:', hashlib.sha256(open('data/b.txt', 'rb').read()).hexdigest())\n"
)


def text(seed: str, size: int) -> str:
    """``size`` characters of text no other seed gives (so each file is a blob of its own)."""
    out, i = [], 0
    while sum(map(len, out)) < size:
        out.append(hashlib.sha256(f"{seed}{i}".encode()).hexdigest() + "\n")
        i += 1
    return "".join(out)[:size]


def fsck(layout) -> None:
    """git's strictest check of the store, as the cluster's user (the store is that user's)."""
    store = shlex.quote(f"{layout.remote_root}/store.git")
    res = layout.ssh.run(f"git --git-dir={store} fsck --full --strict --no-progress")
    assert res.exit_code == 0, res.stdout + res.stderr


def store_files(layout) -> tuple[int, int]:
    """(files and folders under the store, loose objects): what a file quota counts."""
    store = Path(layout.remote_root, "store.git")
    entries = sum(len(dirs) + len(files) for _d, dirs, files in os.walk(store))
    loose = sum(1 for p in store.glob("objects/??/*"))
    return entries, loose


def run(layout, proj: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", name, *extra, "-f", "--", "python3", "main.py",
        cwd=proj, timeout=300,
    )  # fmt: skip


def entry_of(store: Path, oid: str) -> tuple[Path, int, int]:
    """(pack, offset, bytes in the pack) of object ``oid``, as git's verify-pack lists it."""
    for idx in store.glob("objects/pack/pack-*.idx"):
        out = subprocess.run(["git", "verify-pack", "-v", str(idx)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            f = line.split()
            if f and f[0] == oid:
                return idx.with_suffix(".pack"), int(f[4]), int(f[3])
    raise AssertionError(f"{oid} is in no pack of {store}")


def blob_id(data: str) -> str:
    raw = data.encode()
    return hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest()


def test_a_damaged_pack_stops_the_job_naming_the_damaged_files_and_the_next_run_sends_them(layout, tmp_path):
    b = text("b", 40_000)
    files = {"main.py": PROGRAM, "app/util.py": "X = 1\n", "README": "r\n", "data/a.txt": text("a1", 40_000),
             "data/b.txt": b, "data/c.txt": text("c", 3000)}  # fmt: skip
    proj = git_project(tmp_path / "p", files)
    want = f"program ran: {hashlib.sha256(b.encode()).hexdigest()}"
    first = run(layout, proj, "one")
    assert first.returncode == 0 and want in first.stdout, first.stderr[-2000:]
    # A second snapshot, sent against the first: the store saw several runs and holds several packs.
    (proj / "data" / "a.txt").write_text(text("a2", 40_000))
    (proj / "README").write_text("r2\n")
    second = run(layout, proj, "two")
    assert second.returncode == 0 and want in second.stdout, second.stderr[-2000:]

    # Bytes written over in the middle of data/b.txt's entry (sent by the first run); its pack holds
    # the first data/a.txt too, which the snapshot no longer has.
    store = Path(layout.remote_root, "store.git")
    pack, offset, size = entry_of(store, blob_id(b))
    before = pack.stat().st_size
    with open(pack, "r+b") as fh:
        fh.seek(offset + size // 2)
        fh.write(b"X" * 32)
    assert pack.stat().st_size == before  # every file is there, of its size

    third = run(layout, proj, "damaged")
    assert "already on the cluster, nothing to send" in third.stderr  # the laptop cannot tell
    record = ended(layout.remote_root, "damaged")
    out, err = logs(run_folder(layout.remote_root, "damaged"))
    assert third.returncode != 0 and record.get("exit_code") != 0
    assert "program ran" not in out + third.stdout  # never on wrong bytes
    (line,) = [x for x in err.splitlines() if "damaged in the store" in x]
    assert re.search(r"1 object\(s\) of snapshot \w+ are damaged in the store", line), line
    # The damaged file, and only it: not the files git never reached once it stopped.
    names = line.split("wrote over them): ", 1)[1].split(";", 1)[0]
    assert names == "data/b.txt", line
    assert "the program was not started" in line and "run `rv run` again" in line
    # The pack is set aside whole, not deleted; git no longer sees it.
    assert not pack.exists() and not pack.with_suffix(".idx").exists()
    (aside,) = store.glob(f"rv-damaged/*/{pack.name}")
    assert aside.stat().st_size == before and aside.with_suffix(".idx").exists()

    # The next run finds what the store lacks and sends it; the program runs on the right bytes.
    fourth = run(layout, proj, "healed")
    assert fourth.returncode == 0, fourth.stderr[-2000:]
    assert want in fourth.stdout
    assert "; 1 new object (40.0 kB) to send;" in fourth.stderr, fourth.stderr  # data/b.txt alone
    fsck(layout)


def test_gc_after_old_runs_keeps_the_store_packed_and_drops_a_ref_to_a_purged_pack(layout, tmp_path):
    def version(v: int) -> dict[str, str]:
        # 150 files, every one new in each version: 150 objects each snapshot alone reaches.
        return {
            "main.py": "print('program ran')\n",
            **{f"src/f{i:03d}.txt": text(f"{v}-{i}", 200) for i in range(150)},
        }

    proj = git_project(tmp_path / "p", version(1))
    for v in (1, 2, 3):
        if v > 1:
            git_project(proj, version(v))  # a commit of its own: the snapshot is a new one
        r = run(layout, proj, f"v{v}")
        assert r.returncode == 0 and "program ran" in r.stdout, r.stderr[-2000:]
    root = Path(layout.remote_root)
    old = time.time() - 7200
    for meta in root.glob("snapshots/*.git.json"):
        os.utime(meta, (old, old))  # the snapshots were last used 2 h ago; their packs are recent
    files_before, loose_before = store_files(layout)
    assert loose_before == 0

    report = layout.run_rv("gc", "--older-than", "0", "--json")
    assert report.returncode == 0, report.stderr[-2000:]
    data = json.loads(report.stdout)
    assert len(data["removed"]) == 3 and len(data["runs_removed"]) == 3
    files_after, loose_after = store_files(layout)
    # Unreachable objects younger than the grace stay, packed (a cruft pack), never loose.
    assert loose_after == 0, f"{loose_after} loose objects after gc"
    assert files_after <= files_before, (files_before, files_after)
    assert (data["store_files_before"], data["store_files_after"]) == (files_before, files_after)
    assert f"the store went from {files_before:,} to {files_after:,} files" in report.stderr
    fsck(layout)

    # A snapshot whose objects a purge took (its blobs' pack and index deleted, its ref left), while
    # another is old enough to go: git's gc would fail on the ref ("unable to read ...").
    git_project(proj, version(4))
    r = run(layout, proj, "v4")
    assert r.returncode == 0, r.stderr[-2000:]
    sid = json.loads((run_folder(layout.remote_root, "v4") / "run.json").read_text())["snapshot"]
    store = root / "store.git"
    newest = max(store.glob("objects/pack/pack-*.pack"), key=lambda p: p.stat().st_mtime)
    newest.with_suffix(".idx").unlink()  # v4's pack, sent against the others: its commit and blobs
    newest.unlink()
    git_project(proj, version(3))
    again = run(layout, proj, "v3-again")
    assert again.returncode == 0 and "program ran" in again.stdout, again.stderr[-2000:]
    for meta in root.glob("snapshots/*.git.json"):
        if sid not in meta.name:
            os.utime(meta, (old, old))  # v3's snapshot goes this time; v4's was used a moment ago
    second = layout.run_rv("gc", "--older-than", "0", "--json")
    assert second.returncode == 0, second.stderr[-2000:]
    data = json.loads(second.stdout)
    assert data.get("broken_removed") == [sid], data
    assert f"snapshot {sid} had lost objects" in second.stderr
    assert store_files(layout)[1] == 0
    fsck(layout)
    # The next run of that snapshot sends what the purge took.
    git_project(proj, version(4))
    healed = run(layout, proj, "v4-again")
    assert healed.returncode == 0 and "program ran" in healed.stdout, healed.stderr[-2000:]
    fsck(layout)


def test_a_jobs_background_gc_that_fails_says_so_in_rv_status(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"main.py": "import time\nprint('program ran')\ntime.sleep(5)\n"})
    first = run(layout, proj, "one")
    assert first.returncode == 0, first.stderr[-2000:]
    store = Path(layout.remote_root, "store.git")
    # A setting git's gc cannot parse (a hand edit, a newer git's value): it fails whatever rv mends.
    config = (store / "config").read_text()
    (store / "config").write_text(config + "[gc]\n\tpruneExpire = not-a-date\n")
    (proj / "main.py").write_text("import time\nprint('program ran again')\ntime.sleep(5)\n")
    second = run(layout, proj, "two")
    assert second.returncode == 0 and "program ran again" in second.stdout, second.stderr[-2000:]
    failed = wait_for(lambda: (store / "rv-gc-failed").exists() and (store / "rv-gc-failed").read_text(),
                      60, "the job's background gc to write its failure")  # fmt: skip
    assert "git gc --auto failed" in failed and "gc.pruneexpire" in failed, failed
    status = layout.run_rv("status")
    assert status.returncode == 0, status.stderr[-2000:]
    assert "store gc   FAILED in a job: " in status.stdout and "git gc --auto failed" in status.stdout
    data = json.loads(layout.run_rv("status", "--json").stdout)
    assert "git gc --auto failed" in data["git"]["background_gc_failed"]
    # Mended (the setting gone), rv gc collects and the failure is forgotten.
    (store / "config").write_text(config)
    assert layout.run_rv("gc", "--older-than", "0").returncode == 0
    assert not (store / "rv-gc-failed").exists()
    assert "store gc" not in layout.run_rv("status").stdout
    fsck(layout)
