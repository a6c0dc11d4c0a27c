"""Policy models: a built-in tiny causal transformer, and any Hugging Face causal LM.

Both are called the same way, ``model(input_ids=, attention_mask=, position_ids=, logits_to_keep=)``,
with left-padded batches and explicit position ids (positions start at 0 on the first real token).

- :class:`TinyLM` trains from scratch with no download: learned absolute positions (RoPE models learn
  digit reversal slowly, per the notes), pre-LayerNorm blocks, and a KV cache so sampling is one prefill
  plus one token per step. ``_no_split_modules`` names the block class, as Hugging Face models do, so
  FSDP wraps both kinds of model the same way.
- :func:`load_hf` loads a model from a local folder or the hub cache (``transformers`` is imported only
  here, so the package works without it). On a compute node without internet set ``HF_HUB_OFFLINE=1``
  and point ``HF_HOME`` at a cache that already holds the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class KVCache:
    """Keys and values of every layer seen so far: per layer [B, H, S, Dh]."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def batch_repeat_interleave(self, n: int) -> None:
        """Copy each row n times, so one prefill of P prompts serves P × n samples (nanochat's trick).

        Named as Hugging Face's ``Cache.batch_repeat_interleave``, so the sampler repeats both alike."""
        self.keys = [k.repeat_interleave(n, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(n, dim=0) for v in self.values]


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, allowed: Tensor, layer: int, cache: KVCache | None) -> Tensor:
        b, t, d = x.shape  # x [B, T, D]; allowed [B, 1, T, S] bool
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is not None:  # q, k, v [B, H, T, Dh]; with a cache k, v grow to [B, H, S, Dh]
            k, v = cache.update(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [B, H, T, Dh]
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, allowed: Tensor, layer: int, cache: KVCache | None) -> Tensor:
        x = x + self.attn(self.ln1(x), allowed, layer, cache)
        return x + self.mlp(self.ln2(x))


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    max_seq_len: int
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4


class TinyLM(nn.Module):
    """A small GPT: token + learned position embeddings, pre-LN blocks, untied LM head (~104k params)."""

    _no_split_modules: ClassVar[list[str]] = [
        "Block"
    ]  # the FSDP unit, named the way Hugging Face models name theirs

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        if config.dim % config.n_heads:
            raise ValueError(f"dim {config.dim} is not divisible by n_heads {config.n_heads}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config.dim, config.n_heads) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        # PyTorch's default init on purpose (embeddings N(0, 1)): with GPT-2's std 0.02 an Adam step of
        # lr 3e-3 is 15% of a weight, and reversal stalled at 0.3 reward after 150 steps instead of
        # reaching 0.9 in about 70.

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> Tensor:
        """input_ids [B, T] -> logits [B, T, V] (the last ``logits_to_keep`` positions if > 0).

        ``attention_mask`` [B, S] covers every key, cached ones included (S = cached + T); 0 marks left
        padding. ``position_ids`` [B, T] default to 0..T−1 after the cached length.
        """
        b, t = input_ids.shape
        past = kv_cache.keys[0].shape[2] if kv_cache is not None and kv_cache.keys else 0
        s = past + t
        if attention_mask is None:
            attention_mask = torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(past, s, device=input_ids.device).expand(b, t)
        if int(position_ids.max()) >= self.config.max_seq_len:
            raise ValueError(f"position {int(position_ids.max())} >= max_seq_len {self.config.max_seq_len}")
        # Query i sits at key slot past+i: it may see earlier slots that are not padding, and always
        # itself, so a padding query never has an empty row (softmax over nothing is NaN).
        slots = torch.arange(s, device=input_ids.device)  # [S]
        query_slots = slots[past:, None]  # [T, 1]
        causal = slots[None, :] <= query_slots  # [T, S]
        allowed = causal[None] & attention_mask.bool()[:, None, :]  # [B, T, S]
        allowed = allowed | (slots[None, :] == query_slots)[None]
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)  # [B, T, D]
        for layer, block in enumerate(self.blocks):
            x = block(x, allowed[:, None], layer, kv_cache)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.lm_head(self.ln_f(x))  # [B, T', V]


