"""Issue 43: `rv jupyter --container` and `rv code --container` land their servers inside the image.

On both loopback layouts with Charliecloud's ch-run and scripts/testcluster's image (a minimal
Debian 12 with its own python3 and torch 1.13, and /etc/rv-test-image, a file only it has): the
JupyterLab server runs inside the image, so the kernels it starts are the image's Python; rv code's
sshd hands every connection (VS Code's server, its terminals) to a shell inside the image. Pyxis is
not in Debian 12: its refusal here, its command lines in tests/unit/test_container_sessions_parts.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from projects import git_project
from test_code_and_jupyter import _interrupt, _plain_ssh, _run_cell, _scp_up, _session, _start_jupyter
from test_container import IMAGE_TORCH, image, nothing_sent
from test_inside import wait_gone

INSIDE = (
    "import os, sys, torch\n"
    "print(open('/etc/rv-test-image').read().split()[:3], torch.__version__, sys.executable,\n"
    "      os.environ['RV_RUN_NAME'], os.environ.get('RV_IN_CONTAINER'), os.getcwd())\n"
)


def test_jupyter_runs_in_the_image_and_its_kernel_is_the_images_python(layout, tmp_path):
    # The image has no JupyterLab: rv's tools environment is built on the image's Python, in it.
    proj = git_project(tmp_path / "p", {"notes.txt": "x\n"})
    proc, url = _start_jupyter(
        layout, proj, "-g", "0", "--mem", "1G", "--name", "cnb", "--container", image(layout, "sqfs")
    )
    try:
        job = _session(layout.run_rv, "cnb")["job_id"]
        printed = _run_cell(url, INSIDE)
        # The kernel is a child of the server: /etc/rv-test-image and the image's /usr/bin/python3
        # with torch 1.13 (the host's python3 has torch 2.13) mean the server runs inside the image.
        assert printed.startswith(f"['rv', 'test', 'image'] {IMAGE_TORCH}"), printed
        words = printed.split()
        run_id = _session(layout.run_rv, "cnb")["run_id"]
        assert words[-4:] == ["/usr/bin/python3", "cnb", "1", f"{layout.remote_root}/runs/{run_id}/work"]
        metas = [json.loads(p.read_text()) for p in Path(layout.remote_root, "envs").glob("*/rv-env.json")]
        assert any(str(m.get("image", "")).startswith("charliecloud ") for m in metas), metas
    finally:
        err = _interrupt(proc)
    assert proc.returncode == 0, err
    assert "built once per image" in err, err
    assert layout.run_rv("stop", "cnb").returncode == 0
    wait_gone(layout.ssh, job)


def test_code_lands_every_connection_inside_the_projects_image(layout, tmp_path):
    # The image comes from the project's [tool.rv] container, as a run's would.
    sqfs = image(layout, "sqfs")
    proj = git_project(
        tmp_path / "p",
        {"notes.txt": "from the snapshot\n", "pyproject.toml": f'[tool.rv]\ncontainer = "{sqfs}"\n'},
    )
    home = Path(layout.rv_env["HOME"])
    (tmp_path / "empty_ssh_config").write_text("")
    env = {"RV_SSH_CONFIG": str(tmp_path / "empty_ssh_config")}
    r = layout.run_rv(
        "code", "-g", "0", "--mem", "500M", "--name", "ced", "--editor", "no-such-editor", cwd=proj,
        env_extra=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    alias = r.stdout.strip().splitlines()[-1]
    job = _session(layout.run_rv, "ced")["job_id"]
    try:
        config = tmp_path / "ssh_config"
        config.write_text(f"Include {home}/.ssh/rv/config\n")
        torch = "python3 -c 'import torch, sys; print(torch.__version__, sys.executable)'"
        ran = _plain_ssh(
            home, config, alias, f"cat /etc/rv-test-image; {torch}; echo $SLURM_JOB_ID; cat notes.txt"
        )
        assert ran.returncode == 0, ran.stderr
        lines = ran.stdout.splitlines()
        assert lines[0].startswith("rv test image"), lines
        assert lines[1].startswith(IMAGE_TORCH) and lines[1].endswith(" /usr/bin/python3"), lines
        assert lines[2:] == [job, "from the snapshot"], lines
        # scp (sftp's server is the node's, outside the image) reaches the same work dir.
        work = f"{layout.remote_root}/runs/{_session(layout.run_rv, 'ced')['run_id']}/work"
        (tmp_path / "up.txt").write_text("sent by scp\n")
        _scp_up(home, config, alias, tmp_path / "up.txt", work)
        back = _plain_ssh(home, config, alias, "cat up.txt; test -e /etc/rv-test-image && echo inside")
        assert back.stdout == "sent by scp\ninside\n", back.stderr
    finally:
        assert layout.run_rv("stop", "ced").returncode == 0
    wait_gone(layout.ssh, job)


def test_code_and_jupyter_refusals_come_before_anything_is_sent(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"t.py": "print(1)\n"})
    env = {"RV_SSH_CONFIG": os.devnull}

    def refused(*args: str) -> str:
        r = layout.run_rv(*args, "-g", "0", cwd=proj, env_extra=env, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert nothing_sent(layout), f"rv {' '.join(args)} sent something"
        assert "Traceback" not in r.stderr
        return r.stderr

    err = refused("code", "--editor", "x", "--container", "/nonexistent/image.sqfs")
    assert "--container /nonexistent/image.sqfs: no such image on the cluster" in err, err
    err = refused("jupyter", "--no-browser", "--container", image(layout), "--container-runtime", "apptainer")
    assert "--container-runtime apptainer: apptainer is not on the cluster" in err, err
    err = refused("code", "--editor", "x", "--container", image(layout), "--container-runtime", "apptainer")
    assert "--container-runtime apptainer: apptainer is not on the cluster" in err, err
    # A Pyxis image: refused on the laptop, before any connection.
    err = refused("code", "--editor", "x", "--container", "/sw/pt.sqsh")
    assert "do not run inside a Pyxis image yet" in err and "rv ssh" in err, err
    err = refused("jupyter", "--container", "/sw/pt.sqsh")
    assert "do not run inside a Pyxis image yet" in err, err


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # refused on the laptop: one layout
def test_a_projects_container_default_applies_to_code(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"pyproject.toml": '[tool.rv]\ncontainer = "/sw/pt.sqsh"\n'})
    r = layout.run_rv("code", "--editor", "x", "--container", "/sw/pt.sqsh", cwd=proj, timeout=60)
    assert r.returncode == 2 and "Pyxis image" in r.stderr, r.stderr
    r = layout.run_rv("code", "--editor", "x", cwd=proj, timeout=60)  # the project's default: the same
    assert r.returncode == 2 and "Pyxis image" in r.stderr, r.stderr


def test_up_without_detach_gives_a_shell_inside_the_image(layout, tmp_path):
    from terminal import Terminal
    from test_inside import rv_argv, up_job

    proj = git_project(tmp_path / "p", {"t.py": "print(1)\n"})
    argv = rv_argv("up", "-g", "0", "--mem", "500M", "--name", "cshell", "--container", image(layout, "sqfs"))
    term = Terminal(argv, env=layout.rv_env, cwd=proj)
    try:
        job = up_job(term)
        term.expect(r"\(rv cshell\) ", timeout=300)
        torch = "$(python3 -c 'import torch; print(torch.__version__)')"
        term.send(f"echo IN $(head -c 13 /etc/rv-test-image) {torch}\r")
        (version,) = term.expect(r"IN rv test image (\S+)\r\n").groups()
        assert version.startswith(IMAGE_TORCH), version
        term.send("exit\r")
        term.expect(rf"released the allocation \(job {job}\)")
        assert term.wait() == 0
    finally:
        term.close()
