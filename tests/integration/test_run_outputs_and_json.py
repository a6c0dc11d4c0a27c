"""`rv run`'s outputs with a real job, on the bare layout (no accounting, one mixed partition, no
`python` on the login PATH), as the cluster user: pure JSON on stdout with -f, `-o` paths from the
folder the program starts in and `-o` patterns, the snapshot's warnings on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from projects import git_project

JOB = "echo made-in-exp > out.txt; echo to-stdout; echo to-stderr >&2"


def test_follow_with_json_from_a_subfolder_keeps_stdout_json_and_outputs_where_the_program_ran(
    run_rv_bare, bare_remote_root, tmp_path
):
    proj = git_project(tmp_path / "proj", {"exp/job.sh": JOB + "\n", "README": "x\n"})
    (proj / "exp" / "notes.txt").write_text("not committed\n")  # a dirty tree: rv run says so
    r = run_rv_bare(
        "run", "-g", "0", "--mem", "300M", "-f", "--json", "-o", "out.txt", "--", "sh", "job.sh",
        cwd=proj / "exp", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(r.stdout)  # all of stdout is the one record
    assert record["job_id"].isdigit() and record["request"]["outputs"] == ["exp/out.txt"]
    # The program's output, both streams, is on stderr.
    assert "to-stdout" in r.stderr and "to-stderr" in r.stderr
    err = " ".join(r.stderr.split())
    assert "warning: the snapshot holds uncommitted changes (untracked: exp/notes.txt)" in err
    # -o out.txt is the out.txt the program wrote where it started (exp/), kept at its place in the repo.
    copies = list(Path(bare_remote_root).glob(f"outputs/*/{record['name']}/exp/out.txt"))
    assert len(copies) == 1, list(Path(bare_remote_root).glob("outputs/**"))
    assert copies[0].read_text() == "made-in-exp\n"
    assert "not found in the work dir" not in r.stderr


def test_rv_ps_with_nothing_live_and_rv_logs_of_a_run_that_never_started_say_so(layout, tmp_path):
    # Issue 33: a bare header; nothing at all, exit 0.
    proj = git_project(tmp_path / "p", {"README": "x\n"})
    ps = layout.run_rv("ps", cwd=proj)
    # The cluster user's other jobs (tests running beside this one) are rows too: the hint comes when
    # there are none.
    rows = ps.stdout.strip().splitlines()[1:]
    assert ps.returncode == 0 and bool(rows) != ("nothing queued or running: rv ps -a adds" in ps.stderr), ps
    r = layout.run_rv("run", "-g", "0", "--mem", "100M", "--name", "later", "--sbatch=--begin=now+1hour",
                      "--", "echo", "ran", cwd=proj)  # fmt: skip
    assert r.returncode == 0, r.stderr
    waiting = layout.run_rv("logs", "later", cwd=proj)
    assert (
        waiting.returncode == 0 and "run later has not started yet: rv logs -f later waits" in waiting.stderr
    )
    assert layout.run_rv("stop", "later", cwd=proj).returncode == 0
    never = layout.run_rv("logs", "later", cwd=proj)
    assert never.returncode == 9 and "run later never started (" in never.stderr, never.stderr
    assert "it has no output" in never.stderr and never.stdout == ""


@pytest.mark.parametrize("layout", ["bare"], indirect=True)
def test_an_output_pattern_copies_every_match_and_one_matching_nothing_is_said(layout, tmp_path):
    make = (
        "import os; os.makedirs('out/ep 1', exist_ok=True)\n"
        "for n in ('a.pt', 'b.pt', 'log.txt', 'ep 1/c.pt'): open(os.path.join('out', n), 'w').write(n)\n"
    )
    project = git_project(tmp_path / "proj", {"make.py": make})
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
