"""GRPO trainer: ``main()`` runs setup → train → cleanup.

    python -m rv_train --steps 200                              # one process: CPU, or one GPU
    torchrun --nproc-per-node 2 -m rv_train --strategy fsdp     # two ranks, DDP or FSDP2
    python examples/grpo/train.py ...                           # the same, from a plain copy of the repo

One step, on every rank:

1. take this rank's P = prompts_per_step / world_size prompts from the global order;
2. sample G completions of each — the whole group on this rank, from one prefill of the prompt —
   score them, compute advantages;
3. compute old (μ > 1) and reference (β > 0) log-probs, without gradients;
4. take μ optimizer steps on the batch, accumulating gradients over micro-batches;
5. all-reduce the metrics and every stop decision, log on rank 0, checkpoint when due.

The maths and how it departs from the paper are in objective.py, generation under FSDP in rollout.py,
precision and what Accelerate does in dist.py, the checkpoint layout in checkpoint.py, signals in
signals.py, exit codes in ``rv_train/__init__.py``.

Environment: ``RV_OUTPUT_DIR`` is the default output folder (else ``$RV_JOB_DIR/output``, else
``outputs/grpo``); ``RV_CHECKPOINT_DIR`` the default checkpoint folder (else ``<output>/checkpoints``);
``RV_PRECISION`` / ``ACCELERATE_MIXED_PRECISION`` ask for a precision (dist.py); ``RV_METRICS`` is where
metrics.jsonl goes (metrics.py); trackers (``--log-with``) write under ``RV_OUTPUT_DIR`` when it is set
(trackers.py); ``RV_TRAIN_TEST_OOM_ABOVE`` is a test hook (microbatch.py); torchrun sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``. A run always resumes from the newest complete checkpoint in
its checkpoint folder: resubmitting the same command continues it; a fresh folder starts over.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NoReturn

import torch
from torch import Tensor, nn

from rv_train import EXIT_NON_FINITE, EXIT_OK, EXIT_USAGE, EXIT_ZERO_REWARD
from rv_train import checkpoint as ckpt
from rv_train.dist import (
    PRECISIONS,
    STRATEGIES,
    DistEnv,
    Precision,
    all_reduce_max,
    all_reduce_sum,
    autocast,
    broadcast_object,
    choose_precision,
    cleanup_distributed,
    full_norm,
    gather_objects,
    gradient_sync,
    init_distributed,
    make_scaler,
    param_checksum,
    peak_memory_gb,
    unwrap,
    wrap_model,
)
from rv_train.metrics import MetricsLog
from rv_train.microbatch import (
    AUTO,
    NothingFits,
    is_out_of_memory,
    largest_that_fits,
    parse_micro_batch_size,
    raise_if_test_oom,
)
from rv_train.model import build_tiny, describe, forward_logits, load_hf
from rv_train.objective import (
    LOSS_TYPES,
    SCALE_REWARDS,
    aggregate_loss,
    batch_std_from_sums,
    clipped_surrogate,
    clipped_tokens,
    entropy_from_logits,
    group_advantages,
    k3_kl,
    token_logprobs,
    token_normaliser,
    zero_spread_groups,
)
from rv_train.rollout import (
    Rollout,
    Sampler,
    choose_sampler,
    generation_model,
    left_pad,
    sample,
    sampling_seed,
)
from rv_train.signals import StopSignals, default_signals, parse_signals
from rv_train.tasks import Example, TaskContext, get_task, prompt_indices
from rv_train.trackers import Trackers, check_trackers, tracker_folder


def _opt(default, help: str, **argparse_kwargs):
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True)
class Config:
    # what to train
    task: str = _opt("reversal", "task name (reversal, copy, gsm8k) or module:Class or file.py:Class")
    task_option: tuple[str, ...] = _opt(
        (), "KEY=VALUE passed to the task (repeatable), e.g. digits=8", metavar="KEY=VALUE"
    )
    data_path: str | None = _opt(None, "data file for tasks that read one (gsm8k: a JSONL file)")
    model: str = _opt("tiny", "'tiny' (built-in, from scratch) or a Hugging Face model folder or hub id")
    tiny_dim: int = _opt(64, "built-in model: width")
    tiny_layers: int = _opt(2, "built-in model: blocks")
    tiny_heads: int = _opt(4, "built-in model: attention heads")
    chat_template: str = _opt(
        "auto", "HF models: wrap prompts in the chat template", choices=("auto", "on", "off")
    )
    gradient_checkpointing: bool = _opt(False, "HF models: recompute activations in backward to save memory")
    # how long, how much
    steps: int = _opt(200, "train until this global step (a resumed run counts from its checkpoint)")
    prompts_per_step: int = _opt(16, "prompts per step over all ranks; must divide by the world size")
    num_generations: int = _opt(8, "G: completions per prompt (a group), all sampled on one rank")
    max_new_tokens: int | None = _opt(
        None, "completion limit (default: the task's, K+1 for reversal)", type=int
    )
    temperature: float = _opt(1.0, "sampling temperature; log-probs use the same")
    micro_batch_size: int | str = _opt(
        0,
        "sequences per forward/backward (0 = the whole local batch; auto = the largest that fits, halving "
        "on out-of-memory; the effective batch stays the same)",
        type=parse_micro_batch_size,
        metavar="N|auto",
    )
    # objective
    lr: float = _opt(3e-3, "AdamW learning rate (1e-6 for a 0.5B model)")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(1.0, "clip the gradient norm (0 = off)")
    beta: float = _opt(0.04, "k3 KL coefficient to the frozen reference (0: no reference model)")
    epsilon: float = _opt(0.2, "lower clip: ratio >= 1 - epsilon")
    epsilon_high: float | None = _opt(
        None, "upper clip: ratio <= 1 + epsilon_high (default: epsilon; DAPO 0.28)", type=float
    )
    num_iterations: int = _opt(1, "μ: optimizer steps per batch (> 1 makes the clip matter)")
    loss_type: str = _opt("dapo", "loss aggregation", choices=LOSS_TYPES)
    scale_rewards: str = _opt(
        "group", "divide advantages by the group std, the batch std, or nothing", choices=SCALE_REWARDS
    )
    mask_truncated_completions: bool = _opt(False, "leave completions without EOS out of the loss")
    # distributed and precision
    strategy: str = _opt(
        "ddp", "data parallel (ddp) or sharded (fsdp, FSDP2 fully_shard)", choices=STRATEGIES
    )
    precision: str = _opt(
        "auto", "auto: RV_PRECISION, else the device (see dist.py)", choices=("auto", *PRECISIONS)
    )
    threads: int = _opt(0, "torch CPU threads per rank (0: torch's default)")
    dist_timeout: float = _opt(1800.0, "seconds a collective may wait before the run fails")
    seed: int = _opt(0, "seed for weights of the built-in model, data order and sampling")
    # outputs, checkpoints, stopping
    output_dir: str | None = _opt(None, "metrics.jsonl, samples.jsonl, summary.json (default: RV_OUTPUT_DIR)")
    checkpoint_dir: str | None = _opt(
        None, "checkpoints (default: RV_CHECKPOINT_DIR, else <output>/checkpoints)"
    )
    save_every: int = _opt(50, "checkpoint every N steps (0: only at the end and on a stop)")
    skip_final_save: bool = _opt(
        False, "no checkpoint or model export when the run ends normally (benchmarks); stops still save"
    )
    keep_last: int = _opt(3, "complete checkpoints to keep (0: all)")
    breaker_steps: int = _opt(30, "stop (exit 3) after N steps in a row with mean reward 0 (0: never)")
    max_nonfinite_steps: int = _opt(
        10, "stop (exit 4) after N steps in a row skipped for non-finite values (0: never)"
    )
    stop_at_reward: float | None = _opt(None, "stop once a step's mean reward reaches this", type=float)
    signals: str = _opt(
        ",".join(default_signals()), "signals that save and stop (default: RV_STOP_SIGNAL, USR1, USR2, TERM)"
    )
    log_samples_every: int = _opt(10, "write a few samples to samples.jsonl every N steps (0: never)")
    log_with: tuple[str, ...] = _opt(
        (),
        "also send every step's metrics to this Accelerate tracker (repeatable): tensorboard, wandb (offline "
        "unless WANDB_MODE says otherwise), mlflow, ...; files under RV_OUTPUT_DIR, else the output folder",
        metavar="TRACKER",
    )
    tracker_project: str = _opt("rv-grpo", "--log-with: the W&B project, MLflow experiment or folder name")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rv_train", description="GRPO on a causal LM under torchrun (DDP or FSDP).", allow_abbrev=False
    )
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        if f.default is False:
            parser.add_argument(flag, action="store_true", help=help_text)
        elif isinstance(f.default, tuple):  # repeatable: --task-option, --log-with
            parser.add_argument(flag, action="append", default=[], help=help_text, **meta)
        else:
            kind = meta.pop("type", None) or (str if f.default is None else type(f.default))
            parser.add_argument(flag, type=kind, default=f.default, help=help_text, **meta)
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    ns = build_parser().parse_args(argv)
    repeated = {f.name: tuple(getattr(ns, f.name)) for f in fields(Config) if isinstance(f.default, tuple)}
    return Config(**{**vars(ns), **repeated})


def usage_error(message: str) -> NoReturn:
    """A problem with the command line: one line on stderr and exit code 2, as argparse does."""
    print(f"rv_train: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE)


@dataclass
class Run:
    """What setup() builds and train() uses."""

    cfg: Config
    env: DistEnv
    precision: Precision
    task: object
    examples: list[Example]
    tokenizer: object
    model: nn.Module  # wrapped: DDP or FSDP
    ref: nn.Module | None  # frozen, rebuilt from the original weights; None when beta == 0
    optimizer: torch.optim.Optimizer
    scaler: object
    state: ckpt.TrainState
    log: MetricsLog
    output_dir: Path
    checkpoint_dir: Path
    max_new_tokens: int
    sampler: Sampler  # how the G samples of a prompt are drawn (rollout.py), chosen once


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # The handlers stay installed through cleanup: when one rank exits first, torchrun SIGTERMs the
    # others, and a rank already past training would otherwise die with -15 instead of its own code.
    try:
        signals = parse_signals(cfg.signals)
    except ValueError as err:
        usage_error(f"--signals: {err}")
    with StopSignals(signals) as stop:
        env = init_distributed(cfg.dist_timeout)
        try:
            run = setup(cfg, env)
            code = train(run, stop)
            run.log.close()
            # DDP and FSDP hold the process group: free them, and agree on it, while every rank is still
            # connected. Freed after a peer had exited, gloo's teardown hung until torchrun's SIGKILL.
            del run
            gc.collect()
            torch.distributed.barrier()
            return code
        finally:
            cleanup_distributed()


def cli() -> None:
    """``python -m rv_train`` and ``examples/grpo/train.py``: run :func:`main`, exit with its code.

    Outside the run SIGTERM is ignored (inside it, ``--signals`` catches it): as soon as one rank exits,
    torchrun SIGTERMs the others, and a rank still tearing down the interpreter would report -15 instead
    of the exit code every rank agreed on. Ignoring it first means the run's handler is restored to
    "ignore", with no moment in between where the default applies.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(main())


