"""Issue 26 on the real clusters: sweeps, one Slurm job array whose points are runs of their own.

Everything runs as the non-root cluster user. Concurrency is measured from the points' own records
(each segment's start and end, written by its job), never from what rv says about them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_runs import git_project, wait_for

SWEEPER = """\
import json, os, sys, time
lr, crash = sys.argv[1], sys.argv[2]
mark = os.path.join(os.environ["RV_CHECKPOINT_DIR"], "crashed-once")
if lr == crash and not os.path.exists(mark):
    open(mark, "w").close()
    print("crashing on purpose", flush=True)
    sys.exit(3)
for step in (1, 2, 3):
    with open(os.environ["RV_METRICS"], "a") as fh:
        fh.write(json.dumps({"step": step, "loss": float(lr) * 10 / step}) + "\\n")
    time.sleep(1)
print("done", lr, os.environ["RV_SWEEP_LR"], os.environ["RV_SWEEP_INDEX"], flush=True)
"""

# Follows the stop protocol: on USR1 it saves and writes PREEMPTED, so rv continues it.
STEPPER = """\
import json, os, signal, sys, time
ckpt = os.environ["RV_CHECKPOINT_DIR"]
state = os.path.join(ckpt, "state.json")
step = json.load(open(state))["step"] if os.path.exists(state) else 0
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
print(f"start at step {step}", flush=True)
while step < int(sys.argv[1]):
    if stop:
        with open(os.path.join(ckpt, "PREEMPTED"), "w") as fh:
            fh.write(f"{step}\\n")
        print(f"stopped at step {step}", flush=True)
        sys.exit(0)
    time.sleep(0.5)
    step += 1
    with open(state + ".tmp", "w") as fh:
        json.dump({"step": step}, fh)
    os.replace(state + ".tmp", state)
    with open(os.environ["RV_METRICS"], "a") as fh:
        fh.write(json.dumps({"step": step, "loss": 1 / step}) + "\\n")
print(f"done at step {step}", flush=True)
"""


def sweep_sent(result: subprocess.CompletedProcess) -> dict:
    """`rv run --sweep --json`'s record: {"sweep", "arrays", "points": [{index, name, run_id, job_id}]}."""
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def point_records(remote_root: str, sweep: str) -> dict[str, list[dict]]:
    """Every run of the sweep's points (run id -> its segment records), read from the cluster's files."""
    out = {}
    for rdir in (Path(remote_root) / "runs").iterdir():
        meta = json.loads((rdir / "run.json").read_text())
        if (meta.get("sweep") or {}).get("name") == sweep:
            segs = sorted((rdir / "seg").glob("*.json"), key=lambda p: int(p.stem))
            out[rdir.name] = [json.loads(p.read_text()) for p in segs]
    return out


def most_at_once(records: dict[str, list[dict]]) -> int:
    """The most segments that ran at one moment, from their own start and end (whole seconds: a job
    starts in the second another's record ended, never before it)."""
    spans = [(s["start"], s["end"]) for segs in records.values() for s in segs if s.get("start")]
    assert all(end is not None for _, end in spans), spans
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


def results(run_rv, sweep: str) -> dict[int, dict]:
    r = run_rv("sweep", "results", sweep, "--json")
    assert r.returncode == 0, r.stderr
    return {p["index"]: p for p in json.loads(r.stdout)["points"]}


def all_ended(run_rv, sweep: str, count: int):
    def check():
        rows = results(run_rv, sweep)
        # COMPLETING and CONFIGURING: Slurm's job is still there (a cancelled one ends through COMPLETING).
        live = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN")
        done = len(rows) == count and all(p["state"] not in live for p in rows.values())
        return rows if done else None

    return check


