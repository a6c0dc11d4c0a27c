"""One remote layout and one checkpoint layout (rv/agent/layout.py), and everything that spells them
too: the laptop's RemoteLayout, the agent, the job's runtime (job.sh, shell) and rv_train (which takes
only rv.contract from rv, so it keeps its own copy of the checkpoint names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rv
from rv.agent import common, oldstore, rundir, store
from rv.agent import layout as names
from rv.layout import RemoteLayout
from rv.slurm.script import job_runtime

# The runtime as shipped: job.sh and its parts joined (rv.slurm.script.job_runtime).
JOB_SH = job_runtime()

# What a run's folder may hold (rv/agent/layout.py's tree).
RUN_ENTRIES = {
    names.RUN_FILE, names.SCRIPT, names.CANDIDATES, names.ARRAY_SCRIPT, names.SUBMIT_ENV, names.SECRETS,
    names.STOP, names.ENDED, names.FAULTS, names.SEG, names.WORK, names.JOBS, names.LOGS, names.UP_ALIVE,
    names.UP_DETACHED, names.WORK_INDEX, names.WORK_CHANGES, names.STATS,
}  # fmt: skip


def test_the_laptops_paths_are_where_they_always_were():
    # Spelled out: a path that moved would strand every run and snapshot already on a cluster.
    at = RemoteLayout("/r")
    assert at.object("abcdef") == "/r/objects/ab/abcdef" and at.objects == "/r/objects"
    assert (at.snapshots, at.snapshot("s1")) == ("/r/snapshots", "/r/snapshots/s1")
    # The git store, its refs, and its snapshots' meta files beside the earlier store's.
    assert at.store == "/r/store.git" and at.snapshot_ref("s1") == "refs/rv/snapshots/s1"
    assert at.snapshot_meta("s1") == "/r/snapshots/s1.git.json"
    assert at.snapshot_layer("s1") == "/r/snapshots/s1.layer"
    assert (names.old_snapshot_meta("s1"), names.snapshot_manifest("s1")) == (
        "snapshots/s1.json",
        "snapshots/s1.manifest",
    )
    assert names.STORE_QUARANTINE == "rv-incoming-"
    # storecheck.py runs alone in a job (it imports nothing of rv) and job.sh writes the gc failure
    # itself: both spell the store's names as the layout does.
    from rv.agent import storecheck

    assert (storecheck.DAMAGED, storecheck.GC_FAILED) == (names.STORE_DAMAGED, names.STORE_GC_FAILED)
    assert storecheck.SNAPSHOT_REFS == names.SNAPSHOT_REF_PREFIX
    assert storecheck.meta_path("/r/store.git", "s1") == at.snapshot_meta("s1")
    assert f'"$rv_store/{names.STORE_GC_FAILED}"' in JOB_SH
    assert at.workspace("p", "feat/x") == "/r/workspaces/p/feat_x"
    assert (at.runs, at.run_dir("r1")) == ("/r/runs", "/r/runs/r1")
    assert at.name_index("p", "grid/3") == "/r/names/p/grid/3"
    assert at.checkpoint_dir("p", "n") == "/r/checkpoints/p/n" and at.output_dir("p", "n") == "/r/outputs/p/n"
    assert at.log("r1", "7") == "/r/runs/r1/logs/7.out"
    assert at.log("r1", "7_2", "err", node=1) == "/r/runs/r1/logs/7_2-node1.err"
    assert (at.cache, at.tmp, at.runtime) == ("/r/cache", "/r/tmp", "/r/runtime")
    assert at.runtime_file("job-0123456789abcdef.sh") == "/r/runtime/job-0123456789abcdef.sh"
    assert at.in_run("r1", names.job_env("7")) == "/r/runs/r1/jobs/7/env.sh"
    assert at.in_run("r1", names.segment_file(2, "json")) == "/r/runs/r1/seg/2.json"


def test_the_agent_and_the_laptop_name_the_same_paths():
    at = RemoteLayout("/r")
    sid = "0123456789abcdef01234567"
    assert store.store_path(b"/r") == at.store.encode() and store.ref_name(sid) == at.snapshot_ref(sid)
    assert store.meta_path(b"/r", sid) == at.snapshot_meta(sid).encode()
    assert oldstore.snapshot_dir(b"/r", sid) == at.snapshot(sid).encode()
    assert rundir.run_path(b"/r", "r1") == at.run_dir("r1").encode()
    assert rundir.name_index(b"/r", "p", "n") == at.name_index("p", "n").encode()
    assert rundir.checkpoint_path(b"/r", "p", "n") == at.checkpoint_dir("p", "n").encode()
    # Names that are not UTF-8 travel with surrogate escapes, as manifest paths do.
    assert common.under(b"/r", names.checkpoint_dir("p", "caf\udce9")) == b"/r/checkpoints/p/caf\xe9"


def test_rv_train_writes_the_checkpoint_layout_rv_reads(tmp_path):
    from rv import contract
    from rv_train import checkpoint as ckpt

    # rv_train's own copy of the names, held equal to rv's.
    assert (ckpt.STEP_PREFIX, ckpt.STEP_DIGITS, ckpt.COMPLETE, ckpt.PARTIAL) == (
        names.STEP_PREFIX, names.STEP_DIGITS, names.COMPLETE, names.PARTIAL
    )  # fmt: skip
    assert ckpt.STEP_NAME.pattern == names.STEP_NAME.pattern
    assert ckpt.PREEMPTED == contract.PREEMPTED == names.PREEMPTED
    # And as files: what rv_train writes is what the agent reads, and the other way round.
    for step in (3, 40, 12345678):
        folder = ckpt.step_dir(tmp_path, step)
        assert folder.name == names.step_name(step) and names.step_of(folder.name) == step
        folder.mkdir()
        (folder / ckpt.COMPLETE).write_text("{}")
    (tmp_path / (names.step_name(50) + names.PARTIAL)).mkdir()
    ckpt.write_preempted(tmp_path, 40)
    listing = rundir.checkpoint_listing(str(tmp_path).encode())
    assert [s["step"] for s in listing["steps"]] == [3, 40, 12345678] and listing["resume_step"] == 12345678
    assert '"step": 40' in listing["marker"] and listing["files"] == 1  # the partial step
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / names.step_name(12345678)


def _run_dir_paths(text: str) -> set[str]:
    return set(re.findall(r'\$\{?RV_RUN_DIR\}?/([^"\s)};]*)', text))


def test_the_job_runtime_names_a_runs_files_as_the_layout_does():
    paths = _run_dir_paths(JOB_SH)
    assert len(paths) > 15  # the positive case: the pattern finds job.sh's paths
    for path in paths:
        first = path.split("/", 1)[0]
        if first.startswith("$"):
            continue  # "$RV_RUN_DIR/$script": a script named in the candidates file
        assert first.removesuffix(".tmp") in RUN_ENTRIES, path  # NAME.tmp: written, then renamed
        if first == names.LOGS:
            assert path.split("/", 1)[1] in {
                "$rv_job", names.log_name("$rv_job", "out", 0).replace("0.", "%n."),
                names.log_name("$rv_job", "err", 0).replace("0.", "%n."), names.log_name("$rv_job", "err"),
            }, path  # fmt: skip
    # seg/<k>.<kind>, written whole ("$RV_RUN_DIR/seg/$next.job") or from the segment's stem ("$seg.claim")
    kinds = re.findall(r'RV_RUN_DIR/seg/\$[^"]*?\.([a-z]+)"', JOB_SH) + re.findall(
        r'"\$seg\.([a-z]+)"', JOB_SH
    )
    assert set(kinds) == set(names.SEGMENT_FILES), kinds
    assert f"scripts=({names.SCRIPT})" in JOB_SH  # a run of one type: its batch script
    assert f"RV_JOB_ENV_FILE={names.JOB_ENV}\n" in JOB_SH
    # The work dir and the index it was checked out with, and the ref it was checked out of.
    assert f'export RV_WORK_DIR="$RV_RUN_DIR/{names.WORK}"' in JOB_SH
    assert f'index="$RV_WORK_DIR{names.WORK_INDEX.removeprefix(names.WORK)}"' in JOB_SH
    assert f'"{names.snapshot_ref("$RV_SNAPSHOT")}"' in JOB_SH
    # --work-dir node: what the program changed, kept in the run's folder.
    assert f"RV_WORK_SAVED={names.WORK_CHANGES}\n" in JOB_SH


def test_the_notifier_names_a_runs_files_as_the_layout_does():
    # notify.py runs beside job.sh as a program of its own (it imports nothing of rv), so it spells
    # the run folder's names itself: os.path.join(run_dir, "seg", ...).
    tree = ast.parse((Path(rv.__file__).resolve().parent / "agent" / "notify.py").read_text(encoding="utf-8"))
    first = {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join" and len(node.args) > 1
        and ast.unparse(node.args[0]) == "run_dir" and isinstance(node.args[1], ast.Constant)
    }  # fmt: skip
    assert first == {names.SEG, names.LOGS, names.ENDED, names.RUN_FILE, names.STATS}  # the positive case too
    assert first <= RUN_ENTRIES


def test_the_job_runtime_reads_the_checkpoint_layout_as_rv_does():
    assert f"RV_MARKER={names.PREEMPTED}\n" in JOB_SH
    step, complete = names.STEP_PREFIX, names.COMPLETE
    assert f'for d in "$RV_CHECKPOINT_DIR"/{step}*/{complete}; do' in JOB_SH
    assert f'n="${{d%/{complete}}}"' in JOB_SH and f'n="${{n##*/{step}}}"' in JOB_SH


def test_rv_ups_holder_names_the_watchdogs_files_as_the_agent_does():
    from rv.job.up import HOLDER

    assert _run_dir_paths(HOLDER) == {names.UP_ALIVE, names.UP_DETACHED}
