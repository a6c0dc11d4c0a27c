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
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv import __version__
from rv import remote_store as agent
from rv.errors import NotFound, RemoteCommandMissing, RemoteError, RvError, UsageError
from rv.layout import RemoteLayout
from rv.progress import Progress, ProgressCounter

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

# concurrent.futures, tempfile, socket and getpass are imported where they are used: `rv ps` imports
# this module for call_agent and should not pay ~20 ms for what only a snapshot needs.

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
    return str(agent.manifest_id([e.row() for e in sort_entries(entries)]))


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


@dataclass(frozen=True)
class LocalTree:
    """The files a snapshot or push would carry, relative to ``root``."""

    root: Path
    entries: tuple[Entry, ...]
    ignored: tuple[tuple[str, int], ...] = ()  # left out by .rvignore: (path, size; -1 for a folder)
    warnings: tuple[str, ...] = ()
    repo: RepoInfo | None = None

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.entries)

    def subtree(self, rel: str) -> LocalTree:
        """The part under ``rel`` (a folder inside root), with paths relative to it."""
        if rel in ("", "."):
            return self
        prefix = rel.rstrip("/") + "/"
        return replace(
            self,
            root=self.root / rel,
            entries=tuple(
                replace(e, path=e.path[len(prefix) :]) for e in self.entries if e.path.startswith(prefix)
            ),
            ignored=tuple((p[len(prefix) :], s) for p, s in self.ignored if p.startswith(prefix)),
        )


@dataclass
class _Candidates:
    trusted: dict[str, str] = field(default_factory=dict)  # path -> blob id from the index
    index_ids: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> (mode, oid), any stage 0
    hash: set[str] = field(default_factory=set)  # paths whose content must be hashed here
    untracked: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    top_config: dict[str, str] = field(default_factory=dict)  # of the outermost repo
    top_git_dir: str = ""


def find_repo_top(path: Path, git: Git) -> Path | None:
    """The work tree's top, or None outside any repository.

    When git refuses a repository that is there (``safe.directory`` ownership checks, a damaged
    ``.git``), that is an error, not "no repo": treating it as a plain folder would send every
    gitignored file.
    """
    proc = git.run(["rev-parse", "--show-toplevel"], path, ok_codes=(0, 128))
    if proc.returncode == 0:
        return Path(os.fsdecode(proc.stdout.rstrip(b"\n")))
    resolved = path.resolve()
    for folder in (resolved, *resolved.parents):
        if (folder / ".git").exists():
            tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise UsageError(
                f"git cannot read the repository at {folder}: {tail[-1] if tail else 'no message'}",
                hint="run `git status` there to see why (safe.directory, a damaged .git ...)",
            )
    return None


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
        ["config", "-z", "--get-regexp", r"^(core\.(autocrlf|eol|attributesfile)|remote\.origin\.url)$"],
        top,
        ok_codes=(0, 1),
    )
    values = {}
    for item in proc.stdout.split(b"\0"):
        if item:
            key, _, value = item.partition(b"\n")
            values[key.decode()] = value.decode("utf-8", "replace")
    return values


_LS_STAGE = re.compile(rb"([^ \0]+) ([0-7]{6}) ([0-9a-f]+) ([0-3])\t([^\0]*)\0")


def _attribute_sources(top: Path, git_dir: str, names: Iterable[str], config: dict[str, str]) -> bool:
    """Could any gitattributes apply here? Without any, check-attr (costly on big repos) is skipped."""
    if config.get("core.autocrlf", "false").lower() in ("true", "1", "yes", "on", "input"):
        return True
    if config.get("core.eol", "").lower() == "crlf":
        return True
    if any(n == ".gitattributes" or n.endswith("/.gitattributes") for n in names):
        return True
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    files = [
        os.path.join(git_dir, "info", "attributes"),
        os.path.expanduser(config.get("core.attributesfile", "")) or os.path.join(xdg, "git", "attributes"),
        "/etc/gitattributes",
        "/usr/local/etc/gitattributes",
    ]
    return any(os.path.isfile(f) for f in files)


