"""What git says about a repository: where it is, its config, its attributes, its index."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rv.agent import manifest
from rv.errors import UsageError
from rv.files.gitcmd import Git, Soon, _split_z

# --------------------------------------------------------------------------------------------------
# Listing


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


def objects_dir(git_dir: str) -> str:
    """The object folder of a repository's git folder (a linked worktree's is its main one's)."""
    try:
        with open(os.path.join(git_dir, "commondir"), encoding="utf-8") as fh:
            common = fh.read().strip()
    except OSError:
        common = ""
    return os.path.normpath(os.path.join(git_dir, common, "objects"))


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
        input=b"\0".join(manifest.enc(p) for p in paths) + b"\0",
    )
    fields = out.split(b"\0")
    bad: set[str] = set()
    for i in range(0, len(fields) - 2, 3):
        path, attr, value = manifest.dec(fields[i]), fields[i + 1], fields[i + 2]
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
    values: dict[str, str] = {}
    for item in proc.stdout.split(b"\0"):
        if item:
            key, _, value = item.partition(b"\n")
            values[key.decode()] = value.decode("utf-8", "replace")
    if "remote.origin.url" in values:
        # Redacted here, where it is read: the config is kept in the tree cache (to see whether the
        # last listing still holds), and a token in the URL must reach no file (issue 24, item 7).
        values["remote.origin.url"] = redact_url(values["remote.origin.url"]) or ""
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
    index_f = Soon(git.out, ["ls-files", "-z", "-s", "-v"], where) if with_index else None
    modified_f = Soon(git.out, ["diff-files", "-z", "--name-only", "--ignore-submodules=all"], where)
    others_f = Soon(git.out, ["ls-files", "-z", "-o", "--exclude-standard"], where)
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
            index[prefix + manifest.dec(raw)] = (tag, int(mode_s, 8), oid.decode(), int(stage))
    others, nested = [], []
    for path in _split_z(others_b):
        if path.endswith("/"):
            nested.append(prefix + path.rstrip("/"))
        else:
            others.append(prefix + path)
    modified = {prefix + p for p in _split_z(modified_b)}
    return _Repo(prefix, git_dir, sig, config, modified, others, nested, index)
