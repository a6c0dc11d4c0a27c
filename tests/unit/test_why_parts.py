"""rv why's parsers (captured output of the loopback cluster, and hand-written cases it cannot make),
the reasons in words, and the suggestions a pending run gets; rv wait's decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

from rv.catalog import GpuType
from rv.errors import ConnectError
from rv.job import wait as waiting
from rv.job import why
from rv.job.query import RunsListing
from rv.job.records import ClusterRun, Segment
from rv.slurm.parse import parse_squeue
from rv.slurm.pending import (
    ASSOC_FIELDS,
    QOS_FIELDS,
    one_line,
    parse_backfill_window,
    parse_queue,
    parse_sacctmgr,
    parse_scontrol_jobs,
    parse_scontrol_line,
    reason,
    tres_value,
)

CAPTURED = Path(__file__).resolve().parent.parent / "captured"


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


# --- parsers --------------------------------------------------------------------------------------------


def test_scontrol_jobs_of_every_kind_of_wait():
    jobs = {j.job_id: j for j in parse_scontrol_jobs(captured("scontrol_job_pending.txt"))}
    assert {j: (x.state, x.reason) for j, x in jobs.items()} == {
        "413": ("PENDING", "ReqNodeNotAvail, UnavailableNodes:node2"),
        "412": ("PENDING", "Resources"),
        "414": ("PENDING", "JobHeldUser"),
        "415": ("PENDING", "BeginTime"),
        "416": ("PENDING", "Dependency"),
    }
    behind, ahead = jobs["413"], jobs["412"]
    assert (behind.partition, behind.qos, behind.account) == ("gpu-a6000", "normal", "rv")
    assert behind.time_limit_seconds == 2 * 86400 and ahead.time_limit_seconds == 600
    assert behind.priority is not None and ahead.priority is not None and ahead.priority > behind.priority
    assert (
        isinstance(behind.start, int) and behind.start > ahead.start
    )  # epoch seconds (SLURM_TIME_FORMAT=%s)
    assert behind.tres["gres/gpu"] == "1" and ahead.tres["gres/gpu"] == "2"
    assert jobs["416"].dependency == "afterok:412(unfulfilled)"
    (running,) = parse_scontrol_jobs(captured("scontrol_job_running.txt"))
    assert (running.state, running.reason, running.node_list) == ("RUNNING", None, "node2")


def test_a_scontrol_value_with_spaces_stays_whole():
    f = parse_scontrol_line(
        "JobId=1 Reason=ReqNodeNotAvail, UnavailableNodes:node2 Command=/a b/c.sh WorkDir=/x"
    )
    assert f["Reason"] == "ReqNodeNotAvail, UnavailableNodes:node2" and f["Command"] == "/a b/c.sh"
    assert (
        parse_scontrol_jobs("") == [] and parse_scontrol_jobs("slurm_load_jobs error: Invalid job id\n") == []
    )


def test_the_partitions_queue():
    queue = parse_queue(captured("squeue_partition_pending.txt"))
    assert [(q.job_id, q.state, q.reason) for q in queue] == [
        ("412", "PENDING", "Resources"),
        ("413", "PENDING", "ReqNodeNotAvail, UnavailableNodes:node2"),
        ("416", "PENDING", "Dependency"),
        ("409", "RUNNING", None),
    ]
    assert queue[2].start is None and queue[2].tres_per_node is None  # N/A: not planned, no gres
    assert queue[0].start is not None and queue[0].time_limit_seconds == 600
    assert parse_queue("") == []


def test_limits_from_sacctmgr():
    rows = parse_sacctmgr(captured("sacctmgr_qos_limits.txt"), QOS_FIELDS)
    assert {r["name"]: r["maxjobspu"] for r in rows} == {"normal": "", "high": "", "capped": "1"}
    (assoc,) = parse_sacctmgr(captured("sacctmgr_assoc_limits.txt"), ASSOC_FIELDS)
    assert (assoc["account"], assoc["qos"]) == ("rv", "capped,high,normal")
    qos = {r["name"]: r for r in parse_sacctmgr(captured("sacctmgr_qos_handwritten.txt"), QOS_FIELDS)}
    assert tres_value(qos["gpu-limited"]["maxtrespu"], "gres/gpu") == "4"
    assert tres_value("gres/gpu:a100=8,cpu=4", "gres/gpu") == "gres/gpu:a100=8"
    assert tres_value("cpu=4", "gres/gpu") is None


def test_the_backfill_window():
    assert parse_backfill_window(captured("scontrol_config_excerpt.txt")) == 86400  # Slurm's default
    assert parse_backfill_window("SchedulerParameters = bf_interval=30,bf_window=4320\n") == 4320 * 60


@pytest.mark.parametrize(
    ("code", "kind", "words"),
    [
        ("Priority", "priority", "waiting behind jobs of higher priority"),
        ("Resources", "resources", "waiting for the GPUs, CPUs or memory it asks for to free up"),
        ("ReqNodeNotAvail,_UnavailableNodes:node2", "nodes", "a node it needs is down"),
        ("JobHeldUser", "held", "held by you"),
        ("BeginTime", "begin", "its begin time"),
        ("Dependency", "dependency", "waiting for a job it depends on"),
        ("QOSMaxJobsPerUserLimit", "limit", "held by a limit of its QoS: running jobs per user"),
        ("AssocGrpGRESMinutes", "limit", "held by a limit of its account (association): GPU-minutes"),
        ("QOSSomethingNew", "limit", "held by a limit of its QoS (QOSSomethingNew)"),
        ("SomethingElse", "other", "Slurm's reason: SomethingElse"),
    ],
)
def test_reasons_in_words(code, kind, words):
    r = reason(code)
    assert r.kind == kind and r.words.startswith(words), r


def test_rv_ps_one_line_form():
    assert one_line("Priority") == "Priority: waiting behind jobs of higher priority"
    # Slurm's "None" (squeue's reason before the scheduler's first look) is no word to show.
    assert one_line(None) == one_line("None") == "not yet looked at by the scheduler"
    assert one_line("QOSGrpGRES") == "QOSGrpGRES: held by a limit of its QoS: GPUs of all its jobs together"


# --- explaining a pending run ------------------------------------------------------------------------------

CATALOG = {
    "a6000": GpuType("a6000", "gpu-a6000", "a6000", 2, 8.6),
    "v100": GpuType("v100", "gpu-v100", "v100", 2, 7.0),
}


def run_of(job: str, gpu_type: str = "a6000", gpus_per_node: int = 1) -> ClusterRun:
    seg = Segment(1, job, "submitted", "", None, None, None, "", 0, None, None, False, None)
    meta = {"name": "r", "gpu_type": gpu_type, "gpus": gpus_per_node, "nodes": 1,
            "request": {"gpus_per_node": gpus_per_node}, "max_segments": 10}  # fmt: skip
    return ClusterRun("run1", meta, (seg,), None, False, False)


def squeue_line(job: str, reason: str, partition: str = "gpu-a6000", limit: str = "2-00:00:00") -> str:
    # SQUEUE_FORMAT: %i|%T|%r|%M|%l|%D|%N|%b|%P|%S|%V|%j
    return f"{job}|PENDING|{reason}|0:00|{limit}|1||gres:gpu:a6000:1|{partition}|N/A|N/A|r"


def answers(job_text: str, queue: str, qos: str, assoc: str, config: str) -> dict:
    return {
        "job:413": {"text": job_text, "error": None},
        "queue:gpu-a6000": {"text": queue, "error": None},
        "qos": {"text": qos, "error": None},
        "assoc": {"text": assoc, "error": None},
        "config": {"text": config, "error": None},
    }


def test_a_run_behind_a_job_of_higher_priority_gets_the_longest_time_before_it_and_another_type():
    run = run_of("413")
    (pending,) = why.pending_jobs(run, parse_squeue(squeue_line("413", "ReqNodeNotAvail")))
    assert (pending.script, pending.gpu_type) == ("job.sbatch", "a6000")
    job_text = captured("scontrol_job_pending.txt").splitlines()[0]
    queue = captured("squeue_partition_pending.txt")
    ahead_start = parse_queue(queue)[0].start
    assert ahead_start is not None
    now = ahead_start - 600  # the job ahead is planned to start in 10 minutes
    (w,) = why.explain_pending(
        run, [pending],
        answers(job_text, queue, captured("sacctmgr_qos_limits.txt"), captured("sacctmgr_assoc_limits.txt"),
                captured("scontrol_config_excerpt.txt")),
        now=now, catalog=CATALOG,
    )  # fmt: skip
    assert (w.kind, w.ahead, w.running, w.limit) == ("nodes", ("412",), 1, None)
    assert w.expected_in_s is not None and w.expected_in_s > 600
    assert any("backfill window" in n for n in w.notes)
    changes = {s.change: s for s in w.suggestions}
    assert changes["--time 9m"].options == ("--time=9",)  # 10 minutes less the margin
    assert changes["-t v100"].options == ("--partition=gpu-v100", "--gres=gpu:v100:1")
    assert "--qos high" not in changes  # a node wait, not a QoS's: another QoS would not help


def test_a_run_held_by_a_qos_limit_names_it_with_its_value_and_other_qos():
    run = run_of("413", gpus_per_node=2)
    (pending,) = why.pending_jobs(run, parse_squeue(squeue_line("413", "QOSMaxGRESPerUser")))
    job_text = captured("scontrol_job_qos_handwritten.txt").replace("JobId=5120", "JobId=413")
    (w,) = why.explain_pending(
        run, [pending], answers(job_text, "", captured("sacctmgr_qos_handwritten.txt"),
                                captured("sacctmgr_assoc_handwritten.txt"), ""),
        now=0, catalog=CATALOG,
    )  # fmt: skip
    assert w.limit == "QoS gpu-limited allows GPUs per user: 4 (maxtrespu=gres/gpu=4,cpu=64)"
    changes = {s.change: s.options for s in w.suggestions}
    assert changes["--qos normal"] == ("--qos=normal",)
    assert changes["-g 1"] == ("--gres=gpu:a6000:1",)  # half the GPUs, for a GPU limit
    assert not any(c.startswith("--time") for c in changes)


def test_without_accounting_a_limit_is_named_without_a_value():
    run = run_of("413")
    (pending,) = why.pending_jobs(run, parse_squeue(squeue_line("413", "QOSMaxJobsPerUserLimit")))
    job_text = (
        captured("scontrol_job_pending.txt")
        .splitlines()[0]
        .replace("Reason=ReqNodeNotAvail,_UnavailableNodes:node2", "Reason=QOSMaxJobsPerUserLimit")
    )
    failed = {"text": "", "error": "You are not running a supported accounting_storage plugin"}
    (w,) = why.explain_pending(
        run,
        [pending],
        {**answers(job_text, "", "", "", ""), "qos": failed, "assoc": failed},
        now=0,
        catalog=CATALOG,
    )
    assert w.limit == "QoS normal: running jobs per user (sacctmgr shows no value: no accounting here)"


def test_only_suggestions_sbatch_accepts_are_kept():
    suggestions = (
        why.Suggestion("--time 9m", "w", "job.sbatch", ("--time=9",)),
        why.Suggestion("--qos x", "w", "job.sbatch", ("--qos=x",)),
    )
    w = why.Waiting(
        "1", "a6000", "job.sbatch", "Priority", "x", "priority", None, "p", None, None, None, (), 0,
        suggestions=suggestions,
    )  # fmt: skip
    assert why.probes([w]) == [
        {"script": "job.sbatch", "options": ["--time=9"]},
        {"script": "job.sbatch", "options": ["--qos=x"]},
    ]
    replies = [
        {"code": 0, "text": "sbatch: Job 9 to start at 1795811318 using 1 processors on nodes n1"},
        {"code": 1, "text": "sbatch: error: Batch job submission failed: Invalid qos specification"},
    ]
    (judged,) = why.judged([w], replies)
    assert [(s.change, s.accepted, s.estimate) for s in judged.suggestions] == [
        ("--time 9m", True, 1795811318)
    ]


def test_a_run_over_several_types_waits_as_each_candidate():
    seg = Segment(1, "10", "submitted", "", None, None, None, "", 0, None, None, False, None,
                  candidates=(("10", "a6000"), ("11", "v100")))  # fmt: skip
    run = ClusterRun("run1", {"name": "r", "gpu_types": ["a6000", "v100"]}, (seg,), None, False, False)
    queued = parse_squeue(squeue_line("10", "Priority") + "\n" + squeue_line("11", "Resources", "gpu-v100"))
    pending = why.pending_jobs(run, queued)
    assert [(p.job_id, p.gpu_type, p.script) for p in pending] == [
        ("10", "a6000", "job.1.sbatch"),
        ("11", "v100", "job.2.sbatch"),
    ]
    assert set(why.asks(pending)) == {
        "config",
        "qos",
        "assoc",
        "job:10",
        "job:11",
        "queue:gpu-a6000",
        "queue:gpu-v100",
    }


def test_a_job_slurm_has_not_looked_at_yet_is_pending_without_a_none():
    from rv.cli.why import render
    from rv.job.records import run_views

    seg = Segment(1, "10", "submitted", "", None, None, None, "", 0, None, None, False, None)
    run = ClusterRun("run1", {"name": "r"}, (seg,), None, False, False)
    listing = RunsListing(runs=[run], queued=parse_squeue(squeue_line("10", "None")), now=1000.0)
    (view,) = [v for v in run_views([run], listing.queued, now=1000.0) if v.run_id]
    assert view.why == "not yet looked at by the scheduler"  # rv ps, rv wait: "pending (...)"
    answer = why.explain(run, listing)
    assert answer.summary == "pending: not yet looked at by the scheduler", answer.summary
    waiting = why.Waiting(job_id="10", gpu_type="", script="job.sbatch", code="None",
                          words="not yet looked at by the scheduler", kind="other", limit=None,
                          partition="gpu", qos=None, expected_start=None, expected_in_s=None, ahead=(),
                          running=0)  # fmt: skip
    said = "\n".join(render(why.explain(run, listing, [waiting])))
    assert "None" not in said and "why: not yet looked at by the scheduler" in said, said


# --- rv wait ---------------------------------------------------------------------------------------------


def listing_of(*runs: ClusterRun, queued: str = "") -> RunsListing:
    return RunsListing(runs=list(runs), queued=parse_squeue(queued), now=1000.0)


def ended_run(run_id: str, reason: str, code: int) -> ClusterRun:
    seg = Segment(1, "5", "ended", reason, code, 10.0, 20.0, "n1", 0, None, None, False, None)
    return ClusterRun(run_id, {"name": run_id}, (seg,), {"reason": reason, "exit_code": code}, False, False)


def test_wait_polls_until_every_run_ended_and_survives_a_dropped_connection():
    pending = ClusterRun("a", {"name": "a"}, (Segment(1, "5", "submitted", "", None, None, None, "", 0, None,
                                                      None, False, None),), None, False, False)  # fmt: skip
    answers_ = [
        listing_of(pending, queued=squeue_line("5", "Priority")),
        ConnectError("connection reset"),
        listing_of(ended_run("a", "crashed", 7)),
    ]
    calls, sleeps, troubles, reconnects = [], [], [], []

    def fetch():
        calls.append(1)
        answer = answers_.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    done = waiting.wait(fetch, lambda: reconnects.append(1), ["a"], sleep=sleeps.append,
                        on_trouble=lambda why_, pause: troubles.append((why_, pause)))  # fmt: skip
    assert len(calls) == 3 and reconnects == [1] and troubles == [("connection reset", 1.0)]
    assert waiting.exit_code(["a"], done, "end") == 7


def test_wait_exit_codes_for_several_runs_and_until_running():
    done = {
        "a": ended_run("a", "finished", 0),
        "b": ended_run("b", "crashed", 3),
        "c": ended_run("c", "stopped", 1),
    }
    waited = waiting.states(listing_of(*done.values()), ["a", "b", "c"])
    assert waiting.exit_code(["a", "b", "c"], waited, "end") == 3  # the first that did not finish
    assert waiting.exit_code(["c", "b"], waited, "end") == 1
    assert waiting.exit_code(["a"], waited, "end") == 0
    assert all(waiting.reached(w, "running") for w in waited.values())
    with pytest.raises(ValueError):
        waiting.wait(lambda: listing_of(), lambda: None, ["a"], until="soon")


def test_rv_minutes():
    assert [why.rv_minutes(m) for m in (9, 90, 1440 + 240 + 5, 0)] == ["9m", "1h30m", "1d4h", "0m"]
