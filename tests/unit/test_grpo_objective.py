"""The GRPO maths on tensors small enough to check by hand, and the bug list of other trainers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rv_train.objective import (
    ADVANTAGE_EPS,
    aggregate_loss,
    batch_std_from_sums,
    clipped_surrogate,
    clipped_tokens,
    completion_mask,
    entropy_from_logits,
    group_advantages,
    k3_kl,
    position_ids_from_mask,
    token_logprobs,
    token_normaliser,
    zero_spread_groups,
)
from rv_train.rollout import _next_token

# --- advantages ------------------------------------------------------------------------------------


def test_group_advantage_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, group_size=4)
    # group 1: mean 0.25, unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + ADVANTAGE_EPS)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))  # zero spread: exactly 0, not 0/0


def test_zero_spread_group_with_non_dyadic_reward_is_exactly_zero():
    # 0.1 is not representable: mean − r leaves a ~1e-9 residue that /1e-4 would turn into noise.
    rewards = torch.full((8,), 0.1)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 8, scale, batch_std=0.3)
        assert torch.equal(adv, torch.zeros(8)), scale
    assert zero_spread_groups(rewards, 8).tolist() == [True]


def test_seven_against_one_gives_finite_advantages_summing_to_zero():
    rewards = torch.tensor([0.3] * 7 + [0.7])
    adv = group_advantages(rewards, 8)
    assert torch.isfinite(adv).all()
    assert adv[7] > 0 > adv[0]
    assert abs(float(adv.sum())) < 1e-5


def test_groups_are_adjacent_rows_repeat_interleave_layout():
    # Two prompts, G=2, built prompt-major as repeat_interleave makes them: [p0 p0 p1 p1].
    # Group p1 has no spread and must get 0; the strided layout [p0 p1 p0 p1] would mix them (R1-V#67).
    prompts = torch.tensor([0, 1]).repeat_interleave(2)
    assert prompts.tolist() == [0, 0, 1, 1]
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0])
    adv = group_advantages(rewards, 2)
    assert adv[2:].tolist() == [0.0, 0.0]
    assert adv[0] > 0 > adv[1]


def test_scale_none_and_batch():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(
        group_advantages(rewards, 4, "none"), torch.tensor([0.75, -0.25, -0.25, -0.25])
    )
    torch.testing.assert_close(
        group_advantages(rewards, 4, "batch", batch_std=2.0),
        torch.tensor([0.75, -0.25, -0.25, -0.25]) / 2.0001,
    )
    with pytest.raises(ValueError, match="std of the whole batch"):
        group_advantages(rewards, 4, "batch")
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 4, "rank")


def test_batch_std_from_sums_matches_std_over_ranks():
    rank0, rank1 = torch.tensor([0.1, 0.9, 0.4]), torch.tensor([0.2, 0.2, 0.8, 1.0])
    both = torch.cat([rank0, rank1]).double()
    sums = [float(x) for x in (both.sum(), (both**2).sum(), len(both))]
    assert math.isclose(batch_std_from_sums(*sums), float(both.std()), rel_tol=1e-9)
    assert batch_std_from_sums(1.0, 1.0, 1) == 0.0


# --- masks and positions ---------------------------------------------------------------------------

EOS = PAD = 7  # pad == eos, the case that dropped EOS from the loss in tiny-grpo


def test_mask_keeps_the_first_eos_when_pad_equals_eos():
    ids = torch.tensor([[3, EOS, PAD, PAD], [EOS, PAD, PAD, PAD], [1, 2, 3, 4]])
    mask, finished = completion_mask(ids, [EOS])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert finished.tolist() == [True, True, False]
    assert (ids != PAD).tolist()[0] == [True, False, False, False]  # the value test would drop the EOS


def test_mask_uses_the_first_of_several_eos_ids():
    ids = torch.tensor([[5, 9, 8, 9]])
    mask, finished = completion_mask(ids, [8, 9])
    assert mask.tolist() == [[1, 1, 0, 0]] and finished.tolist() == [True]


def test_position_ids_start_at_the_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


# --- log-probs, temperature, entropy ---------------------------------------------------------------


def test_token_logprobs_divides_by_temperature_first():
    logits = torch.tensor([[[0.0, math.log(2.0), math.log(5.0)]]])  # probs 1/8, 2/8, 5/8 at T=1
    target = torch.tensor([[2]])
    torch.testing.assert_close(token_logprobs(logits, target, 1.0), torch.tensor([[math.log(5 / 8)]]))
    t = 0.7
    expected = torch.log_softmax(logits / t, dim=-1)[..., 2]
    torch.testing.assert_close(token_logprobs(logits, target, t), expected)
    assert not torch.allclose(token_logprobs(logits, target, t), token_logprobs(logits, target, 1.0))
    assert token_logprobs(logits.bfloat16(), target, t).dtype == torch.float32


def test_sampler_and_scorer_agree_on_the_temperature():
    # The frequencies the sampler produces at T=0.7 are the probabilities token_logprobs gives at T=0.7,
    # and not those at T=1 (TRL#3029: scoring without the temperature biases the ratio).
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]]).expand(40_000, 4)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(_next_token(logits, 0.7, gen), minlength=4).float() / 40_000
    scored = token_logprobs(logits[:1, None].expand(1, 4, 4), torch.arange(4)[None], 0.7).exp()[0]
    unscaled = torch.softmax(logits[0], dim=-1)
    assert (counts - scored).abs().max() < 0.01
    assert (counts - unscaled).abs().max() > 0.03


def test_ratio_is_exactly_one_on_the_first_pass():
    logp = token_logprobs(torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3)), 0.7)
    assert torch.equal(torch.exp(logp - logp.detach()), torch.ones(2, 3))


def test_entropy_matches_brute_force():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    p = torch.softmax(logits / 1.5, dim=-1)
    brute = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, 1.5), brute)
    assert math.isclose(float(entropy_from_logits(logits)[0, 1]), math.log(3), rel_tol=1e-6)


# --- clipped surrogate -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad"),
    [
        (1.5, 1.0, -1.28, 0.0),  # clipped at 1 + ε_high = 1.28: no gradient
        (1.5, -1.0, 1.5, 1.5),  # −min(−1.5, −1.28) = 1.5: the pessimistic side keeps the gradient
        (0.5, -1.0, 0.8, 0.0),  # clipped at 1 − ε = 0.8: no gradient
        (0.5, 1.0, -0.5, -0.5),
        (1.1, 1.0, -1.1, -1.1),  # inside the clip range
    ],
)
def test_clipped_surrogate_by_hand_with_asymmetric_clip(ratio, adv, loss, grad):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([adv]), 0.2, 0.28)
    (g,) = torch.autograd.grad(out.sum(), logp)  # d(−ρA)/d logp = −ρA where unclipped
    assert float(out.detach()) == pytest.approx(loss)
    assert float(g) == pytest.approx(grad)


def test_clipped_tokens_follow_trl_definitions():
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    old = torch.zeros_like(logp)
    low, high = clipped_tokens(logp.expand(2, 4), old.expand(2, 4), torch.tensor([1.0, -1.0]), 0.2, 0.28)
    assert high.tolist() == [[True, True, False, False], [False, False, False, False]]
    assert low.tolist() == [[False, False, False, False], [False, False, True, True]]


# --- KL --------------------------------------------------------------------------------------------


def test_k3_by_hand():
    kl = k3_kl(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]))
    # d = log(0.25/0.5); exp(d) − d − 1 = 0.5 + log 2 − 1
    assert float(kl) == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    assert float(k3_kl(torch.tensor([[-2.0]]), torch.tensor([[-2.0]]))) == 0.0


def test_k3_is_finite_in_fp32_for_extreme_logits():
    logp = torch.tensor([[-1e4, 0.0, -50.0]], dtype=torch.bfloat16)
    ref = torch.tensor([[0.0, -1e4, -0.0]], dtype=torch.bfloat16)
    kl = k3_kl(logp, ref)
    assert kl.dtype == torch.float32 and torch.isfinite(kl).all() and (kl >= 0).all()


@settings(max_examples=200, deadline=None)
@given(st.floats(-60, 0), st.floats(-60, 0))
def test_k3_is_never_negative(logp, ref):
    assert float(k3_kl(torch.tensor([[logp]]), torch.tensor([[ref]]))) >= 0.0


# --- aggregation -----------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("loss_type", "num_tokens", "expected"),
    [
        ("grpo", 4.0, (2.0 + 4.0) / 2),  # mean per sequence, then mean
        ("dapo", 4.0, 10.0 / 4),  # token sum / tokens
        ("bnpo", 4.0, 10.0 / 4),
        ("dr_grpo", 4.0, 10.0 / (2 * 3)),  # token sum / (sequences × max_len)
    ],
)
def test_aggregation_by_hand(loss_type, num_tokens, expected):
    out = aggregate_loss(LOSS, MASK, loss_type, num_sequences=2, num_tokens=num_tokens, max_len=3)
    assert float(out) == pytest.approx(expected)


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        aggregate_loss(LOSS, MASK, "ppo", num_sequences=2, num_tokens=4.0, max_len=3)


def _random_batch(seed: int, b: int = 6, length: int = 5):
    gen = torch.Generator().manual_seed(seed)
    per_token = torch.randn(b, length, generator=gen)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return per_token, mask


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_micro_batches_sum_to_the_whole_batch(loss_type):
    per_token, mask = _random_batch(0)
    tokens = token_normaliser(loss_type, float(mask.sum()), float(mask.sum()), 1)
    whole = aggregate_loss(per_token, mask, loss_type, num_sequences=6, num_tokens=tokens, max_len=5)
    parts = sum(
        aggregate_loss(per_token[s], mask[s], loss_type, num_sequences=6, num_tokens=tokens, max_len=5)
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    )
    torch.testing.assert_close(parts, whole)


def _grad_over_ranks(loss_type: str, world: int, weights: torch.Tensor, per_token: torch.Tensor, mask):
    """What DDP computes: each rank's loss on its rows, gradients averaged over ranks."""
    rows = torch.arange(len(per_token)).chunk(world)
    global_tokens = float(mask.sum())
    grads = []
    for r in rows:
        w = weights.clone().requires_grad_(True)
        local = per_token[r] * w  # a linear "model" so the gradient is easy to compare
        tokens = token_normaliser(loss_type, float(mask[r].sum()), global_tokens, world)
        loss = aggregate_loss(local, mask[r], loss_type, num_sequences=len(r), num_tokens=tokens, max_len=5)
        (g,) = torch.autograd.grad(loss, w)
        grads.append(g)
    return torch.stack(grads).mean(0)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_loss_is_invariant_to_world_size(loss_type):
    per_token, _ = _random_batch(1)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 5, 5, 1, 1, 1])[:, None]  # uneven tokens per rank
    weights = torch.randn(5)
    torch.testing.assert_close(
        _grad_over_ranks(loss_type, 2, weights, per_token, mask),
        _grad_over_ranks(loss_type, 1, weights, per_token, mask),
    )


def test_bnpo_depends_on_how_tokens_fall_across_ranks():
    # Documented behaviour (TRL's too): bnpo normalises by the local token count, here 15 vs 3.
    per_token, _ = _random_batch(1)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 5, 5, 1, 1, 1])[:, None]
    weights = torch.randn(5)
    assert not torch.allclose(
        _grad_over_ranks("bnpo", 2, weights, per_token, mask),
        _grad_over_ranks("bnpo", 1, weights, per_token, mask),
    )
