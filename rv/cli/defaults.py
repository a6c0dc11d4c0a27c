"""Where each `rv run` setting comes from: the command line, the project, the profile, or rv.

A project keeps its defaults in ``[tool.rv]`` of the ``pyproject.toml`` at the repo top, or in
``.rv.toml`` there (a project without a pyproject): any option of ``rv run`` by its long name
(``type = "a100,a6000"``, ``time = "4h"``, ``setup = ["module load cuda"]``, ``sbatch = [...]``;
dashes or underscores). The command line wins over the project, the project over the profile, the
profile over rv's own defaults. An unknown key is an error that lists the valid ones.

Pure apart from reading the one file: the CLI hands in its click context and gets back, for each
setting, its value and its source (``rv run --dry-run`` shows them).
"""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from rv.errors import ConfigError

COMMAND_LINE = "command line"
BUILT_IN = "rv's default"


@dataclass(frozen=True)
class Layer:
    """One source of defaults: where it was read (for messages) and its values by option key."""

    source: str  # "pyproject.toml [tool.rv]", "profile mylab", ...
    values: Mapping[str, Any]


def project_layer(top: Path | None) -> Layer | None:
    """The project's defaults at the repo top ``top``: ``[tool.rv]`` of pyproject.toml, else .rv.toml."""
    if top is None:
        return None
    pyproject, own = top / "pyproject.toml", top / ".rv.toml"
    if pyproject.is_file():
        table = _read(pyproject).get("tool", {}).get("rv")
        if table is not None:
            if own.is_file():
                raise ConfigError(
                    f"both {pyproject} [tool.rv] and {own} hold rv defaults",
                    hint="keep one of them (the project's pyproject.toml is the usual place)",
                )
            return Layer("pyproject.toml [tool.rv]", _table(table, f"{pyproject} [tool.rv]"))
    if own.is_file():
        return Layer(".rv.toml", _table(_read(own), str(own)))
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}", hint="fix the file (TOML), or remove it") from exc


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table of rv run options")
    return value


def option_keys(command: click.Command, exclude: Iterable[str] = ()) -> dict[str, click.Option]:
    """Every key a defaults table may use for ``command``: each option's long names without dashes,
    with ``-`` or ``_`` (``max-segments``, ``max_segments``), and its parameter name (``gpus``)."""
    skip = set(exclude)
    keys: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in skip or param.name is None:
            continue
        names = {param.name, *(o.lstrip("-") for o in param.opts if o.startswith("--"))}
        for name in names:
            keys[name] = param
            keys[name.replace("-", "_")] = param
            keys[name.replace("_", "-")] = param
    return keys


def apply_layers(
    ctx: click.Context,
    layers: Iterable[Layer | None],
    *,
    exclude: Iterable[str] = (),
    only: Collection[str] | None = None,
) -> dict[str, str]:
    """Fill ``ctx.params`` for every option the user did not type from the first layer that has it.

    With ``only`` (parameter names), a layer's other keys are skipped, unknown ones included: the
    tables hold rv run's options, and rv run checks them (rv up takes a few of them).

    Returns ``{parameter name: source}`` for every option (the command line, a layer, or rv's own
    default). A layer's unknown key, or a value of the wrong type, is a :class:`ConfigError` naming
    the layer, the key and what is valid.
    """
    keys = option_keys(ctx.command, exclude)
    typed = {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)
    }
    sources = {name: COMMAND_LINE if name in typed else BUILT_IN for name in ctx.params}
    for layer in layers:
        if layer is None:
            continue
        for key, raw in layer.values.items():
            param = keys.get(key)
            if only is not None and (param is None or param.name not in only):
                continue
            if param is None:
                valid = sorted({k.replace("_", "-") for k in keys if "_" not in k})
                raise ConfigError(
                    f"{layer.source}: unknown rv run option {key!r}", hint=f"valid keys: {', '.join(valid)}"
                )
            name = param.name
            assert name is not None
            if sources.get(name) != BUILT_IN:
                continue  # typed on the command line, or set by a layer before this one
            if param.multiple and not isinstance(raw, list):
                raise ConfigError(f"{layer.source}: {key} must be a list, e.g. {key} = [{raw!r}]")
            try:
                value = param.type_cast_value(ctx, raw)
            except click.BadParameter as exc:
                raise ConfigError(f"{layer.source}: {key} = {raw!r}: {exc.message}") from None
            ctx.params[name] = value
            sources[name] = layer.source
    return sources
