"""Digit reversal: the synthetic task for tests and demos (no download, no tokenizer).

Prompt ``BOS d1 … dK =``, answer ``dK … d1`` then EOS. The reward gives partial credit: one point per
correct position among the first K, one more if EOS comes right after them, divided by K+1. A random
policy scores about 1/14 per position, so groups have spread from the first step and the run never
starts in the zero-reward trap. Options: ``--task-option digits=K`` (default 4) and ``examples=N``.
"""

from __future__ import annotations

import random

from rv_train.tasks import CharTokenizer, Example, Task, TaskContext, register


def position_credit(completion: str, target: str, finished: bool) -> float:
    """(correct characters among the first len(target) + 1 if EOS follows exactly them) / (len + 1)."""
    hits = sum(a == b for a, b in zip(completion, target, strict=False))
    eos_in_place = finished and len(completion) == len(target)
    return (hits + eos_in_place) / (len(target) + 1)


@register("reversal")
class Reversal(Task):
    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        self.digits = int(ctx.options.get("digits", 4))
        self.num_examples = int(ctx.options.get("examples", 10_000))
        self.max_new_tokens = self.digits + 1  # K digits and the EOS

    def target(self, digits: str) -> str:
        return digits[::-1]

    def examples(self) -> list[Example]:
        rng = random.Random(f"{self.name}:{self.ctx.seed}")
        out = []
        for _ in range(self.num_examples):
            digits = "".join(rng.choices("0123456789", k=self.digits))
            out.append(Example(prompt=digits + "=", answer=self.target(digits)))
        return out

    def score(self, completion: str, finished: bool, example: Example) -> dict[str, float]:
        return {self.name: position_credit(completion, example.answer, finished)}

    def builtin_tokenizer(self) -> CharTokenizer:
        return CharTokenizer("0123456789=")  # with BOS, EOS, PAD: 14 tokens
