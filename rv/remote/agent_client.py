"""Talking to rv's agent: the stdlib-only program (the modules of :mod:`rv.agent`, in AGENT_MODULES)
that every cluster-side operation runs as, one ``python3 -c`` call per operation.

A module of its own because every command that talks to the cluster needs it (`rv ps`, `rv logs`,
`rv status`) and none of those should pay for importing the snapshot machinery.
"""

from __future__ import annotations

import ast
import base64
import bz2
import contextlib
import functools
import hashlib
import io
import json
import shlex
import struct
import sys
import tokenize
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rv.errors import (
    PLACEMENT_HINT,
    ConnectionLost,
    NotFound,
    RemoteCommandMissing,
    RemoteError,
    RvError,
    UsageError,
)
from rv.remote.transport import RunResult, Stdin, Transport

# The cluster-side agent is one program made of these modules of rv/agent/, in this order (each after
# the ones it imports): each is compiled into a module of its own name there, so they import each
# other as they do here. Their files are read, never imported: the laptop does not load the agent.
AGENT_MODULES = (
    "manifest", "segment", "layout", "common", "locks", "packformat", "packfile", "storecheck", "store",
    "oldstore", "transfer", "metrics", "quota", "slurmcmd", "rundir", "runs", "container", "submit", "follow",
    "up", "envs", "images", "gc", "why", "runfiles", "__main__",
)  # fmt: skip
_AGENT_DIR = Path(__file__).resolve().parent.parent / "agent"


def shipped_source(source: str) -> str:
    """``source`` without its comments and docstrings, every line where it was.

    The agent travels on the command line, which sshd caps at 128 KiB with the arguments: what it
    says to readers need not travel. Lines keep their numbers, so a cluster-side traceback points
    at the same line of rv/agent/ as here.
    """
    docstring_rows = {
        body[0].lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    }
    lines = source.splitlines(keepends=True)
    blanks: list[tuple[tuple[int, int], tuple[int, int], str]] = []
    first_on_row: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        row = tok.start[0]
        if tok.type == tokenize.COMMENT:
            blanks.append((tok.start, tok.end, ""))
        elif tok.type == tokenize.STRING and row in docstring_rows and row not in first_on_row:
            blanks.append((tok.start, tok.end, '""' + "\n" * (tok.end[0] - row)))
        if tok.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.NEWLINE):
            first_on_row.add(row)
    for (r0, c0), (r1, c1), text in reversed(blanks):
        joined = lines[r0 - 1][:c0] + text + lines[r1 - 1][c1:]
        lines[r0 - 1 : r1] = [joined] if r0 == r1 else [*joined.splitlines(keepends=True)]
    return "".join(lines)


Shipped = tuple[tuple[str, ...], tuple[int, ...], str, str]


@functools.cache
def _agent_sources() -> Shipped:
    """The agent's modules as shipped: names, lengths, one compressed blob of them all, and a key.

    One bzip2 stream of all modules packs 15% smaller than one per module (they share words), and
    bzip2 packs this source text 17% smaller than zlib at level 9 (the program must stay under 64 KiB:
    see _agent_bootstrap; bz2 is in every CPython's standard library, RHEL 8's 3.6 included); the
    key (what the cluster's compiled-code cache is named by) hashes the shipped text. Stripping
    the sources (tokenize, ast) takes ~0.25 s, which a command started without the command server
    would pay every time: the result is kept in the cache folder, named by the sources' hash.
    """
    names = tuple(f"rv.agent.{module}" for module in AGENT_MODULES)
    sources = [(_AGENT_DIR / f"{module}.py").read_bytes() for module in AGENT_MODULES]
    from rv.config import cache_dir, write_private

    # Named by this file too: how the sources are stripped and packed is written here.
    made_by = (*names, __name__), [*sources, Path(__file__).read_bytes()]
    kept = cache_dir() / "agent" / f"{_digest(*made_by)[:32]}.json"
    shipped = _read_shipped(kept, names)
    if shipped is None:
        texts = [shipped_source(src.decode("utf-8")).encode("utf-8") for src in sources]
        # Level 9: every command pays for the bytes on the line; compressing happens once per version.
        blob = base64.b64encode(bz2.compress(b"".join(texts), 9)).decode("ascii")
        shipped = (names, tuple(len(t) for t in texts), blob, _digest(names, texts)[:20])
        with contextlib.suppress(OSError):  # a cache: without it, the next command strips again
            write_private(kept, json.dumps(shipped).encode("ascii"))
    return shipped


