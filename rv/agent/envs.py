"""Python environments on the cluster side: the agent's ``env``, ``venv-ls`` and ``venv-rm`` modes.

``env``       find the interpreter (after the setup lines), finish the key, and either answer with
              the environment that exists (one round trip) or build it under the key's lock: uv
              (installed once into ``<root>/tools/uv`` when the cluster has none), a relocatable
              venv in a temporary folder, renamed into ``envs/<key>`` only when complete. Progress
              goes to stderr as lines; the reply to stdout.
``venv-ls``   every environment: key, size, built at, last used, what it was built from
``venv-rm``   remove one (refused while a live run uses it)

Environments are shared by every branch, run and project with the same key, so nothing of a
snapshot goes into one: the job finds the project on PYTHONPATH.

``--system-site-packages``: uv does not count the base interpreter's packages as installed (it would
download torch again; astral-sh/uv#4466), so the base's distributions are recorded in the new
environment as metadata-only ``.dist-info`` folders (``INSTALLER`` says ``rv-base``). uv then sees
them as installed and keeps them, as pip would; a requirement that needs another version installs it
into the environment, where it shadows the base's. A base that is itself a venv is chained by a
``.pth`` file, so its packages import too.

Privacy: uv and pip run under the client's umask (the agent's, restated after the setup lines, which
may change it), and what they write is tightened afterwards (:func:`tighten`): uv makes its lock
files 0666 whatever the umask, and pip its executables 0711. A build that fails removes its lock
file; ``rv gc`` removes lock files of keys that have no environment once a day old.
"""

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time

from rv.agent import common, container, layout, locks, manifest, rundir, slurmcmd

META = b"rv-env.json"

# Every file of a complete environment (NUL-separated paths), written last: a scratch filesystem's
# purge deletes files and leaves folders, so an environment is used only while all of them are there.
FILES = b"rv-env-files"

LAST_USED = common.LAST_USED

BUILD_PREFIX = b".build-"

INDEX_VARS = ("UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX", "UV_FIND_LINKS",
              "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")  # fmt: skip

# What the interpreter says about itself: the key's half that only the cluster knows.
PROBE = r"""
import json, os, platform, site, sys, sysconfig
print(json.dumps({
    "executable": sys.executable, "version": platform.python_version(),
    "prefix": sys.prefix, "base_prefix": getattr(sys, "base_prefix", sys.prefix),
    "machine": platform.machine(), "libc": "-".join(platform.libc_ver()),
    "site": [p for p in site.getsitepackages() if os.path.isdir(p)],
    "purelib": sysconfig.get_paths()["purelib"],
    "environ": dict(os.environ),
}))
"""

# Distributions the base interpreter has, as metadata (see the module's docstring).
LIST_DISTS = r"""
import json, sys
try:
    from importlib import metadata
except ImportError:
    print("[]"); sys.exit(0)
out, seen = [], set()
for d in metadata.distributions():
    name = d.metadata["Name"]
    key = (name or "").lower().replace("_", "-").replace(".", "-")
    text = d.read_text("METADATA") or d.read_text("PKG-INFO")
    if name and text and key not in seen:
        seen.add(key)
        out.append([name, d.version, text])
print(json.dumps(out))
"""


def tighten(*tops):
    """Take from everything under ``tops`` the permission bits the umask forbids (symlinks have none).

    uv creates its lock files 0666 whatever the umask (so that users sharing a cache may all lock
    it: astral-sh/uv#8032), and pip installs executables 0777 & ~umask | 0111; rv promises 0600/0700
    (0640/0750 shared with the group). Walked after each run of either, on what they wrote."""
    forbidden = common.UMASK & 0o777
    for top in tops:
        if not os.path.lexists(top):
            continue
        for dirpath, _dirs, files in os.walk(top):
            for path in [dirpath] + [os.path.join(dirpath, f) for f in files]:
                try:
                    st = os.lstat(path)
                    if not stat.S_ISLNK(st.st_mode) and st.st_mode & forbidden:
                        os.chmod(path, common.private(stat.S_IMODE(st.st_mode)))
                except FileNotFoundError:
                    continue  # removed meanwhile (uv's temporary files)


def envs_dir(root):
    return common.under(root, layout.ENVS)


def _say(message):
    sys.stderr.write("rv: %s\n" % message)
    sys.stderr.flush()