def build_tiny(vocab_size: int, max_seq_len: int, seed: int, dim: int, n_layers: int, n_heads: int) -> TinyLM:
    """A TinyLM whose weights depend only on ``seed``: every rank builds the same model, and the
    reference model is rebuilt from the same original weights after a resume."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM(TinyConfig(vocab_size, max_seq_len, dim, n_layers, n_heads))


def forward_logits(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: int
):
    """Logits of the last ``keep`` positions, [B, keep, V], for TinyLM and Hugging Face models alike.

    Hugging Face calls the argument ``logits_to_keep`` (``num_logits_to_keep`` before 4.50); keeping only
    the completion positions saves a [B, T, 151936] tensor for Qwen. A training forward needs no KV
    cache (``use_cache=False``). Which of these a model takes is learnt from the model itself, by
    calling it (:func:`_forward_keywords`), never from its signature: transformers moves its arguments
    into ``**kwargs`` from one release to the next. A model that quietly ignores a keyword still gives
    the right answer here: the slice below keeps the last ``keep`` positions either way.
    """
    out = _call_with_keywords(
        model,
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        {"use_cache": False, "logits_to_keep": keep, "num_logits_to_keep": keep},
    )
    logits = out if isinstance(out, Tensor) else out.logits
    return logits[:, -keep:]


# Optional keywords a model's forward may take, in the order they are given up when it refuses them
# (TypeError: unexpected keyword). The first set it accepts is remembered per model class.
_KEYWORD_CHOICES: tuple[tuple[str, ...], ...] = (
    ("use_cache", "logits_to_keep"),
    ("use_cache", "num_logits_to_keep"),
    ("use_cache",),
    ("logits_to_keep",),
    (),
)
_ACCEPTED: dict[type, tuple[str, ...]] = {TinyLM: ("logits_to_keep",)}  # ours: no call needed to know


def _call_with_keywords(model: nn.Module, required: dict, optional: dict):
    """``model(**required, **some of optional)``: the first set of :data:`_KEYWORD_CHOICES` (names that
    are in ``optional``) the model takes without a TypeError naming one of them; remembered per class
    of the inner model (DDP keeps it in ``.module``), so a refusal costs one call per class and run."""
    inner = getattr(model, "module", model)
    known = _ACCEPTED.get(type(inner))
    choices = [known] if known is not None else _KEYWORD_CHOICES
    for names in choices:
        given = {n: optional[n] for n in names if n in optional}
        try:
            out = model(**required, **given)
        except TypeError as err:
            # Only a refusal of one of our optional keywords moves on to the next choice; any other
            # TypeError is the model's own and is raised.
            if known is not None or not any(repr(n) in str(err) for n in given):
                raise
            continue
        _ACCEPTED[type(inner)] = names
        return out
    raise AssertionError("unreachable: the last choice gives no optional keyword")


# ---------------------------------------------------------------------------------------------------
# Hugging Face models


class HFTokenizer:
    """A Hugging Face tokenizer behind the small interface the trainer uses (see tasks.CharTokenizer)."""

    def __init__(self, tokenizer, eos_ids: tuple[int, ...], system_prompt: str | None, chat: bool) -> None:
        self.tok = tokenizer
        self.eos_ids = eos_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        self.vocab_size = len(tokenizer)
        self.system_prompt = system_prompt
        self.chat = chat

    def encode_prompt(self, prompt: str) -> list[int]:
        if not self.chat:
            return self.tok(prompt, add_special_tokens=True)["input_ids"]
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        # tokenize=False then encode: apply_chat_template(tokenize=True) returns a BatchEncoding in
        # transformers 5 and a list in 4.x; the text path is the same in both.
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_hf(name_or_path: str, *, system_prompt: str | None = None, chat_template: str = "auto"):
    """Load (model, tokenizer) in fp32 — master weights stay fp32, autocast picks the compute dtype.

    Dropout is switched off (TRL's ``disable_dropout``): it would make the old, new and reference
    log-probs of the same tokens disagree. Returns the model on CPU; the caller moves it.
    """
    try:
        import transformers
    except ImportError as err:
        raise SystemExit(
            f"--model {name_or_path!r} needs the transformers package: pip install transformers "
            "(or use --model tiny, the built-in model)"
        ) from err
    from packaging.version import Version

    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
    # The keyword became ``dtype`` in 4.56; older releases only know ``torch_dtype``.
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, **{dtype_kw: torch.float32})
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    if not eos_ids:
        raise SystemExit(f"{name_or_path}: neither generation config nor tokenizer names an EOS token")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = chat_template == "on" or (chat_template == "auto" and has_template)
    return model, HFTokenizer(tokenizer, tuple(eos_ids), system_prompt, chat)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(model: nn.Module) -> str:
    return f"{type(model).__name__} with {param_count(model):,} parameters"
