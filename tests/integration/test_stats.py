"""Issue 45 on the real clusters: what a run used, measured by its own job (`rv stats`).

A CPU-bound program on 2 allocated cores that keeps one busy shows a CPU efficiency near 50% and the
memory it touched; GPU figures come from the test cluster's nvidia-smi stand-in for its fake GPUs
(scripts/testcluster: <state>/fakegpu/bin, off PATH: the setup line puts it there), whose utilization
the program sets through a file, so an idle stretch raises the warning once. Both layouts.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from projects import git_project, wait_for
from test_notify import Receiver

from rv.config import load_config, save_config

# One core busy for ~6 s of CPU, with 200 MB allocated and touched: the peak the job must see.
BURN = """\
import time
began = time.time()
block = bytearray(200 * 1024 * 1024)
for i in range(0, len(block), 4096):
    block[i] = 1
start = time.process_time()
while time.process_time() - start < 6:
    pass
print("burned", round(time.process_time(), 2), "in", round(time.time() - began, 2), flush=True)
"""


def priced(layout, gpu_type: str, rate: float) -> None:
    """The test's profile with an SU rate for ``gpu_type`` (a discovered catalog has none)."""
    path = Path(layout.rv_env["RV_CONFIG"])
    cfg = load_config(path)
    profile = cfg.profile(layout.cluster["RV_TESTCLUSTER_PROFILE"])
    gpus = dict(profile.gpus, **{gpu_type: replace(profile.gpus[gpu_type], su_per_gpu_hour=rate)})
    save_config(replace(cfg.with_profile(replace(profile, gpus=gpus), make_default=True), path=path))


def stats_of(layout, name: str) -> dict:
    r = layout.run_rv("stats", name, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_a_cpu_bound_program_on_two_cores_shows_half_and_its_peak_memory(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"burn.py": BURN})
    r = layout.run_rv(
        "run", "-g", "0", "--cpus", "2", "--mem", "700M", "--name", "burn", "-f", "--", "python3", "burn.py",
        cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"burned (\S+) in (\S+)", r.stdout)
    own, wall = float(m.group(1)), float(m.group(2))
    got = stats_of(layout, "burn")
    (seg,) = got["segments"]
    (node,) = seg["nodes"]
    assert node["final"] and node["cpus"] == 2
    # Exact, not sampled: at least the CPU the program counted itself (plus Python's start-up).
    assert own <= node["cpu_seconds"] < own + 3
    # One of two cores busy: 50% of what the program got; on a machine shared by every test it gets
    # less than one core, so the figure is held to the program's own count of its CPU and wall time.
    assert got["cpu_efficiency"] <= 0.55, got
    assert abs(got["cpu_efficiency"] - own / (2 * wall)) < 0.08, (got, own, wall)
    assert 200e6 < got["peak_memory_bytes"] < 400e6
    assert node["mem_asked_bytes"] == 700 * 1024 * 1024
    assert got["gpus"] == [] and got["su"] is None and "CPU job" in got["segments"][0]["su_why"]
    text = layout.run_rv("stats", "burn").stdout
    # (the text's whole percent and the JSON's three decimals may round apart by one)
    shown = int(re.search(r"CPU (\d+)% of 2 cores", text).group(1))
    assert abs(shown - 100 * got["cpu_efficiency"]) <= 1, text
    assert "peak memory 0.2 GiB of 0.7 GiB asked" in text, text


# Busy, then idle long enough to be told (--idle-gpu 3s, a sample a second), then busy again: the
# fake GPUs' figures come from the file the stand-in nvidia-smi reads at each call.
GPU_PROGRAM = """\
import os, time
path = os.environ["RV_FAKE_GPU_FILE"]
def gpus(util, mib):
    with open(path + ".tmp", "w") as fh:
        fh.write("* %d %d\\n" % (util, mib))
    os.replace(path + ".tmp", path)
gpus(80, 9000)
time.sleep(5)
gpus(1, 9000)
time.sleep(12)
gpus(60, 2000)
time.sleep(4)
print("done", flush=True)
"""


