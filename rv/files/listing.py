"""Which files a snapshot holds and their blob ids: git's answer, listed fast.

What is in a snapshot (from the git repo holding the given folder):

* tracked files plus untracked files git does not ignore, with their working-tree content
  (uncommitted edits included; a tracked file deleted but not staged is simply absent);
* files of checked-out submodules and of untracked nested repositories, by their own git rules;
* minus what ``.rvignore`` files exclude (gitignore syntax, nested folders too, across submodule
  boundaries). git's own matcher decides, never a hand-written one: the candidate paths go into a
  throw-away index and ``git ls-files -c -i --exclude-per-directory=.rvignore`` names the excluded;
* symlinks as symlinks, executable bits kept (git's two file modes), ``.git`` never;
* minus untracked files that look like secrets (:data:`SECRET_PATTERNS`: ``.env*``, private keys,
  credential files) that ``.gitignore`` did not name: they are sent only when git tracks them or a
  ``.rvignore`` names them with ``!`` (``!.env.public``). git's matcher decides here too: the
  patterns act as a file of excludes beneath the ``.rvignore`` files, whose negations win.

Outside a git repo: every file under the folder minus ``.rvignore`` (git's matcher again, in a
throw-away repository whose work tree is the folder), with a warning.

Blob ids are git's (sha1 over ``blob <size>\\0`` + content) for every file, so clean tracked files
cost nothing: their ids come from git's index, trusted only where git's own stat check says the file
is unchanged and no checkout conversion (filters, ``eol=crlf``, autocrlf, ident, encodings) could make
the working tree differ from the blob. Everything else is hashed here. With a cache
(rv.files.treecache), the last listing is reused: see scan_tree.

Why git decides what is ignored: a second implementation of gitignore semantics (negation, folder
patterns, ``**``, nested files, case folding) would disagree with git somewhere, and the user's only
reference is what git itself does.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv.agent import manifest
from rv.errors import NotFound

# The listing's parts, by concern; re-exported here, where callers have always found them.
from rv.files.gitcmd import Git, GitError, Soon, _map, _split_z
from rv.files.gitrepo import (
    _ask_repo,
    _attribute_files,
    _attribute_sources,
    _file_sig,
    _is_attributes,
    _Repo,
    _untrusted_by_attributes,
    find_repo,
    find_repo_top,
    index_signature,
    objects_dir,
    redact_url,
)
from rv.files.tree import (
    LARGE_FLOOR,
    MODE_EXEC,
    MODE_FILE,
    MODE_GITLINK,
    MODE_LINK,
    READ_CHUNK,
    Entry,
    LocalTree,
    ManifestPaths,
    RepoInfo,
    blob_id,
    hash_path,
    snapshot_id,
    sort_entries,
)

__all__ = [
    "LARGE_FLOOR", "MODE_EXEC", "MODE_FILE", "MODE_GITLINK", "MODE_LINK", "READ_CHUNK", "SECRET_PATTERNS",
    "Entry", "Git", "GitError", "LocalTree", "ManifestPaths", "RepoInfo", "Soon", "blob_id", "find_repo",
    "find_repo_top", "hash_path", "ignored_paths", "index_signature", "redact_url", "scan_tree",
    "secret_looking", "secrets_warning", "snapshot_id", "sort_entries",
]  # fmt: skip

if TYPE_CHECKING:
    from rv.files.treecache import TreeCache


# Untracked files with these names are left out unless a .rvignore names them with "!" (gitignore
# syntax, matched on the file's name at any depth): what a project folder holds that must not leave
# the laptop, and that .gitignore often forgets. Tracked files are always sent: git holds them already.
SECRET_PATTERNS = (
    ".env", ".env.*", "*.env", ".envrc",  # dotenv files, direnv
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk",  # ssh private keys
    "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.ppk", "*.kdbx",  # keys, key stores
    ".netrc", "_netrc", ".git-credentials", ".pgpass", ".pypirc", ".npmrc", ".s3cfg", ".boto",
    "credentials", "credentials.json", "client_secret*.json", "service-account*.json", "kaggle.json",
    "token.json", ".htpasswd",
)  # fmt: skip


def _list_plain(folder: Path, git: Git) -> tuple[list[str], list[str], list[str]]:
    """Every file under a folder that is not a repo, minus .rvignore: (files, nested repos, left out)."""
    from rv.files.tmpdirs import temp_dir

    with temp_dir("ls") as tmp:
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
    from rv.files.tmpdirs import temp_dir

    out: set[str] = set()
    while remaining:
        # An index cannot hold "a" and "a/b" at once (a file that became a folder lists both): the
        # paths below another one are asked about in a later round.
        batch = [p for p in remaining if not _below_one_of(p, remaining)]
        remaining.difference_update(batch)
        info = b"".join(b"100644 " + empty.encode() + b"\t" + manifest.enc(p) + b"\0" for p in batch)
        with temp_dir("ignore") as tmp:
            env = _scratch_repo(Path(tmp), root, git)
            git.out(["update-index", "-z", "--index-info"], root, input=info, env=env)
            out.update(_split_z(git.out(["ls-files", "-z", "-c", "-i", *rules], root, env=env)))
    return out


def secret_looking(root: Path, paths: Iterable[str], git: Git) -> set[str]:
    """Which of ``paths`` (untracked, relative to root) look like secrets and no .rvignore sends.

    Names are matched first (most trees have none of these files); the few that match go to git's
    matcher with :data:`SECRET_PATTERNS` as a file of excludes and the .rvignore files above it, so
    a ``!PATH`` there sends the file exactly as git would read the negation.
    """
    import fnmatch

    named = [
        p for p in paths if any(fnmatch.fnmatchcase(p.rpartition("/")[2], pat) for pat in SECRET_PATTERNS)
    ]
    if not named:
        return set()
    from rv.files.tmpdirs import temp_dir

    with temp_dir("secrets") as tmp:
        patterns = Path(tmp) / "secret-patterns"
        patterns.write_text("".join(f"{pat}\n" for pat in SECRET_PATTERNS), encoding="utf-8")
        return ignored_paths(root, named, git, exclude_from=[patterns])


def secrets_warning(secrets: Sequence[str]) -> str | None:
    """What the user hears about the files :func:`secret_looking` left out, and how to send one."""
    if not secrets:
        return None
    names = ", ".join(secrets[:5]) + (f" and {len(secrets) - 5} more" if len(secrets) > 5 else "")
    return (
        f"left out {len(secrets)} untracked file(s) that look like secrets: {names} (.gitignore does not "
        f"name them); to send one, `git add` it or add the line `!{secrets[0]}` to the top .rvignore"
    )


def _below_one_of(path: str, paths: set[str]) -> bool:
    i = path.rfind("/")
    while i > 0:
        if path[:i] in paths:
            return True
        i = path.rfind("/", 0, i)
    return False


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
    the stamp is when hashing began (see rv.files.treecache.RACY_NS for when an id can be reused).
    """

    def __init__(self, root: Path, before: dict[str, Any]) -> None:
        self.root = root
        self.before = before
        self.hashed: dict[str, tuple[Any, int, Any]] = {}

    def one(self, path: str) -> tuple[int, str, int] | None:
        from rv.files import treecache

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


