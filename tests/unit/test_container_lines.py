"""rv run --container: the runtimes' command lines (against their documented options), the laptop's
checks, the batch script's program, and the cluster side's check with stand-in runtimes.

Apptainer, Singularity and Pyxis are not in Debian 12: their lines are checked here only, against
their documentation (apptainer exec: ``--nv``, ``--bind src[:dest]``, ``--pwd``, then the image and
the command; pyxis: ``srun --container-image --container-mounts --container-workdir``). Charliecloud
runs for real in tests/integration/test_container.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from rv.agent import container as adapter
from rv.catalog import RIVANNA
from rv.errors import UsageError
from rv.job.container import parse_container, resolve
from rv.request import build_request
from rv.slurm.container import DROP_HOST_VENV, Container, binds
from rv.slurm.script import ScriptContext, render_script

ROOT = "/scratch/u/rv"


def ctx(**kw) -> ScriptContext:
    kw.setdefault("remote_root", ROOT)
    kw.setdefault("snapshot_id", "snap01")
    kw.setdefault("project", "proj-1a2b3c")
    kw.setdefault("run_id", "run0a1b2")
    return ScriptContext(**kw)


def program_body(script: str) -> list[str]:
    lines = script.splitlines()
    start = lines.index("rv_program() {")
    return lines[start + 1 : lines.index("}", start)]


# --- formats and runtimes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image, fmt, auto",
    [
        ("/sw/pytorch-2.4.sif", "sif", "apptainer"),
        ("/sw/old.simg", "sif", "apptainer"),
        ("/sw/img.sqfs", "squashfs", "charliecloud"),
        ("/sw/img.squashfs", "squashfs", "charliecloud"),
        ("/sw/img/", "dir", "charliecloud"),
        ("/sw/nvidia+pytorch.sqsh", "enroot", "pyxis"),
    ],
)
def test_an_images_format_names_the_runtime_auto_takes(image, fmt, auto):
    assert adapter.image_format(image) == fmt
    assert adapter.default_runtime(image, "auto") == auto
    assert adapter.runtime_for(image, "auto", {auto: {}}) == auto


def test_auto_takes_singularity_where_apptainer_is_missing_and_none_where_neither_is():
    assert adapter.runtime_for("/a.sif", "auto", {"singularity": {}, "charliecloud": {}}) == "singularity"
    assert adapter.runtime_for("/a.sif", "auto", {"charliecloud": {}}) is None
    assert adapter.runtime_for("/a.sif", "charliecloud", {"charliecloud": {}}) == "charliecloud"
    assert adapter.runtime_for("/a.sif", "apptainer", {"singularity": {}}) is None


def test_apptainer_line_is_its_documented_exec_form():
    words = adapter.wrap_words("apptainer", "/sw/pt.sif", ["/scratch/u/rv"], '"$PWD"', gpus=True)
    assert words == ["apptainer", "exec", "--nv", "--bind", "/scratch/u/rv", "--pwd", '"$PWD"', "/sw/pt.sif"]
    # No --nv without GPUs: on a CPU node it warns that no NVIDIA driver was found.
    words = adapter.wrap_words("singularity", "/sw/a b.sif", ["/r", "/ckpt"], '"$PWD"', gpus=False)
    assert words == [
        "singularity",
        "exec",
        "--bind",
        "/r",
        "--bind",
        "/ckpt",
        "--pwd",
        '"$PWD"',
        "'/sw/a b.sif'",
    ]


def test_charliecloud_line_binds_home_and_the_root_and_ends_its_options():
    words = adapter.wrap_words("charliecloud", "/sw/img.sqfs", ["/r"], '"$PWD"', gpus=True)
    assert words == ["ch-run", "--home", "--bind=/r", '--cd="$PWD"', "/sw/img.sqfs", "--"]


def test_pyxis_options_are_srun_options():
    assert adapter.srun_words("/sw/pt.sqsh", ["/r", "/ckpt"], "/r/work") == [
        "--container-image=/sw/pt.sqsh",
        "--container-mounts=/r:/r,/ckpt:/ckpt",
        "--container-workdir=/r/work",
    ]


# --- the laptop's checks ----------------------------------------------------------------------------


def test_none_or_nothing_is_no_container():
    assert parse_container(None, None) is None
    assert parse_container("none", None) is None
    assert parse_container("$CONTAINERDIR/pytorch.sif", None) == parse_container(
        "$CONTAINERDIR/pytorch.sif", "auto"
    )


@pytest.mark.parametrize(
    "image, runtime, words",
    [
        ("pytorch.sif", None, "must be absolute"),
        ("oci-archive:///a.tar", None, "rv pulls no oci-archive:// references"),
        ("oras://ghcr.io/a/b:1", "charliecloud", "--container-runtime charliecloud does not pull oras://"),
        ("docker://", None, "names no image"),
        (None, "apptainer", "--container-runtime apptainer without --container"),
        ("/a.sif", "docker", "not a runtime rv knows"),
    ],
)
def test_what_the_laptop_refuses(image, runtime, words):
    with pytest.raises(UsageError) as e:
        parse_container(image, runtime)
    assert words in e.value.message and e.value.exit_code == 2


def test_the_clusters_refusal_becomes_a_usage_error_with_its_hint():
    spec = parse_container("/x.sif", None)
    assert spec is not None
    with pytest.raises(UsageError) as e:
        resolve(spec, {"error": "--container /x.sif: no runtime here runs a sif image", "hint": "load it"})
    assert e.value.hint == "load it" and e.value.exit_code == 2
    assert resolve(spec, {"image": "/x.sif", "runtime": "singularity", "found": {}}) == Container(
        "/x.sif", "singularity"
    )


def test_binds_are_the_root_and_the_folders_outside_it():
    assert binds("/r", ["/r/checkpoints/p/n", "/ckpt/n", "/ckpt/n/out"]) == ["/r", "/ckpt/n"]


# --- the batch script -------------------------------------------------------------------------------


def test_the_program_runs_inside_the_image_with_rvs_launcher_flags():
    req = build_request(RIVANNA, command=["torchrun", "train.py"], gpus=4, gpu_type="a6000", nodes=2)
    script = render_script(req, ctx(container=Container("/sw/pt.sif", "apptainer")))
    assert program_body(script) == [
        f"    {DROP_HOST_VENV}",
        '    exec apptainer exec --nv --bind /scratch/u/rv --pwd "$PWD" /sw/pt.sif torchrun --nnodes=2 '
        '--node_rank="$SLURM_NODEID" --nproc_per_node=2 --master_addr="$RV_HEAD_ADDR" '
        '--master_port="$MASTER_PORT" train.py',
    ]
    assert "# The program runs in apptainer image /sw/pt.sif (rv run --container)." in script
    subprocess.run(["bash", "-n"], input=script.encode(), check=True)


def test_a_checkpoint_folder_outside_the_root_is_bound_too():
    req = build_request(RIVANNA, command=["python", "t.py"], gpus=0)
    script = render_script(
        req, ctx(container=Container("/img", "charliecloud"), checkpoint_dir="/project/lab/ckpt")
    )
    assert program_body(script)[1] == (
        '    exec ch-run --home --bind=/scratch/u/rv --bind=/project/lab/ckpt --cd="$PWD" /img -- python t.py'
    )


def test_pyxis_wraps_each_nodes_task_through_srun():
    req = build_request(RIVANNA, command=["python", "t.py"], gpus=1, gpu_type="a6000")
    script = render_script(req, ctx(container=Container("/sw/pt.sqsh", "pyxis")))
    assert program_body(script) == ["    exec python t.py"]
    line = next(x for x in script.splitlines() if x.startswith("rv_srun_container="))
    assert line == (
        "rv_srun_container=(--container-image=/sw/pt.sqsh --container-mounts=/scratch/u/rv:/scratch/u/rv "
        '"--container-workdir=$PWD" "--container-name=rv-$SLURM_JOB_ID")'
    )
    subprocess.run(["bash", "-n"], input=script.encode(), check=True)


def test_without_a_container_the_script_is_unchanged():
    req = build_request(RIVANNA, command=["python", "t.py"], gpus=1, gpu_type="a6000")
    script = render_script(req, ctx())
    assert program_body(script) == ["    exec python t.py"]
    assert "rv_srun_container" not in script.split("rv_runtime=")[0]


def test_the_host_venv_leaves_path_inside_the_image():
    out = subprocess.run(
        ["bash", "-c", f'{DROP_HOST_VENV}; printf "%s|%s" "$PATH" "${{VIRTUAL_ENV-unset}}"'],
        env={"PATH": "/v/env/bin:/usr/bin:/v/env/bin:/bin", "VIRTUAL_ENV": "/v/env"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "/usr/bin:/bin|unset"


# --- the cluster side's check -----------------------------------------------------------------------


@pytest.fixture
def runtimes(tmp_path: Path) -> Path:
    """A folder of stand-in runtimes that print a version, put on PATH by a setup line."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, version in (("ch-run", "0.31"), ("singularity", "singularity-ce version 3.11.4")):
        f = bin_ / name
        f.write_text(f"#!/bin/sh\necho {shlex.quote(version)}\n")
        f.chmod(0o755)
    return bin_


