"""The rendered sbatch script: golden files, and the script really run by bash with stub Slurm tools.

The stubs stand in for what only a cluster has: ``srun`` runs the command once per task with the
per-task variables a real srun sets (``SLURM_NODEID``), ``scontrol`` answers ``show hostnames``,
``show node`` and ``-o show job`` (as the test says: a requeue, a time limit), ``squeue`` gives the
job's end time (for the stop watcher), ``sbatch`` and ``scancel`` record what they were asked,
``nvidia-smi`` prints a compute capability, ``torchrun`` records its argv. Everything else (bash, cp,
find, sed, ps, kill) is real, so quoting, traps, signals, exit codes and records are tested for real.

``RV_UPDATE_GOLDEN=1 pytest tests/unit/test_script.py`` rewrites the golden files.
"""

from __future__ import annotations

import itertools
import json
import os
import re
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
from rv.placement import build_placement
from rv.request import build_request
from rv.secrets import render_env_file
from rv.slurm.launch import program_line
from rv.slurm.script import JOB_RUNTIME_PARTS, ScriptContext, job_runtime, render_script, runtime_files

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
BASH = shutil.which("bash") or "/bin/bash"
CATALOG = {**RIVANNA, "v100": replace(RIVANNA["v100"], max_gpus_per_job=None)}
ROOT = "/scratch/u/rv"


def ctx(**kw) -> ScriptContext:
    kw.setdefault("remote_root", ROOT)
    kw.setdefault("snapshot_id", "snap01")
    kw.setdefault("project", "proj-1a2b3c")
    kw.setdefault("run_id", "run0a1b2")
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
        ctx(account="mylab_paid", has_secrets=True, extra_env=(("WANDB_PROJECT", "grpo"),)),
    ),
    "v100_fp16": lambda: (
        build_request(
            CATALOG,
            command=["python3", "-m", "pkg.finetune"],
            gpus=2,
            gpu_type="v100",
            allow_single_process=True,
        ),
        ctx(),
    ),
    "mig": lambda: (build_request(CATALOG, command=["python", "eval.py"], mig=True, time="30m"), ctx()),
    "a6000_accelerate_uv_2node": lambda: (
        build_request(
            CATALOG,
            command=["uv", "run", "--frozen", "accelerate", "launch", "train.py", "--epochs", "3"],
            gpus=4,
            gpu_type="a6000",
            nodes=2,
        ),
        ctx(),
    ),
    "cpu_each_node": lambda: (
        build_request(CATALOG, command=["bash", "prep.sh"], gpus=0, nodes=2, each_node=True),
        ctx(),
    ),
    "cpu_only": lambda: (
        build_request(CATALOG, command=["bash", "prep.sh"], gpus=0, cpus=4, mem="8G"),
        ctx(partition="standard"),
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden(case):
    req, ctx_ = GOLDEN_CASES[case]()
    # The runtime's name holds a hash of job.sh: a change there is not a change of every golden file.
    hashed = r"/runtime/(job|rank-label|stats)-[0-9a-f]{16}\."
    text = re.sub(hashed, r"/runtime/\1-HASH.", render_script(req, ctx_))
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


def test_golden_and_runtime_pass_shellcheck():
    # scripts/test installs shellcheck and also runs it over every shell file of the project.
    assert shutil.which("shellcheck"), (
        "shellcheck is missing: scripts/test installs it (apt-get install shellcheck)"
    )
    result = subprocess.run(
        ["shellcheck", "-s", "bash", *map(str, JOB_RUNTIME_PARTS), *map(str, sorted(GOLDEN.glob("*.sh")))],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout


def test_a_two_node_torchrun_script_is_short():
    req, context = GOLDEN_CASES["a6000_torchrun_2node"]()
    assert len(render_script(req, context).splitlines()) <= 120


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
        f"#SBATCH --output={ROOT}/runs/run0a1b2/logs/%j.out",
        f"#SBATCH --error={ROOT}/runs/run0a1b2/logs/%j.err",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
    ]


def test_no_slurm_signal_and_no_time_min():
    # Slurm's --signal reaches every process of a step, and a plain Python program dies of USR1:
    # rv's own watcher sends the stop signal, only to processes that handle it.
    for case in GOLDEN_CASES:
        text = render_script(*GOLDEN_CASES[case]())
        assert "--signal" not in text
        assert "--signals-to-handle" not in text
        assert "--time-min" not in text
        assert "set -x" not in text.replace("`set -x`", "")


def test_constraint_and_untyped_gres():
    a100 = build_request(CATALOG, command=["python", "x.py"], gpu_type="a100")
    assert "#SBATCH --constraint=a100_80gb" in directives(render_script(a100, ctx()))
    plain = {"gpu": GpuType("gpu", "gpu", "", 4)}
    two = build_request(plain, command=["python", "x.py"], gpus=2, allow_single_process=True)
    d = directives(render_script(two, ctx()))
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


def test_program_line_of_torchrun_injects_only_missing_flags():
    req = build_request(
        CATALOG,
        command=["torchrun", "--nproc_per_node=4", "--rdzv-id=mine", "--signals-to-handle=SIGUSR2", "t.py"],
        gpus=8,
        gpu_type="v100",
    )
    assert program_line(req) == (
        'torchrun --nnodes=2 --node_rank="$SLURM_NODEID" --master_addr="$RV_HEAD_ADDR" '
        '--master_port="$MASTER_PORT" --nproc_per_node=4 --rdzv-id=mine --signals-to-handle=SIGUSR2 t.py'
    )


def test_one_node_torchrun_with_own_rendezvous_is_left_alone():
    req = build_request(
        CATALOG,
        command=["python", "-m", "torch.distributed.run", "--standalone", "t.py"],
        gpus=2,
        gpu_type="a6000",
    )
    assert (
        program_line(req) == "python -m torch.distributed.run --nnodes=1 --nproc_per_node=2 --standalone t.py"
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
    "update JobId="*)
        # A job asking Slurm to mail its own end (rv_notify_end): recorded, as Slurm would keep it.
        printf '%s\n' "$*" >> "$RV_TEST_OUT/scontrol-update.log" ;;
    "-o show")
        # What the EXIT trap asks: the test says how Slurm sees the job (a requeue, a time limit).
        printf 'JobId=%s JobName=x JobState=%s Reason=%s Restarts=%s ExitCode=0:0\n' "$4" \
            "${FAKE_STATE:-COMPLETING}" "${FAKE_REASON:-None}" "${FAKE_RESTARTS:-0}" ;;
    *) exit 1 ;;
