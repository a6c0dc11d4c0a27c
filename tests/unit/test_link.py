"""How an upload's packs are made for the link rv measured (rv.files.link), and the rate's file."""

from __future__ import annotations

import json
import os
import random
import struct
import zlib

import pytest
from test_snapshot import git, new_repo, write
from test_snapshot_store import local_python_first

from rv.agent import manifest
from rv.files import link, packs
from rv.files.gitcmd import Git
from rv.files.link import LinkRate, Meter, PackChoice, choose
from rv.files.packs import open_local_store
from rv.files.snapshot import make_snapshot, prepare_snapshot
from rv.remote.transport import LocalTransport

pytestmark = pytest.mark.usefixtures("hermetic_home")

MB = 1 << 20


# -- the choice ------------------------------------------------------------------------------------
def test_a_fast_link_sends_an_edit_whole_and_stored():
    # Loopback or a campus network: 200 MB/s.
    for blob_bytes in (10_000, 10 * MB, 500 * MB):
        assert choose(blob_bytes, 200e6) == PackChoice(deltas=False, level=0)


def test_a_slow_link_sends_an_edit_as_deltas_compressed():
    # 50 Mbit/s, a laptop over a VPN.
    for blob_bytes in (10_000, 10 * MB, 500 * MB):
        assert choose(blob_bytes, 50e6 / 8) == PackChoice(deltas=True, level=1)


def test_the_break_even_rates_follow_from_the_measured_costs():
    # Deltas save 92% of 9.8 MB for 0.22 s of CPU: whole pays above ~41 MB/s. Level 1 saves 58% for
    # 16 ns a byte: it pays below ~36 MB/s.
    assert link.whole_is_faster(9_800_000, 45e6) and not link.whole_is_faster(9_800_000, 37e6)
    assert link.compression_pays(30e6) and not link.compression_pays(40e6)


def test_a_link_not_measured_decides_by_the_edits_size_stored():
    assert choose(100_000, None) == PackChoice(deltas=False, level=0)
    assert choose(MB - 1, None) == PackChoice(deltas=False, level=0)
    assert choose(MB, None) == PackChoice(deltas=True, level=0)
    assert choose(50 * MB, None) == PackChoice(deltas=True, level=0)


def test_rv_pack_compression_decides_alone():
    assert choose(100_000, 200e6, explicit_level=6) == PackChoice(deltas=True, level=6)
    assert choose(50 * MB, 1e6, explicit_level=0) == PackChoice(deltas=False, level=0)
    assert choose(50 * MB, None, explicit_level=1) == PackChoice(deltas=True, level=1)


# -- the rate's file -------------------------------------------------------------------------------
def test_the_rate_is_kept_per_cluster(tmp_path):
    a, b = LinkRate(tmp_path, "gpu:/scratch/rv"), LinkRate(tmp_path, "laptop-vpn:/scratch/rv")
    assert a.read() is None
    a.write(8 * MB, 0.5)
    assert a.read() == pytest.approx(16 * MB) and b.read() is None
    assert LinkRate(tmp_path, "gpu:/scratch/rv").read() == pytest.approx(16 * MB)  # another rv
    assert oct(a.path.stat().st_mode & 0o777) == "0o600"
    assert json.loads(a.path.read_text())["bytes"] == 8 * MB


def test_the_rate_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    rate = LinkRate(tmp_path, "gpu")
    rate.write(8 * MB, 1.0)

    def cut(src, dst):  # rv killed between writing the new file and renaming it into place
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", cut)
    rate.write(8 * MB, 4.0)  # a cache: the failure costs the next measure, never the upload
    assert rate.read() == pytest.approx(8 * MB)
    monkeypatch.undo()
    rate.write(8 * MB, 4.0)
    assert rate.read() == pytest.approx(2 * MB)


@pytest.mark.parametrize(
    "text",
    [b"", b"{", b"\xff\xfe", b"[1, 2]", b"{}", b'{"bytes_per_s": "fast"}', b'{"bytes_per_s": -5}',
     b'{"bytes_per_s": NaN}', b'{"bytes_per_s": Infinity}', b'{"bytes_per_s": 0}', b"[" * 100_000],
)  # fmt: skip
def test_a_damaged_rate_file_is_a_link_not_measured(tmp_path, text):
    rate = LinkRate(tmp_path, "gpu")
    rate.path.parent.mkdir(parents=True)
    rate.path.write_bytes(text)
    assert rate.read() is None
    assert choose(100_000, rate.read()) == PackChoice(deltas=False, level=0)


def test_only_a_large_send_measures_the_link(tmp_path):
    rate = LinkRate(tmp_path, "gpu")
    small = Meter()
    small.add(3 * MB, 0.001)
    assert not small.keep(rate) and rate.read() is None
    large = Meter()
    for _ in range(8):
        large.add(MB, 0.125)
    assert large.keep(rate) and rate.read() == pytest.approx(8 * MB)


