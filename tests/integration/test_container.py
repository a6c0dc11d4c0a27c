"""Issue 43 on the real clusters: `rv run --container` with Charliecloud's ch-run, on both layouts.

The image is scripts/testcluster's: a minimal Debian 12 with its own python3 and torch 1.13 (the
jobs' venv has torch 2.13) and a file only it has, /etc/rv-test-image, as a directory
(RV_TESTCLUSTER_IMAGE) and as SquashFS (RV_TESTCLUSTER_IMAGE_SQFS, mounted by ch-run through
squashfuse). Jobs run as the non-root cluster user: ch-run is unprivileged (user namespaces).
Apptainer, Singularity and Pyxis are not in Debian 12: tests/unit/test_container_lines.py checks their lines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from projects import git_project, wait_for
from test_store import ended, run_folder

HOST_TORCH = "2.13.0"  # the jobs' venv (scripts/testcluster's PYENV_PACKAGES)
IMAGE_TORCH = "1.13"  # Debian 12's python3-torch, the image's


def image(layout, fmt: str = "dir") -> str:
    key = "RV_TESTCLUSTER_IMAGE" if fmt == "dir" else "RV_TESTCLUSTER_IMAGE_SQFS"
    path = layout.cluster.get(key)
    assert path and Path(path).exists(), f"{key} missing: scripts/testcluster up builds the test image"
    return path


INSIDE = """\
import os, sys, torch
print("marker", open("/etc/rv-test-image").read().split()[:3], flush=True)
print("torch", torch.__version__, "python", sys.executable, flush=True)
print("cwd", os.getcwd(), flush=True)
print("home", os.environ["HOME"], "venv", os.environ.get("VIRTUAL_ENV", "none"), flush=True)
print("rv", os.environ["RV_RUN_NAME"], os.environ["RV_CHECKPOINT_DIR"], os.environ["RV_PRECISION"],
      "job" if os.environ.get("SLURM_JOB_ID") else "nojob", flush=True)
"""


@pytest.mark.parametrize("fmt", ["dir", "sqfs"])
def test_a_program_runs_inside_the_image_in_the_snapshots_work_dir(layout, tmp_path, fmt):
    proj = git_project(tmp_path / "p", {"inside.py": INSIDE})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "500M", "--name", f"inside-{fmt}", "--container", image(layout, fmt), "-f",
        "--", "python3", "inside.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert "marker ['rv', 'test', 'image']" in out, out
    torch_line = re.search(r"^torch (\S+) python (\S+)$", out, re.M)
    assert torch_line and torch_line[1].startswith(IMAGE_TORCH) and torch_line[2] == "/usr/bin/python3", out
    assert not torch_line[1].startswith(HOST_TORCH)
    cwd = re.search(r"^cwd (\S+)$", out, re.M)
    assert cwd and cwd[1].startswith(layout.remote_root + "/runs/"), out
    # Charliecloud's --home: the user's home at /home/$USER; the job's venv is not the image's.
    assert f"home /home/{layout.cluster['RV_TESTCLUSTER_USER']} venv none" in out, out
    ckpt = re.search(r"^rv inside-\S+ (\S+) no job$", out, re.M)
    assert ckpt and ckpt[1].startswith(layout.remote_root + "/checkpoints/"), out
    # The exact container line is in the job's script.
    script = (run_folder(layout.remote_root, f"inside-{fmt}") / "job.sbatch").read_text()
    assert (
        f'exec ch-run --home --bind={layout.remote_root} --cd="$PWD" {image(layout, fmt)} -- python3'
        in script
    )


DIST = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * dist.get_rank()
dist.all_reduce(t)
print("rank", dist.get_rank(), "world", dist.get_world_size(), "sum", int(t.item()),
      "torch", torch.__version__, "precision", os.environ["RV_PRECISION"],
      "marker", os.path.exists("/etc/rv-test-image"), flush=True)
dist.destroy_process_group()
"""