esac
""",
    "squeue": r"""#!/bin/bash
# The stop watcher asks for the job's end time (%e); FAKE_END_IN: seconds from now.
[ -n "${FAKE_SQUEUE_FAIL:-}" ] && exit 1
date -d "@$(( $(date +%s) + ${FAKE_END_IN:-3600} ))" +%Y-%m-%dT%H:%M:%S
""",
    "sbatch": r"""#!/bin/bash
# Records what the next segment was submitted with: argv, RV_SEGMENT, and the environment.
n=$(ls "$RV_TEST_OUT"/sbatch-*.json 2>/dev/null | wc -l)
python3 -c 'import json, os, sys
json.dump({"argv": sys.argv[2:], "env": dict(os.environ)}, open(sys.argv[1], "w"))' \
    "$RV_TEST_OUT/sbatch-$n.json" "$@"
[ -n "${FAKE_SBATCH_FAIL:-}" ] && { echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2; exit 1; }
echo "$((${FAKE_NEXT_JOB:-5001} + n));cluster"
""",
    "scancel": r"""#!/bin/bash
printf '%s\n' "$*" >> "$RV_TEST_OUT/scancel.log"
""",
    "nvidia-smi": r"""#!/bin/bash
[ "${FAKE_CC-8.6}" = fail ] && exit 9
printf '%s\n%s\n' "${FAKE_CC-8.6}" "${FAKE_CC-8.6}"
""",
    "torchrun": f"""#!{sys.executable}
import json, os, sys
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
RUN = "run0a1b2"


class Sandbox:
    """A temp remote root with a snapshot, stub tools on PATH, and a way to run a rendered script."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "root"
        self.out = base / "out"
        self.stubs = base / "stubs"
        for d in (self.root / "runs" / RUN / "seg", self.root / "runs" / RUN / "logs", self.out, self.stubs):
            d.mkdir(parents=True)
        # The snapshot store: a bare git repository whose ref refs/rv/snapshots/snap01 holds the files.
        src = base / "src"
        (src / "pkg").mkdir(parents=True)
        (src / "pkg" / "data.txt").write_text("from the snapshot\n")
        (src / "train.py").write_text("print('hi')\n")
        self.store = self.root / "store.git"
        self.git("init", "-q", "--bare", "--template=", str(self.store))
        env = {"GIT_INDEX_FILE": str(base / "index"), "GIT_WORK_TREE": str(src)}
        self.git("add", "-A", env=env)
        tree = self.git("write-tree", env=env)
        who = {
            f"GIT_{r}_{k}": v for r in ("AUTHOR", "COMMITTER") for k, v in (("NAME", "rv"), ("EMAIL", "rv@x"))
        }
        commit = self.git("commit-tree", tree, "-m", "rv snapshot snap01", env=who)
        self.git("update-ref", "refs/rv/snapshots/snap01", commit)
        self.run_dir = self.root / "runs" / RUN
        # The job's runtime where the batch script sources it, as rv run-submit places it.
        (self.root / "runtime").mkdir()
        for name, text in runtime_files().items():
            (self.root / "runtime" / name).write_text(text)
            (self.root / "runtime" / name).chmod(0o500)
        for name, text in STUBS.items():
            (self.stubs / name).write_text(text)
            (self.stubs / name).chmod(0o755)

    def git(self, *args: str, env: dict[str, str] | None = None) -> str:
        full = {**os.environ, "GIT_DIR": str(self.root / "store.git"), **(env or {})}
        out = subprocess.run(["git", *args], env=full, check=True, capture_output=True, text=True).stdout
        return out.strip()

    def stored(self, path: str) -> str:
        """A file of the snapshot as the store holds it."""
        return self.git("show", f"refs/rv/snapshots/snap01:{path}")

    def ctx(self, **kw) -> ScriptContext:
        return ScriptContext(
            remote_root=str(self.root), snapshot_id="snap01", project="proj", run_id=RUN, **kw
        )

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
        job_id = int(extra.pop("JOB_ID", 0)) or next(_job_ids)
        path = self.run_dir / "job.sbatch"
        path.write_text(script)
        result = subprocess.run(
            [BASH, str(path)],
            env=self.env(job_id, **extra),
            cwd=self.base,
            capture_output=True,
            timeout=timeout,
        )
        return result, job_id

    def record(self, segment: int = 1) -> dict:
        return json.loads((self.run_dir / "seg" / f"{segment}.json").read_text())

    def ended(self) -> dict | None:
        path = self.run_dir / "ENDED"
        return json.loads(path.read_text()) if path.exists() else None

    def sbatch_calls(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("sbatch-*.json"))]

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
    "${RV_STOP_SIGNAL}",
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
        f"--node_rank={node}",
        "--nproc_per_node=2",
        "--master_addr=10.1.2.3",
        f"--master_port={15000 + job_id % 15000}",
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


def test_srun_one_task_per_node_with_per_node_logs(box):
    req = build_request(CATALOG, command=["torchrun", "t.py"], gpus=4, gpu_type="a6000", nodes=2, name="r")
    _, job_id = box.run(render_script(req, box.ctx()))
    line = (box.out / "srun.log").read_text().splitlines()[0]
    assert line.startswith(
        "--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append "
    )
    logs = box.run_dir / "logs"
    # Named by the job as rv knows it (an array task's is ARRAY_TASK, which srun's %j is not).
    assert f"--output={logs}/{job_id}-node%n.out --error={logs}/{job_id}-node%n.err" in line
    assert line.endswith(f'bash -c rv_task "$@" rv-task 1 1 {job_id}')  # labelled ranks under a launcher


def program(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_crash_ends_the_run_with_the_programs_exit_code(box):
    req = build_request(CATALOG, command=program("import sys; sys.exit(7)"), gpu_type="a6000", name="r")
    result, job_id = box.run(render_script(req, box.ctx()))
    assert result.returncode == 7
    assert "rv: run r ended after segment 1: crashed (exit code 7)" in result.stdout.decode()
    record = box.record()
    assert (record["state"], record["reason"], record["exit_code"], record["job_id"]) == (
        "ended", "crashed", 7, str(job_id)
    )  # fmt: skip
    assert box.ended() == {"reason": "crashed", "exit_code": 7, "segment": 1, "end": record["end"]}
    assert (box.run_dir / "seg" / "1.job").read_text() == f"{job_id}\n"
    assert not box.sbatch_calls()


def test_outputs_are_copied_even_when_the_program_fails(box):
    code = """
        import os, sys
        os.makedirs("runs/exp1", exist_ok=True)
        open("runs/exp1/metrics.json", "w").write("{}")
        open("model.pt", "w").write("weights")
        sys.exit(3)
    """
    req = build_request(
        CATALOG, command=program(code), gpu_type="a6000", outputs=["runs/exp1", "model.pt", "missing.txt"],
        name="exp",
    )  # fmt: skip
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 3
    out = box.root / "outputs" / "proj" / "exp"
    assert (out / "runs" / "exp1" / "metrics.json").read_text() == "{}"
    assert (out / "model.pt").read_text() == "weights"
    assert "rv: warning: output missing.txt not found" in result.stdout.decode()


def test_output_patterns_copy_every_match_and_say_when_none_matched(box):
    code = """
        import os
        os.makedirs("out/sub dir", exist_ok=True)
        for name in ("a.pt", "b.pt", "notes.txt", "sub dir/c.pt"):
            open(os.path.join("out", name), "w").write(name)
    """
    req = build_request(
        CATALOG, command=program(code), gpu_type="a6000", outputs=["out/*.pt", "out/**/c.pt", "ckpt/*.bin"],
        name="exp",
    )  # fmt: skip
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 0, result.stderr.decode()
    out = box.root / "outputs" / "proj" / "exp"
    copied = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert copied == ["out/a.pt", "out/b.pt", "out/sub dir/c.pt"]  # a space in a match is no split
    assert "rv: warning: output pattern ckpt/*.bin matched nothing in the work dir" in result.stdout.decode()


def test_work_dir_is_a_private_copy_the_job_may_edit(box):
    # A job that makes its files writable and edits them changes neither the store nor other runs.
    code = """
        import os
        open("new.txt", "w").write("mine")
        os.chmod("train.py", 0o644)
        open("train.py", "a").write("edited\\n")
        print(open("pkg/data.txt").read(), end="")
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 0, result.stderr.decode()
    work = box.run_dir / "work"
    assert (work / "new.txt").read_text() == "mine"
    assert (work / "train.py").read_text() == "print('hi')\nedited\n"
    assert box.stored("train.py") == "print('hi')"  # the store's file is as it was
    assert box.git("ls-tree", "--name-only", "refs/rv/snapshots/snap01") == "pkg\ntrain.py"
    assert box.git("fsck", "--no-dangling") == ""  # and the store is sound
    assert stat.S_IMODE((work / "pkg" / "data.txt").stat().st_mode) & 0o200  # the copy is the user's
    assert "from the snapshot" in result.stdout.decode()


