"""--micro-batch-size auto: the largest micro-batch that fits, found by halving on out-of-memory, agreed
by the ranks, kept across resumes; the effective batch, and so the loss, stays the same. The test hook
RV_TRAIN_TEST_OOM_ABOVE=N makes forwards of more than N sequences raise torch.OutOfMemoryError."""

from __future__ import annotations

import argparse

import pytest
import torch
from train_helpers import (
    explain,
    one_rank,  # noqa: F401  (the fixture below)
    read_jsonl,
    summary,
    torchrun,
)

from rv_train.microbatch import (
    AUTO,
    TEST_OOM_RANK_VARIABLE,
    TEST_OOM_VARIABLE,
    NothingFits,
    is_out_of_memory,
    largest_that_fits,
    parse_micro_batch_size,
)
from rv_train.trainer import main

ARGS = ["--save-every", "0", "--log-samples-every", "0", "--beta", "0.04"]
LOCAL_BATCH = 16 * 8  # one rank: rv_train's default 16 prompts × 8 samples


def _fits_up_to(limit: int, tried: list[int]):
    def try_size(n: int) -> None:
        tried.append(n)
        if n > limit:
            raise torch.OutOfMemoryError(f"{n} sequences: CUDA out of memory.")

    return try_size


def test_halving_from_the_whole_batch_to_the_first_size_that_fits():
    tried: list[int] = []
    assert largest_that_fits(_fits_up_to(20, tried), 128) == 16
    assert tried == [128, 64, 32, 16]
    tried.clear()
    assert largest_that_fits(_fits_up_to(500, tried), 96) == 96 and tried == [96]
    with pytest.raises(NothingFits, match="even a micro-batch of one sequence"):
        largest_that_fits(_fits_up_to(0, []), 8)


def test_other_errors_are_not_taken_for_out_of_memory():
    def broken(n: int) -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        largest_that_fits(broken, 8)
    assert is_out_of_memory(torch.OutOfMemoryError("anything"))
    assert is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 8 GB"))
    assert not is_out_of_memory(RuntimeError("out of range"))


def test_the_option_takes_a_number_or_auto():
    assert parse_micro_batch_size("auto") == AUTO and parse_micro_batch_size("AUTO") == AUTO
    assert parse_micro_batch_size("16") == 16 and parse_micro_batch_size("0") == 0
    for bad in ("-1", "half"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_micro_batch_size(bad)


@pytest.mark.usefixtures("one_rank")
def test_auto_settles_lower_and_learns_exactly_as_that_fixed_size(tmp_path, monkeypatch, capsys):
    auto, fixed, whole = tmp_path / "auto", tmp_path / "fixed", tmp_path / "whole"
    assert main([*ARGS, "--steps", "4", "--output-dir", str(whole)]) == 0  # no hook: the whole batch at once
    monkeypatch.setenv(TEST_OOM_VARIABLE, "40")
    assert main([*ARGS, "--steps", "4", "--micro-batch-size", "auto", "--output-dir", str(auto)]) == 0
    assert "micro-batch: auto settled on 32 sequences (4 accumulation steps" in capsys.readouterr().out
    assert main([*ARGS, "--steps", "4", "--micro-batch-size", "32", "--output-dir", str(fixed)]) == 0

    assert summary(auto)["micro_batch_size"] == 32  # 128 and 64 ran out of memory
    # The trials changed nothing: the same run as a fixed 32, bit for bit.
    assert summary(auto)["param_checksums"] == summary(fixed)["param_checksums"]
    rows = {name: read_jsonl(d / "metrics.jsonl") for name, d in (("auto", auto), ("whole", whole))}
    # The effective batch is the same: the loss per step matches the whole batch's up to summation order.
    assert [r["loss"] for r in rows["auto"]] == pytest.approx([r["loss"] for r in rows["whole"]], abs=1e-6)
    assert [r["reward_mean"] for r in rows["auto"]] == [r["reward_mean"] for r in rows["whole"]]


@pytest.mark.usefixtures("one_rank")
def test_a_fixed_size_above_the_hooks_limit_runs_out_of_memory(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_OOM_VARIABLE, "40")
    with pytest.raises(torch.OutOfMemoryError, match="a forward of 64 sequences is out of memory"):
        main([*ARGS, "--steps", "1", "--micro-batch-size", "64", "--output-dir", str(tmp_path)])


@pytest.mark.usefixtures("one_rank")
def test_the_settled_size_is_kept_across_a_resume_which_stays_exact(tmp_path, monkeypatch, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    auto = [*ARGS, "--micro-batch-size", "auto"]
    monkeypatch.setenv(TEST_OOM_VARIABLE, "40")
    assert main([*auto, "--steps", "6", "--output-dir", str(straight)]) == 0
    assert main([*auto, "--steps", "3", "--output-dir", str(resumed)]) == 0
    capsys.readouterr()
    # Without the hook a new trial would settle on the whole batch: the resume must not try again.
    monkeypatch.delenv(TEST_OOM_VARIABLE)
    assert main([*auto, "--steps", "6", "--output-dir", str(resumed)]) == 0
    out = capsys.readouterr().out
    assert (
        "micro-batch: 32 sequences (auto, settled before the checkpoint)" in out and "settled on" not in out
    )
    assert summary(resumed)["micro_batch_size"] == 32 and summary(resumed)["resumes"] == 1
    assert summary(resumed)["param_checksums"] == summary(straight)["param_checksums"]


@pytest.mark.usefixtures("one_rank")
def test_auto_under_fsdp_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--strategy", "fsdp", "--micro-batch-size", "auto", "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--micro-batch-size auto works with --strategy ddp" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_agree_on_the_settled_size(tmp_path):
    out = tmp_path / "run"
    # Only rank 1 runs out of memory: rank 0 (which logs and writes the summary) must still halve with it.
    proc = torchrun(
        2, *ARGS, "--steps", "2", "--micro-batch-size", "auto", "--output-dir", str(out),
        extra_env={TEST_OOM_VARIABLE: "20", TEST_OOM_RANK_VARIABLE: "1"},
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    result = summary(out)
    assert result["micro_batch_size"] == 16  # each rank's 64 sequences: 64 and 32 ran out of memory on rank 1
    assert len(set(result["param_checksums"])) == 1
    assert proc.stdout.count("micro-batch: auto settled on 16 sequences") == 1  # said by rank 0 alone
