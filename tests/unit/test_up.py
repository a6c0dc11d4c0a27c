"""`rv up`'s watchdog and holder without a cluster: the agent runs for real (LocalTransport), with
stand-ins for sbatch, squeue and scancel on PATH; the holder runs in bash.

The promise under test: the session's job is cancelled however rv goes (the shell exits, Ctrl-C,
rv killed: the watchdog's stdin ends), except when rv detached it, and the job ends itself when the
watchdog's heartbeat stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rv.catalog import RIVANNA
from rv.job import up
from rv.job.submit import script_context
from rv.layout import RemoteLayout
from rv.remote.transport import LocalTransport
from rv.request import build_request

JOB = "777"
STUBS = {
    # Submitting starts the "job": it is queued while $STUB/alive exists.
    "sbatch": 'touch "$STUB/alive"; printf "%s\\n" "$*" >> "$STUB/sbatch.log"; echo ' + JOB,
    "squeue": (
        '[ -e "$STUB/alive" ] || exit 0\n'
        'if [ -e "$STUB/pending" ]; then\n'
        '    echo "777|PENDING|Resources|0:00|1:00:00|1||gres:gpu:a6000:1|gpu|2026-11-23T19:00:00|'
        '2026-11-23T18:00:00|up-test"\n'
        "else\n"
        '    echo "777|RUNNING|None|0:05|1:00:00|1|gpu-01|gres:gpu:a6000:1|gpu|2026-11-23T18:00:05|'
        '2026-11-23T18:00:00|up-test"\n'
        "fi"
    ),
    "scancel": 'printf "%s\\n" "$*" >> "$STUB/scancel.log"; rm -f "$STUB/alive"',
}


class Recorder:
    def __init__(self) -> None:
        self.states: list[str] = []
        self.record = None

    def submitted(self, record) -> None:
        self.record = record

    def state(self, job) -> None:
        self.states.append(job.state)

    def warning(self, message: str) -> None:
        raise AssertionError(message)


@pytest.fixture
def cluster(tmp_path):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text("#!/bin/bash\n" + text + "\n")
        (stubs / name).chmod(0o755)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{stubs}:{bindir}:{os.environ['PATH']}", "STUB": str(stubs)}
    return stubs, LocalTransport(env=env), RemoteLayout(str(tmp_path / "remote"))


def start(cluster, secrets=None):
    _stubs, transport, layout = cluster
    Path(layout.root).mkdir(exist_ok=True)
    req = build_request(
        RIVANNA, command=up.holder_command(), gpu_type="a6000", name="up-test", max_segments=1, each_node=True
    )
    ctx = script_context(layout, run_id="run0a1b2", snapshot_id="snap01", project="proj", account=None,
                         has_secrets=bool(secrets))  # fmt: skip
    view = Recorder()
    dog, record = up.start(
        transport, layout, req, ctx, profile="p", provenance={}, secrets=secrets or {}, view=view
    )
    assert record.job_id == JOB and view.record is record
    return dog, view, Path(ctx.run_dir)


def job_ready(run_dir: Path) -> None:
    """What the job script does once its environment is built: env.sh in its job folder."""
    (run_dir / "jobs" / JOB).mkdir(parents=True)
    (run_dir / "jobs" / JOB / "env.sh").write_text("export X=1\n")


def cancelled(stubs: Path, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    log = stubs / "scancel.log"
    while time.monotonic() < deadline and not log.exists():
        time.sleep(0.05)
    return log.read_text().split() if log.exists() else []


def test_the_shell_exits_then_release_cancels_and_waits_until_the_job_is_gone(cluster):
    stubs = cluster[0]
    dog, view, run_dir = start(cluster, secrets={"HF_TOKEN": "hf s3cr3t"})
    # The secrets travel on stdin into the run's 0600 file, never into the script.
    secrets = run_dir / "secrets.env"
    assert "hf s3cr3t" in secrets.read_text() and secrets.stat().st_mode & 0o777 == 0o600
    assert "s3cr3t" not in (run_dir / "job.sbatch").read_text()
    job_ready(run_dir)
    ready = up.wait_ready(dog, view)
    assert (ready.job_id, ready.node_list) == (JOB, ("gpu-01",))
    assert (run_dir / "up.alive").read_text().strip() == "1"  # the watchdog's heartbeat has begun
    assert up.release(dog) == (True, None)
    assert cancelled(stubs) == [JOB]
    # The stand-in job never ran its EXIT trap (as one Slurm kills before it can): the watchdog
    # does its tidying once the job has left the queue.
    assert not secrets.exists() and not (run_dir / "jobs" / JOB / "env.sh").exists()
    assert json.loads((run_dir / "ENDED").read_text())["reason"].startswith("cancelled by rv up")


def test_the_end_of_rvs_stdin_cancels_a_pending_job(cluster):
    # rv exited or was killed, or its connection dropped: the watchdog's stdin ends.
    stubs = cluster[0]
    (stubs / "pending").touch()
    dog, _view, run_dir = start(cluster)
    frame = dog.next(30)
    assert frame is not None and frame["t"] == "state" and dog.last is not None
    assert (dog.last.state, dog.last.reason, dog.last.start) == (
        "PENDING",
        "Resources",
        "2026-11-23T19:00:00",
    )
    dog.close()
    assert cancelled(stubs) == [JOB]
    wait_ended(run_dir)


def wait_ended(run_dir: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not (run_dir / "ENDED").exists():
        assert time.monotonic() < deadline, "the watchdog did not record the end of the run"
        time.sleep(0.05)


def test_silence_from_rv_cancels(cluster, monkeypatch):
    # A connection that died without closing: no line from rv for `silence` seconds.
    stubs = cluster[0]
    monkeypatch.setattr(up, "SILENCE_S", 1.0)
    monkeypatch.setattr(up, "HEARTBEAT_S", 3600.0)  # rv says nothing
    dog, _view, _ = start(cluster)
    assert cancelled(stubs) == [JOB]
    while (frame := dog.next(30)) is not None and frame["t"] != "lost":
        pass
    assert frame is not None and frame["t"] == "lost"
    dog.close()


def test_detach_keeps_the_job_and_tells_the_holder(cluster):
    stubs = cluster[0]
    dog, view, run_dir = start(cluster)
    job_ready(run_dir)
    up.wait_ready(dog, view)
    up.detach(dog)  # also ends the watchdog's stdin: it must not cancel now
    dog._worker.join(timeout=30)  # the watchdog has exited: no cancel can come any more
    assert not dog._worker.is_alive()
    assert not (stubs / "scancel.log").exists()
    assert (run_dir / "up.detached").exists()


def test_an_error_while_the_session_is_held_releases_it_and_a_detached_one_is_kept(cluster):
    # rv.job.up.held: what `rv up` attends is released on any way out it did not settle itself.
    stubs = cluster[0]
    dog, view, run_dir = start(cluster)
    with pytest.raises(RuntimeError, match="on the way"), up.held(dog) as hold:
        job_ready(run_dir)
        up.wait_ready(dog, view)
        raise RuntimeError("the connection failed on the way")
    assert not hold.settled and cancelled(stubs) == [JOB]
    wait_ended(run_dir)
    (stubs / "scancel.log").unlink()
    (run_dir / "ENDED").unlink()
    dog, view, _ = start(cluster)
    (run_dir / "jobs" / JOB).mkdir(parents=True, exist_ok=True)
    (run_dir / "jobs" / JOB / "env.sh").write_text("export X=1\n")
    with up.held(dog) as hold:
        up.wait_ready(dog, view)
        hold.detach()
    dog._worker.join(timeout=30)
    assert hold.settled and not (stubs / "scancel.log").exists()


def test_a_job_that_ends_before_the_shell_is_reported_with_its_reason(cluster):
    stubs = cluster[0]
    dog, view, run_dir = start(cluster)
    (run_dir / "ENDED").write_text('{"reason": "failed before the program started: setup line 1 failed"}\n')
    (stubs / "alive").unlink()  # the job left the queue by itself
    with pytest.raises(up.SessionEnded, match="setup line 1 failed"):
        up.wait_ready(dog, view)
    dog.close()
    assert not (stubs / "scancel.log").exists()


def test_a_job_sbatch_refuses_says_sbatchs_reason_and_nothing_is_left(cluster):
    # Issue 33: it ended in "the watchdog of the rv up session ended (exit 0)", with no reason.
    stubs = cluster[0]
    refusal = "sbatch: error: Batch job submission failed: Invalid qos specification"
    (stubs / "sbatch").write_text(f"#!/bin/bash\necho '{refusal}' >&2\nexit 1\n")
    with pytest.raises(up.RemoteError) as err:
        start(cluster)
    assert "not queued: sbatch rejected the job: " in err.value.message, err.value.message
    assert "Invalid qos specification" in err.value.message and "--qos" in (err.value.hint or "")
    assert not (stubs / "scancel.log").exists()


# --- the holder ------------------------------------------------------------------------------------


def holder(run_dir: Path, limit: int, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["timeout", str(timeout), *up.holder_command(limit)],
        env={"PATH": os.environ["PATH"], "RV_RUN_DIR": str(run_dir)},
        capture_output=True,
        text=True,
    )


def test_the_holder_gives_the_allocation_back_when_the_heartbeat_stops(tmp_path):
    (tmp_path / "up.alive").write_text("41\n")  # a heartbeat that never moves again
    r = holder(tmp_path, limit=1, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no heartbeat from the watchdog for over 1 s" in r.stderr


def test_a_detached_holder_keeps_the_allocation(tmp_path):
    (tmp_path / "up.detached").touch()
    r = holder(tmp_path, limit=1, timeout=5)
    assert r.returncode == 124, r.stderr  # still holding when `timeout` ended it
