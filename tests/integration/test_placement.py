"""Placement on the real loopback clusters, as the cluster user, on both layouts: Slurm's options
decide where a job runs and reach it, a project's defaults apply under the command line, a run over
two GPU types starts once wherever it can (claimed on the cluster, nothing of rv running here), and
a GPU fault moves the run to another node (issue 25)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from projects import git_project, wait_for


def nodes_of(layout) -> tuple[str, str]:
    """The layout's two nodes: the first has features ib,nvme, the second eth (scripts/testcluster)."""
    return ("node1", "node2") if layout.name == "default" else ("gpu-01", "gpu-02")


def slurm(layout, *argv: str) -> subprocess.CompletedProcess:
    """A Slurm command as the cluster user (the tests run as root on the cluster's own machine)."""
    env = {"PATH": os.environ["PATH"], "SLURM_CONF": layout.cluster["SLURM_CONF"]}
    user = layout.cluster["RV_TESTCLUSTER_USER"]
    return subprocess.run(
        ["runuser", "-u", user, "--", *argv], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )


def runs_json(layout) -> list[dict]:
    r = layout.run_rv("ps", "-a", "--json")
    assert r.returncode == 0, r.stderr
    return [row for row in json.loads(r.stdout) if row["run_id"]]


SHOW = "echo node=$SLURMD_NODENAME; scontrol -o show job $SLURM_JOB_ID"


def test_exclude_and_constraint_decide_the_node(layout, tmp_path):
    first, second = nodes_of(layout)
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    for option in (["--constraint", "eth"], ["--exclude", first]):
        r = layout.run_rv(
            "run", "-g", "0", "--mem", "200M", *option, "-f", "--", "bash", "-c", SHOW, cwd=proj
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"node={second}" in r.stdout, (option, r.stdout)
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--constraint", "ib", "-f", "--", "bash", "-c", SHOW, cwd=proj
    )
    assert r.returncode == 0 and f"node={first}" in r.stdout, r.stdout


