"""`rv jupyter`'s core: JupyterLab in a step of a live session's job, its kernel in the job's environment.

Where JupyterLab comes from: the job's own environment (the project's, or the setup lines') when it
has ``jupyterlab``; else a tools environment rv builds once per cluster and interpreter with its own
machinery (rv.pyenv: ``envs/<key>`` under the remote root, ``jupyterlab`` pinned to
:data:`JUPYTERLAB_VERSION`; `rv venv ls` lists it). Either way the kernel runs the job's Python: the
kernel spec rv writes (``python3``, shadowing the server's own) starts that interpreter, with the
tools environment's packages after the project's on ``sys.path`` when the project has no
``ipykernel``. The server and its kernels start from the job's environment file and in a step of the
job, so a notebook sees the GPUs, ``RV_PRECISION``, the secrets and the work dir a program would.

The server is a step started from the login node under ``setsid nohup`` (``srun --overlap``, as `rv
ssh`'s shell): it outlives `rv jupyter` and its forward, and ends with the job. It listens on the
node's address as Slurm knows it (where the tunnel goes) with a token rv made (kept 0600 in the
session's folder, never on a command line); its runtime file says the port.
"""

from __future__ import annotations

import json
import posixpath
import secrets
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rv.agent import layout
from rv.errors import RemoteError
from rv.job.inside import RunningJob
from rv.job.serve import put_folder, session_folder
from rv.pyenv.spec import EnvSpec
from rv.slurm import commands

if TYPE_CHECKING:
    from rv.remote.transport import Transport

JUPYTERLAB_VERSION = "4.6.6"  # the tools environment's; constraints.txt pins the same for the tests
SESSION_DIR = layout.JUPYTER
START_TIMEOUT_S = 300

# On the login node: is the session's server running (its srun alive, its runtime file there)? Else,
# does the job's environment have JupyterLab? $1: the session's folder, $2: the job's environment file.
STATUS = r"""d=$1
if [ -f "$d/srun.pid" ] && kill -0 "$(cat "$d/srun.pid")" 2>/dev/null; then
    f=$(ls -t "$d"/runtime/jpserver-*.json 2>/dev/null | head -n 1)
    if [ -n "$f" ]; then echo running; cat "$f"; exit 0; fi
fi
echo stopped
has_lab='p=$(command -v python3 || command -v python) && "$p" -c "import jupyterlab" && echo has-lab'
(
    [ -r "$2" ] && . "$2" >/dev/null 2>&1
    if [ -r "${2%/*}/container.sh" ]; then
        # A session in an image: its Python is asked, inside (the runtime runs here as for builds).
        . "${2%/*}/container.sh"
        rv_in_container bash -c '. "$1" >/dev/null 2>&1; eval "$2"' rv-jupyter "$2" "$has_lab"
        exit 0  # the runtime did not start here: not the host's Python's answer (rv builds the tools)
    fi
    eval "$has_lab"
) 2>/dev/null
exit 0
"""

# On the login node: start the server's step ("$@", a srun line) detached from rv's connection, and
# wait until JupyterLab has written its runtime file (it listens then). $1: the session's folder.
START = r"""d=$1
shift
mkdir -p "$d/runtime" && rm -f "$d"/runtime/jpserver-*.json
cd / || exit 1
setsid nohup "$@" >"$d/jupyter.log" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$d/srun.pid"
i=0
while [ "$i" -lt "$((TIMEOUT * 2))" ]; do
    f=$(ls -t "$d"/runtime/jpserver-*.json 2>/dev/null | head -n 1)
    if [ -n "$f" ]; then sleep 0.5; cat "$f"; exit 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "rv: JupyterLab ended before it listened; its log ($d/jupyter.log) ends:" >&2
        tail -n 15 "$d/jupyter.log" >&2
        exit 3
    fi
    sleep 0.5
    i=$((i + 1))
done
echo "rv: JupyterLab did not listen within TIMEOUT s; its log ($d/jupyter.log) ends:" >&2
tail -n 15 "$d/jupyter.log" >&2
exit 4
""".replace("TIMEOUT", str(START_TIMEOUT_S))

