"""The wiring of sweeps and metrics into runs: what a run records, how points are named, submitted
and shown (pure parts and the agent's side on temp folders; the cluster itself is in
tests/integration/test_sweeps.py)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tokenize
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from rv.agent import gc as agent_gc
from rv.agent import rundir as agent_rundir
from rv.agent import slurmcmd as agent_slurmcmd
from rv.agent import submit as agent_submit
from rv.agent.common import AgentError
from rv.catalog import RIVANNA
from rv.cli.ps import render_table
from rv.errors import UsageError
from rv.job.records import RunView
from rv.job.results import fold_sweeps
from rv.job.submit import SweepCheck, check_existing_points, script_context, submit_args
from rv.layout import RemoteLayout
from rv.names import check_run_name, lookup_hint, point_name, split_point_name
from rv.remote.agent_client import agent_command, encode_args
from rv.request import build_request
from rv.slurm import commands
from rv.slurm.parse import ArrayLimits, SubmitLimit, parse_array_limits, parse_squeue, parse_submit_limit
from rv.slurm.script import render_script
from rv.sweep import build_sweep

ROOT = "/scratch/u/rv"


def test_run_json_records_the_metrics_file_the_job_names():
    req = build_request(RIVANNA, command=["python", "train.py"], gpu_type="a6000", name="exp")
    ctx = script_context(
        RemoteLayout(ROOT), run_id="r1", snapshot_id="s1", project="proj", account=None, has_secrets=False
    )
    args = submit_args(RemoteLayout(ROOT), req, ctx, provenance={}, has_secrets=False)
    assert args["meta"]["metrics"] == f"{ROOT}/outputs/proj/exp/metrics.jsonl"
    assert f"RV_METRICS={ROOT}/outputs/proj/exp/metrics.jsonl" in args["script"]


# --- names --------------------------------------------------------------------------------------------


def test_a_point_is_named_sweep_slash_index_and_found_by_that_name():
    assert point_name("grid", 3) == "grid/3"
    assert split_point_name("grid/3") == ("grid", 3)
    for not_a_point in ("grid", "grid/03", "grid/x", "/3", "a b/3", "grid/3/4", ".g/1"):
        assert split_point_name(not_a_point) is None, not_a_point
    assert lookup_hint("grid/3") is None  # a name a run can have: no "no run can be named" hint
    assert "no run can be named" in (lookup_hint("grid/x") or "")
    with pytest.raises(UsageError, match="characters a run name cannot have"):
        check_run_name("grid/3")  # --name stays without '/': only rv makes points


# --- what Slurm says (captured from the loopback clusters) ---------------------------------------------

CONFIG_TEXT = """\
MaxArraySize            = 5
MaxJobCount             = 10000
SchedulerParameters     = sched_interval=1,bf_interval=1
"""


def test_array_limits_from_scontrol_show_config():
    assert parse_array_limits(CONFIG_TEXT) == ArrayLimits(5, None)
    capped = CONFIG_TEXT.replace("bf_interval=1", "bf_interval=1,max_array_tasks=3")
    assert parse_array_limits(capped) == ArrayLimits(5, 3)
    assert parse_array_limits("") == ArrayLimits(1001, None)  # Slurm's default when it says nothing


def test_the_tightest_queue_limit_of_account_and_qos():
    # The default layout as it is (no limits set), then with limits as a site sets them.
    assert parse_submit_limit("rv|||\n", "normal|\nhigh|\n", account=None, qos=None) is None
    assoc = "rv||100|normal\nother||20|\n"
    qos = "normal|50\nhigh|5\n"
    assert parse_submit_limit(assoc, qos, account="rv", qos=None) == SubmitLimit(
        50, "MaxSubmitJobsPerUser of QOS normal"
    )
    assert parse_submit_limit(assoc, qos, account="rv", qos="high").jobs == 5
    assert parse_submit_limit(assoc, "", account=None, qos=None) == SubmitLimit(
        20, "MaxSubmitJobs of account other"
    )


def test_squeue_lists_each_array_task_as_its_point_names_it():
    assert "-r" in commands.squeue_user()
    text = (
        "4002205_1|PENDING|JobArrayTaskLimit|0:00|UNLIMITED|1||N/A|gpu|N/A|2026-11-25T23:49:31|arr\n"
        "4002205_0|RUNNING|None|0:02|365-00:00:00|1|gpu-01|N/A|gpu|2026-11-25T23:49:31|2026-11-25T23:49:31|arr\n"
    )
    jobs = parse_squeue(text)
    assert [(j.job_id, j.state, j.reason) for j in jobs] == [
        ("4002205_1", "PENDING", "JobArrayTaskLimit"), ("4002205_0", "RUNNING", None)
    ]  # fmt: skip
    assert sorted(agent_slurmcmd.jobs_of(text)) == ["4002205_0", "4002205_1"]


# --- the agent's side, on a temp root with Slurm's commands as stubs ----------------------------------


def point_script(root: Path, run_id: str, name: str = "grid/0") -> str:
    req = replace(
        build_request(RIVANNA, command=["python", "t.py"], gpu_type="a6000", name="grid"), name=name
    )
    ctx = script_context(
        RemoteLayout(str(root)), run_id=run_id, snapshot_id="s1", project="proj", account=None,
        has_secrets=False, sweep_env={"RV_SWEEP_INDEX": name.rsplit("/", 1)[1]},
    )  # fmt: skip
    return render_script(req, ctx)


def test_the_array_script_runs_each_tasks_own_point_script(tmp_path):
    script = agent_submit._array_script(point_script(tmp_path, "ab12-0"), "grid", "/r/runs", "ab12", "0-5%2")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "#SBATCH --job-name=grid" in lines
    assert "#SBATCH --output=/r/runs/ab12-%a/logs/%A_%a.out" in lines
    assert "#SBATCH --error=/r/runs/ab12-%a/logs/%A_%a.err" in lines
    assert "#SBATCH --array=0-5%2" in lines and "#SBATCH --gres=gpu:a6000:1" in lines
    assert 'rv_point="/r/runs/ab12-$SLURM_ARRAY_TASK_ID/job.sbatch"' in lines
    assert not any("--job-name=grid/0" in line for line in lines)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.fixture
def slurm_stubs(tmp_path, monkeypatch):
    """sbatch, scancel and squeue as scripts logging their calls; ``refuse``: the Nth sbatch fails."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stubs = {
        "sbatch": 'n=$(($(cat "$D/n" 2>/dev/null || echo 0) + 1)); echo $n >"$D/n"\n'
        'echo "sbatch $*" >>"$D/calls.log"\n'
        '[ "$n" != "${REFUSE:-0}" ] || { echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2; exit 1; }\n'
        "echo $((7000 + n))\n",
        "scancel": 'echo "scancel $*" >>"$D/calls.log"\n',
        "squeue": "",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nD={tmp_path}\n{body}")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log


