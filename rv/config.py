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

    [profiles.mycluster.partitions.standard]  # what one job may have there (rv init reads sinfo)
    max_time = "3-00:00:00"             # absent: no limit
    nodes = 40
    max_nodes = 4                       # absent: no limit
    default = true                      # where CPU-only jobs go (they name no partition)

Reading uses the standard library's tomllib (fast, and every command reads). Writing (`rv init`)
uses tomlkit, which round-trips: the user's comments, blank lines and key order survive, and only
the values rv changes are touched.

Where files live (platformdirs, so each OS gets its usual places; the ``RV_*`` variables override):

* config: ``$RV_CONFIG``, else the user config dir (``~/.config/rv/config.toml`` on Linux);
* state (job records, stored secrets): ``$RV_STATE_DIR``, else the user state dir
  (``~/.local/state/rv`` on Linux);
* cache (manifests for deltas, root commits): ``$RV_CACHE_DIR``, else the user cache dir
  (``~/.cache/rv`` on Linux).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rv.catalog import BUILTIN_CATALOGS, GpuType, Partition
from rv.errors import ConfigError
from rv.slurmoptions import TABLE, profile_keys

PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# Where a job's work dir may live (rv.job.workdir: --work-dir, and what each costs in files).
WORK_DIRS = ("shared", "node")
_UNSAFE_PATH = re.compile(r"[\s\x00-\x1f\x7f]")


def check_node_work_dir(path: str | None, where: str) -> str | None:
    """A profile's ``node_work_dir``: an absolute folder on each compute node's local disk."""
    if path is None:
        return None
    if not path.startswith("/") or _UNSAFE_PATH.search(path):
        raise ConfigError(
            f"{where}: node_work_dir {path!r} must be an absolute path without spaces",
            hint="e.g. node_work_dir = '/local/scratch' (a folder on each compute node's own disk); leave "
            "it out to use $SLURM_TMPDIR, else $TMPDIR, else /tmp",
        )
    return path


def config_path() -> Path:
    if os.environ.get("RV_CONFIG"):
        return Path(os.environ["RV_CONFIG"]).expanduser()
    import platformdirs

    return platformdirs.user_config_path("rv", appauthor=False) / "config.toml"


def state_dir() -> Path:
    """Local state (job records, secrets): ``$RV_STATE_DIR``, else the platform's user state folder."""
    if os.environ.get("RV_STATE_DIR"):
        return Path(os.environ["RV_STATE_DIR"]).expanduser()
    import platformdirs

    return platformdirs.user_state_path("rv", appauthor=False)


def cache_dir() -> Path:
    """Caches that only save time (manifests for deltas, root commits): safe to delete."""
    if os.environ.get("RV_CACHE_DIR"):
        return Path(os.environ["RV_CACHE_DIR"]).expanduser()
    import platformdirs

    return platformdirs.user_cache_path("rv", appauthor=False)


