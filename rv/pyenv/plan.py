"""The run's environment, decided from the snapshot and the flags alone, before the first network call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rv.errors import UsageError
from rv.pyenv.spec import EnvSpec, activation_lines, find_spec, import_paths


@dataclass(frozen=True)
class EnvPlan:
    spec: EnvSpec | None = None  # build (or reuse) the environment these files describe
    use: str | None = None  # --env PATH: a prefix on the cluster, used as is
    paths: tuple[str, ...] = ()  # folders of the work dir put on PYTHONPATH
    notes: tuple[str, ...] = ()

    def lines(self, prefix: str, *, in_image: bool = False) -> tuple[str, ...]:
        """The job's env-build hook lines for the environment at ``prefix`` (none for --env none)."""
        if self.spec is None and self.use is None:
            return ()
        return activation_lines(prefix, self.paths, in_image=in_image)


def plan(
    snap: Any,
    choice: str,
    *,
    requirements: str | None = None,
    extras: Sequence[str] = (),
    python: str | None = None,
    system_site_packages: bool = False,
) -> EnvPlan:
    """``--env auto|none|PATH`` with its companions, checked against the snapshot's own files."""
    building = {"--requirements": requirements, "--extra": extras, "--python": python}
    if choice != "auto":
        given = [flag for flag, value in building.items() if value]
        if given:
            raise UsageError(
                f"{', '.join(given)} describe an environment for rv to build, but --env {choice} says not to",
                hint="leave out --env (auto), or the other flags",
            )
    if choice == "none":
        return EnvPlan()
    files = snap.tree.paths  # membership by binary search: no parse of the whole manifest
    start = snap.subdir or ""
    if choice != "auto":
        if not (choice.startswith("/") or choice.startswith("~/")) or any(c in choice for c in "\n\0"):
            raise UsageError(
                f"--env {choice!r}: expected auto, none, or an absolute path on the cluster (a venv or conda "
                "prefix)",
                hint="e.g. --env ~/venvs/torch  or  --env /project/mylab/conda/envs/llm",
            )
        return EnvPlan(use=choice, paths=import_paths(files, start))
    spec = find_spec(
        files, lambda path: (snap.tree.root / path).read_bytes(), start=start, requirements=requirements,
        extras=extras, python=python, system_site_packages=system_site_packages,
    )  # fmt: skip
    if spec is None:
        return EnvPlan()
    notes = tuple(
        f"{line}: left out of the shared environment (the project is importable in the job from its work dir)"
        for line in spec.dropped
    )
    return EnvPlan(spec=spec, paths=import_paths(files, spec.folder), notes=notes)
