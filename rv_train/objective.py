"""The GRPO objective as small pure functions on tensors.

Shapes: ``B`` sequences in a batch (prompts × ``G``), ``G`` samples per prompt (a group), ``L``
completion positions, ``V`` vocabulary. The rows of one group are adjacent (prompt-major, built with
``repeat_interleave``), so ``rewards.view(-1, G)`` recovers the groups (R1-V#67 mixed them up with
``repeat``).

For each prompt we sample G completions, score them, and minimise per token

    −min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A) + β·KL_k3(π_θ ‖ π_ref),   ρ = π_θ / π_old

where A is the completion's reward relative to its group (outcome supervision: one advantage for every
token of a completion). How this departs from the DeepSeekMath paper (arXiv 2402.03300), following TRL:

- the advantage divides by ``std + 1e-4`` and a group whose rewards are all equal gets exactly zero
  advantage, never 0/0 (the paper divides by the std; NeMo-RL#4161 shows fp32 residue turning into
  4000× advantages);
- ``scale_rewards`` = ``batch`` divides by the std of the whole batch and ``none`` not at all
  (Dr. GRPO, arXiv 2503.20783, which removes the difficulty bias);
- the clip is asymmetric when ``epsilon_high`` > ``epsilon`` (DAPO's clip-higher, arXiv 2503.14476);
- the default loss aggregation is ``dapo`` (token sum over the global token count), not the paper's
  per-sequence mean, which favours short correct and long wrong answers;
- the k3 KL is computed in fp32 on a clamped log-ratio, so extreme logits cannot overflow ``exp``.

Note that with ``num_iterations`` = 1 the ratio is exactly 1 and the advantages of a group sum to zero,
so the printed loss starts near zero while the gradient is not zero (open-r1#239).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")

ADVANTAGE_EPS = 1e-4  # added to the std, as TRL does
ZERO_SPREAD = 1e-6  # a group std below this is treated as zero: every member gets advantage 0
KL_LOG_RATIO_CLIP = 20.0  # exp(20) ≈ 5e8 is finite in fp32; TRL's kl_log_ratio_clip uses 20 too


def group_std(rewards: Tensor, group_size: int) -> Tensor:
    """Unbiased std of each group: rewards [B] -> [B/G] (unbiased, as TRL and DeepSeekMath use)."""
    return rewards.view(-1, group_size).std(dim=1)


def zero_spread_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[B] -> [B/G] bool: groups whose members all got the same reward, so they carry no learning signal."""
    return group_std(rewards, group_size) < ZERO_SPREAD


def batch_std_from_sums(total: float, total_sq: float, count: float) -> float:
    """Unbiased std of a batch from all-reduced sums, so ``scale_rewards=batch`` sees every rank."""
    if count < 2:
        return 0.0
    var = (total_sq - total * total / count) / (count - 1)
    return max(var, 0.0) ** 0.5


def group_advantages(
    rewards: Tensor, group_size: int, scale_rewards: str = "group", batch_std: float | None = None
) -> Tensor:
    """Advantage of each completion relative to its group: rewards [B] -> advantages [B].

    ``group``: (r − mean_g) / (std_g + 1e-4). ``batch``: (r − mean_g) / (batch_std + 1e-4), where the
    caller passes the std of the global batch. ``none``: r − mean_g. In every mode a group with zero
    spread gets exactly 0, not a residue of fp32 rounding divided by 1e-4.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, not {scale_rewards!r}")
    grouped = rewards.float().view(-1, group_size)  # [B/G, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [B/G, G]
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    elif scale_rewards == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards='batch' needs the std of the whole batch")
        centred = centred / (batch_std + ADVANTAGE_EPS)
    no_signal = zero_spread_groups(rewards.float(), group_size)[:, None]  # [B/G, 1]
    return torch.where(no_signal, torch.zeros_like(centred), centred).view(-1)


def completion_mask(completion_ids: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Which completion positions count: everything up to and including the first EOS.

    completion_ids [B, L] -> (mask [B, L] bool, finished [B] bool). Built from positions, never from
    ``ids != pad``: when pad == eos that test drops the EOS itself and the model never learns to stop
    (tiny-grpo, TRL#4970). Only generated tokens are looked at, so an EOS inside the prompt cannot end a
    completion (GRPO-Zero a3a8963). A row without EOS ran to the token limit: all L positions are real.
    """
    eos = torch.as_tensor(list(eos_ids), device=completion_ids.device, dtype=completion_ids.dtype)
    is_eos = torch.isin(completion_ids, eos)  # [B, L]
    finished = is_eos.any(dim=1)  # [B]
    length = completion_ids.shape[1]
    first_eos = torch.where(finished, is_eos.int().argmax(dim=1), length)  # [B]
    positions = torch.arange(length, device=completion_ids.device)  # [L]
    return positions[None, :] <= first_eos[:, None], finished


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[B, T] 0/1 -> [B, T] positions that start at 0 on the first real token (left padding).

    Without them a model with absolute positions sees a left-padded prompt shifted right (GPT-2 logits
    moved by 0.42 in the notes' measurement); pad slots get 0, they are masked anyway.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log π(target) under the *sampling* distribution: logits [B, L, V], targets [B, L] -> [B, L] fp32.

    The logits are divided by the sampling temperature first, for the policy, the old policy and the
    reference alike; otherwise the ratio is not 1 on the first iteration and the gradient is biased
    (TRL#3029). fp32 because logsumexp is unstable in bf16. gather − logsumexp avoids materialising the
    full log-softmax.
    """
    scaled = logits.float() / temperature  # [B, L, V]
    picked = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [B, L]
    return picked - scaled.logsumexp(dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """True entropy of the sampling distribution at each position: [B, L, V] -> [B, L] fp32.

    The entropy of the whole distribution, not the negative log-prob of the sampled token (which
    nano-aha-moment logged as "entropy").
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, L, V]
    return -(logp.exp() * logp).sum(dim=-1)


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, epsilon: float, epsilon_high: float
) -> Tensor:
    """PPO-clipped policy-gradient loss per token: [B, L], [B, L], [B] -> [B, L].

    −min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) with ρ = exp(logp − old_logp). With one update per batch pass
    ``old_logp = logp.detach()``: ρ is then exactly 1 and only the gradient of ρ remains.
    """
    ratio = torch.exp(logp - old_logp)  # [B, L]
    adv = advantages[:, None]  # [B, 1]: one advantage for every token of a completion
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high) * adv
    return -torch.minimum(unclipped, clipped)


