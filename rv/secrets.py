"""Secrets for jobs (`rv env`): kept on the laptop, mode 0600, sent to a job in a 0600 file.

They never enter the job script, a command line or a log: the script sources the file, then deletes it.

Each secret belongs to one profile (one cluster), or to all of them when set with ``--global``; a job
gets its profile's secrets and the global ones, its profile's winning where both name a variable. A
key meant for one site is never sent to another.

What a secret may not be, checked when it is set or imported (and again before a job is sent):

* a name rv or Slurm sets in the job, or one that decides how the job runs at all (:data:`RESERVED`:
  ``PATH``, ``LD_*``, ``RV_*``, ``SLURM_*``, ...): one such secret broke every later job;
* bigger than the kernel passes in one environment string (:data:`MAX_ENV_STRING`), or, all of a
  job's secrets together, more than :data:`MAX_TOTAL_BYTES` of its environment: over either, every
  program the job starts fails with "Argument list too long".
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from rv.errors import ConfigError, UsageError

KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Linux's MAX_ARG_STRLEN: one environment string, "NAME=value" and its terminating NUL, is at most
# 32 pages of 4 KiB. execve refuses a longer one with E2BIG ("Argument list too long") for every
# program, whatever else the environment holds.
MAX_ENV_STRING = 131072
# All of a job's secrets together. The kernel's ARG_MAX (a quarter of the stack limit: 2 MiB with
# the usual 8 MiB) is shared by the command line and the whole environment, which on a cluster
# also carries Slurm's variables, the module system's and rv's own: the secrets get half of it.
MAX_TOTAL_BYTES = 1024 * 1024
_POINTER_BYTES = 8  # each environment string also costs its pointer in envp

_HOW_ELSE = "set it with `rv run --setup 'export NAME=...'` if you mean to, or give the secret another name"

# Names a secret may not have, as (shell glob, why): the globs are plain `case` patterns, so the job's
# shell side can refuse the same names with this one list. Three kinds: what rv sets in every job,
# what Slurm and the launchers set (per job, per node, per process), and what decides how the job's
# shell and programs run at all.
RESERVED: tuple[tuple[str, str], ...] = (
    ("RV_*", "rv sets RV_* variables in every job (its run dir, checkpoint dir, segment, ...)"),
    ("SLURM_*", "Slurm sets SLURM_* variables for the job; rv reads them"),
    ("SLURMD_*", "Slurm sets SLURMD_* variables on every node of the job"),
    ("SRUN_*", "srun reads SRUN_* variables as its options (rv sets SRUN_CPUS_PER_TASK)"),
    ("SBATCH_*", "sbatch reads SBATCH_* variables as its options"),
    ("SALLOC_*", "salloc reads SALLOC_* variables as its options"),
    ("SQUEUE_*", "squeue reads SQUEUE_* variables as its options; rv parses its output"),
    ("SACCT_*", "sacct reads SACCT_* variables as its options; rv parses its output"),
    ("SINFO_*", "sinfo reads SINFO_* variables as its options; rv parses its output"),
    ("PMI_*", "srun sets PMI_* variables to wire up the job's processes"),
    ("PMIX_*", "srun sets PMIX_* variables to wire up the job's processes"),
    ("MASTER_ADDR", "rv sets it: the first node of the job, for the launcher's rendezvous"),
    ("MASTER_PORT", "rv sets it from the job id, so two jobs on one node never share a port"),
    ("WORLD_SIZE", "the launcher sets it for every process"),
    ("RANK", "the launcher sets it for every process"),
    ("LOCAL_RANK", "the launcher sets it for every process"),
    ("LOCAL_WORLD_SIZE", "the launcher sets it for every process"),
    ("NODE_RANK", "the launcher sets it for every process"),
    ("GROUP_RANK", "the launcher sets it for every process"),
    ("ROLE_RANK", "the launcher sets it for every process"),
    ("TORCHELASTIC_*", "torchrun sets TORCHELASTIC_* variables for every process"),
    ("ACCELERATE_MIXED_PRECISION", "rv sets it from the job's GPU (bf16, fp16 or no)"),
    ("CUDA_VISIBLE_DEVICES", "Slurm sets it to the GPUs allocated to the job"),
    ("ROCR_VISIBLE_DEVICES", "Slurm sets it to the GPUs allocated to the job"),
    ("HIP_VISIBLE_DEVICES", "Slurm sets it to the GPUs allocated to the job"),
    ("GPU_DEVICE_ORDINAL", "Slurm sets it to the GPUs allocated to the job"),
    ("PATH", "every program the job runs is found with it"),
    ("HOME", "the job's shell, caches and tools find their files with it"),
    ("USER", "the job's tools and rv's records use it"),
    ("LOGNAME", "the job's tools use it as the user's name"),
    ("SHELL", "the job's programs start their shells with it"),
    ("PWD", "the shell sets it to the folder the program runs in"),
    ("OLDPWD", "the shell sets it"),
    ("TMPDIR", "rv's job steps and most tools write temporary files there"),
    ("IFS", "it changes how the job's shell splits every line"),
    ("ENV", "a shell started by the job runs the file it names first"),
    ("BASH_ENV", "every bash the job starts runs the file it names first"),
    ("BASHOPTS", "it changes how the job's shell runs"),
    ("SHELLOPTS", "it changes how the job's shell runs"),
    ("CDPATH", "it changes where the job's shell `cd`s"),
    ("GLOBIGNORE", "it changes what the job's shell's patterns match"),
    ("PS4", "the job's shell runs it while tracing"),
    ("_", "the shell sets it after every command"),
    ("LD_*", "the dynamic loader reads LD_* variables: they change every program the job runs"),
    ("PYTHON*", "PYTHON* variables change which Python and which modules the job runs"),
    ("VIRTUAL_ENV", "rv sets it when it activates the job's Python environment"),
)
RESERVED_GLOBS: tuple[str, ...] = tuple(glob for glob, _ in RESERVED)


def reserved_reason(name: str) -> str | None:
    """Why ``name`` cannot be a secret (it is rv's, Slurm's, or runs the job), or None when it can."""
    for glob, reason in RESERVED:
        if fnmatchcase(name, glob):
            return reason
    return None


def check_key(key: str) -> str:
    if not KEY.match(key):
        raise UsageError(f"invalid variable name {key!r}: letters, digits and _, not starting with a digit")
    return key


def check_name(key: str) -> str:
    """A name a secret may have: a valid variable name, none rv or Slurm set, none that runs the job."""
    check_key(key)
    reason = reserved_reason(key)
    if reason is not None:
        raise UsageError(f"{key} cannot be a secret: {reason}", hint=_HOW_ELSE.replace("NAME", key))
    return key


def env_string_bytes(key: str, value: str) -> int:
    """Bytes ``NAME=value`` takes in a process's environment: the string, its NUL and its pointer."""
    return len(key.encode()) + 1 + len(value.encode()) + 1 + _POINTER_BYTES


