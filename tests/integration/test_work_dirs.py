"""Issue 35 on the real clusters: work dirs on each node's own disk, and chains that outlive a purge.

`--work-dir node` checks the snapshot out on the node (both loopback nodes are this machine and share
/tmp, so each job's folder is named by run, job and node); what the program changed there is kept in
the run's folder as one tar at each segment's end and put back at the next. Everything runs as the
non-root cluster user, on both layouts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

from conftest import make_remote_dir
from projects import git_project, wait_for
from test_store import ended, run_folder
from test_sweeps import all_ended, sweep_sent

from rv.config import load_config, save_config

# Three segments, each a clean stop with progress (the stop protocol, without waiting for a signal).
# The first changes its work dir in every way a program can; the later ones print what they find.
CHAIN = """\
import os
seg = int(os.environ["RV_SEGMENT"])
ckpt = os.environ["RV_CHECKPOINT_DIR"]
print("cwd", os.getcwd(), flush=True)
if seg == 1:
    assert open("data.txt").read() == "original\\n"
    with open("data.txt", "a") as fh:
        fh.write("seg1\\n")
    os.remove("gone.txt")
    os.makedirs("out", exist_ok=True)
    open("out/made.txt", "w").write("made in 1\\n")
    open("-dash\\nname", "w").write("odd\\n")
    os.symlink("data.txt", "link")
    os.makedirs("empty/inner")
else:
    print("seen", seg, open("data.txt").read().split(), os.path.exists("gone.txt"),
          open("out/made.txt").read().strip(), open("-dash\\nname").read().strip(), os.readlink("link"),
          os.path.isdir("empty/inner"), flush=True)
    with open("data.txt", "a") as fh:
        fh.write("seg%d\\n" % seg)
if seg < 3:
    open(os.path.join(ckpt, "PREEMPTED"), "w").write(str(seg))