def _list_repo(top: Path, prefix: str, git: Git, cand: _Candidates) -> None:
    """Add one repository's files (recursing into submodules and nested repos) to ``cand``."""
    # Independent questions, asked at once: git processes are the bulk of a no-change snapshot.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=5) as pool:
        staged_f = pool.submit(git.out, ["ls-files", "-z", "-s", "-v"], top)
        modified_f = pool.submit(git.out, ["diff-files", "-z", "--name-only", "--ignore-submodules=all"], top)
        others_f = pool.submit(git.out, ["ls-files", "-z", "-o", "--exclude-standard"], top)
        config_f = pool.submit(_git_config, top, git)
        git_dir_f = pool.submit(git.out, ["rev-parse", "--absolute-git-dir"], top)
        listing, modified_b, others_b = staged_f.result(), modified_f.result(), others_f.result()
        config, git_dir = config_f.result(), os.fsdecode(git_dir_f.result().strip())
    if not prefix:
        cand.top_config, cand.top_git_dir = config, git_dir
    index: dict[str, tuple[bytes, int, str, int]] = {}
    submodules = []
    for tag, mode_s, oid, stage, raw_path in _LS_STAGE.findall(listing):
        path = agent.dec(raw_path)
        mode = int(mode_s, 8)
        if mode == MODE_GITLINK:
            submodules.append(path)
            continue
        index[path] = (tag, mode, oid.decode(), int(stage))  # a conflict keeps its last stage
    modified = set(_split_z(modified_b))
    others = _split_z(others_b)
    # "H" is a plain cached entry; lowercase (assume-unchanged), "S" (skip-worktree) and conflicts
    # mean git's stat check does not vouch for the working tree: those are hashed here.
    plain = [
        p for p, (tag, mode, _oid, stage) in index.items()
        if stage == 0 and tag == b"H" and p not in modified and mode != MODE_LINK
    ]  # fmt: skip
    unsafe: set[str] = set()
    if _attribute_sources(top, git_dir, [*index, *others], config):
        unsafe = _untrusted_by_attributes(top, plain, git, config)
    trusted = set(plain) - unsafe
    for path, (_tag, mode, oid, stage) in index.items():
        full = prefix + path
        if stage == 0:
            cand.index_ids[full] = (mode, oid)
        if path in trusted:
            cand.trusted[full] = oid
        else:
            cand.hash.add(full)
    nested = []
    for path in others:
        if path.endswith("/"):
            nested.append(path.rstrip("/"))  # an untracked repository inside this one
        else:
            cand.hash.add(prefix + path)
            cand.untracked.append(prefix + path)
    for sub in submodules + nested:
        sub_top = top / sub
        if (sub_top / ".git").exists():
            _list_repo(sub_top, prefix + sub + "/", git, cand)
        else:
            cand.warnings.append(
                f"submodule {prefix + sub} is not checked out, so none of its files are included "
                "(run `git submodule update --init`)"
            )


def _list_plain(folder: Path, git: Git, cand: _Candidates) -> list[str]:
    """Every file under a folder that is not a repo, minus .rvignore. Returns what .rvignore left out."""
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
    for path in listed:
        if path.endswith("/"):
            _list_repo(folder / path, path, git, cand)
        else:
            cand.hash.add(path)
    return left_out


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
    paths = list(paths)
    if not paths:
        return set()
    empty = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    info = b"".join(b"100644 " + empty.encode() + b"\t" + agent.enc(p) + b"\0" for p in paths)
    rules = ["--exclude-standard"] if gitignore else ["--exclude-per-directory=.rvignore"]
    rules += [f"--exclude-from={f}" for f in exclude_from if f.is_file()]
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rv-ignore-") as tmp:
        env = _scratch_repo(Path(tmp), root, git)
        git.out(["update-index", "-z", "--index-info"], root, input=info, env=env)
        out = git.out(["ls-files", "-z", "-c", "-i", *rules], root, env=env)
    return set(_split_z(out))


