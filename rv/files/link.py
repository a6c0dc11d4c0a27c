"""How an upload's packs are made, chosen by the link rv measured to the cluster.

An edit's blobs can go whole (no delta search here, no delta resolution on the cluster, more bytes)
or as deltas of the versions the cluster holds (fewer bytes, more CPU on both sides); the packs can be
stored (zlib level 0) or compressed (level 1). Which is faster depends on the link: on the loopback
cluster, or a campus network, whole and stored; on a laptop over a VPN, deltas and level 1.

The rate is measured while an upload's packs stream (Meter: the bytes the connection took over the
time it spent taking them, not the time pack-objects spent making them) and kept per cluster in the
cache folder (``links/<store>``, LinkRate). The choice is a pure function of it (choose);
``RV_PACK_COMPRESSION`` set still decides alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from rv.config import write_private

# The figures the rules below come from (docs/measured.md, "After the profile's changes", issue 44):
# 500 edited files of benchmarks/sync.py's 50,000 (9.8 MB) as a thin pack of deltas cost 0.13 s of
# delta search here and 0.23 s of resolution on the cluster (index-pack --fix-thin), against 0.07 s
# and 0.07 s whole; the deltas were 0.8 MB. So deltas cost 0.22 s more CPU per 9.8 MB of blobs and
# save 92% of their bytes.
DELTA_S_PER_BYTE = (0.13 + 0.23 - 0.07 - 0.07) / 9.8e6
DELTA_BYTES_RATIO = 0.8 / 9.8
# Level 1 against level 0: 4.3 s against 1.1 s of pack-objects' CPU for 200 MB (packs.py's
# PACK_COMPRESSION comment, benchmarks/sync.py), and it saves 58% of the bytes of source code (rv's
# own blobs at HEAD, 3.24 MB stored against 1.37 MB at level 1).
LEVEL1_S_PER_BYTE = (4.3 - 1.1) / 200e6
LEVEL1_SAVES = 1 - 1.37 / 3.24

# A link not measured yet: an edit's blobs whole below this (a slow link loses little on a small
# edit), deltas above (a fast link loses little on the delta work of a large one); level 0, which
# costs nothing where the link is fast and the most a slow one can lose is what level 1 would save.
UNKNOWN_WHOLE_MAX_BYTES = 1 << 20

# Only a send this large measures the link: SSH's window (2 MB in paramiko) and the pipes take a
# smaller one in at once, whatever the link.
MEASURE_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class PackChoice:
    deltas: bool  # an edit's blobs as deltas of the versions the cluster holds
    level: int  # pack-objects' zlib level


def whole_is_faster(blob_bytes: int, rate: float) -> bool:
    """Do an edit's ``blob_bytes`` go faster whole than as deltas over a link of ``rate`` bytes/s?
    Whole when the bytes deltas would save take less time on the link than the delta work costs."""
    extra = blob_bytes * (1 - DELTA_BYTES_RATIO)
    return extra / rate <= blob_bytes * DELTA_S_PER_BYTE


def compression_pays(rate: float) -> bool:
    """Does level 1 beat level 0 over a link of ``rate`` bytes/s? When the bytes it saves take
    longer on the link than its CPU: below ~36 MB/s with the figures above."""
    return LEVEL1_SAVES / rate > LEVEL1_S_PER_BYTE


def choose(blob_bytes: int, rate: float | None, explicit_level: int | None = None) -> PackChoice:
    """How to pack an upload whose edited blobs weigh ``blob_bytes``, over a link measured at ``rate``
    bytes/s (None: not measured). ``explicit_level`` (RV_PACK_COMPRESSION) decides alone: any level
    above 0 says the link is slow, so deltas too."""
    if explicit_level is not None:
        return PackChoice(deltas=explicit_level > 0, level=explicit_level)
    if rate is None:
        return PackChoice(deltas=blob_bytes >= UNKNOWN_WHOLE_MAX_BYTES, level=0)
    return PackChoice(deltas=not whole_is_faster(blob_bytes, rate), level=1 if compression_pays(rate) else 0)


def level_now(kept: float | None, measured: float | None, explicit_level: int | None = None) -> int:
    """The zlib level for what an upload packs next: ``explicit_level`` (RV_PACK_COMPRESSION) decides
    alone; else the rate measured so far in this upload (``measured``: the link now), else the one
    kept from an earlier upload; with neither, 0 (a first upload's first packs measure the link)."""
    if explicit_level is not None:
        return explicit_level
    rate = measured if measured is not None else kept
    return 1 if rate is not None and compression_pays(rate) else 0


class LinkRate:
    """The last rate measured to one cluster (per store key: a profile and its remote root), in
    ``<cache>/links/<store>``. A file missing, damaged or of another shape is a link not measured."""

    def __init__(self, directory: Path, key: str) -> None:
        self.key = key
        name = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:20]
        self.path = directory / "links" / name

    def read(self) -> float | None:
        try:
            data = json.loads(self.path.read_text())
            rate = float(data["bytes_per_s"]) if isinstance(data, dict) else math.nan
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None
        return rate if math.isfinite(rate) and rate > 0 else None

    def write(self, sent: int, seconds: float) -> None:
        """Keep the rate of ``sent`` bytes in ``seconds`` (written whole, renamed into place)."""
        data = {"key": self.key, "bytes_per_s": sent / seconds, "bytes": sent, "seconds": seconds}
        with contextlib.suppress(OSError):  # a cache: without it the next upload decides by size
            write_private(self.path, json.dumps({**data, "at": time.time()}).encode())


class Meter:
    """The bytes of a stream and the time its consumer (the connection) spent taking them: time it
    held the stream between two chunks, not the time spent making them."""

    def __init__(self) -> None:
        self.sent = 0
        self.seconds = 0.0

    def add(self, n: int, seconds: float) -> None:
        self.sent += n
        self.seconds += seconds

    def rate(self) -> float | None:
        """Bytes per second so far, once enough has gone to measure the link (None before)."""
        if self.sent < MEASURE_MIN_BYTES or self.seconds <= 0:
            return None
        return self.sent / self.seconds

    def keep(self, link: LinkRate | None) -> bool:
        """Record the rate in ``link`` when this stream was large enough to measure it."""
        if link is None or self.rate() is None:
            return False
        link.write(self.sent, self.seconds)
        return True
