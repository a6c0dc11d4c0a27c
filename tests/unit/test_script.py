"""The rendered sbatch script: golden files, and the script really run by bash with stub Slurm tools.

The stubs stand in for what only a cluster has: ``srun`` runs the command once per task with the
per-task variables a real srun sets (``SLURM_NODEID``), ``scontrol`` answers ``show hostnames`` and
``show node``, ``nvidia-smi`` prints a compute capability, ``torchrun`` records its argv. Everything
else (bash, cp, find, sed) is real, so quoting, traps and exit codes are tested for real.

``RV_UPDATE_GOLDEN=1 pytest tests/unit/test_script.py`` rewrites the golden files.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rv.catalog import RIVANNA, GpuType
from rv.errors import ConfigError, UsageError
from rv.request import build_request
from rv.slurm.script import ScriptContext, inner_command, program_line, render_script

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
BASH = shutil.which("bash") or "/bin/bash"
CATALOG = {**RIVANNA, "v100": replace(RIVANNA["v100"], max_gpus_per_job=None)}
ROOT = "/scratch/u/rv"


def ctx(**kw) -> ScriptContext:
    kw.setdefault("remote_root", ROOT)
    kw.setdefault("snapshot_id", "snap01")
    kw.setdefault("project", "proj-1a2b3c")
    return ScriptContext(**kw)


# --- golden files -------------------------------------------------------------------------------

GOLDEN_CASES = {
    "a6000_python": lambda: (
        build_request(CATALOG, command=["python", "train.py", "--lr", "3e-4"], gpu_type="a6000"),
        ctx(),
    ),
    "a6000_torchrun_2gpu": lambda: (
        build_request(CATALOG, command=["torchrun", "train.py"], gpus=2, gpu_type="a6000", time="6h"),
        ctx(),
    ),
    "a6000_torchrun_2node": lambda: (
        build_request(
            CATALOG,
            command=["torchrun", "--max-restarts=0", "train.py", "--out", "runs/it's here"],
            gpus=4,
            gpu_type="a6000",
            nodes=2,
            time="1d",
            mem="64G",
            cpus=16,
            setup=["module load cuda/12.4", "source ~/venvs/train/bin/activate"],
            outputs=["runs/exp1", "model.pt"],
            name="grpo-2node",
        ),
        ctx(
            account="mylab_paid",
            secrets_file=f"{ROOT}/secrets/0b1c2d.env",
            extra_env=(("WANDB_PROJECT", "grpo"),),
        ),
    ),
    "v100_fp16": lambda: (
        build_request(CATALOG, command=["python3", "-m", "pkg.finetune"], gpus=2, gpu_type="v100"),
        ctx(),
    ),
    "mig": lambda: (build_request(CATALOG, command=["python", "eval.py"], mig=True, time="30m"), ctx()),
    "cpu_only": lambda: (
        build_request(CATALOG, command=["bash", "prep.sh"], gpus=0, cpus=4, mem="8G"),
        ctx(partition="standard"),
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden(case):
    req, context = GOLDEN_CASES[case]()
    text = render_script(req, context)
    path = GOLDEN / f"{case}.sh"
    if os.environ.get("RV_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with RV_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{case}: render differs from {path}; RV_UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_is_valid_bash(case):
    result = subprocess.run([BASH, "-n", str(GOLDEN / f"{case}.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- directives ---------------------------------------------------------------------------------


def directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_directives_of_a_two_node_job():
    req, context = GOLDEN_CASES["a6000_torchrun_2node"]()
    d = directives(render_script(req, context))
    assert d == [
        "#SBATCH --job-name=grpo-2node",
        "#SBATCH --partition=gpu-a6000",
        "#SBATCH --gres=gpu:a6000:2",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --account=mylab_paid",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --mem=64G",
        f"#SBATCH --output={ROOT}/logs/grpo-2node-%j.out",
        f"#SBATCH --error={ROOT}/logs/grpo-2node-%j.err",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=USR1@300",
    ]


def test_signal_has_no_batch_prefix_and_no_time_min():
    for case in GOLDEN_CASES:
        text = render_script(*GOLDEN_CASES[case]())
        assert "--signal=B:" not in text
        assert "--time-min" not in text
        assert "set -x" not in text.replace("`set -x`", "")


def test_constraint_and_untyped_gres():
    a100 = build_request(CATALOG, command=["python", "x.py"], gpu_type="a100")
    assert "#SBATCH --constraint=a100_80gb" in directives(render_script(a100, ctx()))
    plain = {"gpu": GpuType("gpu", "gpu", "", 4)}
    d = directives(render_script(build_request(plain, command=["python", "x.py"], gpus=2), ctx()))
    assert "#SBATCH --gres=gpu:2" in d


def test_partition_override_and_cpu_job_without_partition():
    req = build_request(CATALOG, command=["python", "x.py"], gpu_type="a6000")
    assert "#SBATCH --partition=gpu-a6000-debug" in directives(
        render_script(req, ctx(partition="gpu-a6000-debug"))
    )
    cpu = build_request(CATALOG, command=["python", "x.py"], gpus=0)
    d = directives(render_script(cpu, ctx()))
    assert not any("--partition" in line or "--gres" in line for line in d)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("remote_root", "~/rv", ConfigError),
        ("remote_root", "/scratch/my rv", ConfigError),
        ("remote_root", "/scratch/100%", ConfigError),
        ("account", "my lab", ConfigError),
        ("partition", 'gpu"x', UsageError),
    ],
)
def test_unsafe_directive_values_are_refused(field, value, error):
    req = build_request(CATALOG, command=["python", "x.py"], gpu_type="a6000")
    with pytest.raises(error):
        render_script(req, ctx(**{field: value}))


def test_bad_ids_and_env_names_are_refused():
    req = build_request(CATALOG, command=["python", "x.py"], gpu_type="a6000")
    with pytest.raises(ValueError):
        render_script(req, ctx(snapshot_id="../x"))
    with pytest.raises(UsageError):
        render_script(req, ctx(extra_env=(("BAD-NAME", "x"),)))


def test_inner_command_of_torchrun_injects_only_missing_flags():
    req = build_request(
        CATALOG,
        command=["torchrun", "--nproc_per_node=4", "--rdzv-id=mine", "--signals-to-handle=SIGUSR2", "t.py"],
        gpus=8,
        gpu_type="v100",
    )
    assert program_line(req) == (
        'torchrun --nnodes=2 --node-rank="$SLURM_NODEID" --rdzv-backend=c10d '
        '--rdzv-endpoint="$RV_HEAD_ADDR:$MASTER_PORT" '
        "--nproc_per_node=4 --rdzv-id=mine --signals-to-handle=SIGUSR2 t.py"
    )
    assert "--signals-to-handle" not in render_script(req, ctx()).split("# --- the program")[0]


def test_one_node_torchrun_with_own_rendezvous_is_left_alone():
    req = build_request(
        CATALOG,
        command=["python", "-m", "torch.distributed.run", "--standalone", "t.py"],
        gpus=2,
        gpu_type="a6000",
    )
    assert inner_command(req) == (
        "exec python -m torch.distributed.run --nnodes=1 --nproc-per-node=2 "
        '${RV_TORCHRUN_SIGNALS:+"$RV_TORCHRUN_SIGNALS"} --standalone t.py'
    )


# --- running the script -------------------------------------------------------------------------

STUBS = {
    "srun": r"""#!/bin/bash
