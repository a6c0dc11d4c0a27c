"""Whole runs in one process: learning, the circuit breaker, GSM8K plumbing, the command line, the
environment contract with rv's job script, and the example script as the cluster runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig

import pytest
from train_helpers import (
    HELPERS,
    REPO,
    one_rank,  # noqa: F401  (the fixture below)
    read_jsonl,
    summary,
)

from rv.contract import PREEMPTED
from rv_train import EXIT_USAGE, EXIT_ZERO_REWARD
from rv_train import checkpoint as ckpt
from rv_train.checkpoint import COMPLETE
from rv_train.trainer import main

pytestmark = pytest.mark.usefixtures("one_rank")


def test_learns_reversal_within_a_fixed_step_budget(tmp_path):
    code = main(
        ["--steps", "150", "--stop-at-reward", "0.9", "--save-every", "0", "--output-dir", str(tmp_path)]
    )
    assert code == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    result = summary(tmp_path)
    assert rows[0]["reward_mean"] < 0.2
    assert result["reason"] == "reward target" and result["reward_mean"] >= 0.9 and result["step"] <= 150
    for key in ("step", "reward_mean", "reward_std", "frac_zero_std", "kl", "clip_frac", "entropy",
                "completion_len", "tokens_per_s", "peak_mem_gb"):  # fmt: skip
        assert key in rows[-1], key
    assert rows[-1]["entropy"] < rows[0]["entropy"]  # the policy sharpened as it learned


def test_circuit_breaker_saves_explains_and_exits_3(tmp_path, capsys):
    args = [
        "--task",
        f"{HELPERS}:ZeroReward",
        "--breaker-steps",
        "3",
        "--steps",
        "20",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(args) == EXIT_ZERO_REWARD == 3
    err = capsys.readouterr().err
    assert "circuit breaker: the mean reward was 0 for 3 steps in a row (steps 1-3)" in err
    assert "run the same command again to resume" in err and "Exit code 3" in err
    assert (tmp_path / "checkpoints" / "step_0000003" / COMPLETE).is_file()
    assert summary(tmp_path)["exit_code"] == 3
    # The streak is part of the checkpoint: resuming with the reward still broken trips after one step.
    assert main(args) == EXIT_ZERO_REWARD
    assert summary(tmp_path)["step"] == 4
    # Raising the limit lets it continue.
    assert main([*args[:-4], "--breaker-steps", "6", "--steps", "20", "--output-dir", str(tmp_path)]) == 3
    assert summary(tmp_path)["step"] == 6


def test_skip_final_save_leaves_no_checkpoint_at_a_normal_end(tmp_path, capsys):
    args = ["--steps", "3", "--save-every", "0", "--skip-final-save", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    assert "no final checkpoint (--skip-final-save)" in capsys.readouterr().out
    assert ckpt.complete_checkpoints(tmp_path / "checkpoints") == []
    assert summary(tmp_path)["checkpoint"] is None and summary(tmp_path)["step"] == 3


def test_the_final_checkpoint_is_named_once(tmp_path, capsys):
    # It was said twice at the end of every run: "saved PATH in 0.2 s", then "finished at step 3
    # (completed); saved PATH".
    assert main(["--steps", "3", "--save-every", "0", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    final = str(tmp_path / "checkpoints" / "step_0000003")
    assert out.count(final) == 1, out
    assert f"saved {final} in " in out and "finished at step 3 (completed)\n" in out


def test_a_periodic_save_on_the_last_step_names_the_final_checkpoint_once(tmp_path, capsys):
    # Issue 33: the demo (150 steps, a save every 50) said "saved .../step_0000150" twice: the periodic
    # save of step 150, then the final save, which found it saved.
    assert main(["--steps", "4", "--save-every", "2", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    final = str(tmp_path / "checkpoints" / "step_0000004")
    assert out.count(final) == 1 and out.count(str(tmp_path / "checkpoints" / "step_0000002")) == 1, out


def test_skip_final_save_still_saves_on_a_stop_signal(tmp_path):
    # The stop protocol: a signal always ends with a checkpoint, whatever the flags say.
    args = ["--task", f"{HELPERS}:SignalAtStep2", "--signals", "SIGUSR2", "--steps", "10",
            "--save-every", "0", "--skip-final-save", "--output-dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    result = summary(tmp_path)
    assert result["reason"] == "signal SIGUSR2" and result["step"] == 2
    assert (tmp_path / "checkpoints" / "step_0000002" / COMPLETE).is_file()


def test_a_stop_signal_during_the_last_step_finishes_the_run_with_no_marker(tmp_path):
    # Seen in a chain on the loopback cluster: the signal came while step 300 of 300 ran, the
    # trainer wrote PREEMPTED, and rv started one more job that found nothing left to do.
    args = ["--task", f"{HELPERS}:SignalAtStep2", "--signals", "SIGUSR2", "--steps", "2",
            "--save-every", "0", "--output-dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    result = summary(tmp_path)
    assert result["reason"] == "completed" and result["step"] == 2
    assert not (tmp_path / "checkpoints" / PREEMPTED).exists()
    assert (tmp_path / "checkpoints" / "step_0000002" / COMPLETE).is_file()


def test_gsm8k_runs_on_the_built_in_model(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": f"What is {a} plus {a}?", "answer": f"{a}+{a}=<<{a}+{a}={2 * a}>>{2 * a}\n#### {2 * a}"}
        for a in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    args = ["--task", "gsm8k", "--data-path", str(data), "--steps", "2", "--prompts-per-step", "4",
            "--num-generations", "4", "--max-new-tokens", "8", "--output-dir", str(out)]  # fmt: skip
    assert main(args) == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    assert {"reward_correct", "reward_format"} <= set(metrics[-1])


def test_environment_contract_with_rvs_job_script(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RV_JOB_DIR", str(tmp_path / "job"))
    monkeypatch.setenv("RV_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("RV_PRECISION", "bf16")  # as on the loopback cluster: fake GPUs, no CUDA
    assert main(["--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "precision: fp32 (RV_PRECISION=bf16 asked, fp32 used on cpu" in out
    assert (tmp_path / "job" / "output" / "metrics.jsonl").is_file()  # $RV_JOB_DIR/output
    assert (tmp_path / "ckpt" / "step_0000001" / COMPLETE).is_file()
    monkeypatch.setenv("RV_OUTPUT_DIR", str(tmp_path / "rv-output"))
    assert main(["--steps", "2"]) == 0  # resumes from RV_CHECKPOINT_DIR
    assert [r["step"] for r in read_jsonl(tmp_path / "rv-output" / "metrics.jsonl")] == [2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-generations", "1"], "--num-generations must be >= 2"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--task-option", "digits"], "expected KEY=VALUE"),
        (["--task", "sorting"], "unknown task 'sorting'"),
        (["--signals", "SIGFOO"], "unknown signal 'SIGFOO'"),
    ],
)
def test_bad_command_lines_fail_before_training(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--output-dir", str(tmp_path)])
    assert exit_info.value.code == EXIT_USAGE == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


def _plain_copy(tmp_path):
    """The repo as the cluster sees it: a plain copy, nothing installed (rv_train imports rv.contract)."""
    root = tmp_path / "repo"
    for package in ("rv", "rv_train"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "examples" / "grpo", root / "examples" / "grpo")
    return root


def test_example_runs_from_a_plain_copy_of_the_repo(tmp_path):
    root = _plain_copy(tmp_path)
    # -S hides site-packages' .pth files, so the editable install of this repo is invisible; torch and
    # the rest come from site-packages on PYTHONPATH. Run from another folder: only train.py's own
    # sys.path fallback can find rv_train.
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import rv_train"], env=env, cwd=tmp_path, capture_output=True
    )
    assert probe.returncode != 0  # the copy is the only rv_train there is
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            str(root / "examples" / "grpo" / "train.py"),
            "--steps",
            "2",
            "--output-dir",
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(0 <= r["reward_mean"] <= 1 for r in rows)


def test_help_and_no_rv_import():
    # The trainer runs on the cluster without the CLI: of rv it imports the contract only, and none of
    # the CLI's dependencies.
    code = (
        "import sys, rv_train.trainer\n"
        "rv = sorted(m for m in sys.modules if m.split('.')[0] == 'rv')\n"
        "assert rv == ['rv', 'rv.contract'], rv\n"
        "assert not {'click', 'rich', 'paramiko', 'git'} & set(sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60).returncode
        == 0
    )
    proc = subprocess.run(
        [sys.executable, "-m", "rv_train", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--strategy {ddp,fsdp}" in proc.stdout


def test_example_readme_holds_the_exact_rv_run_lines():
    readme = (REPO / "examples" / "grpo" / "README.md").read_text(encoding="utf-8")
    for line in (
        "rv run -g 2 -t a6000 -- torchrun examples/grpo/train.py\n",
        "rv run -g 2 -t a6000 -- torchrun examples/grpo/train.py --strategy fsdp\n",
        "rv run -g 4 -t a6000 --nodes 2 -- torchrun examples/grpo/train.py --strategy fsdp",
        "rv run -g 4 -t a6000 -- torchrun examples/grpo/train.py ...",
        "--model /scratch/YOU/models/qwen2.5-0.5b-instruct --task gsm8k",
    ):
        assert line in readme, line