def test_a_sweep_is_one_array_at_most_k_at_once_a_crash_fails_alone_and_a_retry_runs_only_it(
    layout, tmp_path
):
    """Six points, two at once. On the default layout one job array; on bare (MaxArraySize 5) two,
    the second after the first, and still never more than two points at once."""
    run_rv, remote_root = layout.run_rv, layout.remote_root
    proj = git_project(tmp_path / "p", {"sweeper.py": SWEEPER})
    lrs = ["0.1", "0.2", "0.3", "0.4", "0.5", "0.6"]
    sent = sweep_sent(
        run_rv(
            "run", "-g", "0", "--mem", "200M", "--name", "grid", "--sweep", "lr=" + ",".join(lrs),
            "--parallel", "2", "--json", "--", "python3", "sweeper.py", "{lr}", "0.5", cwd=proj,
        )
    )  # fmt: skip
    arrays = sent["arrays"]
    assert len(arrays) == (1 if layout.name == "default" else 2), sent
    by_index = {p["index"]: p for p in sent["points"]}
    assert [by_index[i]["name"] for i in range(6)] == [f"grid/{i}" for i in range(6)]
    # Task T of each array is one point; the bare layout's second array holds the sixth point.
    expected = [f"{arrays[0]}_{i}" for i in range(6)] if len(arrays) == 1 else [
        *(f"{arrays[0]}_{i}" for i in range(5)), f"{arrays[1]}_0"]  # fmt: skip
    assert [by_index[i]["job_id"] for i in range(6)] == expected

    ps = run_rv("ps")
    assert ps.returncode == 0 and re.search(r"^grid\s+6pt\s+(RUNNING|PENDING)\s", ps.stdout, re.M), ps.stdout

    rows = wait_for(all_ended(run_rv, "grid", 6), 240, "every point to end")
    assert {i: p["state"] for i, p in rows.items()} == {
        i: "FAILED" if i == 4 else "COMPLETED" for i in range(6)
    }
    # The others' metrics are in the table, each point its own file: the last loss is lr * 10 / 3.
    for i, p in rows.items():
        if i != 4:
            assert p["params"] == {"lr": lrs[i]} and p["metrics"]["loss"] == pytest.approx(
                float(lrs[i]) * 10 / 3
            )
    assert rows[4]["metrics"] == {}
    first = point_records(remote_root, "grid")
    assert len(first) == 6 and most_at_once(first) == 2, first

    table = run_rv("ps", "-a").stdout
    assert re.search(r"^grid\s+6pt\s+FAILED\s.*\(5 finished, 1 failed\)", table, re.M), table
    points = run_rv("ps", "grid").stdout
    assert re.search(r"^4\s+0\.5\s+1\s+FAILED\s+3\s", points, re.M), points
    log = run_rv("logs", "grid/2")
    assert log.returncode == 0 and "done 0.3 0.3 2" in log.stdout, log.stdout

    retry = run_rv("sweep", "retry", "grid", cwd=proj)
    assert retry.returncode == 0, retry.stderr
    (again,) = retry.stdout.split()  # one array
    rows = wait_for(all_ended(run_rv, "grid", 6), 120, "the retried point to end")
    assert all(p["state"] == "COMPLETED" for p in rows.values()), rows
    after = point_records(remote_root, "grid")
    new = set(after) - set(first)
    assert len(new) == 1 and [s["job_id"] for s in after[new.pop()]] == [f"{again}_0"]
    assert all(after[r] == first[r] for r in first)  # nothing else ran again
    assert rows[4]["metrics"]["loss"] == pytest.approx(0.5 * 10 / 3)
    assert "done 0.5 0.5 4" in run_rv("logs", "grid/4").stdout
    nothing = run_rv("sweep", "retry", "grid")
    assert nothing.returncode == 0 and not nothing.stdout and "nothing to retry" in nothing.stderr


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_a_point_stopped_at_its_time_limit_continues_from_its_checkpoint_while_the_others_finish(
    layout, tmp_path
):
    run_rv, remote_root = layout.run_rv, layout.remote_root
    proj = git_project(tmp_path / "p", {"stepper.py": STEPPER})
    # 1-minute jobs (Slurm's shortest), the stop 40 s before the limit: point 1 (60 steps of 0.5 s)
    # trains about 20 s, saves, and goes on in a second segment; points 0 and 2 end in seconds.
    sent = sweep_sent(
        run_rv(
            "run", "-g", "0", "--mem", "200M", "--time", "1m", "--signal", "USR1@40", "--name", "long",
            "--sweep", "steps=4,60,5", "--json", "--", "python3", "stepper.py", "{steps}", cwd=proj,
        )
    )  # fmt: skip
    (array,) = sent["arrays"]
    # rv metrics -f follows the point across its segments and returns when its run ends.
    follow = run_rv("metrics", "long/1", "-f", "--interval", "2", timeout=300)
    assert follow.returncode == 0 and "run long/1 ended: finished" in follow.stderr, follow.stderr
    assert re.search(r"^loss\s+0\.01667\s+60\s", follow.stdout.rsplit("METRIC", 1)[-1], re.M), follow.stdout
    rows = wait_for(all_ended(run_rv, "long", 3), 300, "every point to end", step=3)
    assert all(p["state"] == "COMPLETED" for p in rows.values()), rows
    assert [rows[i]["segments"] for i in range(3)] == [1, 2, 1]
    records = {json.loads((Path(remote_root) / "runs" / r / "run.json").read_text())["name"]: segs
               for r, segs in point_records(remote_root, "long").items()}  # fmt: skip
    first, second = records["long/1"]
    # The array ran segment 1; the next is a job of its own, sent by the job, from the checkpoint.
    assert first["job_id"] == f"{array}_1" and first["reason"] == "stopped at time limit"
    assert "_" not in second["job_id"] and second["reason"] == "finished"
    assert first["checkpoint_step"] and second["start_step"] == first["checkpoint_step"]
    # Not held up: the other points ended while point 1 was still in its first segment.
    assert max(records["long/0"][0]["end"], records["long/2"][0]["end"]) <= first["end"]
    log = run_rv("logs", "long/1").stdout
    assert f"start at step {first['checkpoint_step']}" in log and "done at step 60" in log, log
    assert rows[1]["metrics"]["loss"] == pytest.approx(1 / 60)