HashCache = dict[str, tuple[tuple[int, int, int, int], tuple[int, str, int, int] | None]]


def scan_tree(
    path: str | Path = ".", *, git: Git | None = None, hash_cache: HashCache | None = None
) -> LocalTree:
    """List and hash what a snapshot of ``path``'s repository (or plain folder) would hold.

    ``hash_cache`` (a dict kept by the caller between calls, as `rv sync watch` does) skips hashing
    files whose size, mtime, ctime and inode are unchanged since the last call.
    """
    git = git or Git()
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise NotFound(f"no such folder: {path}")
    top = find_repo_top(folder, git)
    cand = _Candidates()
    warnings: list[str] = []
    plain_left_out: list[str] = []
    if top is None:
        root = folder
        warnings.append(
            f"{folder} is not in a git repository: taking every file under it except what .rvignore "
            "excludes (inside a repo, .gitignore is honoured too)"
        )
        plain_left_out = _list_plain(folder, git, cand)
    else:
        root = top
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=3) as pool:
            finish_repo_info = _head_questions(top, git, pool)
            _list_repo(top, "", git, cand)
    warnings.extend(cand.warnings)
    paths = [p for p in set(cand.trusted) | cand.hash if ".git" not in p.split("/")]

    # .rvignore: skip git entirely when there is none (the common case costs nothing).
    dirs = {p.rpartition("/")[0] for p in paths}
    has_rvignore = any(os.path.exists(os.path.join(root, d, ".rvignore")) for d in dirs)
    excluded = ignored_paths(root, paths, git) if has_rvignore else set()

    wanted = [p for p in paths if p not in excluded]
    to_hash = [p for p in wanted if p not in cand.trusted]
    hashed = _hash_many(root, to_hash, hash_cache)
    entries = []
    for p in wanted:
        if p in cand.trusted:
            full = os.path.join(root, p)
            try:
                st = os.lstat(full)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not stat.S_ISREG(st.st_mode):  # changed type without git noticing yet: hash it
                got = hash_path(full)
                if got is None:
                    continue
                mode, oid, size, mtime = got
            else:
                mode = MODE_EXEC if st.st_mode & stat.S_IXUSR else MODE_FILE
                oid, size, mtime = cand.trusted[p], st.st_size, st.st_mtime_ns
            entries.append(Entry(p, mode, oid, size, mtime))
        else:
            got = hashed.get(p)
            if got is None:
                if os.path.lexists(os.path.join(root, p)) and not os.path.isdir(os.path.join(root, p)):
                    warnings.append(f"left out {p}: not a regular file or symlink")
                continue  # deleted but not staged: simply absent
            mode, oid, size, mtime = got
            entries.append(Entry(p, mode, oid, size, mtime))
    ignored = [(p, _size_of(root / p)) for p in sorted(excluded)]
    ignored += [(p, -1 if p.endswith("/") else _size_of(root / p)) for p in plain_left_out]

    repo = None
    if top is not None:
        # Dirty means the snapshot differs from what is staged: an included file whose content or
        # mode is not the index's (a touched but unchanged file is clean), an included untracked
        # file, or a tracked file deleted (not .rvignored). Staged changes are checked in _repo_info.
        present = {e.path for e in entries}
        changed = any(e.path in cand.index_ids and cand.index_ids[e.path] != (e.mode, e.oid) for e in entries)
        deleted = any(p not in present and p not in excluded for p in cand.index_ids)
        untracked = tuple(sorted(p for p in cand.untracked if p in present))
        repo = finish_repo_info(cand, changed or deleted, untracked)
    return LocalTree(root, tuple(sort_entries(entries)), tuple(ignored), tuple(warnings), repo)


