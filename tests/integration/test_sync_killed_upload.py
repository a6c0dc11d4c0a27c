"""A first upload of many files killed with SIGKILL at random points, again and again.

After every kill the store (a git repository) is sound by git's own check (fsck), holds no
snapshot ref, no quarantine and no temp file: only whole packs. The next sync completes it sending
exactly the blobs still missing. The store is read on the cluster, over SSH, by a script of this
test's own (git's commands, not rv's code); the loopback cluster's disk is this machine's, so the
test also watches the packs arrive to kill at a chosen point.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import signal
import subprocess
import time
from pathlib import Path

from projects import git_project, store_state, wait_for

from tests.integration.conftest import RV_PROGRAM

FILES = 3000  # 40 kB each, 120 MB: packs of 32 MB, so some land whole before a kill
KILLS = 6


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def landed(pack_dir: Path) -> int:
    """Whole packs in the store now (read directly: the loopback cluster's disk is this machine's)."""
    return sum(1 for _ in pack_dir.glob("pack-*.idx")) if pack_dir.is_dir() else 0


def test_a_first_upload_killed_at_random_points_leaves_the_store_sound_and_the_rerun_sends_the_rest(
    layout, tmp_path
):
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    files = {}
    for i in range(FILES):
        # Unique contents (the index is in each), so every file is an object of its own.
        files[f"pkg{i % 30:02d}/mod{i % 7}/file{i:05d}.py"] = f"# {i}\n" + "x = 1\n" * rng.randint(5000, 8000)
    repo = git_project(tmp_path / "many", files)
    want = {blob_id(text.encode()) for text in files.values()}
    pack_dir = Path(layout.remote_root) / "store.git" / "objects" / "pack"
    kills = []
    for attempt in range(3 * KILLS):  # an upload that ends before its kill empties the store (below)
        if len(kills) == KILLS:
            break
        before = landed(pack_dir)
        # A third of the kills at a random moment from the start (listing, the first call, the
        # first pack), the rest once a random number of packs more has landed.
        by_count = attempt % 3 != 0
        target = before + rng.randint(1, 3)
        delay = rng.uniform(0.0, 2.0)
        proc = subprocess.Popen(
            [str(RV_PROGRAM), "sync", "snapshot"], cwd=repo, env=layout.rv_env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        start = time.monotonic()
        while proc.poll() is None:
            if landed(pack_dir) >= target if by_count else time.monotonic() - start >= delay:
                break
            time.sleep(0.005)
        finished = proc.poll() is not None
        if not finished:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The cluster side sees its input end and removes its quarantine; nothing else changes.
        state = wait_for(
            lambda: (s := store_state(layout.ssh, layout.remote_root))["temps"] == [] and s,
            60, "the killed upload's quarantine to go", step=0.2,
        )  # fmt: skip
        assert state["fsck"] == 0, f"seed {seed}: git fsck: {state['fsck_err']}"
        assert set(state["objects"]) <= want, f"seed {seed}"
        if finished or state["refs"]:
            # The upload ended before the kill (the command server's side of a killed command
            # stops at its next look, a fraction of a second later): start again from nothing.
            q = shlex.quote(layout.remote_root)
            layout.ssh.run(f"rm -rf {q}/store.git {q}/snapshots").check("emptying the store")
            continue
        kills.append(len(state["objects"]))
    print(f"seed {seed}: objects in the store after each kill: {kills} of {len(want)}")
    assert len(kills) == KILLS, (
        f"seed {seed}: only {len(kills)} uploads were killed before they ended: {kills}"
    )
    # Whatever a killed command's cluster side was still doing has ended (no temp files above); the
    # rerun sends exactly what the store lacks now.
    present = set(store_state(layout.ssh, layout.remote_root)["objects"])
    r = layout.run_rv("sync", "snapshot", "--json", cwd=repo)
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert done["new_objects"] == len(want - present), f"seed {seed}, kills at {kills}"
    final = store_state(layout.ssh, layout.remote_root)
    assert final["fsck"] == 0 and set(final["objects"]) == want and final["temps"] == []
    assert final["refs"] == [f"refs/rv/snapshots/{done['id']}"]
    # The snapshot holds every file, byte for byte: a job's work dir made of it.
    from rv.layout import RemoteLayout
    from rv.slurm.script import work_dir_script

    work = f"{layout.remote_root}/check-work"
    script = "set -euo pipefail\n" + work_dir_script(RemoteLayout(layout.remote_root), done["id"])
    layout.ssh.run(f"RV_WORK_DIR={shlex.quote(work)} bash -c {shlex.quote(script)}").check("a work dir")
    tree = Path(work)
    assert {str(p.relative_to(tree)): blob_id(p.read_bytes()) for p in tree.rglob("*.py")} == {
        path: blob_id(text.encode()) for path, text in files.items()
    }
