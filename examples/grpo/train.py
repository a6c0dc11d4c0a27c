"""GRPO example: teach the built-in tiny model to reverse digits, on CPU or GPUs, one rank or many.

    python examples/grpo/train.py --steps 200 --output-dir out     # one process, about 10 s on a laptop CPU
    torchrun --nproc-per-node 2 examples/grpo/train.py              # two ranks (gloo on CPU, NCCL on GPU)
    rv run -g 2 -t a6000 -- torchrun examples/grpo/train.py         # two GPUs on the cluster

Defaults: the reversal task on the built-in model. ``--output-dir DIR`` receives ``metrics.jsonl`` (one
JSON object per step: step, reward_mean, ...). Every trainer option works here (``--help``); README.md
beside this file has the cluster recipes, Qwen2.5-0.5B on GSM8K among them.
"""

import sys
from pathlib import Path

try:
    import rv_train  # noqa: F401  (installed, or the working directory is the repo root)
except ImportError:
    # On the cluster the code is a plain copy of the repo, not pip-installed, and Python puts this
    # script's folder on sys.path, not the working directory: add the repo root, two levels up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rv_train.trainer import cli

if __name__ == "__main__":
    cli()
