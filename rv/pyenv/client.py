"""Environments, laptop side: ask the cluster for the run's environment, building it if it must.

One call (:func:`ensure`): when the environment exists it is the single round trip the key check
costs; when it does not, the same call builds it on the login node, in the foreground, and its
progress lines (uv's own, and rv's) reach ``on_line`` as they come.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rv.errors import RemoteError
from rv.layout import RemoteLayout
from rv.pyenv.spec import EnvSpec
from rv.remote.agent_client import agent_call_telling, call_agent
from rv.slurm import commands

if TYPE_CHECKING:
    from rv.remote.transport import Transport


@dataclass(frozen=True)
class Environment:
    path: str  # on the cluster: envs/<key>, or the prefix --env PATH named
    key: str | None  # None for --env PATH
    built: bool = False  # built by this call
    installed_uv: bool = False
    waited: bool = False  # another rv was building it; this call waited and reused it
    meta: dict[str, Any] = field(default_factory=dict)


def ensure(
    transport: Transport,
    layout: RemoteLayout,
    *,
    setup: Sequence[str],
    spec: EnvSpec | None = None,
    use: str | None = None,
    on_line: Callable[[str], None] = lambda line: None,
    force: bool = False,
    image: Mapping[str, str] | None = None,
) -> Environment:
    """The environment a run will use, built now if it does not exist yet.

    ``force`` builds it again even when it exists (the old one is replaced when the new one is whole).
    """
    # With the profile's umask: what uv writes follows the privacy rule (027 when shared with the group).
    args: dict[str, Any] = layout.agent_args(setup=list(setup), force=force)
    if use is not None:
        args["use"] = use
    elif spec is not None:
        args["spec"] = spec.to_wire()
        if image is not None:  # built inside the image, on its Python (rv run --container)
            args["container"] = dict(image)
    else:
        raise ValueError("ensure() needs a spec or a path to use")
    reply = agent_call_telling(transport, "env", args, on_line, timeout=3600)
    if not reply.get("path"):
        raise RemoteError(f"the cluster named no environment: {json.dumps(reply)[:200]}")
    return Environment(
        path=reply["path"],
        key=reply.get("key"),
        built=bool(reply.get("built")),
        installed_uv=bool(reply.get("installed_uv")),
        waited=bool(reply.get("waited")),
        meta=reply.get("meta") or {},
    )


def list_envs(transport: Transport, layout: RemoteLayout) -> list[dict[str, Any]]:
    reply = call_agent(transport, "venv-ls", {"root": layout.root, "squeue": commands.squeue_user()})
    return list(reply.get("envs") or [])


def remove_env(
    transport: Transport, layout: RemoteLayout, key: str, *, force: bool = False
) -> dict[str, Any]:
    args = {"root": layout.root, "key": key, "force": force, "squeue": commands.squeue_user()}
    return call_agent(transport, "venv-rm", args)
