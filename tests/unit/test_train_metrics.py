"""rv_train's metrics log under rv: it writes where $RV_METRICS says, and a resumed run's cut of the
steps it repeats survives a line a killed segment left half written."""

from __future__ import annotations

import json

from rv_train.metrics import MetricsLog

STEP = {
    "step": 3, "reward_mean": 0.5, "reward_std": 0.1, "frac_zero_std": 0.0, "kl": 0.01, "clip_frac": 0.0,
    "entropy": 1.0, "completion_len": 12.0, "tokens_per_s": 100.0, "peak_mem_gb": 0.1,
}  # fmt: skip


def test_metrics_go_to_rv_metrics_when_rv_sets_it(tmp_path, monkeypatch):
    named = tmp_path / "elsewhere" / "m.jsonl"
    monkeypatch.setenv("RV_METRICS", str(named))
    log = MetricsLog(tmp_path / "out", is_main=True, resume_step=0)
    log.step(dict(STEP))
    assert [json.loads(line)["step"] for line in named.read_text().splitlines()] == [3]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_without_rv_metrics_they_go_to_the_output_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("RV_METRICS", raising=False)
    MetricsLog(tmp_path / "out", is_main=True, resume_step=0).step(dict(STEP))
    assert (tmp_path / "out" / "metrics.jsonl").is_file()


def test_a_resume_drops_later_steps_and_half_lines_and_keeps_lines_without_a_step(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    monkeypatch.setenv("RV_METRICS", str(path))
    lines = ['{"step": 1, "a": 1}', '{"step": 2, "a": 2}', '{"note": "eval"}', '{"step": 3, "a": 3}',
             '{"step": 4, "a": 4', '{"step": 5, "a": 5}']  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    MetricsLog(tmp_path / "out", is_main=True, resume_step=2)
    assert path.read_text().splitlines() == ['{"step": 1, "a": 1}', '{"step": 2, "a": 2}', '{"note": "eval"}']
