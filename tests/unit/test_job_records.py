"""Run records and views (pure), frames, and following's reconnect logic at the transport seam."""

from __future__ import annotations

import json
import shlex
import struct
import time

import pytest

from rv.errors import ConnectError, NotFound, UsageError
from rv.job.records import RunRecord, RunStore, end_state, parse_runs, run_exit_code, run_views
from rv.job.submit import FromRun, default_run_name
from rv.job.watch import FollowerFrameReader, follow_run
from rv.slurm.parse import SQUEUE_FORMAT, parse_squeue


def record(run_id: str, name: str, job: str, jobs=()) -> RunRecord:
    return RunRecord(
        run_id, name, "p", "/r", "proj", "snap", "main", "abc1234", False, ["true"], {"nodes": 1},
        time.time(), job, jobs=list(jobs),
    )  # fmt: skip


def test_run_store_resolves_name_run_id_job_id_and_prefix(tmp_path):
    store = RunStore(tmp_path / "runs.json")
    with pytest.raises(NotFound):
        store.resolve(None, "p")
    store.add(record("aaaa1111", "train-aaaa", "1234"))
    store.add(record("bbbb2222", "eval", "1250", jobs=["1250", "1301"]))
    store.add(record("cccc3333", "train-aaaa", "1299"))
    assert store.resolve(None, "p").run_id == "cccc3333"
    assert store.resolve("train-aaaa", "p").run_id == "cccc3333"  # the newest of a name
    assert store.resolve("aaaa1111", "p").run_id == "aaaa1111"
    assert store.resolve("1301", "p").run_id == "bbbb2222"  # a later segment's job
    assert store.resolve("bbbb", "p").run_id == "bbbb2222"
    assert store.resolve("9999", "p") is None  # unknown here: the cluster is asked
    with pytest.raises(UsageError, match="ambiguous"):
        store.resolve("12", "p")
    store.update("p", "bbbb2222", secrets_cleared=True)
    assert store.resolve("eval", "p").secrets_cleared
    assert (tmp_path / "runs.json").stat().st_mode & 0o777 == 0o600


def test_default_names_are_unique_per_run_and_from_parses():
    assert default_run_name("train", "3f9a1c2d") == "train-3f9a1c"
    assert default_run_name("x" * 80, "3f9a1c2d") == "x" * 57 + "-3f9a1c"
    assert FromRun.parse("grpo-1a2b@300") == FromRun("grpo-1a2b", 300)
    assert FromRun.parse("1234") == FromRun("1234", None)
    with pytest.raises(UsageError, match="RUN@STEP"):
        FromRun.parse("a b@x")


def squeue_line(job, state="RUNNING", reason="None", nodes="node1", elapsed="1:05"):
    fields = [
        job,
        state,
        reason,
        elapsed,
        "1:00:00",
        "1",
        nodes,
        "gres/gpu:a6000:2",
        "gpu",
        "N/A",
        "N/A",
        "n",
    ]
    assert len(fields) == SQUEUE_FORMAT.count("|") + 1
    return "|".join(fields)


def cluster_run(run_id, name, segments, ended=None, created=1.0):
    return {
        "run_id": run_id,
        "meta": {"name": name, "project": "proj", "max_segments": 10, "gpus": 2, "gpu_type": "a6000",
                 "nodes": 1, "commit": "abcdef123", "branch": "main", "created": created},
        "segments": segments,
        "ended": ended,
        "stop": False,
        "secrets": False,
    }  # fmt: skip


def seg(k, job, state="ended", reason="stopped at time limit", start=100.0, end=160.0, step=None, code=0):
    return {
        "segment": k,
        "job_id": job,
        "record": {"state": state, "reason": reason, "start": start, "end": end, "exit_code": code,
                   "checkpoint_step": step, "job_id": job},
    }  # fmt: skip


