"""What `rv init` learns about a cluster, in one round trip, and the profile it builds from that."""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field, replace

from rv.catalog import BUILTIN_CATALOGS, GpuType, Partition
from rv.config import Profile, remote_root_problem
from rv.errors import RemoteCommandMissing, UsageError
from rv.remote.transport import Transport
from rv.slurm.commands import SINFO_PARTITION_FORMAT
from rv.slurm.parse import (
    SINFO_NODE_FORMAT,
    account_from_allocations,
    discover_catalog,
    parse_allocations,
    parse_sacctmgr_accounts,
    parse_sinfo_nodes,
)
from rv.timespec import format_slurm_time, parse_slurm_time

REQUIRED_COMMANDS = ("sbatch", "squeue", "sacct")
_OPTIONAL_COMMANDS = ("sinfo", "scontrol", "sacctmgr", "allocations", "python3")

# One shell script, one round trip. Sections are introduced by marker lines so a command that prints
# nothing (or fails) cannot shift the others.
PROBE_SCRIPT = f"""
echo @@user; id -un
echo @@home; printf '%s\\n' "$HOME"
echo @@commands
for c in {" ".join(REQUIRED_COMMANDS + _OPTIONAL_COMMANDS)}; do
  command -v "$c" >/dev/null 2>&1 && echo "$c"
done
echo @@scratch; u=$(id -un); [ -d "/scratch/$u" ] && [ -w "/scratch/$u" ] && printf '%s\\n' "/scratch/$u"
echo @@allocations; command -v allocations >/dev/null 2>&1 && allocations 2>/dev/null
echo @@assoc
command -v sacctmgr >/dev/null 2>&1 && sacctmgr -nP show assoc user="$(id -un)" format=account 2>/dev/null
echo @@sinfo; command -v sinfo >/dev/null 2>&1 && sinfo -h -N -O {shlex.quote(SINFO_NODE_FORMAT)} 2>/dev/null
echo @@partitions
command -v sinfo >/dev/null 2>&1 && sinfo -h -o {shlex.quote(SINFO_PARTITION_FORMAT)} 2>/dev/null
echo @@qos
command -v sacctmgr >/dev/null 2>&1 &&
  sacctmgr -nP show assoc user="$(id -un)" format=account,partition,defaultqos,qos 2>/dev/null
echo @@qoswall
command -v sacctmgr >/dev/null 2>&1 && sacctmgr -nP show qos format=name,maxwall 2>/dev/null
echo @@git; command -v git >/dev/null 2>&1 && git --version 2>/dev/null
echo @@containers
for c in apptainer singularity ch-run; do
  command -v "$c" >/dev/null 2>&1 && printf '%s %s\\n' "$c" "$("$c" --version 2>&1 | sed -n 1p)"
done
command -v srun >/dev/null 2>&1 && srun --help 2>&1 | grep -e --container-image >/dev/null &&
  echo "pyxis (srun --container-image)"
echo @@end
"""


