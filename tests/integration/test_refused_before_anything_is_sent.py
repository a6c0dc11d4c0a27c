"""Requests refused before anything is sent, on the real loopback clusters as the non-root cluster
user: limits of the partition `rv init` learned (and the proposals, which run), run names taken
exactly as typed or refused, `--setup` lines that bash cannot parse."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from projects import SHOW_ENV, git_project

from rv.config import load_config, save_config


@pytest.fixture
def project(tmp_path) -> Path:
    return git_project(tmp_path / "proj", {"show.py": SHOW_ENV})


def nothing_sent(remote_root: str) -> bool:
    return not any(Path(remote_root).rglob("*"))


def test_partition_limits_learned_by_init_are_enforced_and_the_proposals_run(layout, project):
    """The layouts' default partitions have 2 nodes and no time limit, as `rv init` read them from
    sinfo. A CPU job over the node count, or (with the limit a site sets) over the time, is refused
    before anything is sent; the refusal's proposals are jobs that run."""
    config = load_config(Path(layout.rv_env["RV_CONFIG"]))
    profile = config.profile(None)
    default = profile.default_partition
    assert default is not None and default.nodes == 2 and default.max_time is None
    assert default.name == ("gpu-a6000" if layout.name == "default" else "gpu")
    run_rv = layout.run_rv

    r = run_rv("run", "-g", "0", "--nodes", "3", "--each-node", "--", "python", "show.py", cwd=project)
    assert r.returncode == 2 and f"--nodes 3: partition {default.name}" in r.stderr, r.stderr
    assert "has 2 node(s)" in r.stderr and "next: use --nodes 2" in r.stderr
    # The case: -g 5 on two nodes of 2 proposed -g 6 and --nodes 5, both refused next.
    r = run_rv(
        "run", "-g", "5", "-t", "a6000", "--allow-single-process", "--", "python", "show.py", cwd=project
    )
    assert r.returncode == 2 and "next: use -g 2 (1 node)" in r.stderr, r.stderr
    # A site's 3-day limit on that partition, as rv init would have read it.
    limited = replace(default, max_time="3-00:00:00")
    save_config(config.with_profile(replace(profile, partitions={default.name: limited}), make_default=True))
    r = run_rv("run", "-g", "0", "--time", "4d", "--", "python", "show.py", cwd=project)
    assert r.returncode == 2 and "next: use --time 3-00:00:00 or less" in r.stderr, r.stderr
    assert nothing_sent(layout.remote_root)

    # The proposals, taken: each is a job the cluster starts and runs to the end.
    for args in (["-g", "0", "--time", "3-00:00:00"], ["-g", "2", "-t", "a6000", "--allow-single-process"]):
        done = run_rv("run", *args, "--mem", "500M", "-f", "--", "python", "show.py", cwd=project)
        assert done.returncode == 0, done.stderr


def test_run_names_are_taken_as_typed_or_refused_before_anything_is_sent(run_rv, remote_root, project):
    for typed in ("lr 0.1", "lr/0.1", "lr?0.1", "ünï", "x" * 65):
        r = run_rv("run", "--name", typed, "-g", "0", "--", "python", "show.py", cwd=project)
        assert r.returncode == 2 and f"--name {typed!r}" in r.stderr, r.stderr
        assert "ASCII letters, digits, '.', '_' and '-', at most 64" in r.stderr
    bad_setup = run_rv("run", "--setup", "if true; then", "-g", "0", "--", "python", "show.py", cwd=project)
    assert bad_setup.returncode == 2 and "setup line 'if true; then' is not valid bash" in bad_setup.stderr
    assert nothing_sent(remote_root)

    names = ["lr_0.1-A", "lr-0.1-A"]  # one character apart: two runs, each found by its own name
    for name in names:
        r = run_rv(
            "run", "--name", name, "-g", "0", "--mem", "500M", "-f", "--", "python", "show.py", cwd=project
        )
        assert r.returncode == 0 and f"submitted run {name}:" in r.stderr, r.stderr
    for name in names:
        logs = run_rv("logs", name, cwd=project)
        assert logs.returncode == 0 and "SHARED MISSING" in logs.stdout, logs.stderr
    listed = run_rv("ps", "-a", "--json", cwd=project)
    assert set(names) <= {row["name"] for row in json.loads(listed.stdout)}
    gone = run_rv("logs", "lr 0.1", cwd=project)
    assert gone.returncode == 9 and "no run can be named 'lr 0.1'" in gone.stderr, gone.stderr
