"""Which files a snapshot holds, their blob ids, the manifest, and shipping it to the cluster.

What is in a snapshot (from the git repo holding the given folder):

* tracked files plus untracked files git does not ignore, with their working-tree content
  (uncommitted edits included; a tracked file deleted but not staged is simply absent);
* files of checked-out submodules and of untracked nested repositories, by their own git rules;
* minus what ``.rvignore`` files exclude (gitignore syntax, nested folders too, across submodule
  boundaries). git's own matcher decides, never a hand-written one: the candidate paths go into a
  throw-away index and ``git ls-files -c -i --exclude-per-directory=.rvignore`` names the excluded;
* symlinks as symlinks, executable bits kept (git's two file modes), ``.git`` never.

Outside a git repo: every file under the folder minus ``.rvignore`` (git's matcher again, in a
throw-away repository whose work tree is the folder), with a warning.

Blob ids are git's (sha1 over ``blob <size>\\0`` + content) for every file, so clean tracked files
cost nothing: their ids come from git's index, trusted only where git's own stat check says the file
is unchanged and no checkout conversion (filters, ``eol=crlf``, autocrlf, ident, encodings) could make
the working tree differ from the blob. Everything else is hashed here.

Shipping (see :mod:`rv.remote_store` for the cluster side) costs one round trip when the snapshot
already exists and two otherwise: ``snap-query`` (which objects are missing), then ``snap-put`` (only
those, streamed through one command's stdin, then the tree is built by hard links). The manifest
travels as a delta against a manifest this machine sent before when one is cached. make_snapshot
starts ``snap-query`` before listing, so the cluster's shell and python start-up overlap with git.

Why git decides what is ignored: a second implementation of gitignore semantics (negation, folder
patterns, ``**``, nested files, case folding) would disagree with git somewhere, and the user's only
reference is what git itself does.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import re
import shlex
import stat
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv import __version__
from rv import remote_store as agent
from rv.errors import NotFound, RemoteCommandMissing, RemoteError, RvError, UsageError
from rv.layout import RemoteLayout
from rv.progress import Progress, ProgressCounter

if TYPE_CHECKING:
    from rv.treecache import StoreCache, TreeCache

# tempfile, socket and getpass are imported where they are used: `rv ps` imports this module for
# call_agent and should not pay for what only a snapshot needs. Threads are plain ones (_Soon):
# concurrent.futures costs ~4 ms of imports (logging, queue) a command would pay for nothing.

DEFAULT_MAX_FILE_SIZE = 100 * 1000 * 1000  # 100 MB
MODE_FILE, MODE_EXEC, MODE_LINK, MODE_GITLINK = 0o100644, 0o100755, 0o120000, 0o160000
DIFF_LIMIT = 1 << 20  # provenance keeps at most 1 MiB of a dirty tree's diff
_READ = 1 << 20

# Transfers report TransferProgress(files, bytes done and total) to an optional callback; see rv.progress.


# --------------------------------------------------------------------------------------------------
# git, the one local seam


class GitError(RvError):
    """A git command failed unexpectedly (exit 1: not something the user typed wrong)."""

    exit_code = 1


_GIT_LOCATION_VARS = frozenset(
    {
        "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR",
        "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_PREFIX", "GIT_QUARANTINE_PATH",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Git:
    """Runs git. Injected so tests (and odd installs) can point at another binary."""

    executable: str = "git"

    def run(
        self,
        args: Sequence[str],
        cwd: str | Path,
        *,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        ok_codes: tuple[int, ...] = (0,),
    ) -> subprocess.CompletedProcess[bytes]:
        # Variables that would point git at another repository or index (set inside a git hook,
        # say) must not leak in; the rest (GIT_CONFIG_*, GIT_CEILING_DIRECTORIES...) the user meant.
        base = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_VARS}
        # Never take optional locks (git status would rewrite the user's index while they work).
        base["GIT_OPTIONAL_LOCKS"] = "0"
        base.update(env or {})
        try:
            proc = subprocess.run(
                [self.executable, *args], cwd=cwd, input=input, capture_output=True, env=base
            )
        except FileNotFoundError as exc:
            raise UsageError(
                f"git is not installed here ({self.executable})", hint="install git; rv uses it to list files"
            ) from exc
        if proc.returncode not in ok_codes:
            tail = proc.stderr.decode("utf-8", "replace").strip()[-400:]
            raise GitError(f"git {' '.join(args[:3])} failed in {cwd}: {tail}")
        return proc

    def out(self, args: Sequence[str], cwd: str | Path, **kw: Any) -> bytes:
        return self.run(args, cwd, **kw).stdout


class _Soon:
    """A call running on a thread of its own; ``result()`` waits for it and re-raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(fn, args, kw), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        try:
            self._out.append((True, fn(*args, **kw)))
        except BaseException as exc:  # handed to whoever asks for the result, never dropped
            self._out.append((False, exc))

    def result(self) -> Any:
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


def _map(fn: Callable[[Any], Any], items: list[Any], workers: int) -> list[Any]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads."""
    results: list[Any] = [None] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            results[i] = fn(items[i])

    for task in [_Soon(work) for _ in range(max(1, min(workers, len(items))))]:
        task.result()
    return results


def _split_z(data: bytes) -> list[str]:
    return [agent.dec(p) for p in data.split(b"\0") if p]


# --------------------------------------------------------------------------------------------------
# The manifest


@dataclass(frozen=True, slots=True)
class Entry:
    """One file of a tree: ``mode`` is git's (100644, 100755 or 120000), ``oid`` its blob id."""

    path: str
    mode: int
    oid: str
    size: int
    mtime_ns: int = 0  # local only (push's quick check); not part of the manifest

    def row(self) -> list[Any]:
        return [self.path, self.mode, self.oid, self.size]

    @property
    def is_link(self) -> bool:
        return self.mode == MODE_LINK


def blob_id(data: bytes) -> str:
    h = agent.blob_hasher(len(data))
    h.update(data)
    return str(h.hexdigest())


def snapshot_id(entries: Iterable[Entry]) -> str:
    """Derived from the manifest alone, so identical trees are one snapshot."""
    return str(agent.manifest_id([e.row() for e in entries]))


def sort_entries(entries: Iterable[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: agent.enc(e.path))


def hash_path(full: str | Path) -> tuple[int, str, int, int] | None:
    """(mode, oid, size, mtime_ns) of a file or symlink as git would store it; None if absent/special."""
    try:
        st = os.lstat(full)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.fsencode(os.readlink(full))
        return MODE_LINK, blob_id(target), len(target), st.st_mtime_ns
    if not stat.S_ISREG(st.st_mode):
        return None
    mode = MODE_EXEC if st.st_mode & stat.S_IXUSR else MODE_FILE
    h = agent.blob_hasher(st.st_size)
    left = st.st_size
    with open(full, "rb") as fh:
        while left > 0:
            data = fh.read(min(_READ, left))
            if not data:
                # Shrank since the stat: hash what is there now, with its own size.
                return hash_path(full)
            h.update(data)
            left -= len(data)
    return mode, h.hexdigest(), st.st_size, st.st_mtime_ns


# --------------------------------------------------------------------------------------------------
# Listing


@dataclass(frozen=True)
class RepoInfo:
    top: Path
    git_dir: Path
    commit: str | None
    branch: str | None
    remote_url: str | None
    dirty: bool
    untracked: tuple[str, ...]
    # Paths of the top repository whose content may differ from HEAD's (staged, or changed in the
    # work tree, and every submodule): what the provenance diff is limited to. None: not known.
    changed: tuple[str, ...] | None = None
    submodules: tuple[str, ...] = ()  # the top repository's submodules (their diff is never kept)


class ManifestPaths(Collection[str]):
    """The paths of a manifest: membership by binary search, iteration by one parse of the text."""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and agent.row_at(self.text, path) is not None

    def __iter__(self) -> Iterator[str]:
        return (row[0] for row in agent.manifest_rows(self.text))

    def __len__(self) -> int:
        return self.text.count(b"\n")

    def under(self, prefix: str) -> Iterator[str]:
        """The paths that start with ``prefix``, in manifest order."""
        key = agent.enc(prefix)
        start = agent.find_line(self.text, key)[0]
        while start < len(self.text):
            end = self.text.index(b"\n", start) + 1
            path = agent.parse_line(self.text[start:end])[0]
            if not agent.enc(path).startswith(key):
                return
            yield path
            start = end


@dataclass(frozen=True)
class LocalTree:
    """The files a snapshot or push would carry, relative to ``root``, as a manifest text.

    ``entries`` parses the whole manifest (on first use): the hot paths (a resubmit with nothing or
    little changed) never need it.
    """

    root: Path
    manifest: bytes  # rv.remote_store's manifest text: one line per file, sorted by path
    files: int
    total_size: int
    large: tuple[tuple[str, int], ...] = ()  # every file of LARGE_FLOOR bytes or more: (path, size)
    ignored: tuple[tuple[str, int], ...] = ()  # left out by .rvignore: (path, size; -1 for a folder)
    warnings: tuple[str, ...] = ()
    repo: RepoInfo | None = None
    mtimes: dict[str, int] | None = field(default=None, compare=False, repr=False)
    # (id of the manifest this machine listed before, {path: row or None} since then): lets an
    # upload send a delta against it without comparing the two manifests.
    previous: tuple[str, dict[str, list[Any] | None]] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, root: Path, entries: Iterable[Entry], **kw: Any) -> LocalTree:
        entries = list(entries)
        text = agent.manifest_text([e.row() for e in entries])
        mtimes = {e.path: e.mtime_ns for e in entries} if any(e.mtime_ns for e in entries) else None
        large = tuple((e.path, e.size) for e in entries if e.size >= LARGE_FLOOR)
        return cls(root, text, len(entries), sum(e.size for e in entries), large, mtimes=mtimes, **kw)

    @functools.cached_property
    def id(self) -> str:
        return str(agent.text_id(self.manifest))

    @functools.cached_property
    def entries(self) -> tuple[Entry, ...]:
        mtimes = self.mtimes or {}
        return tuple(Entry(p, m, o, s, mtimes.get(p, 0)) for p, m, o, s in agent.manifest_rows(self.manifest))

    @property
    def paths(self) -> ManifestPaths:
        return ManifestPaths(self.manifest)

    def subtree(self, rel: str) -> LocalTree:
        """The part under ``rel`` (a folder inside root), with paths relative to it."""
        if rel in ("", "."):
            return self
        prefix = rel.rstrip("/") + "/"
        return LocalTree.of(
            self.root / rel,
            [replace(e, path=e.path[len(prefix) :]) for e in self.entries if e.path.startswith(prefix)],
            ignored=tuple((p[len(prefix) :], s) for p, s in self.ignored if p.startswith(prefix)),
            warnings=self.warnings,
            repo=self.repo,
        )