def parse_probe(text: str) -> dict[str, list[str]]:
    """Split the probe's output into its sections: {"user": [...], "commands": [...], ...}."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = sections.setdefault(line[2:].strip(), [])
        elif current is not None:
            current.append(line)
    return sections


@dataclass(frozen=True)
class ClusterFacts:
    user: str
    home: str
    commands: frozenset[str]
    scratch: str | None
    account: str | None
    accounts: tuple[str, ...]
    catalog: dict[str, GpuType] = field(default_factory=dict)
    partitions: dict[str, Partition] = field(default_factory=dict)
    # sacctmgr's associations of the user, (account, partition, default QOS, QOS list), and each
    # QOS's MaxWall: which QOS a job gets, and its time limit.
    associations: tuple[tuple[str, str, str, tuple[str, ...]], ...] = ()
    qos_max_wall: dict[str, str] = field(default_factory=dict)
    git_version: str | None = None  # `git --version` on the login node (None: no git there)
    # Container runtimes on the login PATH before any setup line, with versions ("ch-run 0.31").
    container_runtimes: tuple[str, ...] = ()

    @property
    def git_problem(self) -> str | None:
        return git_problem(self.git_version)

    @property
    def default_remote_root(self) -> str:
        # Scratch first: home quotas on HPC systems are small and fill up with checkpoints and caches.
        return posixpath.join(self.scratch or self.home, "rv")


def facts_from_probe(text: str) -> ClusterFacts:
    s = parse_probe(text)
    if "end" not in s:
        raise RemoteCommandMissing(
            "the cluster's shell did not run rv's probe to the end",
            hint="check that your login shell on the cluster is bash-compatible and prints nothing on "
            "non-interactive logins",
        )
    commands = frozenset(c.strip() for c in s.get("commands", []) if c.strip())
    missing = [c for c in REQUIRED_COMMANDS if c not in commands]
    if missing:
        raise RemoteCommandMissing(
            f"{', '.join(missing)} not found on the cluster's login node",
            hint="load Slurm in your shell startup on the cluster (e.g. `module load slurm` in ~/.bashrc) "
            "or check that this host is a Slurm login node",
        )
    # Rivanna's `allocations` knows which accounts have SUs left; elsewhere the Slurm associations.
    allocations = "\n".join(s.get("allocations", []))
    sacctmgr = parse_sacctmgr_accounts("\n".join(s.get("assoc", [])))
    accounts = list(dict.fromkeys([a.account for a in parse_allocations(allocations)] + sacctmgr))
    best = account_from_allocations(allocations) or (accounts[0] if accounts else None)
    user = (s.get("user") or [""])[0].strip()
    home = (s.get("home") or [""])[0].strip()
    scratch = next(iter(s.get("scratch") or []), None)
    return ClusterFacts(
        user=user,
        home=home,
        commands=commands,
        scratch=scratch.strip() if scratch else None,
        account=best,
        accounts=tuple(accounts),
        catalog=discover_catalog("\n".join(s.get("sinfo", []))),
        partitions=parse_partitions("\n".join(s.get("partitions", [])), "\n".join(s.get("sinfo", []))),
        associations=parse_associations("\n".join(s.get("qos", []))),
        qos_max_wall=parse_qos_walls("\n".join(s.get("qoswall", []))),
        git_version=next((line.strip() for line in s.get("git", []) if line.strip()), None),
        container_runtimes=tuple(line.strip() for line in s.get("containers", []) if line.strip()),
    )


# The oldest git the cluster's store works with (rv.agent.store.MIN_GIT, which the agent checks
# itself: laptop code does not import the agent; a unit test holds the two equal).
MIN_GIT = (2, 20)


def git_problem(version_text: str | None) -> str | None:
    """What is wrong with the cluster's git for rv (from `git --version`'s line), or None."""
    if not version_text:
        return (
            "git is not installed on the cluster's login node: rv's snapshot store there is a git "
            "repository, and jobs check their files out of it on the compute nodes (ask the admins for "
            "git, or load it in ~/.bashrc with `module load git`)"
        )
    found = re.search(r"(\d+)\.(\d+)", version_text)
    if found and (int(found.group(1)), int(found.group(2))) < MIN_GIT:
        return (
            f"the cluster's {version_text} is too old for rv's snapshot store (it needs git "
            f"{MIN_GIT[0]}.{MIN_GIT[1]} or newer, on the login and compute nodes): load a newer one"
        )
    return None


def usable_lines(
    accounts: tuple[str, ...] | list[str],
    associations: tuple[tuple[str, str, str, tuple[str, ...]], ...],
    partitions: dict[str, Partition],
) -> list[tuple[str, str]]:
    """What the user may ask Slurm for, where Slurm can say (`rv init`, `rv status`): (label, text)
    for accounts, QoS and partitions; nothing that is not known."""
    lines = []
    if accounts:
        lines.append(("accounts", f"{', '.join(accounts)} (rv run --account)"))
    qos = list(dict.fromkeys(q for *_, allowed in associations for q in allowed))
    defaults = list(dict.fromkeys(d for _, _, d, _ in associations if d))
    if qos:
        default = f"; default {', '.join(defaults)}" if defaults else ""
        lines.append(("qos", f"{', '.join(qos)} (rv run --qos{default})"))
    restricted = sorted({p for _, p, _, _ in associations if p})
    if partitions:
        names = [f"{p.name}{' (default)' if p.default else ''}" for p in partitions.values()]
        only = f"; your associations name {', '.join(restricted)}" if restricted else ""
        lines.append(("partitions", f"{', '.join(names)} (rv run --partition{only})"))
    return lines


def parse_associations(text: str) -> tuple[tuple[str, str, str, tuple[str, ...]], ...]:
    """``sacctmgr -nP show assoc user=U format=account,partition,defaultqos,qos`` rows."""
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 4 and fields[0]:
            account, partition, default, qos = fields
            rows.append((account, partition, default, tuple(q for q in qos.split(",") if q)))
    return tuple(rows)


def parse_qos_walls(text: str) -> dict[str, str]:
    """``sacctmgr -nP show qos format=name,maxwall``: QOS -> its MaxWall, for those that have one."""
    walls = {}
    for line in text.splitlines():
        name, _, wall = (f.strip() for f in line.partition("|"))
        try:
            seconds = parse_slurm_time(wall) if name else None
        except ValueError:
            seconds = None
        if seconds is not None:
            walls[name] = format_slurm_time(seconds)
    return walls


def with_qos(
    partitions: dict[str, Partition], facts: ClusterFacts, account: str | None
) -> dict[str, Partition]:
    """Each partition with the QOS a job of ``account`` gets there and its MaxWall, where known.

    Slurm gives a job without --qos its association's default QOS (the association for that
    partition, else the account's own), or the one QOS it may use. Where that is ambiguous, or the QOS
    has no MaxWall, nothing is added: rv refuses only on limits it knows.
    """
    if account is None or not facts.associations:
        return partitions
    out = {}
    for name, part in partitions.items():
        rows = [r for r in facts.associations if r[0] == account and r[1] == name] or [
            r for r in facts.associations if r[0] == account and not r[1]
        ]
        qos = None
        if len(rows) == 1:
            _, _, default, allowed = rows[0]
            qos = default or (allowed[0] if len(allowed) == 1 else None)
        wall = facts.qos_max_wall.get(qos) if qos else None
        out[name] = replace(part, qos=qos, qos_max_time=wall) if wall else part
    return out


def parse_partitions(partition_text: str, node_text: str = "") -> dict[str, Partition]:
    """Partitions and their limits from ``sinfo -h -o SINFO_PARTITION_FORMAT``; the node counts from
    the per-node listing (SINFO_NODE_FORMAT), since sinfo splits a partition's row by node state.

    A limit sinfo prints as ``infinite``/``UNLIMITED`` (or that cannot be read) is no limit: rv then
    refuses nothing on its account.
    """
    found: dict[str, Partition] = {}
    for line in partition_text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[0].strip():
            continue
        raw, time_text, size = (f.strip() for f in fields)
        name = raw.rstrip("*")
        try:
            seconds = parse_slurm_time(time_text)
        except ValueError:
            seconds = None
        most = size.rpartition("-")[2]
        found[name] = Partition(
            name=name,
            max_time=format_slurm_time(seconds) if seconds is not None else None,
            max_nodes=int(most) if most.isdigit() else None,
            default=raw.endswith("*") or (name in found and found[name].default),
        )
    members: dict[str, set[str]] = {}
    for node in parse_sinfo_nodes(node_text):
        members.setdefault(node.partition, set()).add(node.name)
    return {
        name: replace(p, nodes=len(members[name]) if name in members else None)
        for name, p in sorted(found.items())
    }


def probe(transport: Transport) -> ClusterFacts:
    return facts_from_probe(transport.run(PROBE_SCRIPT, timeout=60).out)


def is_rivanna(host: str) -> bool:
    h = host.lower()
    return h.endswith("hpc.virginia.edu") or "rivanna" in h


def check_remote_root(root: str) -> str:
    """Validate a --remote-root before connecting: absolute, or ``~``/``~/...`` (expanded on the cluster).

    Raises UsageError naming the problem; returns the value unchanged.
    """
    if root == "~" or root.startswith("~/"):
        probe = "/home/user" + root[1:]  # the cluster's home is not known yet; check the rest
    elif root.startswith("~"):
        raise UsageError(
            f"remote root {root!r}: only your own home (~ or ~/...) can be written with ~",
            hint="give an absolute path, e.g. /scratch/$USER/rv",
        )
    else:
        probe = root
    problem = remote_root_problem(probe)
    if problem:
        raise UsageError(
            f"remote root {root!r} {problem}",
            hint="give an absolute path without spaces, e.g. /scratch/me/rv or ~/rv",
        )
    return root


def expand_remote_root(root: str, home: str) -> str:
    """``~`` and ``~/...`` with the cluster's own home folder (as the probe reported it)."""
    if root == "~" or root.startswith("~/"):
        if not home.startswith("/"):
            raise RemoteCommandMissing(
                f"cannot expand {root!r}: the cluster did not report an absolute home folder ({home!r})",
                hint="give --remote-root as an absolute path",
            )
        expanded = posixpath.normpath(home + root[1:])
        problem = remote_root_problem(expanded)
        if problem:
            raise UsageError(
                f"remote root {root!r} expands to {expanded!r} on the cluster, which {problem}",
                hint="give an absolute path without spaces, e.g. /scratch/me/rv",
            )
        return expanded
    return root


