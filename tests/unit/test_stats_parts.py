"""rv stats without a cluster: nvidia-smi's rows (captured), the idle watch, the meter around a real
program, the figures and advice from node records, the notifier's summary line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rv.agent import notify as notifier
from rv.agent import stats as meter
from rv.catalog import RIVANNA
from rv.job import stats as core
from rv.job.records import ClusterRun, Segment

CAPTURED = Path(__file__).resolve().parent.parent / "captured"
GIB = 1024**3
MIB = 1024 * 1024


# --- nvidia-smi ----------------------------------------------------------------------------------


def test_rows_of_a_captured_a100_node_with_an_unsupported_field():
    # The captured file asks three fields more (temperature, power): those lines are not ours, and a
    # query of exactly GPU_FIELDS is made here from the same rows.
    text = (CAPTURED / "nvidia_smi_gpus_handwritten.txt").read_text()
    ours = "\n".join(", ".join(line.split(", ")[:6]) for line in text.splitlines())
    rows = meter.parse_gpus(ours)
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert (
        rows[0]["util"] == 97
        and rows[0]["memory_used"] == 71234 * MIB
        and rows[0]["memory_total"] == 80 * GIB
    )
    assert rows[3]["util"] is None  # [N/A]: a MIG-mode GPU
    assert meter.parse_gpus(text) == []  # nine fields are not the six asked for: nothing guessed


def test_rows_of_a_v100_node_and_the_gpus_the_job_was_given():
    text = "\n".join(
        ", ".join(line.split(", ")[:6])
        for line in (CAPTURED / "nvidia_smi_v100_handwritten.txt").read_text().splitlines()
    )
    assert [r["util"] for r in meter.parse_gpus(text)] == [41, 0]
    # A node without device cgroups lists every GPU: the job's are those CUDA_VISIBLE_DEVICES names.
    assert [r["index"] for r in meter.parse_gpus(text, "1")] == [1]
    uuid = meter.parse_gpus(text)[0]["uuid"]
    assert [r["index"] for r in meter.parse_gpus(text, uuid)] == [0]
    # Already only the job's (cgroups renumber them from 0): kept as they are.
    assert len(meter.parse_gpus(text, "5,6")) == 2


def test_the_fake_nvidia_smi_of_the_test_cluster_answers_as_the_real_one(tmp_path):
    # scripts/testcluster's stand-in, extracted and run: the fields rv asks, [N/A] for others.
    src = (Path(__file__).resolve().parents[2] / "scripts" / "testcluster").read_text()
    body = src.split("make_fake_nvidia_smi() {", 1)[1].split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    fake = tmp_path / "nvidia-smi"
    fake.write_text(body + "\n")
    fake.chmod(0o755)
    (tmp_path / "util").write_text("* 0 300\n1 7 9000\n")
    q = "--query-gpu=" + ",".join(meter.GPU_FIELDS) + ",power.draw"
    out = subprocess.run([str(fake), q, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         env={"RV_FAKE_GPU_FILE": str(tmp_path / "util")}, check=True).stdout  # fmt: skip
    assert out.splitlines()[1].endswith(", 7, 9000, 49140, [N/A]")
    rows = meter.parse_gpus("\n".join(line.rsplit(", ", 1)[0] for line in out.splitlines()), "0,1")
    assert [(r["index"], r["util"], r["memory_used"]) for r in rows] == [
        (0, 0, 300 * MIB),
        (1, 7, 9000 * MIB),
    ]


# --- the idle watch --------------------------------------------------------------------------------


def gpus(*utils):
    return [{"index": i, "util": u} for i, u in enumerate(utils)]


def test_idle_gpus_are_told_once_per_stretch():
    w = meter.IdleWatch(60)
    seen = [w.see(t, gpus(*u)) for t, u in [(0, (1, 0)), (30, (4, 2)), (60, (0, 0)), (90, (0, 0))]]
    assert seen == [None, None, 0, None]  # once, at 60 s, saying since when
    assert w.see(120, gpus(50, 0)) is None  # one GPU at work: the stretch is over
    assert [w.see(t, gpus(0, 0)) for t in (150, 180, 210, 240)] == [None, None, 150, None]
    # Unknown utilization is not idleness; off is off.
    assert meter.IdleWatch(60).see(100, gpus(None, 0)) is None
    off = meter.IdleWatch(0)
    assert [off.see(t, gpus(0)) for t in (0, 1000, 5000)] == [None, None, None]


# --- the meter around a real program ------------------------------------------------------------------


PROGRAM = """
import time
block = bytearray(120 * 1024 * 1024)
for i in range(0, len(block), 4096):
    block[i] = 1