"""


def test_a_node_work_dir_keeps_what_the_program_changed_across_segments_and_leaves_nothing(layout, tmp_path):
    proj = git_project(
        tmp_path / "p", {"chain.py": CHAIN, "data.txt": "original\n", "gone.txt": "g\n", "keep.txt": "k\n"}
    )
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "nodechain", "--work-dir", "node", "-o", "out/*.txt",
        "-f", "--", "python3", "chain.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = run_folder(layout.remote_root, "nodechain")
    assert json.loads((run / "ENDED").read_text())["segment"] == 3
    # Each segment's program ran on the node's disk, in a folder of its own job, never in the run's folder.
    cwds = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("cwd ")]
    assert len(cwds) == 3 and len(set(cwds)) == 3, r.stdout
    for cwd in cwds:
        assert not cwd.startswith(layout.remote_root) and f"/rv-{run.name}-" in cwd, cwd
        assert not Path(cwd).parent.exists(), f"{cwd}: the node's work dir outlived its job"
    # What segment 1 changed, segment 2 found; and segment 2's own change, segment 3.
    assert "seen 2 ['original', 'seg1'] False made in 1 odd data.txt True" in r.stdout, r.stdout
    assert "seen 3 ['original', 'seg1', 'seg2'] False made in 1 odd data.txt True" in r.stdout, r.stdout
    # Each next segment was submitted from a folder that still exists, not the removed work dir.
    assert "couldn't chdir" not in r.stdout + r.stderr, r.stderr[-3000:]
    # On the shared filesystem: no work dir, the changes as one tar and the deleted names.
    assert not (run / "work").exists()
    assert sorted(p.name for p in (run / "work.changes").iterdir()) == ["deleted", "files.tar"]
    # -o still applies, from the node's work dir.
    made = Path(layout.remote_root, "outputs").glob("*/nodechain/out/made.txt")
    assert [p.read_text() for p in made] == ["made in 1\n"]


SWEEP_POINT = (
    "import os, sys\nopen(os.path.join(os.environ['RV_OUTPUT_DIR'], 'r.txt'), 'w').write(sys.argv[1])\n"
)


def test_a_sweep_of_20_points_with_node_work_dirs_leaves_no_work_dir_file_on_the_shared_filesystem(
    layout, tmp_path
):
    # The profile's folder on each node, and the project's key: both as a user would set them.
    node_dir = f"/tmp/rv-it-node-{uuid.uuid4().hex[:8]}"
    make_remote_dir(node_dir, layout.cluster["RV_TESTCLUSTER_USER"])
    config = Path(layout.rv_env["RV_CONFIG"])
    cfg = load_config(config)
    name = layout.cluster["RV_TESTCLUSTER_PROFILE"]
    save_config(
        cfg.with_profile(dataclasses.replace(cfg.profile(name), node_work_dir=node_dir), make_default=True)
    )
    files = {f"pkg/m{i}.py": f"X = {i}\n" for i in range(30)}
    proj = git_project(tmp_path / "p", {"point.py": SWEEP_POINT, ".rv.toml": 'work-dir = "node"\n', **files})
    try:
        sent = sweep_sent(
            layout.run_rv(
                "run", "-g", "0", "--mem", "100M", "--name", "wide", "--sweep", "i=0..19", "--json", "--",
                "python3", "point.py", "{i}", cwd=proj,
            )
        )  # fmt: skip
        assert len(sent["points"]) == 20
        rows = wait_for(all_ended(layout.run_rv, "wide", 20), 600, "the sweep's 20 points to end", step=3)
        assert {p["state"] for p in rows.values()} == {"COMPLETED"}, rows
        outputs = sorted(Path(layout.remote_root, "outputs").glob("*/wide/*/r.txt"))
        assert sorted(p.read_text() for p in outputs) == sorted(str(i) for i in range(20))
        # No file of the snapshot anywhere under the remote root but in the store's packs: no work dir,
        # no changes kept (the program changed nothing in its work dir).
        root = Path(layout.remote_root)
        snapshot_names = {"point.py", ".rv.toml", *(Path(f).name for f in files)}
        found = [p for p in root.rglob("*") if p.name in snapshot_names]
        assert found == [], found[:5]
        runs = [p for p in (root / "runs").iterdir()]
        assert len(runs) == 20
        assert all(not (p / "work").exists() and not (p / "work.changes").exists() for p in runs)
        # And nothing left on the nodes' disk.
        assert list(Path(node_dir).iterdir()) == []
    finally:
        shutil.rmtree(node_dir, ignore_errors=True)


def test_rv_run_names_node_work_dirs_when_a_sweep_would_create_over_100000_files(run_rv, tmp_path):
    proj = git_project(tmp_path / "p", {f"d/f{i}.txt": f"{i}\n" for i in range(2000)} | {"t.py": "pass\n"})
    r = run_rv("run", "--dry-run", "-g", "0", "--sweep", "i=0..50", "--", "python3", "t.py", "{i}", cwd=proj)
    assert r.returncode == 0, r.stderr
    assert "this sweep creates 102,051 files on the cluster's shared filesystem" in r.stderr, r.stderr
    assert "--work-dir node" in r.stderr
    quiet = run_rv(
        "run", "--dry-run", "--json", "-g", "0", "--work-dir", "node", "--sweep", "i=0..50", "--", "python3",
        "t.py", "{i}", cwd=proj,
    )  # fmt: skip
    assert quiet.returncode == 0, quiet.stderr
    assert "files on the cluster's shared filesystem" not in quiet.stderr
    assert "rv_work_node=1 rv_work_base=''" in json.loads(quiet.stdout)["script"]  # the script says where


# Segment 1 deletes rv's runtime files, as a scratch purge would while the run goes on.
PURGER = """\
import glob, os
seg = int(os.environ["RV_SEGMENT"])
ckpt = os.environ["RV_CHECKPOINT_DIR"]
root = os.path.dirname(os.path.dirname(os.environ["RV_RUN_DIR"]))
if seg == 1:
    gone = glob.glob(os.path.join(root, "runtime", "*"))
    for path in gone:
        os.remove(path)
    print("purged", len(gone), flush=True)
    open(os.path.join(ckpt, "PREEMPTED"), "w").write("1")
else:
    print("segment", seg, "ran", flush=True)
