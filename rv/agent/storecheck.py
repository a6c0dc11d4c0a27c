#!/usr/bin/env python3
"""The store's repairs: a snapshot whose bytes cannot be read, and git's gc kept working.

Shipped beside job.sh into ``<root>/runtime/`` (the job runs it, with whatever ``python3`` the node
has) and also a module of the agent program (rv.agent.store imports it for ``rv gc``): standard
library only, Python 3.6, nothing of rv imported.

``store-check.py check STORE COMMIT SNAPSHOT``
    after the job could not check its snapshot out: reads every object ``COMMIT`` reaches (each
    one's bytes hashed again: a pack with bytes overwritten passes every "is the file there" check),
    names the paths that are damaged or missing, and sets aside each pack holding a damaged object
    (moved into ``STORE/rv-damaged/``, never deleted: another job may be reading it), then drops the
    refs (and meta files) of every snapshot that lost objects with it: the next ``rv run`` of each
    finds what the store lacks and sends it again.
    When some are damaged, prints a line naming the paths (damaged, and missing if any) and exits 0;
    else exits 1 (only missing objects: a purge, which the job's own message names).
``store-check.py tidy STORE WHO``
    the job's background ``git gc --auto``, unreachable objects in a cruft pack (never exploded into
    loose files). A ref whose objects are gone (a purge) and a pack git calls corrupt would fail
    every gc: the ref is dropped and the pack set aside, and gc tried again. A failure left is
    written to ``STORE/rv-gc-failed`` (``rv status`` shows it); a success removes that file.
"""

import hashlib
import os
import re
import struct
import subprocess
import sys
import threading
import time

DAMAGED = "rv-damaged"  # layout.STORE_DAMAGED: set-aside packs, a folder per event
GC_FAILED = "rv-gc-failed"  # layout.STORE_GC_FAILED: the last background gc's failure
SNAPSHOT_REFS = "refs/rv/snapshots/"

# git's gc as the store wants it: in the foreground (a detached gc outlives its job or rv call);
# nothing only a server needs (bitmaps, the commit-graph, the dumb-http listings: files a quota
# counts, for fetches and walks nobody makes here). Older git ignores a setting it does not know.
GC_SETTINGS = [
    "-c", "gc.autoDetach=false", "-c", "gc.writeCommitGraph=false", "-c", "repack.writeBitmaps=false",
    "-c", "repack.updateServerInfo=false",
]  # fmt: skip

_CORRUPT = re.compile(r"\(stored in ([^)\s]*/objects/pack/pack-[0-9a-f]{40}\.pack)\) is corrupt")
_OID = re.compile(r"^[0-9a-f]{40}$")


