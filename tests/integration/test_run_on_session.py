"""Issue 44, its second half: `rv run --on SESSION` starts a run as a step of a held allocation's job."""

from __future__ import annotations

import os
import re
from pathlib import Path

from test_container import image
from test_inside import project, queued, wait_for, wait_gone  # noqa: F401  (project: a fixture)

STEP = ("bash", "-c", "cat marker.txt; echo job=$SLURM_JOB_ID; sleep 300")


def runs_under(root: str) -> list[str]:
    path = Path(root) / "runs"
    return sorted(os.listdir(path)) if path.is_dir() else []


def test_run_on_a_session_runs_its_own_snapshot_in_the_sessions_job(layout, project):  # noqa: F811
    run_rv = layout.run_rv
    r = run_rv("up", "--detach", "-g", "0", "--mem", "500M", "--time", "40m", "--name", "held", cwd=project)
    assert r.returncode == 0, r.stderr
    job = re.search(r"rv up session held: job (\d+)", r.stderr).group(1)
    try:
        before = runs_under(layout.remote_root)
        # What the session cannot hold is refused before anything is sent, saying what it holds.
        for extra in (["-g", "1"], ["--nodes", "2"], ["--time", "2h"], ["--sweep", "a=1,2"]):
            r = run_rv("run", "--on", "held", *extra, "--name", "big", "--", "true", cwd=project)
            assert r.returncode == 2, (extra, r.stderr)
            assert "--on" in r.stderr, r.stderr
        assert (
            "-g 1 asks more than it holds: job "
            in run_rv("run", "--on", "held", "-g", "1", "--", "true", cwd=project).stderr
        )
        assert runs_under(layout.remote_root) == before
        # An edited file, not committed: the step sees it, in the session's job.
        (project / "marker.txt").write_text("edited after the session started\n")
        r = run_rv("run", "--on", "held", "--name", "onrun", "--", *STEP, cwd=project)
        assert r.returncode == 0, r.stderr
        wait_for("the step's first lines", lambda: "job=" in run_rv("logs", "onrun").stdout, 120)
        out = run_rv("logs", "onrun").stdout
        assert "edited after the session started" in out, out
        assert f"job={job}" in out, out
        ps = run_rv("ps").stdout
        assert re.search(r"onrun\s.*running", ps, re.IGNORECASE), ps
        # A run is not a session: nothing runs in its job.
        r = run_rv("run", "--on", "onrun", "--", "true", cwd=project)
        assert r.returncode == 2 and "is not a session" in r.stderr, r.stderr
        # rv stop ends the run, and leaves the session running.
        r = run_rv("stop", "onrun")
        assert r.returncode == 0, r.stderr
        assert f"cancelled job {job}." in r.stderr, r.stderr  # a step of the session's job, not the job
        wait_for("the run's end", lambda: "running" not in _line(run_rv("ps").stdout, "onrun"), 120)
        # Its steps are gone with it; the session's own are left.
        wait_for(
            "the run's steps' end",
            lambda: "rv-on-" not in layout.ssh.run(f"squeue -h -s -j {job} -o %j").out,
            60,
        )
        assert queued(layout.ssh, job) == "RUNNING"
        # -f follows the run to its end, which is not the session's.
        r = run_rv(
            "run", "--on", "held", "-f", "--name", "onf", "--", "echo", "followed", cwd=project, timeout=120
        )
        assert r.returncode == 0 and "followed" in r.stdout, r.stderr
        assert queued(layout.ssh, job) == "RUNNING"
    finally:
        run_rv("stop", "held")
        wait_gone(layout.ssh, job)


def _line(ps: str, name: str) -> str:
    return next((line.lower() for line in ps.splitlines() if name in line), "")


