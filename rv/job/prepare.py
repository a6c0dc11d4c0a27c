"""The local half of starting a job, shared by `rv run` and `rv up`, before any network call.

The snapshot of the repo (listed with the cache, size-checked), the folder the program starts in,
the environment plan, and what the job creates on the cluster may be read by. What is worth telling
the user comes back as text: rv.job.launch says it through its view.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rv.config import Profile
    from rv.files.snapshot import LocalSnapshot
    from rv.pyenv.plan import EnvPlan
    from rv.request import JobRequest


@dataclasses.dataclass(frozen=True)
class Prepared:
    request: JobRequest  # with a `cd` into the subfolder the command was typed in, if any
    snapshot: LocalSnapshot
    env_plan: EnvPlan
    warnings: tuple[str, ...]  # about the snapshot (files left out, large files)
    notes: tuple[str, ...]  # about the environment plan


def prepare_local(
    req: JobRequest,
    profile: Profile,
    *,
    allow_large: bool,
    max_file_size: int,
    env_choice: str,
    requirements: str | None,
    extras: tuple[str, ...],
    python: str | None,
    system_site_packages: bool | None,
    cache_dir: Path,
    here: Path,
) -> Prepared:
    """The snapshot of the repo around ``here`` and the job's environment plan, for ``req``."""
    from rv.files.snapshot import prepare_snapshot, snapshot_warnings
    from rv.pyenv.plan import plan

    # The last listing of this repo is reused: a resubmit lists and hashes only what changed.
    snap = prepare_snapshot(here, max_file_size=max_file_size, allow_large=allow_large, cache_dir=cache_dir)
    warnings = tuple(snapshot_warnings(snap))
    if snap.subdir:
        # Typed in a subfolder: the snapshot is the whole repo, the program starts where the user was.
        req = dataclasses.replace(req, setup=(*req.setup, f"cd {shlex.quote(snap.subdir)}"))
    if system_site_packages is None:
        system_site_packages = profile.system_site_packages
    env_plan = plan(
        snap, env_choice, requirements=requirements, extras=extras, python=python or profile.python,
        system_site_packages=system_site_packages,
    )  # fmt: skip
    return Prepared(req, snap, env_plan, warnings, tuple(env_plan.notes))


def job_umask(profile: Profile) -> str:
    """What the job creates (work dir, logs, checkpoints) is as private as what rv uploads."""
    return "027" if profile.share_with_group else "077"