def write_secrets(box) -> Path:
    secrets = box.run_dir / "secrets.env"
    secrets.write_text("export HF_TOKEN='hf_s3cr3t value'\n")
    secrets.chmod(0o600)
    return secrets


def test_secrets_are_loaded_and_removed_when_the_run_ends(box):
    secrets = write_secrets(box)
    code = "import os, json; print(json.dumps(os.environ['HF_TOKEN']))"
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    script = render_script(req, box.ctx(has_secrets=True))
    assert "s3cr3t" not in script
    result, _ = box.run(script)
    assert result.returncode == 0, result.stderr.decode()
    assert '"hf_s3cr3t value"' in result.stdout.decode()
    assert not secrets.exists()
    assert "s3cr3t" not in (box.run_dir / "submit.env").read_text()


def test_a_secret_never_overrides_what_rv_or_the_jobs_shell_own(box):
    # rv env refuses such names; a secrets file that has them anyway (written by an older rv) must not
    # break the job: they are ignored with a warning, rv's values and PATH stay, the others arrive.
    secrets = box.run_dir / "secrets.env"
    secrets.write_text(
        render_env_file({"PATH": "/nonexistent", "RV_RUN_NAME": "hijacked", "MY_TOKEN": "t0k"})
    )
    secrets.chmod(0o600)
    code = "import os, json; print(json.dumps([os.environ['RV_RUN_NAME'], os.environ['MY_TOKEN']]))"
    req = build_request(CATALOG, command=program(code), gpus=0, name="mine")
    result, _ = box.run(render_script(req, box.ctx(has_secrets=True)))
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert '["mine", "t0k"]' in result.stdout.decode()
    assert "rv: warning: secret PATH ignored" in err and "secret RV_RUN_NAME ignored" in err
    assert "MY_TOKEN ignored" not in err


def test_a_step_before_the_program_that_fails_is_recorded_with_its_error(box):
    # The checkpoint folder cannot be made (a file is in the way): the record names the step and
    # the error, and the run ends as failed, not as lost.
    (box.root / "checkpoints").write_text("a file where a folder should be\n")
    req = build_request(CATALOG, command=["true"], gpus=0, name="mine")
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 1
    reason = box.ended()["reason"]
    assert reason.startswith(
        "failed before the program started: making the checkpoint and output folders: mkdir"
    )
    assert box.record()["state"] == "ended" and box.record()["reason"] == reason


def test_the_programs_environment_is_saved_for_rv_ssh_and_gone_with_the_job(box):
    write_secrets(box)
    # The program copies the file as it finds it (the job removes it as it ends: it holds secrets).
    code = """
        import os, shutil
        path = os.environ["RV_JOB_DIR"] + "/env.sh"
        shutil.copy(path, os.environ["RV_TEST_OUT"] + "/env.sh")
        print("mode", oct(os.stat(path).st_mode & 0o777))
    """
    setup = ["export FROM_SETUP='a b$c'", "cd pkg", "helper() { echo helped; }; export -f helper"]
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", setup=setup)
    # The env-build hook (project environments, issue 11) reaches the shells by the same path.
    context = box.ctx(has_secrets=True, env_build=("export FROM_HOOK=built",))
    result, job_id = box.run(render_script(req, context), TERM="xterm-test", SLURM_STEP_ID="7", PS1="$ ")
    assert result.returncode == 0, result.stderr.decode()
    assert "mode 0o600" in result.stdout.decode()
    saved = (box.out / "env.sh").read_text()
    # Slurm's per-job and per-step values, the terminal and the prompt belong to the attaching shell.
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NODEID", "TERM", "PS1"):
        assert f"export {name}=" not in saved, name
    # A fresh shell that sources it (as rv ssh's does) has what the program had, where it had it.
    shell = subprocess.run(
        [BASH, "-c", '. "$1"; printf "%s|" "$FROM_SETUP" "$FROM_HOOK" "$HF_TOKEN" "$RV_RUN_ID" "$PWD" '
         '"$(helper)"', "x", str(box.out / "env.sh")],
        env={"PATH": os.environ["PATH"], "HOME": str(box.base)}, capture_output=True, text=True,
    )  # fmt: skip
    assert shell.stdout == f"a b$c|built|hf_s3cr3t value|{RUN}|{box.run_dir}/work/pkg|helped|", shell.stderr
    assert not (box.run_dir / "jobs" / str(job_id) / "env.sh").exists()


