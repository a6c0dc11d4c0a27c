"""The git store on the cluster, through the `rv` program as the cluster's ordinary user, on both layouts.

A scratch filesystem's purge deletes files one by one and leaves the folders: here the store loses
its files of every kind (a pack, its index, the snapshot refs, the meta files, rv's runtime files)
while a job waits in the queue. That job must stop before its program with the missing paths and the
fix; the next `rv run` must find what the store lacks, send it, and run the program on the whole tree.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

from projects import git_project, wait_for
from test_runs import submitted

PROGRAM = "import app.util\nprint('program ran:', app.util.X)\n"


def run_folder(remote_root: str, name: str) -> Path:
    for meta in Path(remote_root, "runs").glob("*/run.json"):
        if json.loads(meta.read_text()).get("name") == name:
            return meta.parent
    raise AssertionError(f"no run named {name} under {remote_root}")


def ended(remote_root: str, name: str) -> dict:
    return wait_for(
        lambda: (f := run_folder(remote_root, name) / "ENDED").exists() and json.loads(f.read_text()),
        180, f"run {name} to end", step=0.5,
    )  # fmt: skip


def pack_types(pack: Path) -> set[str]:
    """The kinds of object a pack holds, as git's verify-pack lists them."""
    out = subprocess.run(
        ["git", "verify-pack", "-v", str(pack.with_suffix(".idx"))], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return {
        line.split()[1]
        for line in out.stdout.splitlines()
        if len(line.split()) > 2 and len(line.split()[0]) == 40
    }


def logs(folder: Path) -> tuple[str, str]:
    out = "".join(p.read_text(errors="replace") for p in folder.glob("logs/*.out"))
    err = "".join(p.read_text(errors="replace") for p in folder.glob("logs/*.err"))
    return out, err


def test_a_purged_store_stops_the_job_before_its_program_and_the_next_run_mends_it(layout, tmp_path):
    proj = git_project(
        tmp_path / "p",
        {"main.py": PROGRAM, "app/__init__.py": "", "app/util.py": "X = 42\n", "README": "r\n"},
    )
    first = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "main.py", cwd=proj, timeout=300
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "program ran: 42" in first.stdout
    store = Path(layout.remote_root, "store.git")
    packs = {p: pack_types(p) for p in store.glob("objects/pack/pack-*.pack")}
    # The commit and its trees; then the blobs the store lacked.
    assert sorted(packs.values()) == [{"blob"}, {"commit", "tree"}]

    # The same snapshot again, held in the queue for a while; meanwhile the blobs' pack goes.
    held = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "held", "--sbatch=--begin=now+15", "--",
        "python3", "main.py", cwd=proj,
    )  # fmt: skip
    submitted(held)
    assert "already on the cluster, nothing to send" in held.stderr
    (blobs_pack,) = (p for p, types in packs.items() if types == {"blob"})
    blobs_pack.unlink()
    blobs_pack.with_suffix(".idx").unlink()
    record = ended(layout.remote_root, "held")
    out, err = logs(run_folder(layout.remote_root, "held"))
    assert "program ran" not in out, out
    assert record.get("exit_code") != 0
    assert "the store lost 4 file(s) of snapshot" in err and "so the program was not started" in err, err
    for path in ("main.py", "app/util.py", "app/__init__.py", "README"):
        assert path in err
    assert "run `rv run` again from your machine" in err

    # Now everything else of rv's goes too, file by file: the other pack and its index, the refs,
    # the meta files, the job's runtime. Folders stay.
    root = Path(layout.remote_root)
    gone = [
        *store.glob("objects/pack/*"), *store.glob("refs/rv/snapshots/*"), store / "packed-refs",
        *root.glob("snapshots/*.json"), *root.glob("runtime/*"),
    ]  # fmt: skip
    for p in gone:
        if p.exists():
            p.unlink()
    assert (store / "objects" / "pack").is_dir() and Path(layout.remote_root, "runtime").is_dir()
    again = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "main.py", cwd=proj, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "program ran: 42" in again.stdout
    assert "4 new objects" in again.stderr  # every file sent again, found missing by the store's check
    # Whole again: a third run sends nothing.
    third = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "main.py", cwd=proj, timeout=300
    )
    assert third.returncode == 0 and "program ran: 42" in third.stdout
    assert "already on the cluster, nothing to send" in third.stderr