def test_run_on_a_two_node_session_starts_one_launcher_per_node_in_its_job(layout, project):  # noqa: F811
    run_rv = layout.run_rv
    r = run_rv(
        "up", "--detach", "-g", "0", "--nodes", "2", "--mem", "300M", "--time", "30m", "--name", "held2",
        cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = re.search(r"rv up session held2: job (\d+)", r.stderr).group(1)
    try:
        (project / "marker.txt").write_text("edited for both nodes\n")
        step = "echo node=$SLURM_NODEID job=$SLURM_JOB_ID $(cat marker.txt)"
        r = run_rv(
            "run", "--on", "held2", "--each-node", "-f", "--name", "on2", "--", "bash", "-c", step,
            cwd=project, timeout=180,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        # One launcher per node of the session, each in the session's job, each on the edited snapshot.
        seen = sorted(re.findall(r"node=(\d+) job=(\d+) edited for both nodes", r.stdout))
        assert seen == [("0", job), ("1", job)], r.stdout
        assert queued(layout.ssh, job) == "RUNNING"  # the run ended; the session goes on
    finally:
        run_rv("stop", "held2")
        wait_gone(layout.ssh, job)


def test_a_run_on_a_session_in_an_image_runs_in_that_image(layout, project):  # noqa: F811
    # The session's job runs in the test image (a file only it has, its own python3); a step of it
    # runs there too, unless --container none asks for the host.
    run_rv = layout.run_rv
    r = run_rv(
        "up", "--detach", "-g", "0", "--mem", "500M", "--time", "30m", "--name", "imgheld",
        "--container", image(layout), cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = re.search(r"rv up session imgheld: job (\d+)", r.stderr).group(1)
    where = ("bash", "-c", "test -e /etc/rv-test-image && echo IN-IMAGE || echo ON-HOST; command -v python3")
    try:
        r = run_rv("run", "--on", "imgheld", "-f", "--name", "inimg", "--", *where, cwd=project, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "IN-IMAGE" in r.stdout and "/usr/bin/python3" in r.stdout, r.stdout
        r = run_rv(
            "run", "--on", "imgheld", "--container", "none", "-f", "--name", "onhost", "--", *where,
            cwd=project, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "ON-HOST" in r.stdout, r.stdout
        assert queued(layout.ssh, job) == "RUNNING"
    finally:
        run_rv("stop", "imgheld")
        wait_gone(layout.ssh, job)


def test_a_run_on_a_session_takes_a_node_work_dir_and_starts_from_a_checkpoint(layout, project):  # noqa: F811
    run_rv = layout.run_rv
    r = run_rv("up", "--detach", "-g", "0", "--mem", "500M", "--time", "30m", "--name", "wdheld", cwd=project)
    assert r.returncode == 0, r.stderr
    job = re.search(r"rv up session wdheld: job (\d+)", r.stderr).group(1)
    show = ("bash", "-c", "echo dir=$PWD; cat marker.txt")
    try:
        (project / "marker.txt").write_text("sent to the node\n")
        r = run_rv(
            "run", "--on", "wdheld", "--work-dir", "node", "-f", "--name", "onnode", "--", *show,
            cwd=project, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        node_dir = re.search(r"dir=(\S+)", r.stdout).group(1)
        # The node's own folder, not the shared remote root (nor the session's), with the edit.
        assert not node_dir.startswith(layout.remote_root) and "sent to the node" in r.stdout, r.stdout
        assert queued(layout.ssh, job) == "RUNNING"
        # --from RUN@STEP in the session: the new run starts from that run's checkpoint, in the job.
        save = "for s in 5 10 15; do d=$RV_CHECKPOINT_DIR/step_$(printf %07d $s); mkdir -p $d; "
        save += 'echo "saved at $s" > $d/state.json; touch $d/COMPLETE; done; echo saved'
        r = run_rv("run", "--on", "wdheld", "-f", "--name", "saver", "--", "bash", "-c", save, cwd=project)
        assert r.returncode == 0 and "saved" in r.stdout, r.stderr
        show_ckpt = "ls $RV_CHECKPOINT_DIR; cat $RV_CHECKPOINT_DIR/step_*/state.json; echo job=$SLURM_JOB_ID"
        r = run_rv(
            "run", "--on", "wdheld", "--from", "saver@12", "-f", "--name", "fromsaver", "--", "bash", "-c",
            show_ckpt, cwd=project, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "fromsaver starts from saver at step 10" in r.stderr, r.stderr
        assert r.stdout.split() == ["step_0000010", "saved", "at", "10", f"job={job}"], r.stdout
    finally:
        run_rv("stop", "wdheld")
        wait_gone(layout.ssh, job)
