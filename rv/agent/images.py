"""Container images pulled from registries: the agent's ``image-pull`` mode, and what ``rv status``
and ``rv gc`` know of the cache.

``rv run --container docker://...`` pulls the image once, on the login node, with the runtime's own
tool (rv.agent.container.pull_steps) into ``<root>/images/<key>/`` (rv.agent.layout), ``<key>`` a
hash of the reference, its digest and the format the runtime runs; every later run whose reference
has the same digest reuses it. The digest is asked of the registry first (the registry API's
manifest ``HEAD``, anonymous, with a token where the registry hands one out): a reference the
registry does not have is refused here, before anything is pulled or submitted; a tag pushed again
is a new digest, so a new pull. Where the registry cannot be asked (it needs credentials the tool
has; ``oras://``, ``library://``) the key has no digest, and the newest pull of that reference is
reused.

A pull runs under the key's lock (two runs pulling one reference pull once: the second waits and
reuses), into ``images/.pull-<key>-<random>/`` with the tool's scratch inside it (off the home
quota), renamed to ``images/<key>`` when whole, with ``rv-image.json`` (what, when, how long). The
tool's own output goes to stderr as it comes: the laptop shows it. ``.last-used`` is touched at
each use; ``rv gc`` removes an image no run it keeps names (run.json's ``image``) and unused for
``--older-than``.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from rv.agent import common, container, layout, locks, manifest, rundir

META = b"rv-image.json"
LAST_USED = common.LAST_USED
PULL_PREFIX = b".pull-"

# What a manifest HEAD accepts: a multi-platform index or list, or one image's manifest.
ACCEPT = ", ".join(
    (
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
    )
)


def _say(message):
    sys.stderr.write("rv: %s\n" % message)
    sys.stderr.flush()


def images_dir(root):
    return common.under(root, layout.IMAGES)


def parse_docker(reference):
    """``docker://[HOST[:PORT]/]PATH[:TAG][@DIGEST]`` -> (registry host, repository, tag, digest),
    as Docker reads it: a first part without a dot, a colon or ``localhost`` is Docker Hub's."""
    rest = reference[len("docker://") :]
    digest = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
    first, sep, tail = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        host, path = first, tail
    else:
        host, path = "registry-1.docker.io", rest
    if host in ("docker.io", "index.docker.io"):
        host = "registry-1.docker.io"
    tag = "latest"
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
    if host == "registry-1.docker.io" and "/" not in path:
        path = "library/" + path
    return host, path, tag, digest


def _token(challenge):
    """An anonymous bearer token from a registry's ``WWW-Authenticate: Bearer realm=...`` challenge."""
    if not challenge or not challenge.lower().startswith("bearer "):
        return None
    fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    realm = fields.pop("realm", None)
    if not realm:
        return None
    url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(fields)
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = json.loads(resp.read().decode("utf-8"))
    return body.get("token") or body.get("access_token")


def resolve_digest(reference):
    """(digest, None), or (None, why not) where the registry cannot be asked; raises a usage error
    when the registry says it has no such image."""
    if container.scheme_of(reference) != "docker":
        return None, "only docker:// references are asked of their registry"
    host, path, tag, digest = parse_docker(reference)
    if digest:
        return digest, None
    url = "https://%s/v2/%s/manifests/%s" % (host, path, tag)
    headers = {"Accept": ACCEPT}
    for attempt in (1, 2):
        try:
            req = urllib.request.Request(url, headers=headers, method="HEAD")
            with urllib.request.urlopen(req, timeout=30) as resp:
                found = resp.headers.get("Docker-Content-Digest")
                return (found, None) if found else (None, "the registry named no digest")
        except urllib.error.HTTPError as exc:
            if exc.code == 401 and attempt == 1:
                try:
                    token = _token(exc.headers.get("WWW-Authenticate"))
                except (OSError, ValueError) as e:
                    return None, "the registry's token: %s" % e
                if token:
                    headers["Authorization"] = "Bearer " + token
                    continue
            if exc.code == 404:
                raise common.AgentError(
                    "--container %s: the registry %s has no such image (%s:%s: manifest unknown); "
                    "nothing was pulled or submitted" % (reference, host, path, tag),
                    "usage",
                ) from None
            return None, "the registry answered HTTP %d" % exc.code
        except (urllib.error.URLError, OSError, socket.timeout) as exc:  # ssl's errors are OSErrors
            return None, "the registry did not answer (%s)" % getattr(exc, "reason", exc)
    return None, "the registry wants credentials"


