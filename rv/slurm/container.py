"""A run's container in its batch script: the image and runtime the cluster chose, and the lines
that bind folders, run the program inside, let `rv ssh` enter it, and give Pyxis its srun options.
rv.job.container checks what was asked; rv.agent.container holds each runtime's command line."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from rv.agent import container as adapter


@dataclass(frozen=True)
class Container:
    """What the job runs in: the image's path on the cluster and the runtime chosen there."""

    image: str
    runtime: str


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def binds(root: str, others: Sequence[str]) -> list[str]:
    """The folders bound at their own path: the remote root, and each of ``others`` outside it."""
    out = [root]
    for p in others:
        p = posixpath.normpath(p)
        if not any(_under(p, b) for b in out):
            out.append(p)
    return out


DROP_HOST_VENV = adapter.DROP_HOST_VENV


def _bind_words(folders: Sequence[str], work_bind: bool) -> list[str]:
    """The folders as shell words; with ``work_bind`` (--work-dir node) the node's own work dir too,
    ``"$PWD"`` where the task stands (its folder is the node's: $SLURM_TMPDIR, $TMPDIR, ...)."""
    return [shlex.quote(f) for f in folders] + (['"$PWD"'] if work_bind else [])


def program_lines(
    c: Container, program: str, *, folders: Sequence[str], gpus: bool, work_bind: bool = False
) -> list[str]:
    """The body of ``rv_program`` running ``program`` inside the image (Pyxis: as is, its task is
    inside already). The work dir is the task's own (``$PWD``), expanded on the node."""
    if c.runtime == "pyxis":
        return [f"    exec {program}"]
    words = adapter.wrap_words(c.runtime, c.image, _bind_words(folders, work_bind), '"$PWD"', gpus)
    return [f"    {DROP_HOST_VENV}", f"    exec {' '.join(words)} {program}"]


# The file beside the job's environment file that `rv ssh` and `rv up` enter the image by
# (rv.job.inside's ATTACH): a function running its arguments inside, from the current directory.
ENTER_FILE = "container.sh"


def enter_lines(c: Container, *, folders: Sequence[str], gpus: bool, work_bind: bool = False) -> list[str]:
    """The batch script's lines, after rv_start, that let a shell of the job enter the image: the
    function in ``$RV_JOB_DIR/container.sh``, and the host venv dropped at the end of the job's
    environment file (sourced inside). Pyxis: the env file's line alone; a step enters its image by
    srun's own options (:func:`attach_options`)."""
    drop = (
        f'if [ -f "$RV_JOB_DIR/$RV_JOB_ENV_FILE" ]; then printf "%s\\n" {shlex.quote(DROP_HOST_VENV)} '
        '>>"$RV_JOB_DIR/$RV_JOB_ENV_FILE"; fi'
    )
    if c.runtime == "pyxis":
        return ["# rv ssh enters the image by srun's Pyxis options; its venv is not the job's.", drop]
    words = adapter.wrap_words(c.runtime, c.image, _bind_words(folders, work_bind), '"$PWD"', gpus)
    function = f'rv_in_container() {{ exec {" ".join(words)} "$@"; }}'
    return [
        "# rv ssh and rv up enter the image too (rv.job.inside): how, beside the job's environment file.",
        f'printf "%s\\n" {shlex.quote(function)} >"$RV_JOB_DIR/{ENTER_FILE}"',
        drop,
    ]


def srun_values(c: Container, *, folders: Sequence[str]) -> list[str]:
    """The batch script's ``rv_srun_container`` (Pyxis: the options of each node's srun), or none."""
    if c.runtime != "pyxis":
        return []
    words = adapter.srun_words(c.image, list(folders), "$PWD")
    # The work dir is the batch shell's at srun's start ("$PWD" expands there); the container is
    # named after the job, so that later steps of it (rv ssh) enter the same one.
    quoted = [shlex.quote(w) for w in words[:-1]] + ['"--container-workdir=$PWD"', f'"{PYXIS_NAME}"']
    return [f"rv_srun_container=({' '.join(quoted)})"]


# Pyxis keeps a named container for the rest of the job (unnamed ones go with their step): the
# job's tasks run in this one, and `rv ssh` enters it by the same name (:func:`attach_options`).
PYXIS_NAME = "--container-name=rv-$SLURM_JOB_ID"


def attach_options(c: Container, *, folders: Sequence[str], job_id: str, workdir: str) -> list[str]:
    """The options of a step that enters the job's image from outside (``srun --overlap --jobid J``:
    `rv ssh`, `rv up`'s shell): Pyxis's, the job's named container (the import skipped, the image
    given all the same should the name be gone) with its mounts again, since Pyxis mounts at each
    step's start. None for the other runtimes: their step enters the image itself (``container.sh``)."""
    if c.runtime != "pyxis":
        return []
    return [
        *adapter.srun_words(c.image, list(folders), workdir),
        PYXIS_NAME.replace("$SLURM_JOB_ID", job_id),
    ]


def to_meta(c: Container, folders: Sequence[str]) -> dict[str, object]:
    """What the run's record keeps of its container (``meta["container"]``), for the steps that
    enter it later (:func:`attach_options`, `rv jupyter`'s tools environment)."""
    return {"runtime": c.runtime, "image": c.image, "binds": list(folders)}


def from_meta(meta: object) -> tuple[Container, list[str]] | None:
    """:func:`to_meta`'s record read back (None: no container, or a record from before it)."""
    if not isinstance(meta, dict) or not meta.get("image") or meta.get("runtime") not in adapter.RUNTIMES:
        return None
    binds = [str(b) for b in meta.get("binds") or [] if isinstance(b, str)]
    return Container(str(meta["image"]), str(meta["runtime"])), binds


def describe(c: Container) -> str:
    return f"{c.runtime} image {c.image}"