def _size_of(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _hash_many(
    root: Path, paths: list[str], cache: HashCache | None = None
) -> dict[str, tuple[int, str, int, int] | None]:
    def one(p: str) -> tuple[int, str, int, int] | None:
        full = os.path.join(root, p)
        if cache is None:
            return hash_path(full)
        try:
            st = os.lstat(full)
        except OSError:
            return None
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        hit = cache.get(p)
        if hit and hit[0] == key:
            return hit[1]
        got = hash_path(full)
        cache[p] = (key, got)
        return got

    if len(paths) < 16:
        return {p: one(p) for p in paths}
    # hashlib releases the GIL on large buffers, so threads do help on a first snapshot.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2)) as pool:
        return dict(zip(paths, pool.map(one, paths), strict=True))


def _head_questions(top: Path, git: Git, pool: ThreadPoolExecutor) -> Callable[..., RepoInfo]:
    """Start asking about HEAD now; the returned function completes a RepoInfo once listing is done."""
    head = pool.submit(git.run, ["rev-parse", "-q", "--verify", "HEAD^{commit}"], top, ok_codes=(0, 1, 128))
    ref = pool.submit(git.run, ["symbolic-ref", "-q", "--short", "HEAD"], top, ok_codes=(0, 1, 128))
    staged = pool.submit(
        git.run, ["diff-index", "--cached", "--quiet", "HEAD", "--"], top, ok_codes=(0, 1, 128)
    )

    def finish(cand: _Candidates, modified: bool, untracked: tuple[str, ...]) -> RepoInfo:
        h, r, st = head.result(), ref.result(), staged.result()
        commit = h.stdout.decode().strip() if h.returncode == 0 else None
        branch = r.stdout.decode("utf-8", "replace").strip() if r.returncode == 0 else None
        # Without a commit everything staged is new; with one, diff-index says (exit 1: differs).
        is_staged = st.returncode == 1 if commit else bool(cand.index_ids)
        url = redact_url(cand.top_config.get("remote.origin.url"))
        dirty = modified or is_staged or bool(untracked)
        return RepoInfo(top, Path(cand.top_git_dir), commit, branch, url, dirty, untracked)

    return finish


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
    tree: LocalTree, project: str, subdir: str, git: Git | None = None, *, with_diff: bool = True
) -> dict[str, Any]:
    """Where a snapshot came from: stored beside it on the cluster and in the job record.

    ``with_diff=False`` leaves the dirty tree's diff out (``diff`` is then None): it is only needed
    when the snapshot is new, so a resubmit does not pay for ``git diff``.
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
        diff = git.out(
            ["diff", "HEAD", "--no-color", "--no-ext-diff", "--no-textconv", "--submodule=short"], repo.top
        )
        prov["diff_truncated"] = len(diff) > DIFF_LIMIT
        prov["diff"] = diff[:DIFF_LIMIT].decode("utf-8", "replace")
    return prov


# --------------------------------------------------------------------------------------------------
# Talking to the agent


# The cluster-side agent is one program made of these modules, in this order: each is compiled into a
# module of its own name there, so they import each other as they do here (the second adds its modes
# to the first's).
AGENT_MODULES = ("rv.remote_store", "rv.job.remote", "rv.pyenv.remote")


@functools.cache
def _agent_bootstrap() -> str:
    """The ``python3 -c`` program that runs the agent: its modules travel compressed on every call.

    Decompressing and compiling them costs the cluster ~60 ms a call, more than most modes' work,
    so the compiled code is kept in ``${XDG_CACHE_HOME:-~/.cache}/rv/agent/`` on the cluster (0700),
    named by a hash of the sources and the interpreter's cache tag: later calls read it with marshal
    (~1 ms). A missing, damaged or foreign file is simply recompiled and rewritten; nothing else is
    ever read from there.
    """
    import importlib

    parts = []
    digest = hashlib.sha256()
    for name in AGENT_MODULES:
        source = Path(importlib.import_module(name).__file__ or "").read_bytes()
        digest.update(name.encode() + b"\0" + source)
        parts.append((name, base64.b64encode(zlib.compress(source, 9)).decode("ascii")))
    key = digest.hexdigest()[:20]
    return (
        "import base64,marshal,os,sys,types,zlib\n"
        f"P={parts!r}\n"
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
        " exec(c,m.__dict__)\n"
        "sys.exit(sys.modules['rv.remote_store'].main(sys.argv))"
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


def frame(obj: Any) -> bytes:
    data = zlib.compress(json.dumps(obj, ensure_ascii=True).encode("ascii"), 6)
    return struct.pack(">I", len(data)) + data


_AGENT_ERRORS: dict[str, type[RvError]] = {"usage": UsageError, "not-found": NotFound, "live": UsageError}


def call_agent(
    transport: Any, mode: str, args: dict[str, Any], *, stdin: Any = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run one agent mode and return its reply; failures become rv errors with the remote's words."""
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
# Local manifest cache: lets the manifest travel as a delta


