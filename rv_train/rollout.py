"""Sampling G completions per prompt, on one rank, with no collectives per decode step.

Each rank samples all G completions of its own prompts, so a group never straddles ranks and the
advantages need no gather. Ranks therefore finish generating at different lengths, which is only safe
if decoding runs no collectives: under DDP we sample from the inner module; under FSDP2 every unit is
unsharded once (one all-gather each, same order on all ranks), decoding runs on full local weights, and
the units are resharded afterwards. Sharded decoding would all-gather at every forward and deadlock as
soon as one rank stopped early (reproduced in the notes: gloo timeout after 20 s).

The G samples of a prompt share its prefill (:func:`choose_sampler` picks the way once per run):

- ``shared``: each prompt is prefilled once, its KV cache and last logits are repeated G times
  (``batch_repeat_interleave``), then all P·G rows decode together, one token per step. Used for the
  built-in model and for every Hugging Face model that passes :func:`_cache_problem`'s trial: a tiny
  prefill and decode step with a ``DynamicCache``, shared and repeated, gives what separate prefills
  give. What the model does decides, not its signature: transformers 5.24 renamed the forward's
  ``past_key_values`` to ``cache`` (the old name goes into ``**kwargs``), and a check that read the
  signature turned the shared prefill off for every model without a word. Checked bit for bit
  against ``generate`` on CPU for Qwen2, Llama, Mistral (sliding window), Gemma 2 and GPT-2 with
  transformers 5.23. Prompt tokens are computed once instead of G times, and the loop skips
  ``generate``'s per-step machinery (logits processors, stopping criteria, input preparation),
  which is a large part of a decode step for a small model.
- ``copies``: the same loop, but the G copies of a prompt are prefilled separately. The tests hold
  ``shared`` to it bit for bit; nothing else uses it.
- ``generate``: Hugging Face ``generate`` on the repeated prompts, for models that fail the trial:
  their forward takes no ``DynamicCache`` or builds its own, their cache cannot be repeated per row
  (recurrent or convolution state of hybrid models: Mamba, LFM2), or the repeated cache decodes
  otherwise than separate prefills: sharing there would silently sample from a wrong state. Its
  generation config samples exactly the distribution the loss scores: temperature only, no top-k,
  top-p or repetition penalty (Qwen's own config sets top_p 0.8, top_k 20 and repetition_penalty
  1.05, which would bias the ratio).

Reproducibility: ``shared`` and ``copies`` draw every token from one ``torch.Generator`` seeded by
:func:`sampling_seed` (run seed, step, rank), in the same order (one multinomial over the [B, V]
probabilities per step), so a resumed run samples exactly what an uninterrupted one did.
``generate`` takes no generator and samples from the global RNG, seeded the same way before the call.
Prefilling consumes no randomness (dropout is off), so sharing it changes no sample.
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
from rv_train.model import KVCache, TinyLM, _call_with_keywords
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


SAMPLERS = ("shared", "copies", "generate")

# The keyword a Hugging Face forward takes its cache by: ``cache`` since transformers 5.24 (where
# ``past_key_values`` is deprecated, to go in 5.40), ``past_key_values`` before. Tried in this order by
# calling the model (:func:`_find_cache_keyword`); what works is remembered per model class.
_CACHE_KEYWORDS = ("cache", "past_key_values")
_CACHE_KEYWORD: dict[type, str] = {}


@dataclass(frozen=True)
class Sampler:
    mode: str  # one of SAMPLERS
    description: str  # one line for the log: what is done and, for generate, why


def choose_sampler(model: nn.Module) -> Sampler:
    """How to sample from ``model`` (the unwrapped module, weights local: see :func:`generation_model`).

    For a Hugging Face model this runs the trial of :func:`_cache_problem`: a few forwards on six
    tokens, once per run."""
    if isinstance(model, TinyLM):
        return Sampler("shared", "one prefill per prompt, its KV cache repeated for the group's G samples")
    problem = _cache_problem(model)
    if problem is None:
        return Sampler(
            "shared", "one prefill per prompt, its DynamicCache repeated for the group's G samples"
        )
    return Sampler("generate", f"generate() on G copies of each prompt ({problem})")


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
    mode: str | None = None,
) -> Rollout:
    """P prompts [P, Tp] -> a Rollout of P·G completions. temperature 0 is greedy.

    ``mode`` is one of SAMPLERS (module doc); None asks :func:`choose_sampler`, which the trainer calls
    once per run instead.
    """
    if mode is None:
        mode = choose_sampler(model).mode
    g = num_generations
    args = (model, prompt_ids, prompt_mask, g, max_new_tokens, temperature, eos_ids, pad_id, seed)
    if mode in ("shared", "copies"):
        completions = _sample_cached(*args, shared=mode == "shared")
    elif mode == "generate" and not isinstance(model, TinyLM):
        completions = _sample_generate(*args)
    else:
        raise ValueError(f"mode must be one of {SAMPLERS} (generate: Hugging Face models only), not {mode!r}")
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


def _sample_cached(
    model, prompt_ids, prompt_mask, g, max_new, temperature, eos_ids, pad_id, seed, *, shared: bool
) -> Tensor:
    generator = torch.Generator(prompt_ids.device).manual_seed(seed)
    cache = _new_cache(model)
    mask = prompt_mask.repeat_interleave(g, dim=0)  # [B, Tp], grows by one column per step
    next_pos = mask.sum(dim=1)  # [B]: position of the first new token
    if shared:
        logits = _forward_cached(model, prompt_ids, prompt_mask, cache)  # [P, V]
        cache.batch_repeat_interleave(g)  # [P, H, Tp, Dh] -> [B, H, Tp, Dh] in every layer
        logits = logits.repeat_interleave(g, dim=0)  # [B, V]
    else:
        logits = _forward_cached(model, prompt_ids.repeat_interleave(g, dim=0), mask, cache)  # [B, V]
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
        logits = _forward_cached(model, token[:, None], mask, cache, (next_pos + t)[:, None])
    return torch.stack(out, dim=1)  # [B, L]


def _new_cache(model: nn.Module):
    if isinstance(model, TinyLM):
        return KVCache()
    from transformers import DynamicCache

    try:
        # With the config, layers get the model's attention kinds (sliding window where it has them).
        return DynamicCache(config=model.config)
    except TypeError as err:
        if "config" not in str(err):
            raise
        return DynamicCache()  # transformers < 4.56: key and value lists, nothing else


def _returned_cache(out):
    """The cache a Hugging Face forward returned (``cache`` since 5.24, ``past_key_values`` before)."""
    for name in _CACHE_KEYWORDS:
        found = out.get(name) if hasattr(out, "get") else None
        if found is not None:
            return found
    return None


def _forward_cached(model, ids: Tensor, mask: Tensor, cache, positions: Tensor | None = None) -> Tensor:
    """ids [N, T] with mask [N, S] over cached and new keys -> logits of the last position [N, V].

    positions [N, T] default to the prompt's (``position_ids_from_mask``), for the prefill.
    """
    if positions is None:
        positions = position_ids_from_mask(mask)
    if isinstance(model, TinyLM):
        return model(ids, mask, positions, kv_cache=cache, logits_to_keep=1)[:, -1]
    keyword = _CACHE_KEYWORD.get(type(model)) or _find_cache_keyword(model)[0]
    if keyword is None:
        raise RuntimeError(f"{type(model).__name__} takes no DynamicCache: sample it with mode='generate'")
    out = _call_with_keywords(
        model,
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions, keyword: cache},
        {"use_cache": True, "logits_to_keep": 1, "num_logits_to_keep": 1},
    )
    if _returned_cache(out) is not cache:
        # The model built a cache of its own: repeating ours would sample from prompts it never saw.
        raise RuntimeError(
            f"{type(model).__name__} did not use the DynamicCache it was given; "
            "rv_train cannot share the prefill for it (please report the model)"
        )
    return out.logits[:, -1]


def _probe_ids(model: nn.Module, *rows: list[int]) -> tuple[Tensor, Tensor]:
    """Rows of small ids (taken modulo the vocabulary), left-padded, on the model's device:
    (ids [N, T], mask [N, T])."""
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 0) or 4)
    return left_pad([[i % vocab for i in row] for row in rows], 0, device)


def _find_cache_keyword(model: nn.Module) -> tuple[str | None, str]:
    """(the keyword ``model``'s forward takes a DynamicCache by and returns it from, "") or (None, why).

    Found by calling it, never from the signature: transformers takes unknown keywords into
    ``**kwargs`` without a word, so a forward that accepts a name does not prove it uses it."""
    ids, mask = _probe_ids(model, [1, 2, 3])
    why = []
    for keyword in _CACHE_KEYWORDS:
        cache = _new_cache(model)
        try:
            out = _call_with_keywords(
                model,
                {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
                 keyword: cache},
                {"use_cache": True},
            )  # fmt: skip
        except TypeError as err:
            if repr(keyword) not in str(err):  # not a refusal of the keyword: the model failed
                return None, f"its forward fails with a DynamicCache (TypeError: {err})"
            why.append(f"{keyword}=: {err}")  # no such keyword (a forward without **kwargs)
            continue
        except Exception as err:  # e.g. LFM2 in transformers 4.57 looks for a cache of its own kind
            return None, f"its forward fails with a DynamicCache ({type(err).__name__}: {err})"
        if _returned_cache(out) is cache:
            _CACHE_KEYWORD[type(model)] = keyword
            return keyword, ""
        why.append(f"{keyword}=: ignored")
    name = type(model).__name__
    return None, f"{name}.forward does not use a DynamicCache it is given ({'; '.join(why)})"


@torch.no_grad()
def _cache_problem(model: nn.Module) -> str | None:
    """Why the shared prefill cannot serve this Hugging Face model, or None when it can.

    The trial: two prompts (one left-padded) prefilled once with their cache repeated twice, then one
    decode step with a different token per row, against the four rows prefilled separately. Both
    must give the same logits (to a tolerance: on a GPU a batch of another size may take other
    kernels). A cache that cannot repeat what it holds per row (Mamba's and LFM2's recurrent and
    convolution state) fails here, with the model's own error as the reason."""
    was_training = model.training
    model.eval()  # dropout would make the two sides differ
    try:
        keyword, why = _find_cache_keyword(model)
        if keyword is None:
            return why
        ids, mask = _probe_ids(model, [1, 2, 3], [3, 1])  # [2, 3]; the second row left-padded
        rows = mask.repeat_interleave(2, dim=0)  # [4, 3]
        step = _probe_ids(model, [1], [2], [3], [1])[0]  # [4, 1]: another token per row
        grown = torch.cat([rows, torch.ones_like(rows[:, :1])], dim=1)  # [4, 4]
        positions = rows.sum(dim=1, keepdim=True)  # [4, 1]
        try:
            shared = _new_cache(model)
            first = _forward_cached(model, ids, mask, shared).repeat_interleave(2, dim=0)
            shared.batch_repeat_interleave(2)
            second = _forward_cached(model, step, grown, shared, positions)
            copies = _new_cache(model)
            first_copies = _forward_cached(model, ids.repeat_interleave(2, dim=0), rows, copies)
            second_copies = _forward_cached(model, step, grown, copies, positions)
        except Exception as err:  # the model's own reason, shown in the log's "sampling:" line
            return f"its cache cannot be repeated per row ({type(err).__name__}: {err})"
        for ours, theirs in ((first, first_copies), (second, second_copies)):
            ours, theirs = ours.float(), theirs.float()
            if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * float(theirs.abs().max()) + 1e-6):
                return "its repeated cache decodes otherwise than separate prefills"
        return None
    finally:
        model.train(was_training)


def _sample_generate(model, prompt_ids, prompt_mask, g, max_new, temperature, eos_ids, pad_id, seed):
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
