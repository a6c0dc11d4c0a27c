"""Issue 36 on the real clusters: `rv why` on runs that wait, and `rv wait` for scripts.

Each waiting run is made for real, as the cluster user: jobs that hold GPUs of one node (plain
sbatch, as another workload would), a job of higher priority that waits for them, and the run behind
it; or a QoS whose limit holds the run. Every suggestion `rv why` makes is then given to `sbatch
--test-only` by the test itself, on the run's own batch script: it must accept it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import STATES
from projects import git_project, wait_for

SLEEP = "#!/bin/bash\nsleep 600\n"


class Slurm:
    """Slurm's own commands on one layout, as the cluster user (or as root, for sacctmgr)."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.user = layout.cluster["RV_TESTCLUSTER_USER"]
        self.env = dict(os.environ, SLURM_CONF=str(STATES[layout.name] / "slurm.conf"))
        self.jobs: list[str] = []

    def as_user(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["runuser", "-u", self.user, "--", "env", f"SLURM_CONF={self.env['SLURM_CONF']}", *argv],
            capture_output=True, text=True, env=self.env, timeout=60,
        )  # fmt: skip
        assert not check or done.returncode == 0, done.stderr
        return done

    def sbatch(self, script: Path, *options: str) -> str:
        job = self.as_user("sbatch", "--parsable", "--mem=100M", "-o", "/dev/null", *options, str(script))
        self.jobs.append(job.stdout.strip().split(";")[0])
        return self.jobs[-1]

    def state(self, job: str) -> tuple[str, str]:
        out = self.as_user("squeue", "-h", "-j", job, "-o", "%T|%r", check=False).stdout.strip()
        state, _, reason = out.partition("|")
        return state, reason

    def planned(self, job: str) -> bool:
        """Whether Slurm has planned the job's start (a scheduling pass has seen it)."""
        start = self.as_user("squeue", "-h", "-j", job, "-o", "%S", check=False).stdout.strip()
        return start not in ("", "N/A")

    def cancel_all(self) -> None:
        if self.jobs:
            self.as_user("scancel", *self.jobs, check=False)


@pytest.fixture
def slurm(layout):
    s = Slurm(layout)
    yield s
    s.cancel_all()


def node_and_partition(layout) -> tuple[str, str]:
    return ("node2", "gpu-a6000") if layout.name == "default" else ("gpu-02", "gpu")


def run_dir(remote_root: str, name: str) -> Path:
    for p in (Path(remote_root) / "runs").iterdir():
        if json.loads((p / "run.json").read_text())["name"] == name:
            return p
    raise AssertionError(name)


def submitted(r: subprocess.CompletedProcess) -> tuple[str, str]:
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"submitted run (\S+): job (\d+)", r.stderr)
    assert m, r.stderr
    return m.group(1), m.group(2)


