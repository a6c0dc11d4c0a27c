"""The program's line in the job: the user's command, with the flags a launcher needs to span the
allocation, and rv's rank labeller where ranks' lines would otherwise mix.

Pure: a validated :class:`~rv.request.JobRequest` in, one shell line out. Words such as
``$SLURM_NODEID`` are left for each ``srun`` task's own shell to expand.
"""

from __future__ import annotations

import shlex

from rv.launcher import ACCELERATE_MODES, LaunchArgs, TorchrunArgs, launch_ranks
from rv.request import JobRequest

# rv's rank labeller, shipped beside the job's runtime; the job exports its path as RV_RANK_LABEL.
RANK_LABEL = '"$RV_RANK_LABEL"'

# Where `accelerate launch` looks for its default config without --config_file (accelerate's
# commands/config/config_args.py), as a word for the task's shell. The job points HF_HOME under the
# remote root, so this is a file of rv's cache unless the setup lines say otherwise.
ACCELERATE_DEFAULT_CONFIG = (
    '"${HF_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/huggingface}/accelerate/default_config.yaml"'
)
# A config file that names its precision: a top-level YAML key or a JSON key. `fp16` is the old
# spelling, which accelerate still reads when `mixed_precision` is absent.
_SETS_PRECISION = shlex.quote('(^|")(mixed_precision|fp16)"?[[:space:]]*:')


def accelerate_precision_word(la: LaunchArgs) -> str | None:
    """``--mixed_precision`` from the GPU the job was given (``$RV_PRECISION``), as a word for the task's
    shell, or None when the user chose it.

    Without the flag `accelerate launch` exports ``ACCELERATE_MIXED_PRECISION=no`` to its workers over
    the job's own value, and every run is fp32. The user's ``--mixed_precision`` wins, and so does a
    config file that sets it (``--config_file``, or accelerate's default file, which ``--cpu`` skips):
    the flag would override the file. Whether the file sets it is known only on the node, so the
    task's shell looks (the file may be in the snapshot or anywhere on the cluster) and the word is
    empty when it does.
    """
    if la.has("mixed_precision"):
        return None
    flag = '--mixed_precision="$RV_PRECISION"'
    config = la.value("config_file")
    if config is None and la.has("cpu"):
        return flag
    where = shlex.quote(config) if config is not None else ACCELERATE_DEFAULT_CONFIG
    return f"$(grep -qsE {_SETS_PRECISION} {where} || printf %s {flag})"


def accelerate_injected_flags(req: JobRequest, la: LaunchArgs) -> list[str]:
    """The flags rv adds after ``accelerate launch``, as shell words for the task's shell.

    Only flags the user did not give: the processes of all nodes together, the machines, this node's
    rank and the first node as the main process (``$SLURM_NODEID`` and friends expand in each task),
    the port from the job id (also on one node: two jobs sharing a node must not both take 29500).
    ``--multi_gpu`` for two or more processes when nothing else says how to start them: without it
    accelerate counts CUDA devices on the node to decide, and starts a single process where it finds
    one (or none). DeepSpeed on several nodes is started the "standard" way, by every node's task,
    not over pdsh. ``--mixed_precision`` from the allocated GPU (:func:`accelerate_precision_word`).
    """
    total = launch_ranks(la, nodes=req.nodes, gpus_per_node=req.gpus_per_node) or req.nodes
    flags = []
    if not la.has("num_processes"):
        flags.append(f"--num_processes={total}")
    if not la.has("num_machines"):
        flags.append(f"--num_machines={req.nodes}")
    if req.nodes > 1:
        if not la.has("machine_rank"):
            flags.append('--machine_rank="$SLURM_NODEID"')
        if not la.has("main_process_ip"):
            flags.append('--main_process_ip="$RV_HEAD_ADDR"')
    if not la.has("main_process_port"):
        flags.append('--main_process_port="$MASTER_PORT"')
    if total > 1 and not any(la.has(mode) for mode in ACCELERATE_MODES):
        flags.append("--multi_gpu")
    if req.nodes > 1 and la.has("use_deepspeed") and not la.has("deepspeed_multinode_launcher"):
        flags.append("--deepspeed_multinode_launcher=standard")
    precision = accelerate_precision_word(la)
    if precision is not None:
        flags.append(precision)
    return flags


def torchrun_injected_flags(req: JobRequest, tr: TorchrunArgs) -> list[str]:
    """The flags rv adds after the torchrun launcher, as shell words for the task's shell.

    Only flags the user did not give, and none that torchrun warns about. The rendezvous is torchrun's
    static one: each node's rank from Slurm, the first node's agent holding the store at the port
    from the job id. Not c10d: its agents close the rendezvous one by one after the run, and an
    agent that does so after the first node's has exited (the store with it) warns that it "has
    failed to shutdown the rendezvous" (seen in about one two-node job in four); and with c10d a
    --node-rank draws "node_rank is only used for static rdzv_backend" on every node but the first.
    A user's own ``--rdzv-backend=c10d`` gets its endpoint and id instead. ``$SLURM_NODEID`` and
    friends are left for the task's own shell to expand. On one node, a user's own rendezvous
    (``--standalone``, ``--master-port``, ...) is respected; on several, ``build_request`` already
    refused one. No ``--signals-to-handle``: the stop signal goes to the workers directly, never to
    the agent. Spelled with underscores: torch before 2.0 (Debian 12's 1.13, images') knows only
    those; newer torch takes both spellings.
    """
    own_rendezvous = req.nodes == 1 and any(
        tr.has(n) for n in ("standalone", "rdzv-endpoint", "rdzv-backend", "master-addr", "master-port")
    )
    c10d = tr.value("rdzv-backend") == "c10d"
    flags = []
    if not tr.has("nnodes"):
        flags.append(f"--nnodes={req.nodes}")
    if not own_rendezvous and not c10d and not tr.has("node-rank"):
        flags.append('--node_rank="$SLURM_NODEID"')
    if req.gpus_per_node > 0 and not tr.has("nproc-per-node"):
        flags.append(f"--nproc_per_node={req.gpus_per_node}")
    if own_rendezvous:
        return flags
    if c10d:
        if not tr.has("rdzv-endpoint"):
            flags.append('--rdzv_endpoint="$RV_HEAD_ADDR:$MASTER_PORT"')
        if not tr.has("rdzv-id"):
            flags.append('--rdzv_id="$SLURM_JOB_ID"')
        return flags
    flags += ['--master_addr="$RV_HEAD_ADDR"', '--master_port="$MASTER_PORT"']
    return flags


def program_line(req: JobRequest) -> str:
    """The user's command as one shell line: a launcher's flags injected after it, and rv's rank
    labeller in front of what runs without Python (``--each-node``, ``--no-python``)."""
    la = req.launch
    if la is None:
        if req.each_node and req.labeled:
            return f'{RANK_LABEL} --exec --label "$SLURM_NODEID" {shlex.join(req.command)}'
        return shlex.join(req.command)
    flags = torchrun_injected_flags(req, la) if la.kind == "torchrun" else accelerate_injected_flags(req, la)
    words = [shlex.join(la.launcher), *flags]
    if la.options:
        words.append(shlex.join(la.options))
    if la.program:
        if req.labeled and la.has("no-python" if la.kind == "torchrun" else "no_python"):
            words += [RANK_LABEL, "--exec"]
        words.append(shlex.join(la.program))
    return " ".join(words)
