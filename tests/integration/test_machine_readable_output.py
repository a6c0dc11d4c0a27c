"""Output for scripts, on the real loopback cluster: `rv logs --json` and `rv stop --json` print one
JSON document and nothing else on stdout, and `rv run` prints the job id alone on stdout for a
script, never on a terminal."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from projects import git_project, wait_for

pytestmark = pytest.mark.integration


TALK = """\
import sys, time
print('out line 1')
print('err line', file=sys.stderr)
print('out line 2')
time.sleep(float(sys.argv[1]))
"""


def test_logs_and_stop_speak_json(run_rv, tmp_path):
    proj = git_project(tmp_path / "p", {"talk.py": TALK})
    done = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "talky", "-f", "--", "python3", "talk.py", "0", cwd=proj
    )
    assert done.returncode == 0, done.stderr
    out = run_rv("logs", "talky", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # stdout is the one document and nothing else
    assert (doc["run"], doc["stream"], doc["exit_code"]) == ("talky", "out", None)
    (segment,) = doc["segments"]
    assert segment["segment"] == 1 and segment["job_id"]
    # The log as `rv logs` shows it: the program's lines, and rv's own (the job's start and end).
    texts = [line["text"] for line in segment["lines"]]
    assert [t for t in texts if not t.startswith("rv: ")] == ["out line 1", "out line 2"], texts
    assert texts[0].startswith("rv: run talky, segment 1/10")
    assert {(line["node"], line["rank"]) for line in segment["lines"]} == {(None, None)}
    err = json.loads(run_rv("logs", "talky", "--err", "--json").stdout)
    assert [line["text"] for line in err["segments"][0]["lines"] if not line["text"].startswith("rv: ")] == [
        "err line"
    ]
    followed = json.loads(run_rv("logs", "talky", "-f", "--json").stdout)
    assert followed["ended"] is True and followed["exit_code"] == 0

    live = run_rv(
        "run", "-g", "0", "--mem", "200M", "--name", "sleepy", "--", "python3", "talk.py", "300", cwd=proj
    )
    assert live.returncode == 0, live.stderr
    job_id = live.stdout.strip()
    wait_for(lambda: "RUNNING" in run_rv("ps").stdout, 60, "the run to start", step=0.5)
    stopped = run_rv("stop", "sleepy", "--json")
    assert stopped.returncode == 0, stopped.stderr
    (row,) = json.loads(stopped.stdout)
    assert (row["name"], row["cancelled"], row["error"]) == ("sleepy", [job_id], None)
    assert row["secrets_removed"] in (True, False) and row["run_id"]
    nothing = run_rv("stop", "--all", "--yes", "--json")
    assert nothing.returncode == 0 and json.loads(nothing.stdout) == []


# --- the job id on stdout: for scripts, not on a terminal ---------------------------------------------


@pytest.mark.parametrize("front", ["python -m rv", "rv"])
def test_the_job_id_goes_to_stdout_for_a_script_and_not_to_a_terminal(run_rv, rv_env, tmp_path, front):
    import os
    import select
    import sys

    proj = git_project(tmp_path / "p", {"ok.py": "print('ok')\n"})
    piped = run_rv("run", "-g", "0", "--mem", "200M", "--", "python3", "ok.py", cwd=proj)
    assert piped.returncode == 0, piped.stderr
    assert re.fullmatch(r"\d+\n", piped.stdout), piped.stdout  # `job=$(rv run ...)` gets the id alone
    argv = (
        [sys.executable, "-m", "rv"] if front == "python -m rv" else [str(Path(sys.executable).parent / "rv")]
    )
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [*argv, "run", "-g", "0", "--mem", "200M", "--", "python3", "ok.py"], cwd=proj, env=rv_env,
        stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(slave)
    _, err = proc.communicate(timeout=120)
    shown = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert proc.returncode == 0, err
    job = re.search(r"submitted run ok-\w+: job (\d+)", err)
    assert job, err  # the id is in the line on stderr
    assert job.group(1).encode() not in shown, shown  # and not alone on the terminal


# --- rv run -f: stdout is the program's output alone --------------------------------------------------

# Two segments (a clean stop with progress, then the end), each saying one line on each stream.
TWO_SEGMENTS = """\
import os, sys
ckpt = os.environ["RV_CHECKPOINT_DIR"]
done = os.path.exists(os.path.join(ckpt, "step"))
open(os.path.join(ckpt, "step"), "w").write("1")
print("segment", os.environ["RV_SEGMENT"], "says hello")
print("segment", os.environ["RV_SEGMENT"], "warns", file=sys.stderr)
if not done:
    open(os.path.join(ckpt, "PREEMPTED"), "w").write("1")
"""


def test_run_follow_puts_the_programs_output_alone_on_stdout(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"two.py": TWO_SEGMENTS})
    r = layout.run_rv(
        "run", "-g", "0", "--mem", "200M", "--max-segments", "3", "-f", "--", "python3", "two.py",
        cwd=proj, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    # `out=$(rv run -f ...)` gets what the program printed, and nothing of rv's: no job id, no segment
    # line, no "rv: ..." line of the job's runtime.
    assert r.stdout == "segment 1 says hello\nsegment 2 says hello\n", r.stdout
    job = re.search(r"submitted run \S+: job (\d+)", r.stderr)
    assert job, r.stderr  # rv's own lines are on stderr: the job id, the segments, the program's stderr
    assert "segment 1 warns" in r.stderr and "segment 2 warns" in r.stderr
    assert "segment 2/3" in r.stderr, r.stderr