def sweep_args(root: Path) -> dict:
    return {
        "root": str(root), "project": "proj", "name": "grid", "squeue": ["squeue"],
        "sbatch": commands.sbatch("SCRIPT"), "sbatch_after": commands.sbatch("SCRIPT", after="{after}"),
        "scancel": commands.scancel([]), "runtime": {},
    }  # fmt: skip


def part(root: Path, prefix: str, indexes, after: bool = False) -> dict:
    return {
        "prefix": prefix, "spec": f"0-{len(indexes) - 1}", "after_previous": after,
        "points": [{"name": f"grid/{i}", "script": point_script(root, f"{prefix}-{t}", f"grid/{i}"),
                    "meta": {"name": f"grid/{i}", "project": "proj", "has_secrets": True, "snapshot": "s1",
                             "sweep": {"name": "grid", "index": i, "params": {"x": str(i)}}}}
                   for t, i in enumerate(indexes)],
    }  # fmt: skip


def test_sweep_submit_makes_each_point_a_run_and_chains_the_parts(tmp_path, slurm_stubs):
    root = tmp_path / "remote"
    payload = {"secrets": "export K=v\n", "parts": [part(root, "aa", [0, 1, 2]), part(root, "bb", [3], True)]}
    reply = agent_submit._sweep_submit(sweep_args(root), payload)
    assert reply == {
        "parts": [{"array": "7001", "runs": ["aa-0", "aa-1", "aa-2"]}, {"array": "7002", "runs": ["bb-0"]}]
    }
    calls = slurm_stubs.read_text().splitlines()
    assert calls[0] == f"sbatch --parsable {root}/runs/aa-0/array.sbatch"
    after = "--dependency=afterany:7001 --kill-on-invalid-dep=yes"
    assert calls[1] == f"sbatch --parsable {after} {root}/runs/bb-0/array.sbatch"
    for run_id, job, index in (("aa-0", "7001_0", 0), ("aa-2", "7001_2", 2), ("bb-0", "7002_0", 3)):
        rdir = root / "runs" / run_id
        assert (rdir / "seg" / "1.job").read_text() == job + "\n"
        assert json.loads((rdir / "run.json").read_text())["sweep"]["index"] == index
        assert f"RV_RUN_ID={run_id} " in (rdir / "job.sbatch").read_text()
        assert (rdir / "secrets.env").read_text() == "export K=v\n" and (
            rdir / "secrets.env"
        ).stat().st_mode & 0o077 == 0
        assert (root / "names" / "proj" / "grid" / str(index)).read_text() == run_id + "\n"