class ManifestCache:
    """The last few manifests sent to one store, so the next one can travel as a small delta.

    Purely an optimisation: the cluster rebuilds the manifest from the base it names, checks that it
    hashes to the snapshot id, and asks for the full list on any mismatch.
    """

    KEEP = 4

    def __init__(self, directory: Path, store_key: str) -> None:
        self.dir = directory / "manifests" / hashlib.sha256(store_key.encode()).hexdigest()[:16]

    def _project_dir(self, project: str) -> Path:
        return self.dir / _slug(project)

    def bases(self, project: str) -> list[tuple[str, list[list[Any]]]]:
        d = self._project_dir(project)
        if not d.is_dir():
            return []
        files = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[: self.KEEP]
        out = []
        for f in files:
            with contextlib.suppress(OSError, ValueError):
                out.append((f.stem, json.loads(f.read_text())))
        return out

    def put(self, project: str, sid: str, rows: list[list[Any]]) -> None:
        d = self._project_dir(project)
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{sid}.json"
            if path.exists():
                os.utime(path)
            else:
                _write_atomic(path, json.dumps(rows).encode())
            for old in sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)[self.KEEP :]:
                old.unlink(missing_ok=True)


def manifest_payload(rows: list[list[Any]], bases: list[tuple[str, list[list[Any]]]]) -> dict[str, Any]:
    """The full manifest, or a delta against the cached base it differs least from."""
    best: dict[str, Any] = {"entries": rows}
    best_size = len(rows)
    mine = {r[0]: r for r in rows}
    for base_id, base_rows in bases:
        theirs = {r[0]: r for r in base_rows}
        upsert = [r for p, r in mine.items() if theirs.get(p) != r]
        remove = [p for p in theirs if p not in mine]
        size = len(upsert) + len(remove)
        if size < best_size // 2 and size < best_size:
            best, best_size = {"base": base_id, "upsert": upsert, "remove": remove}, size
    return best


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
    remote_path: str  # <root>/snapshots/<id>: the read-only tree
    meta_path: str  # <root>/snapshots/<id>.json: manifest and provenance
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


def human_size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_sizes(tree: LocalTree, max_file_size: int, allow_large: bool) -> tuple[tuple[str, int], ...]:
    """Refuse files over the limit (naming them) unless allowed; return the large ones allowed."""
    large = sorted(((e.path, e.size) for e in tree.entries if not e.is_link and e.size > max_file_size),
                   key=lambda x: -x[1])  # fmt: skip
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
    """List, hash and check the snapshot of ``path``'s repo. Local only: run it before connecting."""
    git = git or Git()
    tree = scan_tree(path, git=git)
    allowed = check_sizes(tree, max_file_size, allow_large)
    project = project_key(tree, git, cache_dir)
    here = Path(path).resolve()
    subdir = here.relative_to(tree.root).as_posix() if here != tree.root else ""
    prov = provenance(tree, project, subdir, git, with_diff=False)
    return LocalSnapshot(tree, snapshot_id(tree.entries), project, subdir, prov, allowed, git)