# ---------------------------------------------------------------------------------------------------
# setup


def setup(cfg: Config, env: DistEnv) -> Run:
    output_dir = Path(cfg.output_dir or os.environ.get("RV_OUTPUT_DIR") or _job_output() or "outputs/grpo")
    checkpoint_dir = Path(
        cfg.checkpoint_dir or os.environ.get("RV_CHECKPOINT_DIR") or output_dir / "checkpoints"
    )
    _validate(cfg, env)
    capability = torch.cuda.get_device_capability(env.device) if env.device.type == "cuda" else None
    precision = choose_precision(cfg.precision, os.environ, env.device.type, capability)

    try:
        task = get_task(cfg.task)(TaskContext(cfg.seed, cfg.data_path, _task_options(cfg.task_option)))
        examples = task.examples()
    except (ValueError, OSError) as err:  # a bad --task, --task-option or --data-path: say so, no traceback
        usage_error(f"--task {cfg.task}: {err}")
    max_new_tokens = cfg.max_new_tokens or task.max_new_tokens
    policy, tokenizer = _build_policy(cfg, task, examples, max_new_tokens)
    ref = None
    if cfg.beta > 0:
        # Rebuilt from the original weights, never copied from the (possibly resumed) policy.
        ref, _ = _build_policy(cfg, task, examples, max_new_tokens)
        ref_dtype = torch.bfloat16 if precision.name == "bf16" else torch.float32  # fp16 may overflow (Qwen)
        ref.to(device=env.device, dtype=ref_dtype).eval().requires_grad_(False)
    if cfg.gradient_checkpointing and hasattr(policy, "gradient_checkpointing_enable"):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model_name = describe(policy)
    model = wrap_model(policy, cfg.strategy, precision, env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = make_scaler(precision, cfg.strategy, env.device)

    resumed = ckpt.resume(checkpoint_dir, model, optimizer, scaler, cfg, env)
    state = resumed.state

    log = MetricsLog(output_dir, env.is_main, state.step)
    if cfg.log_with:
        log.trackers = _start_trackers(cfg, env, output_dir, state.step, resumed.tracker_ids)
    log.info(
        f"rv_train: {env.world_size} rank(s), {env.backend} on {env.device.type}, strategy {cfg.strategy}"
    )
    log.info(f"precision: {precision.name} ({precision.reason})")
    log.info(f"model: {model_name}; task {cfg.task}: {len(examples):,} examples")
    # The sampler is chosen by a trial forward (rollout.choose_sampler), run as sampling runs: weights
    # local (under FSDP every rank gathers them here, in the same order), in the run's precision.
    with generation_model(model) as gen_model, autocast(precision, env.device):
        sampler = choose_sampler(gen_model)
    log.info(f"sampling: {sampler.description}")
    if cfg.log_with:
        log.info(f"trackers: {', '.join(dict.fromkeys(cfg.log_with))}, under {tracker_folder(output_dir)}")
    if resumed.path is not None:
        log.info(f"resumed from {resumed.path} at step {state.step} (data position {state.prompts_seen})")
        if cfg.micro_batch_size == AUTO and state.micro_batch_size:
            log.info(f"micro-batch: {state.micro_batch_size} sequences (auto, settled before the checkpoint)")
        for key, (old, new) in resumed.changed.items():
            log.warn(f"--{key.replace('_', '-')} was {old!r} in the checkpoint, now {new!r}")
    if env.is_main:
        (output_dir / "config.json").write_text(
            json.dumps(dataclasses.asdict(cfg), indent=1), encoding="utf-8"
        )
    return Run(
        cfg=cfg,
        env=env,
        precision=precision,
        task=task,
        examples=examples,
        tokenizer=tokenizer,
        model=model,
        ref=ref,
        optimizer=optimizer,
        scaler=scaler,
        state=state,
        log=log,
        output_dir=output_dir,
        checkpoint_dir=checkpoint_dir,
        max_new_tokens=max_new_tokens,
        sampler=sampler,
    )


def _start_trackers(
    cfg: Config, env: DistEnv, output_dir: Path, resume_step: int, saved_ids: dict[str, str]
) -> Trackers:
    """Rank 0 starts the trackers; every rank learns whether that worked, so a tracker that fails to
    start (W&B told to go online from a node without internet) ends every rank now, not rank 0 alone
    with the others waiting in the next collective until the timeout."""
    trackers, failure = Trackers([], {}), None
    if env.is_main:
        try:
            trackers = Trackers.start(
                cfg.log_with,
                folder=tracker_folder(output_dir),
                project=cfg.tracker_project,
                config=dataclasses.asdict(cfg),
                resume_step=resume_step,
                saved_ids=saved_ids,
                run_name=os.environ.get("RV_RUN_NAME"),
            )
        except Exception as err:
            traceback.print_exc()  # the whole story on rank 0's stderr; the one line below on every rank
            failure = f"{type(err).__name__}: {err}"
    failure = broadcast_object(failure, env)
    if failure is not None:
        raise SystemExit(f"rv_train: --log-with: a tracker failed to start: {failure}")
    return trackers


def _job_output() -> str | None:
    job_dir = os.environ.get("RV_JOB_DIR")
    return str(Path(job_dir) / "output") if job_dir else None


def _task_options(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            usage_error(f"--task-option {pair!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _validate(cfg: Config, env: DistEnv) -> None:
    problems = []
    if cfg.num_generations < 2:
        problems.append("--num-generations must be >= 2: a group of one has no spread to learn from")
    if cfg.prompts_per_step % env.world_size:
        problems.append(
            f"--prompts-per-step {cfg.prompts_per_step} must divide by the world size {env.world_size}: "
            "each rank samples whole groups"
        )
    if cfg.temperature <= 0:
        problems.append("--temperature must be > 0 for training (log-probs divide by it)")
    if cfg.num_iterations < 1:
        problems.append("--num-iterations must be >= 1")
    if cfg.micro_batch_size == AUTO and cfg.strategy == "fsdp":
        # Under FSDP a forward all-gathers each block: a rank that runs out of memory in the middle of
        # one leaves the others waiting in that all-gather, so the trial cannot be made safely.
        problems.append("--micro-batch-size auto works with --strategy ddp; under fsdp give a number")
    problems += check_trackers(cfg.log_with)
    if problems:
        usage_error("\n".join(problems))


def _build_policy(cfg: Config, task, examples: list[Example], max_new_tokens: int):
    """(model on CPU in fp32, tokenizer). Same weights on every rank and on every call."""
    if cfg.model == "tiny":
        tokenizer = task.builtin_tokenizer()
        longest_prompt = max(len(tokenizer.encode_prompt(e.prompt)) for e in examples)
        model = build_tiny(
            tokenizer.vocab_size,
            longest_prompt + max_new_tokens,
            cfg.seed,
            cfg.tiny_dim,
            cfg.tiny_layers,
            cfg.tiny_heads,
        )
        return model, tokenizer
    return load_hf(cfg.model, system_prompt=task.system_prompt, chat_template=cfg.chat_template)


# ---------------------------------------------------------------------------------------------------
# train


def train(run: Run, stop: StopSignals) -> int:
    cfg, env, state = run.cfg, run.env, run.state
    local_prompts = cfg.prompts_per_step // env.world_size
    g = cfg.num_generations
    run.model.train()
    metrics = None
    while state.step < cfg.steps:
        step = state.step + 1
        t_start = time.perf_counter()

        # 1. This rank's prompts: a contiguous slice of the global batch, so each group stays on one rank.
        first = state.prompts_seen + env.rank * local_prompts
        batch = [run.examples[i] for i in prompt_indices(len(run.examples), cfg.seed, first, local_prompts)]
        prompt_ids, prompt_mask = left_pad(
            [run.tokenizer.encode_prompt(e.prompt) for e in batch], run.tokenizer.pad_id, env.device
        )  # [P, Tp]

        # 2. Sample G completions per prompt (B = P·G rows, prompt-major) and score them.
        with generation_model(run.model) as gen_model, autocast(run.precision, env.device):
            rollout = sample(
                gen_model,
                prompt_ids,
                prompt_mask,
                num_generations=g,
                max_new_tokens=run.max_new_tokens,
                temperature=cfg.temperature,
                eos_ids=run.tokenizer.eos_ids,
                pad_id=run.tokenizer.pad_id,
                seed=sampling_seed(cfg.seed, step, env.rank),
                mode=run.sampler.mode,
            )
        t_generated = time.perf_counter()
        texts = [_completion_text(run.tokenizer, rollout, i) for i in range(len(rollout.finished))]
        scores = [run.task.score(t, bool(rollout.finished[i]), batch[i // g]) for i, t in enumerate(texts)]
        rewards = torch.tensor([sum(s.values()) for s in scores], device=env.device)  # [B]
        loss_mask = rollout.completion_mask  # [B, L]
        if cfg.mask_truncated_completions:
            loss_mask = loss_mask & rollout.finished[:, None]

        # 3. Advantages. The batch std and the dapo token count need every rank's numbers.
        totals = all_reduce_sum(
            {"r": rewards.sum(), "r2": (rewards**2).sum(), "n": len(rewards), "tokens": loss_mask.sum()},
            env.device,
        )
        batch_std = batch_std_from_sums(totals["r"], totals["r2"], totals["n"])
        advantages = group_advantages(rewards, g, cfg.scale_rewards, batch_std)  # [B]

        # 4. Old (μ > 1) and reference (β > 0) log-probs, without gradients.
        micro = _micro_batches(len(rewards), _micro_batch_size(run, rollout))
        old_logp = _logprobs(run.model, rollout, micro, run) if cfg.num_iterations > 1 else None  # [B, L]
        ref_logp = _logprobs(run.ref, rollout, micro, run) if run.ref is not None else None  # [B, L]

        # 5. μ optimizer steps on this batch.
        num_tokens = token_normaliser(cfg.loss_type, float(loss_mask.sum()), totals["tokens"], env.world_size)
        stats = policy_update(run, rollout, loss_mask, advantages, old_logp, ref_logp, micro, num_tokens)
        state.step = step
        state.prompts_seen += cfg.prompts_per_step
        state.skipped_steps += stats.pop("skipped")
        state.nonfinite_streak = state.nonfinite_streak + 1 if stats["nonfinite"] else 0

        # 6. Metrics and stop decisions from all-reduced numbers: identical on every rank.
        timing = {"step_s": time.perf_counter() - t_start, "gen_s": t_generated - t_start}
        metrics, received = _step_metrics(
            run, step, rollout, rewards, scores, totals, batch_std, stats, timing, stop
        )
        state.zero_reward_streak = state.zero_reward_streak + 1 if metrics["reward_mean"] == 0 else 0
        metrics["zero_reward_streak"] = state.zero_reward_streak
        run.log.step(metrics)
        if cfg.log_samples_every and step % cfg.log_samples_every == 0:
            run.log.samples(
                [
                    {
                        "step": step,
                        "prompt": batch[i // g].prompt,
                        "completion": texts[i],
                        "reward": float(rewards[i]),
                    }
                    for i in range(0, len(texts), g)  # the first sample of each of this rank's prompts
                ][:4]
            )

        reason, code = None, EXIT_OK
        # A signal during the last step changes nothing: the run is done, and a PREEMPTED marker
        # would have rv start one more job only to find nothing left to train.
        if received and step < cfg.steps:
            reason = f"signal {signal.Signals(received).name}"
        elif cfg.breaker_steps and state.zero_reward_streak >= cfg.breaker_steps:
            reason, code = "zero reward", EXIT_ZERO_REWARD
        elif cfg.max_nonfinite_steps and state.nonfinite_streak >= cfg.max_nonfinite_steps:
            reason, code = "non-finite", EXIT_NON_FINITE
        elif cfg.stop_at_reward is not None and metrics["reward_mean"] >= cfg.stop_at_reward:
            reason = "reward target"
        if reason is not None:
            return _finish(run, reason, code, _final_save(run, reason), metrics)
        if cfg.save_every and step % cfg.save_every == 0:
            _save(run)
    return _finish(run, "completed", EXIT_OK, _final_save(run, "completed"), metrics)


def policy_update(
    run: Run,
    rollout: Rollout,
    loss_mask: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    micro: list[slice],
    num_tokens: float,
) -> dict[str, float]:
    """μ optimizer steps over the micro-batches; returns this rank's sums for the metrics."""
    cfg = run.cfg
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    stats = dict.fromkeys(
        ("loss", "kl", "kl_max", "entropy", "clip_low", "clip_high", "tokens", "grad_norm"), 0.0
    )
    stats["skipped"] = stats["nonfinite"] = 0
    for _ in range(cfg.num_iterations):
        nonfinite = False
        for n, idx in enumerate(micro):
            mask = loss_mask[idx]  # [b, L]
            with gradient_sync(run.model, enabled=n == len(micro) - 1):
                with autocast(run.precision, run.env.device):
                    logits = _completion_logits(run.model, rollout, idx)  # [b, L, V]
                logp = token_logprobs(logits, rollout.completion_ids[idx], cfg.temperature)  # [b, L] fp32
                old = old_logp[idx] if old_logp is not None else logp.detach()  # μ = 1: ratio exactly 1
                per_token = clipped_surrogate(logp, old, advantages[idx], cfg.epsilon, eps_high)  # [b, L]
                if ref_logp is not None:
                    kl = k3_kl(logp, ref_logp[idx])  # [b, L]
                    per_token = per_token + cfg.beta * kl
                loss = aggregate_loss(
                    per_token,
                    mask,
                    cfg.loss_type,
                    num_sequences=len(advantages),
                    num_tokens=num_tokens,
                    max_len=run.max_new_tokens,
                )
                # Backward runs even when this micro-batch is bad: DDP and FSDP reduce inside it, and a
                # rank that skipped it alone would leave the others waiting.
                (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
            nonfinite |= not bool(torch.isfinite(loss) & torch.isfinite(logp[mask]).all())
            with torch.no_grad():
                low, high = clipped_tokens(logp, old, advantages[idx], cfg.epsilon, eps_high)
                stats["loss"] += float(loss)
                stats["entropy"] += float((entropy_from_logits(logits, cfg.temperature) * mask).sum())
                stats["clip_low"] += float((low & mask).sum())
                stats["clip_high"] += float((high & mask).sum())
                stats["tokens"] += float(mask.sum())
                if ref_logp is not None:
                    stats["kl"] += float((kl * mask).sum())
                    stats["kl_max"] = max(stats["kl_max"], float((kl * mask).max()))
        applied, grad_norm = optimizer_step(
            run.model, run.optimizer, run.scaler, nonfinite, cfg.max_grad_norm, run.env
        )
        stats["skipped"] += not applied  # non-finite loss, logits or gradients (the fp16 scaler's too)
        stats["nonfinite"] = max(stats["nonfinite"], int(not applied))
        stats["grad_norm"] = grad_norm
    return stats


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler,
    nonfinite: bool,
    max_grad_norm: float,
    env: DistEnv,
) -> tuple[bool, float]:
    """Apply the accumulated gradients unless a rank saw a non-finite loss, logits or gradient norm.

    Returns (applied, gradient norm before clipping). The decision is the same on every rank: the
    non-finite flag is all-reduced, the gradient norm is computed from reduced gradients, and the scaler
    skips on found-inf, which the reduction spreads to every rank. A skipped step changes no weight.
    """
    any_nonfinite = all_reduce_max({"bad": float(nonfinite)}, env.device)["bad"] > 0
    if any_nonfinite:
        optimizer.zero_grad(set_to_none=True)
        return False, float("nan")
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    norm = full_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skipped inside when a gradient is inf/NaN; the scale then backs off
        scaler.update()
        applied = scaler.get_scale() >= scale
    elif not math.isfinite(norm):
        applied = False
    else:
        optimizer.step()
        applied = True
    optimizer.zero_grad(set_to_none=True)
    return applied, norm


def _step_metrics(run, step, rollout, rewards, scores, totals, batch_std, stats, timing, stop):
    """One all-reduce of sums and one of maxima -> (the step's metrics, the signal any rank received)."""
    env, g = run.env, run.cfg.num_generations
    zero_spread = zero_spread_groups(rewards, g)
    sums = all_reduce_sum(
        {
            "groups": len(zero_spread),
            "zero_spread": zero_spread.sum(),
            "completion_tokens": rollout.completion_mask.sum(),
            "finished": rollout.finished.sum(),
            **{k: stats[k] for k in ("loss", "kl", "entropy", "clip_low", "clip_high", "tokens")},
            **{f"reward_{name}": sum(s[name] for s in scores) for name in scores[0]},
        },
        env.device,
    )
    maxes = all_reduce_max(
        {
            "signal": stop.received,
            "kl_max": stats["kl_max"],
            "peak_mem_gb": peak_memory_gb(env.device),
            **timing,
        },
        env.device,
    )
    n_seq = totals["n"]
    tokens = max(sums["tokens"], 1.0)  # loss tokens over all iterations and ranks
    metrics = {
        "step": step,
        "reward_mean": totals["r"] / n_seq,
        "reward_std": batch_std,
        **{k: v / n_seq for k, v in sums.items() if k.startswith("reward_")},
        "frac_zero_std": sums["zero_spread"] / sums["groups"],
        "kl": sums["kl"] / tokens,
        "kl_max": maxes["kl_max"],
        "clip_frac": (sums["clip_low"] + sums["clip_high"]) / tokens,
        "clip_low": sums["clip_low"] / tokens,
        "clip_high": sums["clip_high"] / tokens,
        "entropy": sums["entropy"] / tokens,
        "loss": sums["loss"] / (run.cfg.num_iterations * env.world_size),
        "grad_norm": stats["grad_norm"],
        "completion_len": sums["completion_tokens"] / n_seq,
        "eos_rate": sums["finished"] / n_seq,
        "tokens_per_s": sums["completion_tokens"] / maxes["step_s"],
        "gen_s": maxes["gen_s"],
        "step_s": maxes["step_s"],
        "peak_mem_gb": maxes["peak_mem_gb"],
        "skipped_steps": run.state.skipped_steps,
    }
    if run.scaler is not None:
        metrics["loss_scale"] = float(run.scaler.get_scale())
    return metrics, int(maxes["signal"])


def _micro_batches(n: int, size: int) -> list[slice]:
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _micro_batch_size(run: Run, rollout: Rollout) -> int:
    """--micro-batch-size as a number: given, or settled by ``auto`` on the run's first step."""
    if run.cfg.micro_batch_size != AUTO:
        return int(run.cfg.micro_batch_size)
    if not run.state.micro_batch_size:
        local = len(rollout.finished)
        worst = _longest_rollout(rollout, run.max_new_tokens, run.tokenizer.pad_id)
        try:
            size = largest_that_fits(lambda n: _try_micro_batch(run, worst, n), local)
        except NothingFits as err:
            raise SystemExit(
                f"rv_train: --micro-batch-size auto: {err}; use a smaller model, --gradient-checkpointing, "
                "or fewer --max-new-tokens"
            ) from err
        run.state.micro_batch_size = size
        run.log.info(
            f"micro-batch: auto settled on {size} sequences "
            f"({math.ceil(local / size)} accumulation steps over this rank's {local} per step)"
        )
    return run.state.micro_batch_size


def _longest_rollout(rollout: Rollout, max_new_tokens: int, pad_id: int) -> Rollout:
    """The rollout with every completion as long as the run allows: the most memory a step can need."""
    extra = max_new_tokens - rollout.completion_ids.shape[1]
    ids = torch.nn.functional.pad(rollout.completion_ids, (0, extra), value=pad_id)  # [B, max_new_tokens]
    full = torch.ones_like(ids, dtype=torch.bool)
    return Rollout(rollout.prompt_ids, rollout.prompt_mask, ids, full, rollout.finished)


def _try_micro_batch(run: Run, rollout: Rollout, size: int) -> None:
    """A training forward and backward of ``size`` sequences; out of memory on every rank if on any.

    Changes nothing: no gradient sync (DDP's no_sync: no collective inside), gradients dropped after,
    the RNG forked. The ranks then agree on the outcome, so every rank halves, or none does.
    """
    ran_out = False
    devices = [run.env.device] if run.env.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), gradient_sync(run.model, enabled=False):
        try:
            with autocast(run.precision, run.env.device):
                logits = _completion_logits(run.model, rollout, slice(0, size))
            token_logprobs(logits, rollout.completion_ids[:size], run.cfg.temperature).sum().backward()
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            ran_out = True  # said below, on every rank, once the ranks agree
        finally:
            run.optimizer.zero_grad(set_to_none=True)
    if all_reduce_max({"ran_out": float(ran_out)}, run.env.device)["ran_out"] > 0:
        raise torch.OutOfMemoryError(f"a micro-batch of {size} sequences ran out of memory.")


def _completion_logits(model: nn.Module, rollout: Rollout, idx: slice) -> Tensor:
    """Logits that predict each completion token: [b, L, V] (position t predicts token t+1)."""
    raise_if_test_oom(len(rollout.finished[idx]))
    length = rollout.completion_ids.shape[1]
    logits = forward_logits(
        model, rollout.input_ids[idx], rollout.attention_mask[idx], rollout.position_ids[idx], keep=length + 1
    )
    return logits[:, :-1]


@torch.no_grad()
def _logprobs(model: nn.Module, rollout: Rollout, micro: list[slice], run: Run) -> Tensor:
    parts = []
    for idx in micro:
        with autocast(run.precision, run.env.device):
            logits = _completion_logits(model, rollout, idx)
        parts.append(token_logprobs(logits, rollout.completion_ids[idx], run.cfg.temperature))
    return torch.cat(parts)  # [B, L]


def _completion_text(tokenizer, rollout: Rollout, i: int) -> str:
    """The text a reward function sees: the completion before its EOS."""
    n = int(rollout.completion_mask[i].sum()) - int(rollout.finished[i])
    return tokenizer.decode(rollout.completion_ids[i, :n].tolist())


# ---------------------------------------------------------------------------------------------------
# checkpoint and cleanup


def _save(run: Run) -> Path:
    t0 = time.perf_counter()
    path = ckpt.save_run(
        run.checkpoint_dir, run.state, run.model, run.optimizer, run.scaler, run.cfg,
        run.log.trackers.run_ids, run.cfg.keep_last,
    )  # fmt: skip
    run.log.info(f"saved {path} in {time.perf_counter() - t0:.1f} s")
    return path


def _final_save(run: Run, reason: str) -> Path | None:
    """The checkpoint the run ends with. ``--skip-final-save`` drops it at a normal end (steps done or the
    reward target reached), where a benchmark has no use for it; a signal, the breaker and a non-finite
    stop always save: the stop protocol and the resume hints rely on that checkpoint."""
    if run.cfg.skip_final_save and reason in ("completed", "reward target"):
        return None
    return _save(run)


def _export_hf(run: Run) -> Path:
    """The trained weights as a Hugging Face folder (``from_pretrained`` loads it), written by rank 0.

    Collective: under FSDP the full state dict is gathered onto rank 0's CPU. Skipped after a signal,
    when the time left before the job's limit belongs to the checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    target = run.output_dir / "final_model"
    if run.env.is_main:
        unwrap(run.model).save_pretrained(target, state_dict=full)
        run.tokenizer.tok.save_pretrained(target)
        run.log.info(f"saved the trained model for from_pretrained() in {target}")
    return target


def _finish(run: Run, reason: str, code: int, path: Path | None, metrics: dict | None) -> int:
    """Say why the run ended and how to go on; write summary.json and, on a signal, the marker.

    The final checkpoint's path is said once, by :func:`_save` just before ("saved PATH in 0.2 s"):
    these lines only say that it was saved."""
    cfg, env, state, log = run.cfg, run.env, run.state, run.log
    checksums = gather_objects(param_checksum(run.model), env)
    if reason.startswith("signal"):
        if env.is_main:
            ckpt.write_preempted(run.checkpoint_dir, state.step, reason=reason, checkpoint=str(path))
        log.info(
            f"stopped by {reason.split()[1]} at step {state.step}, checkpoint saved. "
            f"Run the same command again to resume from {run.checkpoint_dir}."
        )
    elif code == EXIT_ZERO_REWARD:
        first = state.step - state.zero_reward_streak + 1
        log.warn(
            f"circuit breaker: the mean reward was 0 for {state.zero_reward_streak} steps in a row "
            f"(steps {first}-{state.step}), so every group had zero spread and nothing was learned. "
            f"Check the reward function and the prompt format against {run.output_dir / 'samples.jsonl'}. "
            "The checkpoint is saved: run the same command again to resume (raise --breaker-steps to allow "
            "more). "
            f"Exit code {EXIT_ZERO_REWARD}."
        )
    elif code == EXIT_NON_FINITE:
        log.warn(
            f"{state.nonfinite_streak} steps in a row had a non-finite loss, logits or gradients and were "
            "skipped. On a GPU below compute capability 8.0 try --precision fp32 (Qwen overflows in fp16), "
            f"or lower --lr. The checkpoint is saved. Exit code {EXIT_NON_FINITE}."
        )
    else:
        saved = "" if path is not None else "; no final checkpoint (--skip-final-save)"
        log.info(f"finished at step {state.step} ({reason}){saved}")
    if len(set(checksums)) > 1:
        log.warn(f"the ranks' parameters differ (a bug): {checksums}")
    exported = None
    if cfg.model != "tiny" and code == EXIT_OK and not reason.startswith("signal") and path is not None:
        exported = _export_hf(run)
    if env.is_main:
        summary = {
            "reason": reason,
            "exit_code": code,
            "step": state.step,
            "checkpoint": str(path) if path is not None else None,
            "reward_mean": metrics["reward_mean"] if metrics else None,
            "skipped_steps": state.skipped_steps,
            "resumes": state.resumes,
            "world_size": env.world_size,
            "strategy": cfg.strategy,
            "precision": run.precision.name,
            # auto's settled size, else the number given (0: the whole local batch)
            "micro_batch_size": state.micro_batch_size or cfg.micro_batch_size,
            "param_checksums": checksums,
            "final_model": str(exported) if exported else None,
        }
        ckpt.write_atomic(run.output_dir / "summary.json", json.dumps(summary, indent=1))
    return code
