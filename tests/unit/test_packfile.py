"""rv.agent.packfile: packs and indexes written from whole objects, as git itself reads them.

Every pack is checked by git (fsck --full --strict, verify-pack, cat-file): the format is git's,
not ours, so git is the judge.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from rv.agent import common, packfile


def git(repo: Path, *args: str, input: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=repo, input=input, capture_output=True, check=True).stdout


def oid_of(kind: bytes, data: bytes) -> str:
    return hashlib.sha1(kind + b" %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def source(tmp_path):
    """A repository with a commit whose objects are sent: files small, empty, of many stored blocks
    and of several pieces (PIECE), and a symlink."""
    repo = tmp_path / "src"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "small.py").write_text("print('hi')\n")
    (repo / "empty").write_bytes(b"")
    (repo / "blocks.bin").write_bytes(os.urandom(200_000))
    (repo / "pieces.bin").write_bytes(os.urandom(packfile.PIECE * 2 + 12345))
    (repo / "sub").mkdir()
    (repo / "sub" / "x.txt").write_text("x\n" * 1000)
    os.symlink("small.py", repo / "link")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    return repo


def objects_of(repo: Path) -> list[tuple[int, str, bytes]]:
    codes = {b"commit": 1, b"tree": 2, b"blob": 3}
    out = []
    for line in git(repo, "rev-list", "--objects", "HEAD").splitlines():
        oid = line[:40].decode()
        kind = git(repo, "cat-file", "-t", oid).strip()
        out.append((codes[kind], oid, git(repo, "cat-file", kind.decode(), oid)))
    return out


def framed(objects: list[tuple[int, str, bytes]]) -> bytes:
    return (
        b"".join(
            packfile.OBJECT + struct.pack(">BQ", kind, len(data)) + bytes.fromhex(oid) + data
            for kind, oid, data in objects
        )
        + packfile.END
    )


UMASK = 0o022


@pytest.fixture(autouse=True)
def umask():
    old = os.umask(UMASK)
    yield
    os.umask(old)


@pytest.fixture
def store(tmp_path):
    repo = tmp_path / "store.git"
    git(tmp_path, "init", "-q", "--bare", str(repo))
    return repo


@pytest.fixture
def feed(monkeypatch):
    def put(data: bytes) -> None:
        monkeypatch.setattr(common, "_stdin", io.BufferedReader(io.BytesIO(data)))

    return put


def test_a_pack_of_whole_objects_is_one_git_reads_checks_and_checks_out(source, store, feed, tmp_path):
    objects = objects_of(source)
    feed(framed(objects))
    folder = store / "objects" / "pack"
    name, received, error = packfile.receive(os.fsencode(folder), len(objects))
    assert error is None and received == sum(len(d) for _k, _o, d in objects)
    assert sorted(p.name for p in folder.iterdir()) == [f"{name.decode()}.idx", f"{name.decode()}.pack"]
    git(store, "verify-pack", str(folder / f"{name.decode()}.pack"))
    git(store, "fsck", "--full", "--strict", "--no-dangling")
    for kind, oid, data in objects:
        assert git(store, "cat-file", {1: "commit", 2: "tree", 3: "blob"}[kind], oid) == data
    head = git(source, "rev-parse", "HEAD").decode().strip()
    out = tmp_path / "out"
    git(store, f"--work-tree={out}", "read-tree", head)
    out.mkdir()
    git(store, f"--work-tree={out}", "checkout-index", "-a")
    assert (out / "pieces.bin").read_bytes() == (source / "pieces.bin").read_bytes()
    assert os.readlink(out / "link") == "small.py"
    for suffix in (".pack", ".idx"):  # read-only, and under the umask (the fixture's: 022)
        assert (folder / f"{name.decode()}{suffix}").stat().st_mode & 0o777 == 0o444 & ~UMASK


def test_a_private_umask_leaves_the_pack_to_its_owner(source, store, feed):
    objects = objects_of(source)
    feed(framed(objects))
    old = os.umask(0o077)
    try:
        name, _received, error = packfile.receive(os.fsencode(store / "objects" / "pack"), len(objects))
    finally:
        os.umask(old)
    assert error is None
    for suffix in (".pack", ".idx"):
        assert (store / "objects" / "pack" / f"{name.decode()}{suffix}").stat().st_mode & 0o777 == 0o400


def test_an_object_that_is_not_what_its_id_says_refuses_the_pack_and_leaves_nothing(source, store, feed):
    objects = objects_of(source)
    kind, oid, data = objects[-1]
    objects[-1] = (kind, oid, data + b"changed on the way")
    stream = framed(objects) + b"next"
    feed(stream)
    folder = store / "objects" / "pack"
    name, _received, error = packfile.receive(os.fsencode(folder), len(objects))
    assert name is None and oid in error and "changed while being sent" in error
    assert list(folder.iterdir()) == []
    assert common.read_exact(4) == b"next"  # the rest of the pack was read: the stream goes on


def test_a_count_that_is_not_the_headers_refuses_the_pack(source, store, feed):
    objects = objects_of(source)
    for count in (len(objects) + 1, len(objects) - 1):
        feed(framed(objects))
        name, _received, error = packfile.receive(os.fsencode(store / "objects" / "pack"), count)
        assert name is None and f"pack of {count}" in error
    assert list((store / "objects" / "pack").iterdir()) == []


def test_an_object_sent_twice_refuses_the_pack(source, store, feed):
    objects = objects_of(source)
    feed(framed([*objects, objects[0]]))
    name, _received, error = packfile.receive(os.fsencode(store / "objects" / "pack"), len(objects) + 1)
    assert name is None and "twice" in error


def deflated(kind: int, oid: str, data: bytes, stream: bytes | None = None, piece: int = 50_000) -> bytes:
    """``Z`` framing: the object's zlib stream (``stream``, else ``data`` at level 1) in pieces."""
    stream = zlib.compress(data, 1) if stream is None else stream
    pieces = [stream[i : i + piece] for i in range(0, len(stream), piece)]
    body = b"".join(struct.pack(">I", len(p)) + p for p in pieces)
    return packfile.DEFLATED + struct.pack(">BQ", kind, len(data)) + bytes.fromhex(oid) + body + b"\0" * 4


