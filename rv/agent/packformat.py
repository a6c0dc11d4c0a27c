"""A git pack and its index, written from whole objects (format 2, each object one zlib stream of
stored blocks: level 0, or the stream the laptop deflated; index version 2), both as git writes them
(gitformat-pack).

A format both sides share (standard library only): the agent writes what the laptop sends into
packs of its store (:mod:`rv.agent.packfile`), and the laptop writes the blobs of edited files into
its own repository the same way (:mod:`rv.files.packs`). What a pack must hold is checked as it is
written: every object's id is its bytes' SHA-1 (a file that changed on the way fails the pack), the
count is the one announced, and no id comes twice.
"""

import hashlib
import os
import struct
import zlib

TYPES = {1: b"commit", 2: b"tree", 3: b"blob"}
PIECE = 1 << 20  # what is read from the connection at a time
BLOCK = 0xFFFF  # a deflate stored block holds at most this many bytes


class BadPack(Exception):
    """What the laptop sent is not the pack it announced."""


def _create(path):
    """A new file, read-only once closed as git's packs are, under the agent's umask (private unless
    the profile shares with the group)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444), "wb")


def _entry_header(kind, size):
    """An object's type and size as a pack entry starts (a varint: 4 bits of size, then 7 a byte)."""
    out = bytearray()
    byte = (kind << 4) | (size & 0x0F)
    size >>= 4
    while size:
        out.append(byte | 0x80)
        byte = size & 0x7F
        size >>= 7
    out.append(byte)
    return bytes(out)


class PackWriter:
    """One pack of ``count`` objects under ``folder``; ``finish`` names it and writes its index."""

    def __init__(self, folder, count):
        self.folder = folder
        self.count = count
        self.tmp = os.path.join(folder, b"tmp_pack_rv_%d_%s" % (os.getpid(), os.urandom(4).hex().encode()))
        self.fh = _create(self.tmp)
        self.sha = hashlib.sha1()
        self.offset = 0
        self.entries = []  # (id, crc32 of the entry, offset)
        self._write(b"PACK" + struct.pack(">II", 2, count))

    def _write(self, data):
        self.fh.write(data)
        self.sha.update(data)
        self.offset += len(data)

    def add(self, kind, size, oid, read):
        """One object: ``read(n)`` gives its next ``n`` bytes (all ``size`` of them, in pieces).
        Raises BadPack, once they are all read, when they are not object ``oid``."""
        start = self.offset
        head = _entry_header(kind, size) + b"\x78\x01"  # zlib: deflate, 32K window, no dictionary
        crc = zlib.crc32(head)
        self._write(head)
        hasher = hashlib.sha1(TYPES[kind] + b" %d\0" % size)
        adler = zlib.adler32(b"")
        left = size
        while True:
            piece = read(min(PIECE, left)) if left else b""
            left -= len(piece)
            hasher.update(piece)
            adler = zlib.adler32(piece, adler)
            view = memoryview(piece)
            for at in range(0, max(len(piece), 1), BLOCK):
                block = view[at : at + BLOCK]
                final = not left and at + BLOCK >= len(piece)
                frame = struct.pack("<BHH", 1 if final else 0, len(block), len(block) ^ 0xFFFF)
                crc = zlib.crc32(block, zlib.crc32(frame, crc))
                self._write(frame)
                self._write(block)
            if not left:
                break
        tail = struct.pack(">I", adler)
        crc = zlib.crc32(tail, crc)
        self._write(tail)
        if hasher.hexdigest() != oid:
            raise BadPack(
                "object %s arrived as %s (its file changed while being sent?)" % (oid, hasher.hexdigest())
            )
        self.entries.append((bytes.fromhex(oid), crc & 0xFFFFFFFF, start))

    def add_deflated(self, kind, size, oid, pieces):
        """One object sent deflated (a slow link: rv.files.packs): ``pieces`` gives its zlib stream
        (header, deflate, adler32), written into the pack as it came (git reads any level) and
        inflated here to check it is ``size`` bytes of object ``oid``. Every piece is read whatever
        happens; then BadPack when the stream was not that."""
        start = self.offset
        head = _entry_header(kind, size)
        crc = zlib.crc32(head)
        self._write(head)
        hasher = hashlib.sha1(TYPES[kind] + b" %d\0" % size)
        inflate = zlib.decompressobj()
        got, problem = 0, None
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
            self._write(piece)
            rest = piece
            while rest and problem is None:
                try:
                    out = inflate.decompress(rest, PIECE)  # bounded: a stream cannot blow up here
                except zlib.error as exc:
                    problem = "is not a zlib stream (%s)" % exc
                    break
                rest = inflate.unconsumed_tail
                got += len(out)
                hasher.update(out)
                if got > size:
                    problem = "holds more than its %d bytes" % size
                elif inflate.eof and (rest or inflate.unused_data):
                    problem = "has bytes after its end"
        if problem is None and not inflate.eof:
            problem = "ended before its zlib stream did"
        if problem is None and got != size:
            problem = "holds %d bytes, not %d" % (got, size)
        if problem is None and hasher.hexdigest() != oid:
            problem = "arrived as %s (its file changed while being sent?)" % hasher.hexdigest()
        if problem is not None:
            raise BadPack("object %s sent deflated %s" % (oid, problem))
        self.entries.append((bytes.fromhex(oid), crc & 0xFFFFFFFF, start))

    def finish(self):
        """Write the trailer and the index; return the pack's name (``pack-<checksum>``)."""
        if len(self.entries) != self.count:
            raise BadPack("a pack of %d objects ended after %d" % (self.count, len(self.entries)))
        checksum = self.sha.digest()
        self.fh.write(checksum)
        self.fh.flush()
        os.fsync(self.fh.fileno())  # as git does: a pack is whole on disk before anything names it
        self.fh.close()
        name = b"pack-" + checksum.hex().encode()
        entries = sorted(self.entries)
        if any(entries[i][0] == entries[i + 1][0] for i in range(len(entries) - 1)):
            raise BadPack("an object came twice in one pack")
        index = index_bytes(entries, checksum)
        idx_tmp = self.tmp + b".idx"
        with _create(idx_tmp) as fh:
            fh.write(index)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(self.tmp, os.path.join(self.folder, name + b".pack"))
        os.rename(idx_tmp, os.path.join(self.folder, name + b".idx"))
        return name

    def discard(self):
        if not self.fh.closed:
            self.fh.close()
        for path in (self.tmp, self.tmp + b".idx"):
            if os.path.exists(path):
                os.unlink(path)


def index_bytes(entries, pack_checksum):
    """A version 2 pack index of ``entries`` (id, crc32, offset), sorted by id."""
    fanout = [0] * 256
    for oid, _crc, _off in entries:
        fanout[oid[0]] += 1
    total = 0
    for i in range(256):
        total += fanout[i]
        fanout[i] = total
    small, large = [], []
    for _oid, _crc, off in entries:
        if off < 0x80000000:
            small.append(off)
        else:  # past 2 GiB: a slot in the table of 8-byte offsets
            small.append(0x80000000 | len(large))
            large.append(off)
    body = b"".join(
        [
            b"\377tOc" + struct.pack(">I", 2),
            struct.pack(">256I", *fanout),
            b"".join(oid for oid, _crc, _off in entries),
            struct.pack(">%dI" % len(entries), *[crc for _oid, crc, _off in entries]),
            struct.pack(">%dI" % len(small), *small),
            struct.pack(">%dQ" % len(large), *large),
            pack_checksum,
        ]
    )
    return body + hashlib.sha1(body).digest()