def image_key(reference, digest, filename):
    text = "%s\n%s\n%s" % (reference, digest or "", filename)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_meta(path):
    """The cache entry's record, when the entry is whole (its image there too), else None."""
    meta = common.read_json(common.join(path, META))
    if not isinstance(meta, dict) or not meta.get("file"):
        return None
    if not os.path.exists(common.join(path, manifest.enc(meta["file"]))):
        return None  # a purge took the image: pulled again
    return meta


def list_images(root):
    """[{key, path, image, meta, last_used}] of whole cache entries, newest use first."""
    out = common.cache_entries(images_dir(root), read_meta, "pulled_at")
    for entry in out:
        path = manifest.enc(entry["path"])
        entry["image"] = manifest.dec(common.join(path, manifest.enc(entry["meta"]["file"])))
    return out


def _reply(entry_path, key, meta, **more):
    common.touch(common.join(entry_path, LAST_USED))
    image = manifest.dec(common.join(entry_path, manifest.enc(meta["file"])))
    return dict({"key": key, "image": image, "meta": meta, "pulled": False}, **more)


def _run_streamed(argv, env, cwd):
    """Run one step of a pull, its output to stderr line by line as it comes; (exit code, last lines)."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd)  # fmt: skip
    except OSError as exc:
        return 127, ["%s: %s" % (argv[0], exc)]
    tail = []
    for raw in proc.stdout:
        # A progress bar redraws with \r: its last state is the line.
        line = raw.decode("utf-8", "replace").rstrip("\r\n").split("\r")[-1]
        tail = (tail + [line])[-12:]
        sys.stderr.write("| %s\n" % line)
        sys.stderr.flush()
    return proc.wait(), tail


def tool_environment(env):
    """The pull tools' environment: the setup lines' own, without a venv they activated for the jobs
    (ch-image is ``#!/usr/bin/env python3`` and needs the system's lark and requests, not a venv's)."""
    venv = env.get("VIRTUAL_ENV")
    if not venv:
        return env
    out = {k: v for k, v in env.items() if k != "VIRTUAL_ENV"}
    out["PATH"] = ":".join(
        p for p in env.get("PATH", "").split(":") if p.rstrip("/") != venv.rstrip("/") + "/bin"
    )
    return out


def _pull(root, key, reference, runtime, env, filename, squash, digest):
    """Pull into a temporary folder, renamed to ``images/<key>`` when whole; the entry's record."""
    base = images_dir(root)
    tmp = common.join(base, PULL_PREFIX + key.encode() + b"-" + os.urandom(4).hex().encode())
    common.makedirs(tmp, 0o700)
    try:
        scratch = common.join(tmp, b"scratch")
        common.makedirs(scratch, 0o700)
        out = manifest.dec(common.join(tmp, manifest.enc(filename)))
        started = time.time()
        steps = container.pull_steps(runtime, reference, manifest.dec(scratch), out, squash)
        for argv, extra in steps:
            _say("$ %s" % " ".join(argv))
            code, tail = _run_streamed(argv, dict(env, **extra), manifest.dec(tmp))
            if code != 0:
                raise common.AgentError(
                    "--container %s: %s failed (exit %d); nothing was submitted: %s"
                    % (reference, argv[0], code, " | ".join(t for t in tail[-4:] if t.strip())),
                    "pull-failed",
                )
        shutil.rmtree(manifest.dec(scratch), ignore_errors=True)
        if not os.path.exists(out):
            raise common.AgentError("--container %s: %s left no %s" % (reference, steps[-1][0][0], filename))
        meta = {"reference": reference, "digest": digest, "runtime": runtime,
                "tool": container.PULLERS[runtime], "file": filename, "pulled_at": time.time(),
                "pull_seconds": round(time.time() - started, 2),
                "bytes": common.tree_bytes(manifest.enc(out))[0]}  # fmt: skip
        common.write_json(common.join(tmp, META), meta)
        final = common.join(base, key.encode())
        if os.path.lexists(final):  # an entry whose image a purge took: replaced whole
            aside = common.join(base, PULL_PREFIX + b"old-" + os.urandom(4).hex().encode())
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(tmp, final)
        return meta
    finally:
        if os.path.isdir(tmp):
            common.force_rmtree(tmp)


def _newest_of(root, reference, filename):
    """The newest whole entry pulled from ``reference`` in that format (the registry could not say
    its digest)."""
    for entry in list_images(root):
        if entry["meta"].get("reference") == reference and entry["meta"].get("file") == filename:
            return entry
    return None


def mode_image_pull(args):
    """The image of ``reference`` for ``runtime``: in the cache (one round trip), or pulled now."""
    root = common.root_path(args["root"])
    reference, runtime = args["reference"], args["runtime"]
    try:
        env = tool_environment(container.setup_environment(args.get("setup") or []))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        raise common.AgentError("--container: %s" % e, "usage") from None
    squash = runtime != "charliecloud" or bool(shutil.which("mksquashfs", path=env.get("PATH", os.defpath)))
    filename = container.PULLED[runtime] if squash else container.PULLED_DIR
    digest, why = resolve_digest(reference)
    if digest is None:
        entry = _newest_of(root, reference, filename)
        if entry is not None:
            _say("%s: %s; the image pulled before is used" % (reference, why))
            return _reply(manifest.enc(entry["path"]), entry["key"], entry["meta"], unresolved=why)
    key = image_key(reference, digest, filename)
    base = images_dir(root)
    path = common.join(base, key.encode())
    meta = read_meta(path)
    if meta is not None:
        return _reply(path, key, meta)
    common.makedirs(base, 0o700)
    common.remove_stale(base, PULL_PREFIX, 86400)  # a pull killed before it could clean up
    lock_path = common.join(base, key.encode() + manifest.enc(layout.LOCK))
    waited = False
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locks.lock(lock_path, "the pull of %s" % reference, wait=0))
        except common.AgentError as exc:
            if exc.code != "busy":
                raise
            _say("waiting: another rv is pulling %s" % reference)
            stack.enter_context(locks.lock(lock_path, "the pull of %s" % reference, wait=7200))
            waited = True
        meta = read_meta(path)
        if meta is not None:
            return _reply(path, key, meta, waited=waited)
        _say("pulling %s with %s (once; cached as %s)" % (reference, container.PULLERS[runtime], key))
        meta = _pull(root, key, reference, runtime, env, filename, squash, digest)
        _say("pulled %s in %.0f s" % (reference, meta["pull_seconds"]))
        return _reply(path, key, meta, pulled=True)


