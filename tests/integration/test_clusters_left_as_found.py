"""A test that fails leaves the loopback clusters as it found them: conftest cancels, at teardown,
every job a test started (by the test's remote root), and the jobs of `rv run` and `rv up` get the
tests' short time limit (conftest.TEST_TIME) rather than rv's 2:59:00."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import jobs_under

# Run by a pytest of its own with this folder's conftest as a plugin: it queues a job on each layout,
# writes down what the queue holds, and fails.
DOOMED = """
import json, os, subprocess

from conftest import jobs_under
from projects import git_project


def test_fails_on_purpose_with_its_job_queued(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"a.py": "print(1)\\n"})
    r = layout.run_rv("run", "-g", "0", "--mem", "200M", "--name", "doomed", "--", "sleep", "600", cwd=proj)
    assert r.returncode == 0, r.stderr
    jobs = jobs_under(layout.cluster, layout.remote_root)
    limits = subprocess.run(
        ["squeue", "-h", "-o", "%l", "-j", ",".join(jobs)], capture_output=True, text=True,
        env=dict(os.environ, SLURM_CONF=layout.cluster["SLURM_CONF"]),
    ).stdout.split()
    with open(os.environ["RV_DOOMED_OUT"], "a") as fh:
        row = {"layout": layout.name, "root": layout.remote_root, "jobs": jobs, "limits": limits}
        fh.write(json.dumps(row) + "\\n")
    raise AssertionError("failed on purpose, with its job in the queue")
"""


def test_a_test_that_fails_leaves_no_job_of_its_own_in_the_queue(cluster, bare_cluster, tmp_path):
    (tmp_path / "test_doomed.py").write_text(DOOMED)
    out = tmp_path / "out.jsonl"
    path = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), RV_DOOMED_OUT=str(out))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "test_doomed.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.count("failed on purpose, with its job in the queue") >= 2, r.stdout[-3000:]
    rows = {row["layout"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["bare", "default"]
    for name, values in (("default", cluster), ("bare", bare_cluster)):
        row = rows[name]
        # When the test failed, its job was queued, with the tests' limit (20 minutes)...
        assert len(row["jobs"]) == 1 and row["limits"] == ["20:00"], row
        # ...and once its teardown ran, nothing of it is left.
        assert jobs_under(values, row["root"]) == [], name