# Stand-in for srun: log the options, drop them, run the command once per task with the
# per-task variables a real srun sets, and exit with the highest task exit code.
printf '%s\n' "$*" >> "$RV_TEST_OUT/srun.log"
ntasks=1
while [ $# -gt 0 ]; do
    case "$1" in
        --ntasks=*) ntasks="${1#--ntasks=}"; shift ;;
        --*) shift ;;
        *) break ;;
    esac
done
rc=0
for ((i = 0; i < ntasks; i++)); do
    # STUB_SETSID=1: each task in its own process group, as slurmstepd starts it, so a test can
    # signal one task the way Slurm signals a step.
    launch=()
    [ "${STUB_SETSID:-}" = 1 ] && launch=(setsid --wait)
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "${launch[@]}" "$@" || { r=$?; [ $r -gt $rc ] && rc=$r; }
done
exit $rc
""",
    "scontrol": r"""#!/bin/bash
case "$1 $2" in
    "show hostnames") printf 'node1\nnode2\n' ;;
    "show node")
        printf 'NodeName=%s Arch=x86_64 CoresPerSocket=1\n' "$3"
        printf '   NodeAddr=10.1.2.3 NodeHostName=%s Version=22.05.8\n' "$3" ;;
    *) exit 1 ;;
esac
""",
    "nvidia-smi": r"""#!/bin/bash
