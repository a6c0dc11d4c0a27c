"""The secrets sweep a command's session carries (rv.job.secretsweep): in the core, the CLI only calls it."""

from __future__ import annotations

import json
import time
import zlib
from types import SimpleNamespace
from typing import Any

from rv.errors import ConnectError
from rv.job.records import RunRecord, RunStore
from rv.job.secretsweep import COULD_NOT, SecretsSweep, may_have_secrets_left


def record(run_id: str, *, secrets: bool = True, root: str = "/r") -> RunRecord:
    return RunRecord(
        run_id, f"n-{run_id}", "p", root, "proj", "snap", "main", "abc1234", False, ["true"], {"nodes": 1},
        time.time(), "1", has_secrets=secrets,
    )  # fmt: skip


class Cluster:
    """A transport whose agent answers secrets-sweep as the agent does (or fails): the calls it got."""

    def __init__(self, reply: dict[str, Any] | None = None) -> None:
        self.reply, self.calls = reply, []

    def run_agent(self, mode: str, args: dict[str, Any], *, stdin: Any = None, timeout: Any = None) -> Any:
        self.calls.append((mode, args["ids"]))
        if self.reply is None:
            raise ConnectError("the cluster is unreachable")
        return SimpleNamespace(exit_code=0, stdout=zlib.compress(json.dumps(self.reply).encode()), err=b"")


def sweep_of(tmp_path, said: list[str]) -> SecretsSweep:
    return SecretsSweep(
        tmp_path / "runs.json", "p", "/r", note=said.append, warn=lambda m: said.append("!" + m)
    )


def test_a_sweep_that_rode_along_marks_the_runs_and_the_end_asks_nothing(tmp_path):
    store = RunStore(tmp_path / "runs.json")
    for r in (record("a1"), record("b2"), record("c3", secrets=False), record("d4", root="/other")):
        store.add(r)
    said: list[str] = []
    sweep = sweep_of(tmp_path, said)
    assert sweep.along() == ["a1", "b2"]  # only runs of this profile and root sent with secrets
    sweep.swept({"removed": ["a1"], "live": ["b2"]})
    assert said == ["removed the secrets of run n-a1 (a1): its job ended without removing them"]
    assert {r.run_id: r.secrets_cleared for r in store.all("p")} == {"a1": True, "b2": False, "c3": False,
                                                                     "d4": False}  # fmt: skip
    cluster = Cluster({"removed": [], "live": []})
    sweep.at_end(cluster)  # type: ignore[arg-type]
    assert cluster.calls == []


def test_the_end_sweeps_on_its_own_call_only_when_a_run_may_have_secrets_left(tmp_path):
    said: list[str] = []
    cluster = Cluster({"removed": [], "live": []})
    sweep_of(tmp_path, said).at_end(cluster)  # type: ignore[arg-type]
    assert cluster.calls == [] and not may_have_secrets_left(tmp_path / "runs.json", "p", "/r")
    RunStore(tmp_path / "runs.json").add(record("a1"))
    cluster.reply = {"removed": [], "live": ["a1"]}  # its job is alive: its secrets stay, still pending
    sweep_of(tmp_path, said).at_end(cluster)  # type: ignore[arg-type]
    assert cluster.calls == [("secrets-sweep", ["a1"])] and said == []
    # A failed sweep is said, never raised: the command's own work is done.
    down = Cluster(None)
    sweep_of(tmp_path, said).at_end(down)  # type: ignore[arg-type]
    assert down.calls and said == [f"!{COULD_NOT}: the cluster is unreachable"]


def test_records_that_cannot_be_read_here_are_left_to_the_real_reader(tmp_path):
    (tmp_path / "runs.json").write_text("{not json")
    assert may_have_secrets_left(tmp_path / "runs.json", "p", "/r")