def test_sweep_submit_is_all_or_nothing(tmp_path, slurm_stubs, monkeypatch):
    root = tmp_path / "remote"
    monkeypatch.setenv("REFUSE", "2")  # the second array is refused: the first is cancelled
    payload = {"secrets": None, "parts": [part(root, "aa", [0, 1]), part(root, "bb", [2], True)]}
    with pytest.raises(AgentError, match=r"sbatch rejected the array of points grid/2: .*QOSMaxSubmit"):
        agent_submit._sweep_submit(sweep_args(root), payload)
    assert slurm_stubs.read_text().splitlines()[-1] == "scancel 7001"
    assert list((root / "runs").iterdir()) == [] and not (root / "names" / "proj" / "grid").exists()


def test_a_sweep_and_a_plain_run_never_share_a_name(tmp_path, slurm_stubs):
    root = tmp_path / "remote"
    agent_submit._sweep_submit(sweep_args(root), {"secrets": None, "parts": [part(root, "aa", [0])]})
    check = {"root": str(root), "project": "proj", "name": "grid", "squeue": ["squeue"]}
    with pytest.raises(AgentError, match="grid is the name of a sweep"):
        agent_submit.mode_run_check(check)
    (root / "names" / "proj" / "solo").write_text("r1\n")
    with pytest.raises(AgentError, match="a run named solo exists: a sweep needs a name no run has"):
        agent_submit._sweep_submit(dict(sweep_args(root), name="solo"), {"secrets": None, "parts": []})
    with pytest.raises(AgentError, match="a run named solo exists"):
        agent_submit.mode_run_check(dict(check, name="solo", sweep=True))