# On the node, in the server's step: the job's environment, the kernel spec, then JupyterLab.
# $1: the address to listen on, $2: the tools environment ("" when the job's has JupyterLab).
NODE = r"""d=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
addr=$1 tools=$2
env_file=ENV_FILE
# A session in an image (rv up --container): this script again, inside it (rv.slurm.container).
if [ -r "$env_file" ] && [ -r "${env_file%/*}/container.sh" ] && [ -z "${RV_IN_CONTAINER-}" ]; then
    . "${env_file%/*}/container.sh"
    cd -- WORK_DIR 2>/dev/null || true
    export RV_IN_CONTAINER=1
    rv_in_container bash "${BASH_SOURCE[0]}" "$@"
fi
if [ -r "$env_file" ]; then
    . "$env_file" >/dev/null
else
    echo "rv: job ${SLURM_JOB_ID:-?} saved no environment: JupyterLab starts in a plain one" >&2
    cd -- WORK_DIR 2>/dev/null || true
fi
if ! py=$(command -v python3 || command -v python); then
    echo "rv: no python3 in the job's environment" >&2
    exit 98
fi
server=$py site=""
if ! "$py" -c 'import jupyterlab' 2>/dev/null; then
    if [ -z "$tools" ] || [ ! -x "$tools/bin/python" ]; then
        echo "rv: JupyterLab is not in the job's environment, and no tools environment was given" >&2
        exit 97
    fi
    server=$tools/bin/python
    if ! "$py" -c 'import ipykernel' 2>/dev/null; then
        site=$("$server" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    fi
fi
# rv's kernel spec first: jupyter_core 5 otherwise prefers a venv's own folders (the tools
# environment's python3 kernel, which is not the job's Python) to JUPYTER_DATA_DIR.
export JUPYTER_CONFIG_DIR="$d/config" JUPYTER_DATA_DIR="$d/data" JUPYTER_RUNTIME_DIR="$d/runtime"
export JUPYTER_PREFER_ENV_PATH=0
"$py" - "$JUPYTER_DATA_DIR/kernels/python3" "$site" "${RV_RUN_NAME:-session}" <<'EOF' || exit 96
KERNEL_SPEC
EOF
free='import socket, sys; s = socket.socket(); s.bind((sys.argv[1], 0)); print(s.getsockname()[1])'
port=$("$server" -c "$free" "$addr") || exit 95
echo "rv: JupyterLab from $server, kernel $py, on $addr:$port in $PWD" >&2
exec "$server" -m jupyterlab --no-browser --ip="$addr" --port="$port" --ServerApp.root_dir="$PWD"
"""

# Python 3.6+ (the job's interpreter): the kernel spec that runs that interpreter.
KERNEL_SPEC = r"""import json, os, sys
folder, site, name = sys.argv[1], sys.argv[2], sys.argv[3]
if not os.path.isdir(folder):
    os.makedirs(folder)
code = "from ipykernel.kernelapp import launch_new_instance; launch_new_instance()"
if site:
    # The project's packages first (a venv's own), then the tools environment's (ipykernel and what
    # it needs), then the interpreter's own: an image's or a distribution's older packages
    # (Debian 12's typing_extensions) must not shadow what ipykernel needs.
    code = ("import sys\n"
            "venv = sys.prefix != getattr(sys, 'base_prefix', sys.prefix)\n"
            "at = [i for i, p in enumerate(sys.path) if p.rstrip('/').endswith(('site-packages', "
            "'dist-packages')) and not (venv and p.startswith(sys.prefix + '/'))]\n"
            "sys.path.insert(at[0] if at else len(sys.path), %r)\n%s") % (site, code)
with open(os.path.join(folder, "kernel.json"), "w") as fh:
    json.dump({"argv": [sys.executable, "-c", code, "-f", "{connection_file}"],
               "display_name": "Python (rv %s)" % name, "language": "python",
               "metadata": {"debugger": True}}, fh)
"""


