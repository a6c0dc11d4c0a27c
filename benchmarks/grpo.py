"""GRPO on CPU: steps and seconds to a mean reward of 0.9 on digit reversal, and generated tokens per
second, for 1 and 2 ranks (torchrun, gloo, one thread per rank), side by side.

    python benchmarks/grpo.py                      # seeds 0 1 2, 1 and 2 ranks
    python benchmarks/grpo.py --seeds 0 --json     # one seed, machine-readable

Both configurations train on the same global batch (16 prompts × 8 samples per step), so the steps to
0.9 measure the same learning problem and the seconds show what a second rank buys. "Train seconds"
sums the logged step times (generation, scoring, update, all-reduces); "wall" adds process start-up,
model build and the final checkpoint. Tokens per second counts completion tokens over all ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(ranks: int, seed: int, target: float, max_steps: int, workdir: Path) -> dict:
    out = workdir / f"r{ranks}-s{seed}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "rv_train", "--seed", str(seed), "--steps", str(max_steps), "--stop-at-reward", str(target),
        "--save-every", "0", "--log-samples-every", "0", "--threads", "1", "--output-dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    env = {k: v for k, v in env.items() if not k.startswith(("RV_", "ACCELERATE_"))}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{ranks} rank(s), seed {seed} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    sequences = 16 * 8  # the trainer's default global batch
    tokens = sum(r["completion_len"] * sequences for r in rows)
    train_s = sum(r["step_s"] for r in rows)
    gen_s = sum(r["gen_s"] for r in rows)
    reached = summary["reason"] == "reward target"
    return {
        "ranks": ranks,
        "seed": seed,
        "reached": reached,
        "steps": summary["step"] if reached else None,
        "train_s": train_s,
        "wall_s": wall,
        "tokens_per_s": tokens / train_s,
        "gen_tokens_per_s": tokens / gen_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="print every run as JSON lines")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        for ranks in args.ranks:
            for seed in args.seeds:
                r = run_once(ranks, seed, args.target, args.max_steps, Path(tmp))
                results.append(r)
                print(json.dumps(r) if args.json else _row(r), flush=True)

    print(f"\nmedians over seeds {args.seeds} (reward target {args.target}, CPU, 1 thread per rank, "
          f"{os.cpu_count()} cores):")  # fmt: skip
    medians = {}
    for ranks in args.ranks:
        mine = [r for r in results if r["ranks"] == ranks]
        done = [r for r in mine if r["reached"]]
        medians[ranks] = m = {
            "reached": f"{len(done)}/{len(mine)}",
            "steps": statistics.median(r["steps"] for r in done) if done else None,
            "train_s": statistics.median(r["train_s"] for r in done) if done else None,
            "wall_s": statistics.median(r["wall_s"] for r in done) if done else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "gen_tokens_per_s": statistics.median(r["gen_tokens_per_s"] for r in mine),
        }
        print(f"  {ranks} rank(s): reached {m['reached']}, " + _fmt(m))
    if 1 in medians and 2 in medians and medians[1]["train_s"] and medians[2]["train_s"]:
        a, b = medians[1], medians[2]
        print(
            f"  2 ranks / 1 rank: steps ×{b['steps'] / a['steps']:.2f}, "
            f"train seconds ×{b['train_s'] / a['train_s']:.2f}, "
            f"tokens/s ×{b['tokens_per_s'] / a['tokens_per_s']:.2f}"
        )


def _row(r: dict) -> str:
    steps = f"{r['steps']} steps" if r["reached"] else "not reached"
    return (
        f"{r['ranks']} rank(s) seed {r['seed']}: {steps}, train {r['train_s']:.1f} s, "
        f"wall {r['wall_s']:.1f} s, {r['tokens_per_s']:,.0f} tok/s "
        f"({r['gen_tokens_per_s']:,.0f} during generation)"
    )


def _fmt(m: dict) -> str:
    if m["steps"] is None:
        return f"{m['tokens_per_s']:,.0f} tok/s"
    return (
        f"{m['steps']:.0f} steps, train {m['train_s']:.1f} s, wall {m['wall_s']:.1f} s, "
        f"{m['tokens_per_s']:,.0f} tok/s ({m['gen_tokens_per_s']:,.0f} during generation)"
    )


if __name__ == "__main__":
    main()
