"""Sessions in an image (issue 43): rv ssh's step into a Pyxis image, and rv code's login script that
enters any other runtime's image through the job's ``container.sh``.

Pyxis is not in Debian 12, so its lines are checked here against its documented srun options
(``--container-image``, ``--container-mounts=SRC:DST,...``, ``--container-workdir``,
``--container-name``: a named container stays for the rest of the job, and a later step naming it
uses it, the import skipped). The other runtimes run for real in
tests/integration/test_container_sessions.py (Charliecloud).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from rv.catalog import RIVANNA
from rv.job.inside import RunningJob, attach_command
from rv.job.records import ClusterRun
from rv.job.submit import submit_args
from rv.layout import RemoteLayout
from rv.remote.nodessh import login_script
from rv.request import JobRequest, build_request
from rv.slurm.container import Container, attach_options, from_meta, to_meta
from rv.slurm.parse import QueuedJob, parse_job_id
from rv.slurm.script import ScriptContext, render_script

ROOT = "/scratch/u/rv"


def context(container: Container | None = None) -> ScriptContext:
    return ScriptContext(
        remote_root=ROOT, snapshot_id="s", project="p", run_id="run0a1b2", container=container
    )


def held(meta_container=None) -> RunningJob:
    meta = {"name": "sess", "command": ["sleep"], "gpus": 1, "nodes": 1}
    if meta_container is not None:
        meta["container"] = meta_container
    run = ClusterRun("run0a1b2", meta, (), None, False, False)
    job = QueuedJob(
        parse_job_id("42"), "RUNNING", None, 60, 3600, 1, ("node1",), (), "gpu", None, None, "sess"
    )
    return RunningJob(run=run, job=job, root=ROOT)


def _pyxis_run() -> tuple[JobRequest, ScriptContext]:
    """A one-GPU run's request and script context, in a Pyxis image."""
    req = build_request(RIVANNA, command=["python", "t.py"], gpus=1, gpu_type="a6000")
    ctx = ScriptContext(
        remote_root=ROOT,
        snapshot_id="s",
        project="p",
        run_id="run0a1b2",
        container=Container("/sw/pt.sqsh", "pyxis"),
    )
    return req, ctx


def test_the_jobs_tasks_run_in_a_pyxis_container_named_after_the_job():
    req, ctx = _pyxis_run()
    line = next(x for x in render_script(req, ctx).splitlines() if x.startswith("rv_srun_container="))
    assert line.endswith('"--container-workdir=$PWD" "--container-name=rv-$SLURM_JOB_ID")'), line
    # bash expands the name in the batch shell, where SLURM_JOB_ID is the job's.
    out = subprocess.run(
        ["bash", "-c", line + '; printf "%s\\n" "${rv_srun_container[@]}"'],
        env={"SLURM_JOB_ID": "42", "PWD": "/w"}, capture_output=True, text=True, check=True, cwd="/",
    ).stdout.split("\n")  # fmt: skip
    assert out[-2] == "--container-name=rv-42", out


def test_the_runs_record_keeps_its_image_runtime_and_binds():
    req, ctx = _pyxis_run()
    args = submit_args(RemoteLayout(ROOT), req, ctx, provenance={}, has_secrets=False)
    kept = args["meta"]["container"]
    assert kept == {"runtime": "pyxis", "image": "/sw/pt.sqsh", "binds": [ROOT]}
    assert from_meta(kept) == (Container("/sw/pt.sqsh", "pyxis"), [ROOT])
    assert from_meta(to_meta(Container("/i.sqfs", "charliecloud"), ["/a", "/b"])) == (
        Container("/i.sqfs", "charliecloud"),
        ["/a", "/b"],
    )
    assert from_meta(None) is None and from_meta({"image": "/x", "runtime": "docker"}) is None
    no_container = ScriptContext(remote_root=ROOT, snapshot_id="s", project="p", run_id="run0a1b2")
    assert (
        "container"
        not in submit_args(RemoteLayout(ROOT), req, no_container, provenance={}, has_secrets=False)["meta"]
    )


def test_rv_ssh_enters_a_pyxis_sessions_container_by_srun_options():
    rj = held({"runtime": "pyxis", "image": "/sw/pt.sqsh", "binds": [ROOT, "/project/ckpt"]})
    words = shlex.split(attach_command(rj.place, "node1", "nvidia-smi", pty=False))
    at = words.index("bash")
    assert words[:at] == [
        "srun", "--jobid=42", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node1",
        "--container-image=/sw/pt.sqsh",
        f"--container-mounts={ROOT}:{ROOT},/project/ckpt:/project/ckpt",
        f"--container-workdir={ROOT}/runs/run0a1b2",
        "--container-name=rv-42",
    ]  # fmt: skip
    assert words[-1] == "nvidia-smi"
    # A shell: --pty before Pyxis's options, the same container.
    shell = shlex.split(attach_command(rj.place, "node1", None, pty=True))
    assert shell[6] == "--pty" and "--container-name=rv-42" in shell