def tools_spec(python: str | None = None) -> EnvSpec:
    """The tools environment's spec: JupyterLab alone, for rv's environment builder (rv.pyenv)."""
    return EnvSpec(
        "requirements",
        "",
        (("requirements.txt", f"jupyterlab=={JUPYTERLAB_VERSION}\n".encode()),),
        python=python,
    )


@dataclass(frozen=True)
class Server:
    """A JupyterLab server of a session, as its runtime file says."""

    port: int
    token: str
    started: bool  # by this call (else it was running already)

    def url(self, local_port: int) -> str:
        return f"http://127.0.0.1:{local_port}/lab?token={self.token}"


@dataclass(frozen=True)
class Status:
    running: Server | None
    has_lab: bool  # the job's environment has JupyterLab (no tools environment needed)


def folder(rj: RunningJob) -> str:
    return session_folder(rj, SESSION_DIR)


def status(transport: Transport, rj: RunningJob) -> Status:
    """One round trip: the session's server if it runs, else whether the job's environment has
    JupyterLab."""
    line = commands.shell(["bash", "-c", STATUS, "rv-jupyter", folder(rj), rj.place.env_file])
    result = transport.run(line, timeout=120).check("asking the cluster for the session's JupyterLab")
    head, _, rest = result.out.partition("\n")
    if head.strip() == "running":
        info = _runtime(rest)
        if info is not None:
            return Status(Server(int(info["port"]), str(info["token"]), started=False), has_lab=True)
    return Status(None, has_lab="has-lab" in rest.split())


def start(transport: Transport, rj: RunningJob, *, address: str, tools: str | None) -> Server:
    """Write the session's Jupyter config (a new token) and scripts, start the server's step, and
    wait until it listens: one round trip."""
    where = folder(rj)
    token = secrets.token_hex(24)
    config = {
        "IdentityProvider": {"token": token},
        # Nothing fetched from the internet by the page or the server on its own.
        "LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"},
        "ServerApp": {"open_browser": False},
    }
    node_script = (
        NODE.replace("KERNEL_SPEC", KERNEL_SPEC.strip())
        .replace("ENV_FILE", shlex.quote(rj.place.env_file))
        .replace("WORK_DIR", shlex.quote(rj.place.work_dir))
    )
    srun = commands.srun_attach(
        rj.job_id, rj.nodes[0], ["bash", posixpath.join(where, "start.sh"), address, tools or ""]
    )
    then = commands.shell(["bash", "-c", START, "rv-jupyter", where, *srun])
    result = put_folder(
        transport,
        where,
        {
            "config/jupyter_server_config.json": (json.dumps(config, indent=1).encode(), 0o600),
            "start.sh": (node_script.encode(), 0o600),
        },
        then=then,
        timeout=START_TIMEOUT_S + 60,
    )
    info = _runtime(result.out) if result.exit_code == 0 else None
    if info is None:
        detail = result.err.strip() or result.out.strip() or "no message"
        raise RemoteError(
            f"JupyterLab did not start in session {rj.name} (job {rj.job_id}): {detail}",
            hint=f"rv ssh {rj.name} -- cat {shlex.quote(posixpath.join(where, 'jupyter.log'))}",
        )
    return Server(int(info["port"]), str(info["token"]), started=True)


def _runtime(text: str) -> dict[str, Any] | None:
    """JupyterLab's runtime file (``jpserver-PID.json``): its port and token; None when unreadable."""
    try:
        info = json.loads(text)
    except ValueError:
        return None
    if not isinstance(info, dict) or "port" not in info or "token" not in info:
        return None
    return info
