"""Tasks with verifiable rewards, a registry, and the order prompts are drawn in.

A task is one small file: subclass :class:`Task`, decorate it with ``@register("name")`` and put it in
this folder (every module here is imported on the first lookup), or keep it anywhere and pass
``--task path/to/file.py:ClassName`` or ``--task package.module:ClassName``. ``copy.py`` is a complete
example in a dozen lines.

A task gives training examples (prompt text, answer text) and scores a completion with one or more named
reward components; the reward is their sum. The built-in model has no tokenizer of its own: it uses the
task's :meth:`Task.builtin_tokenizer`, characters of a small alphabet.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import random
import string
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskContext:
    """What a task may read from the command line: the run's seed, ``--data-path``, ``--task-option k=v``."""

    seed: int = 0
    data_path: str | None = None
    options: dict[str, str] = field(default_factory=dict)


class CharTokenizer:
    """One token per character of ``alphabet``, then BOS, EOS and PAD. Prompts start with BOS.

    Characters outside the alphabet become ``unknown`` when it is in the alphabet, else an error.
    """

    SPECIAL = "\ufffd"  # how BOS, EOS and PAD print when a model samples them mid-completion

    def __init__(self, alphabet: str, unknown: str | None = None) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self.index = {c: i for i, c in enumerate(alphabet)}
        self.bos_id, self.eos_id, self.pad_id = len(alphabet), len(alphabet) + 1, len(alphabet) + 2
        self.eos_ids = (self.eos_id,)
        self.vocab_size = len(alphabet) + 3
        self.unknown = self.index.get(unknown) if unknown is not None else None

    def encode_prompt(self, prompt: str) -> list[int]:
        ids = [self.bos_id]
        for c in prompt:
            i = self.index.get(c, self.unknown)
            if i is None:
                raise ValueError(f"character {c!r} is not in the tokenizer's alphabet")
            ids.append(i)
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.alphabet[i] if i < len(self.alphabet) else self.SPECIAL for i in ids)


class Task:
    """Subclass this: set ``name``, implement :meth:`examples` and :meth:`score`."""

    name = ""
    max_new_tokens = 256  # the default for --max-new-tokens
    system_prompt: str | None = None  # for chat models

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx = ctx

    def examples(self) -> list[Example]:
        raise NotImplementedError

    def score(self, completion: str, finished: bool, example: Example) -> dict[str, float]:
        """Reward components of one completion (text before the first EOS; ``finished``: an EOS came)."""
        raise NotImplementedError

    def builtin_tokenizer(self) -> CharTokenizer:
        """The vocabulary the built-in model uses for this task: printable ASCII unless overridden."""
        return CharTokenizer(string.printable, unknown="?")


_REGISTRY: dict[str, type[Task]] = {}


def register(name: str):
    def add(cls: type[Task]) -> type[Task]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"two tasks are registered as {name!r}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def task_names() -> list[str]:
    _import_builtin_tasks()
    return sorted(_REGISTRY)


def get_task(spec: str) -> type[Task]:
    """A registered name (``reversal``), ``package.module:Class`` or ``path/to/file.py:Class``."""
    if ":" in spec:
        where, cls_name = spec.rsplit(":", 1)
        if where.endswith(".py"):
            path = Path(where).resolve()
            module_spec = importlib.util.spec_from_file_location(f"rv_train_user_task_{path.stem}", path)
            if module_spec is None or module_spec.loader is None:
                raise ValueError(f"cannot load a task from {where}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        cls = getattr(module, cls_name, None)
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ValueError(f"{spec}: {cls_name} is not a Task subclass in {where}")
        return cls
    names = task_names()
    if spec not in _REGISTRY:
        raise ValueError(f"unknown task {spec!r}; choose one of {', '.join(names)} or pass module:Class")
    return _REGISTRY[spec]


def _import_builtin_tasks() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def prompt_indices(num_examples: int, seed: int, start: int, count: int) -> list[int]:
    """Indices of ``count`` prompts from global position ``start`` of an endless, epoch-shuffled order.

    The data position is one integer (prompts consumed), so a resume, even with another world size,
    continues exactly where the run stopped, with no sampler state to save or replay.
    """
    out = []
    for pos in range(start, start + count):
        epoch, i = divmod(pos, num_examples)
        out.append(_epoch_order(num_examples, seed, epoch)[i])
    return out


@lru_cache(maxsize=4)
def _epoch_order(num_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(num_examples))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)