def test_a_run_with_nothing_changed_checks_the_snapshot_is_whole_before_it_sends_nothing(layout, tmp_path):
    """A run with nothing changed asks the store, in its check, whether it holds the snapshot whole,
    and then sends nothing; a pack gone since the snapshot was verified (its ref and meta stay) makes
    the check walk again, find the blobs lacking, and the run send them before its job starts."""
    proj = git_project(
        tmp_path / "p",
        {"main.py": PROGRAM, "app/__init__.py": "", "app/util.py": "X = 42\n", "README": "r\n"},
    )
    store = Path(layout.remote_root, "store.git")

    def run() -> subprocess.CompletedProcess:
        r = layout.run_rv(
            "run", "-g", "0", "--mem", "200M", "-f", "--", "python3", "main.py", cwd=proj, timeout=300
        )
        assert r.returncode == 0 and "program ran: 42" in r.stdout, r.stderr[-2000:]
        return r

    first = run().stderr
    assert "4 new objects" in first
    sid = re.search(r"snapshot ([0-9a-f]{12}):", first).group(1)  # type: ignore[union-attr]
    (meta,) = Path(layout.remote_root, "snapshots").glob(f"{sid}*.json")
    used = meta.stat().st_mtime
    time.sleep(1.1)
    assert "already on the cluster, nothing to send" in run().stderr
    assert meta.stat().st_mtime > used  # "last used", for rv gc, as an upload would mark it

    (blobs,) = (p for p in store.glob("objects/pack/pack-*.pack") if pack_types(p) == {"blob"})
    for p in store.glob(f"objects/pack/{blobs.stem}.*"):
        p.unlink()
    assert list(store.glob("refs/rv/snapshots/*")) or (store / "packed-refs").exists()
    assert "4 new objects" in run().stderr  # found lacking by the check's walk, sent again
    res = layout.ssh.run(f"git --git-dir={shlex.quote(str(store))} fsck --full --strict --no-progress")
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "already on the cluster, nothing to send" in run().stderr


def test_rv_status_says_which_git_the_cluster_has(layout):
    r = layout.run_rv("status", "--json")
    assert r.returncode == 0, r.stderr
    git = json.loads(r.stdout)["git"]
    version = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout.split()[-1]
    assert git == {"version": version, "problem": None}  # loopback: the cluster's git is this machine's
    text = layout.run_rv("status").stdout
    assert f"git          {version} on the login node" in text


def test_a_snapshot_whose_pack_went_or_was_replaced_after_it_was_verified_is_verified_again(layout, tmp_path):
    """The store remembers a snapshot it found whole (store.git/rv-verified) while the files its
    objects were found in stay as they were; a pack gone or replaced since makes it walk again."""
    proj = git_project(
        tmp_path / "p",
        {"main.py": PROGRAM, "app/__init__.py": "", "app/util.py": "X = 42\n", "README": "r\n"},
    )
    store = Path(layout.remote_root, "store.git")

    def snapshot() -> str:
        r = layout.run_rv("sync", "snapshot", cwd=proj)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stderr

    def fsck() -> None:
        res = layout.ssh.run(f"git --git-dir={shlex.quote(str(store))} fsck --full --strict --no-progress")
        assert res.exit_code == 0, res.stdout + res.stderr

    def blobs_pack() -> Path:
        (pack,) = (p for p in store.glob("objects/pack/pack-*.pack") if pack_types(p) == {"blob"})
        return pack

    assert "4 new objects" in snapshot()
    assert (store / "rv-verified").exists()  # found whole, remembered
    assert "already on the cluster, nothing to send" in snapshot()

    # Removed after it was verified: the blobs' pack and its index go (a purge), the ref stays.
    gone = blobs_pack()
    for p in store.glob(f"objects/pack/{gone.stem}.*"):
        p.unlink()
    assert "4 new objects" in snapshot()  # walked again, found lacking, sent again
    fsck()

    # Replaced after it was verified: the blobs' pack by one of the same blobs but app/util.py's.
    util = subprocess.run(
        ["git", "hash-object", "--stdin"], input="X = 42\n", capture_output=True, text=True, check=True
    ).stdout.strip()
    old = blobs_pack()
    q = shlex.quote
    replace = (
        f"cd {q(str(store))} && git show-index < {q(str(old.with_suffix('.idx')))} | cut -d' ' -f2 "
        f"| grep -v {util} | git --git-dir=. pack-objects -q objects/pack/pack >/dev/null && "
        f"rm -f {q(str(old))} {q(str(old.with_suffix('.idx')))} {q(str(old.with_suffix('.rev')))}"
    )
    res = layout.ssh.run(replace)
    assert res.exit_code == 0, res.stdout + res.stderr
    assert pack_types(blobs_pack()) == {"blob"} and blobs_pack() != old
    assert "1 new object " in snapshot()  # app/util.py's blob, found lacking by the walk
    fsck()
    assert "already on the cluster, nothing to send" in snapshot()