def clipped_tokens(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, epsilon: float, epsilon_high: float
) -> tuple[Tensor, Tensor]:
    """Where the clip removed the gradient: (low [B, L], high [B, L]) bool, TRL's clip_ratio definitions.

    low: ρ < 1−ε on a negative advantage; high: ρ > 1+ε_high on a positive one.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    low = (ratio < 1.0 - epsilon) & (adv < 0)
    high = (ratio > 1.0 + epsilon_high) & (adv > 0)
    return low, high


def k3_kl(logp: Tensor, ref_logp: Tensor, log_ratio_clip: float = KL_LOG_RATIO_CLIP) -> Tensor:
    """Schulman's k3 estimate of KL(π_θ ‖ π_ref) per token: exp(d) − d − 1 with d = ref − logp, fp32.

    Always ≥ 0. The log-ratio is clamped before ``exp`` so a token the reference finds impossible gives a
    large finite penalty instead of inf (TRL#3015, torchforge#664: KL in the billions).
    """
    d = (ref_logp.float() - logp.float()).clamp(-log_ratio_clip, log_ratio_clip)  # [B, L]
    # expm1 and the clamp: exp(d) − d − 1 rounds to −6e-8 for d ≈ 6e-8 in fp32 (found by hypothesis).
    return (torch.expm1(d) - d).clamp(min=0.0)


def token_normaliser(loss_type: str, local_tokens: float, global_tokens: float, world_size: int) -> float:
    """The token count that ``bnpo`` and ``dapo`` divide by.

    ``dapo`` divides by the global token count / world size: DDP and FSDP average gradients over ranks,
    so the result is the token mean over every rank's batch, whatever the world size (TRL multiplies by
    num_processes for the same reason). ``bnpo`` uses this rank's count, as TRL does, so it depends on
    how tokens fall across ranks.
    """
    if loss_type == "dapo":
        return max(global_tokens / world_size, 1.0)
    return max(local_tokens, 1.0)


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    num_sequences: int,
    num_tokens: float,
    max_len: int,
) -> Tensor:
    """This micro-batch's share of the batch loss: [b, L] loss and mask -> scalar.

    ``num_sequences`` is the number of sequences in this rank's whole batch (all micro-batches),
    ``num_tokens`` comes from :func:`token_normaliser`, ``max_len`` is max_new_tokens. Summing the result
    over micro-batches gives the loss of the whole batch, so gradient accumulation changes nothing
    (GRPO-Zero 8ca8b08 normalised per micro-batch and over-weighted short sequences).

    - ``grpo``: mean over each sequence's tokens, then mean over sequences (the paper);
    - ``bnpo``: sum over tokens / this rank's token count;
    - ``dapo``: sum over tokens / (global token count / world size), the default;
    - ``dr_grpo``: sum over tokens / (sequences × max_len), a constant (Dr. GRPO).
    """
    m = mask.to(per_token_loss.dtype)
    if loss_type == "grpo":
        per_seq = (per_token_loss * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # [b]
        return per_seq.sum() / num_sequences
    if loss_type in ("dapo", "bnpo"):
        return (per_token_loss * m).sum() / num_tokens
    if loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (num_sequences * max_len)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