def test_a_retry_is_the_old_points_script_as_the_new_run(tmp_path, slurm_stubs):
    root = tmp_path / "remote"
    (root / "snapshots" / "s1").mkdir(parents=True)
    # Run ids that are each other's prefixes: only the whole word is replaced.
    payload = {"secrets": None, "parts": [part(root, "p", list(range(4)))]}
    payload["parts"][0]["points"][3]["script"] += "# p-30 p-3x p-3\n"
    agent_submit._sweep_submit(sweep_args(root), payload)
    point = {"name": "grid/3", "like": "p-3", "meta_update": {"submitted_from": "here"}}
    retried = {"prefix": "q", "spec": "0", "after_previous": False, "points": [point]}
    agent_submit._sweep_submit(sweep_args(root), {"secrets": "export K=new\n", "parts": [retried]})
    new = (root / "runs" / "q-0" / "job.sbatch").read_text()
    assert f"RV_RUN_DIR={root}/runs/q-0 RV_RUN_ID=q-0 " in new and f"--output={root}/runs/q-0/logs/" in new
    assert "# p-30 p-3x q-0\n" in new and not re.search(r"[^\w.-]p-3[^\w.-]", new.replace("# p-30 p-3x", ""))
    meta = json.loads((root / "runs" / "q-0" / "run.json").read_text())
    assert (meta["run_id"], meta["name"], meta["sweep"]["retry_of"], meta["submitted_from"]) == (
        "q-0", "grid/3", "p-3", "here")  # fmt: skip
    assert (root / "names" / "proj" / "grid" / "3").read_text() == "q-0\n"
    assert (root / "runs" / "q-0" / "secrets.env").read_text() == "export K=new\n"
    shutil.rmtree(root / "snapshots" / "s1")
    gone = dict(retried, prefix="r")
    with pytest.raises(AgentError, match="snapshot s1 of point grid/3 is gone"):
        agent_submit._sweep_submit(sweep_args(root), {"secrets": None, "parts": [gone]})


def test_runs_selects_a_sweep_and_a_live_point_brings_its_sweep(tmp_path, slurm_stubs):
    root = tmp_path / "remote"
    agent_submit._sweep_submit(sweep_args(root), {"secrets": None, "parts": [part(root, "aa", [0, 1, 2])]})
    (root / "runs" / "aa-0" / "ENDED").write_text("{}")
    (root / "runs" / "aa-1" / "ENDED").write_text("{}")
    enc = str(root).encode()
    assert [r["run_id"] for r in agent_rundir.select_runs(enc, {"sweeps": ["grid"]})] == [
        "aa-0",
        "aa-1",
        "aa-2",
    ]
    assert [r["run_id"] for r in agent_rundir.select_runs(enc, {"live": True})] == ["aa-2"]
    whole = agent_rundir.select_runs(enc, {"live": True, "whole_sweeps": True})
    assert [r["run_id"] for r in whole] == ["aa-0", "aa-1", "aa-2"]
    (root / "runs" / "aa-2" / "ENDED").write_text("{}")
    assert agent_rundir.select_runs(enc, {"live": True, "whole_sweeps": True}) == []


def test_gc_keeps_a_sweeps_folders_while_a_point_is_kept(tmp_path, slurm_stubs):
    root = tmp_path / "remote"
    agent_submit._sweep_submit(sweep_args(root), {"secrets": None, "parts": [part(root, "aa", [0, 1])]})
    old = time.time() - 30 * 86400
    for i in (0, 1):
        ckpt = root / "checkpoints" / "proj" / "grid" / str(i)
        ckpt.mkdir(parents=True)
        (ckpt / "w.pt").write_text("x")
        os.utime(ckpt / "w.pt", (old, old))
        os.utime(ckpt, (old, old))
    os.utime(root / "checkpoints" / "proj" / "grid", (old, old))
    (root / "runs" / "aa-0" / "ENDED").write_text(json.dumps({"end": old}))
    args = {"root": str(root), "older_than": 86400, "checkpoints": True, "dry_run": False, "grace": 0}
    report = agent_gc.runs_and_store_gc(args, live={"7001_1": ""})
    assert [r["run_id"] for r in report["runs_removed"]] == ["aa-0"]
    assert report["checkpoints_removed"] == [] and (root / "checkpoints" / "proj" / "grid" / "0").is_dir()
    assert (
        not (root / "names" / "proj" / "grid" / "0").exists()
        and (root / "names" / "proj" / "grid" / "1").exists()
    )