MALFORMED = """\
import json, os, sys
with open(os.environ["RV_METRICS"], "a") as fh:
    if sys.argv[1] == "0":
        fh.write("[" * 100000 + "\\n")  # deeper than json's parser recurses
        fh.write('{"loss": "' + "x" * (2 << 20) + '"}\\n')  # longer than any metrics line
    fh.write(json.dumps({"step": 1, "loss": 1.5 + int(sys.argv[1])}) + "\\n")
"""


def test_a_malformed_metrics_line_is_one_bad_line_and_never_hides_another_point(layout, tmp_path):
    run_rv = layout.run_rv
    proj = git_project(tmp_path / "p", {"bad.py": MALFORMED})
    sweep_sent(
        run_rv("run", "-g", "0", "--mem", "200M", "--name", "mal", "--sweep", "x=0,1", "--json", "--",
               "python3", "bad.py", "{x}", cwd=proj)
    )  # fmt: skip
    rows = wait_for(all_ended(run_rv, "mal", 2), 120, "both points to end")
    assert [rows[i]["metrics"]["loss"] for i in (0, 1)] == [1.5, 2.5], rows
    shown = run_rv("sweep", "results", "mal")
    assert shown.returncode == 0 and "2.5" in shown.stdout, shown.stderr
    one = run_rv("metrics", "mal/0")
    assert (
        one.returncode == 0 and "2 line(s)" in one.stderr and re.search(r"^loss\s+1\.5", one.stdout, re.M)
    ), one.stdout + one.stderr


def test_the_guides_sweep_runs_as_typed_on_a_cluster_of_two_gpu_types(layout, tmp_path):
    # Issue 33: the five-minute guide's sweep (no -t) was refused on the demo's own cluster (a6000 and
    # v100). It takes one type, says which, and every point runs there.
    proj = git_project(
        tmp_path / "p", {"train.py": "import os, sys\nprint('lr', sys.argv[2], os.environ['RV_GPU_TYPE'])\n"}
    )
    r = layout.run_rv("run", "--sweep", "lr=1e-4,3e-4", "--", "python", "train.py", "--lr", "{lr}", cwd=proj)
    assert r.returncode == 0, r.stderr
    m = re.search(
        r"a sweep runs on one GPU type: (\w+), the first that can serve it \(-t picks another: (\w+)\)",
        r.stderr,
    )
    assert m and {m[1], m[2]} == {"a6000", "v100"}, r.stderr
    name = re.search(r"submitted sweep (\S+):", r.stderr)[1]
    rows = wait_for(all_ended(layout.run_rv, name, 2), 180, "both points to end")
    assert all(p["state"] == "COMPLETED" for p in rows.values()), rows
    for i, lr in enumerate(("1e-4", "3e-4")):
        log = layout.run_rv("logs", f"{name}/{i}").stdout
        assert f"lr {lr} {m[1]}" in log, log


