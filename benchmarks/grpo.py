"""GRPO on CPU, side by side: rv_train against TRL's GRPOTrainer on a tiny Hugging Face Qwen2, and
rv_train's built-in model on 1 against 2 ranks. Prints medians over seeds with their [min–max].

    python benchmarks/grpo.py                       # both comparisons, seeds 0 1 2, 1 and 2 ranks
    python benchmarks/grpo.py --suite trl --seeds 0 # rv_train vs TRL only, one seed
    python benchmarks/grpo.py --suite builtin       # built-in model only (no TRL needed)
    python benchmarks/grpo.py --json                # also every run as a JSON line
    python benchmarks/grpo.py --suite trl --baseline /tmp/base  # + rv_train of another checkout ("before")

The TRL comparison needs TRL, installed for the benchmark only (never a dependency of rv):
``pip install -r benchmarks/requirements-trl.txt`` (it pins torch to 2.13.0 so pip keeps the installed
build). Both trainers get, per seed, the same tiny Qwen2 built from a config (hidden 64, 2 layers,
13-token character vocabulary, weights from the seed; no download), saved once and loaded by both; the
same prompts in the same order (the copy task, 5 digits, drawn as rv_train draws them and handed to
TRL unshuffled; the token ids are checked equal); 16 prompts × 8 samples per step over all ranks, at
most 6 new tokens; the same objective and hyper-parameters (dapo loss, group-std advantages, β 0.04,
ε 0.2, μ 1, AdamW lr 3e-3 constant, clip 1.0, temperature 1, fp32); the same reward function. Runs are
interleaved (rv_train and TRL alternate which goes first) on one thread per rank.

Columns: s/step is the median step time (rv_train's ``step_s``, TRL's on_step_begin → on_step_end:
both cover generation, scoring and the update); tokens/s the median over steps of the step's completion
tokens (all ranks) per second, medians because other work on a shared machine stalls single steps;
peak MB is the largest rank's peak RSS; reward@N is the mean reward of steps N−4…N (one step's batch is
noisy). Ratios are taken per seed between the two adjacent runs, then the median [min–max] over seeds
is printed. A second table times rv_train's samplers alone on the same model (one process, runs
interleaved call by call): ``generate`` (Hugging Face ``generate`` on G copies of each prompt, the path
before the shared prefill and still the fallback), ``copies`` (rv_train's decoding loop, each copy
prefilled) and ``shared`` (one prefill per prompt, the cache repeated), at the task's prompt length and
at 64 tokens, where the prefill weighs more.

``--baseline DIR`` adds a third trainer to the TRL comparison: rv_train from another checkout of this
repository (``git worktree add /tmp/base main``, or ``git archive main | tar -x -C /tmp/base``), run the
same way from that folder and interleaved with the others, so a change is measured before and after in
one run; its rows are ``base`` and ``rv/base``.

The built-in comparison: steps and seconds to a mean reward of 0.9 on digit reversal, and completion
tokens per second, for 1 and 2 ranks on the same global batch. "Train seconds" sums the logged step
times; "wall" adds process start-up and model build (no final checkpoint: ``--skip-final-save``).
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
PROMPTS_PER_STEP, GENERATIONS = 16, 8  # rv_train's defaults: 128 sequences per step
COPY_DIGITS = 5  # copy task: at most 5 digits + EOS = 6 new tokens
REWARD_AT = (25, 50, 100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=("all", "trl", "builtin"), default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=100, help="steps per run against TRL")
    parser.add_argument("--target", type=float, default=0.9, help="built-in: the reward to reach")
    parser.add_argument("--max-steps", type=int, default=300, help="built-in: give up after this")
    parser.add_argument("--json", action="store_true", help="also print every run as a JSON line")
    parser.add_argument("--baseline", type=Path, help="TRL suite: also rv_train from this checkout (before)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        if args.suite in ("all", "trl"):
            versus_trl(args, Path(tmp))
        if args.suite in ("all", "builtin"):
            builtin(args, Path(tmp))


# ---------------------------------------------------------------------------------------------------
# rv_train vs TRL on a tiny Qwen2


def versus_trl(args, tmp: Path) -> None:
    import importlib.metadata

    try:
        trl_version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            "the comparison with TRL needs it: pip install -r benchmarks/requirements-trl.txt "
            "(or --suite builtin)"
        ) from None
    results = []
    for seed in args.seeds:
        model_dir, prompts = build_qwen(tmp / f"qwen-s{seed}", seed), tmp / f"prompts-s{seed}.jsonl"
        write_prompts(prompts, model_dir, seed, args.steps)
        for ranks in args.ranks:
            trainers = ["rv_train", "TRL", *(["base"] if args.baseline else [])]
            turn = (seed + ranks) % len(trainers)  # who goes first rotates, seed by seed
            for trainer in trainers[turn:] + trainers[:turn]:
                out = tmp / f"{trainer}-r{ranks}-s{seed}"
                root = args.baseline.resolve() if trainer == "base" else REPO
                r = run_hf(trainer, ranks, seed, args.steps, model_dir, prompts, out, root)
                results.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
                done = f"  {trainer}, {ranks} rank(s), seed {seed}: {r['s_per_step']:.3f} s/step"
                print(done, file=sys.stderr, flush=True)

    print(
        f"\nrv_train vs TRL {trl_version}: tiny Qwen2 from a config, copy {COPY_DIGITS} digits, "
        f"{PROMPTS_PER_STEP} prompts × {GENERATIONS} samples, ≤ {COPY_DIGITS + 1} new tokens, β 0.04, "
        f"{args.steps} steps; median [min–max] over seeds {args.seeds}; CPU, 1 thread per rank, "
        f"{os.cpu_count()} cores"
    )
    at = [n for n in REWARD_AT if n <= args.steps]
    header = ["ranks", "trainer", "s/step", "tokens/s", "peak MB", *(f"reward@{n}" for n in at)]
    table = []
    for ranks in args.ranks:
        mine = [r for r in results if r["ranks"] == ranks]
        by = {t: [r for r in mine if r["trainer"] == t] for t in ("rv_train", "base", "TRL")}
        by = {t: runs for t, runs in by.items() if runs}
        for trainer, runs in by.items():
            table.append(
                [str(ranks), trainer, _spread([r["s_per_step"] for r in runs], "{:.3f}"),
                 _spread([r["tokens_per_s"] for r in runs], "{:,.0f}"),
                 _spread([r["peak_mem_gb"] * 1024 for r in runs], "{:.0f}"),
                 *(_spread([r["reward_at"][str(n)] for r in runs], "{:.3f}") for n in at)]
            )  # fmt: skip
        for other in [t for t in ("TRL", "base") if t in by]:
            pairs = list(zip(by["rv_train"], by[other], strict=True))  # the same seeds, in the same order
            table.append(
                [str(ranks), f"rv/{other}",
                 _spread([a["s_per_step"] / b["s_per_step"] for a, b in pairs], "×{:.2f}"),
                 _spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs], "×{:.2f}"),
                 _spread([a["peak_mem_gb"] / b["peak_mem_gb"] for a, b in pairs], "×{:.2f}"),
                 *(_spread([a["reward_at"][str(n)] - b["reward_at"][str(n)] for a, b in pairs], "{:+.3f}")
                   for n in at)]
            )  # fmt: skip
    _print_table(header, table)
    print("(reward columns of the rv/X rows: rv_train's reward minus X's, per seed)")
    samplers_alone(build_qwen(tmp / "qwen-sampling", args.seeds[0]))


def samplers_alone(model_dir: Path, calls: int = 60) -> None:
    """rv_train's three samplers on one model, interleaved call by call, in this process (1 thread)."""
    import random

    import torch
    import transformers

    from rv_train.rollout import left_pad, sample

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.config.eos_token_id
    print(f"\nrv_train's samplers alone, same model: {PROMPTS_PER_STEP} prompts × {GENERATIONS}, "
          f"≤ {COPY_DIGITS + 1} new tokens, {calls} calls each; ms per call, median [p10–p90]")  # fmt: skip
    table = []
    for length in (COPY_DIGITS + 1, 64):
        rng = random.Random(length)
        # Digits then "=" (ids 0-9 and 10 in build_qwen's vocabulary), as the copy task's prompts.
        prompts = [[rng.randrange(10) for _ in range(length - 1)] + [10] for _ in range(PROMPTS_PER_STEP)]
        ids, mask = left_pad(prompts, eos, torch.device("cpu"))
        kwargs = dict(num_generations=GENERATIONS, max_new_tokens=COPY_DIGITS + 1, temperature=1.0,
                      eos_ids=(eos,), pad_id=eos, seed=1)  # fmt: skip
        times = {mode: [] for mode in ("generate", "copies", "shared")}
        for _ in range(calls):
            for mode, ts in times.items():
                start = time.perf_counter()
                sample(model, ids, mask, mode=mode, **kwargs)
                ts.append((time.perf_counter() - start) * 1e3)
        base = statistics.median(times["generate"])
        for mode, ts in times.items():
            p10, *_, p90 = statistics.quantiles(ts, n=10)
            ms = statistics.median(ts)
            table.append([str(length), mode, f"{ms:.1f} [{p10:.1f}–{p90:.1f}]", f"×{base / ms:.2f}"])
    _print_table(["prompt tokens", "sampler", "ms per call", "speed vs generate"], table)