def test_gpu_figures_an_idle_warning_once_and_the_summary_in_the_notice(layout, tmp_path):
    receiver = Receiver()
    try:
        priced(layout, "a6000", 100.0)
        hook = receiver.url("ok")
        assert layout.run_rv("env", "set", f"STATS_HOOK={hook}").returncode == 0
        proj = git_project(tmp_path / "p", {"gpu.py": GPU_PROGRAM})
        fake = f"{layout.cluster['RV_TESTCLUSTER_DIR']}/fakegpu/bin"
        setup = f'export PATH={fake}:$PATH RV_FAKE_GPU_FILE="$RV_JOB_DIR/fake-gpus" RV_STATS_INTERVAL=1'
        r = layout.run_rv(
            "run", "-g", "1", "-t", "a6000", "--mem", "300M", "--name", "gpustats", "--idle-gpu", "3s",
            "--setup", setup, "--notify", "secret:STATS_HOOK", "-f", "--", "python3", "gpu.py",
            cwd=proj, timeout=400,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        err = layout.run_rv("logs", "gpustats", "--err").stdout
        idle = [line for line in err.splitlines() if "GPUs idle on" in line]
        assert len(idle) == 1, err  # once for the stretch, not once a sample
        assert re.search(
            r"rv: warning: GPUs idle on \S+: GPU [01] under 5% since \d\d:\d\d:\d\d UTC", idle[0]
        )
        got = stats_of(layout, "gpustats")
        (g,) = got["gpus"]  # the job's one GPU of the four the stand-in lists
        assert g["name"] == "NVIDIA RTX A6000" and g["util_max"] == 80
        assert 1 < g["util_mean"] < 80 and g["memory_peak_bytes"] == 9000 * 1024 * 1024
        assert g["memory_total_bytes"] == 49140 * 1024 * 1024
        assert got["segments"][0]["gpu_type"] == "a6000" and got["segments"][0]["missing"] == []
        assert got["su"] == pytest.approx(100.0 * got["wall_seconds"] / 3600, abs=0.01)
        text = layout.run_rv("stats", "gpustats").stdout
        assert "GPU 0 (NVIDIA RTX A6000)" in text or "GPU 1 (NVIDIA RTX A6000)" in text, text
        # The notices: the idle one, then the end with what the run used.
        wait_for(lambda: len(receiver.to(hook)) >= 2, 60, "the idle and end notices")
        idle_notice, end = receiver.to(hook)
        assert idle_notice["rv"]["event"] == "idle" and "GPUs idle on" in idle_notice["text"]
        assert end["rv"]["event"] == "end"
        usage = end["rv"]["usage"]
        said = (
            r"used: \d+s wall, GPU util \d+% mean, GPU memory peak 8\.8 GiB, peak memory \S+ GiB, [\d.]+ SUs$"
        )
        assert re.match(said, usage), usage
        assert usage in end["text"]
        # rv ps -a: what the ended run cost.
        listed = json.loads(layout.run_rv("ps", "-a", "--json").stdout)
        (row,) = [row for row in listed if row["name"] == "gpustats" and row["run_id"]]
        assert row["su"] == pytest.approx(got["su"], abs=0.01), [r for r in listed if r["name"] == "gpustats"]
        table = layout.run_rv("ps", "-a").stdout.splitlines()
        assert table[0].split()[7:9] == ["ELAPSED", "SU"]
        assert f"{got['su']:,.1f}" in [ln.split()[8] for ln in table if ln.startswith("gpustats ")], table
    finally:
        receiver.server.shutdown()


def test_a_sweep_shows_each_point_and_the_total(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"point.py": "import sys, time\ntime.sleep(float(sys.argv[1]))\n"})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "costs", "--sweep", "s=1,3", "--json", "--",
        "python3", "point.py", "{s}", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert layout.run_rv("wait", "costs", timeout=300).returncode == 0
    got = stats_of(layout, "costs")
    assert [p["name"] for p in got["points"]] == ["costs/0", "costs/1"]
    assert all(p["segments"][0]["nodes"][0]["final"] for p in got["points"])
    assert got["wall_seconds"] == pytest.approx(sum(p["wall_seconds"] for p in got["points"]), abs=0.2)
    assert got["su"] is None  # CPU points: the catalog prices GPU hours only
    lines = layout.run_rv("stats", "costs").stdout.splitlines()
    assert lines[0] == "sweep costs" and lines[1].split()[:3] == ["POINT", "RUN", "WALL"]
    assert [ln.split()[:2] for ln in lines[2:5]] == [["0", "costs/0"], ["1", "costs/1"], ["total", "2"]]
    assert lines[-1] == "SUs ?: a CPU job: the catalog prices GPU hours only"


def test_each_node_of_a_two_node_run_is_measured_by_its_slurm_name(layout, tmp_path):
    proj = git_project(
        tmp_path / "p", {"nap.py": "import time\nblock = bytearray(50 << 20)\ntime.sleep(2)\n"}
    )
    r = layout.run_rv(
        "run", "-g", "0", "--nodes", "2", "--each-node", "--mem", "200M", "--name", "pair", "-f", "--",
        "python3", "nap.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (seg,) = stats_of(layout, "pair")["segments"]
    # Both nodes of the allocation, by the names Slurm lists them with: none missing.
    assert len({n["node"] for n in seg["nodes"]}) == 2 and seg["missing"] == [], seg
    assert all(n["final"] and n["cpu_seconds"] > 0 for n in seg["nodes"]), seg