def check_value(key: str, value: str) -> str:
    """A value the kernel can pass to every program of a job: no NUL, UTF-8, not over MAX_ARG_STRLEN."""
    if "\0" in value:
        raise UsageError(f"the value of {key} holds a NUL byte, which no environment variable can")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise UsageError(f"the value of {key} is not UTF-8 text") from None
    string = len(key.encode()) + 1 + size + 1
    if string > MAX_ENV_STRING:
        raise UsageError(
            f"the value of {key} is {size} bytes: the kernel passes at most {MAX_ENV_STRING} bytes per "
            f"environment variable (MAX_ARG_STRLEN, '{key}=' and the final NUL included), so every "
            "program of the job would fail with 'Argument list too long'",
            hint=f"keep the value in a file the job reads (e.g. sent with `rv sync push`) and set {key} "
            "to its path",
        )
    return value


# Below this length a value shows nothing of itself: 4 characters of a 9-character password are
# nearly half of it. Above it, its two first and last characters tell two tokens apart.
MASK_SHOWS_ENDS_FROM = 20
_MASK = "*" * 8  # the same width whatever the value's length: a length narrows a guess too


def mask(value: str) -> str:
    """Enough to recognise a long value, never enough to use it; nothing of a short one, nor any
    value's length."""
    if len(value) < MASK_SHOWS_ENDS_FROM:
        return _MASK
    return value[:2] + _MASK + value[-2:]


@dataclass(frozen=True)
class DotenvLine:
    """A problem with one line of a .env file: its number and what is wrong (never its text)."""

    number: int
    problem: str


