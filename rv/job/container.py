"""The image and runtime a run asked for (``--container``, ``--container-runtime``): checked on the
laptop as far as the laptop can, resolved on the cluster by ``run-check`` (rv.agent.container: the
image there, a runtime for it after the profile's setup lines), and the words of the job's script.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rv.agent import container as adapter
from rv.errors import UsageError
from rv.slurm.container import Container

NONE = "none"  # --container none: no container, over a project's or profile's default


@dataclass(frozen=True)
class ContainerSpec:
    """What was asked: the image as typed (expanded on the cluster) and the runtime, or auto."""

    image: str
    runtime: str = "auto"

    def check_args(self, setup: Sequence[str]) -> dict[str, Any]:
        return {"image": self.image, "runtime": self.runtime, "setup": list(setup)}


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
