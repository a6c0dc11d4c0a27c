"""One TRL GRPOTrainer run for ``benchmarks/grpo.py`` (which starts it; not meant to be run by hand).

    python benchmarks/grpo_trl.py --model DIR --prompts FILE.jsonl --steps 100 --seed 0 --output-dir OUT
    torchrun --nproc-per-node 2 benchmarks/grpo_trl.py ...      # two gloo ranks

Needs TRL: ``pip install -r benchmarks/requirements-trl.txt`` (it pins torch to 2.13.0, so pip keeps
the installed build). TRL is never a dependency of rv or rv_train.

The settings mirror rv_train's defaults, so both trainers optimise the same objective: dapo loss,
group-std advantages, β 0.04 to a reference rebuilt from the same folder, ε 0.2, μ 1, AdamW at a
constant lr, gradient clip 1.0, temperature 1 with no top-k/top-p, 16 prompts × 8 samples per step
over all ranks, fp32 on CPU. The prompts come in the file's order (no shuffling): the driver writes
them in the order rv_train draws them. The reward is rv_train's own partial-credit function.

Writes ``metrics.jsonl`` (rank 0: step, reward, completion length, step seconds) and
``peak_rank<r>.json`` (each rank's peak RSS) to the output folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL of {prompt, answer}, in training order")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--beta", type=float, default=0.04)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rv_train.tasks.reversal import position_credit

    out = Path(args.output_dir)
    rows = [json.loads(line) for line in Path(args.prompts).read_text(encoding="utf-8").splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eos = tokenizer.eos_token_id

    def credit(prompts, completions, completion_ids, answer, **_):
        # completion_ids stop after the first EOS (TRL masks the rest), so a finished one ends with it.
        return [
            position_credit(text, target, bool(ids) and ids[-1] == eos)
            for text, ids, target in zip(completions, completion_ids, answer, strict=True)
        ]

    credit.__name__ = "copy"  # the metric name TRL logs

    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets it; plain python is one process
    sequences = args.prompts_per_step * args.num_generations
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=sequences // world,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        shuffle_dataset=False,
        disable_dropout=True,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        ddp_backend="gloo" if world > 1 else None,
        dataloader_num_workers=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        log_completions=False,
        disable_tqdm=True,
    )

    class Record(TrainerCallback):
        """Step seconds from on_step_begin to on_step_end (generation, scoring, update), as rv_train's
        step_s spans its step; the logged metrics of the same step; each rank's peak RSS at the end."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.step_s = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s = time.perf_counter() - self.t0

        def on_log(self, args, state, control, logs=None, **kw):
            if state.is_world_process_zero and logs and "reward" in logs:
                row = {
                    "step": state.global_step,
                    "reward_mean": logs["reward"],
                    "completion_len": logs["completions/mean_length"],
                    "step_s": self.step_s,
                }
                with (out / "metrics.jsonl").open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")

        def on_train_end(self, args, state, control, **kw):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
            (out / f"peak_rank{args.process_index}.json").write_text(json.dumps({"peak_mem_gb": peak}))

    out.mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=credit,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trainer.train()


if __name__ == "__main__":
    main()
