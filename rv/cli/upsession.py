"""What `rv code` and `rv jupyter` share: `rv up`'s options, and a live session, reused or started.

The session is a detached `rv up` started by `rv up` itself (its command, invoked with ``--detach``
and the options given here), so it is sized, placed, snapshotted and given its environment exactly
as `rv up` does; it lives until `rv stop NAME` or its time limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from rv.cli.common import Session, note, run_store, warn
from rv.cli.layered import UP_DEFAULTS, LayeredCommand
from rv.errors import UsageError
from rv.slurmoptions import flag_rows

if TYPE_CHECKING:
    from rv.job.inside import RunningJob

# rv up's options that size or place a new session: said to be unused when a live one is reused.
_SIZING = ("gpus", "gpu_type", "mig", "time_", "mem", "cpus", "nodes",
           *(row.param_name for row in flag_rows(up=True)), "setup", "container",
           "container_runtime")  # fmt: skip


class SessionCommand(LayeredCommand):
    """A command taking `rv up`'s options (all but --detach), their defaults as `rv up` takes them."""

    only = UP_DEFAULTS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(up_params())


def up_params() -> list[click.Parameter]:
    import copy

    from rv.commands import load

    up = load("up")
    assert isinstance(up, click.Command)
    params = []
    for param in up.params:
        if param.name == "detach":
            continue
        if param.name == "name" and isinstance(param, click.Option):
            param = copy.copy(param)  # rv up's own keeps its help
            param.help = "The session to reuse, or a new one's name (default: the newest live one, else new)."
        params.append(param)
    return params


@contextmanager
def held_session(ctx: click.Context, s: Session, *, base: str, new: bool) -> Iterator[RunningJob]:
    """:func:`live_or_new`, and a session started here stopped again (as `rv stop` does) when the
    command fails before it is of use, whatever the failure: a session nobody reaches must not hold
    GPUs until its time limit. A live session that was reused is left as it was."""
    started: list[str] = []
    try:
        yield live_or_new(ctx, s, base=base, new=new, started=started)
    except BaseException:
        if started:
            _release(s, started[0])
        raise


def _release(s: Session, name: str) -> None:
    from rv.job.cleanup import stop_runs

    record = run_store().resolve(name, s.profile.name)
    if record is None:
        warn(f"session {name} may have been sent; rv has no record of it: rv ps -a, then rv stop {name}")
        return
    try:
        stop_runs(s.transport, s.layout.root, [(record.run_id, name)])
    except Exception as exc:  # the failure that brought us here is the one to report: say this one
        warn(f"could not stop session {name}, which this command started ({exc}): rv stop {name}")
        return
    warn(f"stopped session {name}, which this command started: it could not be used")


def check_container(ctx: click.Context, base: str) -> None:
    """`--container` (typed, or a project's or profile's default) checked before anything is sent:
    a Pyxis image is refused (exit 2). The others' images are entered by rv code's connections
    (rv.remote.nodessh) and rv jupyter's server (rv.job.notebook), through the job's container.sh."""
    from rv.agent import container as adapter
    from rv.job.container import parse_container

    container = parse_container(ctx.params.get("container"), ctx.params.get("container_runtime"))
    if container is not None and adapter.default_runtime(container.image, container.runtime) == "pyxis":
        # The editor's sshd and JupyterLab start in steps of their own, and a Pyxis image is entered
        # only by srun's options, which those steps (an sshd, a server) cannot take from inside.
        raise UsageError(
            f"rv {base} --container {container.image}: the editor and the notebook do not run inside a "
            "Pyxis image yet",
            hint=f"rv up --detach --container {container.image} then rv ssh NAME; or an Apptainer or "
            "Charliecloud image",
        )


def live_or_new(
    ctx: click.Context, s: Session, *, base: str, new: bool, started: list[str] | None = None
) -> RunningJob:
    """The newest live session rv code or rv jupyter set up (``--name``: that one), or a new
    detached `rv up` session named ``BASE-xxxxxx`` (``--name``: that name), once it runs (its name
    appended to ``started``, before anything that may fail after its submission)."""
    from rv.job import serve
    from rv.job.inside import running_job
    from rv.job.submit import default_run_name, new_run_id

    store = run_store()
    profile, root = s.profile.name, s.layout.root
    name: str | None = ctx.params.get("name")
    if new:
        found = None
    elif name:
        record = store.resolve(name, profile)
        found = serve.live_session(s.transport, store, profile, root, [record] if record else [])
    else:
        found = serve.live_session(s.transport, store, profile, root, serve.candidates(store, profile, root))
    if found is not None and found.container is not None and found.container[0].runtime == "pyxis":
        raise UsageError(
            f"session {found.name} runs in a Pyxis image: the editor and the notebook do not run inside "
            "one yet",
            hint=f"rv ssh {found.name}; or rv {base} --new for a session of its own",
        )
    if found is not None:
        typed = [p for p in _SIZING if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE]
        if typed:
            warn(
                f"reusing session {found.name}: the options for a new one ({', '.join(typed)}) are not used; "
                "--new starts a new session"
            )
        nodes = ",".join(found.nodes)
        note(f"session {found.name}: job {found.job_id} on {nodes} (rv stop {found.name} ends it)")
        serve.remember(store, found, profile, kind=base)
        return found
    from rv.commands import load

    up = load("up")
    assert isinstance(up, click.Command)
    name = name or default_run_name(base, new_run_id())
    if started is not None:
        started.append(name)
    args = {p.name: ctx.params[p.name] for p in up_params() if p.name}
    # `rv up --detach` itself: sized, placed, snapshotted and given its environment as rv up does.
    ctx.invoke(up, **{**args, "name": name, "detach": True})
    rj = running_job(s.transport, store, profile, root, name)
    serve.remember(store, rj, profile, kind=base)
    return rj