def test_missing_secrets_file_fails_before_the_program(box):
    req = build_request(CATALOG, command=program("print('ran')"), gpu_type="a6000")
    result, _ = box.run(render_script(req, box.ctx(has_secrets=True)))
    assert result.returncode == 1
    assert "secrets.env is missing" in result.stderr.decode()
    assert "ran" not in result.stdout.decode()
    assert box.record()["reason"].startswith("failed before the program started: the secrets file")


def test_a_requeue_keeps_secrets_and_work_dir_and_the_rerun_finds_them(box):
    secrets = write_secrets(box)
    code = (
        "import os; open('count.txt','a').write('x'); "
        "print('count', open('count.txt').read(), os.environ['HF_TOKEN'])"
    )
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    script = render_script(req, box.ctx(has_secrets=True))
    # Slurm is requeueing this job (node failure, preemption, scontrol requeue): Restarts went up.
    first, job_id = box.run(script, FAKE_RESTARTS="1")
    assert "count x" in first.stdout.decode()
    assert box.record()["state"] == "requeued" and box.ended() is None and secrets.exists()
    again, _ = box.run(script, JOB_ID=str(job_id), SLURM_RESTART_COUNT="1", FAKE_RESTARTS="1")
    assert "count xx hf_s3cr3t value" in again.stdout.decode()  # same work dir, secrets still there
    record = box.record()
    assert (record["state"], record["reason"], record["attempt"]) == ("ended", "finished", 1)
    assert box.ended()["exit_code"] == 0 and not secrets.exists()


def test_a_requeue_restores_work_dir_files_a_purge_took(box):
    # The run's work dir lives on the scratch filesystem too: a file purged between two attempts (or
    # segments) comes back from the store before the program starts again.
    code = "import os; print('data', open('pkg/data.txt').read().strip(), len(os.listdir('.')))"
    req = build_request(CATALOG, command=program(code), gpu_type="a6000")
    script = render_script(req, box.ctx())
    first, job_id = box.run(script, FAKE_RESTARTS="1")
    assert "data from the snapshot" in first.stdout.decode()
    (box.run_dir / "work" / "pkg" / "data.txt").unlink()
    again, _ = box.run(script, JOB_ID=str(job_id), SLURM_RESTART_COUNT="1", FAKE_RESTARTS="1")
    assert "data from the snapshot" in again.stdout.decode(), again.stderr.decode()
    assert "1 file(s) of the snapshot are missing from the work dir" in again.stderr.decode()


def test_a_store_that_lost_a_file_stops_the_job_before_its_program(box):
    # A purge took the loose object of one file (the Sandbox's store keeps objects loose): the job
    # names the file and the fix, and never starts the program.
    oid = box.git("rev-parse", "refs/rv/snapshots/snap01:pkg/data.txt")
    (box.store / "objects" / oid[:2] / oid[2:]).unlink()
    req = build_request(CATALOG, command=program("print('the program ran')"), gpu_type="a6000")
    result, _ = box.run(render_script(req, box.ctx()))
    err = result.stderr.decode()
    assert result.returncode != 0 and "the program ran" not in result.stdout.decode()
    assert "the store lost 1 file(s) of snapshot snap01" in err and "pkg/data.txt" in err, err
    assert "run `rv run` again from your machine" in err
    assert "the store lost 1 file(s)" in box.record()["reason"]
    assert not (box.run_dir / "work").exists()  # no work dir with a hole is left for a later attempt


def test_a_store_that_lost_a_folder_listing_stops_the_job_too(box):
    oid = box.git("rev-parse", "refs/rv/snapshots/snap01:pkg")  # the tree of pkg/
    (box.store / "objects" / oid[:2] / oid[2:]).unlink()
    req = build_request(CATALOG, command=program("print('the program ran')"), gpu_type="a6000")
    result, _ = box.run(render_script(req, box.ctx()))
    err = result.stderr.decode()
    assert result.returncode != 0 and "the program ran" not in result.stdout.decode()
    assert "the store lost 1 object(s) of snapshot snap01, its folders' listings among them" in err, err


STOPPER = """
    import json, os, signal, sys, time
    ckpt = os.environ["RV_CHECKPOINT_DIR"]
    got = []
    if os.environ.get("HANDLE", "1") == "1":
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    print("stop signal", os.environ["RV_STOP_SIGNAL"], flush=True)
    deadline = time.time() + float(os.environ.get("RUN_FOR", "20"))
    while not got and time.time() < deadline:
        time.sleep(0.05)
    if got:
        step = int(os.environ.get("STEP", "40"))
        if os.environ.get("MARKER") == "bare":
            open(os.path.join(ckpt, "PREEMPTED"), "w").write("%d\\n" % step)
        elif os.environ.get("MARKER") == "none":
            open(os.path.join(ckpt, "weights-%d" % step), "w").write("w")
            open(os.path.join(ckpt, "PREEMPTED"), "w").write("")
        else:
            open(os.path.join(ckpt, "PREEMPTED"), "w").write(json.dumps({"step": step, "reason": "USR1"}))
        print("saved and stopped", flush=True)
    else:
        print("ran to the end", flush=True)
"""


def stopper(box, secrets=False, **kw):
    kw.setdefault("time", "10m")
    req = build_request(
        CATALOG, command=program(STOPPER), gpu_type="a6000", name="chain", signal="USR1@60", **kw
    )
    return render_script(req, box.ctx(has_secrets=secrets))