[ "${FAKE_CC-8.6}" = fail ] && exit 9
printf '%s\n%s\n' "${FAKE_CC-8.6}" "${FAKE_CC-8.6}"
""",
    "torchrun": f"""#!{sys.executable}
import json, os, sys
if "--help" in sys.argv[1:]:
    old = os.environ.get("FAKE_OLD_TORCH") == "1"
    print("usage: torchrun" + ("" if old else " [--signals-to-handle SIGNALS]"))
    sys.exit(0)
out = os.path.join(os.environ["RV_TEST_OUT"], "torchrun-" + os.environ["SLURM_NODEID"] + ".json")
with open(out, "w") as f:
    json.dump(sys.argv[1:], f)
""",
}

# Writes its argv (after the output path) as JSON: what the program received, byte for byte.
PRINT_ARGV = (
    "import json,os,sys; open(os.environ['RV_TEST_OUT']+'/argv.json','w').write(json.dumps(sys.argv[1:]))"
)

_job_ids = itertools.count(4242)


class Sandbox:
    """A temp remote root with a snapshot, stub tools on PATH, and a way to run a rendered script."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "root"
        self.out = base / "out"
        self.stubs = base / "stubs"
        for d in (self.root / "logs", self.out, self.stubs):
            d.mkdir(parents=True)
        snap = self.root / "snapshots" / "snap01"
        (snap / "pkg").mkdir(parents=True)
        (snap / "pkg" / "data.txt").write_text("from the snapshot\n")
        (snap / "train.py").write_text("print('hi')\n")
        # The store is read-only: files 0444, folders 0555.
        for path in [snap / "pkg" / "data.txt", snap / "train.py"]:
            path.chmod(0o444)
        for path in [snap / "pkg", snap]:
            path.chmod(0o555)
        self.snapshot = snap
        for name, text in STUBS.items():
            (self.stubs / name).write_text(text)
            (self.stubs / name).chmod(0o755)

    def ctx(self, **kw) -> ScriptContext:
        return ScriptContext(remote_root=str(self.root), snapshot_id="snap01", project="proj", **kw)

    def env(self, job_id: int, **extra: str) -> dict[str, str]:
        env = {
            "PATH": f"{self.stubs}:{os.environ['PATH']}",
            "HOME": str(self.base),
            "LANG": "C.UTF-8",
            "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NODELIST": "node[1-2]",
            "RV_TEST_OUT": str(self.out),
        }
        env.update(extra)
        return env

    def run(self, script: str, timeout: float = 60, **extra: str) -> tuple[subprocess.CompletedProcess, int]:
        job_id = next(_job_ids)
        path = self.base / f"job-{job_id}.sh"
        path.write_text(script)
        result = subprocess.run(
            [BASH, str(path)],
            env=self.env(job_id, **extra),
            cwd=self.base,
            capture_output=True,
            timeout=timeout,
        )
        return result, job_id

    def cleanup(self) -> None:
        for dirpath, dirnames, _ in os.walk(self.base):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def box():
    sandbox = Sandbox(Path(tempfile.mkdtemp(prefix="rv-script-")))
    yield sandbox
    sandbox.cleanup()