def test_torchrun_of_the_image_spans_two_nodes_of_two_ranks(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"dist.py": DIST})
    # --redirects 2 --tee 2: Debian 12's torchrun 1.13 fails on Python 3.11 with its defaults (0:
    # Std.from_str("0") is None, since 3.11 no longer iterates IntFlag's NONE; fixed in torch 2.0),
    # with or without rv. Stderr to a log file and the console, stdout untouched.
    r = layout.run_rv(
        "run", "-g", "4", "-t", "a6000", "--nodes", "2", "--mem", "1G", "--name", "dist",
        "--container", image(layout, "sqfs"), "-f", "--", "torchrun", "--redirects", "2", "--tee", "2",
        "dist.py", cwd=proj, timeout=500,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    ranks = re.findall(r"rank (\d) world (\d) sum (\d+) torch (\S+) precision (\S+) marker (\S+)", r.stdout)
    assert sorted(int(x[0]) for x in ranks) == [0, 1, 2, 3], r.stdout
    # World 4, the sum of ranks 0+1+2+3 over gloo, the image's torch 1.13 with rv's underscored flags,
    # the precision of the a6000 (compute capability 8.6: bf16).
    assert {x[1:] for x in ranks} == {("4", "6", x[3], "bf16", "True") for x in ranks}
    assert all(x[3].startswith(IMAGE_TORCH) for x in ranks), ranks


CHAIN = """\
import os, sys, torch
ckpt = os.environ["RV_CHECKPOINT_DIR"]
path = os.path.join(ckpt, "state.pt")
if os.path.exists(path):
    step = torch.load(path)["step"]
    print("resumed at", step, "segment", os.environ["RV_SEGMENT"], "torch", torch.__version__, flush=True)
else:
    torch.save({"step": 5}, path)
    print("saved step 5 in segment", os.environ["RV_SEGMENT"], flush=True)
    open(os.path.join(ckpt, "PREEMPTED"), "w").write("5")
"""


def test_a_chain_of_two_segments_resumes_from_its_checkpoint_inside(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"chain.py": CHAIN})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "500M", "--name", "cchain", "--container", image(layout), "-f",
        "--", "python3", "chain.py", cwd=proj, timeout=500,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "saved step 5 in segment 1" in r.stdout, r.stdout
    assert re.search(rf"resumed at 5 segment 2 torch {IMAGE_TORCH}", r.stdout), r.stdout
    record = ended(layout.remote_root, "cchain")
    assert record["segment"] == 2 and record["exit_code"] == 0, record


def nothing_sent(layout) -> bool:
    runs = Path(layout.remote_root, "runs")
    return not runs.exists() or not any(runs.iterdir())


def test_each_refusal_comes_before_anything_is_sent(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"t.py": "print(1)\n"})

    def refused(*args: str) -> str:
        r = layout.run_rv("run", "-g", "0", *args, "--", "python3", "t.py", cwd=proj, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert nothing_sent(layout), "a refused run sent something"
        return r.stderr

    err = refused("--container", "/nonexistent/image.sqfs")
    assert "--container /nonexistent/image.sqfs: no such image on the cluster" in err, err
    # ~ and $VAR are the cluster's: the user's home there.
    err = refused("--container", "~/nope.sif")
    assert f"(/home/{layout.cluster['RV_TESTCLUSTER_USER']}/nope.sif)" in err, err
    # A SIF image where only Charliecloud is: the runtimes found are named, with their versions.
    sif = Path(layout.remote_root, "img.sif")
    sif.write_bytes(b"")
    err = refused("--container", str(sif))
    assert "no runtime here runs a sif image (it needs apptainer or singularity)" in err, err
    assert re.search(r"runtimes found: charliecloud \(0\.\d+", err), err
    err = refused("--container", image(layout), "--container-runtime", "apptainer")
    assert "--container-runtime apptainer: apptainer is not on the cluster" in err, err
    assert "module load apptainer" in err
    # Before any network call at all: a relative path, a registry reference.
    assert "must be absolute" in refused("--container", "image.sqfs")
    # A scheme no runtime pulls, and one the runtime named does not (docker:// references are pulled:
    # tests/integration/test_container_registry.py).
    assert "rv pulls no oci-archive:// references" in refused("--container", "oci-archive:///a.tar")
    assert "does not pull oras://" in refused(
        "--container", "oras://ghcr.io/a/b:1", "--container-runtime", "charliecloud"
    )
    # oras:// needs Apptainer or Singularity, which the cluster lacks: refused there, before the pull.
    err = refused("--container", "oras://ghcr.io/a/b:1")
    assert (
        "--container oras://ghcr.io/a/b:1: nothing here pulls it (it needs one of apptainer (apptainer), "
        in err
    )
    assert re.search(r"runtimes found: charliecloud \(0\.\d+", err), err


def test_dry_run_shows_the_container_line_and_none_overrides_a_projects_default(layout, tmp_path):
    proj = git_project(
        tmp_path / "p",
        {"t.py": "print(1)\n", "pyproject.toml": '[tool.rv]\ncontainer = "$HOME/images/pt.sif"\n'},
    )
    r = layout.run_rv("run", "-g", "1", "-t", "a6000", "--dry-run", "--", "python3", "t.py", cwd=proj)
    assert r.returncode == 0, r.stderr
    assert "exec apptainer exec --nv --bind" in r.stdout and "'$HOME/images/pt.sif' python3 t.py" in r.stdout
    r = layout.run_rv("run", "-g", "0", "--container", "none", "--dry-run", "--", "python3", "t.py", cwd=proj)
    assert r.returncode == 0, r.stderr
    assert "    exec python3 t.py" in r.stdout and "apptainer" not in r.stdout


def test_status_lists_the_container_runtimes_with_their_versions(layout):
    r = layout.run_rv("status")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("containers"))
    assert re.fullmatch(r"containers +charliecloud \(0\.\d+\S*\)", line), line
    r = layout.run_rv("status", "--json")
    found = json.loads(r.stdout)["container_runtimes"]["found"]
    assert found["charliecloud"]["path"].endswith("/ch-run"), found


