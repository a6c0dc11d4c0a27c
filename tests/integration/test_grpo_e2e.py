"""Issue 5 end to end: the GRPO example trained through rv on both nodes of the loopback cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_grpo_four_ranks_two_nodes(run_rv, remote_root, tmp_path):
    # A project holding just the trainer and the example, as a user's repo would.
    proj = tmp_path / "proj"
    shutil.copytree(REPO / "rv_train", proj / "rv_train", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "examples" / "grpo", proj / "examples" / "grpo")
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=proj, check=True)
    subprocess.run(["git", "add", "."], cwd=proj, check=True)
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "grpo"], cwd=proj, check=True
    )

    r = run_rv(
        "run", "-g", "4", "-t", "a6000", "--mem", "3G", "--name", "grpo", "-f", "--",
        "torchrun", "examples/grpo/train.py", "--steps", "6", "--save-every", "3",
        cwd=proj, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    job = re.search(r"submitted run grpo: job (\d+)", r.stderr).group(1)

    # Trained across both nodes: one world of 4 ranks, node logs from both.
    logs = {p.name for p in Path(remote_root).glob("runs/*/logs/*")}
    assert {f"{job}-node0.out", f"{job}-node1.out"} <= logs

    # rv logs shows the trainer's per-step lines (rank 0 logs; it lives on node 0).
    out = run_rv("logs", job, cwd=proj)
    assert out.returncode == 0
    assert len(re.findall(r"step\s+[1-6]\b", out.stdout)) >= 6, out.stdout[-2000:]

    # metrics.jsonl in the job's output dir, one row per step.
    metrics = next(Path(remote_root).glob("outputs/*/grpo")) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all("reward_mean" in row for row in rows)

    # Checkpoints landed in RV_CHECKPOINT_DIR: <root>/checkpoints/<project>/<name>.
    ckpt_root = Path(remote_root) / "checkpoints"
    run_dirs = list(ckpt_root.glob("*/grpo"))
    assert len(run_dirs) == 1, list(ckpt_root.rglob("*"))
    saved = [p for p in run_dirs[0].iterdir() if p.is_dir()]
    assert saved, list(run_dirs[0].iterdir())