def summary_line(snap: LocalSnapshot, new_objects: int | None, new_bytes: int) -> str:
    tree = snap.tree
    n = len(tree.entries)
    parts = [f"snapshot {snap.id[:12]}: {n:,} file{'s' if n != 1 else ''}, {human_size(tree.total_size)}"]
    if new_objects is None:
        parts.append("already on the cluster, nothing to send")
    else:
        parts.append(
            f"{new_objects:,} new object{'s' if new_objects != 1 else ''} ({human_size(new_bytes)}) to send"
        )
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


def snapshot_warnings(snap: LocalSnapshot) -> list[str]:
    """What the user should hear before a snapshot is sent (on stderr, by `rv run` too).

    The tree's own warnings (not a repository, a submodule not checked out, a file that is neither
    regular nor a link), files over the size limit sent anyway, and uncommitted changes: the run is
    recorded as the commit plus a diff, which is easy to miss later.
    """
    out = list(snap.tree.warnings)
    if snap.allowed_large:
        shown = ", ".join(f"{p} ({human_size(n)})" for p, n in snap.allowed_large[:5])
        more = f" and {len(snap.allowed_large) - 5} more" if len(snap.allowed_large) > 5 else ""
        out.append(
            f"sending {len(snap.allowed_large)} file(s) over the size limit (--allow-large): {shown}{more}"
        )
    repo = snap.tree.repo
    if repo is not None and repo.dirty:
        parts = []
        if repo.untracked:
            names = ", ".join(repo.untracked[:3]) + (
                f" and {len(repo.untracked) - 3} more" if len(repo.untracked) > 3 else ""
            )
            parts.append(f"untracked: {names}")
        detail = f" ({'; '.join(parts)})" if parts else ""
        if repo.commit:
            at = f"{repo.branch or 'detached HEAD'}@{repo.commit[:7]}+"
            out.append(
                f"the snapshot holds uncommitted changes{detail}: the run is recorded as {at} with their "
                "diff (commit first to reproduce it from git alone)"
            )
        else:
            out.append(f"the repository has no commit yet{detail}: the run records no commit")
    return out