def test_a_session_in_the_image_and_rv_ssh_into_it(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"t.py": "print(1)\n"})
    r = layout.run_rv(
        "up", "--detach", "-g", "0", "--mem", "500M", "--name", "cup", "--container", image(layout, "sqfs"),
        cwd=proj, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    try:
        torch_version = 'python3 -c "import torch; print(torch.__version__)"'
        check = f"cat /etc/rv-test-image; {torch_version}; pwd; echo $RV_RUN_NAME"
        r = layout.run_rv("ssh", "cup", "--", check, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith("rv test image") and lines[1].startswith(IMAGE_TORCH), lines
        assert lines[2].startswith(layout.remote_root + "/runs/") and lines[3] == "cup", lines
    finally:
        assert layout.run_rv("stop", "cup").returncode == 0


ENV_PROGRAM = """\
import os, sys, torch, pyjokes
from importlib import metadata
print("prefix", sys.prefix, "env", os.environ["RV_ENV"], flush=True)
print("pyjokes", metadata.version("pyjokes"), pyjokes.__file__.startswith(sys.prefix), flush=True)
print("torch", torch.__version__, torch.__file__, flush=True)
print("marker", os.path.exists("/etc/rv-test-image"), flush=True)
"""


def test_the_projects_environment_is_built_on_the_images_python_and_sees_its_torch(layout, tmp_path):
    # The profile builds with --system-site-packages: the image's torch is seen, not installed again.
    proj = git_project(tmp_path / "p", {"envprog.py": ENV_PROGRAM, "requirements.txt": "pyjokes==0.6.0\n"})
    args = ("run", "-g", "0", "--mem", "500M", "--container", image(layout, "sqfs"), "-f")
    r = layout.run_rv(*args, "--name", "cenv", "--", "python", "envprog.py", cwd=proj, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    prefix = re.search(r"^prefix (\S+) env (\S+)$", out, re.M)
    assert prefix and prefix[1] == prefix[2] and prefix[1].startswith(layout.remote_root + "/envs/"), out
    # What the image lacks is installed in the environment.
    assert "pyjokes 0.6.0 True" in out, out
    torch_line = re.search(r"^torch (\S+) (\S+)$", out, re.M)
    assert torch_line and torch_line[1].startswith(IMAGE_TORCH), out
    assert torch_line[2].startswith("/usr/lib/python3/dist-packages/torch/"), out
    assert "marker True" in out
    meta = json.loads(Path(prefix[1], "rv-env.json").read_text())
    assert meta["image"].startswith("charliecloud " + image(layout, "sqfs")), meta
    assert not list(Path(prefix[1]).glob("lib/python3*/site-packages/torch/__init__.py")), (
        "torch installed again"
    )
    # A second run finds it (one environment per image and dependencies); --env none: the image alone.
    r = layout.run_rv(*args, "--name", "cenv2", "--", "python", "envprog.py", cwd=proj, timeout=600)
    assert r.returncode == 0 and f"env {prefix[1]}" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "built in" not in r.stderr, r.stderr
    check = "import sys, torch; print('alone', sys.prefix, torch.__version__)"
    r = layout.run_rv(*args, "--env", "none", "--name", "cenv3", "--", "python3", "-c", check, cwd=proj)
    assert r.returncode == 0 and re.search(rf"^alone /usr {IMAGE_TORCH}", r.stdout, re.M), r.stdout + r.stderr


NODE = """\
import os
print("cwd", os.getcwd(), "secret", os.environ.get("MY_IMAGE_SECRET"), flush=True)
print("marker", os.path.exists("/etc/rv-test-image"), "data", open("data.txt").read().strip(), flush=True)
open("made-inside.txt", "w").write("x")
"""


def test_a_node_work_dir_and_the_secrets_reach_the_program_inside(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"node.py": NODE, "data.txt": "from the snapshot\n"})
    assert layout.run_rv("env", "set", "MY_IMAGE_SECRET=only-in-the-job").returncode == 0
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "500M", "--name", "cnode", "--work-dir", "node",
        "--container", image(layout), "-f", "--", "python3", "node.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    cwd = re.search(r"^cwd (\S+) secret (\S+)$", r.stdout, re.M)
    assert cwd and not cwd[1].startswith(layout.remote_root) and cwd[2] == "only-in-the-job", r.stdout
    assert "marker True data from the snapshot" in r.stdout, r.stdout
    # What the program made on the node's disk, inside the image, is kept as with no container.
    run = run_folder(layout.remote_root, "cnode")
    assert (run / "work.changes" / "files.tar").exists()


POINT = """\
import os, sys, torch
with open(os.path.join(os.environ["RV_OUTPUT_DIR"], "inside.txt"), "w") as fh:
    fh.write("%s %s %s" % (sys.argv[1], torch.__version__, os.path.exists("/etc/rv-test-image")))
"""


def test_each_point_of_a_sweep_runs_inside_the_image(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"point.py": POINT})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "300M", "--name", "csweep", "--sweep", "x=1,2",
        "--container", image(layout), "--", "python3", "point.py", "{x}", cwd=proj, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]

    def written():
        found = sorted(Path(layout.remote_root, "outputs").glob("*/csweep/*/inside.txt"))
        return [p.read_text() for p in found] if len(found) == 2 else None

    texts = wait_for(written, 240, "both points to write")
    assert sorted(t.split()[0] for t in texts) == ["1", "2"], texts
    assert all(t.split()[1].startswith(IMAGE_TORCH) and t.endswith("True") for t in texts), texts


