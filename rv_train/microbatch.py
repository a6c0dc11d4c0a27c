"""Micro-batches that fit: ``--micro-batch-size auto``.

A step's loss is a sum over micro-batches, each normalised by the whole batch's counts (objective.py),
so the micro-batch size changes how many forward/backward passes a step takes (gradient accumulation),
never what is learnt: the effective batch stays ``--prompts-per-step`` × ``--num-generations``.

``auto`` settles the size once, on the first step of a run: it tries this rank's whole batch, and on an
out-of-memory error halves it and tries again (Accelerate's ``find_executable_batch_size`` does the
halving and the clean-up in between). The trial runs the policy's forward and backward at the longest
completion the run allows, so a later step with longer completions than the first still fits. The
ranks agree on every trial (one all-reduce of "did it fit"), so they settle on the same size; the size
is kept in the checkpoint and a resumed run uses it without trying again.

Test hook: ``RV_TRAIN_TEST_OOM_ABOVE=N`` makes every forward of more than N sequences raise
``torch.OutOfMemoryError``, so the halving can be tested on a CPU; with ``RV_TRAIN_TEST_OOM_RANK=R`` only
on rank R, so that the ranks' agreement is tested too. Only tests set them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

AUTO = "auto"
TEST_OOM_VARIABLE = "RV_TRAIN_TEST_OOM_ABOVE"
TEST_OOM_RANK_VARIABLE = "RV_TRAIN_TEST_OOM_RANK"


class NothingFits(RuntimeError):
    """Even a micro-batch of one sequence ran out of memory."""


def parse_micro_batch_size(text: str) -> int | str:
    """``--micro-batch-size``: a number of sequences (0: the whole local batch) or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of sequences or 'auto', not {text!r}") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: the whole local batch), not {size}")
    return size


def raise_if_test_oom(rows: int) -> None:
    """The test hook (module doc): a forward of more rows than RV_TRAIN_TEST_OOM_ABOVE is out of memory."""
    limit = os.environ.get(TEST_OOM_VARIABLE)
    only_rank = os.environ.get(TEST_OOM_RANK_VARIABLE)
    if only_rank and only_rank != os.environ.get("RANK", "0"):
        return
    if limit and rows > int(limit):
        # The text ends as CUDA's does (" out of memory."), which Accelerate recognises too.
        raise torch.OutOfMemoryError(
            f"{TEST_OOM_VARIABLE}={limit}: a forward of {rows} sequences is out of memory."
        )


def is_out_of_memory(err: BaseException) -> bool:
    """torch's OutOfMemoryError, or an error Accelerate reads as one (the CPU allocator, cuDNN, MPS)."""
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, Exception) and should_reduce_batch_size(err)
    )


def largest_that_fits(try_size: Callable[[int], None], start: int) -> int:
    """The first of ``start``, ``start // 2``, ... for which ``try_size`` does not raise out of memory.

    ``try_size(n)`` runs the work at size n and raises an out-of-memory error when it does not fit (on
    every rank alike: the caller agrees first). Any other error propagates.
    """
    from accelerate.utils import find_executable_batch_size

    size = start

    def halve() -> int:
        nonlocal size
        size //= 2
        return size

    @find_executable_batch_size(starting_batch_size=start, reduce_batch_size_fn=halve)
    def first_that_fits(batch_size: int) -> int:
        try_size(batch_size)
        return batch_size

    try:
        return first_that_fits()
    except RuntimeError as err:
        if size == 0:  # Accelerate's "No executable batch size found, reached zero."
            raise NothingFits("even a micro-batch of one sequence is out of memory") from err
        raise
