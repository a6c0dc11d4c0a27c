"""Untracked files that look like secrets are never sent unless git tracks them or a .rvignore names
them with `!` (issue 24, item 4): on a listing from scratch, on the cached listing of a resubmit,
and outside a repository."""

from __future__ import annotations

import pytest
from test_snapshot import git, new_repo, write

from rv.files import listing
from rv.files.listing import scan_tree
from rv.files.treecache import TreeCache

pytestmark = pytest.mark.usefixtures("hermetic_home")

SECRETS = [
    ".env", ".env.local", "prod.env", "id_rsa", "keys/id_ed25519", "tls/server.pem", "api.key", ".netrc",
    "credentials.json", "deep/er/.git-credentials", "client_secret_123.json",
]  # fmt: skip
NOT_SECRETS = ["id_rsa.pub", "env.py", "environment.yml", "keys/README.md", "credentials.py"]


def paths(tree) -> list[str]:
    return [e.path for e in tree.entries]


@pytest.fixture
def repo(tmp_path):
    return new_repo(tmp_path / "repo", {"train.py": "lr = 1\n", ".gitignore": "ignored.env\n"})


def test_secret_looking_untracked_files_are_left_out_and_named(repo):
    for name in [*SECRETS, *NOT_SECRETS, "ignored.env"]:
        write(repo / name, "x\n")
    tree = scan_tree(repo)
    assert set(paths(tree)) == {".gitignore", "train.py", *NOT_SECRETS}
    assert tree.secrets == tuple(sorted(SECRETS))  # .gitignore named ignored.env: nothing to say
    (warning,) = [w for w in tree.warnings if "look like secrets" in w]
    assert warning.startswith(f"left out {len(SECRETS)} untracked file(s) that look like secrets: .env, ")
    assert "`git add` it or add the line `!.env` to the top .rvignore" in warning
    assert tree.repo.untracked == tuple(sorted(NOT_SECRETS))  # what "uncommitted changes" lists


def test_a_tracked_one_is_sent_and_a_rvignore_negation_sends_one(repo):
    write(repo / ".env", "TRACKED=1\n")
    write(repo / "keys" / "id_rsa", "key\n")
    write(repo / "tls" / "a.pem", "pem\n")
    git(repo, "add", ".env")
    git(repo, "commit", "-qm", "the project's own .env, tracked on purpose")
    write(repo / ".rvignore", "!keys/id_rsa\n")
    tree = scan_tree(repo)
    assert {".env", "keys/id_rsa"} <= set(paths(tree))
    assert tree.secrets == ("tls/a.pem",)


def test_the_cached_listing_of_a_resubmit_leaves_them_out_too(repo, tmp_path):
    cache = TreeCache(tmp_path / "cache")
    first = scan_tree(repo, cache=cache)
    assert first.secrets == () and first.previous is None  # a listing from scratch
    write(repo / ".env", "TOKEN=abc\n")  # created between two submits
    write(repo / "notes.txt", "sent\n")
    second = scan_tree(repo, cache=cache)
    assert second.previous is not None  # the cached path: the last listing updated
    assert "notes.txt" in paths(second) and ".env" not in paths(second)
    assert second.secrets == (".env",)
    assert any("look like secrets: .env" in w for w in second.warnings)
    write(repo / "train.py", "lr = 2\n")  # an edit and a resubmit: still left out, still said
    third = scan_tree(repo, cache=cache)
    assert third.previous is not None and ".env" not in paths(third) and third.secrets == (".env",)
    assert third.manifest == scan_tree(repo).manifest  # the same as a listing from scratch
    # A .rvignore that names it: listed afresh, and sent.
    write(repo / ".rvignore", "!.env\n")
    fourth = scan_tree(repo, cache=cache)
    assert ".env" in paths(fourth) and fourth.secrets == ()


def test_a_cache_from_before_is_not_trusted_with_them(repo, tmp_path, monkeypatch):
    # A listing kept by a version that sent .env: its manifest holds the file and its state has no
    # "secrets". The next listing must not reuse it.
    cache = TreeCache(tmp_path / "cache")
    write(repo / ".env", "TOKEN=abc\n")
    with monkeypatch.context() as old:
        old.setattr(listing, "SECRET_PATTERNS", ())
        assert ".env" in paths(scan_tree(repo, cache=cache))
    state = cache.state(repo)
    del state["secrets"]
    cache.put_state(repo, state)
    again = scan_tree(repo, cache=cache)
    assert ".env" not in paths(again) and again.secrets == (".env",)


def test_outside_a_repository_too(tmp_path):
    folder = tmp_path / "plain"
    write(folder / "run.py", "print(1)\n")
    write(folder / ".env", "TOKEN=abc\n")
    write(folder / "sub" / "id_ed25519", "key\n")
    tree = scan_tree(folder)
    assert paths(tree) == ["run.py"]
    assert tree.secrets == (".env", "sub/id_ed25519")