def test_other_runtimes_and_no_container_add_no_srun_options():
    plain = shlex.split(attach_command(held().place, "node1", "true", pty=False))
    charlie = held({"runtime": "charliecloud", "image": "/i.sqfs", "binds": [ROOT]})
    inside = shlex.split(attach_command(charlie.place, "node1", "true", pty=False))
    assert plain == inside and not [w for w in plain if w.startswith("--container")]
    assert attach_options(Container("/i.sif", "apptainer"), folders=[ROOT], job_id="1", workdir="/w") == []


def _fake_container(job_dir: Path, log: Path) -> None:
    """A ``container.sh`` whose runtime marks the world it runs in (RV_FAKE_IMAGE) and logs its
    arguments, as the job writes the real one beside its environment file."""
    (job_dir / "container.sh").write_text(
        f'rv_in_container() {{ echo "$*" >>{shlex.quote(str(log))}; RV_FAKE_IMAGE=1 exec "$@"; }}\n'
    )


def test_code_hands_each_connection_into_the_image_but_sftp(tmp_path):
    job_dir, session = tmp_path / "run", tmp_path / "run" / "node-ssh"
    session.mkdir(parents=True)
    (job_dir / "env.sh").write_text("export FROM_ENV=yes\n")
    log = tmp_path / "entered"
    _fake_container(job_dir, log)
    login = session / "login.sh"
    login.write_text(login_script(str(job_dir / "env.sh"), str(tmp_path)))

    def connect(cmd: str) -> str:
        env = {"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": cmd}
        return subprocess.run(
            ["bash", str(login)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            stdin=subprocess.DEVNULL,
        ).stdout

    assert connect("echo ${RV_FAKE_IMAGE-outside} $FROM_ENV $RV_IN_CONTAINER") == "1 yes 1\n"
    assert log.read_text() == f"bash {login}\n"  # once: inside, login.sh does not enter again
    assert connect("/usr/lib/openssh/sftp-server; echo ${RV_FAKE_IMAGE-outside}").endswith("outside\n")
    assert log.read_text().count("\n") == 1


def test_jupyters_node_script_runs_itself_again_inside_the_image(tmp_path):
    from rv.job.notebook import NODE

    job_dir = tmp_path / "run"
    job_dir.mkdir()
    (job_dir / "env.sh").write_text("true\n")
    log = tmp_path / "entered"
    _fake_container(job_dir, log)
    # The script's first lines up to its entering the image, then a line saying where it runs.
    head = NODE.split("if ! py=", 1)[0].replace("ENV_FILE", shlex.quote(str(job_dir / "env.sh")))
    head = head.replace("WORK_DIR", shlex.quote(str(tmp_path)))
    script = tmp_path / "start.sh"
    script.write_text(head + 'echo "${RV_FAKE_IMAGE-outside} $*"\n')
    out = subprocess.run(
        ["bash", str(script), "10.0.0.1", "/tools"], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    assert out == "1 10.0.0.1 /tools\n"
    assert log.read_text() == f"bash {script} 10.0.0.1 /tools\n"


def test_the_kernels_tools_packages_come_before_the_interpreters_own(tmp_path):
    """An image's Python (Debian 12's) has older packages (typing_extensions) that ipykernel cannot
    use: the tools environment's go before them, after a venv's own."""
    import json
    import sys

    from rv.job.notebook import KERNEL_SPEC

    folder = tmp_path / "k"
    argv = [sys.executable, "-", str(folder), "/tools/site-packages", "s"]
    subprocess.run(argv, input=KERNEL_SPEC, text=True, check=True)
    code = json.loads((folder / "kernel.json").read_text())["argv"][2]
    shown = code.replace(
        "from ipykernel.kernelapp import launch_new_instance; launch_new_instance()",
        "import json; print(json.dumps(sys.path))",
    )

    def sys_path(**env: str) -> list[str]:
        full = {"PATH": "/usr/bin:/bin", **env}
        ran = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True, env=full)
        assert ran.returncode == 0, ran.stderr
        return json.loads(ran.stdout)

    # The interpreter's own packages (as an image's /usr/lib/python3/dist-packages) come after.
    path = sys_path(PYTHONPATH="/image/dist-packages")
    assert path.index("/tools/site-packages") < path.index("/image/dist-packages"), path
    path = sys_path()
    at = path.index("/tools/site-packages")
    own = [i for i, p in enumerate(path) if p.startswith(sys.prefix + "/") and p.endswith("site-packages")]
    if sys.prefix != sys.base_prefix:  # a venv (the project's environment): its own packages first
        assert own and all(i < at for i in own), path