NASTY = [
    "",
    "-g",
    "--",
    "$(touch pwned)",
    "`id`",
    "a'b",
    'a"b',
    "a\nb",
    "; rm -rf /",
    "ü日本",
    "*",
    "$HOME",
    "\\",
    " lead and trail ",
    "'",
    "\t",
    "${RV_TORCHRUN_SIGNALS}",
]
ARG = st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)
ARGS = st.lists(ARG, max_size=6)
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(args=ARGS)
@example(args=NASTY)
def test_plain_command_reaches_the_program_byte_for_byte(args):
    box = Sandbox(Path(tempfile.mkdtemp(prefix="rv-prop-")))
    try:
        command = [sys.executable, "-c", PRINT_ARGV, *args]
        req = build_request(CATALOG, command=command, gpu_type="a6000")
        result, _ = box.run(render_script(req, box.ctx()))
        assert result.returncode == 0, result.stderr.decode()
        assert json.loads((box.out / "argv.json").read_text()) == args
        assert not (box.base / "pwned").exists()
    finally:
        box.cleanup()


def expected_torchrun_argv(job_id: int, node: int, tail: list[str]) -> list[str]:
    return [
        "--nnodes=2",
        f"--node-rank={node}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=10.1.2.3:{15000 + job_id % 15000}",
        f"--rdzv-id={job_id}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
        *tail,
    ]


@PROPERTY
@given(args=ARGS)
@example(args=NASTY)
def test_torchrun_command_reaches_each_node_byte_for_byte(args):
    box = Sandbox(Path(tempfile.mkdtemp(prefix="rv-prop-")))
    try:
        command = ["torchrun", "--max-restarts=0", "train.py", *args]
        req = build_request(CATALOG, command=command, gpus=4, gpu_type="a6000", nodes=2)
        result, job_id = box.run(render_script(req, box.ctx()))
        assert result.returncode == 0, result.stderr.decode()
        for node in (0, 1):  # the node rank is expanded inside each task, not once in the batch shell
            got = json.loads((box.out / f"torchrun-{node}.json").read_text())
            assert got == expected_torchrun_argv(job_id, node, ["--max-restarts=0", "train.py", *args])
    finally:
        box.cleanup()


def test_old_torchrun_gets_no_signals_flag(box):
    req = build_request(CATALOG, command=["torchrun", "train.py"], gpus=2, gpu_type="a6000")
    result, _ = box.run(render_script(req, box.ctx()), FAKE_OLD_TORCH="1")
    assert result.returncode == 0, result.stderr.decode()
    argv = json.loads((box.out / "torchrun-0.json").read_text())
    assert not any(a.startswith("--signals-to-handle") for a in argv)
    assert "--nnodes=1" in argv and "--nproc-per-node=2" in argv and argv[-1] == "train.py"


def test_srun_one_task_per_node_with_per_node_logs(box):
    req = build_request(CATALOG, command=["torchrun", "t.py"], gpus=4, gpu_type="a6000", nodes=2, name="r")
    box.run(render_script(req, box.ctx()))
    line = (box.out / "srun.log").read_text().splitlines()[0]
    assert line.startswith(
        "--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append "
    )
    assert f"--output={box.root}/logs/r-%j-node%n.out --error={box.root}/logs/r-%j-node%n.err" in line


