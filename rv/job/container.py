"""The image and runtime a run asked for (``--container``, ``--container-runtime``): checked on the
laptop as far as the laptop can, resolved on the cluster by ``run-check`` (rv.agent.container: the
image there, a runtime for it after the profile's setup lines), and the words of the job's script.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rv.agent import container as adapter
from rv.errors import UsageError

NONE = "none"  # --container none: no container, over a project's or profile's default


@dataclass(frozen=True)
class ContainerSpec:
    """What was asked: the image as typed (expanded on the cluster) and the runtime, or auto."""

    image: str
    runtime: str = "auto"

    def check_args(self, setup: Sequence[str]) -> dict[str, Any]:
        return {"image": self.image, "runtime": self.runtime, "setup": list(setup)}


@dataclass(frozen=True)
class Container:
    """What the job runs in: the image's path on the cluster and the runtime chosen there."""

    image: str
    runtime: str


def parse_container(image: str | None, runtime: str | None) -> ContainerSpec | None:
    """``--container``/``--container-runtime`` (or their defaults) checked; None: no container."""
    runtime = runtime or "auto"
    if runtime not in adapter.CHOICES:
        raise UsageError(
            f"--container-runtime {runtime!r}: not a runtime rv knows",
            hint="choose one of: " + ", ".join(adapter.CHOICES),
        )
    if image is None or image.strip() in ("", NONE):
        if runtime != "auto":
            raise UsageError(
                f"--container-runtime {runtime} without --container",
                hint="give the image with --container IMAGE (a path on the cluster)",
            )
        return None
    image = image.strip()
    if adapter.is_reference(image):
        raise UsageError(
            f"--container {image}: registry references are not pulled by rv yet",
            hint="pull it on the cluster first (apptainer pull, ch-image pull, enroot import) and give "
            "the image's path",
        )
    if not image.startswith(("/", "~", "$")):
        raise UsageError(
            f"--container {image}: a path on the cluster must be absolute (or start with ~ or $VAR)",
            hint=f"e.g. --container '$HOME/{image}' or --container /path/to/{image}",
        )
    if "\n" in image or "\0" in image:
        raise UsageError("--container: the image path holds a newline")
    return ContainerSpec(image, runtime)


def resolve(spec: ContainerSpec, reply: Mapping[str, Any] | None) -> Container:
    """The cluster's answer to ``run-check``'s container question: the container, or the refusal."""
    if not reply:
        raise UsageError(f"--container {spec.image}: the cluster did not answer about the image")
    if "error" in reply:
        raise UsageError(str(reply["error"]), hint=str(reply.get("hint") or ""))
    return Container(str(reply["image"]), str(reply["runtime"]))


def dry_run_container(spec: ContainerSpec) -> Container:
    """The container a ``--dry-run`` shows: the image as typed, the runtime its format needs (auto's
    first choice; the cluster may have the other one)."""
    return Container(spec.image, adapter.default_runtime(spec.image, spec.runtime))


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
    environment file (sourced inside). None for Pyxis: a step of its own would need its options."""
    if c.runtime == "pyxis":
        return []
    words = adapter.wrap_words(c.runtime, c.image, _bind_words(folders, work_bind), '"$PWD"', gpus)
    function = f'rv_in_container() {{ exec {" ".join(words)} "$@"; }}'
    return [
        "# rv ssh and rv up enter the image too (rv.job.inside): how, beside the job's environment file.",
        f'printf "%s\\n" {shlex.quote(function)} >"$RV_JOB_DIR/{ENTER_FILE}"',
        f'if [ -f "$RV_JOB_DIR/$RV_JOB_ENV_FILE" ]; then printf "%s\\n" {shlex.quote(DROP_HOST_VENV)} '
        '>>"$RV_JOB_DIR/$RV_JOB_ENV_FILE"; fi',
    ]


def srun_values(c: Container, *, folders: Sequence[str]) -> list[str]:
    """The batch script's ``rv_srun_container`` (Pyxis: the options of each node's srun), or none."""
    if c.runtime != "pyxis":
        return []
    words = adapter.srun_words(c.image, list(folders), "$PWD")
    # The work dir is the batch shell's at srun's start ("$PWD" expands there).
    quoted = [shlex.quote(w) for w in words[:-1]] + ['"--container-workdir=$PWD"']
    return [f"rv_srun_container=({' '.join(quoted)})"]


def describe(c: Container) -> str:
    return f"{c.runtime} image {c.image}"
