"""A first upload of many small files killed with SIGKILL at random points, again and again.

After every kill the store holds only objects whose content hashes to their name and no snapshot,
and the next sync completes it sending exactly the objects still missing. The store is read on the
cluster, over SSH, by a script of this test's own (not rv's code); the loopback cluster's disk is
this machine's, so the test also watches the objects arrive to kill at a chosen point.
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

from conftest import RV_PROGRAM
from projects import git_project, wait_for

FILES = 3000  # small files: a first upload of them takes a few seconds on the loopback cluster
KILLS = 6

STORE_CHECK = r"""
import hashlib, json, os, sys
root = sys.argv[1]
objs, bad, names = os.path.join(root, "objects"), [], []
for fan in sorted(os.listdir(objs)) if os.path.isdir(objs) else []:
    d = os.path.join(objs, fan)
    if fan.startswith(".") or not os.path.isdir(d):
        continue  # the store's lock file
    for name in os.listdir(d):
        with open(os.path.join(d, name), "rb") as fh:
            data = fh.read()
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != name[:40]:
            bad.append(name)
        names.append(name)
snaps = os.path.join(root, "snapshots")
# A built snapshot is a folder (its meta and manifest files are written just before it appears).
built = [n for n in os.listdir(snaps) if not n.startswith(".") and os.path.isdir(os.path.join(snaps, n))] \
    if os.path.isdir(snaps) else []
tmp = os.path.join(root, "tmp")
print(json.dumps({"objects": names, "bad": bad, "snapshots": built,
                  "temps": os.listdir(tmp) if os.path.isdir(tmp) else []}))
"""


def store_state(transport, root: str) -> dict:
    res = transport.run(f"python3 -c {shlex.quote(STORE_CHECK)} {shlex.quote(root)}")
    return json.loads(res.check("reading the store").stdout)


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def landed(objects: Path) -> int:
    """Objects in the store now (read directly: the loopback cluster's disk is this machine's)."""
    if not objects.is_dir():
        return 0
    fans = [fan.path for fan in os.scandir(objects) if fan.is_dir() and not fan.name.startswith(".")]
    return sum(1 for fan in fans for _ in os.scandir(fan))


def test_a_first_upload_killed_at_random_points_leaves_the_store_sound_and_the_rerun_sends_the_rest(
    layout, tmp_path
):
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    files = {}
    for i in range(FILES):
        # Unique contents (the index is in each), so every file is an object of its own.
        files[f"pkg{i % 30:02d}/mod{i % 7}/file{i:05d}.py"] = f"# {i}\n" + "x = 1\n" * rng.randint(20, 600)
    repo = git_project(tmp_path / "many", files)
    want = {blob_id(text.encode()) for text in files.values()}
    objects = Path(layout.remote_root) / "objects"
    kills = []
    for attempt in range(3 * KILLS):  # an upload that ends before its kill empties the store (below)
        if len(kills) == KILLS:
            break
        before = landed(objects)
        # A third of the kills at a random moment from the start (listing, the query, the first
        # objects), the rest once a random share of the objects still missing has landed (small
        # enough that every attempt has some left to kill).
        by_count = attempt % 3 != 0
        target = before + rng.randint(1, max(1, (len(want) - before) // (KILLS - len(kills) + 1)))
        delay = rng.uniform(0.0, 1.0)
        proc = subprocess.Popen(
            [str(RV_PROGRAM), "sync", "snapshot"], cwd=repo, env=layout.rv_env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        start = time.monotonic()
        while proc.poll() is None:
            if landed(objects) >= target if by_count else time.monotonic() - start >= delay:
                break
            time.sleep(0.005)
        finished = proc.poll() is not None
        if not finished:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The cluster side sees its input end and removes its partial file; nothing else changes.
        state = wait_for(
            lambda: (s := store_state(layout.ssh, layout.remote_root))["temps"] == [] and s,
            60, "the killed upload's temp files to go", step=0.2,
        )  # fmt: skip
        assert state["bad"] == [], f"seed {seed}: objects whose content is not their id: {state['bad']}"
        assert set(state["objects"]) <= want, f"seed {seed}"
        if finished or state["snapshots"]:
            # The upload ended before the kill (the command server's side of a killed command
            # stops at its next look, a fraction of a second later): start again from nothing.
            q = shlex.quote(layout.remote_root)
            layout.ssh.run(
                f"chmod -R u+w {q}/objects {q}/snapshots && rm -rf {q}/objects {q}/snapshots"
            ).check("emptying the store")
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
    assert final["bad"] == [] and set(final["objects"]) == want and final["temps"] == []
    assert len(final["snapshots"]) >= 1
    # The snapshot holds every file, byte for byte (hashed on the cluster).
    tree = Path(done["remote_path"])
    assert {str(p.relative_to(tree)): blob_id(p.read_bytes()) for p in tree.rglob("*.py")} == {
        path: blob_id(text.encode()) for path, text in files.items()
    }