def test_a_clean_stop_with_progress_continues_in_a_new_job_with_the_same_environment(box):
    secrets = write_secrets(box)
    # The job's end is 30 s away and the lead 60 s: the watcher signals the program at once.
    result, job_id = box.run(stopper(box, secrets=True), FAKE_END_IN="30", SUBMITTED_WITH="login env")
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, err
    assert "saved and stopped" in out and "sent USR1 to pid(s)" in err
    assert "segment 2 is job 5001" in out
    (call,) = box.sbatch_calls()
    assert call["argv"] == [
        "--parsable", f"--dependency=afterany:{job_id}", "--kill-on-invalid-dep=yes",
        str(box.run_dir / "job.sbatch"),
    ]  # fmt: skip
    env = call["env"]
    assert env["RV_SEGMENT"] == "2" and env["SUBMITTED_WITH"] == "login env"
    assert "HF_TOKEN" not in env and "SLURM_JOB_ID" not in env and "RV_CHECKPOINT_DIR" not in env
    record = box.record()
    assert (record["reason"], record["checkpoint_step"], record["stop_sent"], record["next_job_id"]) == (
        "stopped at time limit", 40, True, "5001"
    )  # fmt: skip
    assert (box.run_dir / "seg" / "2.job").read_text() == "5001\n"
    assert box.ended() is None and secrets.exists()  # the run goes on: its secrets stay
    # Segment 2 starts from step 40: a marker with no more progress does not continue.
    second, _ = box.run(
        stopper(box, secrets=True), FAKE_END_IN="30", RV_SEGMENT="2", STEP="40", JOB_ID="5001"
    )
    assert second.returncode == 0
    record = box.record(2)
    assert record["start_step"] == 40
    assert (
        record["reason"]
        == "stopped at time limit with no progress (step 40, as when it started): not continued"
    )
    assert len(box.sbatch_calls()) == 1 and box.ended()["exit_code"] == 1 and not secrets.exists()


def test_a_plain_program_is_never_signalled_early(box):
    # No handler for USR1: at the lead time the watcher sends nothing, and says so.
    result, _ = box.run(stopper(box), FAKE_END_IN="30", HANDLE="0", RUN_FOR="1.5")
    assert result.returncode == 0, result.stderr.decode()
    assert "ran to the end" in result.stdout.decode()
    assert "no process handles USR1; the program runs on until the limit" in result.stderr.decode()
    assert box.record()["reason"] == "finished" and box.record()["stop_sent"] is False
    assert box.ended()["exit_code"] == 0


@pytest.mark.parametrize(
    "squeue", [{"FAKE_END_IN": "3600"}, {"FAKE_SQUEUE_FAIL": "1"}], ids=["far off", "no answer"]
)
def test_no_signal_before_the_lead_time_or_on_a_guess(box, squeue):
    # No answer from squeue once read as "ends at midnight today" (`date -d ""`): a signal at once.
    result, _ = box.run(stopper(box), RUN_FOR="1.5", **squeue)
    assert "ran to the end" in result.stdout.decode()
    assert "before the time limit" not in result.stderr.decode()
    assert box.record()["stop_sent"] is False


@pytest.mark.parametrize(
    ("marker", "env", "ended_because"),
    [
        ("bare", {}, None),  # a bare step number is enough
        ("none", {}, None),  # no step: something new in the checkpoint folder counts as progress
        ("json", {"RV_SEGMENT": "10"}, "all 10 segments used"),  # --max-segments (10) reached
        # sbatch refused: the run ends, and says why
        ("json", {"FAKE_SBATCH_FAIL": "1"}, "could not be submitted: sbatch: error: QOSMax"),
    ],
)
def test_when_a_stop_continues(box, marker, env, ended_because):
    write_secrets(box)
    result, _ = box.run(stopper(box, secrets=True), FAKE_END_IN="30", MARKER=marker, **env)
    assert result.returncode == 0, result.stderr.decode()
    ended = box.ended()
    segment = int(env.get("RV_SEGMENT", "1"))
    if ended_because is None:
        assert ended is None and box.record(segment)["next_job_id"] == "5001"
    else:
        assert ended is not None and ended["exit_code"] == 1
        assert ended_because in box.record(segment)["reason"]


def test_rv_stop_ends_the_run_and_a_late_successor_is_cancelled(box):
    write_secrets(box)
    (box.run_dir / "STOP").write_text("now\n")
    box.run(stopper(box, secrets=True), FAKE_END_IN="30")
    assert box.record()["reason"] == "cancelled by rv stop" and not box.sbatch_calls()
    assert box.ended()["reason"] == "cancelled by rv stop"


def test_a_job_that_starts_after_rv_stop_marked_the_run_ends_without_the_program(box):
    # rv stop writes STOP in every run, then cancels their jobs: a job starting in between (a sweep's
    # array task whose slot another point freed) must not run the program.
    touched = box.base / "ran"
    req = build_request(CATALOG, command=["touch", str(touched)], gpu_type="a6000", name="r")
    (box.run_dir / "STOP").write_text("now\n")
    result, _ = box.run(render_script(req, box.ctx()))
    assert not touched.exists(), result.stdout.decode()
    assert (
        box.ended()["reason"] == "cancelled by rv stop" and box.record()["reason"] == "cancelled by rv stop"
    )


def test_an_array_task_is_known_by_its_array_name(box):
    # A sweep's point runs first as task 4 of array 7000: squeue -r, sacct and scancel call it
    # 7000_4, and so do its records, job folder and (the array's --output) its logs.
    req = replace(
        build_request(CATALOG, command=program("print('hi')"), gpu_type="a6000", name="sw"), name="sw/4"
    )
    result, _ = box.run(render_script(req, box.ctx()), SLURM_ARRAY_JOB_ID="7000", SLURM_ARRAY_TASK_ID="4")
    assert result.returncode == 0, result.stderr.decode()
    assert (box.run_dir / "seg" / "1.job").read_text() == "7000_4\n"
    assert box.record()["job_id"] == "7000_4" and (box.run_dir / "jobs" / "7000_4").is_dir()
    assert "rv: run sw/4, segment 1/10: job 7000_4 on" in result.stdout.decode()


