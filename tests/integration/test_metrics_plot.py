"""`rv metrics --plot` on the real clusters: a bare --plot plots the default metric (issue 41: it was
click's "requires an argument"), --plot METRIC that one. Both layouts, as the cluster user."""

from __future__ import annotations

import re

from projects import git_project

WRITES = """\
import json, os
with open(os.environ["RV_METRICS"], "a") as fh:
    for step in range(1, 6):
        fh.write(json.dumps({"step": step, "loss": 1.0 / step, "acc": step / 10}) + "\\n")
print("wrote")
"""


def test_a_bare_plot_plots_the_default_metric_and_plot_metric_that_one(layout, tmp_path):
    proj = git_project(tmp_path / "p", {"m.py": WRITES})
    r = layout.run_rv("run", "-g", "0", "--mem", "200M", "--name", "plotted", "-f", "--", "python3", "m.py",
                      cwd=proj, timeout=300)  # fmt: skip
    assert r.returncode == 0 and r.stdout == "wrote\n", r.stderr[-2000:]
    bare = layout.run_rv("metrics", "plotted", "--plot")
    assert bare.returncode == 0, bare.stderr
    assert re.search(r"^loss\s", bare.stdout, re.M) and "\nloss by step:\n" in bare.stdout, bare.stdout
    first = layout.run_rv("metrics", "--plot", "--", "plotted")  # before the run, ended by --
    assert first.returncode == 0 and "\nloss by step:\n" in first.stdout, first.stderr
    named = layout.run_rv("metrics", "plotted", "--plot", "acc")
    assert named.returncode == 0 and "\nacc by step:\n" in named.stdout, named.stderr
    unknown = layout.run_rv("metrics", "plotted", "--plot", "nope")
    assert unknown.returncode == 2 and "--plot nope: no such metric; there are acc, loss" in unknown.stderr
