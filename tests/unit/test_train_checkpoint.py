"""Checkpoints: atomic layout, keep-last-K, exact resume, and the reference model after a resume."""

from __future__ import annotations

import json
import random

import pytest
import torch
from train_helpers import (
    one_rank,  # noqa: F401  (the fixture below)
    read_jsonl,
    summary,
)

from rv_train import checkpoint as ckpt
from rv_train.dist import init_distributed, unwrap
from rv_train.model import build_tiny
from rv_train.trainer import main, parse_args, setup

# A one-process gloo group for in-process runs, no rv variables from the shell, one thread.
pytestmark = pytest.mark.usefixtures("one_rank")


def _trained_model():
    model = build_tiny(14, 11, 0, 16, 1, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randint(0, 14, (2, 5))).sum().backward()
    opt.step()
    return model, opt


def test_save_load_roundtrip_restores_model_optimizer_and_rng(tmp_path):
    init_distributed()
    model, opt = _trained_model()
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    torch.manual_seed(123)
    random.seed(7)
    path = ckpt.save_checkpoint(tmp_path, 5, model, opt, {"train_state": {"step": 5}}, keep_last=0)
    expected_torch, expected_py = torch.rand(3), random.random()

    fresh = build_tiny(14, 11, 1, 16, 1, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    state = ckpt.load_checkpoint(path, fresh, fresh_opt)
    assert state == {"train_state": {"step": 5}}
    assert all(torch.equal(saved_params[k], v) for k, v in fresh.state_dict().items())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved_moments)
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py


def test_only_complete_checkpoints_count_and_partial_ones_are_removed(tmp_path):
    init_distributed()
    model, opt = _trained_model()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, keep_last=0)
    (tmp_path / "step_0000009.tmp" / "model_optim").mkdir(parents=True)  # killed mid-save
    (tmp_path / "step_0000008").mkdir()  # renamed but COMPLETE never written
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_0000001"
    assert ckpt.remove_partial(tmp_path) == [tmp_path / "step_0000009.tmp"]
    assert not (tmp_path / "step_0000009.tmp").exists()
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None


def test_keep_last_k_and_saving_a_step_twice(tmp_path):
    init_distributed()
    model, opt = _trained_model()
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {"n": step}, keep_last=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_0000003", "step_0000004"]
    again = ckpt.save_checkpoint(tmp_path, 4, model, opt, {"n": "other"}, keep_last=2)  # a stop after a save
    assert json.loads((again / "state.json").read_text()) == {"n": 4}
    assert not list(tmp_path.glob("*.tmp"))


ARGS = ["--num-iterations", "2", "--beta", "0.04", "--save-every", "0", "--log-samples-every", "2"]


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*ARGS, "--steps", "12", "--output-dir", str(straight)]) == 0
    assert main([*ARGS, "--steps", "5", "--output-dir", str(resumed)]) == 0
    assert main([*ARGS, "--steps", "12", "--output-dir", str(resumed)]) == 0

    a, b = summary(straight), summary(resumed)
    assert b["resumes"] == 1 and b["step"] == a["step"] == 12
    assert a["param_checksums"] == b["param_checksums"]  # bitwise: model, optimizer, data, RNG all restored
    rows_a, rows_b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == list(range(1, 13))
    assert [r["reward_mean"] for r in rows_a] == [r["reward_mean"] for r in rows_b]
    assert max(r["clip_frac"] for r in rows_a) > 0  # μ = 2 exercised the clip
    assert [r["step"] for r in read_jsonl(resumed / "samples.jsonl")][::4] == [2, 4, 6, 8, 10, 12]


def test_resume_rebuilds_the_reference_from_the_original_weights(tmp_path):
    assert main(["--steps", "3", "--output-dir", str(tmp_path), "--beta", "0.04"]) == 0
    ckpt.write_preempted(tmp_path / "checkpoints", 3)
    env = init_distributed()
    run = setup(parse_args(["--steps", "6", "--output-dir", str(tmp_path), "--beta", "0.04"]), env)
    assert run.state.step == 3 and run.state.resumes == 1
    original = build_tiny(14, 11, 0, 64, 2, 4).state_dict()
    policy = unwrap(run.model).state_dict()
    assert all(torch.equal(v, original[k]) for k, v in run.ref.state_dict().items())
    assert any(not torch.equal(v, original[k]) for k, v in policy.items())
    assert not (tmp_path / "checkpoints" / ckpt.PREEMPTED).exists()  # a resumed run clears the marker
