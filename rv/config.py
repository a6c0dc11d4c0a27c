"""Profiles: which cluster, how to reach it, and what GPUs it has. Stored as TOML.

File: ``$RV_CONFIG``, else ``$XDG_CONFIG_HOME/rv/config.toml`` (``~/.config/rv/config.toml``)::

    default = "rivanna"

    [profiles.rivanna]
    host = "login.hpc.virginia.edu"
    user = "abc1de"
    account = "mylab"
    remote_root = "/scratch/abc1de/rv"
    catalog = "rivanna"                 # built-in catalog; or "discovered" with [profiles.X.gpus.*]
    setup = ["module load cuda"]

    [profiles.mycluster.gpus.a6000]     # one table per GPU type (fields of rv.catalog.GpuType)
    partition = "gpu"
    gres = "a6000"
    gpus_per_node = 8
    compute_capability = 8.6

Reading uses the standard library's tomllib. Writing uses the small serialiser below rather than a
TOML-writing dependency: the schema is fixed and flat (strings, numbers, booleans, string lists),
and the CLI's dependencies are kept to click, rich, paramiko and gitpython.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rv.catalog import BUILTIN_CATALOGS, GpuType
from rv.errors import ConfigError

PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def config_path() -> Path:
    if os.environ.get("RV_CONFIG"):
        return Path(os.environ["RV_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "rv" / "config.toml"


def state_dir() -> Path:
    """Local state (job records, secrets) lives next to the config file."""
    return config_path().parent


@dataclass(frozen=True)
class Profile:
    name: str
    host: str
    port: int | None = None  # None: from ~/.ssh/config, else 22
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    account: str | None = None
    remote_root: str | None = None
    catalog: str = "discovered"  # a built-in catalog name, or "discovered" (use `gpus`)
    setup: tuple[str, ...] = ()
    gpus: dict[str, GpuType] = field(default_factory=dict)

    def gpu_catalog(self) -> dict[str, GpuType]:
        """The built-in catalog (if any) with this profile's own types laid over it."""
        merged = dict(BUILTIN_CATALOGS.get(self.catalog, {}))
        merged.update(self.gpus)
        return merged

    def require_remote_root(self) -> str:
        if not self.remote_root:
            raise ConfigError(
                f"profile {self.name!r} has no remote_root",
                hint=f"run `rv init --profile {self.name}` again, or add remote_root to {config_path()}",
            )
        return self.remote_root


# Keys a profile table may hold, with the type each must have.
_PROFILE_KEYS: dict[str, type | tuple[type, ...]] = {
    "host": str,
    "port": int,
    "user": str,
    "identity_file": str,
    "known_hosts": str,
    "account": str,
    "remote_root": str,
    "catalog": str,
    "setup": list,
    "gpus": dict,
}
_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    list: "a list",
    dict: "a table",
    float: "a number",
    bool: "true or false",
}
_ANNOTATION_TYPES: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "float": (int, float)}
# GpuType's annotations are strings ("float | None") under `from __future__ import annotations`.
_GPU_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    f.name: _ANNOTATION_TYPES[str(f.type).split(" ")[0]] for f in fields(GpuType) if f.name != "name"
}
_GPU_REQUIRED = ("partition", "gres", "gpus_per_node")


@dataclass(frozen=True)
class Config:
    path: Path
    default: str | None
    profiles: dict[str, Profile]

    def profile(self, name: str | None = None) -> Profile:
        """The named profile, else ``$RV_PROFILE``, else the default one."""
        chosen = name or os.environ.get("RV_PROFILE") or self.default
        if not self.profiles:
            raise ConfigError(f"no profiles in {self.path}", hint="run `rv init` to add one")
        if chosen is None:
            if len(self.profiles) == 1:
                return next(iter(self.profiles.values()))
            raise ConfigError(
                f"no default profile in {self.path}; profiles: {', '.join(sorted(self.profiles))}",
                hint='pass --profile NAME or set default = "NAME" in the config',
            )
        if chosen not in self.profiles:
            raise ConfigError(
                f"unknown profile {chosen!r}; valid profiles: {', '.join(sorted(self.profiles))}",
                hint="pass --profile with one of those, or run `rv init --profile " + chosen + "`",
            )
        return self.profiles[chosen]

    def with_profile(self, profile: Profile, make_default: bool) -> Config:
        profiles = dict(self.profiles)
        profiles[profile.name] = profile
        default = profile.name if make_default or self.default is None else self.default
        return replace(self, profiles=profiles, default=default)


def _type_error(where: str, key: str, expected: type | tuple[type, ...], value: Any) -> ConfigError:
    exp = expected if isinstance(expected, tuple) else (expected,)
    names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in exp)
    return ConfigError(f"{where}: {key} must be {names}, not {json.dumps(value, default=str)}")


def _is(value: Any, expected: type | tuple[type, ...]) -> bool:
    exp = expected if isinstance(expected, tuple) else (expected,)
    # bool is an int in Python; a config value `port = true` is still wrong.
    return isinstance(value, exp) and not (isinstance(value, bool) and bool not in exp)