# -- the packs ---------------------------------------------------------------------------------------
def read_stream(frames: list[bytes]) -> tuple[list[bytes], list[int]]:
    """The git packs of an upload's stream, and how many objects went in whole (W) packs."""
    data = b"".join(frames)
    gitpacks: list[bytes] = []
    whole: list[int] = []
    i, current = 0, bytearray()
    while data[i : i + 1] != packs.PACKS_END:
        tag = data[i : i + 1]
        if tag == packs.PACK_DATA:
            (n,) = struct.unpack(">I", data[i + 1 : i + 5])
            current += data[i + 5 : i + 5 + n]
            i += 5 + n
        elif tag == packs.PACK_END:
            gitpacks.append(bytes(current))
            current.clear()
            i += 1
        else:
            assert tag == packs.WHOLE_PACK
            (count,) = struct.unpack(">I", data[i + 1 : i + 5])
            i += 5
            for _ in range(count):
                _kind, size = struct.unpack(">BQ", data[i + 1 : i + 10])
                i += 10 + 20 + size
            assert data[i : i + 1] == packs.PACK_END
            whole.append(count)
            i += 1
    return gitpacks, whole


def entries(pack: bytes) -> list[tuple[int, bool]]:
    """Each entry of a git pack: its type (1-4 whole objects, 6 and 7 deltas), and whether its zlib
    stream is stored (level 0: a deflate block of type 0)."""
    assert pack[:4] == b"PACK"
    (count,) = struct.unpack(">I", pack[8:12])
    types, stored, i = [], [], 12
    for _ in range(count):
        byte = pack[i]
        types.append((byte >> 4) & 7)
        i += 1
        while byte & 0x80:
            byte = pack[i]
            i += 1
        if types[-1] == 6:  # the base's offset
            while pack[i] & 0x80:
                i += 1
            i += 1
        elif types[-1] == 7:
            i += 20
        stored.append((pack[i + 2] >> 1) & 3 == 0)  # after zlib's two header bytes
        inflate = zlib.decompressobj()
        inflate.decompress(pack[i:])
        i = len(pack) - len(inflate.unused_data)
    return list(zip(types, stored, strict=True))


def test_an_edit_goes_as_deltas_on_a_slow_link_and_whole_on_a_fast_one(tmp_path, monkeypatch):
    text = "".join(f"line {i} of a long file\n" for i in range(5000))  # 120 KB
    small = "".join(f"x{i} = {i}\n" for i in range(100))
    repo = new_repo(tmp_path / "repo", {"big.txt": text, "small.txt": small})
    store = open_local_store(tmp_path / "cache", prepare_snapshot(repo).tree, Git())
    before = store.build(prepare_snapshot(repo).tree)
    write(repo / "big.txt", text + "one more line\n")
    write(repo / "small.txt", small + "y = 2\n")
    tree = prepare_snapshot(repo).tree
    after = store.build(tree)
    sizes = {r[2]: r[3] for r in manifest.manifest_rows(tree.manifest)}
    sends = store.objects(after, [before], sizes)
    assert len(sends.blobs) == 2 and sends.thin

    # 1 MB/s: one thin pack, both files as deltas of the versions the cluster holds, compressed.
    slow, slow_whole = read_stream(list(store.stream(after, sends, rate=1e6)))
    assert slow_whole == [] and len(slow) == 1
    kinds = entries(slow[0])
    assert sum(1 for t, _ in kinds if t == 3) == 0 and sum(1 for t, _ in kinds if t in (6, 7)) >= 2
    assert not any(stored for _, stored in kinds)
    assert len(slow[0]) < 1000

    # 500 MB/s: the small file whole in the thin pack, the large one whole after it, all stored.
    fast, fast_whole = read_stream(list(store.stream(after, sends, rate=500e6)))
    assert fast_whole == [1] and len(fast) == 1
    kinds = entries(fast[0])
    assert sum(1 for t, _ in kinds if t == 3) == 1 and all(stored for _, stored in kinds)

    # Not measured: by size (130 KB: whole), stored.
    unknown, unknown_whole = read_stream(list(store.stream(after, sends)))
    assert unknown_whole == [1] and all(stored for _, stored in entries(unknown[0]))

    # RV_PACK_COMPRESSION=0 on the slow link: whole and stored, as the user said.
    monkeypatch.setattr(packs, "PACK_COMPRESSION", 0)
    told, told_whole = read_stream(list(store.stream(after, sends, rate=1e6)))
    assert told_whole == [1] and all(stored for _, stored in entries(told[0]))