def test_views_one_line_per_run_live_from_squeue_ended_from_records():
    runs = parse_runs(
        [
            cluster_run(
                "r1", "chain", [seg(1, "11", step=40), seg(2, "12", state="running", reason="")], created=3
            ),
            cluster_run(
                "r2", "done", [seg(1, "21", reason="finished", step=None)], created=2,
                ended={"reason": "finished", "exit_code": 0},
            ),
            cluster_run(
                "r3", "capped", [seg(1, "31", reason="stopped at time limit; all 1 segments used")],
                created=1, ended={"reason": "stopped at time limit; all 1 segments used", "exit_code": 1},
            ),
            cluster_run("r4", "lost", [seg(1, "41", state="running", reason="")], created=0.5),
        ]
    )  # fmt: skip
    queued = parse_squeue(
        "\n".join([squeue_line("12", elapsed="1:05"), squeue_line("99", "PENDING", "Priority", "")])
    )
    views = run_views(runs, queued, now=200.0)
    by_name = {v.name: v for v in views}
    assert [v.name for v in views] == ["chain", "done", "capped", "lost", "n"]  # newest run first, then jobs
    chain = by_name["chain"]
    assert (chain.segment, chain.max_segments, chain.state, chain.job_id, chain.live) == (
        2,
        10,
        "RUNNING",
        "12",
        True,
    )
    assert chain.elapsed_seconds == 60 + 65  # the ended segment's span, the live one's per squeue
    assert chain.checkpoint_step == 40 and chain.source == "main@abcdef1"
    assert (by_name["done"].state, by_name["done"].exit_code) == ("COMPLETED", 0)
    assert (by_name["capped"].state, by_name["capped"].exit_code) == ("STOPPED", 1)
    assert by_name["lost"].state == "UNKNOWN" and "no record" in by_name["lost"].reason
    other = by_name["n"]
    assert (other.run_id, other.state, other.reason, other.live) == (None, "PENDING", "Priority", True)
    assert [v.name for v in run_views(runs, queued, now=200.0, live_only=True)] == ["chain", "n"]


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        ("finished", "COMPLETED"),
        ("crashed", "FAILED"),
        ("failed before the program started: setup line 1 failed with exit code 2", "FAILED"),
        ("time limit", "TIMEOUT"),
        ("stopped at time limit with no progress (step 5, as when it started): not continued", "STOPPED"),
        ("cancelled by rv stop", "CANCELLED"),
        ("preempted", "PREEMPTED"),
        ("ended without a record (cancelled or killed before it could write one)", "LOST"),
    ],
)
def test_end_states(reason, state):
    assert end_state(reason) == state


def test_run_exit_code_is_never_success_when_unknown():
    assert run_exit_code({"exit_code": 0}) == 0
    assert run_exit_code({"exit_code": 3}) == 3
    assert run_exit_code({"exit_code": None}) == 1
    assert run_exit_code(None) == 1


def frame(head: dict, data: bytes = b"") -> bytes:
    h = json.dumps(head).encode()
    return struct.pack(">II", len(h), len(data)) + h + data


def test_frame_reader_handles_frames_split_anywhere():
    stream = frame({"t": "data", "f": "a", "o": 0, "s": "out"}, b"hello\n") + frame(
        {"t": "end", "ended": None}
    )
    for cut in range(len(stream) + 1):
        reader = FollowerFrameReader()
        got = list(reader.feed(stream[:cut])) + list(reader.feed(stream[cut:]))
        assert [h["t"] for h, _ in got] == ["data", "end"]
        assert got[0][1] == b"hello\n"


class DroppingTransport:
    """The one fake seam: a follower whose first connection drops after some output."""

    def __init__(self, scripts):
        self.scripts = scripts  # per connection: (frames to send, then raise?)
        self.commands: list[str] = []
        self.closed = 0

    def stream(self, command, *, on_stdout, on_stderr=None, keep_stdin_open=False, **_):
        self.commands.append(command)
        frames, fail = self.scripts[len(self.commands) - 1]
        for f in frames:
            on_stdout(f)
        if fail:
            raise ConnectError("connection to host was lost")
        return 0

    def close(self):
        self.closed += 1


class Recorder:
    def __init__(self):
        self.out = []
        self.notes = []

    def output(self, stream, data, source=""):
        self.out.append((stream, data))

    def segment(self, frame):
        self.notes.append(("segment", frame["segment"]))

    def segment_end(self, frame):
        self.notes.append(("segment-end", frame["segment"]))

    def state(self, frame):
        pass

    def warning(self, message):
        self.notes.append(("warning", message))

    def reconnecting(self, error, wait):
        self.notes.append(("reconnecting", error))


def test_follow_resumes_after_a_drop_from_the_offsets_received():
    first = [
        frame({"t": "segment", "segment": 2, "job_id": "12", "record": None}),
        frame({"t": "data", "f": "/r/runs/x/logs/12.out", "o": 0, "s": "out", "seg": 2}, b"line 1\nline"),
    ]
    second = [
        frame({"t": "segment", "segment": 2, "job_id": "12", "record": None}),
        frame({"t": "data", "f": "/r/runs/x/logs/12.out", "o": 11, "s": "out", "seg": 2}, b" 2\n"),
        frame({"t": "segment-end", "segment": 2, "job_id": "12", "record": {}}),
        frame({"t": "end", "ended": {"reason": "finished", "exit_code": 0}, "segment": 2}),
    ]
    t = DroppingTransport([(first, True), (second, False)])
    view = Recorder()
    slept = []
    done = follow_run(lambda: t, lambda: t, "/r", "x", view, sleep=slept.append)
    assert b"".join(d for _, d in view.out) == b"line 1\nline 2\n"  # nothing twice, nothing lost
    assert done.ended == {"reason": "finished", "exit_code": 0} and run_exit_code(done.ended) == 0
    assert ("reconnecting", "connection to host was lost") in view.notes and slept == [1.0]
    # The second follower was asked to start at segment 2, byte 11 of that file.
    second_args = json.loads(shlex.split(t.commands[1])[-1])
    assert second_args["offsets"] == {"/r/runs/x/logs/12.out": 11} and second_args["from_segment"] == 2
