"""`rv gc --older-than 0` on the real loopback cluster: every ended run's leftovers go, never a live
run's; a duration without a unit is refused, naming the flag typed."""

from __future__ import annotations

import json

import pytest
from projects import git_project, wait_for

pytestmark = pytest.mark.integration


def test_gc_older_than_zero_removes_every_ended_run_and_never_a_live_one(run_rv, tmp_path):
    proj = git_project(tmp_path / "p", {"job.py": "import sys, time\ntime.sleep(float(sys.argv[1]))\n"})
    for name in ("done1", "done2"):
        r = run_rv(
            "run", "-g", "0", "--mem", "200M", "--name", name, "-f", "--", "python3", "job.py", "0", cwd=proj
        )
        assert r.returncode == 0, r.stderr
    live = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "alive", "--", "python3", "job.py", "300", cwd=proj
    )
    assert live.returncode == 0, live.stderr
    try:
        wait_for(lambda: "RUNNING" in run_rv("ps").stdout, 60, "the live run to start", step=0.5)
        # Both spellings of zero; the runs ended seconds ago (the default, 14d, keeps them).
        dry = run_rv("gc", "--older-than", "0s", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert sorted(r["name"] for r in json.loads(dry.stdout)["runs_removed"]) == ["done1", "done2"]
        report = run_rv("gc", "--older-than", "0", "--json")
        assert report.returncode == 0, report.stderr
        data = json.loads(report.stdout)
        assert sorted(r["name"] for r in data["runs_removed"]) == ["done1", "done2"]
        assert {k["name"]: k["why"] for k in data["runs_kept"]}["alive"].startswith("live (job ")
        assert "RUNNING" in run_rv("ps").stdout  # the live run goes on
    finally:
        assert run_rv("stop", "alive").returncode == 0
    bad = run_rv("gc", "--older-than", "3")
    assert bad.returncode == 2 and bad.stderr.startswith("rv: error: --older-than '3' has no unit")
    assert "--time" not in bad.stderr
