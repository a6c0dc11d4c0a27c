"""Sampling G completions per prompt, on one rank, with no collectives per decode step.

Each rank samples all G completions of its own prompts, so a group never straddles ranks and the
advantages need no gather. Ranks therefore finish generating at different lengths, which is only safe
if decoding runs no collectives: under DDP we sample from the inner module; under FSDP2 every unit is
unsharded once (one all-gather each, same order on all ranks), decoding runs on full local weights, and
the units are resharded afterwards. Sharded decoding would all-gather at every forward and deadlock as
soon as one rank stopped early (reproduced in the notes: gloo timeout after 20 s).

The built-in model prefills each prompt once and copies its KV cache G times; Hugging Face models go
through ``generate`` on the repeated prompts, with a generation config that samples exactly the
distribution the loss scores: temperature only, no top-k, top-p or repetition penalty (Qwen's own
config sets top_p 0.8, top_k 20 and repetition_penalty 1.05, which would bias the ratio).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from rv_train.dist import unwrap
from rv_train.model import KVCache, TinyLM
from rv_train.objective import completion_mask, position_ids_from_mask


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """A seed per (run seed, step, rank): sampling is reproducible after a resume with no RNG replay."""
    return int(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).hexdigest()[:15], 16)


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token lists -> (ids [P, T], mask [P, T]) padded on the left, so every prompt ends at column T−1."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


@dataclass
class Rollout:
    """B = P·G sequences, prompt-major: rows g·G … g·G+G−1 are the G samples of prompt g."""

    prompt_ids: Tensor  # [B, Tp] left-padded
    prompt_mask: Tensor  # [B, Tp] 1 on real prompt tokens
    completion_ids: Tensor  # [B, L] pad after the first EOS
    completion_mask: Tensor  # [B, L] bool: up to and including the first EOS
    finished: Tensor  # [B] bool: an EOS was generated

    @cached_property
    def input_ids(self) -> Tensor:  # [B, Tp + L]
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @cached_property
    def attention_mask(self) -> Tensor:  # [B, Tp + L]: padding after the EOS is not attended to
        return torch.cat([self.prompt_mask, self.completion_mask.long()], dim=1)

    @cached_property
    def position_ids(self) -> Tensor:  # [B, Tp + L]
        return position_ids_from_mask(self.attention_mask)


@contextmanager
def generation_model(model: nn.Module) -> Iterator[nn.Module]:
    """The module to sample from, in eval mode, with weights local to this rank (see module doc).

    Eval mode also turns off Hugging Face gradient checkpointing, which disables the KV cache in
    training mode and makes generation slow (TRL does the same).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    was_training = model.training
    model.eval()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield unwrap(model)
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)
        model.train(was_training)


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    pad_id: int,
    seed: int,
) -> Rollout:
    """P prompts [P, Tp] -> a Rollout of P·G completions. temperature 0 is greedy."""
    if isinstance(model, TinyLM):
        completions = _sample_tiny(
            model,
            prompt_ids,
            prompt_mask,
            num_generations,
            max_new_tokens,
            temperature,
            eos_ids,
            pad_id,
            seed,
        )
    else:
        completions = _sample_hf(
            model,
            prompt_ids,
            prompt_mask,
            num_generations,
            max_new_tokens,
            temperature,
            eos_ids,
            pad_id,
            seed,
        )
    mask, finished = completion_mask(completions, eos_ids)
    # Whatever a sampler put after the first EOS, the rows read as padding from here on.
    completions = torch.where(mask, completions, torch.full_like(completions, pad_id))
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
        completion_ids=completions,
        completion_mask=mask,
        finished=finished,
    )


def _next_token(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """logits [B, V] -> tokens [B]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _sample_tiny(model, prompt_ids, prompt_mask, g, max_new, temperature, eos_ids, pad_id, seed) -> Tensor:
    generator = torch.Generator(prompt_ids.device).manual_seed(seed)
    cache = KVCache()
    positions = position_ids_from_mask(prompt_mask)  # [P, Tp]
    logits = model(prompt_ids, prompt_mask, positions, kv_cache=cache, logits_to_keep=1)[:, -1]  # [P, V]
    cache.repeat_interleave(g)  # one prefill serves all G samples of a prompt
    logits = logits.repeat_interleave(g, dim=0)  # [B, V]
    mask = prompt_mask.repeat_interleave(g, dim=0)  # [B, Tp], grows by one column per step
    next_pos = prompt_mask.sum(dim=1).repeat_interleave(g)  # [B]: position of the first new token
    eos = torch.tensor(list(eos_ids), device=prompt_ids.device)
    done = torch.zeros(len(mask), dtype=torch.bool, device=prompt_ids.device)
    out = []
    for t in range(max_new):
        token = _next_token(logits, temperature, generator)  # [B]
        token = torch.where(done, torch.full_like(token, pad_id), token)
        out.append(token)
        done |= torch.isin(token, eos)
        if bool(done.all()) or t == max_new - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(token[:, None], mask, (next_pos + t)[:, None], kv_cache=cache)[:, -1]
    return torch.stack(out, dim=1)  # [B, L]


def _sample_hf(model, prompt_ids, prompt_mask, g, max_new, temperature, eos_ids, pad_id, seed) -> Tensor:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        max_new_tokens=max_new,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
    )
    # generate() merges a passed config with the model's own defaults in some releases, which would bring
    # back Qwen's top_p/top_k; installing ours as the model's config for the call leaves nothing to merge.
    saved = model.generation_config
    model.generation_config = config
    torch.manual_seed(seed)  # generate() takes no generator: sample from the global RNG, seeded per step
    try:
        out = model.generate(
            input_ids=prompt_ids.repeat_interleave(g, dim=0),
            attention_mask=prompt_mask.repeat_interleave(g, dim=0),
            synced_gpus=False,  # weights are local (unsharded) during generation: no lock-step needed
        )
    finally:
        model.generation_config = saved
    return out[:, prompt_ids.shape[1] :]
