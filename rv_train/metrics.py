"""Rank-0 logging: one line per step on stdout, the same as JSON lines in the output folder, and the
experiment trackers ``--log-with`` names (trackers.py). Other ranks log nothing.

Files in the output folder: ``metrics.jsonl`` (one object per step), ``samples.jsonl`` (a few prompts,
completions and rewards every ``--log-samples-every`` steps), ``summary.json`` (how the run ended).
Under rv the metrics go to ``$RV_METRICS`` (rv sets it in every job; by default it is that same
``metrics.jsonl`` of the run's output folder), where ``rv sweep results`` and ``rv metrics`` read them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from rv_train.trackers import Trackers


def format_line(m: dict) -> str:
    """The one line a step prints. Keys follow metrics.jsonl."""
    parts = [
        f"step {m['step']:>5}",
        f"reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}",
        f"zero-spread {m['frac_zero_std']:.2f}",
        f"kl {m['kl']:.4f}",
        f"clip {m['clip_frac']:.3f}",
        f"entropy {m['entropy']:.3f}",
        f"len {m['completion_len']:.1f}",
        f"{m['tokens_per_s']:,.0f} tok/s",
        f"mem {m['peak_mem_gb']:.2f} GB",
    ]
    if m.get("skipped_steps"):
        parts.append(f"skipped {int(m['skipped_steps'])}")
    return " | ".join(parts)


class MetricsLog:
    def __init__(self, output_dir: Path, is_main: bool, resume_step: int) -> None:
        self.is_main = is_main
        self.trackers = Trackers([], {})  # set by the trainer on rank 0 when --log-with names some
        named = os.environ.get("RV_METRICS")
        self.metrics_path = Path(named) if named else output_dir / "metrics.jsonl"
        self.samples_path = output_dir / "samples.jsonl"
        if is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run repeats the steps after its checkpoint: drop their old lines.
            _truncate_after(self.metrics_path, resume_step)
            _truncate_after(self.samples_path, resume_step)

    def info(self, message: str) -> None:
        if self.is_main:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        if self.is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def step(self, metrics: dict) -> None:
        if not self.is_main:
            return
        print(format_line(metrics), flush=True)
        # NaN is not JSON (jq and most parsers refuse it): a skipped step's grad norm is written as null.
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(finite) + "\n")
        self.trackers.log(metrics)

    def samples(self, rows: list[dict]) -> None:
        if self.is_main and rows:
            with self.samples_path.open("a", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.trackers.finish()


def _truncate_after(path: Path, step: int) -> None:
    """Drop the lines of steps after ``step``. A line that is not a JSON object (half written when a
    segment was killed) is dropped too; one without a step is kept."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        at = row.get("step")
        if not isinstance(at, int) or at <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