def test_objects_sent_deflated_go_into_the_pack_as_they_came_and_git_reads_them(source, store, feed):
    """Over a slow link the laptop deflates whole objects (rv.files.packs): the agent writes each
    zlib stream into the pack as it came (git reads any level), once it has inflated it to check it."""
    objects = objects_of(source)
    plain = [o for o in objects if o[0] != 3]
    blobs = [o for o in objects if o[0] == 3]
    body = framed(plain)[:-1] + b"".join(deflated(k, o, d) for k, o, d in blobs) + packfile.END
    feed(body)
    folder = store / "objects" / "pack"
    name, received, error = packfile.receive(os.fsencode(folder), len(objects))
    assert error is None, error
    streams = sum(len(zlib.compress(d, 1)) for _k, _o, d in blobs)
    assert received == sum(len(d) for _k, _o, d in plain) + streams  # the bytes that came
    git(store, "verify-pack", str(folder / f"{name.decode()}.pack"))
    git(store, "fsck", "--full", "--strict", "--no-dangling")
    for kind, oid, data in objects:
        assert git(store, "cat-file", {1: "commit", 2: "tree", 3: "blob"}[kind], oid) == data
    text = next(d for _k, _o, d in blobs if d.startswith(b"x\n"))
    assert (folder / f"{name.decode()}.pack").stat().st_size < sum(len(d) for *_, d in objects) - len(
        text
    ) // 2


@pytest.mark.parametrize(
    "what, stream, says",
    [
        ("other bytes", zlib.compress(b"x\n" * 999 + b"y\n", 1), "changed while being sent"),
        ("not zlib", b"not a zlib stream at all", "is not a zlib stream"),
        ("cut short", zlib.compress(b"x\n" * 1000, 1)[:-9], "ended before its zlib stream did"),
        ("bytes after its end", zlib.compress(b"x\n" * 1000, 1) + b"more", "has bytes after its end"),
        ("more than its size", zlib.compress(b"x\n" * 1001, 1), "holds more than its 2000 bytes"),
        ("less than its size", zlib.compress(b"x\n" * 999, 1), "holds 1998 bytes, not 2000"),
    ],
)
def test_a_deflated_object_that_is_not_what_it_says_refuses_the_pack_and_the_stream_goes_on(
    store, feed, what, stream, says
):
    data = b"x\n" * 1000
    oid = oid_of(b"blob", data)
    feed(deflated(3, oid, data, stream, piece=700) + packfile.END + b"next")
    folder = store / "objects" / "pack"
    name, _received, error = packfile.receive(os.fsencode(folder), 1)
    assert name is None and oid in error and says in error, (what, error)
    assert list(folder.iterdir()) == []
    assert common.read_exact(4) == b"next"  # every piece was read


def test_a_refused_pack_s_deflated_objects_are_skipped_to_its_end(source, store, feed):
    data = b"x\n" * 1000
    oid = oid_of(b"blob", data)
    feed(deflated(3, oid, data) + deflated(3, oid, data) + packfile.END + b"next")
    packfile.skip_objects()
    assert common.read_exact(4) == b"next"


def test_offsets_past_2_gib_go_in_the_index_s_table_of_8_byte_offsets(tmp_path):
    entries = sorted(
        [
            (bytes.fromhex(oid_of(b"blob", b"a")), 1, 12),
            (bytes.fromhex(oid_of(b"blob", b"b")), 2, (1 << 31) + 5),
            (bytes.fromhex(oid_of(b"blob", b"c")), 3, (1 << 33) + 7),
        ]
    )
    index = packfile._index(entries, b"\1" * 20)
    (tmp_path / "x.idx").write_bytes(index)
    # git's own reader of an index prints "offset id (crc)" per object.
    shown = subprocess.run(
        ["git", "show-index"], input=index, capture_output=True, check=True
    ).stdout.decode()
    got = sorted((line.split()[1], int(line.split()[0])) for line in shown.splitlines())
    assert got == sorted((oid.hex(), off) for oid, _crc, off in entries)
    assert hashlib.sha1(index[:-20]).digest() == index[-20:]
