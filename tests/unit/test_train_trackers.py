"""--log-with: Accelerate's trackers get every step's metrics from rank 0, and a resumed run continues the
same tracker run. Real trackers, real files: TensorBoard's events are read back with TensorBoard's own
reader, W&B runs offline (as on a compute node without internet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_helpers import REPO, env_for_ranks, explain, read_jsonl, summary, torchrun

from rv_train.trackers import check_trackers

pytestmark = pytest.mark.slow

FEW = ["--save-every", "0", "--prompts-per-step", "8", "--log-samples-every", "0"]


def _tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _state(output_dir: Path, step: int) -> dict:
    return json.loads((output_dir / "checkpoints" / f"step_{step:07d}" / "state.json").read_text())


def test_two_ranks_log_to_tensorboard_and_a_resume_appends_to_the_same_folder(tmp_path):
    out = tmp_path / "run"
    args = [*FEW, "--log-with", "tensorboard", "--output-dir", str(out)]
    first = torchrun(2, *args, "--steps", "3", timeout=120)
    assert first.returncode == 0, explain(first)
    folder = out / "tensorboard" / "rv-grpo"
    first_files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(first_files) == 1  # rank 0 only: rank 1 wrote nothing
    rewards = [r["reward_mean"] for r in read_jsonl(out / "metrics.jsonl")]
    logged = _tensorboard_scalars(folder, "reward_mean")
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx(rewards, rel=1e-6)  # float32 in the event file

    resumed = torchrun(2, *args, "--steps", "5", timeout=120)
    assert resumed.returncode == 0, explain(resumed)
    assert summary(out)["resumes"] == 1
    assert set(first_files) < set(folder.glob("events.out.tfevents.*"))  # the same folder, a file added
    assert [s for s, _ in _tensorboard_scalars(folder, "reward_mean")] == [1, 2, 3, 4, 5]
    assert {s for s, _ in _tensorboard_scalars(folder, "loss")} == {1, 2, 3, 4, 5}  # every metric


def test_tensorboard_goes_under_rv_output_dir_when_rv_sets_it(tmp_path):
    out, rv_output = tmp_path / "trainer", tmp_path / "rv-output"
    env = {**env_for_ranks(), "RV_OUTPUT_DIR": str(rv_output), "RV_METRICS": str(rv_output / "m.jsonl")}
    proc = _one_process([*FEW, "--steps", "2", "--log-with", "tensorboard", "--output-dir", str(out)], env)
    assert proc.returncode == 0, explain(proc)
    assert [s for s, _ in _tensorboard_scalars(rv_output / "tensorboard" / "rv-grpo", "reward_mean")] == [
        1,
        2,
    ]
    assert not (out / "tensorboard").exists()
    assert [r["step"] for r in read_jsonl(rv_output / "m.jsonl")] == [1, 2]  # metrics.jsonl: RV_METRICS


def test_wandb_runs_offline_in_the_output_folder_and_a_resume_keeps_its_run_id(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in env_for_ranks().items() if not k.startswith("WANDB_")}
    env["WANDB_SILENT"] = "true"
    args = [*FEW, "--log-with", "wandb", "--output-dir", str(out), "--save-every", "2"]
    first = _one_process([*args, "--steps", "2"], env)
    assert first.returncode == 0, explain(first)
    run_id = _state(out, 2)["tracker_runs"]["wandb"]
    resumed = _one_process([*args, "--steps", "4"], env)
    assert resumed.returncode == 0, explain(resumed)
    assert _state(out, 4)["tracker_runs"]["wandb"] == run_id

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)  # one W&B run, two segments
    for run in runs:
        data = (run / f"run-{run_id}.wandb").read_bytes()
        assert b"reward_mean" in data and b"grad_norm" in data


def test_a_tracker_that_fails_to_start_ends_every_rank_at_once(tmp_path):
    # Rank 0 alone starts trackers; without telling the others they would wait in a collective.
    proc = torchrun(2, *FEW, "--steps", "2", "--log-with", "wandb", "--output-dir", str(tmp_path),
                    timeout=120, extra_env={"WANDB_MODE": "not-a-mode"})  # fmt: skip
    assert proc.returncode == 1, explain(proc)
    assert proc.stderr.count("rv_train: --log-with: a tracker failed to start: ") == 2, explain(proc)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_or_missing_trackers_are_named_before_training(monkeypatch):
    assert check_trackers(()) == []
    (problem,) = check_trackers(("tensorbord",))
    assert problem.startswith("--log-with tensorbord: not one of Accelerate's trackers (")
    assert "tensorboard" in problem and "wandb" in problem and "mlflow" in problem
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", list)  # as if nothing is installed
    assert check_trackers(("wandb",)) == ["--log-with wandb needs the wandb package: pip install wandb"]


def test_a_bad_log_with_is_a_usage_error(tmp_path):
    proc = _one_process(["--log-with", "nope", "--output-dir", str(tmp_path)], env_for_ranks())
    assert proc.returncode == 2, explain(proc)
    assert "rv_train: error: --log-with nope: not one of Accelerate's trackers" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def _one_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rv_train", "--threads", "1", *args],
        cwd=REPO,
        env={k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_no_tracker_is_loaded_without_log_with():
    # Accelerate's tracking module costs about half a second to import: only --log-with pays it.
    code = "import sys, rv_train.trainer; assert 'accelerate.tracking' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
