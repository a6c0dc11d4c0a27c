"""The wiring of sweeps and metrics into runs: what a run records, how points are named, submitted
and shown (pure parts and the agent's side on temp folders; the cluster itself is in
tests/integration/test_sweeps.py)."""

from __future__ import annotations

from rv.catalog import RIVANNA
from rv.job.submit import script_context, submit_args
from rv.layout import RemoteLayout
from rv.request import build_request

ROOT = "/scratch/u/rv"


def test_run_json_records_the_metrics_file_the_job_names():
    req = build_request(RIVANNA, command=["python", "train.py"], gpu_type="a6000", name="exp")
    ctx = script_context(
        RemoteLayout(ROOT), run_id="r1", snapshot_id="s1", project="proj", account=None, has_secrets=False
    )
    args = submit_args(RemoteLayout(ROOT), req, ctx, provenance={}, has_secrets=False)
    assert args["meta"]["metrics"] == f"{ROOT}/outputs/proj/exp/metrics.jsonl"
    assert f"RV_METRICS={ROOT}/outputs/proj/exp/metrics.jsonl" in args["script"]