def find_repo(path: Path, git: Git) -> tuple[Path, str] | None:
    """(the work tree's top, its git folder), or None outside any repository.

    When git refuses a repository that is there (``safe.directory`` ownership checks, a damaged
    ``.git``), that is an error, not "no repo": treating it as a plain folder would send every
    gitignored file.
    """
    proc = git.run(["rev-parse", "--show-toplevel", "--absolute-git-dir"], path, ok_codes=(0, 128))
    if proc.returncode == 0:
        top, git_dir = os.fsdecode(proc.stdout).rstrip("\n").split("\n")[:2]
        return Path(top), git_dir
    resolved = path.resolve()
    for folder in (resolved, *resolved.parents):
        if (folder / ".git").exists():
            tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise UsageError(
                f"git cannot read the repository at {folder}: {tail[-1] if tail else 'no message'}",
                hint="run `git status` there to see why (safe.directory, a damaged .git ...)",
            )
    return None


def find_repo_top(path: Path, git: Git) -> Path | None:
    found = find_repo(path, git)
    return found[0] if found else None


def _untrusted_by_attributes(top: Path, paths: list[str], git: Git, config: dict[str, str]) -> set[str]:
    """Paths whose checkout may not equal the blob (filters such as LFS, CRLF conversion, ident...)."""
    if not paths:
        return set()
    autocrlf = config.get("core.autocrlf", "false").lower() in ("true", "1", "yes", "on")
    crlf_eol = config.get("core.eol", "").lower() == "crlf"
    out = git.out(
        ["check-attr", "-z", "--stdin", "filter", "ident", "working-tree-encoding", "text", "eol", "crlf"],
        top,
        input=b"\0".join(agent.enc(p) for p in paths) + b"\0",
    )
    fields = out.split(b"\0")
    bad: set[str] = set()
    for i in range(0, len(fields) - 2, 3):
        path, attr, value = agent.dec(fields[i]), fields[i + 1], fields[i + 2]
        if value in (b"unspecified", b"unset"):
            if attr == b"text" and (autocrlf or crlf_eol) and value == b"unspecified":
                bad.add(path)  # autocrlf converts any file git guesses is text
            continue
        converts = attr in (b"text", b"crlf") and (autocrlf or crlf_eol)
        if (
            converts
            or attr in (b"filter", b"ident", b"working-tree-encoding")
            or (attr, value) == (b"eol", b"crlf")
        ):
            bad.add(path)
    return bad


def _git_config(top: Path, git: Git) -> dict[str, str]:
    proc = git.run(
        [
            "config", "-z", "--get-regexp",
            r"^(core\.(autocrlf|eol|attributesfile|filemode)|remote\.origin\.url)$",
        ],
        top,
        ok_codes=(0, 1),
    )  # fmt: skip
    values = {}
    for item in proc.stdout.split(b"\0"):
        if item:
            key, _, value = item.partition(b"\n")
            values[key.decode()] = value.decode("utf-8", "replace")
    return values


_LS_STAGE = re.compile(rb"([^ \0]+) ([0-7]{6}) ([0-9a-f]+) ([0-3])\t([^\0]*)\0")


def _attribute_files(git_dir: str, config: dict[str, str]) -> list[str]:
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return [
        os.path.join(git_dir, "info", "attributes"),
        os.path.expanduser(config.get("core.attributesfile", "")) or os.path.join(xdg, "git", "attributes"),
        "/etc/gitattributes",
        "/usr/local/etc/gitattributes",
    ]


def _converts(config: dict[str, str]) -> bool:
    return config.get("core.autocrlf", "false").lower() in ("true", "1", "yes", "on", "input") or (
        config.get("core.eol", "").lower() == "crlf"
    )


def _attribute_sources(top: Path, git_dir: str, names: Iterable[str], config: dict[str, str]) -> bool:
    """Could any gitattributes apply here? Without any, check-attr (costly on big repos) is skipped."""
    if _converts(config):
        return True
    if any(n == ".gitattributes" or n.endswith("/.gitattributes") for n in names):
        return True
    return any(os.path.isfile(f) for f in _attribute_files(git_dir, config))


def _is_attributes(path: str) -> bool:
    return path == ".gitattributes" or path.endswith("/.gitattributes")


def _list_plain(folder: Path, git: Git) -> tuple[list[str], list[str], list[str]]:
    """Every file under a folder that is not a repo, minus .rvignore: (files, nested repos, left out)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rv-ls-") as tmp:
        env = _scratch_repo(Path(tmp), folder, git)
        listed = _split_z(
            git.out(["ls-files", "-z", "-o", "--exclude-per-directory=.rvignore"], folder, env=env)
        )
        left_out = _split_z(
            git.out(
                ["ls-files", "-z", "-o", "-i", "--directory", "--exclude-per-directory=.rvignore"],
                folder,
                env=env,
            )
        )
    files = [p for p in listed if not p.endswith("/")]
    nested = [p.rstrip("/") for p in listed if p.endswith("/")]
    return files, nested, left_out


def _scratch_repo(tmp: Path, work_tree: Path, git: Git) -> dict[str, str]:
    """A throw-away repository over ``work_tree``: git's ignore matcher without touching the user's repo."""
    git.out(["init", "-q", "--bare", str(tmp / "g")], tmp)
    return {
        "GIT_DIR": str(tmp / "g"),
        "GIT_WORK_TREE": str(work_tree),
        "GIT_INDEX_FILE": str(tmp / "index"),
        "GIT_CONFIG_NOSYSTEM": "1",
    }


def ignored_paths(
    root: Path,
    paths: Iterable[str],
    git: Git,
    *,
    gitignore: bool = False,
    exclude_from: Iterable[Path] = (),
) -> set[str]:
    """Which of ``paths`` (relative to root; they need not exist) ignore rules exclude.

    ``.rvignore`` files by default; with ``gitignore``, git's standard rules instead (``.gitignore``
    files, the global excludes file, plus ``exclude_from`` such as the repo's ``info/exclude``).
    git decides: the paths go into a throw-away index as placeholders and ``ls-files -c -i`` applies
    nested ignore files, negations and folder patterns exactly as git does.
    """
    remaining = set(paths)
    if not remaining:
        return set()
    empty = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    rules = ["--exclude-standard"] if gitignore else ["--exclude-per-directory=.rvignore"]
    rules += [f"--exclude-from={f}" for f in exclude_from if f.is_file()]
    import tempfile

    out: set[str] = set()
    while remaining:
        # An index cannot hold "a" and "a/b" at once (a file that became a folder lists both): the
        # paths below another one are asked about in a later round.
        batch = [p for p in remaining if not _below_one_of(p, remaining)]
        remaining.difference_update(batch)
        info = b"".join(b"100644 " + empty.encode() + b"\t" + agent.enc(p) + b"\0" for p in batch)
        with tempfile.TemporaryDirectory(prefix="rv-ignore-") as tmp:
            env = _scratch_repo(Path(tmp), root, git)
            git.out(["update-index", "-z", "--index-info"], root, input=info, env=env)
            out.update(_split_z(git.out(["ls-files", "-z", "-c", "-i", *rules], root, env=env)))
    return out


def _below_one_of(path: str, paths: set[str]) -> bool:
    i = path.rfind("/")
    while i > 0:
        if path[:i] in paths:
            return True
        i = path.rfind("/", 0, i)
    return False


def index_signature(git_dir: str) -> tuple[Any, ...] | None:
    """What identifies the content of a repository's index: its size, mtime, inode and checksum.

    git writes the index to a new file and renames it, and ends it with a SHA-1 of its content, so
    an unchanged signature means an unchanged file list. None when there is nothing to trust (the
    index could not be read, or ``index.skipHash`` left the checksum out).
    """
    try:
        with open(os.path.join(git_dir, "index"), "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size < 32:
                return None
            fh.seek(-20, os.SEEK_END)
            trailer = fh.read(20)
    except FileNotFoundError:
        return ("no index",)
    except OSError:
        return None
    if trailer == bytes(20):
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, trailer)


def _file_sig(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclass
class _Repo:
    """What git says about one repository of the tree (the top one, a submodule, a nested repo)."""

    prefix: str  # its folder from the top, with a trailing slash ("" for the top)
    git_dir: str
    sig: tuple[Any, ...] | None
    config: dict[str, str]
    modified: set[str]  # tracked files git's stat check does not vouch for (paths from the top)
    others: list[str]  # untracked files, not ignored
    nested: list[str]  # untracked folders that are repositories of their own
    index: dict[str, tuple[bytes, int, str, int]] | None  # path -> (tag, mode, oid, stage); fast: None


def _ask_repo(top: Path, prefix: str, git: Git, git_dir: str | None, with_index: bool) -> _Repo:
    where = top / prefix if prefix else top
    if git_dir is None:
        git_dir = os.fsdecode(git.out(["rev-parse", "--absolute-git-dir"], where).strip())
    sig = index_signature(git_dir)  # before the index is read: a later change then shows next time
    # Independent questions, asked at once: git processes are the bulk of a listing.
    index_f = _Soon(git.out, ["ls-files", "-z", "-s", "-v"], where) if with_index else None
    modified_f = _Soon(git.out, ["diff-files", "-z", "--name-only", "--ignore-submodules=all"], where)
    others_f = _Soon(git.out, ["ls-files", "-z", "-o", "--exclude-standard"], where)
    config = _git_config(where, git)
    listing = index_f.result() if index_f is not None else b""
    modified_b, others_b = modified_f.result(), others_f.result()
    if index_signature(git_dir) != sig:
        sig = None  # the index changed while git read it (a `git add` just now): trust no listing of it
    index = None
    if with_index:
        index = {}
        for tag, mode_s, oid, stage, raw in _LS_STAGE.findall(listing):
            # a conflict keeps its last stage
            index[prefix + agent.dec(raw)] = (tag, int(mode_s, 8), oid.decode(), int(stage))
    others, nested = [], []
    for path in _split_z(others_b):
        if path.endswith("/"):
            nested.append(prefix + path.rstrip("/"))
        else:
            others.append(prefix + path)
    modified = {prefix + p for p in _split_z(modified_b)}
    return _Repo(prefix, git_dir, sig, config, modified, others, nested, index)


LARGE_FLOOR = 1_000_000  # files this big are remembered, so the size check needs no parse


def _ancestors(paths: Iterable[str]) -> set[str]:
    """Every folder holding one of ``paths`` at any depth ("" for the top)."""
    parents = {p.rpartition("/")[0] for p in paths}
    out = {""}
    for d in parents:
        while d and d not in out:
            out.add(d)
            d = d.rpartition("/")[0]
    return out


def _rvignore_sig(root: Path, dirs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The .rvignore files in these folders, with a hash of each one's content."""
    out = []
    for d in dirs:
        f = os.path.join(root, d, ".rvignore")
        try:
            with open(f, "rb") as fh:
                out.append((d, hashlib.sha1(fh.read()).hexdigest()))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            continue
    return tuple(sorted(out))