def build_profile(
    *,
    name: str,
    host: str,
    port: int | None,
    user: str | None,
    identity_file: str | None,
    known_hosts: str | None,
    account: str | None,
    remote_root: str | None,
    setup: tuple[str, ...],
    catalog: str,
    facts: ClusterFacts,
    share_with_group: bool = False,
    system_site_packages: bool = False,
) -> Profile:
    """The profile `rv init` saves: explicit options win, then what the probe found."""
    if catalog == "auto":
        catalog = "rivanna" if is_rivanna(host) else "discovered"
    if catalog == "discovered":
        gpus = facts.catalog
    else:  # the built-in facts, with CPUs and memory per GPU from the nodes where it has none
        gpus = per_gpu_from_nodes(BUILTIN_CATALOGS[catalog], facts.catalog)
    if account and facts.accounts and account not in facts.accounts:
        raise UsageError(
            f"account {account!r} is not one of yours on this cluster; yours: {', '.join(facts.accounts)}"
        )
    return Profile(
        name=name,
        host=host,
        port=port,
        user=user,
        identity_file=identity_file,
        known_hosts=known_hosts,
        account=account or facts.account,
        remote_root=expand_remote_root(remote_root, facts.home) if remote_root else facts.default_remote_root,
        catalog=catalog,
        setup=setup,
        gpus=gpus,
        partitions=with_qos(facts.partitions, facts, account or facts.account),
        share_with_group=share_with_group,
        system_site_packages=system_site_packages,
    )