def test_stop_written_while_submitting_cancels_the_new_segment(box):
    # rv stop writes STOP, then cancels the jobs it finds: a segment submitting its successor in
    # between must cancel that successor itself.
    stub = box.stubs / "sbatch"
    stub.write_text(
        stub.read_text().replace(
            'echo "$((${FAKE_NEXT_JOB', f'touch {box.run_dir}/STOP; echo "$((${{FAKE_NEXT_JOB'
        )
    )
    box.run(stopper(box), FAKE_END_IN="30")
    assert (box.out / "scancel.log").read_text() == "5001\n"
    assert "cancelled by rv stop" in box.record()["reason"] and box.ended() is not None


def test_time_limit_without_a_marker_ends_the_run(box):
    box.run(stopper(box), HANDLE="0", RUN_FOR="0.2", FAKE_REASON="TimeLimit")
    assert box.record()["reason"] == "time limit" and box.ended()["exit_code"] == 1


def test_term_runs_the_exit_trap_as_a_cancel(box):
    secrets = write_secrets(box)
    code = f"""
        import time
        open("partial.txt", "w").write("so far")
        open({str(box.out / "started")!r}, "w").close()
        time.sleep(30)
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", outputs=["partial.txt"], name="t")
    path = box.run_dir / "job.sbatch"
    path.write_text(render_script(req, box.ctx(has_secrets=True)))
    # scancel signals every process of the job; a process group stands in for that.
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
    assert (box.root / "outputs" / "proj" / "t" / "partial.txt").read_text() == "so far"
    assert box.record()["reason"] == "cancelled" and box.ended()["exit_code"] == 143
    assert b"ended after segment 1: cancelled (exit code 143)" in stdout


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
    assert box.record()["reason"] == "failed before the program started: setup line 2 failed with exit code 5"


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
    req = build_request(CATALOG, command=program(PRECISION), gpus=0, name="cpu")
    result, job_id = box.run(render_script(req, box.ctx()))
    assert "P no no None" in result.stdout.decode()
    assert (
        f"rv: run cpu, segment 1/10: job {job_id} on node[1-2], 1 node(s), CPU only" in result.stdout.decode()
    )


def test_a_half_metrics_line_a_killed_segment_left_is_ended_before_the_program_writes(box):
    # A segment killed mid-write leaves `{"step": 7, "lo` without a newline: the next segment's first
    # line must start a line of its own, or a reader loses both.
    code = """
        import json, os
        with open(os.environ["RV_METRICS"], "a") as fh:
            fh.write(json.dumps({"step": 8, "loss": 0.5}) + "\\n")
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", name="exp")
    metrics = box.root / "outputs" / "proj" / "exp" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"step": 6, "loss": 0.7}\n{"step": 7, "lo')
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 0, result.stderr.decode()
    assert metrics.read_text().splitlines() == [
        '{"step": 6, "loss": 0.7}',
        '{"step": 7, "lo',
        '{"step": 8, "loss": 0.5}',
    ]
    # A file that ends with its newline is left as it is.
    result, _ = box.run(render_script(req, box.ctx()))
    assert metrics.read_text().count("\n") == 4 and "\n\n" not in metrics.read_text()


def test_environment_paths_and_master_port(box):
    code = """
        import os
        for k in ["RV_JOB_DIR", "RV_WORK_DIR", "RV_OUTPUT_DIR", "RV_CHECKPOINT_DIR", "HF_HOME", "WANDB_DIR",
                  "MASTER_PORT", "MASTER_ADDR", "RV_SNAPSHOT", "PYTHONUNBUFFERED", "RV_RUN_ID", "RV_RUN_NAME",
                  "RV_SEGMENT", "RV_MAX_SEGMENTS", "RV_STOP_SIGNAL", "RV_METRICS"]:
            print(k, os.environ[k])
        print("cwd", os.getcwd())
        print("exported_functions", [k for k in os.environ if k.startswith("BASH_FUNC")])
    """
    req = build_request(CATALOG, command=program(code), gpu_type="a6000", name="exp")
    result, job_id = box.run(render_script(req, box.ctx()))
    lines = dict(line.split(" ", 1) for line in result.stdout.decode().splitlines() if " " in line)
    run_dir = str(box.run_dir)
    assert lines["RV_JOB_DIR"] == f"{run_dir}/jobs/{job_id}"
    assert lines["RV_WORK_DIR"] == f"{run_dir}/work"
    assert lines["RV_OUTPUT_DIR"] == f"{box.root}/outputs/proj/exp"
    assert lines["RV_CHECKPOINT_DIR"] == f"{box.root}/checkpoints/proj/exp"
    assert lines["RV_METRICS"] == f"{box.root}/outputs/proj/exp/metrics.jsonl"
    assert lines["HF_HOME"] == f"{box.root}/cache/hf"
    assert lines["WANDB_DIR"] == f"{box.root}/cache/wandb"
    assert lines["MASTER_PORT"] == str(15000 + job_id % 15000)
    assert lines["MASTER_ADDR"] == "10.1.2.3"  # NodeAddr of the first node, not its name
    assert lines["RV_SNAPSHOT"] == "snap01"
    assert lines["PYTHONUNBUFFERED"] == "1"
    assert (lines["RV_RUN_ID"], lines["RV_RUN_NAME"], lines["RV_SEGMENT"]) == (RUN, "exp", "1")
    assert (lines["RV_MAX_SEGMENTS"], lines["RV_STOP_SIGNAL"]) == ("10", "USR1")
    assert lines["exported_functions"] == "[]"  # rv's own shell functions do not leak into the program
    assert os.path.realpath(lines["cwd"]) == os.path.realpath(run_dir + "/work")


def test_user_cache_setting_wins(box):
    req = build_request(
        CATALOG, command=program("import os; print('HF', os.environ['HF_HOME'])"), gpu_type="a6000"
    )
    result, _ = box.run(render_script(req, box.ctx()), HF_HOME="/datasets/hf")
    assert "HF /datasets/hf" in result.stdout.decode()


def test_plain_command_on_several_nodes_runs_once_per_node(box):
    code = "import json, os, sys; print('node', os.environ['SLURM_NODEID'], json.dumps(sys.argv[1:]))"
    req = build_request(
        CATALOG, command=[*program(code), *NASTY], gpus=4, gpu_type="v100", nodes=2, each_node=True
    )
    result, job_id = box.run(render_script(req, box.ctx()))
    assert result.returncode == 0, result.stderr.decode()
    for node in (0, 1):  # each copy's lines carry its node as its rank, in its node's log
        log = (box.run_dir / "logs" / f"{job_id}-node{node}.out").read_text()
        assert log == f"[{node}] node {node} {json.dumps(NASTY)}\n"


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
    req = build_request(CATALOG, command=program(code), gpus=4, gpu_type="v100", nodes=2, each_node=True)
    result, job_id = box.run(render_script(req, box.ctx()))
    assert result.returncode == expected, result.stderr.decode()
    for node, node_code in enumerate(codes):
        assert (box.run_dir / "jobs" / str(job_id) / f"node{node}.exit").read_text() == f"{node_code}\n"


def test_task_shell_outlives_slurms_signal_and_the_program_gets_it(box):
    # Slurm signals every process of a step (killpg or the whole process tree); the task's shell
    # must survive it to record the exit code, and the program must still see the signal.
    code = f"""
        import os, signal, sys, time
        got = []
        signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
        open({str(box.out)!r} + "/pgid-" + os.environ["SLURM_NODEID"], "w").write(str(os.getpgid(0)))
        deadline = time.time() + 20
        while not got and time.time() < deadline:
            time.sleep(0.05)
        print("node", os.environ["SLURM_NODEID"], "got USR2" if got else "no signal", flush=True)
        sys.exit(0 if got else 9)
    """
    req = build_request(CATALOG, command=program(code), gpus=4, gpu_type="v100", nodes=2, each_node=True)
    path = box.run_dir / "job.sbatch"
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
        os.killpg(int(pgid_file.read_text()), signal.SIGUSR2)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, stdout
    for node in (0, 1):  # through the rank labeller, which outlives the signal too
        log = (box.run_dir / "logs" / f"5150-node{node}.out").read_text()
        assert log == f"[{node}] node {node} got USR2\n"
    assert (box.run_dir / "jobs" / "5150" / "node1.exit").read_text() == "0\n"


def test_the_stop_signal_goes_to_workers_never_to_a_launcher(box):
    # A torchrun-like agent that would die (and print a traceback) on USR1, over a worker that saves.
    agent = box.stubs / "torchrun"
    agent.write_text(
        f"#!{sys.executable}\n"
        "import os, signal, subprocess, sys\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (print('AGENT GOT USR1', flush=True), sys.exit(1)))\n"
        f"sys.exit(subprocess.call([{sys.executable!r}, '-c', {textwrap.dedent(STOPPER)!r}]))\n"
    )
    req = build_request(CATALOG, command=["torchrun", "w.py"], gpus=2, gpu_type="a6000", signal="USR1@60")
    result, _ = box.run(render_script(req, box.ctx()), FAKE_END_IN="30")
    out = result.stdout.decode()
    assert "saved and stopped" in out and "AGENT GOT USR1" not in out
    assert result.returncode == 0 and box.record()["reason"] == "stopped at time limit"


def test_the_stop_watcher_ends_with_the_program_however_soon_and_leaves_nothing_behind(box, tmp_path):
    # The program ending at once ends the watcher at any point of its loop. With a TERM trap and
    # `sleep &`, a TERM between `sleep &` and `sleeper=$!` left a sleep holding the job's output open
    # for a minute (a flaky hang of the property tests above), and under load bash 5.2 lost the trap
    # itself, so the watcher lived on and rv_task waited for it. The watcher and rv_task's lines
    # that end it, thousands of times, run into neither.
    lines = job_runtime().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("rv_stop_watch() {")))
    watcher = "\n".join(lines[start : lines.index("}", start) + 1])
    end_it = "; ".join(
        line.strip() for line in lines if '"$watcher"' in line and line.strip().startswith(("kill", "wait"))
    )
    assert end_it.count("$watcher") == 2, end_it
    loop = f"for i in $(seq 3000); do rv_stop_watch 1 & watcher=$!; {end_it}; done"
    bindir = tmp_path / "bin"  # no squeue: the watcher waits its full minute between questions
    bindir.mkdir()
    for tool in ("bash", "date", "sed", "seq", "env"):
        (bindir / tool).symlink_to(shutil.which(tool))
    proc = subprocess.Popen(["bash", "-c", f"{watcher}\n{loop}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={"PATH": str(bindir)})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=45)  # what a watcher leaves holds the pipes 60 s
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a watcher, or a sleep of one, outlived its end, holding the output open")
    assert proc.returncode == 0 and out == b"" and err == b""


def test_the_job_writes_its_records_in_the_one_format(box):
    from rv.agent.segment import ENDED_FIELDS, SEGMENT_FIELDS, segment_record

    result, _ = box.run(render_script(build_request(CATALOG, command=["true"], gpus=0), box.ctx()))
    assert result.returncode == 0, result.stderr
    record = json.loads((box.run_dir / "seg" / "1.json").read_text())
    assert tuple(record) == SEGMENT_FIELDS  # the job's writer: the same keys, in the same order
    assert tuple(json.loads((box.run_dir / "ENDED").read_text())) == ENDED_FIELDS
    assert tuple(segment_record(2, "7", "ended", "cancelled by rv stop", 1.0)) == SEGMENT_FIELDS


def test_the_job_and_the_contract_agree_on_the_precision_rule():
    from rv.contract import BF16_MIN_MAJOR

    assert f'"${{RV_GPU_CC%%.*}}" -ge {BF16_MIN_MAJOR} ]' in job_runtime()


def test_the_job_refuses_the_secret_names_rv_env_refuses():
    from rv.secrets import RESERVED_GLOBS

    text = job_runtime()
    body = text[text.index("rv_reserved_name() {") :]
    pattern = body[body.index('case "$1" in') + len('case "$1" in') : body.index(")\n")]
    globs = {g.strip() for g in pattern.replace("\\\n", " ").split("|")}
    assert globs == {*RESERVED_GLOBS, "rv_*"}


# --- a run sent once per GPU type -----------------------------------------------------------------

RAN = """
import os
with open(os.path.join(os.environ["RV_TEST_OUT"], "ran.txt"), "a") as f:
    f.write(os.environ["SLURM_JOB_ID"] + "\\n")
"""


def test_the_first_job_of_a_segment_sent_per_type_takes_it_and_the_other_never_runs_the_program(box):
    req = build_request(CATALOG, command=program(RAN), gpu_type="a6000", name="r")
    (box.run_dir / "seg" / "1.candidates").write_text("7001 a6000\n7002 v100\n")
    script = render_script(req, box.ctx())
    first, _ = box.run(script, JOB_ID="7002")  # the v100 job starts first
    assert first.returncode == 0, first.stderr.decode()
    assert (box.out / "ran.txt").read_text() == "7002\n"
    assert (box.out / "scancel.log").read_text() == "7001\n"  # the other one, cancelled
    assert (box.run_dir / "seg" / "1.job").read_text() == "7002\n" and box.record()["job_id"] == "7002"
    second, _ = box.run(script, JOB_ID="7001")  # the a6000 job starts anyway (scancel came late)
    assert second.returncode == 0 and "ends without running the program" in second.stdout.decode()
    assert (box.out / "ran.txt").read_text() == "7002\n"  # once
    assert box.record()["job_id"] == "7002" and not (box.run_dir / "jobs" / "7001").exists()
    # Slurm requeues the job that took it: the claim is its own, the program runs again as a requeue.
    again, _ = box.run(script, JOB_ID="7002", SLURM_RESTART_COUNT="1")
    assert again.returncode == 0 and (box.out / "ran.txt").read_text() == "7002\n7002\n"


def test_the_next_segment_of_a_run_sent_per_type_is_sent_per_type_again(box):
    script = stopper(box)
    for name in ("job.1.sbatch", "job.2.sbatch"):
        (box.run_dir / name).write_text(script)
    (box.run_dir / "candidates").write_text("job.1.sbatch a6000\njob.2.sbatch v100\n")
    result, job_id = box.run(script, FAKE_END_IN="30")
    assert result.returncode == 0, result.stderr.decode()
    calls = [c["argv"] for c in box.sbatch_calls()]
    assert [c[-1] for c in calls] == [str(box.run_dir / "job.1.sbatch"), str(box.run_dir / "job.2.sbatch")]
    assert all(f"--dependency=afterany:{job_id}" in c for c in calls)
    assert (box.run_dir / "seg" / "2.candidates").read_text() == "5001 a6000\n5002 v100\n"
    assert (box.run_dir / "seg" / "2.job").read_text() == "5001\n"


# --- a GPU that fails under the program ------------------------------------------------------------

# Saves, then dies of a GPU fault. Slurm would write its stderr into the job's log; the sandbox has
# no Slurm, so the program appends the line there itself.
FAULTY = """
import os, sys
d = os.environ["RV_CHECKPOINT_DIR"]
os.makedirs(os.path.join(d, "step_10"), exist_ok=True)
open(os.path.join(d, "step_10", "COMPLETE"), "w").close()
log = os.path.join(os.environ["RV_RUN_DIR"], "logs", os.environ["SLURM_JOB_ID"] + ".err")
with open(log, "a") as f:
    f.write("Traceback (most recent call last):\\nRuntimeError: CUDA error: unknown error\\n")
sys.exit(1)
"""


def test_a_gpu_fault_continues_the_run_without_that_node_a_bounded_number_of_times(box):
    req = build_request(CATALOG, command=program(FAULTY), gpu_type="a6000", name="r")
    place = build_placement(exclude="node9", max_fault_retries=1)
    script = render_script(req, box.ctx(placement=place))
    first, _ = box.run(script, SLURMD_NODENAME="node1")
    assert first.returncode == 1
    reason = box.record()["reason"]
    assert reason == (
        "gpu fault on node1 (RuntimeError: CUDA error: unknown error): continued without node1 "
        "(fault retry 1/1)"
    )
    (call,) = box.sbatch_calls()
    assert "--exclude=node1,node9" in call["argv"]  # the fault's node and the user's own
    assert box.ended() is None and (box.run_dir / "faults").read_text().startswith("1\tnode1\t")
    # The same fault again: no retries left, the run ends as crashed.
    second, _ = box.run(script, RV_SEGMENT="2", JOB_ID="5001", SLURMD_NODENAME="node2")
    assert second.returncode == 1
    assert box.ended()["reason"].startswith("crashed: gpu fault on node2") and len(box.sbatch_calls()) == 1
    assert "no fault retries left (--max-fault-retries 1)" in box.ended()["reason"]


def test_a_plain_crash_never_continues(box):
    req = build_request(CATALOG, command=program("import sys; print('ValueError: bad'); sys.exit(3)"),
                        gpu_type="a6000", name="r")  # fmt: skip
    result, _ = box.run(render_script(req, box.ctx()))
    assert result.returncode == 3 and box.ended()["reason"] == "crashed" and box.sbatch_calls() == []


# --- notifications: once per run, from the job that ends it -----------------------------------------


def test_only_the_job_that_ends_the_run_asks_for_mail_and_posts(box):
    # A chain of two segments with --notify mail and a webhook: segment 1 continues (no word at all),
    # segment 2 ends the run (Slurm's mail asked for once; the notifier run once, for the end).
    secrets = write_secrets(box)  # the hook's secret is not among them: the notifier says so, once
    req = build_request(CATALOG, command=program(STOPPER), gpu_type="a6000", name="chain", signal="USR1@60")
    script = render_script(req, box.ctx(has_secrets=True, notify=("mail:me@example.org", "secret:MY_HOOK")))
    assert "rv_notify_mail=me@example.org rv_notify_hooks=MY_HOOK" in script
    first, _ = box.run(script, FAKE_END_IN="30")
    assert first.returncode == 0, first.stderr.decode()
    assert "segment 2 is job 5001" in first.stdout.decode()
    assert not (box.out / "scontrol-update.log").exists()
    assert "notify" not in first.stderr.decode() + first.stdout.decode()
    second, _ = box.run(script, FAKE_END_IN="30", RV_SEGMENT="2", STEP="40", JOB_ID="5001")
    assert second.returncode == 0 and box.ended() is not None and not secrets.exists()
    assert (box.out / "scontrol-update.log").read_text() == (
        "update JobId=5001 MailType=END MailUser=me@example.org\n"
    )
    err = second.stderr.decode()
    assert err.count("rv: notify: secret MY_HOOK is not in the job's environment") == 1, err


def test_a_run_without_notify_has_no_notify_values_and_asks_for_no_mail(box):
    req = build_request(CATALOG, command=program("pass"), gpu_type="a6000", name="quiet")
    script = render_script(req, box.ctx())
    assert "rv_notify" not in script
    result, _ = box.run(script)
    assert result.returncode == 0 and not (box.out / "scontrol-update.log").exists()