def parse_dotenv(data: bytes | str, *, skipped: list[DotenvLine] | None = None) -> dict[str, str]:
    """KEY=VALUE lines; `export ` prefixes, comments, and single/double quotes as in a shell .env file.

    ``data`` as read from the file: a line that is not UTF-8 is left out and, when ``skipped`` is
    given, reported there by number (the rest of the file is still read); without ``skipped`` it
    is an error. Any other malformed line is an error naming its number, never its text.
    """
    lines: list[str | None] = []
    if isinstance(data, str):
        lines += data.split("\n")
    else:
        for n, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):  # less a BOM
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                if skipped is None:
                    raise UsageError(
                        f".env line {n} is not UTF-8 text", hint="save the file as UTF-8 and import again"
                    ) from None
                skipped.append(DotenvLine(n, "not UTF-8 text"))
                lines.append(None)
    values: dict[str, str] = {}
    for n, text in enumerate(lines, 1):
        if text is None:
            continue
        line = text.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep:
            # Never echo the line: without its '=' it may be nothing but the secret itself.
            raise UsageError(
                f".env line {n} has no '=' (expected KEY=VALUE)", hint="fix that line and import again"
            )
        value = value.strip()
        if value[:1] in ("'", '"'):
            try:
                value = shlex.split(value)[0] if value not in ("''", '""') else ""
            except ValueError as exc:
                raise UsageError(f".env line {n}: unbalanced quotes") from exc
        else:
            value = value.split(" #", 1)[0].strip()
        try:
            values[check_key(key.strip())] = value
        except UsageError:
            raise UsageError(
                f".env line {n}: the name before '=' is not a valid variable name "
                "(letters, digits and _, not starting with a digit)",
                hint="fix that line and import again",
            ) from None
    return values


def render_env_file(values: Mapping[str, str]) -> str:
    """Bash-sourceable text: every value quoted once, so `$`, quotes and newlines stay literal."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(values.items()))


def read_piped_value(data: bytes, key: str) -> str:
    """A value piped to `rv env set KEY`: all of it, less one trailing newline (``echo`` adds one).

    A multi-line value (a PEM key) keeps every line; only the single newline that ends the input is
    dropped, so ``echo "$TOKEN" | rv env set KEY`` stores the token itself.
    """
    try:
        value = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"the value piped in for {key} is not UTF-8 text") from None
    if value.endswith("\n"):
        value = value[:-2] if value.endswith("\r\n") else value[:-1]
    if not value:
        raise UsageError(
            f"no value for {key}: standard input was empty",
            hint=f'pipe the value in (printf %s "$VALUE" | rv env set {key}), give it as {key}=VALUE, or '
            f"run `rv env set {key}` in a terminal to type it hidden",
        )
    return value


@dataclass(frozen=True)
class Secret:
    name: str
    value: str
    profile: str | None  # None: global, sent to jobs on every profile


def _total(values: Mapping[str, str]) -> int:
    return sum(env_string_bytes(k, v) for k, v in values.items())


class SecretStore:
    """secrets.json: ``{"version": 2, "global": {NAME: VALUE}, "profiles": {PROFILE: {NAME: VALUE}}}``.

    ``notice`` hears what a user should know but that does not stop the command (a secret not sent).
    """

    def __init__(self, path: Path, notice: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.notice = notice

    # -- the file -----------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """(global, per profile)."""
        if not self.path.exists():
            return {}, {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConfigError(
                f"{self.path} is not valid JSON ({exc})",
                hint="fix it, or move it away and set the secrets again",
            ) from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"{self.path} does not hold rv's secrets", hint="move it away and set them again"
            )
        raw_global, raw_profiles = data.get("global"), data.get("profiles")
        glob = (
            {k: v for k, v in raw_global.items() if isinstance(v, str)}
            if isinstance(raw_global, dict)
            else {}
        )
        profiles = (
            {p: dict(v) for p, v in raw_profiles.items() if isinstance(v, dict)}
            if isinstance(raw_profiles, dict)
            else {}
        )
        return glob, profiles

    def _write(self, glob: Mapping[str, str], profiles: Mapping[str, Mapping[str, str]]) -> None:
        data = {
            "version": 2,
            "global": dict(sorted(glob.items())),
            "profiles": {p: dict(sorted(v.items())) for p, v in sorted(profiles.items()) if v},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        # Created 0600 from the first byte: never a moment where others could read it.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)

    # -- reading ------------------------------------------------------------------------------------

    def entries(self) -> list[Secret]:
        """Every secret, global ones first, then each profile's, names in order."""
        glob, profiles = self._read()
        out = [Secret(k, v, None) for k, v in sorted(glob.items())]
        for profile in sorted(profiles):
            out += [Secret(k, v, profile) for k, v in sorted(profiles[profile].items())]
        return out

    def profiles(self) -> list[str]:
        return sorted(self._read()[1])

    def scope(self, profile: str | None) -> dict[str, str]:
        """The secrets of exactly one scope: a profile's own, or (None) the global ones."""
        glob, profiles = self._read()
        return dict(glob if profile is None else profiles.get(profile, {}))

    def for_profile(self, profile: str) -> dict[str, Secret]:
        """What a job on ``profile`` gets, name -> secret: the global ones, its own laid over them."""
        glob, profiles = self._read()
        merged = {k: Secret(k, v, None) for k, v in glob.items()}
        merged.update({k: Secret(k, v, profile) for k, v in profiles.get(profile, {}).items()})
        return dict(sorted(merged.items()))

    def for_job(self, profile: str) -> dict[str, str]:
        """The environment a job on ``profile`` gets from its secrets.

        A name that may not be a secret (in a file edited by hand: `rv env` refuses such names) is
        left out, and ``notice`` says why. Raises UsageError, before anything is sent, when the
        secrets would not fit in a job's environment.
        """
        values = {}
        for name, secret in self.for_profile(profile).items():
            reason = reserved_reason(name)
            if reason is not None:
                if self.notice is not None:
                    where = "--global " if secret.profile is None else ""
                    self.notice(f"secret {name} is not sent to the job: {reason} (rv env rm {where}{name})")
                continue
            check_value(name, secret.value)
            values[name] = secret.value
        _check_total(values, profile)
        return values

    # -- changing -----------------------------------------------------------------------------------

    def update(self, values: Mapping[str, str], profile: str | None) -> None:
        """Set ``values`` in one scope (None: global), all or none: every name and value is checked."""
        for key, value in values.items():
            check_name(key)
            check_value(key, value)
        with self._locked():
            glob, profiles = self._read()
            if profile is None:
                glob = {**glob, **values}
            else:
                profiles = {**profiles, profile: {**profiles.get(profile, {}), **values}}
            _check_all_totals(glob, profiles, profile)
            self._write(glob, profiles)

    def set(self, key: str, value: str, profile: str | None = None) -> None:
        self.update({key: value}, profile)

    def remove(self, keys: list[str], profile: str | None) -> list[str]:
        """Remove ``keys`` from one scope; returns those that were not there (nothing removed then)."""
        with self._locked():
            glob, profiles = self._read()
            scope = dict(glob if profile is None else profiles.get(profile, {}))
            missing = [k for k in keys if k not in scope]
            if missing:
                return missing
            for key in keys:
                del scope[key]
            if profile is None:
                glob = scope
            else:
                profiles = {**profiles, profile: scope}
            self._write(glob, profiles)
        return []

    def move(self, keys: list[str], source: str | None, target: str | None) -> list[str]:
        """Move ``keys`` from one scope to another (None: global); returns those not in ``source``."""
        with self._locked():
            glob, profiles = self._read()
            scopes: dict[str | None, dict[str, str]] = {None: dict(glob)}
            scopes.update({p: dict(v) for p, v in profiles.items()})
            src, dst = scopes.setdefault(source, {}), scopes.setdefault(target, {})
            missing = [k for k in keys if k not in src]
            if missing:
                return missing
            for key in keys:
                dst[key] = src.pop(key)
            glob = scopes.pop(None)
            profiles = {p: v for p, v in scopes.items() if p is not None}
            _check_all_totals(glob, profiles, target)
            self._write(glob, profiles)
        return []


