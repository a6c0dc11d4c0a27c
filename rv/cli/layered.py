"""Options a project or profile may set once: where `rv run` and `rv up` take their defaults from.

What the user did not type comes from the project's defaults (``[tool.rv]`` in pyproject.toml, or
.rv.toml), then the profile's, then rv's own (rv.cli.defaults holds the layering; this module says which
layers and which options). Slurm's placement options and the environment's live here too: both
commands take them, and a site that requires a QoS requires it of a shell as much as of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from rv.slurmoptions import flag_rows

if TYPE_CHECKING:
    from rv.job.launch import EnvOptions
    from rv.slurmoptions import PlacementOptions

# Options that say what this one command does, never defaults of a project. A sweep's values belong
# to one command; how many of its points run at once (--parallel) may be a project's habit.
NOT_DEFAULTS = ("name", "from_", "dry_run", "as_json", "sweep_options", "sweep_file")

# What `rv up` takes from the defaults: where it may run (placement) and what its shell has (setup
# lines, the project's environment), so a session is the place a run's program would be. Not its
# size or length: a project's `gpus = 8, time = "2d"` is for its runs; a shell is sized as typed.
UP_DEFAULTS = (
    *(row.param_name for row in flag_rows(up=True)), "setup", "env_choice", "requirements", "extras",
    "python_", "system_site_packages", "container", "container_runtime",
)  # fmt: skip


def apply_defaults(ctx: click.Context, only: Collection[str] | None = None) -> dict[str, str]:
    """Fill the options not typed from the project's and the profile's defaults (``only``: just
    these parameters; the other keys are rv run's to check). Returns each option's source."""
    from rv.cli.common import load_profile
    from rv.cli.defaults import Layer, apply_layers, project_layer
    from rv.files.listing import Git, find_repo_top
    from rv.slurmoptions import profile_keys

    _, profile = load_profile(ctx)
    own: dict[str, Any] = {k: v for k, v in profile.placement.items() if k in profile_keys()}
    if profile.sbatch:
        own["sbatch"] = list(profile.sbatch)
    if profile.notify:
        own["notify"] = list(profile.notify)
    if profile.work_dir:
        own["work_dir"] = profile.work_dir
    if profile.container:
        own["container"] = profile.container
    if profile.idle_gpu:
        own["idle_gpu"] = profile.idle_gpu
    layers = [project_layer(find_repo_top(Path.cwd(), Git())), Layer(f"profile {profile.name}", own)]
    return apply_layers(ctx, layers, exclude=NOT_DEFAULTS, only=only)


class LayeredCommand(click.Command):
    """A command whose options not typed come from the defaults: all but :data:`NOT_DEFAULTS`
    (`rv run`), or only those named in ``only`` (`rv up`: :data:`UP_DEFAULTS`)."""

    only: Collection[str] | None = None

    def invoke(self, ctx: click.Context) -> object:
        ctx.meta["rv.sources"] = apply_defaults(ctx, only=self.only)
        return super().invoke(ctx)


def placement_options(*, up: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Slurm's options as typed: a flag for each row of rv.slurmoptions.TABLE that ``rv run``
    (``up``: ``rv up``) takes, in the table's order."""
    options = [
        click.option(row.flag, row.param_name, help=row.help, metavar=row.metavar, multiple=row.multiple)
        for row in flag_rows(up=up)
    ]

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def container_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The image a job runs in (`rv run`, `rv up`; rv.job.container)."""
    from rv.agent.container import CHOICES

    options = [
        click.option(
            "--container", metavar="IMAGE|none",
            help="Run the program inside this image: a path on the cluster (.sif/.simg for "
            "Apptainer/Singularity, .sqfs or an image directory for Charliecloud, .sqsh for Pyxis; ~ and "
            "$VAR are expanded there); none: no container, over a project's or profile's default.",
        ),
        click.option(
            "--container-runtime", type=click.Choice(CHOICES), metavar="|".join(CHOICES),
            help="The runtime that runs the image (default auto: the one its format needs, from what the "
            "cluster has after the profile's setup lines).",
        ),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def env_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options that choose a job's Python environment (`rv run`, `rv up`)."""
    options = [
        click.option(
            "--env", "env_choice", metavar="auto|none|PATH", default="auto", show_default=True,
            help="The job's Python environment: built from the project's dependency files (auto), only "
            "the setup lines (none), or an existing venv/conda prefix on the cluster (PATH).",
        ),
        click.option(
            "--requirements", metavar="FILE",
            help="Build the environment from FILE (default: requirements.txt).",
        ),
        click.option(
            "--extra", "extras", multiple=True,
            help="A pyproject.toml optional-dependencies group (repeatable).",
        ),
        click.option(
            "--system-site-packages/--no-system-site-packages", default=None,
            help="Build on top of the interpreter's own packages (a site's torch module), not "
            "downloading them.",
        ),
        click.option(
            "--python", "python_", metavar="VERSION|PATH", help="Interpreter to build the environment on."
        ),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def placement_of(params: Mapping[str, Any]) -> PlacementOptions:
    """The placement options (:func:`placement_options`) of a command's parameters."""
    from rv.slurmoptions import PlacementOptions

    rows = [row for row in flag_rows() if row.param_name in params]  # rv up's: those it takes
    sbatch = [text for row in rows if row.multiple for text in params[row.param_name]]
    return PlacementOptions(sbatch=sbatch, **{row.name: params[row.param_name] for row in rows if row.typed})


def env_of(params: Mapping[str, Any]) -> EnvOptions:
    """The environment options (:func:`env_options`) of a command's parameters."""
    from rv.job.launch import EnvOptions

    return EnvOptions(
        choice=params["env_choice"], requirements=params["requirements"], extras=tuple(params["extras"]),
        python=params["python_"], system_site_packages=params["system_site_packages"],
    )  # fmt: skip