def write_private(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` whole by temp file and rename, readable by the user only (folders made 0700).

    ``durable`` syncs it to disk before the rename: for what the user wrote (config, records), not
    for caches, which a crash only makes slower.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


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
    share_with_group: bool = False  # remote files group-readable (0750/0640) instead of private
    system_site_packages: bool = False  # environments built on top of the interpreter's packages
    python: str | None = None  # interpreter environments are built on (a version or a path)
    # Slurm's placement options every job of this profile gets unless `rv run` says otherwise (a site
    # that requires a QoS, a reservation, nodes to avoid: rv.slurmoptions.profile_keys), and extra
    # #SBATCH options (rv.placement).
    placement: dict[str, str] = field(default_factory=dict)
    sbatch: tuple[str, ...] = ()
    # The cluster's partitions and their limits, as `rv init` found them (empty: not known, before
    # rv init learned them; then rv cannot refuse a CPU-only job over its partition's limit).
    partitions: dict[str, Partition] = field(default_factory=dict)
    # Where every run's end is told unless `rv run --notify` says otherwise (rv.notify's forms).
    notify: tuple[str, ...] = ()
    # Where jobs' work dirs live unless `rv run --work-dir` says otherwise (rv.job.workdir), and the
    # folder on each node's local disk for --work-dir node (None: $SLURM_TMPDIR, $TMPDIR, /tmp).
    work_dir: str | None = None
    node_work_dir: str | None = None
    # The image every run and session runs in unless --container says otherwise (rv.job.container).
    container: str | None = None
    # How long every GPU of a node may stay idle before the run's log says so (`rv run --idle-gpu`:
    # a duration, or "off"); None: rv's default.
    idle_gpu: str | None = None

    @property
    def default_partition(self) -> Partition | None:
        """Where a job that names no partition goes (rv's CPU-only jobs); None when not known."""
        return next((p for p in self.partitions.values() if p.default), None)

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
    "share_with_group": bool,
    "system_site_packages": bool,
    "python": str,
    # Slurm's options a profile may set (rv.slurmoptions.TABLE), each the default of its flag.
    **{row.name: row.config_type for row in TABLE if row.name in profile_keys()},
    "sbatch": list,
    "partitions": dict,
    "notify": list,
    "work_dir": str,
    "node_work_dir": str,
    "container": str,
    "idle_gpu": str,
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
_HOST_PROBLEM = re.compile(r"^-|[\s\x00-\x1f\x7f]")


def remote_root_problem(root: str) -> str | None:
    """Why ``root`` cannot be a remote root (None when it can).

    Absolute, because every job script and remote step starts from it wherever it runs; no
    whitespace or control characters, because Slurm's ``#SBATCH --output`` cannot quote them; no
    ``%``, because Slurm expands ``%j``-style patterns inside log paths.
    """
    if not root.startswith("/"):
        return "must be an absolute path"
    if re.search(r"[\s\x00-\x1f\x7f]", root):
        return "must not contain spaces or control characters"
    if "%" in root:
        return "must not contain '%' (Slurm expands it in log file names)"
    if any(part == ".." for part in root.split("/")):
        return "must not contain '..'"
    return None


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
                hint="choose one with `rv --profile NAME COMMAND ...` (or $RV_PROFILE), or set "
                'default = "NAME" in the config',
            )
        if chosen not in self.profiles:
            raise ConfigError(
                f"unknown profile {chosen!r}; valid profiles: {', '.join(sorted(self.profiles))}",
                hint=f"use one of those (`rv --profile NAME COMMAND ...`) or `rv init --profile {chosen}`",
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


_PARTITION_KEYS: dict[str, type] = {
    "max_time": str,
    "nodes": int,
    "max_nodes": int,
    "default": bool,
    "qos": str,
    "qos_max_time": str,
}


def _parse_partition(where: str, name: str, table: Any) -> Partition:
    """One ``[partitions.NAME]`` table: its limits, each optional."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: partitions.{name} must be a table")
    unknown = sorted(set(table) - set(_PARTITION_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}.partitions.{name}: unknown key {unknown[0]!r}; valid keys: {', '.join(_PARTITION_KEYS)}"
        )
    for key, value in table.items():
        if not _is(value, _PARTITION_KEYS[key]):
            raise _type_error(f"{where}.partitions.{name}", key, _PARTITION_KEYS[key], value)
    for key in ("max_time", "qos_max_time"):
        if key not in table:
            continue
        from rv.timespec import parse_slurm_time

        try:
            parse_slurm_time(table[key])
        except ValueError:
            raise ConfigError(
                f"{where}.partitions.{name}: {key} {table[key]!r} is not a Slurm time",
                hint='e.g. "3-00:00:00" or "12:00:00"; leave it out for no limit',
            ) from None
    return Partition(name=name, **table)


def _parse_gpu(where: str, name: str, table: Any, base: GpuType | None = None) -> GpuType:
    """One ``[gpus.NAME]`` table. Over a built-in type of the same name (``base``) it may hold only the
    fields it changes (``rv init`` writes CPUs and memory per GPU found on the nodes that way)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: gpus.{name} must be a table")
    unknown = sorted(set(table) - set(_GPU_FIELD_TYPES))
    if unknown:
        raise ConfigError(
            f"{where}.gpus.{name}: unknown key {unknown[0]!r}; valid keys: {', '.join(_GPU_FIELD_TYPES)}"
        )
    missing = [k for k in _GPU_REQUIRED if k not in table] if base is None else []
    if missing:
        raise ConfigError(f"{where}.gpus.{name}: missing {', '.join(missing)}")
    for key, value in table.items():
        if not _is(value, _GPU_FIELD_TYPES[key]):
            raise _type_error(f"{where}.gpus.{name}", key, _GPU_FIELD_TYPES[key], value)
    if table.get("gpus_per_node", 1) < 1:
        raise ConfigError(f"{where}.gpus.{name}: gpus_per_node must be at least 1")
    return replace(base, **table) if base is not None else GpuType(name=name, **table)


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
    if _HOST_PROBLEM.search(table["host"]) or not table["host"]:
        raise ConfigError(f"{where}: host {table['host']!r} is not a host name (spaces, or a leading '-')")
    root = table.get("remote_root")
    problem = remote_root_problem(root) if root is not None else None
    if problem:
        raise ConfigError(
            f"{where}: remote_root {root!r} {problem}",
            hint=f"run `rv init --profile {name} --remote-root /absolute/path` (or ~/path: the cluster "
            "expands it)",
        )
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
    sbatch = table.get("sbatch", [])
    if not all(isinstance(text, str) for text in sbatch):
        raise ConfigError(f"{where}: sbatch must be a list of strings (sbatch options)")
    notify = table.get("notify", [])
    if not all(isinstance(text, str) for text in notify):
        raise ConfigError(f"{where}: notify must be a list of strings, e.g. notify = ['mail:me@example.org']")
    work_dir = table.get("work_dir")
    if work_dir is not None and work_dir not in WORK_DIRS:
        raise ConfigError(f"{where}: work_dir must be shared or node, not {work_dir!r}")
    node_work_dir = check_node_work_dir(table.get("node_work_dir"), where)
    idle_gpu = table.get("idle_gpu")
    if idle_gpu is not None:
        from rv.errors import UsageError
        from rv.timespec import parse_idle_gpu

        try:
            parse_idle_gpu(idle_gpu)
        except UsageError as exc:
            raise ConfigError(f"{where}: idle_gpu: {exc.message}") from None
    builtin = BUILTIN_CATALOGS.get(catalog, {})
    gpus = {
        gname: _parse_gpu(where, gname, gtable, builtin.get(gname))
        for gname, gtable in table.get("gpus", {}).items()
    }
    partitions = {
        pname: _parse_partition(where, pname, ptable) for pname, ptable in table.get("partitions", {}).items()
    }
    if sum(p.default for p in partitions.values()) > 1:
        raise ConfigError(f"{where}: more than one partition has default = true")
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
        share_with_group=table.get("share_with_group", False),
        system_site_packages=table.get("system_site_packages", False),
        placement={k: table[k] for k in profile_keys() if k in table},
        sbatch=tuple(sbatch),
        python=table.get("python"),
        partitions=partitions,
        notify=tuple(notify),
        work_dir=work_dir,
        node_work_dir=node_work_dir,
        container=table.get("container") or None,
        idle_gpu=idle_gpu,
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
        named = " (RV_CONFIG names it)" if os.environ.get("RV_CONFIG") else ""
        raise ConfigError(f"no rv config yet ({path}{named})", hint=_no_config_hint(path))
    return parse_config(path.read_text(encoding="utf-8"), path)


def _no_config_hint(path: Path) -> str:
    """`rv init`, or RV_CONFIG: `bash scripts/demo` keeps its profile in a config of its own (beside
    the loopback cluster's state, $RV_TESTCLUSTER_DIR), never in the user's; named when it is there."""
    import shlex

    hint = "run `rv init` to connect rv to your cluster, or point RV_CONFIG at the config you have"
    demo = Path(os.environ.get("RV_TESTCLUSTER_DIR") or "/tmp/rv-testcluster") / "rv-config.toml"
    if demo != path and demo.is_file():
        hint += f"; the demo's (bash scripts/demo): export RV_CONFIG={shlex.quote(str(demo))}"
    return hint


# --------------------------------------------------------------------------------------------------
# Writing

_HEADER_COMMENT = "rv configuration: see `rv init --help`. Edited by rv init; safe to edit by hand."
_SCALAR_KEYS = ("host", "port", "user", "identity_file", "known_hosts", "account", "remote_root", "catalog")


def _profile_values(p: Profile) -> dict[str, Any]:
    """The keys a profile table holds, in the order rv writes new ones (unset keys are absent)."""
    values: dict[str, Any] = {k: getattr(p, k) for k in _SCALAR_KEYS if getattr(p, k) is not None}
    if p.setup:
        values["setup"] = list(p.setup)
    if p.share_with_group:
        values["share_with_group"] = True
    if p.system_site_packages:
        values["system_site_packages"] = True
    if p.python:
        values["python"] = p.python
    values.update(p.placement)  # rv init keeps what the user wrote there
    if p.sbatch:
        values["sbatch"] = list(p.sbatch)
    if p.notify:
        values["notify"] = list(p.notify)
    if p.work_dir:
        values["work_dir"] = p.work_dir
    if p.node_work_dir:
        values["node_work_dir"] = p.node_work_dir
    if p.container:
        values["container"] = p.container
    if p.idle_gpu:
        values["idle_gpu"] = p.idle_gpu
    return values


def _sync_table(table: Any, values: dict[str, Any]) -> None:
    """Make ``table`` hold ``values``: changed keys are assigned in place, unchanged ones untouched
    (their comments and formatting stay), keys no longer set removed, new ones appended."""
    for key in [k for k in table if k not in values and k not in ("gpus", "partitions")]:
        del table[key]
    for key, value in values.items():
        current = table.get(key)
        unwrapped = current.unwrap() if hasattr(current, "unwrap") else current
        if key not in table or unwrapped != value:
            table[key] = value


def _sync_subtables(table: Any, key: str, wanted: dict[str, dict[str, Any]]) -> None:
    """``table[key]`` holds one sub-table per name in ``wanted``, edited in place (comments kept)."""
    import tomlkit

    if not wanted:
        if key in table:
            del table[key]
        return
    if key not in table:
        table[key] = tomlkit.table(is_super_table=True)
    tables = table[key]
    for name in [n for n in tables if n not in wanted]:
        del tables[name]
    for name, values in wanted.items():
        if name not in tables:
            tables[name] = tomlkit.table()
        _sync_table(tables[name], values)


def render_config(config: Config, existing: str | None = None) -> str:
    """The config file's text: ``existing`` edited in place (comments kept), or a new file."""
    import tomlkit

    doc = tomlkit.parse(existing) if existing is not None else tomlkit.document()
    if existing is None:
        doc.add(tomlkit.comment(_HEADER_COMMENT))
    if config.default:
        if doc.get("default") != config.default:
            doc["default"] = config.default
    elif "default" in doc:
        del doc["default"]
    if "profiles" not in doc:
        doc["profiles"] = tomlkit.table(is_super_table=True)
    profiles = doc["profiles"]
    for name in [n for n in profiles if n not in config.profiles]:
        del profiles[name]
    for name, p in config.profiles.items():
        if name not in profiles:
            profiles[name] = tomlkit.table()
        table = profiles[name]
        _sync_table(table, _profile_values(p))
        if p.gpus or "gpus" in table:
            if "gpus" not in table:
                table["gpus"] = tomlkit.table(is_super_table=True)
            gpus = table["gpus"]
            for gname in [g for g in gpus if g not in p.gpus]:
                del gpus[gname]
            builtin = BUILTIN_CATALOGS.get(p.catalog, {})
            for gname, gpu in p.gpus.items():
                if gname not in gpus:
                    gpus[gname] = tomlkit.table()
                # Over a built-in type, only what differs from it: the built-in facts stay rv's.
                base = builtin[gname].to_dict() if gname in builtin else {}
                _sync_table(
                    gpus[gname],
                    {
                        k: v
                        for k, v in gpu.to_dict().items()
                        if k != "name" and v is not None and base.get(k) != v
                    },
                )
            if not p.gpus:
                del table["gpus"]
        _sync_subtables(table, "partitions", {n: q.to_dict() for n, q in p.partitions.items()})
    return tomlkit.dumps(doc)


def save_config(config: Config) -> None:
    """Write atomically, mode 0600 (the file names identity files and accounts), keeping comments."""
    existing = config.path.read_text(encoding="utf-8") if config.path.exists() else None
    text = render_config(config, existing)
    parse_config(text, config.path)  # never write a file we could not read back
    config.path.parent.mkdir(parents=True, exist_ok=True)
    write_private(config.path, text.encode("utf-8"), durable=True)
