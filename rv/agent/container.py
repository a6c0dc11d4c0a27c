"""Container runtimes: which one runs an image, whether the cluster has it, and the command line that
runs a node's launcher inside the image.

A runtime is an adapter with one job: given the node's program line, the folders to bind and whether
GPUs are passed, return the words that run it inside the image. Everything else (the snapshot,
chains, secrets, precision, launchers, the stop watcher) is shared by every runtime and stays
outside. Apptainer, Singularity and Charliecloud wrap the program inside each node's task
(``exec <words> PROGRAM``: the stop watcher beside it sees the program's processes, which share the
node's PID namespace); Pyxis is an option of ``srun`` itself, so it wraps the whole task.

Shared by the laptop (rendering the batch script, ``--dry-run``) and the agent (``run-check``: the
image exists, a runtime for it is there, after the profile's setup lines). Standard library only,
Python 3.6.
"""

import os
import re
import shlex
import shutil
import subprocess

RUNTIMES = ("apptainer", "singularity", "charliecloud", "pyxis")
CHOICES = ("auto",) + RUNTIMES
# The program each runtime is found by on the cluster (Pyxis: a plugin of srun, seen in its help).
PROGRAMS = {"apptainer": "apptainer", "singularity": "singularity", "charliecloud": "ch-run", "pyxis": "srun"}

# An image's format, from its name: Apptainer/Singularity's SIF (and the older .simg), SquashFS
# (Charliecloud's .sqfs, enroot's .sqsh), or an unpacked directory (Charliecloud).
_FORMATS = (
    ((".sif", ".simg"), "sif"),
    ((".sqfs", ".squashfs"), "squashfs"),
    ((".sqsh",), "enroot"),
)
# Which runtimes run each format, the preferred first (auto takes the first the cluster has).
RUNNERS = {
    "sif": ("apptainer", "singularity"),
    "squashfs": ("charliecloud",),
    "dir": ("charliecloud",),
    "enroot": ("pyxis",),
}
_REFERENCE = re.compile(r"^[a-z][a-z0-9+.-]*://")


# Inside the image its own Python runs, not the job's venv the setup lines activated (its `python`
# is the host's interpreter with the host's packages): the venv's bin leaves PATH. Not the project's
# environment rv built in the image ($RV_ENV).
DROP_HOST_VENV = (
    'if [ -n "${VIRTUAL_ENV:-}" ] && [ "$VIRTUAL_ENV" != "${RV_ENV:-}" ]; then '
    'PATH=":$PATH:"; PATH="${PATH//:$VIRTUAL_ENV\\/bin:/:}"; PATH="${PATH#:}"; PATH="${PATH%:}"; '
    "unset VIRTUAL_ENV; fi"
)


def is_reference(image):
    """A registry reference (``docker://...``, ``oras://...``), not a path."""
    return bool(_REFERENCE.match(image))


# --- registry references: what each runtime takes, and its own tool that pulls it -----------------

# The schemes each runtime's pull tool takes (Apptainer's and Singularity's `pull`: docker, oras,
# library, shub; enroot's `import` and Charliecloud's `ch-image pull`: a registry's docker://).
SCHEMES = {
    "apptainer": ("docker", "oras", "library", "shub"),
    "singularity": ("docker", "oras", "library", "shub"),
    "charliecloud": ("docker",),
    "pyxis": ("docker",),
}
# The tool each runtime pulls with on the login node (Pyxis: enroot, whose images Pyxis runs).
PULLERS = {
    "apptainer": "apptainer", "singularity": "singularity", "charliecloud": "ch-image", "pyxis": "enroot",
}  # fmt: skip
# What a pull leaves in the cache, by runtime: the format that runtime runs (Charliecloud: SquashFS,
# one file on a shared filesystem, or an unpacked directory where mksquashfs is missing).
PULLED = {
    "apptainer": "image.sif", "singularity": "image.sif", "charliecloud": "image.sqfs", "pyxis": "image.sqsh",
}  # fmt: skip
PULLED_DIR = "image"


def scheme_of(reference):
    return reference.split("://", 1)[0].lower()