def blob_entry(store: Path, oid: str) -> list[str]:
    """The store's pack entry of object ``oid`` as verify-pack lists it: 7 fields for a delta (its
    depth and base last), 5 for an object stored whole."""
    for pack in store.glob("objects/pack/pack-*.pack"):
        out = subprocess.run(
            ["git", "verify-pack", "-v", str(pack.with_suffix(".idx"))], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        for line in out.stdout.splitlines():
            if line.startswith(oid + " "):
                return line.split()
    raise AssertionError(f"{oid} is in no pack of {store}")


def test_an_edit_goes_as_the_measured_link_wants(layout, tmp_path):
    """A first upload large enough measures the link and keeps its rate in the cache folder; an edit
    then goes whole where the link is fast and as a delta where it is slow, and the store is sound."""
    text = "".join(f"{i:08x} {i * 2654435761 % 2**32:08x}\n" for i in range(300_000))  # 5.1 MB
    proj = git_project(tmp_path / "p", {"main.py": PROGRAM, "data/big.txt": text})
    store = Path(layout.remote_root, "store.git")

    def snapshot() -> dict:
        r = layout.run_rv("sync", "snapshot", "--json", cwd=proj)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    def edit(line: str) -> str:
        with open(proj / "data/big.txt", "a") as fh:
            fh.write(line)
        got = subprocess.run(["git", "hash-object", "data/big.txt"], cwd=proj, capture_output=True, text=True)
        return got.stdout.strip()

    snapshot()
    (rate_file,) = Path(layout.rv_env["HOME"]).glob(".cache/rv/links/*")
    measured = json.loads(rate_file.read_text())
    assert measured["bytes"] >= 5_000_000 and measured["bytes_per_s"] > 0

    def link(rate: float) -> None:  # what an upload over such a link would have measured
        rate_file.write_text(json.dumps({**measured, "bytes_per_s": rate}))

    link(1e9)  # a fast link: the edited file whole, no delta work on either side
    fast = edit("one more line\n")
    first_edit = snapshot()
    assert len(blob_entry(store, fast)) == 5
    link(1e6)  # a slow one: the file as a delta of the version the store holds
    slow = edit("two more lines\n\n")
    second_edit = snapshot()
    entry = blob_entry(store, slow)
    assert len(entry) == 7 and int(entry[3]) < 1000
    res = layout.ssh.run(f"git --git-dir={shlex.quote(str(store))} fsck --full --strict --no-progress")
    assert res.exit_code == 0, res.stdout + res.stderr
    for result, oid in ((first_edit, fast), (second_edit, slow)):
        res = layout.ssh.run(
            f"git --git-dir={shlex.quote(str(store))} rev-parse {result['ref']}:data/big.txt"
        )
        assert res.out.strip() == oid
