"""Which Python environment a run needs, read from the snapshot before anything is sent.

A project says what it depends on in one of three ways; the first found wins, looking in the folder
``rv run`` was typed in and then in each folder above it up to the repo top:

1. ``uv.lock`` next to ``pyproject.toml``: the locked set (``uv export`` of it, without the project).
2. ``requirements.txt`` (or the file ``--requirements`` names, with the files it includes by ``-r``
   or ``-c``).
3. ``pyproject.toml`` with ``[project] dependencies`` (and the ``--extra`` groups).

Only the snapshot's own files count (what git tracks): the environment must be rebuildable from what
the job runs. The project itself is never installed into the environment (it is shared by every run
with the same dependencies; the code is per run): the job puts the project's folder, or its ``src/``,
on ``PYTHONPATH`` instead.

The environment's key is finished on the cluster, which adds the interpreter, the platform and the
index settings (see :mod:`rv.agent.envs`); here we hash what the project decides.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
import tomllib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from rv.errors import UsageError

SPEC_VERSION = "1"  # bump when the way an environment is built changes: every key changes with it

# A requirements line that installs the project itself: it would tie the shared environment to one
# snapshot, and the job already finds the project's code on PYTHONPATH.
_SELF_INSTALL = re.compile(r"^(?:-e\s+|--editable(?:=|\s+))?(?:\.|\./|file:\.?/?\.?)(?:\[[^\]]*\])?\s*$")
_INCLUDE = re.compile(r"^(?:-r|--requirement|-c|--constraint)(?:=|\s+)(\S+)\s*$")


@dataclass(frozen=True)
class EnvSpec:
    """What decides an environment's content, as far as the project's files say."""

    kind: str  # "uv.lock" | "requirements" | "pyproject"
    folder: str  # where the files are, relative to the repo top ("" for the top)
    files: tuple[tuple[str, bytes], ...]  # (path relative to folder, bytes), the main file first
    extras: tuple[str, ...] = ()
    system_site_packages: bool = False
    python: str | None = None  # --python: a version uv may find or fetch, or an interpreter's path
    dropped: tuple[str, ...] = ()  # requirement lines left out (the project installing itself)

    @property
    def main_file(self) -> str:
        return posixpath.join(self.folder, self.files[0][0]) if self.folder else self.files[0][0]

    @property
    def file_names(self) -> tuple[str, ...]:
        return tuple(posixpath.join(self.folder, name) if self.folder else name for name, _ in self.files)

    def digest(self) -> str:
        """Hash of the project's part of the key (the cluster adds the interpreter's)."""
        h = hashlib.sha256()
        for part in (
            SPEC_VERSION,
            self.kind,
            *self.extras,
            str(self.system_site_packages),
            self.python or "",
        ):
            h.update(part.encode() + b"\0")
        for name, data in self.files:
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return h.hexdigest()

    def to_wire(self) -> dict[str, object]:
        """What the cluster-side builder gets: the files' text travels in the call's arguments."""
        return {
            "kind": self.kind,
            "files": [[name, data.decode("utf-8", "replace")] for name, data in self.files],
            "extras": list(self.extras),
            "system_site_packages": self.system_site_packages,
            "python": self.python,
            "digest": self.digest(),
            "label": ", ".join(self.file_names),
            "requires_python": self.requires_python,
        }

    @property
    def requires_python(self) -> str | None:
        """The project's ``requires-python``, checked against the cluster's interpreter before a build."""
        for name, data in self.files:
            if posixpath.basename(name) == "pyproject.toml":
                try:
                    value = _project_table(tomllib.loads(data.decode("utf-8"))).get("requires-python")
                except (tomllib.TOMLDecodeError, UnicodeDecodeError):
                    return None
                return value if isinstance(value, str) else None
        return None


Reader = Callable[[str], bytes]  # bytes of a snapshot file, by its path from the repo top


def find_spec(
    files: Collection[str],
    read: Reader,
    *,
    start: str = "",
    requirements: str | None = None,
    extras: Sequence[str] = (),
    system_site_packages: bool = False,
    python: str | None = None,
) -> EnvSpec | None:
    """The environment the snapshot asks for, or None when it names no dependencies.

    ``files`` are the snapshot's paths (from the repo top), ``start`` the folder ``rv run`` was typed
    in. A flag that names something absent (``--requirements``, ``--extra``) is an error here, before
    anything is sent.
    """
    if requirements is not None:
        path = _resolve(start, requirements)
        if path not in files:
            raise UsageError(
                f"--requirements {requirements}: {path} is not in the snapshot",
                hint="name a file git tracks (`git add` it), relative to where you typed rv run",
            )
        if extras:
            raise UsageError("--extra applies to pyproject.toml dependencies, not to a requirements file")
        folder, name = posixpath.split(path)
        found: EnvSpec | None = _requirements_spec(files, read, folder, name)
    else:
        found = _search(files, read, start.strip("/"), tuple(extras))
    if found is None:
        if extras:
            raise UsageError("--extra: no pyproject.toml with [project] dependencies in the snapshot")
        return None
    return replace(found, system_site_packages=system_site_packages, python=python)


def _search(files: Collection[str], read: Reader, folder: str, extras: tuple[str, ...]) -> EnvSpec | None:
    """From ``folder`` up to the repo top: the first folder with a dependency spec."""
    while True:

        def here(name: str, folder: str = folder) -> str:
            return posixpath.join(folder, name) if folder else name

        pyproject = _load_pyproject(read, here("pyproject.toml")) if here("pyproject.toml") in files else None
        if here("uv.lock") in files and pyproject is not None:
            _check_extras(pyproject, extras, here("pyproject.toml"))
            locked = (("pyproject.toml", read(here("pyproject.toml"))), ("uv.lock", read(here("uv.lock"))))
            return EnvSpec("uv.lock", folder, locked, extras)
        if here("requirements.txt") in files:
            if extras:
                raise UsageError(
                    f"--extra needs pyproject.toml dependencies, but {here('requirements.txt')} comes first",
                    hint="name the pyproject's groups in a requirements file, or use --requirements",
                )
            return _requirements_spec(files, read, folder, "requirements.txt")
        if pyproject is not None and _declares_dependencies(pyproject):
            _check_extras(pyproject, extras, here("pyproject.toml"))
            return EnvSpec("pyproject", folder, (("pyproject.toml", read(here("pyproject.toml"))),), extras)
        if not folder:
            return None
        folder = posixpath.dirname(folder)


def _resolve(start: str, path: str) -> str:
    joined = posixpath.normpath(posixpath.join(start, path))
    if joined.startswith("../") or joined == ".." or posixpath.isabs(path):
        raise UsageError(f"--requirements {path}: must be a file inside the repo")
    return joined


def _load_pyproject(read: Reader, path: str) -> dict[str, object]:
    try:
        return tomllib.loads(read(path).decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"{path} is not valid TOML: {exc}",
            hint="fix it, or run with no environment built: rv run --env none ...",
        ) from exc


def _project_table(pyproject: dict[str, object]) -> dict[str, object]:
    table = pyproject.get("project")
    return table if isinstance(table, dict) else {}


def _declares_dependencies(pyproject: dict[str, object]) -> bool:
    project = _project_table(pyproject)
    return bool(project.get("dependencies")) or bool(project.get("optional-dependencies"))


def _check_extras(pyproject: dict[str, object], extras: Sequence[str], where: str) -> None:
    groups = _project_table(pyproject).get("optional-dependencies")
    known = sorted(groups) if isinstance(groups, dict) else []
    for extra in extras:
        if extra not in known:
            raise UsageError(
                f"--extra {extra}: {where} has no such group",
                hint=f"its [project.optional-dependencies]: {', '.join(known) or 'none'}",
            )


def _requirements_spec(files: Collection[str], read: Reader, folder: str, name: str) -> EnvSpec:
    """A requirements file and what it includes, each once; lines installing the project dropped."""
    collected: list[tuple[str, bytes]] = []
    dropped: list[str] = []
    pending = [name]
    while pending:
        rel = pending.pop(0)
        if any(rel == seen for seen, _ in collected):
            continue
        path = posixpath.join(folder, rel) if folder else rel
        if path not in files:
            raise UsageError(
                f"{collected[0][0] if collected else rel} includes {rel}, which is not in the snapshot",
                hint="`git add` it, or remove the -r/-c line",
            )
        kept = []
        for line in read(path).decode("utf-8", "replace").splitlines():
            stripped = line.split(" #", 1)[0].strip()
            if _SELF_INSTALL.match(stripped):
                dropped.append(f"{path}: {stripped}")
                continue
            kept.append(line)
            include = _INCLUDE.match(stripped)
            if include:
                pending.append(posixpath.normpath(posixpath.join(posixpath.dirname(rel), include[1])))
        collected.append((rel, "\n".join(kept).encode() + b"\n"))
    return EnvSpec("requirements", folder, tuple(collected), dropped=tuple(dropped))


def import_paths(files: Collection[str], folder: str) -> tuple[str, ...]:
    """Folders (relative to the work dir) that make the project importable: ``src/`` if it has one."""
    base = f"{folder}/" if folder else ""
    src = f"{base}src/"
    under = getattr(files, "under", None)  # a manifest's paths list those under a folder cheaply
    inside = under(src) if under is not None else (p for p in files if p.startswith(src))
    if any(path.endswith(".py") for path in inside):
        return (f"{base}src",)
    return (folder or ".",)


def activation_lines(prefix: str, paths: Sequence[str] = (), *, in_image: bool = False) -> tuple[str, ...]:
    """The job's lines for the env-build hook: the environment first on PATH, the project importable.

    ``prefix`` is a venv or a conda prefix. Its ``.last-used`` stamp tells ``rv gc`` it is in use.
    ``in_image``: a venv built in a container image, whose ``bin/python`` points at the image's
    interpreter (not a file of this machine): its ``pyvenv.cfg`` says it is there.
    """
    q = shlex.quote(prefix)
    there = '-f "$RV_ENV/pyvenv.cfg"' if in_image else '-x "$RV_ENV/bin/python"'
    lines = [
        f"export RV_ENV={q}",
        f'if [ ! {there} ]; then echo "rv: the environment $RV_ENV is gone;'
        ' rebuild it with: rv venv build" >&2; exit 3; fi',
        'if [ -f "$RV_ENV/pyvenv.cfg" ]; then export VIRTUAL_ENV="$RV_ENV"; fi',
        'if [ -d "$RV_ENV/conda-meta" ]; then export CONDA_PREFIX="$RV_ENV"; fi',
        'unset PYTHONHOME; export PATH="$RV_ENV/bin:$PATH"',
        'touch "$RV_ENV/.last-used" 2>/dev/null || true',
    ]
    for path in reversed(paths):
        where = '"$RV_WORK_DIR"' if path in ("", ".") else f'"$RV_WORK_DIR"/{shlex.quote(path)}'
        lines.append(f'export PYTHONPATH={where}"${{PYTHONPATH:+:$PYTHONPATH}}"')
    return tuple(lines)
