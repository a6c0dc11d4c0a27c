"""The image and runtime a run asked for (``--container``, ``--container-runtime``): checked on the
laptop as far as the laptop can, resolved on the cluster by ``run-check`` (rv.agent.container: the
image there, a runtime for it after the profile's setup lines), a registry reference pulled once
into the cluster's cache (rv.agent.images), and the words of the job's script.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rv.agent import container as adapter
from rv.errors import UsageError
from rv.slurm.container import Container

if TYPE_CHECKING:
    from rv.remote.transport import Transport

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
                hint="give the image with --container IMAGE (a path on the cluster, or docker://...)",
            )
        return None
    image = image.strip()
    if "\n" in image or "\0" in image:
        raise UsageError("--container: the image holds a newline")
    if adapter.is_reference(image):
        return _reference(image, runtime)
    if not image.startswith(("/", "~", "$")):
        raise UsageError(
            f"--container {image}: a path on the cluster must be absolute (or start with ~ or $VAR)",
            hint=f"e.g. --container '$HOME/{image}' or --container /path/to/{image}, or a registry "
            f"reference: --container docker://{image}",
        )
    return ContainerSpec(image, runtime)


def _reference(image: str, runtime: str) -> ContainerSpec:
    """A registry reference: a scheme some runtime's tool pulls (the runtime named, if one is)."""
    scheme = adapter.scheme_of(image)
    takes = sorted({s for r in adapter.RUNTIMES for s in adapter.SCHEMES[r]})
    if scheme not in takes:
        raise UsageError(
            f"--container {image}: rv pulls no {scheme}:// references",
            hint="give one of " + ", ".join(f"{s}://" for s in takes) + ", or a path on the cluster",
        )
    if runtime != "auto" and scheme not in adapter.SCHEMES[runtime]:
        raise UsageError(
            f"--container-runtime {runtime} does not pull {scheme}:// references",
            hint=f"{runtime} takes " + ", ".join(f"{s}://" for s in adapter.SCHEMES[runtime])
            + "; or leave --container-runtime auto",
        )  # fmt: skip
    if len(image) <= len(scheme) + 3 or image.endswith(("/", ":", "@")):
        raise UsageError(
            f"--container {image}: the reference names no image", hint="e.g. docker://python:3.11"
        )
    return ContainerSpec(image, runtime)


def resolve(spec: ContainerSpec, reply: Mapping[str, Any] | None) -> Container:
    """The cluster's answer to ``run-check``'s container question: the container, or the refusal.
    A registry reference stays one here: :func:`pull` makes it a path."""
    if not reply:
        raise UsageError(f"--container {spec.image}: the cluster did not answer about the image")
    if "error" in reply:
        raise UsageError(str(reply["error"]), hint=str(reply.get("hint") or ""))
    return Container(str(reply["image"]), str(reply["runtime"]))


# A pulled image's key in a --dry-run: the registry is asked for the digest at `rv run` time.
DRY_RUN_IMAGE = "<key of the reference and its digest>"


def dry_run_container(spec: ContainerSpec, root: str) -> Container:
    """The container a ``--dry-run`` shows: the image as typed (a reference: where its pull puts it),
    the runtime its format needs (auto's first choice; the cluster may have another)."""
    if adapter.is_reference(spec.image):
        runtime = spec.runtime if spec.runtime != "auto" else adapter.reference_runners(spec.image)[0]
        return Container(f"{root}/images/{DRY_RUN_IMAGE}/{adapter.PULLED[runtime]}", runtime)
    return Container(spec.image, adapter.default_runtime(spec.image, spec.runtime))


def dry_run_pull(spec: ContainerSpec, root: str) -> list[str]:
    """The commands a pull of ``spec``'s reference would run on the login node (none: a path)."""
    if not adapter.is_reference(spec.image):
        return []
    runtime = dry_run_container(spec, root).runtime
    tmp = f"{root}/images/.pull-{DRY_RUN_IMAGE}"
    steps = adapter.pull_steps(runtime, spec.image, f"{tmp}/scratch", f"{tmp}/{adapter.PULLED[runtime]}")
    return [
        " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *(shlex.quote(w) for w in argv)])
        for argv, env in steps
    ]


@dataclass(frozen=True)
class Pulled:
    """What a run's image is on the cluster: a path as given, or a pulled reference's in the cache."""

    container: Container
    key: str | None = None  # the cache entry (run.json's ``image``: rv gc keeps it while a run names it)
    pulled: bool = False  # pulled by this call (False: found in the cache)
    seconds: float | None = None  # how long the pull took, when it was pulled
    reference: str | None = None


def pull(
    transport: Transport,
    agent_args: Mapping[str, Any],
    chosen: Container,
    setup: Sequence[str],
    on_line: Callable[[str], None],
) -> Pulled:
    """``chosen`` as the job runs it: a path as is; a registry reference pulled once into the cache on
    the cluster (the agent's ``image-pull``), the tool's output reaching ``on_line`` as it comes."""
    if not adapter.is_reference(chosen.image):
        return Pulled(chosen)
    from rv.remote.agent_client import agent_call_telling

    args = dict(agent_args, reference=chosen.image, runtime=chosen.runtime, setup=list(setup))
    reply = agent_call_telling(transport, "image-pull", args, on_line, timeout=7200)
    meta = reply.get("meta") or {}
    return Pulled(
        Container(str(reply["image"]), chosen.runtime), str(reply["key"]), bool(reply.get("pulled")),
        meta.get("pull_seconds"), chosen.image,
    )  # fmt: skip
