"""Precision choice, the scaler, and skipping non-finite steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from train_helpers import (
    HELPERS,
    checkpoint_params,
    one_rank,  # noqa: F401  (the fixture below)
    read_jsonl,
    summary,
)

from rv_train import EXIT_NON_FINITE
from rv_train.dist import Precision, choose_precision, init_distributed, make_scaler
from rv_train.model import build_tiny
from rv_train.trainer import main, optimizer_step

# A one-process gloo group for in-process runs, no rv variables from the shell, one thread.
pytestmark = pytest.mark.usefixtures("one_rank")


# --- choosing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cli", "env", "device", "cc", "expected"),
    [
        ("auto", {}, "cuda", (7, 0), "fp16"),  # V100
        ("auto", {}, "cuda", (8, 0), "bf16"),  # A100
        ("auto", {}, "cuda", (9, 0), "bf16"),  # H100/H200
        ("auto", {}, "cpu", None, "fp32"),
        ("auto", {"RV_PRECISION": "bf16"}, "cpu", None, "fp32"),  # loopback cluster: fake GPUs, no CUDA
        ("fp16", {"RV_PRECISION": "bf16"}, "cpu", None, "fp16"),  # an explicit flag wins, even on CPU
        ("bf16", {}, "cpu", None, "bf16"),
        ("auto", {"RV_PRECISION": "fp16"}, "cuda", (8, 6), "fp16"),
        ("auto", {"RV_PRECISION": "bf16"}, "cuda", (7, 0), "fp16"),  # bf16 needs cc >= 8.0
        ("auto", {"ACCELERATE_MIXED_PRECISION": "no"}, "cuda", (8, 0), "fp32"),
        ("auto", {"RV_PRECISION": "fp16", "ACCELERATE_MIXED_PRECISION": "bf16"}, "cuda", (8, 0), "fp16"),
        ("fp32", {}, "cuda", (7, 0), "fp32"),  # Qwen on a V100: fp16 forward passes overflow
    ],
)
def test_precision_choice(cli, env, device, cc, expected):
    assert choose_precision(cli, env, device, cc).name == expected


def test_precision_reason_names_what_was_asked_and_what_is_used():
    chosen = choose_precision("auto", {"RV_PRECISION": "bf16"}, "cpu", None)
    assert "RV_PRECISION=bf16" in chosen.reason and "fp32" in chosen.reason
    with pytest.raises(ValueError, match="RV_PRECISION='tf32'"):
        choose_precision("auto", {"RV_PRECISION": "tf32"}, "cuda", (8, 0))


def test_scaler_only_for_fp16_and_sharded_under_fsdp():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    cpu = torch.device("cpu")
    assert make_scaler(Precision("bf16", ""), "ddp", cpu) is None
    assert make_scaler(Precision("fp32", ""), "fsdp", cpu) is None
    ddp = make_scaler(Precision("fp16", ""), "ddp", cpu)
    assert type(ddp) is torch.amp.GradScaler
    assert isinstance(make_scaler(Precision("fp16", ""), "fsdp", cpu), ShardedGradScaler)


# --- skipping bad steps ----------------------------------------------------------------------------


def _linear_with_grad(value: float, scaler=None) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.Linear(3, 1)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    loss = layer(torch.ones(1, 3)).sum() * value
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return layer, opt


def _snapshot(layer: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in layer.parameters()]


def test_a_flagged_step_is_skipped_and_changes_nothing():
    env = init_distributed()
    layer, opt = _linear_with_grad(1.0)
    before = _snapshot(layer)
    applied, norm = optimizer_step(layer, opt, None, True, 1.0, env)
    assert not applied and norm != norm  # NaN: no norm was computed
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(layer), strict=True))
    assert all(p.grad is None for p in layer.parameters())  # the bad gradients are dropped
    applied, norm = optimizer_step(*_linear_with_grad(1.0), None, False, 1.0, env)
    assert applied and norm > 0


def test_non_finite_gradients_are_skipped_without_a_scaler():
    env = init_distributed()
    layer, opt = _linear_with_grad(float("inf"))
    before = _snapshot(layer)
    applied, _ = optimizer_step(layer, opt, None, False, 1.0, env)
    assert not applied
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(layer), strict=True))


def test_the_scaler_skips_inf_gradients_and_backs_off():
    env = init_distributed()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    layer, opt = _linear_with_grad(float("inf"), scaler)
    before = _snapshot(layer)
    applied, _ = optimizer_step(layer, opt, scaler, False, 1.0, env)
    assert not applied and scaler.get_scale() == 512.0
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(layer), strict=True))


# --- whole runs ------------------------------------------------------------------------------------


def test_fp16_autocast_with_grad_scaler_on_cpu(tmp_path):
    code = main(["--precision", "fp16", "--steps", "4", "--output-dir", str(tmp_path), "--save-every", "0"])
    assert code == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert summary(tmp_path)["precision"] == "fp16"
    assert all(r["loss_scale"] > 0 for r in rows) and rows[-1]["reward_mean"] >= 0
    params = checkpoint_params(tmp_path / "checkpoints" / "step_0000004")
    assert {p.dtype for p in params.values()} == {torch.float32}  # master weights stay fp32, never .half()
    init = build_tiny(14, 11, 0, 64, 2, 4).state_dict()
    assert any(not torch.equal(params[k], init[k]) for k in init)  # and the steps were applied


def test_non_finite_loss_steps_are_skipped_counted_and_stop_the_run(tmp_path, capsys):
    code = main(
        [
            "--task",
            f"{HELPERS}:NaNReward",
            "--steps",
            "10",
            "--max-nonfinite-steps",
            "2",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == EXIT_NON_FINITE
    assert "non-finite" in capsys.readouterr().err
    result = summary(tmp_path)
    assert result["step"] == 2 and result["skipped_steps"] == 2
    params = checkpoint_params(tmp_path / "checkpoints" / "step_0000002")
    init = build_tiny(14, 11, 0, 64, 2, 4).state_dict()
    assert all(torch.equal(params[k], init[k]) for k in init)  # nothing was applied
