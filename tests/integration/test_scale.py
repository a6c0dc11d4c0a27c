"""`rv ps`, `rv status` and `rv logs` with 2,000 of the user's jobs in the queue and 500 runs in the
local records (and on the cluster), on the bare layout (no accounting, one mixed partition).

The jobs are real: 2,000 held jobs the cluster user submits itself (`sbatch --hold`; the bare layout
allows 10,000 jobs, and arrays of at most 1,001 tasks, which squeue would show as one line each
while pending, so they are single jobs), cancelled at the end by their ids. That each command makes
one round trip is counted at the transport in tests/unit/test_scale.py; here the commands are shown
to tell the whole truth at that size.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from projects import git_project

SUBMIT = (
    "for i in $(seq {n}); do "
    "sbatch --hold --parsable -J rv-scale-held -t 1 --mem 10M -o /dev/null --wrap true || exit 1; done"
)


def add_old_runs(remote_root: str, user: str, state: Path, count: int) -> None:
    """``count`` runs that ended a day ago, on the cluster (as the jobs write them) and in the local
    records (every other one sent with secrets this machine has not yet seen removed)."""
    records = json.loads(state.read_text())
    model = records["runs"][-1]
    created = model["submitted_at"] - 86400
    runs = Path(remote_root) / "runs"
    added = []
    for i in range(count):
        run_id, job = f"0ld{i:05x}", str(9000000 + i)
        rdir = runs / run_id
        (rdir / "seg").mkdir(parents=True)
        meta = {"run_id": run_id, "name": f"old-{i}", "project": model["project"], "created": created + i,
                "max_segments": 10, "nodes": 1}  # fmt: skip
        (rdir / "run.json").write_text(json.dumps(meta))
        (rdir / "seg" / "1.job").write_text(job + "\n")
        end = {"reason": "finished", "exit_code": 0, "segment": 1, "end": created + i + 5}
        (rdir / "seg" / "1.json").write_text(json.dumps({"job_id": job, "state": "ended", **end}))
        (rdir / "ENDED").write_text(json.dumps(end))
        local = {"run_id": run_id, "name": f"old-{i}", "job_id": job, "jobs": [], "ended": None,
                 "submitted_at": created + i, "has_secrets": i % 2 == 0,
                 "secrets_cleared": False}  # fmt: skip
        added.append({**model, **local})
    subprocess.run(["chown", "-R", f"{user}:", str(runs)], check=True)
    records["runs"] = added + records["runs"]
    state.write_text(json.dumps(records))


def test_ps_status_and_logs_with_2000_queued_jobs_and_500_runs(
    run_rv_bare, bare_rv_env, bare_remote_root, bare_cluster, tmp_path
):
    proj = git_project(tmp_path / "proj", {"hello.sh": "echo hello-at-scale\n"})
    r = run_rv_bare(
        "run", "-g", "0", "--mem", "200M", "--name", "probe", "-f", "--", "sh", "hello.sh", cwd=proj
    )
    assert r.returncode == 0 and "hello-at-scale" in r.stdout, r.stderr[-2000:]
    state = next(Path(bare_rv_env["HOME"]).rglob("runs.json"))
    add_old_runs(bare_remote_root, bare_cluster["RV_TESTCLUSTER_USER"], state, 500)

    submit = run_rv_bare("exec", SUBMIT.format(n=2000), timeout=600)
    held = re.findall(r"^(\d+)", submit.stdout, re.M)
    try:
        assert submit.returncode == 0 and len(held) == 2000, submit.stderr[-2000:]

        ps = run_rv_bare("ps", "--json")
        assert ps.returncode == 0, ps.stderr[-2000:]
        rows = {row["job_id"]: row for row in json.loads(ps.stdout)}
        assert all(rows[job]["state"] == "PENDING" for job in held)
        # The sweep rode along on that one call: all 250 runs sent with secrets are settled locally.
        pending = [
            r for r in json.loads(state.read_text())["runs"] if r["has_secrets"] and not r["secrets_cleared"]
        ]
        assert pending == []

        table = run_rv_bare("ps").stdout.splitlines()
        shown = {line.split()[4] for line in table[1:] if len(line.split()) > 4}  # the JOB column
        assert set(held) <= shown and len(table) >= 2001

        every = run_rv_bare("ps", "-a", "--json")
        names = {row["name"] for row in json.loads(every.stdout) if row["run_id"]}
        assert {f"old-{i}" for i in range(500)} | {"probe"} <= names
        # ... and rv ps -a wrote what it learned of 500 runs into the local records.
        assert all(r.get("ended") for r in json.loads(state.read_text())["runs"])

        status = run_rv_bare("status", "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["jobs"].get("PENDING", 0) >= 2000

        logs = run_rv_bare("logs", "probe")
        assert logs.returncode == 0 and "hello-at-scale" in logs.stdout, logs.stderr[-2000:]
    finally:
        if held:
            cancel = run_rv_bare("exec", "scancel " + " ".join(held))
            assert cancel.returncode == 0, cancel.stderr[-2000:]
