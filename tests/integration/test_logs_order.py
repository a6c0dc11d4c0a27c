"""`rv logs` of a run over two nodes on the real clusters: the runtime's closing line comes after the
program's output (issue 41: "rv: run X ended" came first, each node's log being read after the batch
log whole). Both layouts, as the cluster user."""

from __future__ import annotations

from projects import git_project

SAYS = """\
import os
print("node", os.environ.get("SLURM_NODEID"), "says hello", flush=True)
"""


def test_logs_of_a_two_node_run_put_the_runs_end_after_the_programs_output(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"say.py": SAYS})
    r = layout.run_rv(
        "run", "-g", "0", "--nodes", "2", "--mem", "200M", "--each-node", "--name", "twonode", "-f", "--",
        "python3", "say.py", cwd=proj, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = layout.run_rv("logs", "twonode").stdout.splitlines()
    said = [i for i, line in enumerate(lines) if "says hello" in line]
    start = [i for i, line in enumerate(lines) if line.startswith("rv: run twonode, segment 1/")]
    end = [i for i, line in enumerate(lines) if line.startswith("rv: run twonode ended after segment 1")]
    assert len(said) == 2 and len(start) == 1 and len(end) == 1, lines
    assert start[0] < min(said) and max(said) < end[0], lines