def program(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_exit_code_of_the_program_is_the_jobs(box):
    req = build_request(CATALOG, command=program("import sys; sys.exit(7)"), gpu_type="a6000")
    result, job_id = box.run(render_script(req, box.ctx()))
    assert result.returncode == 7
    assert f"rv: job {job_id} ended with exit code 7" in result.stdout.decode()


def test_outputs_are_copied_even_when_the_program_fails(box):
    code = """
        import os, sys
        os.makedirs("runs/exp1", exist_ok=True)
        open("runs/exp1/metrics.json", "w").write("{}")
        open("model.pt", "w").write("weights")
        sys.exit(3)
    """
    req = build_request(
        CATALOG, command=program(code), gpu_type="a6000", outputs=["runs/exp1", "model.pt", "missing.txt"]
    )
    result, job_id = box.run(render_script(req, box.ctx()))
    assert result.returncode == 3
    out = box.root / "jobs" / str(job_id) / "output"
    assert (out / "runs" / "exp1" / "metrics.json").read_text() == "{}"
    assert (out / "model.pt").read_text() == "weights"
    assert "rv: warning: output missing.txt not found" in result.stdout.decode()


def test_work_dir_is_a_hard_link_farm_of_the_read_only_snapshot(box):
    code = """
        open("new.txt", "w").write("mine")
        try:
            open("train.py", "a").write("x")
        except PermissionError:
            print("snapshot file is read-only")
        print(open("pkg/data.txt").read(), end="")
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    result, job_id = box.run(render_script(req, box.ctx()))
    if os.geteuid() != 0:  # root ignores file modes
        assert "snapshot file is read-only" in result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    work = box.root / "jobs" / str(job_id) / "work"
    assert (work / "new.txt").read_text() == "mine"
    assert not (box.snapshot / "new.txt").exists()
    assert (work / "pkg" / "data.txt").stat().st_ino == (box.snapshot / "pkg" / "data.txt").stat().st_ino
    assert stat.S_IMODE((box.snapshot / "train.py").stat().st_mode) == 0o444  # the store was not chmod'ed
    assert "from the snapshot" in result.stdout.decode()


def test_secrets_are_loaded_then_removed(box):
    secrets = box.root / "secrets" / "s.env"
    secrets.parent.mkdir()
    secrets.write_text("HF_TOKEN='hf_s3cr3t value'\n")
    secrets.chmod(0o600)
    code = "import os, json; print(json.dumps(os.environ['HF_TOKEN']))"
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    script = render_script(req, box.ctx(secrets_file=str(secrets)))
    assert "s3cr3t" not in script
    result, _ = box.run(script)
    assert result.returncode == 0, result.stderr.decode()
    assert '"hf_s3cr3t value"' in result.stdout.decode()
    assert not secrets.exists()


def test_missing_secrets_file_fails_the_first_attempt(box):
    req = build_request(CATALOG, command=program("print('ran')"), gpu_type="a6000")
    script = render_script(req, box.ctx(secrets_file=str(box.root / "secrets" / "gone.env")))
    result, _ = box.run(script)
    assert result.returncode == 1
    assert "gone.env is missing" in result.stderr.decode()
    assert "ran" not in result.stdout.decode()
    requeued, _ = box.run(script, SLURM_RESTART_COUNT="1")
    assert requeued.returncode == 0 and "ran" in requeued.stdout.decode()


def test_term_runs_the_exit_trap(box):
    secrets = box.root / "secrets" / "s.env"
    secrets.parent.mkdir()
    secrets.write_text("A=1\n")
    code = f"""
        import time
        open("partial.txt", "w").write("so far")
        open({str(box.out / "started")!r}, "w").close()
        time.sleep(30)
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", outputs=["partial.txt"])
    path = box.base / "term.sh"
    path.write_text(render_script(req, box.ctx(secrets_file=str(secrets))))
    # Slurm's time limit signals every process of the job; a process group stands in for that.
    proc = subprocess.Popen(
        [BASH, str(path)], env=box.env(9001), cwd=box.base, start_new_session=True, stdout=subprocess.PIPE
    )
    deadline = time.monotonic() + 20
    while not (box.out / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=20)
    assert proc.returncode == 143
    assert not secrets.exists()
    assert (box.root / "jobs" / "9001" / "output" / "partial.txt").read_text() == "so far"
    assert b"ended with exit code 143" in stdout


def test_setup_runs_first_in_the_work_dir_and_a_failure_stops_the_job(box):
    code = "import os; print('setup said', os.environ['FROM_SETUP'])"
    setup = ["export FROM_SETUP=\"$(cat pkg/data.txt | tr -d '\\n')$UNSET_IS_FINE\""]
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", setup=setup)
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 0, result.stderr.decode()
    assert "setup said from the snapshot" in result.stdout.decode()

    failing = build_request(
        CATALOG,
        command=program("print('ran')"),
        gpu_type="a6000",
        setup=["true", "exit_5() { return 5; }; exit_5"],
    )
    result, _ = box.run(render_script(failing, box.ctx()))
    assert result.returncode == 5
    assert "rv: setup line 2 failed with exit code 5" in result.stderr.decode()
    assert "ran" not in result.stdout.decode()


PRECISION = (
    "import os; e = os.environ; "
    "print('P', e['RV_PRECISION'], e['ACCELERATE_MIXED_PRECISION'], e.get('RV_GPU_CC'))"
)


@pytest.mark.parametrize(
    ("gpu_type", "fake_cc", "expected"),
    [
        ("a6000", "8.6", "P bf16 bf16 8.6"),
        ("a6000", "7.5", "P fp16 fp16 7.5"),  # the GPU's answer beats the catalog
        ("a6000", "fail", "P bf16 bf16 8.6"),  # nvidia-smi failed: catalog
        ("a6000", "garbage", "P bf16 bf16 8.6"),
        ("v100", "fail", "P fp16 fp16 7.0"),
        ("h200", "10.0", "P bf16 bf16 10.0"),
    ],
)
def test_precision_from_the_gpu_or_the_catalog(box, gpu_type, fake_cc, expected):
    req = build_request(CATALOG, command=program(PRECISION), gpu_type=gpu_type)
    result, _ = box.run(render_script(req, box.ctx()), FAKE_CC=fake_cc)
    assert result.returncode == 0, result.stderr.decode()
    assert expected in result.stdout.decode()


def test_unknown_compute_capability_falls_back_to_fp16(box):
    cat = {"mystery": GpuType("mystery", "p", "mystery", 4)}
    req = build_request(cat, command=program(PRECISION), gpus=1)
    result, _ = box.run(render_script(req, box.ctx()), FAKE_CC="fail")
    assert "P fp16 fp16 \n" in result.stdout.decode()


def test_cpu_only_job_has_no_mixed_precision(box):
    req = build_request(CATALOG, command=program(PRECISION), gpus=0)
    result, job_id = box.run(render_script(req, box.ctx()))
    assert "P no no None" in result.stdout.decode()
    assert f"rv: job {job_id} on node[1-2]: 1 node(s), CPU only" in result.stdout.decode()


def test_environment_paths_and_master_port(box):
    code = """
        import os
        for k in ["RV_JOB_DIR", "RV_OUTPUT_DIR", "RV_CHECKPOINT_DIR", "HF_HOME", "WANDB_DIR",
                  "MASTER_PORT", "MASTER_ADDR", "RV_SNAPSHOT", "PYTHONUNBUFFERED"]:
            print(k, os.environ[k])
        print("cwd", os.getcwd())
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", name="exp")
    result, job_id = box.run(render_script(req, box.ctx()))
    lines = dict(line.split(" ", 1) for line in result.stdout.decode().splitlines() if " " in line)
    job_dir = f"{box.root}/jobs/{job_id}"
    assert lines["RV_JOB_DIR"] == job_dir
    assert lines["RV_OUTPUT_DIR"] == job_dir + "/output"
    assert lines["RV_CHECKPOINT_DIR"] == f"{box.root}/checkpoints/proj/exp"
    assert lines["HF_HOME"] == f"{box.root}/cache/hf"
    assert lines["WANDB_DIR"] == f"{box.root}/cache/wandb"
    assert lines["MASTER_PORT"] == str(15000 + job_id % 15000)
    assert lines["MASTER_ADDR"] == "10.1.2.3"  # NodeAddr of the first node, not its name
    assert lines["RV_SNAPSHOT"] == "snap01"
    assert lines["PYTHONUNBUFFERED"] == "1"
    assert os.path.realpath(lines["cwd"]) == os.path.realpath(job_dir + "/work")


def test_user_cache_setting_wins(box):
    req = build_request(
        CATALOG, command=program("import os; print('HF', os.environ['HF_HOME'])"), gpu_type="a6000"
    )
    result, _ = box.run(render_script(req, box.ctx()), HF_HOME="/datasets/hf")
    assert "HF /datasets/hf" in result.stdout.decode()


def test_requeued_job_keeps_its_work_dir(box):
    code = "import os; open('count.txt','a').write('x'); print('count', open('count.txt').read())"
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    script = render_script(req, box.ctx())
    path = box.base / "requeue.sh"
    path.write_text(script)
    for expected in ("count x", "count xx"):
        result = subprocess.run([BASH, str(path)], env=box.env(777), cwd=box.base, capture_output=True)
        assert expected in result.stdout.decode()


def test_plain_command_on_several_nodes_runs_once_per_node(box):
    code = "import json, os, sys; print('node', os.environ['SLURM_NODEID'], json.dumps(sys.argv[1:]))"
    req = build_request(CATALOG, command=[*program(code), *NASTY], gpus=4, gpu_type="v100", nodes=2)
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode()
    for node in (0, 1):
        assert f"node {node} {json.dumps(NASTY)}" in out


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ((0, 0), 0),
        ((3, 143), 3),  # node 1 stopped by --kill-on-bad-exit: node 0's failure is the job's
        ((143, 2), 2),
        ((143, 143), 143),  # both killed (a time limit): srun's own code stands
        ((137, 0), 137),
    ],
)
def test_several_nodes_report_the_failing_nodes_exit_code(box, codes, expected):
    code = f"import os, sys; sys.exit({list(codes)!r}[int(os.environ['SLURM_NODEID'])])"
    req = build_request(CATALOG, command=program(code), gpus=4, gpu_type="v100", nodes=2)
    result, job_id = box.run(render_script(req, box.ctx()))
    assert result.returncode == expected, result.stderr.decode()
    for node, node_code in enumerate(codes):
        assert (box.root / "jobs" / str(job_id) / f"node{node}.exit").read_text() == f"{node_code}\n"


def test_task_shell_outlives_slurms_signal_and_the_program_gets_it(box):
    # Slurm signals every process of a step (killpg or the whole process tree); the task's shell
    # must survive it to record the exit code, and the program must still see the signal.
    code = f"""
        import os, signal, sys, time
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        open({str(box.out)!r} + "/pgid-" + os.environ["SLURM_NODEID"], "w").write(str(os.getpgid(0)))
        deadline = time.time() + 20
        while not got and time.time() < deadline:
            time.sleep(0.05)
        print("node", os.environ["SLURM_NODEID"], "got USR1" if got else "no signal", flush=True)
        sys.exit(0 if got else 9)
    """
    req = build_request(CATALOG, command=program(code), gpus=4, gpu_type="v100", nodes=2)
    path = box.base / "usr1.sh"
    path.write_text(render_script(req, box.ctx()))
    proc = subprocess.Popen(
        [BASH, str(path)], env=box.env(5150, STUB_SETSID="1"), cwd=box.base, stdout=subprocess.PIPE
    )
    for node in (0, 1):  # the stub runs tasks one after the other
        pgid_file = box.out / f"pgid-{node}"
        deadline = time.monotonic() + 20
        while not pgid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        os.killpg(int(pgid_file.read_text()), signal.SIGUSR1)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, stdout
    assert b"node 0 got USR1" in stdout and b"node 1 got USR1" in stdout
    assert (box.root / "jobs" / "5150" / "node1.exit").read_text() == "0\n"