def test_check_expands_the_image_after_the_setup_lines(runtimes, tmp_path):
    img = tmp_path / "images" / "pt.sif"
    img.parent.mkdir()
    img.write_text("")
    setup = [f"export PATH={runtimes}:$PATH", f"export CONTAINERDIR={img.parent}"]
    out = adapter.check("$CONTAINERDIR/pt.sif", "auto", setup)
    assert out["image"] == str(img) and out["runtime"] == "singularity"
    assert out["found"]["charliecloud"]["version"] == "0.31"
    assert adapter.check(str(img.parent), "auto", setup)["runtime"] == "charliecloud"


def test_check_refuses_a_missing_image_a_format_no_runtime_runs_and_a_missing_runtime(runtimes, tmp_path):
    setup = [f"export PATH={runtimes}:/usr/bin:/bin"]
    missing = adapter.check(str(tmp_path / "nope.sif"), "auto", setup)
    assert "no such image on the cluster" in missing["error"]
    sqsh = tmp_path / "pt.sqsh"
    sqsh.write_text("")
    out = adapter.check(str(sqsh), "auto", setup)
    assert "no runtime here runs a enroot image (it needs pyxis)" in out["error"]
    assert "runtimes found: charliecloud (0.31), singularity (singularity-ce version 3.11.4)" in out["error"]
    out = adapter.check(str(sqsh), "apptainer", setup)
    assert out["error"].startswith("--container-runtime apptainer: apptainer is not on the cluster")
    assert "module load apptainer" in out["hint"]


