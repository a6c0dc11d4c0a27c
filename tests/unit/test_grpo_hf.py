"""The Hugging Face path, on a tiny random Qwen2 built on the spot (no download).

SKIPPED WHEN ``transformers`` IS NOT INSTALLED: it is an optional dependency of rv_train, and the shared
test environment does not have it, so there these tests report "skipped" and the Hugging Face path is
untested. Install ``transformers`` to run them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch
from train_helpers import explain, read_jsonl, summary, torchrun

from rv_train.model import forward_logits, load_hf
from rv_train.objective import position_ids_from_mask
from rv_train.rollout import choose_sampler, left_pad, sample
from rv_train.trainer import main

pytest.importorskip(
    "transformers",
    reason="transformers is not installed (optional): the Hugging Face path is NOT tested here",
)

VOCAB = [*"0123456789=", "<s>", "</s>"]  # EOS doubles as PAD, as in Qwen: the case that hid EOS from losses


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A random Qwen2 (RoPE, tied embeddings) with a character tokenizer and Qwen's sampling defaults."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-qwen")
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.save_pretrained(folder)
    config = transformers.Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    # Qwen2.5-Instruct ships these; sampling must not use them or the ratio is biased.
    model.generation_config = transformers.GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=1,
        repetition_penalty=1.05,
        eos_token_id=vocab["</s>"],
    )
    model.save_pretrained(folder)
    return folder


def test_load_hf_gives_fp32_weights_eos_and_pad(tiny_qwen):
    model, tok = load_hf(str(tiny_qwen), chat_template="off")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.eos_ids == (VOCAB.index("</s>"),) and tok.pad_id == VOCAB.index("</s>")
    assert tok.decode(tok.encode_prompt("12=")) == "12="


def test_left_padding_with_position_ids(tiny_qwen):
    model, tok = load_hf(str(tiny_qwen), chat_template="off")
    long_p, short_p = tok.encode_prompt("31415="), tok.encode_prompt("27=")
    ids, mask = left_pad([long_p, short_p], tok.pad_id, torch.device("cpu"))
    padded = forward_logits(model.eval(), ids, mask, position_ids_from_mask(mask), keep=len(short_p))
    alone_ids = torch.tensor([short_p])
    alone = forward_logits(
        model, alone_ids, torch.ones_like(alone_ids), position_ids_from_mask(alone_ids * 0 + 1), len(short_p)
    )
    torch.testing.assert_close(padded[1], alone[0], atol=1e-5, rtol=1e-4)


def test_sampling_ignores_the_models_own_generation_config(tiny_qwen):
    model, tok = load_hf(str(tiny_qwen), chat_template="off")
    saved = model.generation_config
    ids, mask = left_pad([tok.encode_prompt("12=")], tok.pad_id, torch.device("cpu"))
    out = sample(
        model.eval(),
        ids,
        mask,
        num_generations=8,
        max_new_tokens=4,
        temperature=1.0,
        eos_ids=tok.eos_ids,
        pad_id=tok.pad_id,
        seed=1,
    )
    # The model's config says top_k=1 (greedy): 8 identical rows. Ours samples the full distribution.
    assert len({tuple(r) for r in out.completion_ids.tolist()}) > 1
    assert model.generation_config is saved
    mask_rows = out.completion_mask.sum(1)
    for row, n, fin in zip(out.completion_ids, mask_rows, out.finished, strict=True):
        if fin:  # the EOS is inside the mask, even though it equals the pad id
            assert row[n - 1] == tok.eos_ids[0]


def test_shared_prefill_gives_the_samples_of_separate_prefills(tiny_qwen):
    # One prefill per prompt with its DynamicCache repeated G times must sample exactly what prefilling
    # each copy samples: same seed, bit for bit (fp32), left padding in the repeated cache.
    model, tok = load_hf(str(tiny_qwen), chat_template="off")
    assert choose_sampler(model).mode == "shared"
    prompts = [tok.encode_prompt(p) for p in ("31415=", "27=", "8=")]
    ids, mask = left_pad(prompts, tok.pad_id, torch.device("cpu"))
    kwargs = dict(num_generations=4, max_new_tokens=6, temperature=1.0, eos_ids=tok.eos_ids)
    kwargs["pad_id"] = tok.pad_id
    shared = sample(model.eval(), ids, mask, seed=5, mode="shared", **kwargs)
    copies = sample(model, ids, mask, seed=5, mode="copies", **kwargs)
    assert torch.equal(shared.completion_ids, copies.completion_ids)
    assert torch.equal(shared.finished, copies.finished)
    assert len({tuple(r) for r in shared.completion_ids.tolist()}) > 3  # real sampling, not one fixed row
    other = sample(model, ids, mask, seed=6, mode="shared", **kwargs)
    assert not torch.equal(shared.completion_ids, other.completion_ids)  # the seed drives the samples


def _mamba():
    import transformers

    return transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1)
    )


def _lfm2():
    import transformers

    if not hasattr(transformers, "Lfm2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no LFM2 (a model with convolution state)")
    config = transformers.Lfm2Config(
        vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    return transformers.Lfm2ForCausalLM(config)


@pytest.mark.parametrize("build", [_mamba, _lfm2])
def test_models_whose_cache_cannot_be_repeated_fall_back_to_generate(build):
    # Mamba's recurrent state and LFM2's convolution state cannot be repeated per row: the trial
    # forward says why (transformers 5.24: "its cache cannot be repeated per row (AttributeError: ...)";
    # 4.57: Mamba ignores the cache, LFM2 fails with it), and sampling falls back to generate().
    model = build().eval()
    sampler = choose_sampler(model)
    reasons = (
        "its cache cannot be repeated per row",
        "does not use a DynamicCache",
        "fails with a DynamicCache",
    )
    assert sampler.mode == "generate" and any(r in sampler.description for r in reasons), sampler
    ids, mask = left_pad([[1, 2, 10], [3, 10]], 12, torch.device("cpu"))
    kwargs = dict(num_generations=3, max_new_tokens=4, temperature=1.0, eos_ids=(12,), pad_id=12, seed=2)
    out = sample(model, ids, mask, mode=sampler.mode, **kwargs)
    assert out.completion_ids.shape[0] == 6
    assert torch.equal(out.completion_ids, sample(model, ids, mask, mode="generate", **kwargs).completion_ids)


class _KwargsOnly(torch.nn.Module):
    """A model whose forward names nothing (everything through **kwargs), as transformers 5.24's
    Qwen2 does for the old ``past_key_values``: its signature says nothing about a cache."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, **kwargs):
        return self.inner(**kwargs)