class _Hasher:
    """Hashes files, reusing ids from the last listing while the files' stat data is unchanged.

    ``before`` is the last listing's ``hashed``: path -> [index ids, stat key, stamp, result].
    ``hashed`` collects what the next listing may reuse: path -> (stat key, stamp, result), where
    the stamp is when hashing began (see rv.treecache.RACY_NS for when an id can be reused).
    """

    def __init__(self, root: Path, before: dict[str, Any]) -> None:
        self.root = root
        self.before = before
        self.hashed: dict[str, tuple[Any, int, Any]] = {}

    def one(self, path: str) -> tuple[int, str, int] | None:
        from rv import treecache

        full = os.path.join(self.root, path)
        stamp = treecache.now_ns()
        try:
            st = os.lstat(full)
        except (FileNotFoundError, NotADirectoryError):
            return None
        key = treecache.stat_key(st)
        hit = self.before.get(path)  # [index ids, stat key, stamp, result]
        if hit is not None and treecache.trusted(hit[1], hit[2], key):
            result: tuple[int, str, int] | None = hit[3]
        else:
            got = hash_path(full)
            result = None if got is None else got[:3]
        self.hashed[path] = (key, stamp, result)
        return result

    def many(self, paths: list[str]) -> dict[str, tuple[int, str, int] | None]:
        if len(paths) < 16:
            return {p: self.one(p) for p in paths}
        # hashlib releases the GIL on large buffers, so threads do help on a first snapshot.
        return dict(zip(paths, _map(self.one, paths, min(8, os.cpu_count() or 2)), strict=True))


def _skipped(path: str) -> bool:
    return ".git" in path.split("/")


def scan_tree(
    path: str | Path = ".",
    *,
    git: Git | None = None,
    cache: TreeCache | None = None,
    with_mtimes: bool = False,
) -> LocalTree:
    """List and hash what a snapshot of ``path``'s repository (or plain folder) would hold.

    With a ``cache`` (rv.treecache.TreeCache: a folder, or memory as `rv sync watch` keeps), the last
    listing of the repo is reused: while git's index is the one it was made from, only the files git
    reports as modified, untracked files, and those it listed last time are looked at again, and
    files are hashed only when their stat data changed. ``with_mtimes`` adds each file's mtime (push
    compares them with the remote copy's).
    """
    git = git or Git()
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise NotFound(f"no such folder: {path}")
    found = find_repo(folder, git)
    tree = _scan_plain(folder, git) if found is None else _Scan(found[0], found[1], git, cache).run()
    if with_mtimes:
        tree = _with_mtimes(tree)
    return tree


def _with_mtimes(tree: LocalTree) -> LocalTree:
    mtimes = {}
    for e in tree.entries:
        with contextlib.suppress(OSError):
            mtimes[e.path] = os.lstat(os.path.join(tree.root, e.path)).st_mtime_ns
    return replace(tree, mtimes=mtimes)


def _scan_plain(folder: Path, git: Git) -> LocalTree:
    """A folder outside any repository: everything minus .rvignore, nested repos by their own rules."""
    warnings = [
        f"{folder} is not in a git repository: taking every file under it except what .rvignore "
        "excludes (inside a repo, .gitignore is honoured too)"
    ]
    files, nested, left_out = _list_plain(folder, git)
    rows: dict[str, tuple[int, str, int]] = {}
    hasher = _Hasher(folder, {})
    for p, got in hasher.many([p for p in files if not _skipped(p)]).items():
        if got is not None:
            rows[p] = got
        elif os.path.lexists(os.path.join(folder, p)) and not os.path.isdir(os.path.join(folder, p)):
            warnings.append(f"left out {p}: not a regular file or symlink")
    for sub in nested:
        git_dir = os.fsdecode(git.out(["rev-parse", "--absolute-git-dir"], folder / sub).strip())
        inner = _Scan(folder / sub, git_dir, git, None).run()
        warnings.extend(inner.warnings)
        for e in inner.entries:
            rows[f"{sub}/{e.path}"] = (e.mode, e.oid, e.size)
    ignored = tuple((p, -1 if p.endswith("/") else _size_of(folder / p)) for p in left_out)
    entries = [Entry(p, m, o, s) for p, (m, o, s) in rows.items()]
    return LocalTree.of(folder, entries, ignored=ignored, warnings=tuple(warnings))


