"""rv run --on SESSION: what a session can hold, decided before anything is sent (rv.job.onsession)."""

from __future__ import annotations

import pytest

from rv.errors import UsageError
from rv.job.inside import RunningJob
from rv.job.launch import RunOptions
from rv.job.onsession import fit, refuse_alone
from rv.job.records import ClusterRun
from rv.job.submit import OnSession
from rv.job.up import holder_command
from rv.slurm.parse import QueuedJob, parse_job_id


def held(command=None, gpus=2, gpu_type="a6000", nodes=1, limit=3600, elapsed=600, container=None):
    meta = {"name": "held", "command": command or holder_command(), "gpus": gpus, "gpu_type": gpu_type,
            "nodes": nodes}  # fmt: skip
    if container is not None:
        meta["container"] = container
    run = ClusterRun("r1", meta, (), None, False, False)
    job = QueuedJob(parse_job_id("42"), "RUNNING", None, elapsed, limit, nodes, ("node1",) * nodes, (), "gpu",
                    None, None, "held")  # fmt: skip
    return RunningJob(run=run, job=job, root="/r")


def options(**kw) -> RunOptions:
    return RunOptions(command=("python", "x.py"), **kw)


def test_what_is_left_out_is_the_sessions_and_its_time_left_bounds_the_run():
    fitted, on = fit(options(), held())
    assert (fitted.gpus, fitted.gpu_type, fitted.nodes, fitted.max_segments) == (2, "a6000", 1, 1)
    assert fitted.time == "00:50:00"
    assert (on.job_id, on.nodes) == ("42", ("node1",))
    assert on.srun_argv("abc")[:3] == ["srun", "--jobid=42", "--overlap"]
    assert fit(options(gpus=1, gpu_type="A6000"), held())[0].gpus == 1


def test_a_step_of_a_session_in_an_image_runs_in_that_image_unless_told_otherwise():
    image = {"runtime": "apptainer", "image": "/r/images/k1/image.sif", "binds": ["/r"]}
    fitted = fit(options(), held(container=image))[0]
    assert (fitted.container, fitted.container_runtime) == ("/r/images/k1/image.sif", "apptainer")
    assert fit(options(container="none"), held(container=image))[0].container == "none"
    other = fit(options(container="/other.sqfs"), held(container=image))[0]
    assert (other.container, other.container_runtime) == ("/other.sqfs", None)
    assert fit(options(), held())[0].container is None  # a session on the host: its steps too


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (
            {"gpus": 3},
            "-g 3 asks more than it holds: job 42, 2 GPU(s) of type a6000 on 1 node(s), 00:50:00 left",
        ),
        ({"gpu_type": "a100"}, "-t a100 asks another type"),
        ({"nodes": 2}, "--nodes 2 asks more"),
        ({"time": "1h"}, "--time 1h runs past its end"),
    ],
)
def test_more_than_the_session_holds_is_refused(kw, words):
    with pytest.raises(UsageError) as e:
        fit(options(**kw), held())
    assert words in str(e.value)


def test_a_run_that_is_not_a_session_a_sweep_and_a_chain_are_refused():
    with pytest.raises(UsageError, match="is not a session"):
        fit(options(), held(command=["python", "train.py"]))
    with pytest.raises(UsageError, match="no --sweep"):
        refuse_alone(options(sweep=("a=1,2",)))
    with pytest.raises(UsageError, match="no chains"):
        refuse_alone(options(max_segments=3))


def test_the_step_gives_the_script_the_sessions_nodes_back():
    # A step's task sees its one node as the job's: the run's own srun over the session's two nodes
    # would be refused ("Only allocated 1 nodes asked for 2") without the session's list and count.
    on = OnSession("held", "42", ("node1", "node2"))
    argv = on.srun_argv("abc")
    assert argv[argv.index("--nodelist=node1") :][-5:] == [
        "env", "SLURM_JOB_NODELIST=node1,node2", "SLURM_NODELIST=node1,node2", "SLURM_NNODES=2",
        "SLURM_JOB_NUM_NODES=2",
    ]  # fmt: skip
