"""What rv keeps on the cluster, and the site's quota: pure parsers of the quota tools' text.

The agent (rv/agent/quota.py) runs whichever tool the remote root's filesystem has: ``lfs quota``
(Lustre), ``mmlsquota`` (GPFS / Spectrum Scale) or ``quota`` (Linux quotas, NFS through rquotad), and
sends their text back as printed. These parsers read the forms the tools print (the unit tests hold
samples in each form): columns split on blanks, where ``quota`` leaves a grace column empty unless
the user is over a limit (marked ``*``), names too long for their column wrap onto a line of their
own, Lustre brackets values it is unsure of (``[1041408]``), and ``-h``/``-s``/``--block-size auto``
print sizes with units. A limit of 0 means none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# rv run warns when a run would take the user's file count past this share of the file quota.
QUOTA_WARN_SHARE = 0.9

_NUMBER = re.compile(r"^\[?(\d+(?:\.\d+)?)([kKmMgGtTpP]?)\]?\*?$")
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


@dataclass(frozen=True)
class Quota:
    """A user's usage and limits on one filesystem, as the site's tool printed them (None: no limit)."""

    tool: str  # lfs, mmlsquota, quota
    filesystem: str
    bytes_used: int | None
    bytes_limit: int | None
    files_used: int | None
    files_limit: int | None

    @property
    def files_share(self) -> float | None:
        if not self.files_limit or self.files_used is None:
            return None
        return self.files_used / self.files_limit


def _number(token: str) -> bool:
    return bool(_NUMBER.match(token))


def _value(token: str, unit: int | None, scale: Mapping[str, int]) -> int | None:
    """A column's value: ``unit`` multiplies a plain number (1024 for a KB column); a suffix wins."""
    m = _NUMBER.match(token)
    if not m:
        return None
    number, suffix = float(m.group(1)), m.group(2).lower()
    if suffix:
        return int(number * scale[suffix])
    return int(number * (unit or 1))


def _limit(soft: int | None, hard: int | None) -> int | None:
    """The quota a user meets first: the soft one (grace starts there), else the hard one; 0 is none."""
    limits = [v for v in (soft, hard) if v]
    return min(limits) if limits else None


def _quota(tool: str, name: str, space: Sequence[str], files: Sequence[str], unit: int | None) -> Quota:
    """A row's (used, soft, hard) of space (plain numbers times ``unit``) and of files."""
    return Quota(
        tool, name,
        bytes_used=_value(space[0], unit, _BINARY),
        bytes_limit=_limit(_value(space[1], unit, _BINARY), _value(space[2], unit, _BINARY)),
        files_used=_value(files[0], 1, _DECIMAL),
        files_limit=_limit(_value(files[1], 1, _DECIMAL), _value(files[2], 1, _DECIMAL)),
    )  # fmt: skip


def _rows(lines: Sequence[str]) -> list[list[str]]:
    """The data rows under a ``Filesystem`` header: a name alone on its line (too long for its
    column) is joined to the numbers on the next."""
    rows: list[list[str]] = []
    pending: str | None = None
    in_table = False
    for line in lines:
        words = line.split()
        if not words:
            continue
        if words[0] in ("Filesystem", "Name") or words[0].startswith("Disk"):
            in_table = words[0] in ("Filesystem", "Name")
            pending = None
            continue
        if not in_table:
            continue
        if len(words) == 1 and not _number(words[0]):
            pending = words[0]
            continue
        if pending is not None and _number(words[0]):
            words = [pending, *words]
        pending = None
        rows.append(words)
    return rows


def parse_lfs_quota(text: str) -> list[Quota]:
    """``lfs quota -u USER PATH`` (also ``-h``): Filesystem, kbytes|used, quota, limit, grace, files,
    quota, limit, grace."""
    lines = text.splitlines()
    header = next((ln.split() for ln in lines if ln.split()[:1] == ["Filesystem"]), [])
    unit = 1024 if len(header) > 1 and header[1] == "kbytes" else None
    out = []
    for words in _rows(lines):
        nums = words[1:]
        if len(nums) < 7 or not _number(nums[0]) or not _number(nums[4]):
            continue
        out.append(_quota("lfs", words[0], nums[0:3], nums[4:7], unit))
    return out