def _digest(names: Sequence[str], texts: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    for name, text in zip(names, texts, strict=True):
        digest.update(name.encode() + b"\0" + text)
    return digest.hexdigest()


def _read_shipped(path: Path, names: tuple[str, ...]) -> Shipped | None:
    """A kept result, when it is whole: its blob must still hash to its key (else it is made again)."""
    try:
        got_names, sizes, blob, key = json.loads(path.read_bytes())
        whole = bz2.decompress(base64.b64decode(blob))
    except (OSError, ValueError, TypeError, EOFError):
        return None
    if tuple(got_names) != names or len(sizes) != len(names) or sum(sizes) != len(whole):
        return None
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    texts = [whole[offsets[i] : offsets[i + 1]] for i in range(len(names))]
    if _digest(names, texts)[:20] != key:
        return None
    return names, tuple(sizes), blob, key


def agent_key() -> str:
    """Names the agent's code: a pre-started agent serves only requests of the same code."""
    return _agent_sources()[3]


@functools.cache
def _agent_bootstrap(hot: bool = False) -> str:
    """The ``python3 -c`` program that runs the agent: its modules travel compressed on every call.

    Decompressing and compiling them costs the cluster ~60 ms a call, more than most modes' work,
    so the compiled code is kept in ``${XDG_CACHE_HOME:-~/.cache}/rv/agent/`` on the cluster (0700),
    named by a hash of the sources and the interpreter's cache tag: later calls read it with marshal
    (~1 ms). A missing, damaged or foreign file is simply recompiled and rewritten; nothing else is
    ever read from there.

    ``hot``: the mode and arguments come on stdin (see agent_request) instead of the command line,
    so the program can be started, its modules loaded, before anyone knows what it will be asked.
    """
    names, sizes, blob, key = _agent_sources()
    if hot:
        run = (
            "import json,struct\nH=sys.stdin.buffer;b=H.read(4)\n"
            "if len(b)<4:sys.exit(0)\n"  # closed before it was asked anything
            "M,A=json.loads(H.read(struct.unpack('>I',b)[0]).decode())\n"
            "sys.exit(sys.modules['rv.agent.__main__'].main(['-c',M,A]))"
        )
    else:
        run = "sys.exit(sys.modules['rv.agent.__main__'].main(sys.argv))"
    return (
        "import base64,bz2,marshal,os,sys,types\n"
        f"P={list(names)!r}\n"
        "for p in ('rv','rv.agent'):\n m=types.ModuleType(p);m.__path__=[];sys.modules[p]=m\n"
        "d=os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'),'rv','agent')\n"
        f"f=os.path.join(d,{key!r}+'-'+sys.implementation.cache_tag+'.bin')\n"
        "try:\n"
        " with open(f,'rb') as h:C=marshal.load(h)\n"
        " assert len(C)==len(P)\n"
        # A cache, so any failure to read it means: compile from the sources sent along.
        "except Exception:\n"
        f" S=bz2.decompress(base64.b64decode({blob!r}));C=[];o=0\n"
        f" for n,k in zip(P,{list(sizes)!r}):C.append(compile(S[o:o+k],n,'exec'));o+=k\n"
        " try:\n"
        "  os.makedirs(d,0o700,exist_ok=True);t='%s.%d'%(f,os.getpid())\n"
        "  with open(t,'wb') as h:marshal.dump(C,h)\n"
        "  os.chmod(t,0o600);os.replace(t,f)\n"
        " except OSError:pass\n"
        "for n,c in zip(P,C):\n"
        " m=types.ModuleType(n);sys.modules[n]=m;p,_,a=n.rpartition('.');setattr(sys.modules[p],a,m)\n"
        " exec(c,m.__dict__)\n" + run
    )


# Arguments longer than this travel compressed ("z:" + base64 of zlib): sshd hands the whole command
# line to the login shell as one argument, which Linux caps at 128 KiB (MAX_ARG_STRLEN), and the
# agent's own program takes ~50 KiB of it (its sources without comments or docstrings). A run over
# two GPU types (two scripts and the job runtime) passed the cap as plain JSON: "Argument list too
# long".
INLINE_ARGS = 8192


def encode_args(args: dict[str, Any]) -> str:
    """The agent's arguments as one command-line word: JSON, compressed when long."""
    text = json.dumps(args)
    if len(text) <= INLINE_ARGS:
        return text
    return "z:" + base64.b64encode(zlib.compress(text.encode("utf-8"), 6)).decode("ascii")


def agent_command(mode: str, args: dict[str, Any]) -> str:
    """The shell line that runs the agent (:mod:`rv.agent`) on the cluster (isolated mode, no site).

    The system's /usr/bin/python3 is preferred over whatever ``python3`` is first on PATH: pyenv and
    conda shims there cost 50-150 ms per call (on the loopback cluster, more than the work itself),
    and a user's broken environment cannot break syncing. The agent needs the stdlib only.
    """
    program = " ".join(
        ["-I", "-S", "-c", shlex.quote(_agent_bootstrap()), shlex.quote(mode), shlex.quote(encode_args(args))]
    )
    return f'p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" {program}'


def hot_agent_command() -> str:
    """The shell line of an agent started ahead of time: it waits for agent_request on stdin."""
    program = shlex.quote(_agent_bootstrap(True))
    return f'p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" -I -S -c {program}'


def agent_request(mode: str, args: dict[str, Any]) -> bytes:
    """What a pre-started agent reads first: the mode and arguments agent_command would pass."""
    data = json.dumps([mode, json.dumps(args)]).encode()
    return struct.pack(">I", len(data)) + data


# Frames larger than this are compressed at level 1: a 50,000-file manifest (4.4 MB of JSON) took
# 0.14 s of CPU at level 6 and 0.05 s at level 1, for 5% more bytes (and it may travel twice).
FAST_FRAME = 1 << 20


def frame(obj: Any) -> bytes:
    raw = json.dumps(obj, ensure_ascii=True).encode("ascii")
    data = zlib.compress(raw, 1 if len(raw) > FAST_FRAME else 6)
    return struct.pack(">I", len(data)) + data


_AGENT_ERRORS: dict[str, type[RvError]] = {"usage": UsageError, "not-found": NotFound, "live": UsageError}

# The next step for each kind of failure the cluster side reports (its words say what failed; the
# mode's name, `run-check`, is rv's own and means nothing to a user: it goes in no message).
_AGENT_HINTS: dict[str, str] = {
    "sbatch": PLACEMENT_HINT,
    "live": "rv ps   rv stop NAME   or pick another --name",
    "busy": "wait for it to finish, then run the command again",
    "squeue": "rv status asks Slurm on the cluster; try again once it answers",
    "not-found": "rv ps -a lists runs; rv venv ls lists environments",
    "usage": "change what it names, then run the command again",
}
_AGENT_HINT = "rv status checks the connection and Slurm; RV_DEBUG=1 shows what rv sent and got"


# What an agent call does when its connection is lost before its answer (ConnectionLost: it may
# have run), one entry per mode of rv/agent/__main__.py's table (tests/unit/test_lost_connections.py
# holds them equal): True, it is asked again, once, over a fresh connection (a read, or a change that
# a repeat leaves as the first left it); a mode's name, that mode is asked first, with the same
# arguments, whether the call arrived (``arrived``: its reply is then the call's), and the call is
# sent again only if it did not; False, never again: the command fails saying it may have been done;
# a function, True or False by the call's arguments.
ON_LOST: dict[str, bool | str | Callable[[dict[str, Any]], bool]] = {
    "snap-put": True,  # objects by their ids, then the ref: a repeat changes nothing (if not a stream)
    "snap-code": True,
    "scan": True,
    "apply": False,  # rv sync push's files, from a stream
    "send": True,
    "run-check": True,
    "run-submit": "run-arrived",
    "run-arrived": True,
    "sweep-submit": False,  # many points and arrays: "may have been sent", as a Ctrl-C says
    "runs": True,
    "follow": True,
    "run-stop": True,  # STOP and scancel once more change nothing
    "secrets-sweep": True,
    "ckpt-ls": True,
    "why-probe": True,  # sbatch --test-only submits nothing
    "metrics": True,
    "up": False,
    # The listing (--dry-run) removes nothing; a collection's reply says what it removed, and a
    # repeat would say nothing.
    "gc": lambda args: bool(args.get("dry_run")),
    "usage": True,
    "env": False,  # a build
    "venv-ls": True,
    "venv-rm": False,  # a repeat would say it is not there
    "image-pull": True,  # under the key's lock: a repeat waits for the first and reuses its image
}


def call_agent(
    transport: Transport, mode: str, args: dict[str, Any], *, stdin: Any = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run one agent mode and return its reply; failures become rv errors with the remote's words.

    A transport that keeps an agent started ahead of time (the warm connection) is asked through
    ``run_agent``: the agent's start-up is then off the command's path. A call whose connection is
    lost before its answer is asked again over a fresh one (the transport's ``reconnect``) as ON_LOST
    says, with one line on stderr; its stdin must be bytes to be sent twice.
    """
    try:
        return _call_once(transport, mode, args, stdin, timeout)
    except ConnectionLost as lost:
        on_lost = ON_LOST[mode]
        if callable(on_lost):
            on_lost = on_lost(args)
        reconnect = getattr(transport, "reconnect", None)
        if on_lost is False or reconnect is None or not (stdin is None or isinstance(stdin, bytes)):
            if on_lost is True:
                raise
            raise _may_have_run(lost) from None
        reconnect()
        if isinstance(on_lost, str):
            try:
                check = _call_once(transport, on_lost, args, None, timeout)
            except ConnectionLost as again:
                raise _may_have_run(again) from None
            if check.get("arrived"):
                _note(f"{lost.message}; reconnected: it had reached the cluster, and was not sent again")
                return check
            _note(f"{lost.message}; reconnected: it had not reached the cluster, and was sent again")
        else:
            _note(f"{lost.message}; reconnected and asked again")
        return _call_once(transport, mode, args, stdin, timeout)


def _call_once(
    transport: Transport, mode: str, args: dict[str, Any], stdin: Any, timeout: float | None
) -> dict[str, Any]:
    run_agent = getattr(transport, "run_agent", None)
    if run_agent is not None:
        res = run_agent(mode, args, stdin=stdin, timeout=timeout)
    else:
        res = transport.run(agent_command(mode, args), stdin=stdin, timeout=timeout)
    return agent_reply(mode, res.exit_code, res.stdout, res.err)


def _may_have_run(lost: ConnectionLost) -> ConnectionLost:
    """The loss of a call that is not asked again: what it asked may have been done."""
    return ConnectionLost(
        f"{lost.message}: what it asked of the cluster may have been done",
        hint="rv ps shows what was sent; check before running the command again",
    )


def _note(text: str) -> None:
    sys.stderr.write(f"rv: note: {text}\n")
    sys.stderr.flush()


class Lines:
    """Splits a byte stream into lines for ``on_line``."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self.buf = b""

    def feed(self, data: bytes) -> None:
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            self.on_line(line.decode("utf-8", "replace"))


def agent_call_telling(
    transport: Transport, mode: str, args: dict[str, Any], on_line: Callable[[str], None], timeout: float
) -> dict[str, Any]:
    """One long agent call (an environment's build, an image's pull) whose stderr reaches ``on_line``
    line by line as it comes, so the laptop shows the tool's progress; its reply as agent_reply."""
    out: list[bytes] = []
    err: list[bytes] = []
    lines = Lines(on_line)

    def on_stderr(data: bytes) -> None:
        err.append(data)
        lines.feed(data)

    code = transport.stream(
        agent_command(mode, args), on_stdout=out.append, on_stderr=on_stderr, timeout=timeout
    )
    return agent_reply(mode, code, b"".join(out), b"".join(err))


def agent_reply(mode: str, exit_code: int, stdout: bytes, stderr: bytes | str) -> dict[str, Any]:
    """The reply of one agent call, from its exit code and output; failures become rv errors."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", "replace")
    if exit_code == 127:
        raise RemoteCommandMissing(
            "python3 is not on the cluster's PATH (rv needs it, stdlib only, to sync files)",
            hint="add `module load python` (or similar) to the profile's setup, or ask the admins",
        )
    if exit_code != 0:
        tail = " / ".join(stderr.strip().splitlines()[-3:])
        # Not an answer but a crash (or a cut connection): the step's own name is what a report needs.
        raise RemoteError(
            f"remote {mode} failed (exit {exit_code}): {tail or 'no message'}",
            hint="check the connection (rv status); if it keeps failing, rerun with RV_DEBUG=1 and report it",
        )
    try:
        reply = json.loads(zlib.decompress(stdout))
    except (zlib.error, ValueError) as exc:
        raise RemoteError(
            f"remote {mode} sent an unreadable reply: {stdout[:120]!r}",
            hint="a login script that prints to stdout corrupts replies: make it quiet for non-interactive "
            "shells",
        ) from exc
    if isinstance(reply, dict) and "error" in reply:
        code = str(reply.get("code", ""))
        hint = _AGENT_HINTS.get(code, _AGENT_HINT)
        if reply.get("errno") in ("ENOSPC", "EDQUOT"):
            hint = "free space under the remote root: `rv sync gc` removes snapshots no job needs"
        elif reply.get("errno") in ("EACCES", "EPERM", "EROFS"):
            hint = "check the profile's remote_root is writable by you (`rv init` to change it)"
        raise _AGENT_ERRORS.get(code, RemoteError)(str(reply["error"]), hint=hint)
    if not isinstance(reply, dict):
        raise RemoteError(f"remote {mode} sent a reply that is not an object: {str(reply)[:120]}")
    return reply


def run_agent_over(
    stream: Callable[..., int], mode: str, args: dict[str, Any], *, stdin: Stdin, timeout: float | None
) -> RunResult:
    """rv's agent in ``mode``, through ``stream`` of a transport that can hand an agent call to an agent
    started ahead of time (its ``agent`` option; see rv.remote.ssh's prestart); where it has none of
    this code, the call runs as any command. The ``run_agent`` of the SSH and warm transports."""
    out: list[bytes] = []
    err: list[bytes] = []
    code = stream(
        agent_command(mode, args),
        on_stdout=out.append,
        on_stderr=err.append,
        stdin=stdin,
        timeout=timeout,
        agent={"key": agent_key(), "mode": mode, "args": args},
    )
    return RunResult(code, b"".join(out), b"".join(err))