def test_qos_partition_and_sbatch_options_reach_the_job(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    # The default layout enforces QoS (its user may ask for `high`); the bare one has no accounting.
    qos, partition = ("high", "gpu-v100") if layout.name == "default" else ("normal", "gpu")
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--qos", qos, "--partition", partition,
        "--sbatch=--comment=rvtest", "--sbatch", "--nice=5", "-f", "--", "bash", "-c", SHOW, cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    show = r.stdout
    assert f"Partition={partition} " in show and " Comment=rvtest" in show and " Nice=5 " in show, show
    if layout.name == "default":
        assert " QOS=high " in show, show


def test_what_rv_sets_or_sbatch_refuses_fails_before_anything_is_sent(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    r = layout.run_rv("run", "-g", "0", "--sbatch=--time=1:00", "--", "true", cwd=proj)
    assert r.returncode == 2 and "rv sets --time itself" in r.stderr and "rv run --time" in r.stderr
    if layout.name == "default":
        r = layout.run_rv("run", "-g", "0", "--mem", "200M", "--qos", "nonesuch", "--", "true", cwd=proj)
        assert r.returncode == 2, r.stderr
        assert "sbatch refuses this job" in r.stderr and "Invalid qos specification" in r.stderr
    root = Path(layout.remote_root)
    assert not (root / "runs").exists() or not list((root / "runs").iterdir())
    assert not (root / "snapshots").exists()  # the check comes before the upload


def test_every_spelling_of_an_option_rv_sets_is_refused_before_upload_and_others_reach_sbatch(
    layout, tmp_path
):
    # sbatch reads a unique prefix of a long option, and short forms, as the option itself (issue 33).
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    for typed, owned in (
        ("--sbatch=--arr=0-2", "--array"),
        ("--sbatch=--partit=gpu-v100", "--partition"),
        ("--sbatch=-p gpu-v100", "--partition"),
        ("--sbatch=--job-n=x", "--job-name"),
    ):
        r = layout.run_rv("run", "-g", "0", typed, "--", "true", cwd=proj)
        assert r.returncode == 2 and f"rv sets {owned} itself" in r.stderr, (typed, r.stderr)
    for typed, why in (("--sbatch=--export=NONE", "without ALL"), ("--sbatch=--chdir=/tmp", "own copy")):
        r = layout.run_rv("run", "-g", "0", typed, "--", "true", cwd=proj)
        assert r.returncode == 2 and why in r.stderr and "next:" in r.stderr, (typed, r.stderr)
    root = Path(layout.remote_root)
    assert not (root / "snapshots").exists()  # refused before the upload
    # A prefix of an option rv leaves alone reaches sbatch, which reads it as that option.
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--sbatch=--comm=rvprefix", "--sbatch=--export=ALL,RV_T=1",
        "-f", "--",
        "bash", "-c", SHOW + "; echo RV_T=$RV_T", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert " Comment=rvprefix" in r.stdout and "RV_T=1" in r.stdout, r.stdout


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # refused before any job: one layout
def test_glued_short_options_an_option_sbatch_lacks_and_an_empty_type_list_say_what_to_do(layout, tmp_path):
    # Issue 41: -N3 and the like were "not an sbatch option"; --bell showed `Try "sbatch --help"`.
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    for typed, owned, flag in (
        ("-N3", "--nodes", "rv run --nodes"),
        ("-o/tmp/x", "--output", "rv logs"),
        ("-Jfoo", "--job-name", "rv run --name"),
        ("-wnode1", "--nodelist", "rv run --nodelist"),
        ("-Cib", "--constraint", "rv run --constraint"),
    ):
        r = layout.run_rv("run", "-g", "0", f"--sbatch={typed}", "--", "true", cwd=proj)
        assert r.returncode == 2 and f"rv sets {owned} itself" in r.stderr, (typed, r.stderr)
        assert flag in r.stderr and "not an sbatch option" not in r.stderr, (typed, r.stderr)
    bell = layout.run_rv("run", "-g", "0", "--mem", "200M", "--sbatch=--bell", "--", "true", cwd=proj)
    assert bell.returncode == 2, bell.stderr
    assert "sbatch refuses this job: unrecognized option '--bell'" in bell.stderr, bell.stderr
    assert "sbatch --help" not in bell.stderr
    (proj / "pyproject.toml").write_text('[project]\nname = "p"\n\n[tool.rv]\ntype = []\n')
    empty = layout.run_rv("run", "-g", "1", "--dry-run", "--", "true", cwd=proj)
    assert empty.returncode == 3, empty.stderr
    assert (
        f"{proj / 'pyproject.toml'} [tool.rv]: type = [] (a list): type must name at least one GPU type"
        in (" ".join(empty.stderr.split()))
    ), empty.stderr
    root = Path(layout.remote_root)
    assert not (root / "snapshots").exists()  # each refused before the upload


def test_rvs_list_of_sbatch_options_is_the_clusters_own(layout):
    # Each one-letter prefix names the options that start with it (ambiguous), or the one that does.
    from rv.slurmoptions import LONG_OPTIONS

    names = []
    for letter in "abcdefghijklmnopqrstuvwxyz":
        answer = slurm(layout, "bash", "-c", f"sbatch --{letter} </dev/null").stderr
        if "is ambiguous" in answer:
            names += re.findall(r"'--([a-z-]+)'", answer.split("possibilities:", 1)[1].splitlines()[0])
        elif "requires an argument" in answer:
            names += re.findall(r"option '--([a-z-]+)'", answer)
        else:
            assert "unrecognized option" in answer, answer
    assert sorted(names) == sorted(LONG_OPTIONS)


def test_exclude_alone_and_rv_up_are_judged_by_sbatch_before_the_upload(layout, tmp_path):
    # Issue 33: --exclude alone was never probed (every node excluded: uploaded, then exit 8), and rv up
    # said "the watchdog of the rv up session ended (exit 0)" for a QoS sbatch refuses.
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    every = ",".join(nodes_of(layout))
    for argv in (("run", "-g", "0", "--mem", "200M", "--exclude", every, "--", "true"),
                 ("up", "--detach", "-g", "0", "--mem", "200M", "--exclude", every)):  # fmt: skip
        r = layout.run_rv(*argv, cwd=proj)
        assert r.returncode == 2 and "sbatch refuses this job" in r.stderr, (argv, r.stderr)
        assert "Requested node configuration is not available" in r.stderr and "next:" in r.stderr, r.stderr
    if layout.name == "default":
        r = layout.run_rv("up", "--detach", "-g", "0", "--mem", "200M", "--qos", "nonesuch", cwd=proj)
        assert r.returncode == 2 and "Invalid qos specification" in r.stderr, r.stderr
    root = Path(layout.remote_root)
    assert not (root / "snapshots").exists()  # the check comes before the upload
    assert not (root / "runs").exists() or not list((root / "runs").iterdir())


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_a_projects_defaults_apply_under_the_command_line_and_the_dry_run_names_each_source(layout, tmp_path):
    pyproject = '[project]\nname = "p"\n\n[tool.rv]\nmax-segments = 3\nsbatch = ["--comment=fromproject"]\n'
    proj = git_project(tmp_path / "p", {"pyproject.toml": pyproject})
    dry = layout.run_rv("run", "-g", "0", "--max-segments", "2", "--dry-run", "--", "true", cwd=proj)
    assert dry.returncode == 0, dry.stderr
    settings = " ".join(dry.stderr.split())
    assert "--max-segments 2 (command line)" in settings
    assert "--sbatch --comment=fromproject (pyproject.toml [tool.rv])" in settings
    assert "#SBATCH --comment=fromproject" in dry.stdout and "RV_MAX_SEGMENTS=2" in dry.stdout
    r = layout.run_rv("run", "-g", "0", "--mem", "200M", "-f", "--", "bash", "-c", SHOW, cwd=proj)
    assert r.returncode == 0 and " Comment=fromproject" in r.stdout, r.stderr[-2000:]
    assert [row["max_segments"] for row in runs_json(layout)] == [3]
    (proj / "pyproject.toml").write_text(pyproject + "gpus_total = 2\n")
    bad = layout.run_rv("run", "-g", "0", "--dry-run", "--", "true", cwd=proj)
    assert bad.returncode == 3 and "unknown rv run option 'gpus_total'" in bad.stderr, bad.stderr


def test_a_projects_defaults_are_typed_and_follow_there_leaves_sweeps_alone(layout, tmp_path):
    # Issue 33: `gpu = 2.7` became 2 GPUs, a list of types was one unknown type, `follow = true` made
    # every sweep fail with "drop -f" though no -f was typed.
    head = '[project]\nname = "p"\n\n[tool.rv]\n'
    proj = git_project(tmp_path / "p", {"pyproject.toml": head + 'follow = true\ntype = ["v100", "a6000"]\n'})
    dry = layout.run_rv("run", "-g", "1", "--dry-run", "--", "true", cwd=proj)
    assert dry.returncode == 0 and "--gres=gpu:v100:1" in dry.stdout, dry.stderr
    assert "--type v100,a6000 (pyproject.toml [tool.rv])" in " ".join(dry.stderr.split()), dry.stderr
    (proj / "pyproject.toml").write_text(head + "follow = true\n")
    sweep = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--sweep", "x=1,2", "--json", "--", "true", cwd=proj
    )
    assert sweep.returncode == 0 and len(json.loads(sweep.stdout)["points"]) == 2, sweep.stderr
    assert "a sweep's points are not followed" in sweep.stderr
    typed = layout.run_rv("run", "-g", "0", "--sweep", "x=1,2", "-f", "--", "true", cwd=proj)
    assert typed.returncode == 2 and "drop -f" in typed.stderr  # typed, it is still refused
    for table, said in (
        ("gpu = 2.7\n", "gpu = 2.7 (a number with a point): gpu must be an integer"),
        ("gpu = true\n", "gpu = true (true/false): gpu must be an integer"),
        ("time = 8\n", "time = 8 (an integer): time must be a string"),
        (
            "max-segments = 2\nmax_segments = 3\n",
            "max-segments and max_segments are one key written two ways",
        ),
        ('env-choice = "none"\n', "unknown rv run option 'env-choice'"),
    ):
        (proj / "pyproject.toml").write_text(head + table)
        bad = layout.run_rv("run", "--dry-run", "--", "true", cwd=proj)
        assert bad.returncode == 3 and f"{proj / 'pyproject.toml'} [tool.rv]: " in bad.stderr, bad.stderr
        assert said in bad.stderr and "next:" in bad.stderr, bad.stderr


def test_rv_up_takes_placement_from_the_command_line_and_the_project_but_not_its_size(layout, tmp_path):
    _, second = nodes_of(layout)
    qos = "high" if layout.name == "default" else "normal"
    # The project's runs are long and big; a shell on its nodes is not, but runs where they run.
    pyproject = (
        '[project]\nname = "p"\n\n[tool.rv]\nconstraint = "eth"\ntime = "2d"\nmax-segments = 3\n'
        'sbatch = ["--comment=fromproject"]\n'
    )
    proj = git_project(tmp_path / "p", {"pyproject.toml": pyproject})
    r = layout.run_rv(
        "up", "--detach", "-g", "0", "--mem", "200M", "--qos", qos, "--name", "placed", cwd=proj
    )
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        shown = layout.run_rv("ssh", "placed", "--", "scontrol", "-o", "show", "job", "$SLURM_JOB_ID")
        assert shown.returncode == 0, shown.stderr
        show = shown.stdout
        assert f" NodeList={second} " in show and " Features=eth " in show, show
        # The time as typed (the tests' --time, conftest.TEST_TIME), not the project's 2d.
        assert " Comment=fromproject " in show and " TimeLimit=00:20:00 " in show, show
        if layout.name == "default":
            assert " QOS=high " in show, show
    finally:
        assert layout.run_rv("stop", "placed").returncode == 0
    # A value Slurm refuses is said before anything is queued, as for rv run.
    r = layout.run_rv("up", "--detach", "-g", "0", "--sbatch=--time=1:00", cwd=proj)
    assert r.returncode == 2 and "rv sets --time itself" in r.stderr, r.stderr


RAN = "import os; print('ran', os.environ['SLURM_JOB_ID'], os.environ['RV_GPU_TYPE'], flush=True)\n"


def rv_processes_of(home: str) -> list[int]:
    """Processes of this machine whose environment holds this test's HOME: rv's, if any are left."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"HOME={home}".encode() in environ.split(b"\0"):
            found.append(int(pid))
    return found


def test_a_run_over_two_types_starts_once_on_the_one_that_is_free(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"ran.py": RAN})
    # Every a6000 of the cluster taken by another job: the run's a6000 job would wait.
    blocker = slurm(
        layout, "sbatch", "--parsable", "-N2", "--gres=gpu:a6000:2", "--mem=100M", "-t", "5",
        "-o", "/dev/null", "--wrap", "sleep 300",
    )  # fmt: skip
    assert blocker.returncode == 0, blocker.stderr
    block_id = blocker.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: "RUNNING" in slurm(layout, "squeue", "-h", "-j", block_id, "-o", "%T").stdout, 60,
                 "the blocking job to run")  # fmt: skip
        # In-process and direct: once `rv run` returns, nothing of rv is left on this machine.
        r = layout.run_rv(
            "run", "-t", "a6000,v100", "-g", "1", "--mem", "200M", "--name", "two-types", "--",
            "python3", "ran.py", cwd=proj, env_extra={"RV_WARM_SECONDS": "0"},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        jobs = dict((t, j) for j, t in re.findall(r"(\d+) \((a6000|v100)\)", r.stderr))
        assert set(jobs) == {"a6000", "v100"}, r.stderr
        assert rv_processes_of(layout.rv_env["HOME"]) == []

        def finished():
            rows = [x for x in runs_json(layout) if x["name"] == "two-types" and x["state"] == "COMPLETED"]
            return rows[0] if rows else None

        row = wait_for(finished, 120, "the run to finish")
        assert row["gpu_type"] == "v100" and row["job_id"] == jobs["v100"]
        # The a6000 job left the queue without ever running the program.
        assert slurm(layout, "squeue", "-h", "-j", jobs["a6000"], "-o", "%T").stdout.strip() in (
            "",
            "CANCELLED",
        )
        logs = Path(layout.remote_root) / "runs"
        (rdir,) = [
            d for d in logs.iterdir() if json.loads((d / "run.json").read_text())["name"] == "two-types"
        ]
        ran = [p.name for p in (rdir / "logs").glob("*.out") if "ran " in p.read_text()]
        assert ran == [f"{jobs['v100']}.out"]
        out = layout.run_rv("logs", "two-types").stdout
        assert f"ran {jobs['v100']} v100" in out
    finally:
        slurm(layout, "scancel", block_id)


@pytest.mark.parametrize("layout", ["default"], indirect=True)
def test_with_both_types_free_the_program_starts_exactly_once_and_rv_ps_shows_one_run(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"ran.py": RAN})
    r = layout.run_rv(
        "run", "-t", "v100,a6000", "-g", "1", "--mem", "200M", "--name", "both-free", "-f", "--",
        "python3", "ran.py", cwd=proj,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(re.findall(r"^ran \d+", r.stdout, flags=re.M)) == 1, r.stdout
    rows = [row for row in runs_json(layout) if row["name"] == "both-free"]
    assert len(rows) == 1 and rows[0]["state"] == "COMPLETED"
    others = [row for row in json.loads(layout.run_rv("ps", "-a", "--json").stdout) if not row["run_id"]]
    assert not set(rows[0]["jobs"]) & {row["job_id"] for row in others}  # no candidate shown on its own


def test_without_a_type_the_run_plans_over_every_type_that_fits_and_vram_narrows_them(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    r = layout.run_rv("run", "-g", "1", "--dry-run", "--", "python3", "t.py", cwd=proj)
    assert r.returncode == 0, r.stderr
    assert "types: a6000, v100 in order" in " ".join(r.stderr.split()) or "types: v100, a6000" in r.stderr
    narrowed = layout.run_rv("run", "-g", "1", "--vram", "40", "--dry-run", "--", "python3", "t.py", cwd=proj)
    assert narrowed.returncode == 0, narrowed.stderr
    assert "rv_gpu_type=a6000" in narrowed.stdout and "types:" not in narrowed.stderr
    assert "left out v100 (memory unknown to the catalog)" in narrowed.stderr


# Saves at step 10, then dies of a GPU fault on the node it first ran on; resumed, it finishes.
FAULTY = """
import os, sys
ckpt = os.environ["RV_CHECKPOINT_DIR"]
done = os.path.join(ckpt, "step_10", "COMPLETE")
if os.path.exists(done):
    print("resumed from step 10 on", os.environ["SLURMD_NODENAME"], flush=True)
    sys.exit(0)
os.makedirs(os.path.dirname(done), exist_ok=True)
open(done, "w").close()
print("RuntimeError: CUDA error: unknown error", file=sys.stderr, flush=True)
sys.exit(1)
"""


def test_a_gpu_fault_after_saving_finishes_the_run_on_another_node(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"faulty.py": FAULTY})
    r = layout.run_rv(
        "run", "-t", "a6000", "-g", "1", "--mem", "200M", "--name", "faulty", "-f", "--",
        "python3", "faulty.py", cwd=proj, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(
        r"gpu fault on (\S+) \(RuntimeError: CUDA error: unknown error\): continued without \1", r.stderr
    )
    assert m, r.stderr  # the runtime's own line: on stderr with -f, stdout is the program's (issue 41)
    resumed = re.search(r"resumed from step 10 on (\S+)", r.stdout)
    assert resumed and resumed.group(1) != m.group(1), r.stdout
    (row,) = [row for row in runs_json(layout) if row["name"] == "faulty"]
    assert row["state"] == "COMPLETED" and row["segment"] == 2


def test_rv_status_lists_the_accounts_qos_and_partitions_one_may_ask_for(layout):
    r = layout.run_rv("status", "--json")
    assert r.returncode == 0, r.stderr
    may = json.loads(r.stdout)["may_use"]
    if layout.name == "default":
        # capped: the QoS with a one-job limit that `rv why`'s test holds a run with (scripts/testcluster)
        qos = ["capped", "high", "normal"]
        assert may == {"accounts": ["rv"], "qos": qos, "partitions": ["gpu-a6000", "gpu-v100"]}
    else:  # no accounting: only sinfo can say
        assert may == {"accounts": [], "qos": [], "partitions": ["gpu"]}
    text = layout.run_rv("status").stdout
    assert "(rv run --partition)" in text