def _object_stream(
    root: Path,
    header: bytes,
    sends: list[Entry],
    progress: ProgressCounter,
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
                    progress.add(len(data))
            finally:
                if fh:
                    fh.close()
        progress.add(files=1)
        if len(buf) >= _READ:
            counter[0] += len(buf)
            yield bytes(buf)
            buf.clear()
    buf += b"E"
    counter[0] += len(buf)
    yield bytes(buf)
    progress.done()


def _query_stdin(snap: LocalSnapshot, payload: dict[str, Any]) -> bytes:
    return frame({"id": snap.id, **payload})


def upload_snapshot(
    transport: Any,
    layout: RemoteLayout,
    snap: LocalSnapshot,
    *,
    cache: ManifestCache | None = None,
    on_summary: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
    _query: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> SnapshotResult:
    """Make ``snap`` exist on the cluster: one round trip if it already does, two otherwise.

    (``_query``: the payload sent and the reply of a snap-query already made, by make_snapshot.)
    """
    rows = [e.row() for e in snap.tree.entries]
    args = layout.agent_args()
    if _query is None:
        payload = manifest_payload(rows, cache.bases(snap.project) if cache else [])
        reply = call_agent(transport, "snap-query", args, stdin=_query_stdin(snap, payload))
    else:
        payload, reply = _query
    if reply["status"] == "need-full":
        payload = {"entries": rows}
        reply = call_agent(transport, "snap-query", args, stdin=_query_stdin(snap, payload))
    sent = [0]
    created = False
    new_objects = new_bytes = 0
    if reply["status"] == "exists":
        summary = summary_line(snap, None, 0)
        if on_summary:
            on_summary(summary)
    else:
        missing = list(reply["missing"])
        by_oid = {e.oid: e for e in snap.tree.entries}
        new_objects = len(missing)
        new_bytes = sum(by_oid[o].size for o in missing)
        summary = summary_line(snap, new_objects, new_bytes)
        if on_summary:
            on_summary(summary)
        stored_provenance = provenance(snap.tree, snap.project, snap.subdir, snap.git)
        for _attempt in range(3):
            sends = [by_oid[o] for o in missing]
            header = frame({"id": snap.id, **payload, "provenance": stored_provenance})
            progress = ProgressCounter(on_progress, "upload", len(sends), sum(e.size for e in sends))
            stream = _object_stream(snap.tree.root, header, sends, progress, sent)
            reply = call_agent(transport, "snap-put", args, stdin=stream)
            if reply.get("bad"):
                paths = sorted(e.path for e in snap.tree.entries if e.oid in set(reply["bad"]))
                raise RemoteError(
                    f"{len(paths)} file(s) changed while being sent: {', '.join(paths[:5])}",
                    hint="rerun once they stop changing (or .rvignore files a running program writes)",
                )
            if reply["status"] in ("created", "exists"):
                created = reply["status"] == "created"
                break
            if reply["status"] == "need-full":
                payload = {"entries": rows}
                again = call_agent(transport, "snap-query", args, stdin=_query_stdin(snap, payload))
                missing = again.get("missing", [])
            else:
                missing = list(reply["missing"])  # collected by a concurrent gc since the query: resend
        else:
            raise RemoteError(
                f"snapshot {snap.id} could not be completed on the cluster (objects kept disappearing)",
                hint="is `rv sync gc` running in a loop? retry in a minute",
            )
    if cache:
        cache.put(snap.project, snap.id, rows)
    return SnapshotResult(
        id=snap.id,
        remote_path=layout.snapshot(snap.id),
        meta_path=layout.snapshot_meta(snap.id),
        project=snap.project,
        branch=snap.branch,
        commit=snap.commit,
        dirty=snap.dirty,
        subdir=snap.subdir,
        summary=summary,
        files=len(snap.tree.entries),
        total_bytes=snap.tree.total_size,
        new_objects=new_objects,
        new_bytes=new_bytes,
        sent_bytes=sent[0],
        created=created,
        provenance=snap.provenance,
        warnings=snap.tree.warnings,
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
    git: Git | None = None,
) -> SnapshotResult:
    """List, hash, check and ship the snapshot of ``path``'s repo; ``cache_key`` names the store.

    The first remote command starts before the local listing, so the cluster's shell and python
    start-up (most of a round trip on many clusters) overlap with it: a resubmit with nothing
    changed costs about one round trip in all. Local errors (a file over the size limit) still
    win: the early command is then abandoned with nothing sent. For a strict "check everything,
    then connect" order, call prepare_snapshot and upload_snapshot yourself.
    """
    cache = ManifestCache(cache_dir, cache_key or layout.root) if cache_dir else None
    from concurrent.futures import Future, ThreadPoolExecutor

    ready: Future[bytes | None] = Future()

    def query_stdin() -> Iterator[bytes]:
        data = ready.result()
        if data is not None:
            yield data

    with ThreadPoolExecutor(max_workers=1) as pool:
        early = pool.submit(call_agent, transport, "snap-query", layout.agent_args(), stdin=query_stdin())
        try:
            snap = prepare_snapshot(
                path, max_file_size=max_file_size, allow_large=allow_large, git=git, cache_dir=cache_dir
            )
            rows = [e.row() for e in snap.tree.entries]
            payload = manifest_payload(rows, cache.bases(snap.project) if cache else [])
        except BaseException:
            ready.set_result(None)  # the early command reads an empty stdin and exits
            with contextlib.suppress(Exception):
                early.result()
            raise
        ready.set_result(_query_stdin(snap, payload))
        reply = early.result()
    return upload_snapshot(
        transport,
        layout,
        snap,
        cache=cache,
        on_summary=on_summary,
        on_progress=on_progress,
        _query=(payload, reply),
    )