def build_qwen(folder: Path, seed: int) -> Path:
    """A random Qwen2 (RoPE, tied embeddings, GQA) with a one-character-per-token tokenizer.

    max_position_embeddings only bounds what ``generate`` accepts without a warning (the samplers' table
    goes to 70 positions); RoPE's weights and outputs do not depend on it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([*"0123456789=", "<s>", "</s>"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    config = transformers.Qwen2Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def write_prompts(path: Path, model_dir: Path, seed: int, steps: int) -> None:
    """The prompts rv_train draws in ``steps`` steps, in its order, for TRL; checks both tokenise alike."""
    from transformers import AutoTokenizer

    from rv_train.model import HFTokenizer
    from rv_train.tasks import TaskContext, prompt_indices
    from rv_train.tasks.copy import Copy

    examples = Copy(TaskContext(seed, None, {"digits": str(COPY_DIGITS)})).examples()
    order = [examples[i] for i in prompt_indices(len(examples), seed, 0, steps * PROMPTS_PER_STEP)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ours = [HFTokenizer(tok, (tok.eos_token_id,), None, chat=False).encode_prompt(e.prompt) for e in order]
    theirs = tok(text=[e.prompt for e in order])["input_ids"]  # what GRPOTrainer calls on plain prompts
    if ours != theirs:
        raise SystemExit("rv_train and TRL would tokenise the prompts differently; the comparison is off")
    lines = (json.dumps({"prompt": e.prompt, "answer": e.answer}) for e in order)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_hf(
    trainer: str, ranks: int, seed: int, steps: int, model: Path, prompts: Path, out: Path, root: Path = REPO
) -> dict:
    """One run; ``root`` is the checkout rv_train runs from (``base``: the --baseline folder)."""
    if trainer in ("rv_train", "base"):
        args = ["-m", "rv_train", "--model", str(model), "--task", "copy", "--task-option",
                f"digits={COPY_DIGITS}", "--chat-template", "off", "--seed", str(seed), "--steps", str(steps),
                "--lr", "3e-3", "--beta", "0.04", "--save-every", "0", "--skip-final-save",
                "--log-samples-every", "0", "--threads", "1", "--output-dir", str(out)]  # fmt: skip
    else:
        args = [str(REPO / "benchmarks" / "grpo_trl.py"), "--model", str(model), "--prompts", str(prompts),
                "--steps", str(steps), "--seed", str(seed), "--max-new-tokens", str(COPY_DIGITS + 1),
                "--lr", "3e-3", "--beta", "0.04", "--output-dir", str(out)]  # fmt: skip
    _launch(ranks, args, f"{trainer}, {ranks} rank(s), seed {seed}", root=root)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise SystemExit(f"{trainer} logged steps {[r['step'] for r in rows][:5]}…, expected 1…{steps}")
    if trainer in ("rv_train", "base"):
        peak = rows[-1]["peak_mem_gb"]  # all-reduced max over ranks
    else:
        peak = max(json.loads(p.read_text())["peak_mem_gb"] for p in out.glob("peak_rank*.json"))
    at = [n for n in REWARD_AT if n <= steps]
    timed = rows[1:]  # the first step pays one-time costs (lazy inits, first allocations)
    sequences = PROMPTS_PER_STEP * GENERATIONS
    return {
        "trainer": trainer,
        "ranks": ranks,
        "seed": seed,
        "s_per_step": statistics.median(r["step_s"] for r in timed),
        "tokens_per_s": statistics.median(r["completion_len"] * sequences / r["step_s"] for r in timed),
        "peak_mem_gb": peak,
        "reward_at": {str(n): statistics.fmean(r["reward_mean"] for r in rows[n - 5 : n]) for n in at},
    }


# ---------------------------------------------------------------------------------------------------
# the built-in model, 1 vs 2 ranks


def builtin(args, tmp: Path) -> None:
    results = []
    for seed in args.seeds:  # interleaved: the rank counts alternate, seed by seed
        for ranks in args.ranks:
            r = run_builtin(ranks, seed, args.target, args.max_steps, tmp)
            results.append(r)
            print(json.dumps(r) if args.json else _row(r), file=sys.stdout if args.json else sys.stderr)

    print(f"\nbuilt-in model, reversal: medians over seeds {args.seeds} (reward target {args.target}, CPU, "
          f"1 thread per rank, {os.cpu_count()} cores):")  # fmt: skip
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


def run_builtin(ranks: int, seed: int, target: float, max_steps: int, workdir: Path) -> dict:
    out = workdir / f"builtin-r{ranks}-s{seed}"
    args = ["-m", "rv_train", "--seed", str(seed), "--steps", str(max_steps), "--stop-at-reward", str(target),
            "--save-every", "0", "--skip-final-save", "--log-samples-every", "0", "--threads", "1",
            "--output-dir", str(out)]  # fmt: skip
    start = time.perf_counter()
    _launch(ranks, args, f"built-in, {ranks} rank(s), seed {seed}", torchrun=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    tokens = sum(r["completion_len"] * PROMPTS_PER_STEP * GENERATIONS for r in rows)
    train_s = sum(r["step_s"] for r in rows)
    reached = summary["reason"] == "reward target"
    return {
        "ranks": ranks,
        "seed": seed,
        "reached": reached,
        "steps": summary["step"] if reached else None,
        "train_s": train_s,
        "wall_s": wall,
        "tokens_per_s": tokens / train_s,
        "gen_tokens_per_s": tokens / sum(r["gen_s"] for r in rows),
    }


# ---------------------------------------------------------------------------------------------------
# helpers


def _launch(ranks: int, args: list[str], what: str, torchrun: bool = False, root: Path = REPO) -> None:
    """One run: plain python for one process (as a user runs either trainer), torchrun for more.
    ``root``: the checkout whose rv_train runs (cwd and PYTHONPATH), this one unless --baseline."""
    launcher = [sys.executable]
    if ranks > 1 or torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root)}
    env = {k: v for k, v in env.items() if not k.startswith(("RV_", "ACCELERATE_"))}
    proc = subprocess.run([*launcher, *args], cwd=root, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def _spread(values: list[float], fmt: str) -> str:
    mid = fmt.format(statistics.median(values))
    if len(values) < 2:
        return mid
    return f"{mid} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _row(r: dict) -> str:
    steps = f"{r['steps']} steps" if r["reached"] else "not reached"
    return (
        f"  built-in {r['ranks']} rank(s) seed {r['seed']}: {steps}, train {r['train_s']:.1f} s, "
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