"""


def test_a_chain_whose_runtime_files_were_purged_writes_them_again_and_goes_on(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"purger.py": PURGER})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "purged", "-f", "--", "python3", "purger.py",
        cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    # The runtime's files: job.sh, store-check, rv's meter, and the labeller and the notifier when
    # they are used.
    assert re.search(r"^purged [1-5]$", r.stdout, re.M), r.stdout
    assert "segment 2 ran" in r.stdout, r.stdout
    # The meter was written again too: segment 2's program ran under it.
    assert list((run_folder(layout.remote_root, "purged") / "stats" / "2").glob("*.json")), r.stderr
    record = ended(layout.remote_root, "purged")
    assert record["segment"] == 2 and record["exit_code"] == 0, record
    assert "written again for the next segment" in r.stderr
    assert list(Path(layout.remote_root, "runtime").glob("job-*.sh"))


# Run once on each node (--each-node) from a subfolder: where each copy stands, and a file of its own.
EACH = """\
import os
node = os.environ["SLURM_NODEID"]
print("node", node, "cwd", os.getcwd(), flush=True)
open("from-node-%s.txt" % node, "w").write(node)
"""


def test_each_node_of_a_job_checks_out_a_work_dir_of_its_own(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"sub/each.py": EACH})
    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "1G", "--each-node", "--work-dir", "node", "--name", "two",
        "-f", "--", "python3", "each.py", cwd=proj / "sub", timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # Said before the run: the other node's changes are not kept.
    assert (
        "--work-dir node on 2 nodes: each node checks the code out on its own disk, and only the first "
        "node's changes to its work dir are kept" in " ".join(r.stderr.split())
    ), r.stderr
    lines = [line.split("] ", 1)[-1].split() for line in r.stdout.splitlines()]
    seen = {words[1]: words[3] for words in lines if words and words[0] == "node"}
    assert sorted(seen) == ["0", "1"], r.stdout
    # Each node in its own folder (named by its node: both are this machine), in the subfolder typed in.
    assert seen["0"] != seen["1"] and all(cwd.endswith("/work/sub") for cwd in seen.values()), seen
    assert all(not cwd.startswith(layout.remote_root) for cwd in seen.values())
    assert all(not Path(cwd).parent.parent.exists() for cwd in seen.values()), "a node's work dir stayed"
    # The first node's changes are the run's; the other node's file is named as dropped, not lost unsaid.
    logs = layout.run_rv("logs", "two", "--err", "--node", "1")
    assert "rv: warning: node 1 (" in logs.stdout and "are not kept" in logs.stdout, logs.stdout + logs.stderr
    run = run_folder(layout.remote_root, "two")
    listing = subprocess.run(
        ["tar", "-tf", str(run / "work.changes" / "files.tar")], capture_output=True, text=True, check=True
    ).stdout.split()
    assert listing == ["./sub/from-node-0.txt"], listing


# Two segments in the shared work dir: segment 1 deletes a file of the snapshot, and a purge takes
# another while segment 2 waits in the queue; segment 2 says what it finds.
DELETER = """\
import os
seg = int(os.environ["RV_SEGMENT"])
if seg == 1:
    os.remove("gone.txt")
    open(os.path.join(os.environ["RV_CHECKPOINT_DIR"], "PREEMPTED"), "w").write("1")
else:
    print("found", os.path.exists("gone.txt"), open("purged.txt").read().strip(), flush=True)
"""


def test_the_shared_work_dir_keeps_the_programs_deletions_and_restores_only_a_purges(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"deleter.py": DELETER, "gone.txt": "g\n", "purged.txt": "p\n"})
    # Each segment waits 25 s in the queue (--begin): the purge comes while nothing of the run runs.
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "deleter", "--sbatch=--begin=now+25", "--", "python3",
        "deleter.py", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    seg = wait_for(lambda: run_folder(layout.remote_root, "deleter") / "seg", 120, "the run's folder")

    def first_ended() -> bool:
        record = seg / "1.json"
        done = record.exists() and json.loads(record.read_text())["state"] == "ended"
        return done and (seg / "2.job").exists()

    wait_for(first_ended, 180, "segment 1 to end and submit segment 2", step=0.5)
    work = seg.parent / "work"
    assert not (work / "gone.txt").exists()
    (work / "purged.txt").unlink()  # the purge
    record = ended(layout.remote_root, "deleter")
    assert record["segment"] == 2 and record["exit_code"] == 0, record
    logs = layout.run_rv("logs", "deleter")
    assert "found False p" in logs.stdout, logs.stdout + logs.stderr
    err = layout.run_rv("logs", "deleter", "--err").stdout
    assert "1 file(s) of the snapshot are missing from the work dir (a purge?): restoring them" in err, err
    assert not (work / "gone.txt").exists() and (work / "purged.txt").read_text() == "p\n"


def test_a_run_whose_runtime_was_purged_before_it_started_shows_the_cause_it_recorded(layout, tmp_path):
    # Issue 41: rv ps said LOST, "cancelled or killed", while the job's own log said why it ended.
    proj = git_project(tmp_path / "p", {"a.py": "print('never')\n"})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "100M", "--name", "unlucky", "--sbatch=--begin=now+15", "--",
        "python3", "a.py", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    runtime = list(Path(layout.remote_root, "runtime").glob("job-*.sh"))
    assert runtime, "the run's job runtime was sent"  # the positive case: there was one to purge
    for path in runtime:
        path.unlink()  # a scratch purge while the job waits for its begin time
    waited = layout.run_rv("wait", "unlucky", timeout=300)
    assert waited.returncode == 1, waited.stderr[-2000:]
    rows = json.loads(layout.run_rv("ps", "-a", "--json").stdout)
    (row,) = [row for row in rows if row["name"] == "unlucky" and row["run_id"]]  # sacct's others aside
    assert row["state"] == "FAILED" and row["exit_code"] == 1, row
    assert row["reason"].startswith("failed before the program started: the job runtime "), row
    assert (
        "is missing (a purge of the filesystem?)" in row["reason"]
        and "cancelled or killed" not in row["reason"]
    )
    assert "the job runtime" in layout.run_rv("why", "unlucky").stdout