def _check_total(values: Mapping[str, str], profile: str | None) -> None:
    total = _total(values)
    if total > MAX_TOTAL_BYTES:
        where = f"on profile {profile}" if profile is not None else "on every profile"
        raise UsageError(
            f"the secrets of a job {where} would take {total} bytes of its environment, over rv's limit of "
            f"{MAX_TOTAL_BYTES} (the kernel's ARG_MAX, 2 MiB on most clusters, holds the command line "
            "and the whole environment together)",
            hint="keep large values in files the job reads (e.g. sent with `rv sync push`), and "
            "remove some secrets with `rv env rm`",
        )


def _check_all_totals(
    glob: Mapping[str, str], profiles: Mapping[str, Mapping[str, str]], changed: str | None
) -> None:
    """The jobs a change reaches still fit: one profile's, or (a global change) every profile's."""
    if changed is not None:
        _check_total({**glob, **profiles.get(changed, {})}, changed)
        return
    _check_total(glob, None)
    for profile, own in profiles.items():
        _check_total({**glob, **own}, profile)


def job_secrets(profile: str, notice: Callable[[str], None] | None = None) -> dict[str, str]:
    """The secrets a job on ``profile`` gets (`rv run`, `rv up`): its own and the global ones."""
    from rv.config import state_dir

    return SecretStore(state_dir() / "secrets.json", notice).for_job(profile)
