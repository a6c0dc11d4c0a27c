"""rv/agent/envs.py's housekeeping, on a local folder: what uv and pip leave too open is tightened,
and lock files of keys without an environment go with gc."""

from __future__ import annotations

import os
import time

import pytest

from rv.agent import common, envs


@pytest.fixture
def umask():
    saved = common.UMASK
    yield
    common.UMASK = saved


@pytest.mark.parametrize(("mask", "file_mode", "exe_mode"), [(0o077, 0o600, 0o700), (0o027, 0o640, 0o750)])
def test_tighten_takes_what_the_umask_forbids(tmp_path, umask, mask, file_mode, exe_mode):
    common.UMASK = mask
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    lock, exe = cache / ".lock", cache / "wheels" / "uv"
    lock.write_text("")
    exe.write_text("")
    os.chmod(lock, 0o666)  # what uv makes its lock files, whatever the umask
    os.chmod(exe, 0o711)  # what pip makes an executable under umask 077
    os.chmod(cache / "wheels", 0o777)
    os.symlink("/etc/passwd", cache / "link")
    envs.tighten(bytes(cache), bytes(tmp_path / "absent"))
    assert lock.stat().st_mode & 0o777 == file_mode
    assert exe.stat().st_mode & 0o777 == 0o711 & ~mask  # 0700, or 0710 shared with the group
    assert (cache / "wheels").stat().st_mode & 0o777 == exe_mode
    assert os.stat("/etc/passwd").st_mode & 0o777 == 0o644  # a link's target is never touched


def test_gc_removes_day_old_lock_files_of_keys_without_an_environment(tmp_path):
    base = tmp_path / "envs"
    (base / "kept").mkdir(parents=True)
    day_old = time.time() - 2 * 86400
    for name in ("failed.lock", "kept.lock", "fresh.lock"):
        (base / name).write_text("")
        if name != "fresh.lock":
            os.utime(base / name, (day_old, day_old))

    class Freed:
        bytes = 0

        def note(self, path):
            pass

    envs.gc_envs(bytes(tmp_path), 86400.0, set(), Freed(), False)
    assert sorted(p.name for p in base.iterdir()) == ["fresh.lock", "kept", "kept.lock"]


def test_a_lock_removed_while_held_is_taken_anew_by_whoever_waited(tmp_path):
    # rv gc removes a name's lock file while holding it (issue 33: one file per name ever used stayed
    # forever); a waiter must then lock the file the path names, never the removed one.
    import threading

    from rv.agent import locks

    path = str(tmp_path / "names" / "p" / "run.lock").encode()
    got = []
    with locks.lock(path, "rv gc"):

        def waiter():
            with locks.lock(path, "rv run", wait=10):
                got.append(os.stat(path).st_ino)

        other = threading.Thread(target=waiter)
        other.start()
        time.sleep(0.5)  # the waiter is blocked on the held lock
        os.unlink(path)
    other.join(10)
    # The waiter holds the file the path names (the removed one would lock nothing).
    assert got and os.path.exists(path) and got[0] == os.stat(path).st_ino