def test_names_a_sweep_a_rejected_job_and_what_rv_gc_leaves(layout, tmp_path):
    # Issue 33: `rv logs SWEEP` said "not on the cluster" right after rv ps listed it; a job Slurm
    # rejected at submission was FAILED in rv ps -a and unknown to rv logs; after rv gc every array
    # task was a row of its own, and every name's lock file stayed.
    run_rv = layout.run_rv
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    sweep_sent(run_rv("run", "-g", "0", "--mem", "100M", "--name", "nm", "--sweep", "x=1,2", "--json", "--",
                      "true", cwd=proj))  # fmt: skip
    solo = run_rv("run", "-g", "0", "--mem", "100M", "--name", "solo", "-f", "--", "true", cwd=proj)
    assert solo.returncode == 0, solo.stderr
    wait_for(all_ended(run_rv, "nm", 2), 120, "both points to end")
    for command in ("logs", "metrics"):
        r = run_rv(command, "nm")
        assert r.returncode == 9 and "'nm' is a sweep of 2 point(s)" in r.stderr, r.stderr
        assert f"next: rv {command} nm/0" in r.stderr and "not on the cluster" not in r.stderr, r.stderr
    names = Path(layout.remote_root) / "names"
    assert {p.name for p in names.rglob("*.lock")} >= {"solo.lock", "nm.lock"}
    gc = run_rv("gc", "--older-than", "0")
    assert gc.returncode == 0, gc.stderr
    assert list(names.rglob("*.lock")) == [] and list(names.rglob("nm")) == [], list(names.rglob("*"))
    if layout.name == "default":  # accounting: rv ps -a lists the jobs rv no longer has records of
        table = run_rv("ps", "-a").stdout
        assert re.search(r"^nm\s+2pt\s+COMPLETED\s.*\(2 finished\)", table, re.M), table
        assert not re.search(r"^nm\s+-\s", table, re.M), table  # no row per array task
        user = layout.cluster["RV_TESTCLUSTER_USER"]
        rejected = subprocess.run(
            ["runuser", "-u", user, "--", "sbatch", "-J", "refused", "--exclude=node1,node2", "--mem=100M",
             "--wrap", "true"],
            env={"PATH": os.environ["PATH"], "SLURM_CONF": layout.cluster["SLURM_CONF"]}, cwd="/",
            capture_output=True, text=True,
        )  # fmt: skip
        assert rejected.returncode == 1, rejected.stderr

        def listed() -> str | None:
            shown = run_rv("ps", "-a").stdout
            return shown if "refused" in shown else None

        table = wait_for(listed, 60, "sacct to know the rejected job")
        assert re.search(r"^refused\s.*FAILED.*\(rejected at submission: it never ran", table, re.M), table
        r = run_rv("logs", "refused")
        assert r.returncode == 9 and "run 'refused' never ran: Slurm rejected its job" in r.stderr, r.stderr


def test_rv_stop_sweep_cancels_its_running_and_pending_points(layout, tmp_path):
    run_rv = layout.run_rv
    proj = git_project(tmp_path / "p", {"sleep.py": "import time\ntime.sleep(300)\n"})
    sweep_sent(
        run_rv("run", "-g", "0", "--mem", "200M", "--name", "sl", "--sweep", "x=1..4", "--parallel", "1",
               "--json", "--", "python3", "sleep.py", cwd=proj)
    )  # fmt: skip

    def running() -> bool:
        rows = results(run_rv, "sl")
        return sorted(p["state"] for p in rows.values()) == ["PENDING", "PENDING", "PENDING", "RUNNING"]

    wait_for(running, 60, "one point running, three pending")
    stop = run_rv("stop", "sl")
    assert stop.returncode == 0 and "stopped sweep sl: 4 of its 4 point(s) had not ended" in stop.stderr
    rows = wait_for(all_ended(run_rv, "sl", 4), 60, "every point to end")
    assert all(p["state"] == "CANCELLED" for p in rows.values()), rows
    # Every view of the sweep agrees: cancelled, not failed (issue 33).
    table = run_rv("ps", "-a").stdout
    assert re.search(r"^sl\s+4pt\s+CANCELLED\s.*\(4 cancelled\)", table, re.M), table
    points = run_rv("ps", "sl").stdout
    assert len(re.findall(r"^\d\s+\d\s+\S+\s+CANCELLED\s", points, re.M)) == 4, points
    shown = run_rv("sweep", "results", "sl")
    assert "4 point(s): 4 cancelled" in shown.stdout + shown.stderr and "failed" not in shown.stdout, shown
    queue = subprocess.run(
        ["squeue", "-h", "-r", "-u", layout.cluster["RV_TESTCLUSTER_USER"], "-n", "sl", "-o", "%i"],
        env={**os.environ, "SLURM_CONF": layout.cluster["SLURM_CONF"]}, capture_output=True, text=True,
    )  # fmt: skip
    assert queue.stdout.strip() == "", queue.stdout
    again = run_rv("stop", "sl")
    assert again.returncode == 0 and "nothing to stop" in again.stderr


def sweep_runs_on_the_cluster(remote_root: str, sweep: str) -> int:
    """How many runs of ``sweep`` the cluster's agent has made so far (their run.json, read as root)."""
    found = 0
    for meta in (Path(remote_root) / "runs").glob("*/run.json"):
        try:
            found += (json.loads(meta.read_text()).get("sweep") or {}).get("name") == sweep
        except ValueError:  # being written
            continue
    return found