# --- the laptop's side ---------------------------------------------------------------------------------


def test_a_sweep_named_again_resumes_only_the_same_points():
    sweep = build_sweep(["x=1,2"])
    same = SweepCheck(existing={0: {"params": {"x": "1"}, "resume_step": 40}, 1: {"params": {"x": "2"}}},
                      queued=0, arrays=ArrayLimits(1001, None), limit=None)  # fmt: skip
    assert check_existing_points("g", same, sweep.points) == [0]
    other = replace(same, existing={1: {"params": {"x": "3"}}})
    with pytest.raises(UsageError, match=r"its point 1 was x=3, not x=2"):
        check_existing_points("g", other, sweep.points)
    live = replace(same, existing={1: {"params": {"x": "2"}, "live": "7001_1"}})
    with pytest.raises(UsageError, match=r"point g/1 of sweep 'g' is still live \(job 7001_1\)"):
        check_existing_points("g", live, sweep.points)


def view(name, state, *, live=False, sweep=None, index=None, created=1.0, job="1"):
    return RunView(name=name, run_id=name, segment=1, max_segments=10, state=state, job_id=job, live=live,
                   reason=None, exit_code=None, gpus=0, gpu_type=None, nodes=1, elapsed_seconds=5,
                   source="-", created=created, sweep=sweep, sweep_index=index)  # fmt: skip


def test_rv_ps_shows_one_line_per_sweep_with_its_points_by_state():
    views = [
        view("solo", "RUNNING", live=True, created=9),
        view("g/2", "RUNNING", live=True, sweep="g", index=2, created=8, job="70_2"),
        view("g/1", "COMPLETED", sweep="g", index=1, created=7, job="71_0"),  # the retry of point 1
        view("g/1", "FAILED", sweep="g", index=1, created=3, job="70_1"),
        view("g/0", "PENDING", live=True, sweep="g", index=0, created=2, job="70_0"),
        view("old", "COMPLETED", created=1),
        view("h/0", "COMPLETED", sweep="h", index=0, created=1),
    ]
    live = fold_sweeps(views, live_only=True)
    assert [(v.name, v.points, v.state, v.reason, v.job_id) for v in live] == [
        ("solo", 0, "RUNNING", None, "1"), ("g", 3, "RUNNING", "1 running, 1 pending, 1 finished", "70"),
    ]  # fmt: skip
    table = render_table(fold_sweeps(views, live_only=False))
    assert re.search(r"^g\s+3pt\s+RUNNING\s.*\(1 running, 1 pending, 1 finished\)$", table[2], re.M), table
    assert re.search(r"^h\s+1pt\s+COMPLETED\s.*\(1 finished\)$", table[4], re.M), table


# --- refused before anything is sent (the profile's host does not exist) -------------------------------


@pytest.fixture
def offline(tmp_path):
    """A profile whose host cannot answer, on a catalog of several types, and a repo to run in."""
    config = tmp_path / "rv.toml"
    config.write_text(
        'default = "nowhere"\n[profiles.nowhere]\nhost = "127.0.0.1"\nport = 9\ncatalog = "rivanna"\n'
        'remote_root = "/r"\n'
    )
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "t.py").write_text("print(1)\n")
    for args in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "i"],
    ):
        subprocess.run(["git", *args], cwd=repo, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RV_")}
    env.update(HOME=str(tmp_path), RV_CONFIG=str(config), NO_COLOR="1")

    def rv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rv", *args], cwd=repo, env=env, capture_output=True, text=True
        )

    return rv


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--parallel", "2", "-g", "0"], "--parallel caps how many points of a sweep run at once"),
        (["-g", "0", "--sweep", "x=1,2", "-f"], "-f follows one run, and each point of a sweep is a run"),
        (["-g", "0", "--sweep", "x=1,2", "--from", "base"], "--from cannot start a sweep"),
        (["-g", "0", "--sweep", "x=1,1"], "the value '1' is given twice"),
        (["-g", "0", "--sweep", "x=1,2", "--name", "a/b"], "has characters a run name cannot have"),
    ],
)
def test_what_a_sweep_cannot_be_is_refused_before_connecting(offline, args, said):
    r = offline("run", *args, "--", "python", "t.py", "{x}")
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert "connect" not in r.stderr.lower()


