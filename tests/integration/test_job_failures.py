"""What a job does when something before the program fails, on both layouts as the cluster user:
every end is recorded with the step and the error, and `rv ps`/`rv logs` say so (issue 28, item 7)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from projects import git_project


def ps_row(run_rv, name: str) -> dict:
    r = run_rv("ps", "-a", "--json")
    assert r.returncode == 0, r.stderr
    # Runs of this test's remote root only: jobs of the same name from earlier tests show as others.
    rows = [row for row in json.loads(r.stdout) if row["name"] == name and row["run_id"]]
    assert len(rows) == 1, rows
    (row,) = rows
    return row


def test_a_job_whose_checkpoint_folder_cannot_be_made_says_which_step_failed_and_why(layout, tmp_path):
    proj = git_project(tmp_path / "proj", {"train.py": "print('never runs')\n"})
    # The checkpoints folder belongs to root here (0755): the cluster user cannot make the run's
    # folder in it. The job fails at that step, before the program: it must say so, not "LOST".
    checkpoints = Path(layout.remote_root) / "checkpoints"
    checkpoints.mkdir(mode=0o755)
    os.chown(checkpoints, 0, 0)
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "300M", "--name", "no-ckpt", "-f", "--", "python3", "train.py", cwd=proj
    )
    assert r.returncode == 1, r.stderr[-3000:]
    row = ps_row(layout.run_rv, "no-ckpt")
    assert row["state"] == "FAILED", row
    assert row["reason"].startswith(
        "failed before the program started: making the checkpoint and output folders"
    )
    assert "Permission denied" in row["reason"], row
    logs = layout.run_rv("logs", "no-ckpt", "--err")
    assert "rv: making the checkpoint and output folders: mkdir: cannot create directory" in logs.stdout
    assert "never runs" not in r.stdout + r.stderr
