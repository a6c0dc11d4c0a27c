"""The snapshot manifest: the one format the laptop and the agent share, byte for byte.

A manifest is text: one line per file, ``["path",mode,"oid",size]`` in JSON (ASCII only, so no line
can hold a raw newline), sorted by the path's bytes; the snapshot id is a hash of that text. A line
is found by binary search and replaced in place, so a manifest made from a known one by a few
changes costs Python work in proportion to the changes (on both sides), plus one pass of C over
the bytes (a copy and a hash): a resubmit of a 50,000-file repo never parses 50,000 lines.

Paths travel as UTF-8 with surrogate escapes and are used as bytes, so file names that are not
valid UTF-8, and a cluster whose locale is C, both work.

Imports nothing of the agent: laptop modules import this one (a shared format: see :mod:`rv.agent`).
"""

import hashlib
import json
import re

MODE_FILE = 0o100644

MODE_EXEC = 0o100755

MODE_LINK = 0o120000


def enc(path):
    return path.encode("utf-8", "surrogateescape")


def dec(path):
    return path.decode("utf-8", "surrogateescape")


def blob_hasher(size):
    """git's blob id: sha1 over ``blob <size>\\0`` and the content."""
    h = hashlib.sha1()
    h.update(b"blob " + str(size).encode("ascii") + b"\0")
    return h


def sort_entries(entries):
    return sorted(entries, key=lambda e: enc(e[0]))


# A manifest is text: one line per file, ``["path",mode,"oid",size]`` in JSON (ASCII only, so no
# line can hold a raw newline), sorted by the path's bytes; the snapshot id is a hash of that text.
# A line is found by binary search and replaced in place, so a manifest made from a known one by a
# few changes costs Python work in proportion to the changes (on both sides), plus one pass of C
# over the bytes (a copy and a hash): a resubmit of a 50,000-file repo never parses 50,000 lines.
MANIFEST_TAG = b"rv-snapshot-2\n"

_LINE = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

# A path of printable ASCII without a quote or a backslash is its own JSON string: such lines are
# formatted directly, the JSON encoder (a third of a 50,000-file listing's Python time) is for others.
_PLAIN = re.compile(r"[ !#-\[\]-~]*\Z")


def manifest_line(row):
    path, mode, oid, size = row[0], row[1], row[2], row[3]
    if _PLAIN.match(path) and type(mode) is int and type(size) is int:
        return ('["%s",%d,"%s",%d]\n' % (path, mode, oid, size)).encode("ascii")
    return _LINE.encode([path, mode, oid, size]).encode("ascii") + b"\n"


def manifest_text(rows):
    """The manifest of rows ``[path, mode, oid, size]`` given in any order."""
    return b"".join(manifest_line(r) for r in sort_entries(rows))


def text_id(text):
    h = hashlib.sha256(MANIFEST_TAG)
    h.update(text)
    return h.hexdigest()[:24]


def manifest_id(entries):
    """The snapshot id of rows ``[path, mode, oid, size]`` (any order)."""
    return text_id(manifest_text(entries))


def parse_line(line):
    return json.loads(line.decode("ascii"))


def manifest_rows(text):
    """Every row of a manifest (one C-speed parse)."""
    if not text:
        return []
    return json.loads((b"[" + text[:-1].replace(b"\n", b",") + b"]").decode("ascii"))


def find_line(text, key, lo=0):
    """``(start, end, found)``: the line whose path's bytes are ``key``, or where it would go.

    ``lo`` is a line start the search begins at (the lines before it sort before ``key``).
    """
    hi = len(text)
    while lo < hi:
        mid = (lo + hi) // 2
        start = text.rfind(b"\n", lo, mid) + 1
        if start < lo:
            start = lo
        end = text.index(b"\n", start) + 1
        k = line_key(text, start, end)
        if k < key:
            lo = end
        elif k > key:
            hi = start
        else:
            return start, end, True
    return lo, lo, False


def line_key(text, start, end):
    """The path's bytes of the line ``text[start:end]``. A line without a backslash holds its path
    verbatim between its first two quotes (JSON escapes quotes and non-ASCII with backslashes): no
    JSON parse, which made a search of a 50,000-line manifest cost 16 of them."""
    close = text.find(b'"', start + 2, end)
    if close < 0 or text.find(b"\\", start, close) >= 0:
        return enc(parse_line(text[start:end])[0])
    return text[start + 2 : close]


def row_at(text, path):
    """The row of ``path`` in a manifest, or None."""
    start, end, found = find_line(text, enc(path))
    return parse_line(text[start:end]) if found else None


def has_under(text, folder):
    """Does the manifest hold anything inside ``folder`` (a path without the trailing slash)?"""
    prefix = enc(folder) + b"/"
    start, _end, _found = find_line(text, prefix)
    if start >= len(text):
        return False
    end = text.index(b"\n", start) + 1
    return enc(parse_line(text[start:end])[0]).startswith(prefix)


def splice(text, changes):
    """``(new text, old rows)``: ``changes`` ({path: row, or None to remove}) applied to a manifest.

    ``old rows`` maps each changed path to the row it replaced (None where there was none).
    """
    if len(changes) > 64 and len(changes) * 12 > text.count(b"\n"):
        # Many changes: one parse of everything is cheaper than a search per change.
        by_path = dict((r[0], r) for r in manifest_rows(text))
        old = dict((p, by_path.get(p)) for p in changes)
        for path, row in changes.items():
            if row is None:
                by_path.pop(path, None)
            else:
                by_path[path] = row
        return manifest_text(list(by_path.values())), old
    out, old, pos = [], {}, 0
    for key, path in sorted((enc(p), p) for p in changes):
        start, end, found = find_line(text, key, pos)
        old[path] = parse_line(text[start:end]) if found else None
        out.append(text[pos:start])
        row = changes[path]
        if row is not None:
            out.append(manifest_line(row))
        pos = end if found else start
    out.append(text[pos:])
    return b"".join(out), old


def same_mtime(a, b):
    """Equal mtimes, allowing for a file system that keeps whole seconds only (Lustre, some NFS)."""
    if a == b:
        return True
    return a // 1000000000 == b // 1000000000 and (a % 1000000000 == 0 or b % 1000000000 == 0)