def test_a_sweep_on_a_cluster_of_several_types_takes_one_and_says_which(offline):
    # Issue 33: it was refused ("a point claimed on one type would still hold an array task of the
    # others"), so the guide's sweep failed as typed on a cluster of two types.
    r = offline("run", "-g", "1", "--dry-run", "--sweep", "x=1,2", "--", "python", "t.py", "{x}")
    assert r.returncode == 0, r.stderr
    said = r"a sweep runs on one GPU type: (\S+), the first that can serve it \(-t picks another: (.+)\)"
    m = re.search(said, r.stderr)
    assert m and m[1] not in m[2].split(", "), r.stderr
    assert f" 1 {m[1]};" in r.stderr, r.stderr  # the resources line: the type taken


def test_a_sweeps_dry_run_lists_its_points_and_sends_nothing(offline):
    r = offline("run", "-g", "0", "--dry-run", "--name", "g", "--sweep", "x=1..3", "--parallel", "2", "--",
                "python", "t.py", "--x={x}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "sweep of 3 point(s) over x, at most 2 at once" in r.stdout and "--array=0-2%2" in r.stdout
    assert re.search(r"^2\s+3\s+python t.py --x=3$", r.stdout, re.M), r.stdout
    assert "dry run: nothing was sent (sweep g, 3 point(s)" in r.stderr


def test_the_agent_travels_without_comments_or_docstrings_and_keeps_its_line_numbers():
    # Its program shares the 128 KiB command line with the arguments: at 96 KiB (comments and
    # docstrings included) a run over two GPU types passed the cap again.
    import ast

    from rv.remote.agent_client import _AGENT_DIR, AGENT_MODULES, _agent_bootstrap, shipped_source

    def without_docstrings(tree: ast.AST) -> str:
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            first = body[0] if isinstance(body, list) and body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                first.value.value = "" if isinstance(first.value.value, str) else first.value.value
        return ast.dump(tree)

    for module in AGENT_MODULES:
        source = (_AGENT_DIR / f"{module}.py").read_text("utf-8")
        shipped = shipped_source(source)
        assert not [t.string for t in _tokens(shipped) if t.type == tokenize.COMMENT], module
        assert shipped.count("\n") == source.count("\n"), module
        assert without_docstrings(ast.parse(shipped)) == without_docstrings(ast.parse(source)), module
    assert len(_agent_bootstrap()) < 64 * 1024


def test_the_stripped_agent_is_kept_in_the_cache_and_a_damaged_copy_is_made_again(tmp_path, monkeypatch):
    # Stripping takes ~0.25 s: a command started without the command server would pay it each time.
    from rv.remote import agent_client

    monkeypatch.setenv("RV_CACHE_DIR", str(tmp_path))
    agent_client._agent_sources.cache_clear()
    made = agent_client._agent_sources()
    (kept,) = (tmp_path / "agent").iterdir()
    assert kept.stat().st_mode & 0o777 == 0o600
    agent_client._agent_sources.cache_clear()
    monkeypatch.setattr(agent_client, "shipped_source", lambda _s: pytest.fail("stripped again"))
    assert agent_client._agent_sources() == made
    monkeypatch.undo()
    monkeypatch.setenv("RV_CACHE_DIR", str(tmp_path))
    data = json.loads(kept.read_text())
    data[2] = base64.b64encode(zlib.compress(b"x" * sum(data[1]))).decode()  # right length, wrong text
    kept.write_text(json.dumps(data))
    agent_client._agent_sources.cache_clear()
    assert agent_client._agent_sources() == made
    agent_client._agent_sources.cache_clear()


def _tokens(source: str):
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def test_long_agent_arguments_travel_compressed_under_the_kernels_cap(tmp_path):
    # sshd hands the command line to the shell as one argument, capped at 128 KiB: a run over two
    # GPU types (two batch scripts and the job runtime) passed it as plain JSON.
    layout = RemoteLayout(str(tmp_path / "remote"))
    reqs = [
        build_request(RIVANNA, command=["python", "t.py"], gpu_type=t, name="two") for t in ("a6000", "a100")
    ]
    ctx = script_context(layout, run_id="r1", snapshot_id="s1", project="p", account=None, has_secrets=False)
    two = submit_args(layout, reqs[0], ctx, provenance={}, has_secrets=False, alternatives=reqs[1:])
    plain = len(agent_command("metrics", {})) + len(json.dumps(two))
    assert plain > 128 * 1024 > len(agent_command("run-submit", two))
    (tmp_path / "remote" / "runs").mkdir(parents=True)
    line = agent_command("metrics", {"root": layout.root, "runs": [], "padding": two})
    done = subprocess.run(
        ["bash", "-c", line], capture_output=True, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(zlib.decompress(done.stdout)) == {"runs": []}
    assert encode_args({"a": 1}) == '{"a": 1}'  # short ones stay as they are


def test_time_min_over_the_default_time_names_the_default(offline):
    r = offline("run", "-g", "0", "--time-min", "4h", "--dry-run", "--", "python", "t.py")
    assert r.returncode == 2 and "rv's default 02:59:00 (no --time was given)" in r.stderr, r.stderr
    r = offline("run", "-g", "0", "--time-min", "90", "--dry-run", "--", "python", "t.py")
    assert r.returncode == 2 and "--time-min '90' has no unit" in r.stderr, r.stderr


def test_messages_in_the_users_words(offline):
    # Issue 33: --vram 40.0 shown as a float; rv up -t a,b called a list an unknown type; the --sweep
    # help named $RV_SWEEP_NAME (it is RV_SWEEP_<NAME>); the dry run wrote the product sign as x.
    r = offline("run", "-g", "1", "-t", "a100", "--vram", "40.0", "--dry-run", "--", "python", "t.py")
    assert r.returncode == 0 and "--vram 40 (command line)" in r.stderr, r.stderr
    assert "resources: 1 node(s) × 1 a100;" in r.stderr, r.stderr
    r = offline("up", "--detach", "-t", "a100,a6000")
    assert r.returncode == 2 and "rv up takes one GPU type, not a100,a6000" in r.stderr, r.stderr
    assert "next: name one, e.g. -t a100" in r.stderr and "connect" not in r.stderr.lower()
    r = offline("run", "--help")
    assert "RV_SWEEP_<NAME>" in " ".join(r.stdout.split()) and "$RV_SWEEP_NAME" not in r.stdout


def test_an_error_the_cluster_side_reports_is_its_words_and_a_next_step():
    from rv.errors import RemoteError, UsageError
    from rv.remote.agent_client import agent_reply

    def reply(obj) -> bytes:
        return zlib.compress(json.dumps(obj).encode())

    with pytest.raises(UsageError) as err:
        agent_reply("run-check", 0, reply({"error": "run x is still live (job 5)", "code": "live"}), b"")
    assert err.value.message == "run x is still live (job 5)" and "rv stop" in (err.value.hint or "")
    with pytest.raises(RemoteError) as err:
        agent_reply("sweep-submit", 0, reply({"error": "sbatch rejected the array", "code": "sbatch"}), b"")
    assert err.value.message == "sbatch rejected the array" and "--qos" in (err.value.hint or "")
    with pytest.raises(RemoteError) as err:
        agent_reply("runs", 1, b"", b"Traceback\nKeyError: 'x'\n")
    assert "KeyError" in err.value.message and "RV_DEBUG=1" in (err.value.hint or "")  # a crash: a report
