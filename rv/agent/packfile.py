"""A git pack and its index, written from whole objects as they arrive (``W`` sends).

The laptop sends the objects of a snapshot that the store lacks as they are, no deltas: each one's
type, size and id, then its bytes (over a slow link, deflated: its zlib stream, which goes into the
pack as it came, once inflated here to check it). This writes them into a pack and its index
(:mod:`rv.agent.packformat`) in the call's quarantine; the store takes them by rename.

Why not ``git index-pack``, which the thin sends still use: it hashes every object and the whole
pack with git's collision-detecting SHA-1, 0.65 s per 200 MB here against 0.11 s for hashlib's, and
on a first send of 200 MB it took 2.1 s where the tar stream a user compares with takes 2.0 s in
all. What a pack must hold is checked here all the same: every object's id is its bytes' SHA-1 (a
file that changed on the way fails the pack), the count is the header's, and no id comes twice.
"""

import struct

from rv.agent import common
from rv.agent.packformat import PIECE, TYPES, BadPack, PackWriter, index_bytes

OBJECT, DEFLATED, END = b"O", b"Z", b"N"
MAX_PIECE = 16 << 20  # a deflated object's pieces are about 1 MiB; anything far larger is corrupt
_index = index_bytes  # the index's bytes (tests compare them with git's)
__all__ = ["PIECE", "TYPES", "BadPack", "PackWriter", "receive", "skip_objects"]


def _skip(n):
    while n:
        n -= len(common.read_exact(min(PIECE, n)))
    return b""


def _pieces():
    """A deflated object's pieces as they come: ``<len:4> <bytes>``..., ended by a length of 0."""
    while True:
        (n,) = struct.unpack(">I", common.read_exact(4))
        if not n:
            return
        if n > MAX_PIECE:
            raise common.AgentError("corrupt object stream (a piece of %d bytes)" % n)
        yield common.read_exact(n)


def skip_objects():
    """Read and drop the objects of a pack up to its ``N`` (after an earlier pack was refused)."""
    while True:
        tag = common.read_exact(1)
        if tag not in (OBJECT, DEFLATED):
            return
        _kind, size = struct.unpack(">BQ", common.read_exact(9))
        common.read_exact(20)
        if tag == OBJECT:
            _skip(size)
        else:
            for _piece in _pieces():
                pass


class _Counted:
    """Pieces, with the bytes they held counted."""

    def __init__(self, pieces):
        self.pieces, self.bytes = pieces, 0

    def __iter__(self):
        for piece in self.pieces:
            self.bytes += len(piece)
            yield piece


def receive(folder, count):
    """Read ``count`` objects framed ``O <type:1> <size:8> <id:20> <bytes>``, or ``Z <type:1> <size:8>
    <id:20>`` and the pieces of its zlib stream (``<len:4> <bytes>``..., then a length of 0: sent
    deflated over a slow link), and the ``N`` after them into a pack under ``folder``. Returns (its
    name or None, bytes read, why it was refused or None).

    A refused pack (an object that is not what it says) leaves nothing behind, and the rest of it is
    read and dropped, so the reply still comes after the whole request.
    """
    writer = PackWriter(folder, count)
    error = None
    received = 0
    try:
        while True:
            tag = common.read_exact(1)
            if tag == END:
                break
            if tag not in (OBJECT, DEFLATED):
                raise common.AgentError("corrupt object stream (tag %r)" % tag)
            kind, size = struct.unpack(">BQ", common.read_exact(9))
            oid = common.read_exact(20).hex()
            pieces = _Counted(_pieces()) if tag == DEFLATED else None
            if error is None and (kind not in TYPES or len(writer.entries) >= count):
                error = "object %d of a pack of %d is of type %d" % (len(writer.entries) + 1, count, kind)
            if error is not None:
                if pieces is None:
                    _skip(size)
                else:
                    for _piece in pieces:
                        pass
            else:
                try:
                    if pieces is None:
                        writer.add(kind, size, oid, common.read_exact)  # reads all its bytes, then checks
                    else:
                        writer.add_deflated(kind, size, oid, pieces)
                except BadPack as exc:
                    error = str(exc)
            received += size if pieces is None else pieces.bytes
        if error is None:
            return writer.finish(), received, None
    except BadPack as exc:
        error = str(exc)
    finally:
        if error is not None or not writer.fh.closed:
            writer.discard()
    return None, received, error
