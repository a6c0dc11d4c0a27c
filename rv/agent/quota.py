"""The site's quota tools, asked about the user: ``lfs quota`` (Lustre), ``mmlsquota`` (GPFS /
Spectrum Scale) and ``quota`` (Linux disk quotas, NFS through rquotad), whichever are on PATH.

Their text goes back as printed; the laptop parses it (rv.job.footprint, pure parsers tested on
captured output). Each tool is bounded by a timeout: ``quota`` can hang on a dead NFS server, and a
status or a submit must not. Also the filesystem the remote root is on (its mount point and source,
from /proc/mounts), so the laptop can tell which of the rows is the one rv's files count against.
"""

import os
import pwd
import shutil
import subprocess

from rv.agent import manifest

TIMEOUT_S = 5


def _mount_of(path):
    """(mount point, source, type) of the filesystem holding ``path``, from /proc/mounts (or Nones)."""
    path = os.path.realpath(manifest.dec(path))
    best = (None, None, None)
    try:
        with open("/proc/mounts") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        # /proc/mounts escapes spaces and such as octal.
        point = parts[1].encode("latin-1").decode("unicode_escape")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0] or ""):
            best = (point, parts[0], parts[2])
    return best


def _ask(argv):
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"argv": argv, "error": "no answer in %d s" % TIMEOUT_S}
    except OSError as exc:
        return {"argv": argv, "error": str(exc)}
    return {
        "argv": argv,
        "code": proc.returncode,
        "text": proc.stdout.decode("utf-8", "replace")[-20000:],
        "err": proc.stderr.decode("utf-8", "replace")[-2000:],
    }


def report(root):
    """What the quota tools on PATH say about this user, and where the remote root is mounted."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    point, source, fstype = _mount_of(root)
    out = {"mount": point, "source": source, "fstype": fstype, "tools": []}
    here = manifest.dec(root) if os.path.isdir(root) else point or "/"
    # The tool of the root's own filesystem: lfs for Lustre, mmlsquota for GPFS, else quota.
    if fstype == "lustre" and shutil.which("lfs"):
        out["tools"].append(dict(_ask(["lfs", "quota", "-u", user, here]), tool="lfs"))
    elif fstype == "gpfs" and shutil.which("mmlsquota"):
        out["tools"].append(dict(_ask(["mmlsquota", "-u", user, "--block-size", "1K"]), tool="mmlsquota"))
    elif shutil.which("quota"):
        # -w: one line per filesystem (no wrapping of long names); -u: this user's; no -s: plain numbers.
        out["tools"].append(dict(_ask(["quota", "-w", "-u", user]), tool="quota"))
    return out