start = time.process_time()
while time.process_time() - start < 0.5:
    pass
raise SystemExit(3)
"""


def test_the_meter_runs_the_program_and_records_its_cpu_and_peak_memory(tmp_path):
    out = tmp_path / "stats" / "1"
    env = {"PATH": "/usr/bin:/bin", "RV_STATS_INTERVAL": "0.2", "SLURM_CPUS_ON_NODE": "2",
           "SLURM_MEM_PER_NODE": "1024", "RV_STATS_JOB": "77", "RV_STATS_NOTIFY_PROG": "x"}  # fmt: skip
    r = subprocess.run(
        [sys.executable, meter.__file__, "wrap", str(out), "n1", "--", sys.executable, "-c", PROGRAM],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr  # the program's own code
    rec = json.loads((out / "n1.json").read_text())
    assert rec["final"] and rec["exit_code"] == 3 and rec["job_id"] == "77"
    assert rec["cpu_seconds"] >= 0.5 and rec["cpus"] == 2 and rec["mem_asked_bytes"] == GIB
    assert 120 * MIB < rec["maxrss_bytes"] < 250 * MIB
    assert rec["gpu_error"] == "a CPU job" and rec["gpus"] == []
    assert meter.node_peak(rec) == max(rec["maxrss_bytes"], rec["rss_peak_bytes"])


def test_the_meter_passes_the_signals_it_ignores_as_the_program_had_them(tmp_path):
    # The program gets default dispositions (bash's `trap -`), never the meter's SIG_IGN: TERM kills it.
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM); import time; time.sleep(5)"
    r = subprocess.run(
        [sys.executable, meter.__file__, "wrap", str(tmp_path), "n1", "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 128 + 15
    assert json.loads((tmp_path / "n1.json").read_text())["exit_code"] == 143


def test_the_meter_says_how_to_call_it():
    assert meter.main(["wrap", "d"]) == 2


# --- the figures ----------------------------------------------------------------------------------------


def seg(index, start, end, nodes="n1", gpu_type="a100", state="ended"):
    return Segment(index=index, job_id=str(100 + index), state=state, reason="finished", exit_code=0,
                   start=start, end=end, nodes=nodes, attempt=0, start_step=None, checkpoint_step=None,
                   stop_sent=False, next_job_id=None, gpu_type=gpu_type)  # fmt: skip


def node(name, cpu, cpus, start, end, gpus=(), gpu_error=None, rss=2 * GIB):
    return {"node": name, "cpu_seconds": cpu, "cpus": cpus, "start": start, "end": end, "final": True,
            "maxrss_bytes": rss, "rss_peak_bytes": rss // 2, "cgroup_peak_bytes": None,
            "mem_asked_bytes": 64 * GIB, "gpu_error": gpu_error, "gpus": list(gpus)}  # fmt: skip


def gpu(index, mean, peak_gb):
    return {"index": index, "uuid": f"GPU-{index}", "name": "NVIDIA A100-SXM4-80GB", "util_mean": mean,
            "util_max": mean + 10, "memory_peak_bytes": int(peak_gb * GIB),
            "memory_total_bytes": 80 * GIB}  # fmt: skip


def run(segments, gpus=2, gpu_type="a100"):
    meta = {"name": "grpo", "gpus": gpus, "gpu_type": gpu_type}
    return ClusterRun("r1", meta, tuple(segments), None, False, False)


def test_a_cpu_program_on_two_cores_using_one_is_half_efficient():
    rs = core.run_stats(
        run([seg(1, 0, 110, gpu_type="")], gpus=0), {"1": [node("n1", 50.0, 2, 5, 105)]}, RIVANNA, 0
    )
    assert rs.cpu_efficiency == pytest.approx(0.25)
    rs = core.run_stats(
        run([seg(1, 0, 110, gpu_type="")], gpus=0), {"1": [node("n1", 100.0, 2, 5, 105)]}, RIVANNA, 0
    )
    assert rs.cpu_efficiency == pytest.approx(0.5)
    assert rs.su is None and "CPU job" in (rs.su_why or "")
    assert rs.peak_memory_bytes == 2 * GIB


def test_two_segments_two_gpus_sus_and_the_cheaper_type_advice():
    a100 = RIVANNA["a100"]
    r = run([seg(1, 0, 3600), seg(2, 4000, 5800)])
    measured = {
        "1": [node("n1", 3600.0, 8, 0, 3600, [gpu(0, 90, 9.1), gpu(1, 80, 8.0)])],
        "2": [node("n1", 1800.0, 8, 4000, 5800, [gpu(0, 60, 5.0), gpu(1, 40, 4.0)])],
    }
    rs = core.run_stats(r, measured, RIVANNA, 0)
    assert rs.su == pytest.approx((a100.su_per_gpu_hour or 0) * 2 * 1.5)
    g0 = next(g for g in rs.gpus if g.index == 0)
    assert g0.util_mean == pytest.approx(80.0)  # 90 for an hour, 60 for half an hour
    assert (g0.util_max, g0.memory_peak_bytes) == (100, int(9.1 * GIB))
    doc = core.to_json(rs)
    assert doc["cpu_efficiency"] == pytest.approx(5400 / (8 * 5400))
    assert {"cpu_efficiency", "peak_memory_bytes", "gpus", "su", "segments"} <= set(doc)
    assert set(doc["gpus"][0]) >= {"util_mean", "util_max", "memory_peak_bytes"}
    # 9.1 GiB of an 80 GiB card: the cheapest type that holds it with room to spare, priced against a100.
    (low_cpu, cheaper) = rs.advice
    assert low_cpu.startswith("CPU efficiency 12% of the 8 cores asked")
    fit = min((t for t in RIVANNA.values() if t.vram_gb and t.vram_gb >= 9.1 * core.GPU_HEADROOM
               and t.su_per_gpu_hour is not None and t.su_per_gpu_hour < (a100.su_per_gpu_hour or 0)
               and (t.max_gpus_per_job or 2) >= 2 and (t.compute_capability or 0) >= 8),
              key=lambda t: t.su_per_gpu_hour or 0)  # fmt: skip
    assert cheaper.startswith("peak GPU memory 9.1 of 80 GiB: an " + fit.name)
    ratio = (fit.su_per_gpu_hour or 0) / (a100.su_per_gpu_hour or 1)
    assert cheaper.endswith(f"at {ratio:.2f}× the SUs")
    text = "\n".join(core.render(rs))
    assert "segment 2: job 102 (ended), 30m00s wall, 2× a100" in text
    assert (
        "n1 GPU 0 (NVIDIA A100-SXM4-80GB): util 90% mean, 100% max, peak memory 9.1 GiB of 80.0 GiB" in text
    )


def test_what_was_not_measured_is_said_by_node_and_why():
    r = run([seg(1, 0, 100, nodes="n[1-2]")])
    rs = core.run_stats(
        r, {"1": [node("n1", 10.0, 4, 0, 100, gpu_error="no nvidia-smi on PATH")]}, RIVANNA, 0
    )
    (s,) = rs.segments
    assert s.missing == (
        "n2: nothing measured (no python3 on the node, or the job's runtime predates rv stats)",
        "n1: no GPU figures: no nvidia-smi on PATH",
    )
    # A type the catalog has no rate for: "?" and why.
    rs = core.run_stats(run([seg(1, 0, 100, gpu_type="b200")], gpu_type="b200"), {}, RIVANNA, 0)
    assert rs.su is None and "b200 is not in the profile's catalog" in (rs.su_why or "")
    assert "SUs ? (" in core.render(rs)[1]


def test_a_sweep_shows_each_point_and_the_total():
    points = [
        (
            i,
            core.run_stats(
                run([seg(1, 0, 1800 * (i + 1))]), {"1": [node("n1", 10.0, 4, 0, 100)]}, RIVANNA, 0
            ),
        )
        for i in range(2)
    ]
    lines = core.render_sweep("lr", points)
    head = ["POINT", "RUN", "WALL", "CPU", "PEAK", "MEM", "GPU", "UTIL", "SU"]
    assert lines[0] == "sweep lr" and lines[1].split() == head
    rate = RIVANNA["a100"].su_per_gpu_hour or 0
    assert lines[-1].split()[:4] == ["total", "2", "points", "1h30m"]
    assert lines[-1].endswith(f"{rate * 2 * 1.5:,.1f}")


def test_a_running_segment_counts_up_to_now():
    rs = core.run_stats(run([seg(1, 1000, None, state="running")]), {}, RIVANNA, 4600)
    assert rs.wall_seconds == 3600


# --- the notifier's summary --------------------------------------------------------------------------------


def test_the_end_notice_carries_what_the_run_used(tmp_path):
    (tmp_path / "seg").mkdir()
    (tmp_path / "stats" / "1").mkdir(parents=True)
    (tmp_path / "run.json").write_text(json.dumps({"name": "grpo", "gpus": 2, "gpu_type": "a100",
                                                   "su_rates": {"a100": 500.0}}))  # fmt: skip
    (tmp_path / "seg" / "1.json").write_text(
        json.dumps({"segment": 1, "start": 1000, "end": 4600, "gpu_type": "a100"})
    )
    (tmp_path / "ENDED").write_text(
        json.dumps({"reason": "finished", "exit_code": 0, "segment": 1, "end": 4600})
    )
    rec = node("n1", 100.0, 8, 0, 3600, [dict(gpu(0, 30, 9.1), util_sum=90.0, util_samples=3),
                                        dict(gpu(1, 50, 3.0), util_sum=150.0, util_samples=3)])  # fmt: skip
    (tmp_path / "stats" / "1" / "n1.json").write_text(json.dumps(rec))
    _, text, facts = notifier.end_message(str(tmp_path), "101")
    want = "used: 1h00m wall, GPU util 40% mean, GPU memory peak 9.1 GiB, peak memory 2.0 GiB, 1000.0 SUs"
    assert facts["usage"] == want and want in text
    # The notifier's copy of the peak rule is the meter's and rv stats's.
    for r in (rec, dict(rec, cgroup_peak_bytes=5), dict(rec, maxrss_bytes=None), {}):
        assert notifier.node_peak(r) == meter.node_peak(r) == core.node_peak(r)


# --- the agent's reading --------------------------------------------------------------------------------


def test_the_agent_reads_each_segments_node_records_and_their_gpu_curve(tmp_path):
    import os

    from rv.agent import rundir

    seg = tmp_path / "stats" / "2"
    seg.mkdir(parents=True)
    (seg / "n1.json").write_text(json.dumps({"node": "n1", "cpu_seconds": 3.0}))
    (seg / "n2.json").write_text("{not json")  # one bad file stays one bad file
    samples = [{"t": 100 + i, "gpus": [[0, 10.0 * i, 5], [1, None, 5]]} for i in range(10)]
    (seg / "n1.gpu.jsonl").write_text("\n".join(json.dumps(s) for s in samples) + "\nbroken\n")
    (tmp_path / "stats" / "notes").mkdir()
    got = rundir.read_stats(os.fsencode(str(tmp_path)))
    assert got == {"2": [{"node": "n1", "cpu_seconds": 3.0}]}
    (rec,) = rundir.read_stats(os.fsencode(str(tmp_path)), points=4)["2"]
    assert rec["curve"] == [[100, 0.0], [102, 20.0], [105, 50.0], [107, 70.0], [109, 90.0]]  # and the last
    assert rundir.read_stats(os.fsencode(str(tmp_path / "nothing"))) == {}


def test_the_pages_usage_has_the_figures_and_each_nodes_gpu_curve():
    from types import SimpleNamespace

    from rv.ui.data import usage

    cluster = SimpleNamespace(profile=SimpleNamespace(gpu_catalog=lambda: RIVANNA))
    rec = dict(node("n1", 100.0, 8, 0, 3600, [gpu(0, 30, 9.1)]), curve=[[0, 10.0], [30, 50.0]])
    got = usage(cluster, run([seg(1, 0, 3600)]), {"1": [rec]}, 0)  # type: ignore[arg-type]
    assert got["curves"] == [{"segment": 1, "node": "n1", "points": [[0, 10.0], [30, 50.0]]}]
    assert got["su"] == pytest.approx((RIVANNA["a100"].su_per_gpu_hour or 0) * 2)
    assert got["summary"].startswith("1h00m wall, GPU util 30%, peak memory 2.0 GiB, SUs ")


def test_a_value_the_meter_cannot_read_never_keeps_the_program_from_running(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "RV_STATS_INTERVAL": "often", "RV_GPUS_PER_NODE": "x", "RV_IDLE_GPU": "?"}
    r = subprocess.run(
        [sys.executable, meter.__file__, "wrap", str(tmp_path), "n1", "--", sys.executable, "-c", "exit(4)"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 4, r.stderr
    rec = json.loads((tmp_path / "n1.json").read_text())
    assert rec["interval_s"] == meter.INTERVAL_S and rec["gpu_error"] == "a CPU job"
