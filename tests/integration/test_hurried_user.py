"""Issue 28 against the real loopback clusters, as the non-root cluster user: secrets that belong to
a profile, run names taken as typed, requests refused before anything is sent, --setup syntax."""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_remote_dir

from rv.config import load_config, save_config


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def project(tmp_path) -> Path:
    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "show.py").write_text(
        "import hashlib, os\n"
        "for name in ('ALPHA_ONLY', 'BARE_ONLY', 'SHARED', 'CLASH', 'PEM'):\n"
        "    v = os.environ.get(name)\n"
        "    print(name, 'MISSING' if v is None else hashlib.sha256(v.encode()).hexdigest()[:16])\n"
    )
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return repo


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def shown(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if line.split(" ", 1)[0].isupper())


def test_secrets_reach_only_their_profiles_jobs_and_global_ones_reach_all(
    run_rv, rv_env, remote_root, bare_cluster, bare_session_config, bare_remote_root, project
):
    # One machine, both clusters: the default layout's profile and the bare layout's beside it.
    config = load_config(Path(rv_env["RV_CONFIG"]))
    bare = load_config(bare_session_config).profile(bare_cluster["RV_TESTCLUSTER_PROFILE"])
    save_config(config.with_profile(replace(bare, remote_root=bare_remote_root), make_default=False))
    make_remote_dir(bare_remote_root, bare_cluster["RV_TESTCLUSTER_USER"])
    bare_name = bare.name

    pem = "-----BEGIN KEY-----\nAAAA\nBBBB\n-----END KEY-----"
    assert run_rv("env", "set", "ALPHA_ONLY=for-alpha").returncode == 0  # the default profile's
    assert run_rv("env", "set", "--profile", bare_name, "BARE_ONLY=for-bare").returncode == 0
    assert run_rv("env", "set", "--global", "SHARED=everywhere").returncode == 0
    assert run_rv("env", "set", "--global", "CLASH=global").returncode == 0
    assert run_rv("-p", bare_name, "env", "set", "CLASH=bare-wins").returncode == 0
    piped = run_rv("env", "set", "PEM", input=pem + "\n")  # piped: every line of it
    assert piped.returncode == 0 and "Warning" not in piped.stderr, piped.stderr

    cmd = ("run", "-g", "0", "--mem", "500M", "-f", "--", "python", "show.py")
    on_default = run_rv(*cmd, cwd=project)
    assert on_default.returncode == 0, on_default.stderr
    assert shown(on_default.stdout) == {
        "ALPHA_ONLY": sha("for-alpha"), "BARE_ONLY": "MISSING", "SHARED": sha("everywhere"),
        "CLASH": sha("global"), "PEM": sha(pem),
    }  # fmt: skip
    on_bare = run_rv("-p", bare_name, *cmd, cwd=project)
    assert on_bare.returncode == 0, on_bare.stderr
    assert shown(on_bare.stdout) == {
        "ALPHA_ONLY": "MISSING", "BARE_ONLY": sha("for-bare"), "SHARED": sha("everywhere"),
        "CLASH": sha("bare-wins"), "PEM": "MISSING",
    }  # fmt: skip
    # Neither cluster holds the other's secret anywhere: not in its files, not in its logs.
    for root, foreign in ((remote_root, "for-bare"), (bare_remote_root, "for-alpha")):
        for path in Path(root).rglob("*"):
            if path.is_file():
                assert foreign.encode() not in path.read_bytes(), path


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


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_an_output_pattern_copies_every_match_and_one_matching_nothing_is_said(layout, project):
    make = (
        "import os; os.makedirs('out/ep 1', exist_ok=True)\n"
        "for n in ('a.pt', 'b.pt', 'log.txt', 'ep 1/c.pt'): open(os.path.join('out', n), 'w').write(n)\n"
    )
    (project / "make.py").write_text(make)
    git(project, "add", ".")
    git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "make")
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "500M", "--name", "globs", "-o", "out/**/*.pt", "-o", "ckpt/*.bin",
        "-f", "--", "python", "make.py", cwd=project,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "output pattern ckpt/*.bin matched nothing in the work dir" in r.stdout + r.stderr
    (kept,) = Path(layout.remote_root, "outputs").glob("proj*/globs")  # proj-<hash of its path>
    copied = sorted(str(p.relative_to(kept)) for p in kept.rglob("*.pt"))
    assert copied == ["out/a.pt", "out/b.pt", "out/ep 1/c.pt"], copied
    assert not (kept / "out" / "log.txt").exists()
