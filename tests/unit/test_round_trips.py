"""`rv ps`, `rv status` and `rv logs` at scale: 2,000 of the user's jobs in the queue, 500 runs in the
local records (half with secrets not yet seen removed) and 500 on the cluster.

The cluster is this machine: LocalTransport runs the real agent under a temp remote root, with
`squeue`, `sinfo` and `sacct` stand-ins first on PATH (each logs its call). The one seam faked is
the transport the CLI opens, so the round trips a command makes are counted where they leave rv.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from rv.cli.main import cli
from rv.remote.transport import LocalTransport

pytestmark = pytest.mark.usefixtures("hermetic_home")

HERE = Path(__file__).resolve().parent
SINFO = (HERE.parent / "captured" / "sinfo_nodes_busy.txt").read_text()
CONFIG = """
[profiles.lab]
host = "nowhere.invalid"
user = "me"
remote_root = "{root}"
"""
FAKE = """#!/bin/sh
echo "$0 $*" >> {log}
{body}
"""


@dataclass
class CountingTransport(LocalTransport):
    """LocalTransport that also connects (rv status times the connect); ``calls`` counts round trips."""

    calls: list[str] = field(default_factory=list)

    def connect(self) -> CountingTransport:
        return self


@dataclass
class Cluster:
    root: Path
    state: Path
    slurm_log: Path
    transport: CountingTransport
    run_name: str = "scale-probe"
    run_id: str = "f00dcafe"

    def slurm_calls(self, program: str) -> int:
        if not self.slurm_log.exists():
            return 0
        return sum(1 for line in self.slurm_log.read_text().splitlines() if line.split()[0].endswith(program))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cluster_run(root: Path, run_id: str, name: str, job: str, created: float, *, ended: bool) -> None:
    rdir = root / "runs" / run_id
    meta = {"run_id": run_id, "name": name, "project": "proj", "created": created, "max_segments": 10,
            "nodes": 1, "gpus": 0, "commit": "0123456789abcdef", "branch": "main"}  # fmt: skip
    _write(rdir / "run.json", json.dumps(meta))
    _write(rdir / "seg" / "1.job", job + "\n")
    record = {"job_id": job, "state": "ended" if ended else "running", "start": created, "nodes": "gpu-01"}
    if ended:
        record.update(end=created + 5, exit_code=0, reason="finished")
        _write(
            rdir / "ENDED",
            json.dumps({"reason": "finished", "exit_code": 0, "segment": 1, "end": created + 5}),
        )
    _write(rdir / "seg" / "1.json", json.dumps(record))


def _record(run_id: str, name: str, job: str, root: Path, created: float, *, secrets: bool) -> dict:
    return {
        "run_id": run_id, "name": name, "profile": "lab", "remote_root": str(root), "project": "proj",
        "snapshot": "0" * 64, "branch": "main", "commit": "0123456789abcdef", "dirty": False,
        "command": ["python", "train.py"], "request": {"nodes": 1, "max_segments": 10},
        "submitted_at": created, "job_id": job, "has_secrets": secrets,
    }  # fmt: skip


def make_cluster(tmp_path: Path, queued: int) -> tuple[Cluster, dict[str, str]]:
    root = tmp_path / "remote"
    state = tmp_path / "state"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "slurm.log"
    lines = "".join(
        f"{5000000 + i}|PENDING|JobHeldUser|0:00|1:00:00|1||N/A|gpu|N/A|2026-11-20T22:33:45|held\n"
        for i in range(queued)
    )
    _write(tmp_path / "squeue.txt", lines)
    _write(tmp_path / "sinfo.txt", SINFO)
    scripts = {
        "squeue": f"cat {tmp_path / 'squeue.txt'}",
        "sinfo": f"cat {tmp_path / 'sinfo.txt'}",
        "sacct": 'echo "Slurm accounting storage is disabled" >&2; exit 1',
    }
    for name, body in scripts.items():
        (bindir / name).write_text(FAKE.format(log=log, body=body))
        (bindir / name).chmod(0o755)
    # 500 ended runs on the cluster and in the local records; every other one was sent with secrets
    # this machine has not seen removed (so each command's sweep asks about 250 runs).
    now = time.time()
    records = []
    for i in range(500):
        run_id, job, created = f"{i:08x}", str(4000000 + i), now - 86400 * 2 + i
        _cluster_run(root, run_id, f"old-{i}", job, created, ended=True)
        records.append(_record(run_id, f"old-{i}", job, root, created, secrets=i % 2 == 0))
    c = Cluster(root, state, log, CountingTransport())
    _cluster_run(root, c.run_id, c.run_name, "4999999", now - 60, ended=True)
    _write(root / "runs" / c.run_id / "logs" / "4999999.out", "hello from the probe\n")
    records.append(_record(c.run_id, c.run_name, "4999999", root, now - 60, secrets=False))
    _write(state / "runs.json", json.dumps({"runs": records}))
    _write(tmp_path / "rv.toml", CONFIG.format(root=root))
    env = {
        "PATH": f"{bindir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RV_CONFIG": str(tmp_path / "rv.toml"),
        "RV_STATE_DIR": str(state),
        "RV_WARM_SECONDS": "0",
        "NO_COLOR": "1",
    }
    c.transport.env = {**os.environ, **env}
    return c, env


@pytest.fixture
def cluster(request, tmp_path, monkeypatch):
    c, env = make_cluster(tmp_path, request.param)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import rv.remote.connect

    monkeypatch.setattr(rv.remote.connect, "open_transport", lambda *a, **k: c.transport)
    return c


def rv(c: Cluster, *args: str):
    c.transport.calls.clear()
    if c.slurm_log.exists():
        c.slurm_log.unlink()
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result, len(c.transport.calls)


def records(c: Cluster) -> list[dict]:
    return json.loads((c.state / "runs.json").read_text())["runs"]


@pytest.mark.parametrize("cluster", [10, 2000], indirect=True, ids=["10-queued", "2000-queued"])
@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["ps"], None),
        (["ps", "-a", "--json"], "old-499"),
        (["status", "--json"], '"PENDING"'),
        (["logs", "scale-probe"], "hello from the probe"),
        (["logs"], "hello from the probe"),  # the latest run
        (["logs", "--tail", "1", "4999999"], "hello from the probe"),  # by job id
    ],
    ids=["ps", "ps-a", "status", "logs-name", "logs-latest", "logs-job-id"],
)
def test_one_round_trip_whatever_the_queue_and_the_records_hold(cluster, args, expect):
    result, trips = rv(cluster, *args)
    assert result.exit_code == 0, result.output
    assert trips == 1, cluster.transport.calls
    assert cluster.slurm_calls("squeue") == 1  # the sweep and the listing share one squeue
    if expect:
        assert expect in result.stdout
    # The sweep rode along: every run sent with secrets is now known to have none left.
    assert not [r for r in records(cluster) if r["has_secrets"] and not r.get("secrets_cleared")]


@pytest.mark.parametrize("cluster", [2000], indirect=True)
def test_what_the_commands_show_with_2000_queued_jobs(cluster):
    result, _ = rv(cluster, "ps", "--json")
    rows = json.loads(result.stdout)
    assert sum(1 for row in rows if row["state"] == "PENDING" and row["run_id"] is None) == 2000
    result, _ = rv(cluster, "ps")
    assert len(result.stdout.splitlines()) == 2001  # the header and one line per job
    result, _ = rv(cluster, "status", "--json")
    assert json.loads(result.stdout)["jobs"] == {"PENDING": 2000}
    # rv ps -a learns the end of all 500 old runs, in one write of the local records.
    result, _ = rv(cluster, "ps", "-a", "--json")
    assert len([row for row in json.loads(result.stdout) if row["run_id"]]) == 501
    assert all(r.get("ended") for r in records(cluster))