def reference_runners(reference):
    """The runtimes whose tool pulls ``reference``, auto's preference first."""
    return tuple(r for r in RUNTIMES if scheme_of(reference) in SCHEMES[r])


def enroot_uri(reference):
    """``docker://[REGISTRY/]IMAGE[:TAG]`` in enroot's (and Pyxis's) spelling, which puts ``#`` after
    the registry: ``docker://REGISTRY#IMAGE[:TAG]``. A first part without a dot, a colon or
    ``localhost`` is Docker Hub's path, as Docker reads it."""
    rest = reference[len("docker://") :]
    first, sep, tail = rest.partition("/")
    if "#" not in rest and sep and ("." in first or ":" in first or first == "localhost"):
        return "docker://%s#%s" % (first, tail)
    return reference


def pull_steps(runtime, reference, tmp, out, squash=True):
    """[(argv, extra environment)] that pull ``reference`` into ``out`` with the runtime's own tool,
    its scratch (and any cache it keeps) in ``tmp``, off the home quota and gone with it.

    - apptainer/singularity: ``pull --disable-cache OUT.sif REF`` (their documented options; TMPDIR
      through APPTAINER_TMPDIR / SINGULARITY_TMPDIR).
    - pyxis: ``enroot import --output OUT.sqsh docker://REGISTRY#IMAGE:TAG`` (ENROOT_TEMP_PATH,
      ENROOT_CACHE_PATH); Pyxis runs the .sqsh file (``--container-image=PATH``).
    - charliecloud: ``ch-image --no-cache pull REF`` into a storage directory of its own
      (CH_IMAGE_STORAGE), then ``ch-convert -i ch-image -o squash REF OUT.sqfs`` (``-o dir`` where
      ``squash`` is false: no mksquashfs).
    """
    if runtime in ("apptainer", "singularity"):
        return [([runtime, "pull", "--disable-cache", out, reference], {runtime.upper() + "_TMPDIR": tmp})]
    if runtime == "pyxis":
        env = {"ENROOT_TEMP_PATH": tmp, "ENROOT_CACHE_PATH": tmp + "/cache"}
        return [(["enroot", "import", "--output", out, enroot_uri(reference)], env)]
    if runtime == "charliecloud":
        name = reference[len("docker://") :]
        env = {"CH_IMAGE_STORAGE": tmp + "/storage"}
        fmt = "squash" if squash else "dir"
        return [
            (["ch-image", "--no-cache", "pull", name], env),
            (["ch-convert", "--tmp", tmp, "-i", "ch-image", "-o", fmt, name, out], env),
        ]
    raise ValueError("no pull for runtime %r" % runtime)


def image_format(image):
    """ "sif", "squashfs", "enroot" or "dir" (anything else: an unpacked image directory)."""
    low = image.lower().rstrip("/")
    for suffixes, fmt in _FORMATS:
        if low.endswith(suffixes):
            return fmt
    return "dir"


def runtime_for(image, runtime, found):
    """The runtime that runs ``image``: ``runtime`` when named, else (auto) the first of the format's
    runners in ``found``; None when none is there."""
    if runtime != "auto":
        return runtime if runtime in found else None
    for name in RUNNERS[image_format(image)]:
        if name in found:
            return name
    return None


def default_runtime(image, runtime):
    """The runtime a line is written for before the cluster is asked (``--dry-run``)."""
    return runtime if runtime != "auto" else RUNNERS[image_format(image)][0]


def _bind_words(runtime, binds):
    if runtime == "charliecloud":
        return ["--bind=%s" % b for b in binds]
    out = []
    for b in binds:
        out += ["--bind", b]
    return out


