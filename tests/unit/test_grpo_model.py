"""The built-in model and sampling: KV cache, left padding, EOS handling, reproducibility."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from rv_train.model import KVCache, TinyLM, build_tiny, forward_logits
from rv_train.objective import position_ids_from_mask
from rv_train.rollout import left_pad, sample, sampling_seed

V, BOS, EOS, PAD = 14, 10, 12, 13
CPU = torch.device("cpu")


def _model(seed: int = 0) -> TinyLM:
    return build_tiny(V, 24, seed, dim=32, n_layers=2, n_heads=4).eval()


def test_kv_cache_decoding_matches_a_full_forward():
    model = _model()
    ids = torch.randint(0, 10, (3, 9))
    full = model(ids)  # [3, 9, V]
    cache = KVCache()
    steps = [model(ids[:, :5], kv_cache=cache)]
    for t in range(5, 9):
        steps.append(model(ids[:, t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_left_padding_with_position_ids_changes_nothing():
    model = _model()
    prompt = [BOS, 3, 1, 4, 1, 11]
    ids, mask = left_pad([prompt, [BOS, 2, 11]], PAD, CPU)
    assert mask[1].tolist() == [0, 0, 0, 1, 1, 1]
    alone = model(torch.tensor([[BOS, 2, 11]]))
    padded = model(ids, mask, position_ids_from_mask(mask))
    torch.testing.assert_close(padded[1, 3:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()  # padding queries attend to themselves: no empty softmax rows
    # Without position ids the padded prompt is shifted right and its logits move (bug #12 in the notes).
    shifted = model(ids, mask)
    assert not torch.allclose(shifted[1, 3:], alone[0], atol=1e-3)


def test_forward_logits_keeps_the_last_positions():
    model = _model()
    ids, mask = left_pad([[BOS, 1, 2, 3]], PAD, CPU)
    full = model(ids, mask, position_ids_from_mask(mask))
    kept = forward_logits(model, ids, mask, position_ids_from_mask(mask), keep=2)
    torch.testing.assert_close(kept, full[:, -2:])


def test_samples_are_grouped_prompt_major_and_reproducible():
    model = _model()
    ids, mask = left_pad([[BOS, 1, 2, 11], [BOS, 7, 11]], PAD, CPU)
    kwargs = dict(num_generations=4, max_new_tokens=5, temperature=1.0, eos_ids=(EOS,), pad_id=PAD)
    a = sample(model, ids, mask, seed=sampling_seed(0, 1, 0), **kwargs)
    b = sample(model, ids, mask, seed=sampling_seed(0, 1, 0), **kwargs)
    c = sample(model, ids, mask, seed=sampling_seed(0, 1, 1), **kwargs)  # another rank, another stream
    assert a.completion_ids.shape[0] == 8
    assert torch.equal(a.prompt_ids[:4], ids[:1].expand(4, -1)) and torch.equal(
        a.prompt_ids[4:], ids[1:].expand(4, -1)
    )
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len({tuple(r) for r in a.completion_ids[:4].tolist()}) > 1  # G samples differ
    # The rollout's sequences line up with the prompt and completion.
    assert torch.equal(a.input_ids[:, -5:], a.completion_ids) and a.attention_mask.shape == a.input_ids.shape


def test_shared_prefill_gives_the_samples_of_separate_prefills():
    # One prefill per prompt, its cache repeated G times, must sample exactly what prefilling each of the
    # G copies on its own samples: same seed, bit for bit (fp32). Prompts of different lengths, so the
    # repeated cache carries left padding.
    model = _model()
    ids, mask = left_pad([[BOS, 1, 2, 3, 11], [BOS, 7, 11], [BOS, 4, 4, 11]], PAD, CPU)
    kwargs = dict(num_generations=4, max_new_tokens=6, temperature=1.0, eos_ids=(EOS,), pad_id=PAD, seed=3)
    shared = sample(model, ids, mask, mode="shared", **kwargs)
    copies = sample(model, ids, mask, mode="copies", **kwargs)
    assert torch.equal(shared.completion_ids, copies.completion_ids)
    assert torch.equal(shared.finished, copies.finished)
    assert len({tuple(r) for r in shared.completion_ids.tolist()}) > 3  # real sampling, not one fixed row


def test_the_built_in_model_has_no_generate_fallback():
    ids, mask = left_pad([[BOS, 1, 11]], PAD, CPU)
    with pytest.raises(ValueError, match="generate: Hugging Face models only"):
        sample(_model(), ids, mask, num_generations=2, max_new_tokens=2, temperature=1.0, eos_ids=(EOS,),
               pad_id=PAD, seed=0, mode="generate")  # fmt: skip


class ScriptedLM(TinyLM):
    """A TinyLM whose next token is fixed by position: script[p] is emitted after position p."""

    def __init__(self, script: dict[int, int], filler: int = 1) -> None:
        super().__init__(_model().config)
        self.script, self.filler = script, filler

    def forward(self, input_ids, attention_mask=None, position_ids=None, kv_cache=None, logits_to_keep=0):
        super().forward(input_ids, attention_mask, position_ids, kv_cache, logits_to_keep)  # fill the cache
        pos = position_ids[:, -logits_to_keep:] if logits_to_keep else position_ids
        nxt = pos.clone().apply_(lambda p: self.script.get(p, self.filler))
        return F.one_hot(nxt, V).float() * 50.0


def test_generation_masks_after_the_first_eos_and_stops_when_all_rows_finished():
    # Row A's prompt ends at position 2, row B's at 4: A emits 5, EOS; B emits 6, 6, EOS.
    model = ScriptedLM({2: 5, 3: EOS, 4: 6, 5: 6, 6: EOS})
    ids, mask = left_pad([[BOS, 1, 11], [BOS, 1, 2, 3, 11]], PAD, CPU)
    out = sample(
        model,
        ids,
        mask,
        num_generations=1,
        max_new_tokens=6,
        temperature=0,
        eos_ids=(EOS,),
        pad_id=PAD,
        seed=0,
    )
    assert out.completion_ids.tolist() == [[5, EOS, PAD], [6, 6, EOS]]
    assert out.completion_mask.tolist() == [[True, True, False], [True, True, True]]
    assert out.finished.tolist() == [True, True]


def test_an_eos_inside_the_prompt_does_not_end_the_completion():
    model = ScriptedLM({}, filler=4)  # never emits EOS
    ids, mask = left_pad([[BOS, EOS, 1, 11]], PAD, CPU)
    out = sample(
        model,
        ids,
        mask,
        num_generations=2,
        max_new_tokens=3,
        temperature=1.0,
        eos_ids=(EOS,),
        pad_id=PAD,
        seed=0,
    )
    assert out.completion_ids.tolist() == [[4, 4, 4]] * 2
    assert out.completion_mask.all() and not out.finished.any()


def test_built_in_model_depends_only_on_the_seed():
    state = torch.get_rng_state()
    a, b, c = _model(1), _model(1), _model(2)
    assert torch.equal(torch.get_rng_state(), state)  # building it draws nothing from the global RNG
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
