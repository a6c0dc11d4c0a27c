"""Issue 43: `rv code --container` lands every connection (VS Code's server) inside the image.

On both loopback layouts with Charliecloud's ch-run and scripts/testcluster's image (a minimal
Debian 12 with its own python3 and torch 1.13, and /etc/rv-test-image, a file only it has): rv code's
sshd hands every connection (VS Code's server, its terminals) to a shell inside the image. Pyxis is
not in Debian 12: its refusal here, its command lines in tests/unit/test_container_sessions_parts.py.
`rv jupyter --container` is refused (exit 2) until its kernel runs inside.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from projects import git_project
from test_code_and_jupyter import _plain_ssh, _session
from test_container import IMAGE_TORCH, image, nothing_sent
from test_inside import wait_gone


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
        sent = subprocess.run(
            ["scp", "-F", str(config), "-o", "BatchMode=yes", str(tmp_path / "up.txt"), f"{alias}:{work}/"],
            env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
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
    # rv jupyter in an image: not yet (its kernel there), said before any connection.
    err = refused("jupyter", "--no-browser", "--container", image(layout))
    assert "JupyterLab does not run inside an image yet" in err and "rv code --container" in err, err
    err = refused("code", "--editor", "x", "--container", image(layout), "--container-runtime", "apptainer")
    assert "--container-runtime apptainer: apptainer is not on the cluster" in err, err
    # A Pyxis image: refused on the laptop, before any connection.
    err = refused("code", "--editor", "x", "--container", "/sw/pt.sqsh")
    assert "do not run inside a Pyxis image yet" in err and "rv ssh" in err, err


@pytest.mark.parametrize("layout", ["default"], indirect=True)  # refused on the laptop: one layout
def test_a_projects_container_default_applies_to_code(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"pyproject.toml": '[tool.rv]\ncontainer = "/sw/pt.sqsh"\n'})
    r = layout.run_rv("code", "--editor", "x", "--container", "/sw/pt.sqsh", cwd=proj, timeout=60)
    assert r.returncode == 2 and "Pyxis image" in r.stderr, r.stderr
    r = layout.run_rv("code", "--editor", "x", cwd=proj, timeout=60)  # the project's default: the same
    assert r.returncode == 2 and "Pyxis image" in r.stderr, r.stderr