def wrap_words(runtime, image, binds, workdir, gpus, quote=True):
    """The words in front of the program that run it inside ``image`` (Apptainer, Singularity,
    Charliecloud), already shell-quoted: ``workdir`` and each bind may be a shell word the node's
    task expands (``"$PWD"``); the rest is quoted here.

    - apptainer/singularity: ``exec --nv --bind SRC --pwd DIR IMAGE`` (``--nv``: the host's NVIDIA
      driver and devices, for a job with GPUs). HOME: the runtime's default, the host's home bound.
    - charliecloud: ``ch-run --home --bind=SRC --cd=DIR IMAGE --``. ``--home``: the host's home at
      /home/$USER, HOME set to it, as Charliecloud's users expect; GPUs need the image prepared with
      ``ch-fromhost --nvidia`` (ch-run has no flag for them).
    """
    img = shlex.quote(image) if quote else image
    if runtime in ("apptainer", "singularity"):
        words = [runtime, "exec"] + (["--nv"] if gpus else [])
        words += _bind_words(runtime, binds) + ["--pwd", workdir, img]
        return words
    if runtime == "charliecloud":
        return ["ch-run", "--home"] + _bind_words(runtime, binds) + ["--cd=" + workdir, img, "--"]
    raise ValueError("no program words for runtime %r" % runtime)


def argv_in(c, root, cwd, argv):
    """``argv`` run inside the image of ``c`` ({"runtime", "image"}: an environment's build on the
    login node), the remote root bound, from ``cwd`` (under the root). Pyxis has no login-node form."""
    if c["runtime"] == "pyxis":
        raise ValueError("pyxis runs images only in a Slurm step")
    return wrap_words(c["runtime"], c["image"], [root], cwd, False, quote=False) + list(argv)


def identity(c):
    """What an environment built in the image is keyed by: the runtime, and the image's path, size
    and modification time (a new image at the same path is another environment)."""
    st = os.stat(c["image"])
    return "%s %s %d %d" % (c["runtime"], os.path.realpath(c["image"]), st.st_size, int(st.st_mtime))


def srun_words(image, mounts, workdir):
    """Pyxis's options of the ``srun`` that starts each node's task (pyxis's README):
    ``--container-image=IMAGE --container-mounts=SRC:DST,... --container-workdir=DIR``. GPUs reach
    the container through enroot's NVIDIA hook from Slurm's own allocation; HOME is pyxis's default."""
    return [
        "--container-image=" + image,
        "--container-mounts=" + ",".join("%s:%s" % (m, m) for m in mounts),
        "--container-workdir=" + workdir,
    ]


# --- on the cluster: what is there ------------------------------------------------------------------

_SPLIT = "\n--rv-setup-environment--\n"