def _same_result(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    """Two hashing results (mode, blob id, size), as kept (tuples, or lists once stored), alike?"""
    return (a is None and b is None) or (a is not None and b is not None and list(a) == list(b))


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

    With a ``cache`` (rv.files.treecache.TreeCache: a folder, or memory as `rv sync watch` keeps), the last
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
    secrets = secret_looking(folder, files, git)  # nothing is tracked here
    rows: dict[str, tuple[int, str, int]] = {}
    hasher = _Hasher(folder, {})
    for p, got in hasher.many([p for p in files if not _skipped(p) and p not in secrets]).items():
        if got is not None:
            rows[p] = got
        elif os.path.lexists(os.path.join(folder, p)) and not os.path.isdir(os.path.join(folder, p)):
            warnings.append(f"left out {p}: not a regular file or symlink")
    for sub in nested:
        git_dir = os.fsdecode(git.out(["rev-parse", "--absolute-git-dir"], folder / sub).strip())
        inner = _Scan(folder / sub, git_dir, git, None).run()
        warnings.extend(w for w in inner.warnings if w != secrets_warning(inner.secrets))
        secrets.update(f"{sub}/{p}" for p in inner.secrets)
        for e in inner.entries:
            rows[f"{sub}/{e.path}"] = (e.mode, e.oid, e.size)
    ignored = tuple((p, -1 if p.endswith("/") else _size_of(folder / p)) for p in left_out)
    entries = [Entry(p, m, o, s) for p, (m, o, s) in rows.items()]
    said = secrets_warning(sorted(secrets))
    if said:
        warnings.append(said)
    return LocalTree.of(
        folder, entries, ignored=ignored, warnings=tuple(warnings), secrets=tuple(sorted(secrets))
    )


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
        self.head = Soon(git.run, ["rev-parse", "-q", "--verify", "HEAD^{commit}"], top, ok_codes=ok)
        self.ref = Soon(git.run, ["symbolic-ref", "-q", "--short", "HEAD"], top, ok_codes=ok)
        # After a change of the index the staged question is asked at once; otherwise the answer
        # kept with the index signature and commit usually stands, and asking would only cost CPU.
        self.staged = Soon(self._staged) if eager else None

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

    The cache state it keeps (rv.files.treecache) per repository: ``repos`` (each one's folder, git folder,
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
        secrets = secret_looking(
            self.top, [p for p in untracked if p not in excluded and not _skipped(p)], self.git
        )
        hasher = _Hasher(self.top, (self.state or {}).get("hashed", {}))
        results = hasher.many(
            [p for p in candidates if p not in trusted and p not in excluded and p not in secrets]
        )
        rows, warnings = [], list(struct_warnings)
        for p in candidates:
            if p in excluded or p in secrets:
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
            "secrets": sorted(secrets),
        }
        text = manifest.manifest_text(rows)
        return self._finish(text, None, _large(rows), len(rows), sum(r[3] for r in rows), excluded,
                            warnings, info, state, None, secrets)  # fmt: skip

    # -- the last listing, updated by what git reports now -----------------------------------------
    def _fast(self, head: _HeadQuestions) -> LocalTree | None:
        """None when the last listing cannot be reused (index, config, ignore rules... changed)."""
        state = self.state
        assert state is not None and self.cache is not None
        if not state["repos"] or state["repos"][0][:2] != ["", self.git_dir]:
            return None
        if "secrets" not in state:
            return None  # kept by a version that sent secret-looking files: list afresh once
        old_text = self.cache.text(state["sid"])
        if old_text is None:
            return None
        repos = self._same_repositories(state)
        if repos is None:
            return None
        structure = [list(s) for s in state["structure"]]
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
        # Left out last time and still untracked, and any new one: what a name decides stays decided
        # while the .rvignore files are the same (a change of them lists afresh, above).
        secrets = {p for p in state["secrets"] if p in untracked}
        secrets |= secret_looking(self.top, [p for p in new_untracked if p not in excluded], self.git)
        # Had this listing run from scratch, only these paths could differ from the last one.
        fixed, before = state["fixed"], state["hashed"]
        look = {
            p
            for p in (*before, *modified, *untracked, *fixed)
            if p not in excluded and p not in secrets and not _skipped(p)
        }
        index_of = _index_ids(look, fixed, before, untracked, old_text)
        if index_of is None:
            return None
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
            hashed_before = before.get(p)
            if hashed_before is not None and _same_result(hashed_before[3], got):
                # What the last listing hashed is what its manifest holds: with many dirty files
                # (thousands after a big edit), only those that changed since are spliced.
                continue
            changes[p] = None if got is None else [p, *got]
        text, old_rows = manifest.splice(old_text, changes) if changes else (old_text, {})
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
            hashed={p: [index_of.get(p), *v] for p, v in hasher.hashed.items()}, secrets=sorted(secrets),
        )  # fmt: skip
        sid = None if changes else state["sid"]
        large_rows = tuple(sorted(large.items()))
        return self._finish(text, sid, large_rows, files, total, set(excluded), warnings, info, new_state,
                            (state["sid"], changes), secrets)  # fmt: skip

    def _same_repositories(self, state: dict[str, Any]) -> list[Any] | None:
        """The repositories asked again, or None when one changed since the last listing: its index
        or config, the executable bit's meaning, or which submodules and nested repositories exist
        (each checked out or not as before)."""
        repos = _map(lambda r: _ask_repo(self.top, r[0], self.git, r[1], False), state["repos"], 4)
        for repo, (_prefix, _gd, sig, config) in zip(repos, state["repos"], strict=True):
            if sig is None or repo.sig != sig or sorted(repo.config.items()) != config:
                return None
            if repo.config.get("core.filemode", "true").lower() in ("false", "0", "no", "off"):
                return None  # git ignores the executable bit here: every file's is read instead
        structure = [list(s) for s in state["structure"]]
        nested_now = {s for r in repos for s in r.nested}
        gitlinks = {s for s, _ in structure} - nested_now
        if [s for s, _ in structure if s not in gitlinks] != [
            s for s in (n for r in repos for n in r.nested)
        ]:
            return None
        if any((self.top / s / ".git").exists() != present for s, present in structure):
            return None
        return repos

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
        secrets: Iterable[str] = (),
    ) -> LocalTree:
        ignored = tuple((p, _size_of(self.top / p)) for p in sorted(excluded))
        said = secrets_warning(sorted(secrets))
        if said:
            warnings = [*warnings, said]
        tree = LocalTree(
            self.top, text, files, total, large, ignored, tuple(warnings), info, previous=previous,
            secrets=tuple(sorted(secrets)), unindexed=frozenset(state["hashed"]),
            object_dirs=tuple(objects_dir(r[1]) for r in state["repos"]),
        )  # fmt: skip
        if sid is not None:
            tree.__dict__["id"] = sid  # known already: the text is the one listed last time
        if self.cache is not None:
            self.cache.put_text(tree.id, text)
            self.cache.put_state(self.top, dict(state, sid=tree.id, files=files, bytes=total, large=large))
        return tree


def _index_ids(
    look: set[str], fixed: dict[str, Any], before: dict[str, Any], untracked: set[str], old_text: bytes
) -> dict[str, Any] | None:
    """What the index said of each path to look at (its [blob id, mode]; None for untracked), or None
    when the last manifest lacks a path git vouched for (list afresh)."""
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
            row = manifest.row_at(old_text, p)
            if row is None:
                return None
            index_of[p] = [row[1], row[2]]
    return index_of