def test_ctrl_c_during_a_sweeps_submit_says_it_may_have_been_sent_and_rv_ps_finds_it(layout, tmp_path):
    # Issue 33: the array was queued (no local record) while rv said only "interrupted".
    from terminal import Terminal

    proj = git_project(tmp_path / "p", {"README": "x\n"})
    argv = [sys.executable, "-m", "rv", "run", "-g", "0", "--mem", "100M", "--name", "cc",
            "--sweep", "x=1..150", "--parallel", "1", "--", "sleep", "30"]  # fmt: skip
    term = Terminal(argv, env=layout.rv_env, cwd=proj)
    try:
        # The agent makes the points' runs while it submits: the request has left this machine.
        wait_for(
            lambda: sweep_runs_on_the_cluster(layout.remote_root, "cc") > 0, 120, "the submit", step=0.05
        )
        term.send("\x03")
        assert term.wait(60) == 130, term.text
    finally:
        term.close()
    said = " ".join(term.text.split())
    maybe = "interrupted while sweep cc was being sent: it may have been sent next: rv ps cc" in said
    sent = re.search(
        r"interrupted after sweep cc was sent \(job array [\d, ]+\); it is queued and recorded", said
    )
    assert maybe or sent, term.text
    # It was queued: rv ps finds it (from the cluster's records), and rv stop stops it.
    wait_for(lambda: sweep_runs_on_the_cluster(layout.remote_root, "cc") == 150, 120, "every point's run")
    points = wait_for(lambda: layout.run_rv("sweep", "results", "cc", "--json"), 60, "the sweep")
    assert points.returncode == 0 and len(json.loads(points.stdout)["points"]) == 150, points.stderr
    stop = layout.run_rv("stop", "cc")
    assert stop.returncode == 0, stop.stderr


def agent_running(mode: str, root: str) -> bool:
    """Whether an rv agent of ``mode`` for the remote root ``root`` runs on this machine now."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        if mode.encode() in words and any(root.encode() in w for w in words):
            return True
    return False


def test_ctrl_c_before_a_sweep_is_sent_says_nothing_was_queued(layout, tmp_path):
    from terminal import Terminal

    proj = git_project(tmp_path / "p", {"README": "x\n"})
    # The store held by another (as rv gc holds it): the upload waits, and the Ctrl-C comes while it
    # does, before anything could be submitted. A connection of its own (no warm one, no command
    # server, no agent started ahead): the agent then runs as a process named by its mode.
    objects = Path(layout.remote_root) / "objects"
    user = layout.cluster["RV_TESTCLUSTER_USER"]
    lock = f"mkdir -p -m 700 {objects} && exec flock -x {objects}/.lock sleep 600"
    # Its own group: runuser, flock and sleep all go with it at the end.
    holder = subprocess.Popen(["runuser", "-u", user, "--", "bash", "-c", lock], start_new_session=True)
    argv = [sys.executable, "-m", "rv", "run", "-g", "0", "--mem", "100M", "--name", "nc", "--sweep", "x=1,2",
            "--", "true"]  # fmt: skip
    term = None
    try:
        wait_for(lambda: (objects / ".lock").exists(), 30, "the store's lock to be held")
        direct = {"RV_WARM_SECONDS": "0", "RV_COMMAND_SERVER": "0", "RV_PRESTART_AGENTS": "0"}
        term = Terminal(argv, env={**layout.rv_env, **direct}, cwd=proj)
        wait_for(lambda: agent_running("snap-put", layout.remote_root), 120, "the upload", step=0.1)
        term.send("\x03")
        assert term.wait(60) == 130, term.text
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        if term is not None:
            term.close()
    said = " ".join(term.text.split())
    assert "interrupted before sweep nc was sent: nothing was queued" in said, term.text
    assert sweep_runs_on_the_cluster(layout.remote_root, "nc") == 0
    ps = layout.run_rv("ps", "-a", "--json")
    assert ps.returncode == 0 and not [r for r in json.loads(ps.stdout) if r.get("sweep") == "nc"], ps.stdout


def test_the_bare_layout_splits_arrays_at_its_max_array_size(bare_cluster):
    """The layout the splitting test relies on (scripts/testcluster writes MaxArraySize=5 for bare)."""
    shown = subprocess.run(
        ["scontrol", "show", "config"], env={**os.environ, "SLURM_CONF": bare_cluster["SLURM_CONF"]},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert re.search(r"^MaxArraySize\s*=\s*5$", shown, re.M), (
        "the running bare cluster predates MaxArraySize=5: `scripts/testcluster down && up` (bare)"
    )