def images_in_use(root, kept_run_ids):
    """Keys of images that the runs gc keeps name (run.json's ``image``), with those runs' names."""
    used = {}
    for run_id in kept_run_ids:
        meta = (rundir.run_info(root, run_id) or {}).get("meta") or {}
        if meta.get("image"):
            used.setdefault(meta["image"], []).append(meta.get("name") or run_id)
    return used


def runs_using(root, live):
    """{image key: [{"name", "run_id", "live"}]} over every run the cluster has."""
    out = {}
    for run_id in rundir.all_run_ids(root):
        info = rundir.run_info(root, run_id)
        if info is None or not info["meta"].get("image"):
            continue
        alive = any(s["job_id"] in live for s in info["segments"]) if live is not None else None
        out.setdefault(info["meta"]["image"], []).append(
            {"name": info["meta"].get("name"), "run_id": run_id, "live": alive}
        )
    return out


def gc_images(root, older_than, in_use, freed, dry):
    """Images no kept run names and unused for ``older_than`` s; pulls left over a day old."""
    now = time.time()
    removed, kept = [], []
    for entry in list_images(root):
        ref = entry["meta"].get("reference")
        if entry["key"] in in_use:
            kept.append({"key": entry["key"], "reference": ref,
                         "why": "used by run(s) %s" % ", ".join(in_use[entry["key"]][:3])})  # fmt: skip
            continue
        if now - entry["last_used"] < older_than:
            kept.append({"key": entry["key"], "reference": ref,
                         "why": "used %s ago" % common.human_age(now - entry["last_used"])})  # fmt: skip
            continue
        before = freed.bytes
        common.remove_counted(manifest.enc(entry["path"]), freed, dry)
        removed.append({"key": entry["key"], "reference": ref, "bytes": freed.bytes - before})
    base = images_dir(root)
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = common.join(base, name)
        with contextlib.suppress(OSError):
            old = now - os.lstat(path).st_mtime > 86400
            lock_alone = name.endswith(manifest.enc(layout.LOCK)) and not os.path.isdir(
                common.join(base, name[: -len(layout.LOCK)])
            )
            if old and (name.startswith(PULL_PREFIX) or lock_alone):
                common.remove_counted(path, freed, dry)  # a pull killed, or the lock of an image gone
    return removed, kept
