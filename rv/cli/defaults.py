"""Where each `rv run` setting comes from: the command line, the project, the profile, or rv.

A project keeps its defaults in ``[tool.rv]`` of the ``pyproject.toml`` at the repo top, or in
``.rv.toml`` there (a project without a pyproject): any option of ``rv run`` by its long name
(``type = "a100,a6000"`` or ``type = ["a100", "a6000"]``, ``time = "4h"``, ``setup = ["module load
cuda"]``, ``sbatch = [...]``; dashes or underscores, one of the two per key). The command line wins
over the project, the project over the profile, the profile over rv's own defaults. An unknown key
is an error that lists the valid ones; a value of the wrong type (``gpu = 2.7``, ``time = 8``) is an
error naming the file, the key and the type wanted, never a value rv guessed.

Pure apart from reading the one file: the CLI hands in its click context and gets back, for each
setting, its value and its source (``rv run --dry-run`` shows them).
"""

from __future__ import annotations

import difflib
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
    where: str | None = None  # the file, for messages: "/home/me/p/pyproject.toml [tool.rv]"


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
            where = f"{pyproject} [tool.rv]"
            return Layer("pyproject.toml [tool.rv]", _table(table, where), where)
    if own.is_file():
        return Layer(".rv.toml", _table(_read(own), str(own)), str(own))
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
    with ``-`` or ``_`` (``max-segments``, ``max_segments``). Only the names the help shows: never a
    parameter's name inside rv (``python_``, ``env_choice``)."""
    skip = set(exclude)
    keys: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in skip or param.name is None:
            continue
        for name in (o[2:] for o in param.opts if o.startswith("--")):
            keys[name] = param
            keys[name.replace("-", "_")] = param
    return keys


def _checked(param: click.Option, key: str, raw: Any, where: str) -> Any:
    """``raw`` as the option takes it, or a :class:`ConfigError` naming ``where``, the key and the
    type wanted. TOML's types are exact: ``gpu = 2.7`` or ``gpu = true`` is no integer (click would
    cast them to 2 and 1), ``time = 8`` no duration. ``type`` may be a list: the several-types form."""
    if param.multiple or (param.name == "gpu_type" and isinstance(raw, list)):
        if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
            example = f"[{raw!r}]" if isinstance(raw, str) else '["..."]'
            raise ConfigError(
                f"{where}: {_toml(key, raw)}: {key} must be a list of strings", hint=f"{key} = {example}"
            )
        if param.name == "gpu_type" and (not raw or not all(item.strip() for item in raw)):
            # An empty list (or name) would silently mean "no type given": rv's default choice.
            raise ConfigError(
                f"{where}: {_toml(key, raw)}: {key} must name at least one GPU type, each not empty",
                hint=f'{key} = ["a100", "a6000"], {key} = "any", or no {key} line (rv then chooses)',
            )
        return ",".join(raw) if not param.multiple else raw
    kind = param.type
    ok: bool
    if param.is_flag or isinstance(kind, click.types.BoolParamType):
        ok, wanted, example = isinstance(raw, bool), "true or false", "true"
    elif isinstance(kind, click.types.IntParamType):
        ok, wanted, example = isinstance(raw, int) and not isinstance(raw, bool), "an integer", "2"
    elif isinstance(kind, click.types.FloatParamType):
        ok = isinstance(raw, int | float) and not isinstance(raw, bool)
        wanted, example = "a number", "40"
    else:
        ok, wanted, example = isinstance(raw, str), "a string", f'"{raw}"'
    if not ok:
        raise ConfigError(f"{where}: {_toml(key, raw)}: {key} must be {wanted}", hint=f"{key} = {example}")
    return raw


def _toml(key: str, value: Any) -> str:
    """``key = value`` as TOML wrote it, and the value's type: ``gpu = 2.7 (a number with a point)``."""
    if isinstance(value, bool):
        text, kind = str(value).lower(), "true/false"
    elif isinstance(value, int):
        text, kind = str(value), "an integer"
    elif isinstance(value, float):
        text, kind = repr(value), "a number with a point"
    elif isinstance(value, str):
        text, kind = repr(value), "a string"
    elif isinstance(value, list):
        text, kind = repr(value), "a list"
    else:
        text, kind = repr(value), "a table" if isinstance(value, dict) else type(value).__name__
    return f"{key} = {text} ({kind})"


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
        where = layer.where or layer.source
        seen: dict[str, str] = {}
        for key, raw in layer.values.items():
            param = keys.get(key)
            if only is not None and (param is None or param.name not in only):
                continue
            if param is None:
                valid = sorted(k for k in keys if "_" not in k)
                close = difflib.get_close_matches(key.replace("_", "-"), valid, n=1)
                maybe = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(
                    f"{where}: unknown rv run option {key!r}{maybe}", hint=f"valid keys: {', '.join(valid)}"
                )
            name = param.name
            assert name is not None
            if name in seen:
                raise ConfigError(
                    f"{where}: {seen[name]} and {key} are one key written two ways", hint="keep one of them"
                )
            seen[name] = key
            raw = _checked(param, key, raw, where)
            if sources.get(name) != BUILT_IN:
                continue  # typed on the command line, or set by a layer before this one
            try:
                value = param.type_cast_value(ctx, raw)
            except click.BadParameter as exc:
                raise ConfigError(
                    f"{where}: {key} = {raw!r}: {exc.message}", hint=f"fix {key} there"
                ) from None
            ctx.params[name] = value
            sources[name] = layer.source
    return sources
