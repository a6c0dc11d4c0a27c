"""``rv sync push`` and ``pull`` on the cluster side: ``scan``, ``apply`` and ``send``.

``scan``   list a file or folder (size, mtime, mode; blob ids where asked) for push and pull
``apply``  carry out a push plan: deletions, uploads, chmods, symlinks
``send``   stream files back for pull
"""

import contextlib
import os
import stat
import struct
import sys

from rv.agent import common, manifest


def file_oid(path, size):
    h = manifest.blob_hasher(size)
    with open(path, "rb") as fh:
        for data in iter(lambda: fh.read(common.CHUNK), b""):
            h.update(data)
    return h.hexdigest()


def mode_scan(args):
    """List ``path``: ``[rel, kind, mode, size, mtime_ns, extra]``; extra = link target or blob id.

    Blob ids are computed only for files the client listed with the same size but another mtime:
    the quick check (size + mtime, as rsync) settles the rest without reading them.
    """
    base = common.resolve(args["root"], args["path"])
    hdr = common.read_header()
    local = hdr.get("local") or {}
    skip_git = bool(args.get("skip_git"))
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        return {"kind": "missing", "path": manifest.dec(base), "entries": []}

    def row(rel, path, st):
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            return [rel, "l", mode, st.st_size, st.st_mtime_ns, manifest.dec(os.readlink(path))]
        if stat.S_ISDIR(st.st_mode):
            return [rel, "d", mode, 0, st.st_mtime_ns, None]
        if not stat.S_ISREG(st.st_mode):
            return None  # sockets, fifos, devices: never synced
        extra = None
        want = local.get(rel)
        if want and want[0] == st.st_size and not manifest.same_mtime(want[1], st.st_mtime_ns):
            with contextlib.suppress(OSError):
                extra = file_oid(path, st.st_size)
        return [rel, "f", mode, st.st_size, st.st_mtime_ns, extra]

    if not stat.S_ISDIR(st.st_mode):
        r = row("", base, st)
        return {"kind": "file", "path": manifest.dec(base), "entries": [r] if r else []}
    entries = []
    stack = [(base, "")]
    while stack:
        directory, prefix = stack.pop()
        try:
            it = list(os.scandir(directory))
        except OSError as exc:
            raise common.AgentError(
                "cannot list %s: %s" % (manifest.dec(directory), exc.strerror), "remote"
            ) from None
        for de in it:
            name = manifest.dec(de.name)
            if skip_git and name == ".git":
                continue
            rel = prefix + name
            est = de.stat(follow_symlinks=False)
            r = row(rel, de.path, est)
            if r is None:
                continue
            entries.append(r)
            if r[1] == "d":
                stack.append((de.path, rel + "/"))
    entries.sort(key=lambda e: manifest.enc(e[0]))
    return {"kind": "dir", "path": manifest.dec(base), "entries": entries}


def mode_apply(args):
    base = common.resolve(args["root"], args["path"])
    plan = common.read_header()
    common.makedirs(base)

    def target(rel):
        return common.join(base, manifest.enc(common.check_relpath(rel)))

    done = {"deleted": 0, "uploaded": 0, "uploaded_bytes": 0, "bad": []}
    for rel in plan.get("delete", ()):
        p = target(rel)
        if os.path.lexists(p):
            common.force_rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
            done["deleted"] += 1
    for rel, mode, size, oid, mtime_ns in plan.get("upload", ()):
        p = target(rel)
        parent = os.path.dirname(p)
        common.makedirs(parent)
        tmp = common.temp_name(parent, "up")
        common.cleanup_paths.add(tmp)
        try:
            hasher = manifest.blob_hasher(size)
            common.receive_into(tmp, size, hasher)
            if hasher.hexdigest() != oid:
                done["bad"].append(rel)
                continue
            os.chmod(tmp, common.private(mode))
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
            if os.path.isdir(p) and not os.path.islink(p):
                common.force_rmtree(p)
            os.replace(tmp, p)
            done["uploaded"] += 1
            done["uploaded_bytes"] += size
        finally:
            common.cleanup_paths.discard(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    if common.read_exact(1) != b"E":
        raise common.AgentError("corrupt push stream")
    for rel, link in plan.get("symlink", ()):
        p = target(rel)
        common.makedirs(os.path.dirname(p))
        if os.path.lexists(p):
            common.force_rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        os.symlink(manifest.enc(link), p)
    for rel, mode in plan.get("chmod", ()):
        os.chmod(target(rel), common.private(mode))
    for rel, mtime_ns in plan.get("touch", ()):
        os.utime(target(rel), ns=(mtime_ns, mtime_ns))
    for rel in sorted(plan.get("rmdir", ()), key=lambda r: -r.count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(target(rel))  # not empty (something appeared since the scan): keep it
    return done


def mode_send(args):
    """Stream files for pull. Frames, in request order:

    ``F idx:4 size:8 mtime_ns:8 mode:4 <content> sha1:20 changed:1``  content follows
    ``S idx:4 mtime_ns:8 mode:4``  same content as the client's copy (its blob id matched)
    ``X idx:4 len:4 <message>``  could not be read
    then ``E``.
    """
    base = common.resolve(args["root"], args["path"])
    files = common.read_header()["files"]
    out = sys.stdout.buffer
    for idx, (rel, local_oid) in enumerate(files):
        path = base if rel == "" else common.join(base, manifest.enc(common.check_relpath(rel)))
        try:
            fh = open(path, "rb")
        except OSError as exc:
            msg = (exc.strerror or str(exc)).encode("utf-8", "replace")
            out.write(b"X" + struct.pack(">II", idx, len(msg)) + msg)
            continue
        with fh:
            st = os.fstat(fh.fileno())
            mode = stat.S_IMODE(st.st_mode)
            if local_oid and file_oid(path, st.st_size) == local_oid:
                out.write(b"S" + struct.pack(">IqI", idx, st.st_mtime_ns, mode))
                continue
            out.write(b"F" + struct.pack(">IQqI", idx, st.st_size, st.st_mtime_ns, mode))
            hasher = manifest.blob_hasher(st.st_size)
            left, changed = st.st_size, 0
            while left:
                data = fh.read(min(common.CHUNK, left))
                if not data:
                    data = b"\0" * min(common.CHUNK, left)  # shrank while read: keep the frame's length
                    changed = 1
                hasher.update(data)
                out.write(data)
                left -= len(data)
            if fh.read(1):
                changed = 1  # grew while read: the client gets the first `size` bytes and a warning
            out.write(hasher.digest() + bytes([changed]))
    out.write(b"E")
    out.flush()
    return None