def _setup_script(setup, tail):
    """A bash script: the setup lines (each must succeed, as in the job), then ``tail``."""
    lines = ["set +u"]
    for i, line in enumerate(setup, 1):
        lines.append("{\n%s\n} >&2 || { echo 'rv: setup line %d failed' >&2; exit 97; }" % (line, i))
    lines.append(tail)
    return "\n".join(lines)


def _python_word(request):
    """The interpreter to probe for ``--python``: a path as is, a version as pythonX.Y."""
    if not request:
        return (
            'p=$(command -v python3 || command -v python) || { echo "rv: no python3 on PATH" >&2; exit 98; }'
        )
    if "/" in request:
        return "p=%s" % _q(request)
    return 'p=$(command -v python%s) || p=""' % _q(request)


def _q(text):
    return "'" + text.replace("'", "'\"'\"'") + "'"


def probe(setup, python_request, uv, image=None, root=None):
    """(interpreter facts, environment after setup): runs the setup lines like the job does. With
    ``image`` (rv run --container), the image's own python3, asked inside it."""
    want = _q(python_request or "")
    if image is not None:
        inside = " ".join(_q(w) for w in container.argv_in(image, manifest.dec(root), manifest.dec(root), []))
        tail = "\n".join([
            "umask %03o" % (common.UMASK & 0o777),
            'printf "%s\\n" "$(command -v uv || true)"',
            container.DROP_HOST_VENV,  # the image's python3, not the setup lines' venv's
            'exec %s python3 -I -c "$RV_PROBE"' % inside,
        ])  # fmt: skip
        return _probe_run(setup, tail, uv)
    tail = "\n".join([
        # A site's setup (a module) may set its own umask: uv below must write under rv's.
        "umask %03o" % (common.UMASK & 0o777),
        _python_word(python_request),
        # A version the PATH lacks: uv finds it, or fetches a managed one into <root>/tools/python.
        'if [ -z "$p" ] && [ -n "$RV_UV" ]; then p=$("$RV_UV" python find %s 2>/dev/null || { '
        '"$RV_UV" python install %s >&2 && "$RV_UV" python find %s; }) || p=""; fi' % (want, want, want),
        '[ -n "$p" ] || { echo "rv: no interpreter for --python %s" >&2; exit 98; }' % (python_request or ""),
        'printf "%s\\n" "$(command -v uv || true)"',
        'exec "$p" -I -c "$RV_PROBE"',
    ])  # fmt: skip
    return _probe_run(setup, tail, uv)