def git_env(store):
    """git on the store alone: none of the user's configuration, no GIT_* of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_DIR=store, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, HOME=store,
        XDG_CONFIG_HOME=store, GIT_TERMINAL_PROMPT="0", LC_ALL="C",
    )  # fmt: skip
    return env


def git(store, args, stdin=None):
    """(exit code, stdout, stderr) of ``git ARGS`` on the store."""
    proc = subprocess.Popen(
        ["git"] + list(args), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=git_env(store), cwd=store,
    )  # fmt: skip
    out, err = proc.communicate(stdin)
    return proc.returncode, out, err


# -- reading a snapshot, every byte checked -----------------------------------------------------------


class _Batch:
    """``git cat-file --batch`` over a list of objects; a corrupt object ends git (fatal): the
    objects after it are asked of a new one."""

    def __init__(self, store):
        self.store = store

    def read(self, oids, on_object):
        """``on_object(oid, kind, data or None)`` for each: data is None when the object is missing
        or unreadable or its bytes do not hash to its id; blobs' data are not kept (b"")."""
        left = list(oids)
        while left:
            done = self._one_process(left, on_object)
            if done < len(left):
                on_object(left[done], None, None)  # the object git died on
                done += 1
            left = left[done:]

    def _one_process(self, oids, on_object):
        proc = subprocess.Popen(
            ["git", "cat-file", "--batch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=git_env(self.store), cwd=self.store,
        )  # fmt: skip
        listing = "".join(o + "\n" for o in oids).encode("ascii")
        feeder = threading.Thread(target=_feed, args=(proc.stdin, listing))
        feeder.daemon = True
        feeder.start()
        done = 0
        try:
            for oid in oids:
                answer = _answer(proc.stdout, oid)
                if answer is False:
                    break
                kind, data = answer if answer is not None else (None, None)
                on_object(oid, kind, data)
                done += 1
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            feeder.join()
        return done


def _feed(pipe, data):
    try:
        pipe.write(data)
        pipe.close()
    except OSError:
        pass  # git stopped on a corrupt object: the reader tells which


def _answer(out, oid):
    """(kind, data) of the next answer; None: missing or bytes not its own; False: git stopped."""
    head = out.readline().split()
    if len(head) == 2 and head[1] == b"missing":
        return None
    if len(head) != 3 or head[0].decode("ascii", "replace") != oid:
        return False
    kind, size = head[1], int(head[2])
    digest = hashlib.sha1(kind + b" " + str(size).encode() + b"\0")
    keep = [] if kind in (b"tree", b"commit") else None
    left = size
    while left:
        piece = out.read(min(left, 1 << 20))
        if not piece:
            return False
        digest.update(piece)
        if keep is not None:
            keep.append(piece)
        left -= len(piece)
    if out.read(1) != b"\n":
        return False
    if digest.hexdigest() != oid:
        return None
    return kind.decode("ascii"), (b"".join(keep) if keep is not None else b"")


def _tree_entries(data):
    """(mode, name, oid) of each entry of a tree object."""
    i = 0
    while i < len(data):
        space = data.index(b" ", i)
        nul = data.index(b"\0", space)
        yield data[i:space], data[space + 1 : nul], data[nul + 1 : nul + 21].hex()
        i = nul + 21


def unreadable(store, commit):
    """``{oid: path}`` of the objects ``commit`` reaches that the store cannot give whole (missing
    ones included); a tree's path is its folder's (``""``: the top), the commit's is ``""``. What is
    under an unreadable tree is unknown, and not listed."""
    bad = {}
    paths = {commit: ""}
    level = [commit]
    batch = _Batch(store)
    while level:
        below = []

        def on_object(oid, kind, data, below=below):
            if data is None:
                bad[oid] = paths[oid]
            elif kind == "commit":
                tree = data[5:45].decode("ascii")  # "tree <oid>" is a commit's first line
                paths.setdefault(tree, "")
                below.append(tree)
            elif kind == "tree":
                for mode, name, child in _tree_entries(data):
                    if mode == b"160000" or child in paths:
                        continue  # a submodule's commit is not in the store; a shared object once
                    top = paths[oid]
                    paths[child] = (top + "/" if top else "") + name.decode("utf-8", "surrogateescape")
                    below.append(child)

        batch.read(level, on_object)
        level = below
    return bad


# -- which packs hold them, set aside ------------------------------------------------------------------


def _idx_names(path):
    """The sorted object ids (20 bytes each) in a pack index, version 1 or 2."""
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:4] == b"\xfftOc":
        count = struct.unpack(">I", data[8 + 255 * 4 : 8 + 256 * 4])[0]
        start = 8 + 256 * 4
        return [data[start + 20 * i : start + 20 * i + 20] for i in range(count)]
    count = struct.unpack(">I", data[255 * 4 : 256 * 4])[0]
    start = 256 * 4
    return [data[start + 24 * i + 4 : start + 24 * i + 24] for i in range(count)]


def holders(store, oids):
    """The packs (``.pack`` paths) and loose files in the store that hold any of ``oids``."""
    want = set(bytes.fromhex(o) for o in oids)
    folder = os.path.join(store, "objects", "pack")
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("pack-") and name.endswith(".idx"):
            try:
                names = _idx_names(os.path.join(folder, name))
            except (OSError, struct.error):
                continue
            if want.intersection(names):
                found.append(os.path.join(folder, name[:-4] + ".pack"))
    for oid in oids:
        loose = os.path.join(store, "objects", oid[:2], oid[2:])
        if os.path.exists(loose):
            found.append(loose)
    return found


def set_aside(store, paths):
    """Move packs (every file of each: its index first, so git stops seeing it) and loose objects
    into a folder of their own under ``STORE/rv-damaged/``; returns the names moved. A rename, never
    a deletion: a job reading the pack keeps its open file. ``rv gc`` removes the folder later."""
    if not paths:
        return []
    folder = os.path.join(store, DAMAGED, "%d-%d-%s" % (time.time(), os.getpid(), os.urandom(3).hex()))
    os.makedirs(folder, 0o700)
    moved = []
    for path in paths:
        if path.endswith(".pack"):
            stem = os.path.basename(path)[: -len(".pack")]
            siblings = sorted(
                (n for n in os.listdir(os.path.dirname(path)) if n.startswith(stem + ".")),
                key=lambda n: (not n.endswith(".idx"), n),
            )
            group = [os.path.join(os.path.dirname(path), n) for n in siblings]
        else:
            group = [path]
        for item in group:
            target = os.path.join(folder, os.path.basename(item))
            try:
                os.rename(item, target)
            except OSError:
                continue  # gone already: another job set it aside a moment ago
            if item == path:
                moved.append(os.path.basename(path))
    if not moved and not os.listdir(folder):
        os.rmdir(folder)
    return moved