def test_why_a_run_waits_behind_a_higher_priority_job_and_past_the_backfill_window(layout, slurm, tmp_path):
    node, partition = node_and_partition(layout)
    script = Path(layout.remote_root) / "sleep.sh"  # where the cluster user can read it
    script.write_text(SLEEP)
    script.chmod(0o755)
    # One a6000 of the node busy for 10 minutes; a job of higher priority (sent first) waits for both.
    blocker = slurm.sbatch(
        script, f"--partition={partition}", "--gres=gpu:a6000:1", f"--nodelist={node}", "-t", "10"
    )
    wait_for(lambda: slurm.state(blocker)[0] == "RUNNING", 120, "the blocker to run")
    ahead = slurm.sbatch(
        script, f"--partition={partition}", "--gres=gpu:a6000:2", f"--nodelist={node}", "-t", "10"
    )
    wait_for(lambda: slurm.state(ahead)[0] == "PENDING", 30, "the job ahead to pend")
    # Its planned start (what the --time suggestion counts back from) comes with a scheduling pass:
    # on a loaded machine, later than its pending state.
    wait_for(lambda: slurm.planned(ahead), 60, "Slurm to plan the job ahead's start")
    proj = git_project(tmp_path / "p", {"a.py": "print('hi')\n"})
    # Our run wants the node's other a6000 for 2 days: longer than the backfill window (1 day), and
    # longer than the gap before the job ahead starts, so it cannot go in now.
    name, job = submitted(
        layout.run_rv(
            "run", "-g", "1", "-t", "a6000", "--nodelist", node, "--time", "2d", "--mem", "200M", "--",
            "python3", "a.py", cwd=proj,
        )
    )  # fmt: skip
    slurm.jobs.append(job)
    wait_for(lambda: slurm.state(job)[0] == "PENDING" and slurm.state(job)[1], 30, "the run to pend")
    r = layout.run_rv("why", name, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    why = json.loads(r.stdout)
    assert why["state"] == "PENDING" and why["run"] == name
    (w,) = why["waiting"]
    assert w["job_id"] == job and w["partition"] == partition
    assert w["code"].split(",")[0] in ("Priority", "Resources", "ReqNodeNotAvail"), w
    assert ahead in w["ahead"], w  # the job of higher priority it waits behind
    assert any("backfill window" in n for n in w["notes"]), w
    times = [s for s in w["suggestions"] if s["change"].startswith("--time")]
    assert times, w
    (minutes,) = [int(o.split("=")[1]) for o in times[0]["options"]]
    assert 5 <= minutes < 10, times  # before the job ahead starts, in at most 10 minutes
    # Every suggestion: sbatch --test-only takes the run's own script with it.
    rdir = run_dir(layout.remote_root, name)
    for s in w["suggestions"]:
        assert s["accepted"] is True
        judged = slurm.as_user("sbatch", "--test-only", *s["options"], str(rdir / s["script"]), check=False)
        assert judged.returncode == 0 and "to start at" in judged.stderr, (s, judged.stderr)
    # The words, as a person reads them; and rv ps's one line.
    text = layout.run_rv("why", name).stdout
    assert f"job {job}" in text and "try --time" in text and "sbatch --test-only accepts it" in text, text
    table = layout.run_rv("ps").stdout
    assert re.search(rf"{re.escape(name)}\s.*PENDING.*\((Priority|Resources|ReqNodeNotAvail)", table), table


def ensure_capped_qos(layout) -> None:
    """The QoS capped (one running job per user), as scripts/testcluster adds it: as root, when missing."""
    env = dict(os.environ, SLURM_CONF=str(STATES[layout.name] / "slurm.conf"))
    user = layout.cluster["RV_TESTCLUSTER_USER"]

    def sacctmgr(*args: str) -> str:
        done = subprocess.run(["sacctmgr", *args], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    if "capped" not in sacctmgr("-nP", "show", "qos", "format=name").split():
        sacctmgr("-i", "add", "qos", "capped", "maxjobsperuser=1")
    if "capped" not in sacctmgr("-nP", "show", "assoc", f"user={user}", "format=qos"):
        sacctmgr("-i", "modify", "user", user, "set", "qos+=capped")
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, env=env).stdout
    assert re.search(r"AccountingStorageEnforce\s*=\s*\S*limits", config), (
        "the default cluster does not enforce limits: `scripts/testcluster down && scripts/testcluster up` "
        "applies AccountingStorageEnforce=associations,limits,qos"
    )


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # the bare layout has no accounting
def test_why_a_run_held_by_a_qos_limit_names_it_with_its_value(layout, slurm, tmp_path):
    ensure_capped_qos(layout)
    proj = git_project(tmp_path / "p", {"a.py": "import time; time.sleep(300)\n"})
    _, job1 = submitted(
        layout.run_rv("run", "-g", "0", "--qos", "capped", "--mem", "100M", "--", "python3", "a.py", cwd=proj)
    )
    slurm.jobs.append(job1)
    wait_for(lambda: slurm.state(job1)[0] == "RUNNING", 120, "the first run to start")
    second, job2 = submitted(
        layout.run_rv("run", "-g", "0", "--qos", "capped", "--mem", "100M", "--", "python3", "a.py", cwd=proj)
    )
    slurm.jobs.append(job2)
    wait_for(
        lambda: slurm.state(job2) == ("PENDING", "QOSMaxJobsPerUserLimit"), 60, "the QoS limit to hold it"
    )
    r = layout.run_rv("why", second, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    (w,) = json.loads(r.stdout)["waiting"]
    assert (w["code"], w["kind"], w["qos"]) == ("QOSMaxJobsPerUserLimit", "limit", "capped")
    assert w["limit"] == "QoS capped allows running jobs per user: 1 (maxjobspu=1)"
    qos = [s for s in w["suggestions"] if s["change"].startswith("--qos")]
    assert {s["change"] for s in qos} == {"--qos normal", "--qos high"}, w
    rdir = run_dir(layout.remote_root, second)
    for s in qos:
        judged = slurm.as_user("sbatch", "--test-only", *s["options"], str(rdir / s["script"]), check=False)
        assert judged.returncode == 0, (s, judged.stderr)
    assert "held by a limit of its QoS: running jobs per user" in layout.run_rv("ps").stdout


# --- rv wait ------------------------------------------------------------------------------------------

WAITED = """\
import sys, time
time.sleep(float(sys.argv[1]))
print("done waiting", flush=True)
sys.exit(int(sys.argv[2]))
"""


def test_rv_wait_exits_with_the_programs_code(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"w.py": WAITED})
    failing, _ = submitted(
        layout.run_rv("run", "-g", "0", "--mem", "100M", "--", "python3", "w.py", "8", "7", cwd=proj)
    )
    fine, _ = submitted(
        layout.run_rv("run", "-g", "0", "--mem", "100M", "--", "python3", "w.py", "3", "0", cwd=proj)
    )
    # --until running returns once both have started (neither has ended yet, or has finished).
    started = layout.run_rv("wait", "--until", "running", failing, fine, timeout=300)
    assert started.returncode in (0, 7), started.stderr[-2000:]
    alone = layout.run_rv("wait", fine, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    both = layout.run_rv("wait", fine, failing, "--json", timeout=300)
    assert both.returncode == 7, both.stderr[-2000:]  # the program's own exit code
    rows = {row["name"]: row for row in json.loads(both.stdout)}
    assert (rows[failing]["state"], rows[failing]["exit_code"]) == ("FAILED", 7)
    assert (rows[fine]["state"], rows[fine]["exit_code"]) == ("COMPLETED", 0)
    # rv why of an ended run: why it ended, segment by segment.
    ended = layout.run_rv("why", failing, "--json")
    assert ended.returncode == 0, ended.stderr[-2000:]
    answer = json.loads(ended.stdout)
    assert (answer["state"], answer["summary"], answer["exit_code"]) == ("FAILED", "ended: crashed", 7)
    assert answer["waiting"] == [] and answer["details"][0].endswith(": crashed, exit code 7")
    # A run that is not on the cluster: an error before any wait, with the way to find runs.
    missing = layout.run_rv("wait", "no-such-run-xyz")
    assert missing.returncode == 9 and "rv ps -a" in missing.stderr, missing.stderr