def test_a_large_upload_measures_the_link_for_the_next(tmp_path, layout):
    rng = random.Random(7)
    files = {f"data/{i}.bin": rng.randbytes(64 << 10).hex() for i in range(40)}  # 5 MB of text
    repo = new_repo(tmp_path / "repo", files)
    cache_dir = tmp_path / "cache"
    make_snapshot(LocalTransport(env=local_python_first()), layout, repo, cache_dir=cache_dir)
    rate = LinkRate(cache_dir, layout.root).read()
    assert rate is not None and rate > 0
    # A small edit measures nothing: the rate stays.
    write(repo / "data/0.bin", "changed\n")
    git(repo, "commit", "-qam", "edit")
    make_snapshot(LocalTransport(env=local_python_first()), layout, repo, cache_dir=cache_dir)
    assert LinkRate(cache_dir, layout.root).read() == rate


# -- a first send over a slow link ---------------------------------------------------------------------


def whole_objects(frames: list[bytes]) -> list[tuple[bytes, int]]:
    """Each object of the stream's W packs: its tag (O as it is, Z deflated) and its size."""
    data = b"".join(frames)
    out: list[tuple[bytes, int]] = []
    i = 0
    while data[i : i + 1] != packs.PACKS_END:
        tag = data[i : i + 1]
        if tag == packs.PACK_DATA:
            (n,) = struct.unpack(">I", data[i + 1 : i + 5])
            i += 5 + n
        elif tag == packs.PACK_END:
            i += 1
        else:
            (count,) = struct.unpack(">I", data[i + 1 : i + 5])
            i += 5
            for _ in range(count):
                kind_tag = data[i : i + 1]
                _kind, size = struct.unpack(">BQ", data[i + 1 : i + 10])
                i += 30
                if kind_tag == packs.OBJECT:
                    i += size
                else:
                    assert kind_tag == packs.DEFLATED
                    while (n := struct.unpack(">I", data[i : i + 4])[0]) != 0:
                        i += 4 + n
                    i += 4
                out.append((kind_tag, size))
            assert data[i : i + 1] == packs.PACK_END
            i += 1
    return out


def test_a_first_send_deflates_whole_objects_once_the_link_is_measured_slow(tmp_path):
    rng = random.Random(3)
    texts = {f"src/{i}.py": "".join(f"value_{i}_{j} = {j}\n" for j in range(6000)) for i in range(4)}
    repo = new_repo(tmp_path / "repo", texts)
    write(repo / "weights.bin", rng.randbytes(100_000))  # incompressible: goes as it is
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "weights")
    tree = prepare_snapshot(repo).tree
    store = open_local_store(tmp_path / "cache", tree, Git())
    commit = store.build(tree)
    sends = store.everything(commit, manifest.manifest_rows(tree.manifest))
    large = sorted(o.size for o in sends.blobs if o.size >= packs.WHOLE_MIN_BYTES)
    assert len(large) == 5

    # Nothing measured at first (the small objects' pack and the first large object: as they are),
    # then 1 MB/s: the text files deflated, the random one as it is.
    asked = [0]

    def measured() -> float | None:
        asked[0] += 1
        return None if asked[0] <= 2 else 1e6

    sent = whole_objects(list(store.stream(commit, sends, measured=measured)))
    assert sorted(size for _t, size in sent) == large
    assert sent[0][0] == packs.OBJECT
    tags = {size: tag for tag, size in sent[1:]}
    assert tags.pop(100_000) == packs.OBJECT and set(tags.values()) == {packs.DEFLATED}
    # A fast link, or a rate kept fast: all as they are.
    fast = whole_objects(list(store.stream(commit, sends, measured=lambda: 500e6)))
    assert {tag for tag, _ in fast} == {packs.OBJECT}
    assert {tag for tag, _ in whole_objects(list(store.stream(commit, sends, rate=500e6)))} == {packs.OBJECT}


def test_a_first_sync_over_a_slow_link_lands_whole_and_smaller(tmp_path, layout, monkeypatch):
    """Through the real agent: the deflated objects go into the store as they came, and the snapshot
    is what the repo holds."""
    from test_snapshot_store import job_copy, store_is_sound

    texts = {f"src/{i}.py": "".join(f"value_{i}_{j} = {j}\n" for j in range(6000)) for i in range(8)}
    repo = new_repo(tmp_path / "repo", texts)
    monkeypatch.setattr(Meter, "rate", lambda self: 1e6)
    result = make_snapshot(LocalTransport(env=local_python_first()), layout, repo, cache_dir=tmp_path / "c")
    assert result.created and store_is_sound(layout) == 8
    total = sum(len(t) for t in texts.values())
    assert result.sent_bytes < total / 3  # deflated at level 1: numbered lines shrink 4-6x
    copy = job_copy(layout, result.id, tmp_path / "w")
    assert {f"src/{i}.py": (copy / f"src/{i}.py").read_text() for i in range(8)} == texts