def test_check_says_when_the_setup_lines_fail(tmp_path):
    out = adapter.check("/x.sif", "auto", ["echo oops >&2; false"])
    assert "setup lines failed" in out["error"] and "oops" in out["error"]


def test_expand_image_leaves_this_process_environment_alone():
    before = dict(os.environ)
    assert adapter.expand_image("~/x/$A", {"HOME": "/h", "A": "b"}) == "/h/x/b"
    assert dict(os.environ) == before


def test_a_shell_of_the_job_enters_the_image_the_job_left_beside_its_environment(tmp_path):
    from rv.job.inside import ATTACH

    env_file = tmp_path / "env.sh"
    env_file.write_text("export FOO=bar\n")
    (tmp_path / "container.sh").write_text('rv_in_container() { exec env RV_INSIDE=yes "$@"; }\n')
    out = subprocess.run(
        ["bash", "-c", ATTACH, "rv-ssh", str(env_file), str(tmp_path), 'echo "$RV_INSIDE $FOO $PWD"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout == f"yes bar {tmp_path}\n"
    (tmp_path / "container.sh").unlink()  # a job without a container: as before
    out = subprocess.run(
        ["bash", "-c", ATTACH, "rv-ssh", str(env_file), str(tmp_path), 'echo "${RV_INSIDE:-no} $FOO"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout == "no bar\n"


def test_the_job_writes_how_to_enter_its_image_and_drops_the_host_venv_from_its_environment(tmp_path):
    req = build_request(RIVANNA, command=["python", "t.py"], gpus=0)
    script = render_script(req, ctx(container=Container("/img.sqfs", "charliecloud")))
    lines = script.splitlines()
    at = lines.index("rv_start")
    enter = "\n".join(lines[at + 1 : at + 4])
    # Run the lines as the job would, in a job folder of its own.
    (tmp_path / "env.sh").write_text("export X=1\n")
    job_env = {"RV_JOB_DIR": str(tmp_path), "RV_JOB_ENV_FILE": "env.sh", "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", "-c", enter], env=job_env, check=True)
    assert (tmp_path / "container.sh").read_text() == (
        'rv_in_container() { exec ch-run --home --bind=/scratch/u/rv --cd="$PWD" /img.sqfs -- "$@"; }\n'
    )
    assert (tmp_path / "env.sh").read_text() == f"export X=1\n{DROP_HOST_VENV}\n"
    pyxis = render_script(req, ctx(container=Container("/img.sqsh", "pyxis")))
    assert "container.sh" not in pyxis


def test_rv_inits_probe_lists_the_runtimes_on_the_login_path_with_versions(runtimes):
    from rv.probe import PROBE_SCRIPT, facts_from_probe

    section = PROBE_SCRIPT.split("echo @@containers\n", 1)[1].split("echo @@end", 1)[0]
    out = subprocess.run(
        ["bash", "-c", "echo @@containers\n" + section], env={"PATH": f"{runtimes}:/usr/bin:/bin"},
        capture_output=True, text=True, check=False,  # no srun here: the section's last test fails
    ).stdout  # fmt: skip
    facts = facts_from_probe("@@user\nu\n@@home\n/h\n@@commands\nsbatch\nsqueue\nsacct\n" + out + "@@end\n")
    assert facts.container_runtimes == ("singularity singularity-ce version 3.11.4", "ch-run 0.31")


def test_a_node_work_dir_is_bound_where_the_task_stands():
    req = build_request(RIVANNA, command=["python", "t.py"], gpus=1, gpu_type="a6000")
    script = render_script(req, ctx(container=Container("/img.sif", "apptainer"), work_dir="node"))
    assert program_body(script)[1] == (
        '    exec apptainer exec --nv --bind /scratch/u/rv --bind "$PWD" --pwd "$PWD" /img.sif python t.py'
    )
    assert '--bind "$PWD" --pwd "$PWD" /img.sif "$@"; }' in script  # rv ssh enters the same way