def _parse_gpu(where: str, name: str, table: Any) -> GpuType:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: gpus.{name} must be a table")
    unknown = sorted(set(table) - set(_GPU_FIELD_TYPES))
    if unknown:
        raise ConfigError(
            f"{where}.gpus.{name}: unknown key {unknown[0]!r}; valid keys: {', '.join(_GPU_FIELD_TYPES)}"
        )
    missing = [k for k in _GPU_REQUIRED if k not in table]
    if missing:
        raise ConfigError(f"{where}.gpus.{name}: missing {', '.join(missing)}")
    for key, value in table.items():
        if not _is(value, _GPU_FIELD_TYPES[key]):
            raise _type_error(f"{where}.gpus.{name}", key, _GPU_FIELD_TYPES[key], value)
    if table["gpus_per_node"] < 1:
        raise ConfigError(f"{where}.gpus.{name}: gpus_per_node must be at least 1")
    return GpuType(name=name, **table)


def _parse_profile(path: Path, name: str, table: Any) -> Profile:
    where = f"{path}: profile {name!r}"
    if not PROFILE_NAME.match(name):
        raise ConfigError(f"{path}: invalid profile name {name!r} (letters, digits, '.', '_', '-')")
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(table) - set(_PROFILE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(_PROFILE_KEYS)}")
    if "host" not in table:
        raise ConfigError(f"{where}: missing host", hint=f"run `rv init --profile {name}`")
    for key, value in table.items():
        if not _is(value, _PROFILE_KEYS[key]):
            raise _type_error(where, key, _PROFILE_KEYS[key], value)
    port = table.get("port")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port must be between 1 and 65535, not {port}")
    catalog = table.get("catalog", "discovered")
    valid_catalogs = ["discovered", *BUILTIN_CATALOGS]
    if catalog not in valid_catalogs:
        raise ConfigError(f"{where}: catalog must be one of {', '.join(valid_catalogs)}, not {catalog!r}")
    setup = table.get("setup", [])
    if not all(isinstance(line, str) for line in setup):
        raise ConfigError(f"{where}: setup must be a list of strings")
    gpus = {gname: _parse_gpu(where, gname, gtable) for gname, gtable in table.get("gpus", {}).items()}
    return Profile(
        name=name,
        host=table["host"],
        port=port,
        user=table.get("user"),
        identity_file=table.get("identity_file"),
        known_hosts=table.get("known_hosts"),
        account=table.get("account"),
        remote_root=table.get("remote_root"),
        catalog=catalog,
        setup=tuple(setup),
        gpus=gpus,
    )


def parse_config(text: str, path: Path) -> Config:
    """Parse and validate config text; every problem is a ConfigError naming the file and the key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}", hint="fix the file or move it away") from exc
    unknown = sorted(set(data) - {"default", "profiles"})
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; valid keys: default, profiles")
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise _type_error(str(path), "default", str, default)
    raw_profiles = data.get("profiles", {})
    if not isinstance(raw_profiles, dict):
        raise ConfigError(f"{path}: profiles must be a table")
    profiles = {name: _parse_profile(path, name, table) for name, table in raw_profiles.items()}
    if default is not None and default not in profiles:
        valid = ", ".join(sorted(profiles)) or "(none)"
        raise ConfigError(f"{path}: default profile {default!r} does not exist; valid profiles: {valid}")
    return Config(path=path, default=default, profiles=profiles)


def load_config(path: Path | None = None, *, missing_ok: bool = False) -> Config:
    path = path or config_path()
    if not path.exists():
        if missing_ok:
            return Config(path=path, default=None, profiles={})
        raise ConfigError(f"no rv config yet ({path})", hint="run `rv init` to connect rv to your cluster")
    return parse_config(path.read_text(encoding="utf-8"), path)


# --------------------------------------------------------------------------------------------------
# Writing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def render_config(config: Config) -> str:
    lines = ["# rv configuration: see `rv init --help`. Edited by rv init; safe to edit by hand."]
    if config.default:
        lines.append(f"default = {_toml_value(config.default)}")
    for name, p in config.profiles.items():
        lines += ["", f"[profiles.{_toml_key(name)}]"]
        for key in (
            "host",
            "port",
            "user",
            "identity_file",
            "known_hosts",
            "account",
            "remote_root",
            "catalog",
        ):
            value = getattr(p, key)
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        if p.setup:
            lines.append(f"setup = {_toml_value(list(p.setup))}")
        for gname, gpu in p.gpus.items():
            lines.append(f"\n[profiles.{_toml_key(name)}.gpus.{_toml_key(gname)}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in gpu.to_dict().items() if k != "name"]
    return "\n".join(lines) + "\n"


def save_config(config: Config) -> None:
    """Write atomically, mode 0600 (the file names identity files and accounts)."""
    text = render_config(config)
    parse_config(text, config.path)  # never write a file we could not read back
    config.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = config.path.with_name(config.path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, config.path)