def per_gpu_from_nodes(builtin: dict[str, GpuType], discovered: dict[str, GpuType]) -> dict[str, GpuType]:
    """Built-in types that lack CPUs and memory per GPU, with what the cluster's nodes have per GPU.

    A built-in catalog knows policy (SU rates, limits) but not how many CPUs and how much memory a
    node shares out per GPU; sinfo does. Matched by partition and gres type. A type with its own fixed
    CPUs (MIG) keeps its own figures.
    """
    found = {(t.partition, t.gres): t for t in discovered.values()}
    out = {}
    for name, t in builtin.items():
        d = found.get((t.partition, t.gres))
        if d is None or t.fixed_cpus is not None:
            continue
        cpus = t.cpus_per_gpu if t.cpus_per_gpu is not None else d.cpus_per_gpu
        mem = t.mem_per_gpu if t.mem_per_gpu is not None else d.mem_per_gpu
        if (cpus, mem) != (t.cpus_per_gpu, t.mem_per_gpu):
            out[name] = replace(t, cpus_per_gpu=cpus, mem_per_gpu=mem)
    return out


def prepare_remote_root(transport: Transport, remote_root: str, share_with_group: bool = False) -> None:
    """Create the remote root, readable by the user only (0700; 0750 when shared with the group).

    An existing root is narrowed to that mode too: it is the one gate in front of snapshots,
    manifests (which hold the repo's diff) and job records. A test write proves it is writable.
    """
    q = shlex.quote(remote_root)
    mode = "750" if share_with_group else "700"
    umask = "027" if share_with_group else "077"
    test = f"{q}/.rv-write-test"
    transport.run(
        f"umask {umask} && mkdir -p {q} && chmod {mode} {q} && touch {test} && rm -f {test}", timeout=60
    ).check(f"creating the remote root {remote_root}")