def setup_environment(setup, timeout=120):
    """The environment after the profile's setup lines (``module load apptainer``), as a dict: the
    lines run in bash as the job runs them; their output is dropped, a failure is an error."""
    lines = ["set +u"]
    for i, line in enumerate(setup, 1):
        # As the job runs them (rv.slurm.script): a failing line stops here.
        lines += ["{", line, '} || { echo "setup line %d failed" >&2; exit 1; }' % i]
    lines += ["printf '%%s' %s" % shlex.quote(_SPLIT), "env -0"]
    script = "\n".join(lines) + "\n"
    proc = subprocess.run(
        ["bash", "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        timeout=timeout,
    )
    out = proc.stdout.decode("utf-8", "replace")
    if _SPLIT not in out:
        err = proc.stderr.decode("utf-8", "replace").strip()[-500:]
        raise RuntimeError("the setup lines failed (exit %d): %s" % (proc.returncode, err))
    env = {}
    for item in out.split(_SPLIT, 1)[1].split("\0"):
        if "=" in item:
            k, v = item.split("=", 1)
            env[k] = v
    return env


def _version(argv, env):
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return "unknown (%s)" % e
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def find_runtimes(env):
    """The runtimes on this machine's PATH in ``env``: {name: {"path", "version"}}."""
    path = env.get("PATH", os.defpath)
    found = {}
    for name in ("apptainer", "singularity", "charliecloud"):
        prog = shutil.which(PROGRAMS[name], path=path)
        if prog:
            found[name] = {"path": prog, "version": _version([prog, "--version"], env)}
    srun = shutil.which("srun", path=path)
    if srun:
        try:
            proc = subprocess.run(
                [srun, "--help"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env=env, timeout=30,
            )  # fmt: skip
            helptext = proc.stdout.decode("utf-8", "replace")
        except (OSError, subprocess.TimeoutExpired):
            helptext = ""
        if "--container-image" in helptext:
            found["pyxis"] = {"path": srun, "version": "pyxis (srun --container-image)"}
    return found


def expand_image(image, env):
    """``~`` and ``$VAR``/``${VAR}`` expanded as the job's shell would, in ``env``."""
    saved = os.environ.copy()
    try:
        os.environ.clear()
        os.environ.update(env)
        return os.path.expanduser(os.path.expandvars(image))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def describe(found):
    """``apptainer 1.3.4, ch-run 0.31`` or ``none``."""
    if not found:
        return "none"
    return ", ".join("%s (%s)" % (n, found[n]["version"]) for n in sorted(found))


def check(image, runtime, setup):
    """``run-check``'s container part: the image expanded and present, and the runtime that runs it.

    Returns {"image", "runtime", "found"} or {"error", "hint"} (the client refuses the run, exit 2).
    """
    try:
        env = setup_environment(setup)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return {"error": "--container: %s" % e, "hint": "fix the profile's setup lines (rv init)"}
    found = find_runtimes(env)
    if is_reference(image):
        return _check_reference(image, runtime, env, found)
    path = expand_image(image, env)
    if not path.startswith("/") and not is_reference(image):
        return {
            "error": "--container %s: not an absolute path on the cluster (it expands to %r)" % (image, path),
            "hint": "give the image's absolute path, or one starting with ~ or $VAR",
        }
    if not os.path.exists(path):
        return {
            "error": "--container %s: no such image on the cluster (%s)" % (image, path),
            "hint": "copy or pull the image there first (apptainer pull, ch-convert, enroot import)",
        }
    chosen = runtime_for(path, runtime, found)
    if chosen is None:
        if runtime != "auto":
            what = "--container-runtime %s: %s is not on the cluster" % (runtime, PROGRAMS[runtime])
        else:
            fmt = image_format(path)
            what = "--container %s: no runtime here runs a %s image (it needs %s)" % (
                image, fmt, " or ".join(RUNNERS[fmt]))  # fmt: skip
        return {
            "error": "%s; runtimes found: %s" % (what, describe(found)),
            "hint": "load the runtime in the profile's setup lines (e.g. module load apptainer), or "
            "name one that is there with --container-runtime",
        }
    return {"image": path, "runtime": chosen, "found": found}


def _check_reference(image, runtime, env, found):
    """A registry reference: the runtime that runs it and whose own tool pulls it (the pull itself
    is the agent's ``image-pull``, which streams its progress)."""
    runners = reference_runners(image)
    path = env.get("PATH", os.defpath)
    pullable = [r for r in runners if r in found and shutil.which(PULLERS[r], path=path)]
    scheme = scheme_of(image)
    hint = ("load the runtime and its pull tool in the profile's setup lines (e.g. module load apptainer), "
            "or pull the image on the cluster and give its path")  # fmt: skip
    if runtime != "auto" and runtime not in runners:
        takes = ", ".join(s + "://" for s in SCHEMES[runtime])
        return {"error": "--container-runtime %s does not pull %s:// references (it takes %s)"
                % (runtime, scheme, takes), "hint": hint}  # fmt: skip
    if runtime != "auto" and runtime not in found:
        return {"error": "--container-runtime %s: %s is not on the cluster; runtimes found: %s"
                % (runtime, PROGRAMS[runtime], describe(found)), "hint": hint}  # fmt: skip
    if runtime != "auto" and runtime not in pullable:
        return {"error": "--container %s: %s, the tool %s pulls with, is not on the cluster"
                % (image, PULLERS[runtime], runtime), "hint": hint}  # fmt: skip
    if not pullable:
        tools = ", ".join("%s (%s)" % (PULLERS[r], r) for r in runners)
        return {"error": "--container %s: nothing here pulls it (it needs one of %s); runtimes found: %s"
                % (image, tools, describe(found)), "hint": hint}  # fmt: skip
    return {"image": image, "runtime": runtime if runtime != "auto" else pullable[0], "found": found,
            "reference": True}  # fmt: skip
