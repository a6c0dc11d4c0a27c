"""rv.job.launch without a network: the plan (everything checked before the first network call), the
dry run, the script context's one place, and what the pipeline says through its view."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_cli import CONFIG as ONE_TYPE

from rv.config import parse_config
from rv.errors import UsageError
from rv.job import launch as pipeline
from rv.layout import RemoteLayout
from rv.placement import Estimate, Placement
from rv.pyenv.client import Environment
from rv.pyenv.plan import EnvPlan

pytestmark = pytest.mark.usefixtures("hermetic_home")

# test_cli's profile (one type, a6000), and a second type: a run without -t may take either.
CONFIG = (
    ONE_TYPE
    + """
[profiles.lab.gpus.a100]
partition = "gpu-a100"
gres = "a100"
gpus_per_node = 4
nodes = 2
"""
)


class Heard:
    """A LaunchView that keeps what it is told."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def note(self, message: str) -> None:
        self.said.append(("note", message))

    def warn(self, message: str) -> None:
        self.said.append(("warn", message))

    @contextmanager
    def building(self):
        yield lambda line: self.said.append(("build", line))

    @contextmanager
    def uploading(self):
        yield None


@pytest.fixture
def profile(tmp_path):
    return parse_config(CONFIG, tmp_path / "rv.toml").profile("lab")


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "train.py").write_text("print(1)\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    return repo


def test_a_plan_is_checked_and_prepared_before_any_network_call(profile, repo):
    heard = Heard()
    options = pipeline.RunOptions(command=("python", "train.py"), setup=("echo hi",), rv_flags={})
    plan = pipeline.plan_run(options, profile, here=repo / "sub", view=heard)
    # One candidate per GPU type the run may take (none named, two in the catalog), each with the
    # `cd` into the folder the command was typed in, after the run's setup.
    assert [c.type.name for c in plan.candidates] == ["a100", "a6000"]
    assert all(c.setup == ("echo hi", "cd sub") for c in plan.candidates)
    assert plan.env_setup == ("echo hi",)
    assert plan.snapshot.tree.files == 1 and plan.sweep is None and plan.from_run is None
    assert plan.request.name.startswith("train-") and plan.run_id.startswith(plan.request.name[-6:])


def test_the_script_context_comes_from_the_plan_before_and_after_the_upload(profile, repo):
    plan = pipeline.plan_run(
        pipeline.RunOptions(command=("python", "train.py"), gpu_type="a6000"),
        profile,
        here=repo,
        view=Heard(),
    )
    layout = RemoteLayout("/scratch/me/rv")
    before = plan.context(layout)
    assert (before.run_id, before.snapshot_id, before.account) == (plan.run_id, plan.snapshot.id, "lab")
    assert before.placement == Placement() and before.umask == "077" and not before.has_secrets

    class Uploaded:
        id, project = "f" * 64, "proj-x"

    after = plan.context(layout, run_id="r-1", uploaded=Uploaded(), env_build=("x",), sweep_env={"A": "1"})
    assert (after.run_id, after.snapshot_id, after.project) == ("r-1", "f" * 64, "proj-x")
    assert after.env_build == ("x",) and after.sweep_env == (("A", "1"),)


def test_a_dry_run_renders_every_candidate_and_a_sweeps_first_point(profile, repo):
    heard = Heard()
    plan = pipeline.plan_run(
        pipeline.RunOptions(command=("python", "train.py")), profile, here=repo, view=heard
    )
    shown = pipeline.dry_run(plan)
    assert set(shown.scripts) == {"a100", "a6000"} and shown.script == shown.scripts["a100"]
    options = pipeline.RunOptions(
        command=("python", "train.py", "--lr", "{lr}"), gpu_type="a6000", sweep=("lr=1,2",)
    )
    sweep = pipeline.plan_run(options, profile, here=repo, view=heard)
    assert [p.command for p in sweep.points.values()] == [
        ("python", "train.py", "--lr", "1"),
        ("python", "train.py", "--lr", "2"),
    ]
    shown = pipeline.dry_run(sweep)
    assert [p.spec for p in shown.parts] == ["0-1"] and "RV_SWEEP_LR" in shown.script


def test_refusals_come_before_anything_is_prepared(profile, repo):
    heard = Heard()
    with pytest.raises(UsageError, match="-g 4 went to the program"):
        pipeline.plan_run(
            pipeline.RunOptions(command=("python", "train.py", "-g", "4"), rv_flags={"-g": True}),
            profile, here=repo, view=heard,
        )  # fmt: skip
    # (A sweep over several types was refused here; since issue 33 it takes one: the test below.)
    with pytest.raises(UsageError, match="-f follows one run"):
        pipeline.plan_run(
            pipeline.RunOptions(command=("python", "train.py"), sweep=("x=1,2",), follow=True),
            profile,
            here=repo,
            view=heard,
        )
    with pytest.raises(UsageError, match="rv up takes one GPU type, not a100,a6000"):
        pipeline.plan_up(pipeline.JobOptions(gpu_type="a100,a6000"), profile, here=repo, view=heard)
    assert not [s for s in heard.said if "snapshot" in s[1]]  # nothing was listed


def test_a_sweep_that_could_take_several_types_takes_the_first_and_says_which(profile, repo):
    # Issue 33: it was refused, so the guide's sweep (no -t) failed on a cluster of two types.
    heard = Heard()
    options = pipeline.RunOptions(command=("python", "train.py", "{x}"), sweep=("x=1,2",))
    plan = pipeline.plan_run(options, profile, here=repo, view=heard)
    assert [c.type.name for c in plan.candidates] == ["a100"]
    assert {r.type.name for r in plan.points.values()} == {"a100"}
    assert (
        "note",
        "a sweep runs on one GPU type: a100, the first that can serve it (-t picks another: a6000)",
    ) in heard.said
    # A project's `follow = true` leaves a sweep alone, and says so; a typed -f is refused (above).
    options = pipeline.RunOptions(
        command=("python", "train.py", "{x}"), sweep=("x=1,2",), gpu_type="a6000", follow=True,
        follow_from="pyproject.toml [tool.rv]",
    )  # fmt: skip
    assert pipeline.plan_run(options, profile, here=repo, view=heard).sweep is not None
    assert (
        "note",
        "follow = true (pyproject.toml [tool.rv]) is for single runs: a sweep's points are not followed",
    ) in heard.said


def test_sbatch_leaves_out_the_types_it_refuses_and_says_when_the_others_start(profile, repo):
    heard = Heard()
    plan = pipeline.plan_run(
        pipeline.RunOptions(command=("python", "train.py")), profile, here=repo, view=heard
    )
    heard.said.clear()
    estimates = [
        Estimate("a100", None, None, None, "Requested node configuration is not available"),
        Estimate("a6000", "2026-11-25T22:47:49", "gpu-01", "gpu-a6000", None),
    ]
    kept = pipeline.choose_candidates(plan.candidates, estimates, heard)
    assert [r.type.name for r in kept] == ["a6000"]
    assert heard.said == [
        ("note", "a6000: would start 2026-11-25T22:47:49 on gpu-01"),
        ("warn", "left out a100: Requested node configuration is not available (sbatch refuses it)"),
    ]
    with pytest.raises(UsageError, match="sbatch refuses this job"):
        pipeline.choose_candidates(plan.candidates[:1], estimates[:1], heard)


def test_sbatch_is_asked_of_one_type_when_only_it_can_judge_the_placement(profile, repo):
    # Issue 33: --exclude alone was never probed (uploaded, then refused at submission); rv up's
    # session (start_up) and a sweep ask the same question.
    from rv.placement import PlacementOptions

    layout = RemoteLayout("/scratch/me/rv")

    def probes(**placement: str) -> list[tuple[str, str]]:
        options = pipeline.RunOptions(
            command=("python", "train.py"), gpu_type="a6000", placement=PlacementOptions(**placement)
        )
        plan = pipeline.plan_run(options, profile, here=repo, view=Heard())
        return pipeline.placement_probes(plan.candidates, plan.context(layout), plan.placement)

    assert probes() == []  # nothing only sbatch can judge: no question before the upload
    asked = probes(exclude="gpu-01,gpu-02")
    assert [t for t, _ in asked] == ["a6000"] and "#SBATCH --exclude=gpu-01,gpu-02" in asked[0][1]
    refused = pipeline.sbatch_refuses(["Requested node configuration is not available"])
    assert refused.message == (
        "sbatch refuses this job: Requested node configuration is not available (nothing was sent)"
    )
    assert "--exclude" in (refused.hint or "")


def test_what_is_said_of_the_environment():
    plan = EnvPlan()
    assert pipeline.environment_line(Environment("/opt/v", None), plan) == "environment: /opt/v (as is)"
    waited = Environment("/r/envs/k1", "k1", waited=True)
    assert pipeline.environment_line(waited, plan) == "environment k1: built meanwhile by another rv, reused"
    assert pipeline.environment_line(Environment("/r/envs/k1", "k1"), plan) is None


def test_facts_gitpython_cannot_read_are_said_and_the_run_goes_on():
    from rv.files.listing import Soon
    from rv.files.repo import FactsUnreadable

    def unreadable() -> None:
        raise FactsUnreadable("ValueError: an object format GitPython does not know")

    class Uploaded:
        branch, commit, dirty = "main", "c" * 40, False

    heard = Heard()
    provenance = pipeline._provenance(Uploaded(), None, Soon(unreadable), heard)
    assert provenance == {
        "branch": "main",
        "commit": "c" * 40,
        "dirty": False,
        "env": None,
        "git": None,
        "image": None,
    }
    assert heard.said == [
        (
            "warn",
            "the repository's facts could not be read, so the run is recorded without them: ValueError: an "
            "object format GitPython does not know",
        )
    ]