def _size_of(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _large(rows: Iterable[list[Any]]) -> tuple[tuple[str, int], ...]:
    return tuple((r[0], r[3]) for r in rows if r[3] >= LARGE_FLOOR)


def _left_out(root: Path, path: str) -> str | None:
    """The warning for a path that exists but is neither a regular file nor a symlink."""
    full = os.path.join(root, path)
    if os.path.lexists(full) and not os.path.isdir(full):
        return f"left out {path}: not a regular file or symlink"
    return None


def _in_top(paths: Iterable[str], nested: Iterable[str]) -> list[str]:
    """The paths that belong to the top repository, not to one of the ``nested`` ones."""
    prefixes = tuple(n + "/" for n in nested)
    return [p for p in paths if not (prefixes and p.startswith(prefixes))]


def _top_links(top: _Repo) -> list[str]:
    assert top.index is not None
    return [p for p, v in top.index.items() if v[1] == MODE_GITLINK]


class _HeadQuestions:
    """HEAD's commit and branch, and whether what is staged differs from it, asked while listing."""

    def __init__(self, top: Path, git: Git, *, eager: bool) -> None:
        self.top, self.git = top, git
        ok = (0, 1, 128)
        self.head = _Soon(git.run, ["rev-parse", "-q", "--verify", "HEAD^{commit}"], top, ok_codes=ok)
        self.ref = _Soon(git.run, ["symbolic-ref", "-q", "--short", "HEAD"], top, ok_codes=ok)
        # After a change of the index the staged question is asked at once; otherwise the answer
        # kept with the index signature and commit usually stands, and asking would only cost CPU.
        self.staged = _Soon(self._staged) if eager else None

    def _staged(self) -> list[str]:
        proc = self.git.run(
            ["diff-index", "--cached", "--name-only", "-z", "HEAD", "--"], self.top, ok_codes=(0, 128)
        )
        return _split_z(proc.stdout) if proc.returncode == 0 else []

    def finish(
        self, top: _Repo, before: Any, changed: list[str], untracked: tuple[str, ...], submodules: list[str]
    ) -> tuple[RepoInfo, Any]:
        """The RepoInfo; ``changed``: the top repo's tracked paths whose work tree differs from the index."""
        h, r = self.head.result(), self.ref.result()
        commit = h.stdout.decode().strip() if h.returncode == 0 else None
        branch = r.stdout.decode("utf-8", "replace").strip() if r.returncode == 0 else None
        key = [commit, top.sig]
        staged: list[str] | None  # paths staged with content other than HEAD's; None: unknown
        if top.sig is not None and before is not None and before[0] == key:
            staged = before[1]
        elif commit is None:
            # Without a commit everything staged is new.
            staged = (
                None if top.sig != ("no index",) and self.git.out(["ls-files", "-z"], self.top)[:1] else []
            )
        else:
            staged = self.staged.result() if self.staged is not None else self._staged()
        url = redact_url(top.config.get("remote.origin.url"))
        dirty = bool(changed) or staged is None or bool(staged) or bool(untracked)
        paths = None if staged is None else tuple(sorted({*changed, *staged, *submodules}))
        info = RepoInfo(
            self.top, Path(top.git_dir), commit, branch, url, dirty, untracked, paths, tuple(submodules)
        )
        return info, [key, staged]


class _Scan:
    """One listing of a repository and everything inside it (submodules, nested repositories).

    The cache state it keeps (rv.treecache) per repository: ``repos`` (each one's folder, git folder,
    index signature and config), ``structure`` (submodules and nested repos, checked out or not),
    ``attrs`` and ``rvignore`` (what decides conversions and .rvignore exclusions), ``dirs`` (every
    folder holding a listed file), ``fixed`` (tracked files always hashed: links, conflicts,
    assume-unchanged, converted by attributes; with their index ids), ``hashed`` (every file hashed:
    index ids, stat key, stamp, result), ``untracked``, ``excluded`` (by .rvignore, with index ids),
    ``staged``, ``warnings`` (about submodules), and the manifest's ``sid``, ``files``, ``bytes``
    and ``large``.
    """

    def __init__(self, top: Path, git_dir: str, git: Git, cache: TreeCache | None) -> None:
        self.top = top
        self.git_dir = git_dir
        self.git = git
        self.cache = cache
        self.state = cache.state(top) if cache is not None else None

    def run(self) -> LocalTree:
        tree = None
        if self.state is not None:
            tree = self._fast(_HeadQuestions(self.top, self.git, eager=False))
        if tree is None:
            tree = self._full(_HeadQuestions(self.top, self.git, eager=True))
        return tree

    # -- every repository, from scratch -------------------------------------------------------------
    def _repos(self) -> tuple[list[_Repo], list[tuple[str, bool]], list[str]]:
        repos, structure, warnings = [], [], []
        pending: list[tuple[str, str | None]] = [("", self.git_dir)]
        while pending:
            prefix, git_dir = pending.pop(0)
            repo = _ask_repo(self.top, prefix, self.git, git_dir, with_index=True)
            repos.append(repo)
            assert repo.index is not None
            gitlinks = [p for p, (_t, mode, _o, _s) in repo.index.items() if mode == MODE_GITLINK]
            for sub in gitlinks + repo.nested:
                present = (self.top / sub / ".git").exists()
                structure.append((sub, present))
                if present:
                    pending.append((sub + "/", None))
                else:
                    warnings.append(
                        f"submodule {sub} is not checked out, so none of its files are included "
                        "(run `git submodule update --init`)"
                    )
        return repos, structure, warnings

    def _attrs(self, repos: list[_Repo], applies: list[str]) -> Any:
        """What, besides the index and config, decides which files attributes keep from trust."""
        files = [[_file_sig(f) for f in _attribute_files(r.git_dir, r.config)] for r in repos]
        return [applies, files]

    def _full(self, head: _HeadQuestions) -> LocalTree:
        repos, structure, struct_warnings = self._repos()
        index_ids: dict[str, Any] = {}  # tracked path -> [mode, oid], or [] when conflicted
        trusted: set[str] = set()  # clean by git's stat check: the index's id stands
        fixed: set[str] = set()
        to_hash: set[str] = set()
        untracked: list[str] = []
        applies: list[str] = []
        for repo in repos:
            assert repo.index is not None
            entries = {p: v for p, v in repo.index.items() if v[1] != MODE_GITLINK}
            # "H" is a plain cached entry; lowercase (assume-unchanged), "S" (skip-worktree) and
            # conflicts mean git's stat check does not vouch for the working tree: hashed here, as
            # are symlinks and files attributes may convert on checkout.
            plain = {p for p, (tag, mode, _o, stage) in entries.items()
                     if stage == 0 and tag == b"H" and mode != MODE_LINK}  # fmt: skip
            where = self.top / repo.prefix if repo.prefix else self.top
            if _attribute_sources(where, repo.git_dir, [*entries, *repo.others], repo.config):
                n = len(repo.prefix)
                rel = _untrusted_by_attributes(where, [p[n:] for p in plain], self.git, repo.config)
                plain -= {repo.prefix + p for p in rel}
                applies.append(repo.prefix)
            for p, (_tag, mode, oid, stage) in entries.items():
                index_ids[p] = [mode, oid] if stage == 0 else []
                if p not in plain:
                    fixed.add(p)
                    to_hash.add(p)
                elif p in repo.modified:
                    to_hash.add(p)
                else:
                    trusted.add(p)
            to_hash.update(repo.others)
            untracked.extend(repo.others)
        candidates = [p for p in (*trusted, *to_hash) if not _skipped(p)]
        dirs = _ancestors(candidates)
        rvignore = _rvignore_sig(self.top, dirs)
        excluded = ignored_paths(self.top, candidates, self.git) if rvignore else set()
        hasher = _Hasher(self.top, (self.state or {}).get("hashed", {}))
        results = hasher.many([p for p in candidates if p not in trusted and p not in excluded])
        rows, warnings = [], list(struct_warnings)
        for p in candidates:
            if p in excluded:
                continue
            if p in trusted:
                try:
                    st = os.lstat(os.path.join(self.top, p))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                if stat.S_ISREG(st.st_mode):
                    rows.append(
                        [
                            p,
                            MODE_EXEC if st.st_mode & stat.S_IXUSR else MODE_FILE,
                            index_ids[p][1],
                            st.st_size,
                        ]
                    )
                    continue
                results[p] = hasher.one(p)  # changed type without git noticing yet: hash it
            got = results[p]
            if got is None:
                why = _left_out(self.top, p)
                if why:
                    warnings.append(why)
                continue
            rows.append([p, *got])
        present = {r[0]: [r[1], r[2]] for r in rows}
        # Dirty: the snapshot differs from what is staged (an included file whose content or mode is
        # not the index's: a touched but unchanged file is clean; an included untracked file; a
        # tracked file deleted and not .rvignored), or what is staged differs from HEAD.
        changed = [p for p in to_hash if index_ids.get(p) and present.get(p) != index_ids[p]
                   and p not in excluded and not _skipped(p)]  # fmt: skip
        included = tuple(sorted(p for p in untracked if p in present))
        submodules = [s for s, _ in structure]
        links = _top_links(repos[0])
        info, staged = head.finish(repos[0], None, _in_top(changed, submodules), included, links)
        state = {
            "repos": [[r.prefix, r.git_dir, r.sig, sorted(r.config.items())] for r in repos],
            "structure": structure,
            "attrs": self._attrs(repos, applies),
            "rvignore": rvignore,
            "dirs": dirs,
            "fixed": {p: index_ids[p] for p in fixed},
            "hashed": {p: [index_ids.get(p), *v] for p, v in hasher.hashed.items()},
            "untracked": set(untracked),
            "excluded": {p: index_ids.get(p) for p in excluded},
            "warnings": struct_warnings,
            "staged": staged,
            "links": links,
        }
        text = agent.manifest_text(rows)
        return self._finish(text, None, _large(rows), len(rows), sum(r[3] for r in rows), excluded,
                            warnings, info, state, None)  # fmt: skip

    # -- the last listing, updated by what git reports now -----------------------------------------
    def _fast(self, head: _HeadQuestions) -> LocalTree | None:
        """None when the last listing cannot be reused (index, config, ignore rules... changed)."""
        state = self.state
        assert state is not None and self.cache is not None
        if not state["repos"] or state["repos"][0][:2] != ["", self.git_dir]:
            return None
        old_text = self.cache.text(state["sid"])
        if old_text is None:
            return None
        repos = _map(lambda r: _ask_repo(self.top, r[0], self.git, r[1], False), state["repos"], 4)
        for repo, (_prefix, _gd, sig, config) in zip(repos, state["repos"], strict=True):
            if sig is None or repo.sig != sig or sorted(repo.config.items()) != config:
                return None
            if repo.config.get("core.filemode", "true").lower() in ("false", "0", "no", "off"):
                return None  # git ignores the executable bit here: every file's is read instead
        # The same submodules and nested repositories, each checked out or not as before.
        structure = [list(s) for s in state["structure"]]
        nested_now = {s for r in repos for s in r.nested}
        gitlinks = {s for s, _ in structure} - nested_now
        if [s for s, _ in structure if s not in gitlinks] != [
            s for s in (n for r in repos for n in r.nested)
        ]:
            return None
        if any((self.top / s / ".git").exists() != present for s, present in structure):
            return None
        modified = set().union(*(r.modified for r in repos))
        untracked = {p for r in repos for p in r.others}
        applies = state["attrs"][0]
        if self._attrs(repos, applies) != state["attrs"]:
            return None
        if any(_is_attributes(p) for p in untracked) or (
            applies and any(_is_attributes(p) for p in modified)
        ):
            return None  # an uncommitted .gitattributes: which files convert may have changed
        new_untracked = [p for p in untracked if p not in state["untracked"] and not _skipped(p)]
        dirs = set(state["dirs"]) | _ancestors(new_untracked)
        rvignore = _rvignore_sig(self.top, dirs)
        if rvignore != state["rvignore"]:
            return None
        excluded = {p: ids for p, ids in state["excluded"].items() if ids is not None or p in untracked}
        if rvignore and new_untracked:
            for p in ignored_paths(self.top, new_untracked, self.git):
                excluded[p] = None
        # Had this listing run from scratch, only these paths could differ from the last one.
        fixed, before = state["fixed"], state["hashed"]
        look = {p for p in (*before, *modified, *untracked, *fixed) if p not in excluded and not _skipped(p)}
        index_of: dict[str, Any] = {}
        for p in look:
            if p in fixed:
                index_of[p] = fixed[p]
            elif p in before:
                index_of[p] = before[p][0]
            elif p in untracked:
                index_of[p] = None
            else:
                # Modified just now: last time git vouched for it, so its row held the index's id.
                row = agent.row_at(old_text, p)
                if row is None:
                    return None
                index_of[p] = [row[1], row[2]]
        hasher = _Hasher(self.top, before)
        listed = {p for p in look if p in modified or p in untracked or p in fixed}
        results: dict[str, Any] = hasher.many(list(listed))
        for p in look:
            if p in results:
                continue
            ids = index_of[p]
            if not ids:
                results[p] = None  # untracked before, not listed now: gone, or ignored now
                continue
            listed.add(p)
            # Modified before and clean now: git vouches for it again.
            try:
                st = os.lstat(os.path.join(self.top, p))
            except (FileNotFoundError, NotADirectoryError):
                results[p] = None
                continue
            results[p] = (ids[0], ids[1], st.st_size) if stat.S_ISREG(st.st_mode) else hasher.one(p)
        warnings = list(state["warnings"])
        changes: dict[str, list[Any] | None] = {}
        for p in sorted(look):
            got = results[p]
            if got is None and p in listed:
                why = _left_out(self.top, p)
                if why:
                    warnings.append(why)
            changes[p] = None if got is None else [p, *got]
        text, old_rows = agent.splice(old_text, changes) if changes else (old_text, {})
        changes = {p: r for p, r in changes.items() if r != old_rows[p]}
        if not changes:
            text = old_text
        files = state["files"] + sum((r is not None) - (old_rows[p] is not None) for p, r in changes.items())
        total = state["bytes"] + sum(
            (r[3] if r is not None else 0) - (old_rows[p][3] if old_rows[p] is not None else 0)
            for p, r in changes.items()
        )
        large = dict(state["large"])
        for p, r in changes.items():
            large.pop(p, None)
            if r is not None and r[3] >= LARGE_FLOOR:
                large[p] = r[3]
        changed = [
            p
            for p in look
            if index_of[p] and (results[p] is None or list(results[p][:2]) != list(index_of[p]))
        ]
        included = tuple(sorted(p for p in untracked if results.get(p) is not None))
        submodules = [s for s, _ in structure]
        info, staged = head.finish(
            repos[0], state["staged"], _in_top(changed, submodules), included, state["links"]
        )
        new_state = dict(
            state, rvignore=rvignore, dirs=dirs, untracked=untracked, excluded=excluded, staged=staged,
            hashed={p: [index_of.get(p), *v] for p, v in hasher.hashed.items()},
        )  # fmt: skip
        sid = None if changes else state["sid"]
        large_rows = tuple(sorted(large.items()))
        return self._finish(text, sid, large_rows, files, total, set(excluded), warnings, info, new_state,
                            (state["sid"], changes))  # fmt: skip

    def _finish(
        self,
        text: bytes,
        sid: str | None,
        large: tuple[tuple[str, int], ...],
        files: int,
        total: int,
        excluded: set[str],
        warnings: list[str],
        info: RepoInfo,
        state: dict[str, Any],
        previous: tuple[str, dict[str, Any]] | None,
    ) -> LocalTree:
        ignored = tuple((p, _size_of(self.top / p)) for p in sorted(excluded))
        tree = LocalTree(
            self.top, text, files, total, large, ignored, tuple(warnings), info, previous=previous
        )
        if sid is not None:
            tree.__dict__["id"] = sid  # known already: the text is the one listed last time
        if self.cache is not None:
            self.cache.put_text(tree.id, text)
            self.cache.put_state(self.top, dict(state, sid=tree.id, files=files, bytes=total, large=large))
        return tree


# --------------------------------------------------------------------------------------------------
# Project key and provenance

_URL_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<userinfo>[^@/?#]*)@")


def redact_url(url: str | None) -> str | None:
    """A remote URL without the credentials it may carry, fit to record and print.

    ``https://user:token@host/x`` -> ``https://host/x`` (over http(s) the user part alone can be a
    token, e.g. ``https://ghp_...@github.com``); ``ssh://user:password@host/x`` ->
    ``ssh://user@host/x`` (an ssh user name is not a secret, the password is). ``git@host:x`` has
    no password and stays as it is.
    """
    if not url:
        return url
    m = _URL_USERINFO.match(url)
    if not m:
        return url
    scheme, userinfo = m.group("scheme"), m.group("userinfo")
    rest = url[m.end() :]
    if scheme.lower() in ("http", "https", "ftp", "ftps"):
        return f"{scheme}://{rest}"
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}@{rest}" if user else f"{scheme}://{rest}"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "project"


def project_key(tree: LocalTree, git: Git | None = None, cache_dir: Path | None = None) -> str:
    """``<folder>-<first 10 hex of the root commit>``: unique to the repo, not to its folder name.

    The root commit is the one reached by first parents from HEAD, so merging another history in
    does not change it. Without a commit (or a repo): a hash of the absolute path instead.
    """
    git = git or Git()
    name = _slug(tree.root.name)
    if tree.repo is not None and tree.repo.commit:
        root_commit = _root_commit(tree.repo, git, cache_dir)
        if root_commit:
            return f"{name}-{root_commit[:10]}"
    return f"{name}-{hashlib.sha256(os.fsencode(tree.root)).hexdigest()[:10]}"


def _root_commit(repo: RepoInfo, git: Git, cache_dir: Path | None) -> str | None:
    cache = cache_dir / "root-commits.json" if cache_dir else None
    known: dict[str, str] = {}
    if cache and cache.exists():
        with contextlib.suppress(ValueError, OSError):
            known = json.loads(cache.read_text())
        hit = known.get(str(repo.git_dir))
        # Walking a long history is slow; a cached answer is checked with one cheap lookup.
        if (
            hit
            and git.run(["cat-file", "-e", hit + "^{commit}"], repo.top, ok_codes=(0, 1, 128)).returncode == 0
        ):
            return hit
    out = git.out(["rev-list", "--first-parent", "--max-parents=0", "HEAD"], repo.top).split()
    if not out:
        return None
    root = out[-1].decode()
    if cache:
        known[str(repo.git_dir)] = root
        with contextlib.suppress(OSError):
            cache.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(cache, json.dumps(known).encode())
    return root


def provenance(
    tree: LocalTree,
    project: str,
    subdir: str,
    git: Git | None = None,
    *,
    with_diff: bool = True,
    cache: TreeCache | None = None,
) -> dict[str, Any]:
    """Where a snapshot came from: stored beside it on the cluster and in the job record.

    ``with_diff=False`` leaves the dirty tree's diff out (``diff`` is then None): it is only needed
    when the snapshot is new, so a resubmit does not pay for ``git diff``. With a ``cache``, the
    diff's part for a file is made again only when the file or HEAD changed (see diff_head).
    """
    import getpass
    import socket

    git = git or Git()
    repo = tree.repo
    prov: dict[str, Any] = {
        "project": project,
        "path": str(tree.root),
        "subdir": subdir,
        "host": socket.gethostname(),
        "user": getpass.getuser(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rv_version": __version__,
        "repo": None,
        "remote_url": None,
        "branch": None,
        "commit": None,
        "dirty": None,
        "diff": "",
        "diff_truncated": False,
        "untracked": [],
    }
    if repo is None:
        return prov
    prov.update(
        repo=str(repo.top),
        remote_url=repo.remote_url,
        branch=repo.branch,
        commit=repo.commit,
        dirty=repo.dirty,
    )
    prov["untracked"] = list(repo.untracked[:1000])
    if not with_diff:
        prov["diff"] = None
    elif repo.dirty and repo.commit:
        diff = diff_head(tree, git, cache)
        prov["diff_truncated"] = len(diff) > DIFF_LIMIT
        prov["diff"] = diff[:DIFF_LIMIT].decode("utf-8", "replace")
    return prov


# `git diff HEAD` for the provenance, without rename detection (so that each file's part depends on
# that file alone) and with the prefixes fixed (a user's diff.noprefix must not change the format).
_DIFF = [
    "-c", "core.quotePath=true", "diff", "HEAD", "--no-color", "--no-ext-diff", "--no-textconv",
    "--submodule=short", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/",
]  # fmt: skip
_DIFF_PATHS_MAX = 500  # more changed paths than this: one diff of everything, no pathspec list


def diff_head(tree: LocalTree, git: Git, cache: TreeCache | None = None) -> bytes:
    """What ``git diff HEAD`` shows for the tree's repository, made from cached parts where it can.

    The part of a file depends only on HEAD's commit and the file's content and mode (renames are
    not detected), so with a cache only files changed since the last diff are diffed again: a resubmit
    after one edit diffs one file, however many others are dirty.
    """
    repo = tree.repo
    assert repo is not None and repo.commit is not None
    changed = repo.changed
    if changed == ():
        return b""
    if changed is None or len(changed) > _DIFF_PATHS_MAX:
        return git.out(_DIFF, repo.top)
    literal = {"GIT_LITERAL_PATHSPECS": "1"}
    if cache is None:
        return git.out([*_DIFF, "--", *changed], repo.top, env=literal)
    kept = cache.diffs(repo.top)
    files = kept["files"] if kept.get("head") == repo.commit else {}
    subs = set(repo.submodules)
    keys = {p: agent.row_at(tree.manifest, p) for p in changed if p not in subs}
    todo = [p for p in changed if p in subs or p not in files or files[p][0] != keys[p]]
    fresh = _diff_parts(git.out([*_DIFF, "--", *todo], repo.top, env=literal)) if todo else {}
    if fresh is None:  # a header this code cannot read: the plain diff, nothing kept
        return git.out([*_DIFF, "--", *changed], repo.top, env=literal)
    parts = {p: fresh.get(p, b"") if p in todo else files[p][1] for p in changed}
    cache.put_diffs(repo.top, {"head": repo.commit, "files": {p: [keys[p], parts[p]] for p in keys}})
    return b"".join(parts[p] for p in sorted(parts, key=agent.enc))


_C_ESCAPES = {ord("a"): 7, ord("b"): 8, ord("t"): 9, ord("n"): 10, ord("v"): 11, ord("f"): 12, ord("r"): 13,
              ord('"'): 34, ord("\\"): 92}  # fmt: skip


def _c_unquote(data: bytes) -> bytes | None:
    """The first C-quoted string (as git writes unusual paths) of ``data``, which starts with '"'."""
    out, i = bytearray(), 1
    while i < len(data):
        c = data[i]
        if c == 34:
            return bytes(out)
        if c == 92 and i + 1 < len(data):
            n = data[i + 1]
            if n in _C_ESCAPES:
                out.append(_C_ESCAPES[n])
                i += 2
                continue
            if 48 <= n <= 55:
                out.append(int(data[i + 1 : i + 4], 8))
                i += 4
                continue
            return None
        out.append(c)
        i += 1
    return None


def _diff_parts(out: bytes) -> dict[str, bytes] | None:
    """``git diff --no-renames`` output split by file; None if a header cannot be read."""
    starts = [m.start() for m in re.finditer(rb"^diff --git ", out, re.M)]
    parts = {}
    for i, start in enumerate(starts):
        chunk = out[start : starts[i + 1] if i + 1 < len(starts) else len(out)]
        header = chunk.split(b"\n", 1)[0][len(b"diff --git ") :]
        if header.startswith(b'"'):
            a = _c_unquote(header)
            if a is None or not a.startswith(b"a/"):
                return None
            path = a[2:]
        else:
            # "a/<path> b/<path>", the same path twice (no renames)
            half = (len(header) - 5) // 2
            path = header[2 : 2 + half]
            if header[:2] != b"a/" or header[2 + half :] != b" b/" + path:
                return None
        parts[agent.dec(path)] = chunk
    return parts


# --------------------------------------------------------------------------------------------------
# Talking to the agent


# The cluster-side agent is one program made of these modules, in this order: each is compiled into a
# module of its own name there, so they import each other as they do here (the second adds its modes
# to the first's).
AGENT_MODULES = ("rv.remote_store", "rv.job.remote", "rv.pyenv.remote")


@functools.cache
def _agent_sources() -> tuple[tuple[tuple[str, str], ...], str]:
    """The agent's modules, compressed for the command line, and a key naming this version of them."""
    import importlib

    parts = []
    digest = hashlib.sha256()
    for name in AGENT_MODULES:
        source = Path(importlib.import_module(name).__file__ or "").read_bytes()
        digest.update(name.encode() + b"\0" + source)
        # Level 6: every command pays this; 9 takes three times as long for 1% less.
        parts.append((name, base64.b64encode(zlib.compress(source, 6)).decode("ascii")))
    return tuple(parts), digest.hexdigest()[:20]


def agent_key() -> str:
    """Names the agent's code: a pre-started agent serves only requests of the same code."""
    return _agent_sources()[1]


@functools.cache
def _agent_bootstrap(hot: bool = False) -> str:
    """The ``python3 -c`` program that runs the agent: its modules travel compressed on every call.

    Decompressing and compiling them costs the cluster ~60 ms a call, more than most modes' work,
    so the compiled code is kept in ``${XDG_CACHE_HOME:-~/.cache}/rv/agent/`` on the cluster (0700),
    named by a hash of the sources and the interpreter's cache tag: later calls read it with marshal
    (~1 ms). A missing, damaged or foreign file is simply recompiled and rewritten; nothing else is
    ever read from there.

    ``hot``: the mode and arguments come on stdin (see agent_request) instead of the command line,
    so the program can be started, its modules loaded, before anyone knows what it will be asked.
    """
    parts, key = _agent_sources()
    if hot:
        run = (
            "import json,struct\nH=sys.stdin.buffer;b=H.read(4)\n"
            "if len(b)<4:sys.exit(0)\n"  # closed before it was asked anything
            "M,A=json.loads(H.read(struct.unpack('>I',b)[0]).decode())\n"
            "sys.exit(sys.modules['rv.remote_store'].main(['-c',M,A]))"
        )
    else:
        run = "sys.exit(sys.modules['rv.remote_store'].main(sys.argv))"
    return (
        "import base64,marshal,os,sys,types,zlib\n"
        f"P={list(parts)!r}\n"
        f"for p in {_agent_packages()!r}:\n m=types.ModuleType(p);m.__path__=[];sys.modules[p]=m\n"
        "d=os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'),'rv','agent')\n"
        f"f=os.path.join(d,{key!r}+'-'+sys.implementation.cache_tag+'.bin')\n"
        "try:\n"
        " with open(f,'rb') as h:C=marshal.load(h)\n"
        " assert len(C)==len(P)\n"
        # A cache, so any failure to read it means: compile from the sources sent along.
        "except Exception:\n"
        " C=[compile(zlib.decompress(base64.b64decode(s)),n,'exec') for n,s in P]\n"
        " try:\n"
        "  os.makedirs(d,0o700,exist_ok=True);t='%s.%d'%(f,os.getpid())\n"
        "  with open(t,'wb') as h:marshal.dump(C,h)\n"
        "  os.chmod(t,0o600);os.replace(t,f)\n"
        " except OSError:pass\n"
        "for (n,_),c in zip(P,C):\n"
        " m=types.ModuleType(n);sys.modules[n]=m;p,_,a=n.rpartition('.');setattr(sys.modules[p],a,m)\n"
        " exec(c,m.__dict__)\n" + run
    )


def _agent_packages() -> tuple[str, ...]:
    """The packages the agent's modules live in, made empty for them (parents first)."""
    names = {name.rsplit(".", i)[0] for name in AGENT_MODULES for i in range(1, name.count(".") + 1)}
    return tuple(sorted(names, key=lambda n: (n.count("."), n)))


def agent_command(mode: str, args: dict[str, Any]) -> str:
    """The shell line that runs :mod:`rv.remote_store` on the cluster (isolated mode, no site).

    The system's /usr/bin/python3 is preferred over whatever ``python3`` is first on PATH: pyenv and
    conda shims there cost 50-150 ms per call (on the loopback cluster, more than the work itself),
    and a user's broken environment cannot break syncing. The agent needs the stdlib only.
    """
    program = " ".join(
        ["-I", "-S", "-c", shlex.quote(_agent_bootstrap()), shlex.quote(mode), shlex.quote(json.dumps(args))]
    )
    return f'p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" {program}'


def hot_agent_command() -> str:
    """The shell line of an agent started ahead of time: it waits for agent_request on stdin."""
    program = shlex.quote(_agent_bootstrap(True))
    return f'p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" -I -S -c {program}'


def agent_request(mode: str, args: dict[str, Any]) -> bytes:
    """What a pre-started agent reads first: the mode and arguments agent_command would pass."""
    data = json.dumps([mode, json.dumps(args)]).encode()
    return struct.pack(">I", len(data)) + data


def frame(obj: Any) -> bytes:
    data = zlib.compress(json.dumps(obj, ensure_ascii=True).encode("ascii"), 6)
    return struct.pack(">I", len(data)) + data


_AGENT_ERRORS: dict[str, type[RvError]] = {"usage": UsageError, "not-found": NotFound, "live": UsageError}


def call_agent(
    transport: Any, mode: str, args: dict[str, Any], *, stdin: Any = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run one agent mode and return its reply; failures become rv errors with the remote's words.

    A transport that keeps an agent started ahead of time (the warm connection) is asked through
    ``run_agent``: the agent's start-up is then off the command's path.
    """
    run_agent = getattr(transport, "run_agent", None)
    if run_agent is not None:
        res = run_agent(mode, args, stdin=stdin, timeout=timeout)
    else:
        res = transport.run(agent_command(mode, args), stdin=stdin, timeout=timeout)
    return agent_reply(mode, res.exit_code, res.stdout, res.err)


def agent_reply(mode: str, exit_code: int, stdout: bytes, stderr: bytes | str) -> dict[str, Any]:
    """The reply of one agent call, from its exit code and output; failures become rv errors."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", "replace")
    if exit_code == 127:
        raise RemoteCommandMissing(
            "python3 is not on the cluster's PATH (rv needs it, stdlib only, to sync files)",
            hint="add `module load python` (or similar) to the profile's setup, or ask the admins",
        )
    if exit_code != 0:
        tail = " / ".join(stderr.strip().splitlines()[-3:])
        raise RemoteError(f"remote {mode} failed (exit {exit_code}): {tail or 'no message'}")
    try:
        reply = json.loads(zlib.decompress(stdout))
    except (zlib.error, ValueError) as exc:
        raise RemoteError(
            f"remote {mode} sent an unreadable reply: {stdout[:120]!r}",
            hint="a login script that prints to stdout corrupts replies: make it quiet for non-interactive "
            "shells",
        ) from exc
    if isinstance(reply, dict) and "error" in reply:
        hint = None
        if reply.get("errno") in ("ENOSPC", "EDQUOT"):
            hint = "free space under the remote root: `rv sync gc` removes snapshots no job needs"
        elif reply.get("errno") in ("EACCES", "EPERM", "EROFS"):
            hint = "check the profile's remote_root is writable by you (`rv init` to change it)"
        raise _AGENT_ERRORS.get(reply.get("code", ""), RemoteError)(
            f"remote {mode}: {reply['error']}", hint=hint
        )
    if not isinstance(reply, dict):
        raise RemoteError(f"remote {mode} sent a reply that is not an object: {str(reply)[:120]}")
    return reply


# --------------------------------------------------------------------------------------------------
# The manifest on the wire: a delta against a snapshot the store is known to hold


def diff_manifests(old: bytes, new: bytes) -> tuple[list[list[Any]], list[str]]:
    """(rows new or changed, paths gone) from manifest ``old`` to ``new``: set operations in C."""
    a, b = set(old.split(b"\n")), set(new.split(b"\n"))
    upsert = [agent.parse_line(line) for line in b - a if line]
    have = {r[0] for r in upsert}
    remove = [p for p in (agent.parse_line(line)[0] for line in a - b if line) if p not in have]
    return upsert, remove


def manifest_payload(tree: LocalTree, known: Sequence[str], texts: TreeCache | None = None) -> dict[str, Any]:
    """The manifest to send: changes to a snapshot ``known`` to be in the store, else the full list.

    The changes since the last listing are at hand when that listing was sent to this store (the
    usual resubmit); otherwise they come from comparing with a known snapshot's cached manifest.
    The cluster checks the result against the snapshot id and asks for the full list on a mismatch.
    """
    if tree.id in known:
        return {"base": tree.id, "upsert": [], "remove": []}
    delta = None
    if tree.previous is not None and tree.previous[0] in known:
        changes = tree.previous[1]
        delta = (tree.previous[0], [r for r in changes.values() if r is not None],
                 [p for p, r in changes.items() if r is None])  # fmt: skip
    elif texts is not None:
        for sid in known:
            old = texts.text(sid)
            if old is not None:
                delta = (sid, *diff_manifests(old, tree.manifest))
                break
    if delta is not None and len(delta[1]) + len(delta[2]) < max(1, tree.files // 2):
        return {"base": delta[0], "upsert": delta[1], "remove": delta[2]}
    return {"entries": agent.manifest_rows(tree.manifest)}


def default_cache_dir() -> Path:
    from rv.config import cache_dir

    return cache_dir()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Snapshots


@dataclass(frozen=True)
class LocalSnapshot:
    """Everything about a snapshot that is known before touching the network."""

    tree: LocalTree
    id: str
    project: str
    subdir: str  # the folder asked for, relative to the repo top ("" when it is the top)
    provenance: dict[str, Any]  # without the diff: see provenance(with_diff=False)
    allowed_large: tuple[tuple[str, int], ...] = ()
    git: Git = field(default_factory=Git, compare=False, repr=False)
    texts: TreeCache | None = field(default=None, compare=False, repr=False)  # cached manifests

    @property
    def branch(self) -> str | None:
        return self.tree.repo.branch if self.tree.repo else None

    @property
    def commit(self) -> str | None:
        return self.tree.repo.commit if self.tree.repo else None

    @property
    def dirty(self) -> bool:
        return bool(self.tree.repo and self.tree.repo.dirty)


@dataclass(frozen=True)
class SnapshotResult:
    id: str
    remote_path: str  # <root>/snapshots/<id>: the read-only tree; <id>.layer for a layer (see base)
    meta_path: str  # <root>/snapshots/<id>.json: provenance (and a layer's rows)
    project: str
    branch: str | None
    commit: str | None
    dirty: bool
    subdir: str  # cd here inside the snapshot to be where `rv run` was typed
    summary: str
    files: int
    total_bytes: int
    new_objects: int
    new_bytes: int
    sent_bytes: int  # everything written to the connection (objects, framing, manifest)
    created: bool  # False: the identical tree was already there
    provenance: dict[str, Any]  # the diff of a dirty tree is in the meta file, not here
    warnings: tuple[str, ...] = ()
    base: str | None = None  # a layer: the full snapshot it sits on (jobs copy that, then the layer)
    ignored: tuple[tuple[str, int], ...] = ()  # what .rvignore left out: (path, size; -1 a folder)


def human_size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_sizes(tree: LocalTree, max_file_size: int, allow_large: bool) -> tuple[tuple[str, int], ...]:
    """Refuse files over the limit (naming them) unless allowed; return the large ones allowed."""
    if max_file_size >= LARGE_FLOOR:
        sizes: Iterable[tuple[str, int]] = tree.large  # every file that could be over: no parse
    else:
        sizes = ((e.path, e.size) for e in tree.entries if not e.is_link)
    large = sorted(((p, s) for p, s in sizes if s > max_file_size), key=lambda x: -x[1])
    if large and not allow_large:
        shown = ", ".join(f"{p} ({human_size(s)})" for p, s in large[:5])
        more = f" and {len(large) - 5} more" if len(large) > 5 else ""
        raise UsageError(
            f"{len(large)} file{'s' if len(large) > 1 else ''} over the {human_size(max_file_size)} limit: "
            f"{shown}{more}",
            hint="add them to .rvignore (gitignore syntax), or allow them with --allow-large "
            "(the limit is set with --max-file-size)",
        )
    return tuple(large)


def prepare_snapshot(
    path: str | Path = ".",
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    allow_large: bool = False,
    git: Git | None = None,
    cache_dir: Path | None = None,
) -> LocalSnapshot:
    """List, hash and check the snapshot of ``path``'s repo. Local only: run it before connecting.

    With ``cache_dir`` the last listing of the repo is reused (see scan_tree) and the root commit is
    remembered.
    """
    git = git or Git()
    texts = None
    if cache_dir is not None:
        from rv.treecache import TreeCache

        texts = TreeCache(cache_dir)
    tree = scan_tree(path, git=git, cache=texts)
    allowed = check_sizes(tree, max_file_size, allow_large)
    project = project_key(tree, git, cache_dir)
    here = Path(path).resolve()
    subdir = here.relative_to(tree.root).as_posix() if here != tree.root else ""
    prov = provenance(tree, project, subdir, git, with_diff=False)
    return LocalSnapshot(tree, tree.id, project, subdir, prov, allowed, git, texts)


def summary_line(snap: LocalSnapshot, new_objects: int | None, new_bytes: int, *, sent: bool = False) -> str:
    tree = snap.tree
    n = tree.files
    parts = [f"snapshot {snap.id[:12]}: {n:,} file{'s' if n != 1 else ''}, {human_size(tree.total_size)}"]
    if new_objects is None:
        parts.append("already on the cluster, nothing to send")
    else:
        objects = f"{new_objects:,} new object{'s' if new_objects != 1 else ''} ({human_size(new_bytes)})"
        parts.append(f"{objects} sent with the manifest" if sent else f"{objects} to send")
    files = [s for _, s in tree.ignored if s >= 0]
    folders = sum(1 for _, s in tree.ignored if s < 0)
    if tree.ignored:
        what = []
        if files:
            what.append(f"{len(files):,} file{'s' if len(files) != 1 else ''} ({human_size(sum(files))})")
        if folders:
            what.append(f"{folders:,} folder{'s' if folders != 1 else ''}")
        parts.append(".rvignore left out " + " and ".join(what))
    else:
        parts.append(".rvignore left out nothing")
    if snap.allowed_large:
        parts.append(f"{len(snap.allowed_large)} file(s) over the size limit allowed")
    return "; ".join(parts)


def _object_stream(
    root: Path,
    header: bytes,
    sends: list[Entry],
    progress: ProgressCounter | None,
    counter: list[int],
) -> Iterator[bytes]:
    """``header``, then ``O <oid> <size> <content>`` per object, then ``E``, in ~1 MiB chunks.

    Progress counts an object's bytes as they are handed to the connection.
    """
    buf = bytearray(header)
    for e in sends:
        buf += b"O" + bytes.fromhex(e.oid) + struct.pack(">Q", e.size)
        full = os.path.join(root, e.path)
        if e.is_link:
            data = os.fsencode(os.readlink(full)) if os.path.islink(full) else b""
            buf += data[: e.size].ljust(e.size, b"\0")
            if progress:
                progress.add(e.size)
        else:
            left = e.size
            try:
                fh = open(full, "rb")  # noqa: SIM115 (closed below; the generator may pause mid-file)
            except OSError:
                fh = None
            try:
                while left:
                    data = fh.read(min(_READ, left)) if fh else b""
                    if not data:
                        # Gone or shrunk since it was hashed: keep the frame's length; the cluster
                        # will find the id wrong and refuse the object.
                        data = b"\0" * min(_READ, left)
                    buf += data
                    left -= len(data)
                    if len(buf) >= _READ:
                        counter[0] += len(buf)
                        yield bytes(buf)
                        buf.clear()
                    if progress:
                        progress.add(len(data))
            finally:
                if fh:
                    fh.close()
        if progress:
            progress.add(files=1)
        if len(buf) >= _READ:
            counter[0] += len(buf)
            yield bytes(buf)
            buf.clear()
    buf += b"E"
    counter[0] += len(buf)
    yield bytes(buf)
    if progress:
        progress.done()


# New objects this small go with the first call, unasked: cheaper than a round trip to ask (the
# cluster reads past any it has already).
SPECULATE_BYTES = 1 << 20
SPECULATE_FILES = 64


def _speculative(payload: dict[str, Any]) -> list[Entry]:
    """The objects of a delta's new rows, when they are few and small (a full list asks first)."""
    rows = payload.get("upsert", [])
    by_oid = {r[2]: Entry(*r) for r in rows}
    if len(by_oid) > SPECULATE_FILES or sum(e.size for e in by_oid.values()) > SPECULATE_BYTES:
        return []
    return list(by_oid.values())


@dataclass
class _Shipping:
    """One upload's state across its calls (snap-put; rv.remote_store says what each reply means)."""

    transport: Any
    layout: RemoteLayout
    snap: LocalSnapshot
    store: StoreCache | None
    on_progress: Progress | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    sent: list[int] = field(default_factory=lambda: [0])
    stored_provenance: dict[str, Any] | None = None
    known: list[str] = field(default_factory=list)

    def first(self) -> tuple[bytes, list[Entry]]:
        """The first call's header and the objects that go with it unasked."""
        self.known = self.store.known(self.snap.project) if self.store else []
        self.payload = manifest_payload(self.snap.tree, self.known, self.snap.texts)
        header: dict[str, Any] = {"id": self.snap.id, **self.payload}
        if self.snap.id not in self.known:
            header["provenance"] = self.provenance()  # probably new: let it be built in this call
        return frame(header), _speculative(self.payload) if "provenance" in header else []

    def provenance(self) -> dict[str, Any]:
        if self.stored_provenance is None:
            snap = self.snap
            self.stored_provenance = provenance(
                snap.tree, snap.project, snap.subdir, snap.git, cache=snap.texts
            )
        return self.stored_provenance

    def stream(self, header: bytes, sends: list[Entry], progress: ProgressCounter | None) -> Iterator[bytes]:
        return _object_stream(self.snap.tree.root, header, sends, progress, self.sent)

    def call(self, sends: list[Entry], progress: ProgressCounter | None = None) -> dict[str, Any]:
        header = frame({"id": self.snap.id, **self.payload, "provenance": self.provenance()})
        return call_agent(
            self.transport, "snap-put", self.layout.agent_args(), stdin=self.stream(header, sends, progress)
        )


def upload_snapshot(
    transport: Any,
    layout: RemoteLayout,
    snap: LocalSnapshot,
    *,
    cache: StoreCache | None = None,
    on_summary: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
    _first: tuple[_Shipping, list[Entry], dict[str, Any]] | None = None,
) -> SnapshotResult:
    """Make ``snap`` exist on the cluster: one round trip when it does already or differs from a
    snapshot known to be there by a few small files (sent along unasked), two otherwise.

    ``cache`` (rv.treecache.StoreCache) remembers which snapshots the store holds: the manifest then
    travels as a delta against one of them. (``_first``: the shipping, the objects sent with its
    first call and that call's reply, when make_snapshot made it already.)
    """
    if _first is None:
        ship = _Shipping(transport, layout, snap, cache, on_progress)
        header, spec = ship.first()
        reply = call_agent(transport, "snap-put", layout.agent_args(), stdin=ship.stream(header, spec, None))
    else:
        ship, spec, reply = _first
    new_objects = new_bytes = 0
    summary = None
    for _attempt in range(4):
        new_objects += int(reply.get("received", 0))
        new_bytes += int(reply.get("received_bytes", 0))
        if reply.get("bad"):
            bad = set(reply["bad"])
            paths = sorted(e.path for e in spec if e.oid in bad) or sorted(reply["bad"])
            raise RemoteError(
                f"{len(paths)} file(s) changed while being sent: {', '.join(paths[:5])}",
                hint="rerun once they stop changing (or .rvignore files a running program writes)",
            )
        status = reply["status"]
        if status in ("exists", "created"):
            break
        if status == "need-full":
            # The base is gone from the store (rv gc) or is not what this machine remembers.
            if cache is not None and "base" in ship.payload:
                cache.forget(snap.project, ship.payload["base"])
            ship.payload = {"entries": agent.manifest_rows(snap.tree.manifest)}
            spec = []
            reply = ship.call([])
            continue
        missing = list(reply["missing"])
        rows = ship.payload.get("upsert", ship.payload.get("entries"))
        by_oid = {r[2]: r for r in rows or ()}
        if any(o not in by_oid for o in missing):
            by_oid = {r[2]: r for r in agent.manifest_rows(snap.tree.manifest)}
        by_oid = {o: Entry(*by_oid[o]) for o in missing}
        spec = [by_oid[o] for o in missing]
        if summary is None and on_summary:
            summary = summary_line(snap, new_objects + len(spec), new_bytes + sum(e.size for e in spec))
            on_summary(summary)
        progress = ProgressCounter(on_progress, "upload", len(spec), sum(e.size for e in spec))
        reply = ship.call(spec, progress)
    else:
        raise RemoteError(
            f"snapshot {snap.id} could not be completed on the cluster (objects kept disappearing)",
            hint="is `rv gc` running in a loop? retry in a minute",
        )
    created = status == "created"
    if summary is None:
        summary = summary_line(snap, new_objects if created else None, new_bytes, sent=True)
        if on_summary:
            on_summary(summary)
    if cache is not None:
        cache.add(snap.project, snap.id)
    base = reply.get("base")
    return SnapshotResult(
        id=snap.id,
        remote_path=layout.snapshot(snap.id) + (".layer" if base else ""),
        meta_path=layout.snapshot_meta(snap.id),
        project=snap.project,
        branch=snap.branch,
        commit=snap.commit,
        dirty=snap.dirty,
        subdir=snap.subdir,
        summary=summary,
        files=snap.tree.files,
        total_bytes=snap.tree.total_size,
        new_objects=new_objects,
        new_bytes=new_bytes,
        sent_bytes=ship.sent[0],
        created=created,
        provenance=snap.provenance,
        warnings=snap.tree.warnings,
        base=base,
        ignored=snap.tree.ignored,
    )


def make_snapshot(
    transport: Any,
    layout: RemoteLayout,
    path: str | Path = ".",
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    allow_large: bool = False,
    cache_dir: Path | None = None,
    cache_key: str | None = None,
    on_summary: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
    on_prepared: Callable[[LocalSnapshot], None] | None = None,
    git: Git | None = None,
) -> SnapshotResult:
    """List, hash, check and ship the snapshot of ``path``'s repo; ``cache_key`` names the store.

    The first remote command starts before the local listing, so the cluster's shell and python
    start-up (most of a round trip on many clusters) overlap with it: a resubmit with nothing or
    little changed costs about one round trip in all. Local errors (a file over the size limit) still
    win: the early command then reads an empty input and exits, with nothing sent. For a strict
    "check everything, then connect" order, call prepare_snapshot and upload_snapshot yourself.
    ``on_prepared`` sees the local snapshot (its warnings, say) before anything is sent.
    """
    store = None
    if cache_dir is not None:
        from rv.treecache import StoreCache

        store = StoreCache(cache_dir, cache_key or layout.root)
    ready = threading.Event()
    first: list[tuple[bytes, list[Entry]] | None] = []
    ship: _Shipping | None = None

    def first_stdin() -> Iterator[bytes]:
        ready.wait()
        if first[0] is not None:
            assert ship is not None
            yield from ship.stream(first[0][0], first[0][1], None)

    early = _Soon(call_agent, transport, "snap-put", layout.agent_args(), stdin=first_stdin())
    try:
        snap = prepare_snapshot(
            path, max_file_size=max_file_size, allow_large=allow_large, git=git, cache_dir=cache_dir
        )
        if on_prepared:
            on_prepared(snap)
        ship = _Shipping(transport, layout, snap, store, on_progress)
        header, spec = ship.first()
    except BaseException:
        first.append(None)  # the early command reads an empty stdin and exits
        ready.set()
        with contextlib.suppress(Exception):
            early.result()
        raise
    first.append((header, spec))
    ready.set()
    reply = early.result()
    return upload_snapshot(
        transport, layout, snap, cache=store, on_summary=on_summary, on_progress=on_progress,
        _first=(ship, spec, reply),
    )  # fmt: skip