def _probe_run(setup, tail, uv):
    env = dict(os.environ, RV_PROBE=PROBE, RV_UV=uv or "")
    proc = subprocess.Popen(["bash", "-c", _setup_script(setup, tail)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        lines = [line for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
        raise common.AgentError(
            "finding the environment's Python failed: %s"
            % (" / ".join(lines[-3:]) or "exit %d" % proc.returncode),
            "usage",
        )
    first, _, rest = out.decode("utf-8", "replace").partition("\n")
    facts = json.loads(rest.strip().splitlines()[-1])
    facts["uv_on_path"] = first.strip()
    return facts


def finish_key(spec, facts, environ):
    h = hashlib.sha256()
    if facts.get("image"):
        h.update(b"image\0" + facts["image"].encode("utf-8") + b"\0")
    index = sorted((k, environ[k]) for k in INDEX_VARS if environ.get(k))
    for part in (spec["digest"], facts["executable"], facts["version"], facts["machine"], facts["libc"],
                 json.dumps(index)):  # fmt: skip
        h.update(part.encode("utf-8") + b"\0")
    for conf in ("~/.config/uv/uv.toml", "/etc/uv/uv.toml"):
        with contextlib.suppress(OSError), open(os.path.expanduser(conf), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def _listing(path):
    """The environment's files and links (relative paths), less Python's bytecode caches (written
    and rewritten as programs import) and rv's own stamps."""
    found = []
    top = len(path.rstrip(b"/")) + 1
    for dirpath, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != b"__pycache__"]
        for name in files:
            found.append(os.path.join(dirpath, name)[top:])
        # A link to a folder is one entry (os.walk does not enter it).
        found.extend(os.path.join(dirpath, d)[top:] for d in dirs if os.path.islink(os.path.join(dirpath, d)))
    return sorted(p for p in found if p not in (LAST_USED, FILES))


def write_files(path):
    common.write_atomic(common.join(path, FILES), b"\0".join(_listing(path)), 0o600)


def missing_files(path):
    """Files of the environment at ``path`` that are gone, or None when it has no listing (built by
    an rv before the listing: it cannot be checked). Its listing gone counts as everything gone."""
    try:
        with open(common.join(path, FILES), "rb") as fh:
            want = fh.read().split(b"\0")
    except FileNotFoundError:
        return [FILES] if read_meta(path) and read_meta(path).get("files_listed") else None
    have = set(_listing(path))
    return [p for p in want if p and p not in have]


def read_meta(path):
    try:
        with open(common.join(path, META), "rb") as fh:
            return json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None


def find_uv(root, on_path):
    own = common.join(common.under(root, layout.UV_HOME), b"bin", b"uv")
    if os.access(own, os.X_OK):
        return manifest.dec(own), False
    if on_path:
        return on_path, False
    return None, False


def install_uv(root, python):
    """uv into ``<root>/tools/uv`` once, from the index this node reaches; the path to its binary."""
    common.makedirs(common.under(root, layout.TOOLS), 0o700)
    home = common.under(root, layout.UV_HOME)
    with locks.lock(common.under(root, layout.UV_HOME + layout.LOCK), "installing uv", wait=600):
        own = common.join(home, b"bin", b"uv")
        if os.access(own, os.X_OK):
            return manifest.dec(own)
        _say("the cluster has no uv: installing it once into %s (from the package index)"
             % manifest.dec(home))  # fmt: skip
        tmp = home + b".tmp-" + os.urandom(4).hex().encode()
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        tried = []
        pip = ["-m", "pip", "install", "-q", "--target", manifest.dec(tmp), "uv"]
        for argv in ([python, *pip], ["/usr/bin/python3", *pip]):
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)  # fmt: skip
            out = proc.communicate(timeout=900)[0].decode("utf-8", "replace")
            if proc.returncode == 0 and os.access(common.join(tmp, b"bin", b"uv"), os.X_OK):
                tighten(tmp)  # pip's executables are 0711
                os.rename(tmp, home)
                return manifest.dec(own)
            tried.append(
                "%s: %s"
                % (" ".join(argv[:3]), (out.strip().splitlines() or ["exit %d" % proc.returncode])[-1])
            )
            shutil.rmtree(tmp, ignore_errors=True)
        raise common.AgentError(
            "could not install uv on the cluster (%s). Install it yourself on the login node: "
            "`python3 -m pip install --user uv` or `curl -LsSf https://astral.sh/uv/install.sh | sh`, "
            "and put it on PATH in the profile's setup" % "; ".join(tried),
            "usage",
        )


def _uv_env(root, environ):
    env = dict(environ)
    env.update(UV_CACHE_DIR=manifest.dec(common.under(root, layout.UV_CACHE)),
               UV_PYTHON_INSTALL_DIR=manifest.dec(common.under(root, layout.UV_PYTHONS)),
               UV_NO_PROGRESS="1", NO_COLOR="1")  # fmt: skip
    if not any(env.get(k) for k in ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX")) and env.get(
        "PIP_INDEX_URL"
    ):
        # A cluster's own mirror is usually set up for pip: uv reads only its own names.
        env["UV_INDEX_URL"] = env["PIP_INDEX_URL"]
        if env.get("PIP_EXTRA_INDEX_URL") and not env.get("UV_EXTRA_INDEX_URL"):
            env["UV_EXTRA_INDEX_URL"] = env["PIP_EXTRA_INDEX_URL"]
    if "UV_SYSTEM_CERTS" not in env and "UV_NATIVE_TLS" not in env:
        # Sites behind a TLS-inspecting proxy add its CA to the system store, which uv's own roots
        # lack (pip trusts it through the system's certifi). Both names: UV_NATIVE_TLS before uv 0.9.
        env.update(UV_SYSTEM_CERTS="1", UV_NATIVE_TLS="1")
    env.pop("VIRTUAL_ENV", None)
    return env


def _run_uv(argv, env, cwd, transcript):
    """Run a uv command, passing its lines on as progress; the lines are kept for an error."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        transcript.append(line)
        sys.stderr.write("| %s\n" % line)
        sys.stderr.flush()
    return proc.wait()


def _stub_base(site_dir, dists):
    """The base's distributions as metadata-only installs, so uv counts them (module docstring)."""
    for name, version, text in dists:
        folder = "%s-%s.dist-info" % (name.replace("-", "_"), version)
        path = os.path.join(site_dir, folder)
        if os.path.exists(path):
            continue
        os.mkdir(path)
        for fname, body in (("METADATA", text), ("INSTALLER", "rv-base\n")):
            with open(os.path.join(path, fname), "w", encoding="utf-8") as fh:
                fh.write(body)
        with open(os.path.join(path, "RECORD"), "w") as fh:
            fh.write("".join("%s/%s,,\n" % (folder, f) for f in ("METADATA", "INSTALLER", "RECORD")))


def _version_tuple(text):
    parts = []
    for piece in text.strip().split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def python_satisfies(version, requires):
    """Whether ``version`` (3.11.2) meets a ``requires-python`` text (">=3.10, <4", "~=3.9", "==3.11.*")."""
    have = _version_tuple(version)
    for clause in (c.strip() for c in requires.split(",") if c.strip()):
        op = next((o for o in ("~=", "==", "!=", ">=", "<=", ">", "<") if clause.startswith(o)), "==")
        text = clause[len(op) :].strip() if clause.startswith(op) else clause
        want = _version_tuple(text.rstrip(".*"))
        if text.endswith(".*") or op == "~=":
            # ==3.11.* : the same leading parts; ~=3.9 : >=3.9 and the same parts but the last.
            same = have[: len(want) - (op == "~=")] == want[: len(want) - (op == "~=")]
            ok = same if op in ("==", "~=") else not same
            if op == "~=":
                ok = ok and have >= want
        else:
            padded = have[: len(want)] if op in ("==", "!=") else have
            ok = {"==": padded == want, "!=": padded != want, ">=": have >= want, "<=": have <= want,
                  ">": have > want, "<": have < want}[op]  # fmt: skip
        if not ok:
            return False
    return True


def _shim_base_scripts(env_bin, base_bin):
    """The base's Python console scripts (torchrun, accelerate, ...) run by the environment's python.

    Run as they are, their ``#!`` line names the base interpreter: torchrun's workers would start
    without the environment's packages. A shim in the environment's bin, first on PATH, runs the same
    script file with the environment's python (found next to the shim, so a renamed env still works).
    """
    made = 0
    for name in sorted(os.listdir(base_bin)) if os.path.isdir(base_bin) else []:
        src = os.path.join(base_bin, name)
        dst = os.path.join(env_bin, name)
        if (
            os.path.lexists(dst)
            or name.startswith(("python", "activate", "pip"))
            or not os.access(src, os.X_OK)
        ):
            continue
        try:
            with open(src, "rb") as fh:
                first = fh.readline(256)
        except OSError:
            continue
        if not (first.startswith(b"#!") and b"python" in first):
            continue
        with open(dst, "w") as fh:
            fh.write('#!/bin/sh\n# rv: %s run by this environment\'s python\n'
                     'exec "$(dirname -- "$0")/python" %s "$@"\n' % (name, _q(src)))  # fmt: skip
        os.chmod(dst, 0o755 & ~common.UMASK)
        made += 1
    return made


def _failure(spec, transcript, python_version):
    lines = [line for line in transcript if line.strip()]
    shown = lines if len(lines) <= 12 else [*lines[:4], "...", *lines[-8:]]
    text = "\n".join("  " + line for line in shown)
    message = "building the environment for %s failed:\n%s" % (spec["label"], text)
    low = text.lower()
    if "requires-python" in low or "does not satisfy python" in low or "python version" in low:
        message += (
            "\nthe interpreter is Python %s: load a newer one in setup (e.g. --setup 'module load "
            "python/3.11') or pass --python 3.11" % python_version
        )
    return common.AgentError(message, "usage")


# The login node's CA bundle, as its own pip and uv find it.
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def _host_certificates(environ, src, env):
    """uv in the image trusts what the login node trusts: a site behind a TLS-inspecting proxy adds its
    CA to the host's store, which the image's lacks. The host's bundle is copied beside the build's
    files (under the root, which the image sees) and named by SSL_CERT_FILE."""
    candidates = [environ.get(k) for k in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE")]
    for path in [c for c in candidates if c] + list(CA_BUNDLES):
        if os.path.isfile(path):
            dest = common.join(src, b"rv-ca-bundle.pem")
            shutil.copyfile(path, dest)
            env["SSL_CERT_FILE"] = manifest.dec(dest)
            return


def build(root, key, spec, facts, uv, environ, image=None):
    """Build into a temporary folder and rename it to ``envs/<key>`` when complete. With ``image``
    every step runs inside it, on the image's Python (the remote root is bound at its own path)."""
    base = envs_dir(root)

    def inside(argv, cwd):
        return container.argv_in(image, manifest.dec(root), cwd, argv) if image is not None else argv

    final = common.join(base, key.encode())
    tmp = common.join(base, BUILD_PREFIX + key.encode() + b"-" + os.urandom(4).hex().encode())
    src = tmp + b".src"
    env = _uv_env(root, environ)
    transcript = []
    started = time.time()
    try:
        common.makedirs(src, 0o700)
        for name, text in spec["files"]:
            path = common.join(src, manifest.enc(name))
            common.makedirs(os.path.dirname(path), 0o700)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        if image is not None:
            _host_certificates(environ, src, env)
        venv = [uv, "venv", "--quiet", "--relocatable", "--python", facts["executable"], manifest.dec(tmp)]
        if spec["system_site_packages"]:
            venv.insert(2, "--system-site-packages")
        if _run_uv(inside(venv, manifest.dec(src)), env, manifest.dec(src), transcript) != 0:
            raise _failure(spec, transcript, facts["version"])
        py = manifest.dec(common.join(tmp, b"bin", b"python"))
        if spec["system_site_packages"]:
            here = manifest.dec(src)
            site_dir = subprocess.check_output(
                inside([py, "-I", "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"], here),
                cwd=here,
            )
            site_dir = site_dir.decode().strip()
            dists = json.loads(
                subprocess.check_output(
                    inside([facts["executable"], "-I", "-c", LIST_DISTS], here), cwd=here
                ).decode()
            )
            _stub_base(site_dir, dists)
            if image is None:  # the image's scripts are the image's: its own bin is not this machine's
                _shim_base_scripts(
                    manifest.dec(common.join(tmp, b"bin")), os.path.dirname(facts["executable"])
                )
            if facts["prefix"] != facts["base_prefix"]:
                with open(os.path.join(site_dir, "_rv_base.pth"), "w") as fh:
                    fh.write("".join(p + "\n" for p in facts["site"]))
        main = spec["files"][0][0]
        if spec["kind"] == "uv.lock":
            export = [uv, "export", "--frozen", "--no-hashes", "--no-header", "--no-emit-project",
                      "--output-file", "rv-locked.txt"]  # fmt: skip
            export += ["--extra=%s" % e for e in spec["extras"]]
            if _run_uv(inside(export, manifest.dec(src)), env, manifest.dec(src), transcript) != 0:
                raise _failure(spec, transcript, facts["version"])
            main = "rv-locked.txt"
        install = [uv, "pip", "install", "--python", py, "-r", main]
        if spec["kind"] == "pyproject":
            install += ["--extra=%s" % e for e in spec["extras"]]
        if _run_uv(inside(install, manifest.dec(src)), env, manifest.dec(src), transcript) != 0:
            raise _failure(spec, transcript, facts["version"])
        meta = {"key": key, "kind": spec["kind"], "files": spec["label"], "extras": spec["extras"],
                "python": facts["executable"], "python_version": facts["version"],
                "system_site_packages": spec["system_site_packages"], "built_at": time.time(),
                "build_seconds": round(time.time() - started, 2), "uv": uv, "files_listed": True,
                "image": facts.get("image")}  # fmt: skip
        with open(common.join(tmp, META), "w") as fh:
            json.dump(meta, fh)
        tighten(tmp)  # uv's .lock in the venv
        write_files(tmp)
        old = None
        if os.path.lexists(final):  # --force: the old one steps aside only now, when the new one is whole
            old = common.join(base, BUILD_PREFIX + b"old-" + os.urandom(4).hex().encode())
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        common.touch(common.join(final, LAST_USED))
        return meta
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        # What uv wrote outside the venv, whether or not the build worked: its cache's lock files.
        tighten(common.under(root, layout.UV_CACHE), common.under(root, layout.UV_PYTHONS))


def mode_env(args):
    """The run's environment: found by key (one round trip) or built now, once, under a lock."""
    root = common.root_path(args["root"])
    if args.get("use"):
        return _use_existing(args["use"], args.get("setup") or [])
    spec = args["spec"]
    uv, _ = find_uv(root, None)
    request = spec.get("python")
    if uv is None and request and "/" not in request:
        uv = install_uv(root, "python3")  # to find (or fetch) the version asked for
    image = args.get("container")
    if image is not None:
        # The image's python3 (--python does not apply) and uv under the root, which the image sees.
        if uv is None:
            uv = install_uv(root, "python3")
        facts = probe(args.get("setup") or [], None, uv, image, root)
        facts["uv_on_path"] = ""
        facts["image"] = container.identity(image)
    else:
        facts = probe(args.get("setup") or [], request, uv)
    if uv is not None:
        tighten(common.under(root, layout.UV_PYTHONS))  # an interpreter uv fetched for --python
    environ = facts.pop("environ")  # after the setup lines: a site's mirror is often set by a module
    key = finish_key(spec, facts, environ)
    path = common.join(envs_dir(root), key.encode())
    meta = read_meta(path)
    if meta is not None and args.get("force"):
        meta = None  # rebuilt under the lock below; the old one goes only when the new one is complete
    holes = _holes(path, key) if meta is not None else None
    if holes:
        meta = None  # purged: rebuilt like --force, never used with holes
    if meta is not None:
        common.touch(common.join(path, LAST_USED))
        return {"key": key, "path": manifest.dec(path), "built": False, "exists": True, "meta": meta}
    common.makedirs(envs_dir(root), 0o700)
    lock_path = common.join(envs_dir(root), key.encode() + manifest.enc(layout.LOCK))
    held = _lock_build(lock_path, key)
    built = False
    try:
        meta = None if args.get("force") or holes else read_meta(path)
        if meta is not None and _holes(path, key):
            meta = None
        if meta is not None:
            common.touch(common.join(path, LAST_USED))
            return {"key": key, "path": manifest.dec(path), "built": False, "exists": True, "meta": meta,
                    "waited": True}  # fmt: skip
        installed_uv = False
        uv, _ = find_uv(root, facts["uv_on_path"])
        if uv is None:
            uv = install_uv(root, facts["executable"])
            installed_uv = True
        requires = spec.get("requires_python")
        if requires and not python_satisfies(facts["version"], requires):
            raise common.AgentError(
                "%s needs Python %s, but the cluster's interpreter is %s (%s): load a newer one in the "
                "setup (e.g. --setup 'module load python/3.11') or pass --python VERSION (uv fetches it)"
                % (spec["label"].split(",")[0], requires, facts["version"], facts["executable"]),
                "usage",
            )
        _say("building environment %s from %s (Python %s)" % (key, spec["label"], facts["version"]))
        meta = build(root, key, spec, facts, uv, environ, image)
        built = True
        return {"key": key, "path": manifest.dec(path), "built": True, "exists": True, "meta": meta,
                "installed_uv": installed_uv, "rebuilt_holes": len(holes or ())}  # fmt: skip
    finally:
        if not built and read_meta(path) is None:
            # No environment came of it: its lock file would stay for good. Removed while held; one
            # who was waiting on it finds it gone and takes a fresh one (_lock_build).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)
        held.__exit__(None, None, None)


def _holes(path, key):
    """The files a purge took from the environment (said on stderr), or [] / None (not checkable)."""
    gone = missing_files(path)
    if gone:
        shown = ", ".join(manifest.dec(p) for p in gone[:3]) + (
            " and %d more" % (len(gone) - 3) if len(gone) > 3 else ""
        )
        _say(
            "environment %s lost %d file(s) (a purge of the filesystem?): %s; building it again"
            % (key, len(gone), shown)
        )
    return gone


def _lock_build(lock_path, key):
    """The key's build lock, held (a context entered by hand: the caller exits it)."""
    what = "the build of environment %s" % key
    said = False
    while True:
        try:
            held = locks.lock(lock_path, what, wait=0)
            held.__enter__()
        except common.AgentError as exc:
            if not said:
                _say("waiting: %s" % str(exc).split("; try again")[0])
                said = True
            held = locks.lock(lock_path, what, wait=3600)
            held.__enter__()
        if os.path.exists(lock_path):
            return held
        # Its holder's build failed and removed the file while we waited on it: this lock guards
        # nothing any more; take the one at the path.
        held.__exit__(None, None, None)


def _use_existing(path, setup):
    """``--env PATH``: an existing venv or conda prefix, used as is; it must hold a python."""
    tail = 'd=%s; d="${d/#\\~/$HOME}"; [ -x "$d/bin/python" ] || exit 4; cd "$d" && pwd -P' % _q(path)
    proc = subprocess.Popen(["bash", "-c", _setup_script(setup, tail)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    if proc.returncode != 0:
        raise common.AgentError(
            "--env %s: no bin/python there on the cluster (a venv or conda prefix is expected)" % path,
            "usage",
        )
    return {"key": None, "path": out.decode().strip().splitlines()[-1], "built": False, "exists": True}


def _size(path):
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def list_envs(root):
    """[{key, path, meta, last_used}] of complete environments, newest use first."""
    return common.cache_entries(envs_dir(root), read_meta, "built_at")


def envs_in_use(root, squeue_argv, grace=900.0):
    """Keys of environments that runs still alive (or being submitted) were submitted with."""
    live = slurmcmd.live_jobs(squeue_argv)  # if squeue fails, this raises: nothing is removed
    used = set()
    now = time.time()
    for run_id in rundir.all_run_ids(root):
        info = rundir.run_info(root, run_id)
        if info is None:
            continue
        key = info["meta"].get("env")
        alive = any(s["job_id"] in live for s in info["segments"])
        submitting = info["ended"] is None and now - float(info["meta"].get("created", 0)) < grace
        if key and (alive or submitting):
            used.add(key)
    return used


def gc_envs(root, older_than, in_use, freed, dry):
    """Environments unused for ``older_than`` s and by no live run; half-built leftovers over a day."""
    now = time.time()
    removed, kept = [], []
    for env in list_envs(root):
        if env["key"] in in_use:
            kept.append({"key": env["key"], "why": "a live run uses it"})
            continue
        if now - env["last_used"] < older_than:
            kept.append({"key": env["key"], "why": "used %s ago" % common.human_age(now - env["last_used"])})
            continue
        before = freed.bytes
        common.remove_counted(env["path"].encode(), freed, dry)
        removed.append({"key": env["key"], "bytes": freed.bytes - before, "files": env["meta"].get("files")})
    base = envs_dir(root)
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = common.join(base, name)
        with contextlib.suppress(OSError):
            if name.startswith(BUILD_PREFIX) and now - os.lstat(path).st_mtime > 86400:
                common.remove_counted(path, freed, dry)
            elif (
                name.endswith(manifest.enc(layout.LOCK))
                and not os.path.isdir(common.join(base, name[: -len(layout.LOCK)]))
                and now - os.lstat(path).st_mtime > 86400
            ):
                common.remove_counted(path, freed, dry)  # an environment gone, or a build that failed
    return removed, kept


def mode_venv_ls(args):
    root = common.root_path(args["root"])
    envs = list_envs(root)
    in_use = envs_in_use(root, args["squeue"])
    for env in envs:
        env["bytes"] = _size(env["path"].encode())
        env["in_use"] = env["key"] in in_use
    return {"envs": envs}


def mode_venv_rm(args):
    root = common.root_path(args["root"])
    want = args["key"]
    matches = [e for e in list_envs(root) if e["key"].startswith(want)]
    if not matches:
        raise common.AgentError("no environment %s (rv venv ls lists them)" % want, "not-found")
    if len(matches) > 1:
        raise common.AgentError(
            "%s matches %d environments: give more of the key" % (want, len(matches)), "usage"
        )
    env = matches[0]
    if not args.get("force") and env["key"] in envs_in_use(root, args["squeue"]):
        raise common.AgentError(
            "environment %s is used by a live run (--force removes it anyway)" % env["key"], "live"
        )
    # Renamed away first: a job starting now finds it gone rather than half-deleted.
    aside = common.join(envs_dir(root), BUILD_PREFIX + b"rm-" + env["key"].encode())
    os.rename(env["path"].encode(), aside)
    freed = _size(aside)
    shutil.rmtree(aside)
    return {"key": env["key"], "bytes_freed": freed}