def check(store, commit):
    """What ``check`` prints: the damaged and missing objects of ``commit``, and what was set aside."""
    bad = unreadable(store, commit)
    present = set()
    if bad:
        # Which of them the store has (a damaged object), and which it lacks (a purge).
        listing = "".join(o + "\n" for o in bad).encode("ascii")
        _rc, out, _err = git(store, ["cat-file", "--batch-check=%(objectname) ok"], stdin=listing)
        present = set(line.split()[0].decode("ascii") for line in out.splitlines() if line.endswith(b" ok"))
    damaged = sorted(o for o in bad if o in present)
    missing = sorted(o for o in bad if o not in present)
    aside = set_aside(store, holders(store, damaged)) if damaged else []
    # The refs of every snapshot that lost objects with the pack (this one's among them) go, with
    # their meta files: a ref stands for a whole snapshot, and one that is not fails git's gc. A
    # send sets them again.
    broken = broken_refs(store) if aside else []
    drop_snapshots(store, broken)
    return {
        "damaged": [[o, bad[o]] for o in damaged],
        "missing": [[o, bad[o]] for o in missing],
        "set_aside": aside,
        "dropped": [n[len(SNAPSHOT_REFS) :] for n in broken],
    }


def meta_path(store, sid):
    """layout.snapshot_meta: the snapshot's meta file beside the store."""
    return os.path.join(os.path.dirname(os.path.abspath(store)), "snapshots", sid + ".git.json")


# -- gc ---------------------------------------------------------------------------------------------


def broken_refs(store):
    """Snapshot refs whose commit, or an object under it, the store lacks: each fails git's gc for
    the whole repository ("bad object refs/...", "unable to read ...")."""
    rc, out, _err = git(store, ["rev-list", "--objects", "--missing=print", "--all"])
    if rc == 0 and b"\n?" not in b"\n" + out:
        return []
    _rc, refs, _err = git(store, ["for-each-ref", "--format=%(objectname) %(refname)", SNAPSHOT_REFS])
    broken = []
    for line in refs.decode("utf-8", "replace").splitlines():
        oid, _, name = line.partition(" ")
        rc, out, _err = git(store, ["rev-list", "--objects", "--missing=print", oid])
        if rc != 0 or b"\n?" in b"\n" + out:
            broken.append(name)
    return broken


def drop_refs(store, names):
    if names:
        git(store, ["update-ref", "--stdin"], stdin="".join("delete %s\n" % n for n in names).encode())


def drop_snapshots(store, names):
    """Drop the refs ``names`` and their snapshots' meta files (a send sets both again)."""
    drop_refs(store, names)
    for name in names:
        try:
            os.unlink(meta_path(store, name[len(SNAPSHOT_REFS) :]))
        except OSError:
            pass


def set_aside_corrupt(store, error):
    """Set aside the packs git's ``error`` calls corrupt (each fails every gc); their names."""
    return set_aside(store, sorted(set(p for p in _CORRUPT.findall(error) if os.path.exists(p))))


def tidy(store, who):
    """The job's background ``git gc --auto``: see the module's docstring."""
    args = GC_SETTINGS + ["-c", "gc.cruftPacks=true", "gc", "--auto", "--quiet"]
    error = ""
    for _attempt in range(3):
        rc, _out, err = git(store, args)
        error = err.decode("utf-8", "replace").strip()
        if rc == 0:  # another job's gc running is a 0 too, without a word (git's gc.pid, --auto)
            try:
                os.unlink(os.path.join(store, GC_FAILED))
            except OSError:
                pass
            return 0
        broken = broken_refs(store)
        drop_snapshots(store, broken)
        if not set_aside_corrupt(store, error) and not broken:
            break  # nothing to repair: gc's failure stands
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = "%s %s: git gc --auto failed: %s\n" % (stamp, who, " ".join(error.split())[-600:])
    tmp = os.path.join(store, "%s.%d" % (GC_FAILED, os.getpid()))
    with open(tmp, "w") as fh:
        fh.write(text)
    os.rename(tmp, os.path.join(store, GC_FAILED))
    return 1


def _names(rows):
    names = [p if p else "(the snapshot's top folder or commit)" for _oid, p in rows[:10]]
    return " ".join(names) + (" and %d more" % (len(rows) - 10) if len(rows) > 10 else "")


def describe(found, sid):
    """The job's message for what ``check`` found (None: every object read back whole)."""
    parts = []
    if found["damaged"]:
        parts.append(
            "%d object(s) of snapshot %s are damaged in the store (their bytes do not read back: a "
            "failing disk or a restore wrote over them): %s; the pack(s) holding them (%s) were set "
            "aside in the store's %s/" % (len(found["damaged"]), sid, _names(found["damaged"]),
                                          ", ".join(found["set_aside"]) or "already set aside", DAMAGED)
        )  # fmt: skip
    if found["missing"]:
        parts.append(
            "%d object(s) of snapshot %s are missing from the store (a purge of the filesystem?): %s"
            % (len(found["missing"]), sid, _names(found["missing"]))
        )
    return "; ".join(parts) or None


def main(argv):
    if len(argv) == 5 and argv[1] == "check":
        found = check(argv[2], argv[3])
        if not found["damaged"]:
            return 1  # only missing objects, or none: the job's own message says what a purge took
        sys.stdout.write(describe(found, argv[4]) + "\n")
        return 0
    if len(argv) == 4 and argv[1] == "tidy":
        return tidy(argv[2], argv[3])
    sys.stderr.write("usage: store-check.py check STORE COMMIT SNAPSHOT | tidy STORE WHO\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
