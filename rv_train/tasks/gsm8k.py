"""GSM8K grade-school maths from a local JSONL file (``--data-path``), the real-GPU recipe's task.

Each line is ``{"question": ..., "answer": "... #### 42"}``, the format of openai/grade-school-math's
``train.jsonl`` and of ``datasets.load_dataset("openai/gsm8k", "main")`` saved with ``to_json``.

Reward components: ``correct`` is 1 when the predicted number equals the gold one (lenient extraction:
the last ``#### x``, else the last ``\\boxed{x}``, else the last number in the text), ``format`` is
``format_weight`` (``--task-option format_weight=0.1``) when the last line is ``#### <number>``, as the
prompt asks. Correctness stays binary, which beat tiered rewards in the one report the notes cite.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rv_train.tasks import Example, Task, TaskContext, register

INSTRUCTION = (
    "Solve the problem step by step. On the last line write '#### ' followed by the final number only."
)
SYSTEM_PROMPT = "You are a helpful assistant that solves grade-school maths problems."

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANY_NUMBER = re.compile(_NUMBER)
_FORMAT_LINE = re.compile(r"^####\s*" + _NUMBER + r"\s*\.?$")


def parse_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_gold(answer: str) -> str:
    """The number after the last ``####`` of a GSM8K answer field."""
    found = _HASHES.findall(answer)
    if not found:
        raise ValueError(f"GSM8K answer without '#### <number>': {answer[-80:]!r}")
    return found[-1].replace(",", "").replace("$", "")


def extract_prediction(text: str) -> float | None:
    for pattern in (_HASHES, _BOXED, _ANY_NUMBER):
        found = pattern.findall(text)
        if found:
            return parse_number(found[-1])
    return None


def follows_format(text: str) -> bool:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return bool(lines) and bool(_FORMAT_LINE.match(lines[-1]))


def load_jsonl(path: str) -> list[Example]:
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = f"{row['question'].strip()}\n\n{INSTRUCTION}"
                out.append(Example(prompt=prompt, answer=extract_gold(row["answer"])))
            except (json.JSONDecodeError, KeyError, ValueError) as err:
                raise ValueError(f"{path}:{n}: not a GSM8K record ({err})") from err
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


@register("gsm8k")
class GSM8K(Task):
    system_prompt = SYSTEM_PROMPT

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        if not ctx.data_path:
            raise ValueError(
                "--task gsm8k needs --data-path: a GSM8K JSONL file (see examples/grpo/README.md)"
            )
        self.path = ctx.data_path
        self.format_weight = float(ctx.options.get("format_weight", 0.1))

    def examples(self) -> list[Example]:
        return load_jsonl(self.path)

    def score(self, completion: str, finished: bool, example: Example) -> dict[str, float]:
        predicted = extract_prediction(completion)
        gold = float(example.answer)
        correct = predicted is not None and abs(predicted - gold) < 1e-6
        return {"correct": float(correct), "format": self.format_weight * follows_format(completion)}