STOPPED = """\
import os, signal, sys, time
ckpt = os.environ["RV_CHECKPOINT_DIR"]
state = os.path.join(ckpt, "step")
if os.path.exists(state):
    print("segment", os.environ["RV_SEGMENT"], "resumed at", open(state).read(), flush=True)
    sys.exit(0)
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
deadline = time.time() + 55
while not got and time.time() < deadline:
    time.sleep(0.2)
if not got:
    sys.exit(9)
open(state, "w").write("7")
open(os.path.join(ckpt, "PREEMPTED"), "w").write("7")
print("got USR1 inside", os.path.exists("/etc/rv-test-image"), flush=True)
"""


def test_the_stop_signal_reaches_the_program_inside_and_the_chain_goes_on(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"stopped.py": STOPPED})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "300M", "--time", "1m", "--signal", "USR1@50", "--name", "cstop",
        "--container", image(layout, "sqfs"), "-f", "--", "python3", "stopped.py", cwd=proj, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "got USR1 inside True" in r.stdout and "segment 2 resumed at 7" in r.stdout, r.stdout
    assert "sent USR1 to pid(s)" in r.stderr, r.stderr[-3000:]
    record = ended(layout.remote_root, "cstop")
    assert record["segment"] == 2 and record["exit_code"] == 0, record
