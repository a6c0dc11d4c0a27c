"""A real filesystem whose flock fails: a FUSE passthrough that answers flock with ENOLCK.

Some Lustre and NFS mounts answer ``flock`` like this (ENOLCK, ENOSYS); rv's locks must still
work there. Run as root: ``python noflock_fs.py BACKING MOUNTPOINT`` (stays in the foreground;
``fusermount -u MOUNTPOINT`` or SIGTERM ends it). Files are created as the calling user.

fusepy's operations table stops before libfuse 2.9's ``flock`` member, and without it the kernel
would emulate flock locally (and it would work): the table is extended here so the kernel forwards
flock to this filesystem, which refuses it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import fuse
from fuse import FUSE, FuseOSError, Operations, fuse_file_info


class _Ops(ctypes.Structure):
    # fusepy's table, then libfuse 2.9's members after ioctl: poll, write_buf, read_buf, flock, fallocate.
    _fields_ = [
        *fuse.fuse_operations._fields_,
        ("poll", ctypes.c_void_p),
        ("write_buf", ctypes.c_void_p),
        ("read_buf", ctypes.c_void_p),
        (
            "flock",
            ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(fuse_file_info), ctypes.c_int),
        ),
        ("fallocate", ctypes.c_void_p),
    ]


fuse.fuse_operations = _Ops


class _Fuse(FUSE):
    def flock(self, path, fip, op):
        return self.operations("flock", path.decode(self.encoding), fip.contents.fh, op)


class NoFlock(Operations):
    """Passthrough to ``root``; new files and folders belong to the caller; flock fails."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _own(self, path: str) -> None:
        uid, gid, _ = fuse.fuse_get_context()
        os.lchown(path, uid, gid)

    def getattr(self, path, fh=None):
        st = os.lstat(self._p(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
        return {**{k: getattr(st, k) for k in keys}, "st_blocks": st.st_blocks}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._p(path))]

    def readlink(self, path):
        return os.readlink(self._p(path))

    def mkdir(self, path, mode):
        os.mkdir(self._p(path), mode)
        self._own(self._p(path))

    def rmdir(self, path):
        os.rmdir(self._p(path))

    def unlink(self, path):
        os.unlink(self._p(path))

    def symlink(self, name, target):
        os.symlink(target, self._p(name))
        self._own(self._p(name))

    def rename(self, old, new):
        os.rename(self._p(old), self._p(new))

    def link(self, target, name):
        os.link(self._p(name), self._p(target))

    def chmod(self, path, mode):
        os.chmod(self._p(path), mode)

    def chown(self, path, uid, gid):
        os.lchown(self._p(path), uid, gid)

    def utimens(self, path, times=None):
        os.utime(self._p(path), times)

    def truncate(self, path, length, fh=None):
        os.truncate(self._p(path), length)

    def statfs(self, path):
        st = os.statvfs(self._p(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag")
        return {**{k: getattr(st, k) for k in keys}, "f_frsize": st.f_frsize, "f_namemax": st.f_namemax}

    def open(self, path, flags):
        return os.open(self._p(path), flags)

    def create(self, path, mode, fi=None):
        fd = os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        self._own(self._p(path))
        return fd

    def read(self, path, length, offset, fh):
        return os.pread(fh, length, offset)

    def write(self, path, data, offset, fh):
        return os.pwrite(fh, data, offset)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        os.fsync(fh)

    def release(self, path, fh):
        os.close(fh)

    def flock(self, path, fh, op):
        raise FuseOSError(errno.ENOLCK)  # as Lustre mounted without flock, or NFS without a lock manager


if __name__ == "__main__":
    _Fuse(NoFlock(sys.argv[1]), sys.argv[2], foreground=True, allow_other=True, default_permissions=True)