def parse_quota(text: str) -> list[Quota]:
    """``quota -w -u USER`` (also ``-s``): Filesystem, blocks|space, quota, limit, [grace], files,
    quota, limit, [grace]; a grace column is printed only when its usage is over a limit."""
    lines = text.splitlines()
    header = next((ln.split() for ln in lines if ln.split()[:1] == ["Filesystem"]), [])
    unit = 1024 if len(header) > 1 and header[1] == "blocks" else None
    out = []
    for words in _rows(lines):
        nums = words[1:]
        if len(nums) < 6 or not all(_number(t) for t in nums[:3]):
            continue
        rest = nums[3:]
        if rest and not _number(rest[0]):
            rest = rest[1:]  # the block grace (6days, 00:30, none)
        if len(rest) < 3 or not all(_number(t) for t in rest[:3]):
            continue
        out.append(_quota("quota", words[0], nums[0:3], rest[0:3], unit))
    return out


def parse_mmlsquota(text: str) -> list[Quota]:
    """``mmlsquota -u USER [--block-size 1K|auto]``: per row, left of ``|`` Filesystem [Fileset] type,
    KB|blocks, quota, limit, in_doubt, grace; right of it files, quota, limit, in_doubt, grace,
    remarks. A row ``no limits`` has none."""
    out = []
    unit: int | None = 1024
    for line in text.splitlines():
        if "|" not in line:
            continue  # the "Block Limits | File Limits" line has one too, and no numbers
        left, right = (part.split() for part in line.split("|", 1))
        if left[:1] in (["Filesystem"], ["Name"]):
            unit = 1024 if "KB" in left else None
            continue
        if len(left) < 7 or len(right) < 3 or not _number(left[-5]) or not _number(right[0]):
            continue
        out.append(_quota("mmlsquota", left[0], left[-5:-2], right[0:3], unit))
    return out


PARSERS = {"lfs": parse_lfs_quota, "quota": parse_quota, "mmlsquota": parse_mmlsquota}


@dataclass(frozen=True)
class QuotaReport:
    """What the quota tools said: every row, which of them hold the remote root, and what failed."""

    quotas: tuple[Quota, ...]
    root: tuple[Quota, ...]  # the rows of the remote root's filesystem
    tools: tuple[str, ...]  # the tools that answered
    errors: tuple[str, ...]


def read_quota_report(reply: Mapping[str, Any] | None) -> QuotaReport:
    """The agent's ``quota`` answer (rv/agent/quota.py) parsed; no tool on the cluster: all empty."""
    reply = reply or {}
    quotas: list[Quota] = []
    root: list[Quota] = []
    tools, errors = [], []
    mount, source = reply.get("mount") or "", reply.get("source") or ""
    for answer in reply.get("tools") or ():
        tool = str(answer.get("tool"))
        if answer.get("error") or (answer.get("code") not in (0, None) and not answer.get("text")):
            errors.append(f"{tool}: {answer.get('error') or (answer.get('err') or '').strip()[-200:]}")
            continue
        rows = PARSERS[tool](str(answer.get("text") or "")) if tool in PARSERS else []
        tools.append(tool)
        quotas += rows
        if tool == "lfs":
            root += rows  # asked about the root's own path
        else:
            names = {mount, source, source.rsplit("/", 1)[-1]} - {""}
            root += [q for q in rows if q.filesystem in names]
    return QuotaReport(tuple(quotas), tuple(root), tuple(tools), tuple(errors))


def quota_warning(quotas: Sequence[Quota], new_files: int) -> str | None:
    """What ``rv run`` says when ``new_files`` more would pass 90% of a file quota (the tightest)."""
    for q in sorted(quotas, key=lambda q: -(q.files_share or 0)):
        if not q.files_limit or q.files_used is None:
            continue
        after = q.files_used + new_files
        if after >= QUOTA_WARN_SHARE * q.files_limit:
            return (
                f"file quota on {q.filesystem}: {q.files_used:,} of {q.files_limit:,} files used "
                f"({q.files_used / q.files_limit:.0%}), {after / q.files_limit:.0%} with this run's "
                f"{new_files:,}; `rv gc` removes what ended runs left, and --work-dir node keeps work dirs "
                "off the shared filesystem"
            )
    return None