class _IgnoresTheCache(torch.nn.Module):
    """A forward that names both cache keywords and uses neither: it builds a cache of its own."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, cache=None,
                use_cache=None):  # fmt: skip
        return self.inner(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        )


def test_what_the_model_does_decides_the_sampler_not_its_signature(tiny_qwen):
    # Before, rv_train read forward's signature: the first model here lost the shared prefill (as
    # every Qwen2 did with transformers 5.24), the second was given it and failed while sampling.
    model, tok = load_hf(str(tiny_qwen), chat_template="off")
    hidden, ignoring = _KwargsOnly(model.eval()), _IgnoresTheCache(model)
    assert choose_sampler(hidden).mode == "shared"
    sampler = choose_sampler(ignoring)
    assert sampler.mode == "generate"
    assert "_IgnoresTheCache.forward does not use a DynamicCache it is given" in sampler.description
    ids, mask = left_pad(
        [tok.encode_prompt("31415="), tok.encode_prompt("8=")], tok.pad_id, torch.device("cpu")
    )
    kwargs = dict(
        num_generations=3, max_new_tokens=5, temperature=1.0, eos_ids=tok.eos_ids, pad_id=tok.pad_id
    )
    through = sample(hidden, ids, mask, seed=3, mode="shared", **kwargs)
    direct = sample(model, ids, mask, seed=3, mode="copies", **kwargs)
    assert torch.equal(through.completion_ids, direct.completion_ids)


def test_the_training_forward_keeps_only_the_logits_asked_for_when_the_signature_hides_it(tiny_qwen):
    model, tok = load_hf(str(tiny_qwen), chat_template="off")
    seen = []
    model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(dict(kw)), with_kwargs=True)
    hidden = _KwargsOnly(model.eval())
    ids = torch.tensor([tok.encode_prompt("31415=")])
    logits = forward_logits(
        hidden, ids, torch.ones_like(ids), position_ids_from_mask(torch.ones_like(ids)), 2
    )
    assert logits.shape[:2] == (1, 2)
    assert seen[-1]["use_cache"] is False and seen[-1]["logits_to_keep"] == 2


def test_trainer_runs_on_a_hugging_face_model(tiny_qwen, tmp_path, capsys):
    code = main(
        ["--model", str(tiny_qwen), "--task", "copy", "--chat-template", "off", "--steps", "3",
         "--num-iterations", "2", "--micro-batch-size", "32", "--output-dir", str(tmp_path), "--threads", "1"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("sampling: one prefill per prompt, its DynamicCache repeated") == 1  # said once
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["kl"] > 0  # the reference (rebuilt from the folder) and the policy have moved apart
    trained, _ = load_hf(str(tmp_path / "final_model"), chat_template="off")  # the export loads back
    original, _ = load_hf(str(tiny_qwen), chat_template="off")
    moved = [not torch.equal(a, b) for a, b in zip(trained.parameters(), original.parameters(), strict=True)]
    assert any(moved)


def test_resume_on_a_hugging_face_model_is_bit_exact(tiny_qwen, tmp_path):
    # The shared-prefill sampler draws from a generator seeded per (seed, step, rank): a resumed run
    # samples, and so learns, exactly what an uninterrupted one does.
    args = ["--model", str(tiny_qwen), "--task", "copy", "--chat-template", "off", "--save-every", "0",
            "--log-samples-every", "0", "--threads", "1"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*args, "--steps", "4", "--output-dir", str(straight)]) == 0
    assert main([*args, "--steps", "2", "--output-dir", str(resumed)]) == 0
    assert main([*args, "--steps", "4", "--output-dir", str(resumed)]) == 0
    a, b = summary(straight), summary(resumed)
    assert b["resumes"] == 1 and a["param_checksums"] == b["param_checksums"]
    rows_a, rows_b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["reward_mean"] for r in rows_a] == [r["reward_mean"] for r in rows_b]


def test_skip_final_save_skips_the_export_too(tiny_qwen, tmp_path):
    code = main(
        ["--model", str(tiny_qwen), "--task", "copy", "--chat-template", "off", "--steps", "2",
         "--save-every", "0", "--skip-final-save", "--output-dir", str(tmp_path), "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    assert not (tmp_path / "final_model").exists() and not (tmp_path / "checkpoints").exists()
    assert summary(tmp_path)["final_model"] is None


@pytest.mark.slow
def test_fsdp_on_a_hugging_face_model(tiny_qwen, tmp_path):
    proc = torchrun(
        2, "--model", str(tiny_qwen), "--task", "copy", "--chat-template", "off", "--strategy", "fsdp",
        "--steps", "3", "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    result = summary(tmp_path)
    assert result["step"] == 3 and len(set(result["param_checksums"])) == 1
    assert (tmp_path / "final_model" / "config.json").is_file()  # gathered from the shards onto rank 0


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("RV_TEST_NEWEST") != "1",
    reason="RV_TEST_NEWEST=1 runs these tests against the newest transformers on PyPI (CI tests the "
    "release pinned in constraints.txt, the newest on the day it was pinned)",
)
def test_the_hugging_face_path_on_the_newest_transformers_release(tmp_path):
    # Before a bump of constraints.txt: the newest transformers (and what it needs) in a venv of its
    # own, on top of this one's torch, runs this file's cache tests there. Not in CI by default: a
    # release must not turn CI red by itself, and the index must not be a dependency of every run.
    newest = tmp_path / "newest"
    subprocess.run([sys.executable, "-m", "venv", str(newest)], check=True)
    python = newest / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    # Installed before this venv's packages are visible to it, so pip never touches them.
    pip = [str(python), "-m", "pip", "install", "-q", "--upgrade", "transformers", "tokenizers"]
    subprocess.run(pip, check=True, env=env)
    site = newest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "zz-rv-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    version = subprocess.run(
        [str(python), "-c", "import transformers; print(transformers.__version__)"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    print(f"newest transformers on the index: {version}")
    tests = "shared_prefill or signature or fall_back or hides_it or trainer_runs"
    proc = subprocess.run(
        [str(python), "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", tests],
        capture_output=True, text=True, env={**env, "RV_TEST_NEWEST": "0"},
    )  # fmt: skip
    assert proc.returncode == 0, f"transformers {version}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], proc.stdout[-500:]
