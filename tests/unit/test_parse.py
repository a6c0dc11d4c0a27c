"""Parsers against captured output (tests/captured/README.md says which files are real)."""

from pathlib import Path

import pytest

from rv.catalog import RIVANNA
from rv.slurm.parse import (
    SACCT_FORMAT,
    SINFO_NODE_FORMAT,
    SQUEUE_FORMAT,
    Gres,
    account_from_allocations,
    account_from_sacctmgr,
    availability_by_type,
    discover_catalog,
    expand_hostlist,
    gpu_availability,
    normalise_state,
    parse_allocations,
    parse_gres,
    parse_job_id,
    parse_sacct,
    parse_sacctmgr_accounts,
    parse_sinfo_nodes,
    parse_squeue,
    parse_tres,
)

CAPTURED = Path(__file__).resolve().parent.parent / "captured"


def captured(name: str) -> str:
    return (CAPTURED / name).read_text()


# --- formats --------------------------------------------------------------------------------------


def test_format_strings_are_what_the_remote_side_runs():
    assert SQUEUE_FORMAT == "%i|%T|%r|%M|%l|%D|%N|%b|%P|%S|%V|%j"
    assert SACCT_FORMAT == (
        "JobID,State,ExitCode,Elapsed,Timelimit,Submit,Start,End,NNodes,NodeList,AllocTRES,ReqTRES,"
        "Partition,Reason,JobName"
    )
    assert SINFO_NODE_FORMAT == (
        "NodeList:0|,Partition:0|,StateComplete:0|,Gres:0|,GresUsed:0|,CPUs:0|,Memory:0|,Time:0|,Features:0"
    )


# --- host lists -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu[01-03,07],a100-[1-2]", ["gpu01", "gpu02", "gpu03", "gpu07", "a100-1", "a100-2"]),
        ("node1", ["node1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("udc-an25-[1,3]", ["udc-an25-1", "udc-an25-3"]),
        ("gpu[008-011]", ["gpu008", "gpu009", "gpu010", "gpu011"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("", []),
        ("None assigned", []),
        ("(null)", []),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


# --- gres, TRES, ids, states ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "gres"),
    [
        ("gpu:a6000:8(S:0-47)", (Gres("gpu", "a6000", 8),)),
        ("gpu:a100:8(S:16-31,48-63,80-95,112-127)", (Gres("gpu", "a100", 8),)),
        ("gpu:a6000:1(IDX:0),gpu:v100:0(IDX:N/A)", (Gres("gpu", "a6000", 1), Gres("gpu", "v100", 0))),
        ("gpu:a6000:3(IDX:0-1,5)", (Gres("gpu", "a6000", 3),)),
        ("gpu:1g.10gb:56", (Gres("gpu", "1g.10gb", 56),)),
        ("gpu:4", (Gres("gpu", None, 4),)),
        ("gres:gpu:a6000:2", (Gres("gpu", "a6000", 2),)),
        ("gres/gpu:2", (Gres("gpu", None, 2),)),
        ("gpu:(null):0(IDX:N/A)", (Gres("gpu", None, 0),)),
        ("gpu:a100:4(S:0-1),shard:a100:16", (Gres("gpu", "a100", 4), Gres("shard", "a100", 16))),
        ("(null)", ()),
        ("N/A", ()),
        ("", ()),
    ],
)
def test_parse_gres(text, gres):
    assert parse_gres(text) == gres


def test_parse_tres():
    assert parse_tres("billing=2,cpu=2,gres/gpu:a6000=4,gres/gpu=4,mem=1000M,node=2") == {
        "billing": "2",
        "cpu": "2",
        "gres/gpu:a6000": "4",
        "gres/gpu": "4",
        "mem": "1000M",
        "node": "2",
    }
    assert parse_tres("") == {}


@pytest.mark.parametrize(
    ("text", "base", "task", "het", "step", "job"),
    [
        ("123", "123", None, None, None, "123"),
        ("123_4", "123", "4", None, None, "123_4"),
        ("123_[1-5]", "123", "[1-5]", None, None, "123_[1-5]"),
        ("5_[3-5%2]", "5", "[3-5%2]", None, None, "5_[3-5%2]"),
        ("123.batch", "123", None, None, "batch", "123"),
        ("123_4.0", "123", "4", None, "0", "123_4"),
        ("123+0", "123", None, "0", None, "123+0"),
        ("123.extern", "123", None, None, "extern", "123"),
    ],
)
def test_parse_job_id(text, base, task, het, step, job):
    jid = parse_job_id(text)
    assert (jid.base, jid.array_task, jid.het_offset, jid.step, jid.job) == (base, task, het, step, job)


def test_parse_job_id_garbage():
    with pytest.raises(ValueError):
        parse_job_id("abc")


@pytest.mark.parametrize(
    ("text", "state"),
    [("CANCELLED by 0", "CANCELLED"), ("CANCELLED by 123456", "CANCELLED"), ("CANCELLED+", "CANCELLED"),
     ("running", "RUNNING"), ("", "UNKNOWN")],
)  # fmt: skip
def test_normalise_state(text, state):
    assert normalise_state(text) == state


# --- squeue ---------------------------------------------------------------------------------------


def test_squeue_captured():
    jobs = {j.job_id: j for j in parse_squeue(captured("squeue_mixed.txt"))}
    assert list(jobs) == ["6", "4", "3", "5_[3-5%2]", "5_1", "5_2"]

    held = jobs["4"]
    assert (held.state, held.reason, held.nodes, held.node_list) == ("PENDING", "JobHeldUser", 2, ())
    assert (held.gpus_per_node, held.gpus, held.gpu_type) == (2, 4, "a6000")
    assert held.start is None and held.time_limit_seconds is None  # N/A, UNLIMITED

    running = jobs["3"]
    assert (running.state, running.reason, running.node_list) == ("RUNNING", None, ("node1",))
    assert running.elapsed_seconds == 5
    assert running.time_limit_seconds == 600  # squeue prints "10:00" for ten minutes
    assert running.start == "2026-11-20T22:33:45"

    array = jobs["5_[3-5%2]"]
    assert (array.id.base, array.id.array_task, array.reason) == ("5", "[3-5%2]", "JobArrayTaskLimit")
    assert jobs["5_1"].id.array_task == "1"

    # a '|' in a job name stays in the name (it is the last field)
    assert jobs["6"].name == "pipe|name"
    assert (jobs["6"].reason, jobs["6"].gres_per_node, jobs["6"].gpus) == ("BeginTime", (), 0)


def test_squeue_empty():
    assert parse_squeue(captured("squeue_empty.txt")) == []
    assert parse_squeue("\n") == []


def test_squeue_handwritten_rivanna():
    jobs = {j.job_id: j for j in parse_squeue(captured("squeue_handwritten_rivanna.txt"))}
    big = jobs["61234567"]
    assert big.node_list == ("udc-an25-1", "udc-an25-3")
    assert big.elapsed_seconds == 93784 and big.time_limit_seconds == 259200
    assert (big.gpus, big.gpu_type) == (8, "a6000")  # 4 per node x 2 nodes
    assert jobs["61234570"].name == "big eval run"
    assert jobs["61234570"].start == "2026-01-13T04:00:00"  # expected start of a pending job
    assert jobs["61234571"].reason == "QOSMaxGRESPerUser"
    assert jobs["61234580_[8-15%4]"].gpu_type == "1g.10gb"
    assert jobs["61234580_7"].elapsed_seconds == 754
    assert jobs["61234590"].state == "COMPLETING"


def test_squeue_refuses_a_short_line():
    with pytest.raises(ValueError):
        parse_squeue("123|RUNNING|None\n")


def test_sacct_captured_skips_steps_and_keeps_job_exit_codes():
    jobs = {j.job_id: j for j in parse_sacct(captured("sacct_mixed.txt"))}
    assert "3.batch" not in jobs and "12.0" not in jobs
    assert set(jobs) == {"3", "4", "6", "7", "5_1", "5_2", "5_3", "5_4", "5_5", "10", "11", "12"}

    failed = jobs["7"]
    assert (failed.state, failed.exit_code, failed.exit_signal, failed.terminal) == ("FAILED", 3, 0, True)
    assert jobs["12"].exit_code == 2 and jobs["12"].node_list == ("node1", "node2")
    assert jobs["12"].gpus == 2 and jobs["12"].gpu_type == "a6000"

    cancelled = jobs["11"]
    assert cancelled.state == "CANCELLED"  # "CANCELLED by 0"

    timeout = jobs["10"]
    assert (timeout.state, timeout.elapsed_seconds, timeout.time_limit_seconds) == ("TIMEOUT", 79, 60)

    held = jobs["4"]
    assert (held.state, held.start, held.end, held.node_list) == ("PENDING", None, None, ())
    assert held.time_limit_seconds is None  # Partition_Limit
    assert (held.gpus, held.gpu_type, held.reason) == (4, "a6000", "JobHeldUser")  # from ReqTRES
    assert not held.terminal

    running = jobs["3"]
    assert (running.state, running.end, running.start) == ("RUNNING", None, "2026-11-20T22:33:45")
    assert jobs["6"].name == "pipe|name"


def test_sacct_empty():
    assert parse_sacct(captured("sacct_empty.txt")) == []


def test_sacct_handwritten():
    jobs = {j.job_id: j for j in parse_sacct(captured("sacct_handwritten.txt"))}
    assert jobs["61234500"].state == "CANCELLED"
    assert (jobs["61234500"].exit_code, jobs["61234500"].exit_signal) == (0, 15)
    assert jobs["61234501"].state == "OUT_OF_MEMORY" and jobs["61234501"].gpu_type == "1g.10gb"
    assert jobs["61234502"].name == "a|b" and jobs["61234502"].gpus == 16
    assert jobs["61234503"].state == "RUNNING"  # the requeued job's latest row wins
    assert jobs["61234504+0"].id.het_offset == "0" and jobs["61234504+0"].exit_code == 1
    assert jobs["61234580_[8-15%4]"].reason == "JobArrayTaskLimit"
    assert jobs["61234567"].elapsed_seconds == 93784


# --- sinfo ----------------------------------------------------------------------------------------


def test_sinfo_captured():
    nodes = parse_sinfo_nodes(captured("sinfo_nodes_busy.txt"))
    assert len(nodes) == 4  # two nodes, each in two partitions
    node1 = next(n for n in nodes if n.name == "node1" and n.partition == "gpu-a6000")
    assert node1.default_partition and node1.state == "mixed" and node1.usable
    assert (node1.gpus("a6000"), node1.gpus_used("a6000"), node1.gpus_idle("a6000")) == (2, 1, 1)
    assert (node1.gpus("v100"), node1.gpus_idle("v100")) == (2, 0)
    assert (node1.cpus, node1.memory_mb, node1.partition_max_time, node1.features) == (8, 8000, None, ())
    # each node counted once although sinfo lists it per partition
    assert gpu_availability(nodes) == {"a6000": (3, 4), "v100": (2, 4)}


def test_sinfo_rivanna_availability_reads_gres_used_and_skips_unusable_nodes():
    nodes = parse_sinfo_nodes(captured("sinfo_nodes_handwritten_rivanna.txt"))
    avail = gpu_availability(nodes)
    # a6000: 5 free on an25-1, 8 on an25-2, none on the drained an25-3 or the allocated an25-4
    assert avail["a6000"] == (13, 32)
    # a100: 2 on an26-1, none on the down an26-2, 1 on an28-1, 8 on an28-2
    assert avail["a100"] == (11, 32)
    assert avail["1g.10gb"] == (36, 56)
    assert avail["rtx3090"] == (4, 4)  # one node in two partitions counts once
    assert "gpu" not in avail  # CPU nodes have no gres


def test_availability_by_catalog_type_splits_a100_by_partition():
    nodes = parse_sinfo_nodes(captured("sinfo_nodes_handwritten_rivanna.txt"))
    avail = availability_by_type(nodes, RIVANNA)
    assert avail["a100-40"] == (2, 16)
    assert avail["a100"] == (9, 16)
    assert avail["a6000"] == (13, 32)
    assert avail["mig"] == (36, 56)
    assert avail["h200"] == (0, 0)


@pytest.mark.parametrize(
    ("state", "usable"),
    [
        ("idle", True),
        ("mixed", True),
        ("idle~", True),  # powered down, resumes on demand
        ("allocated", False),
        ("mixed+drain", False),
        ("idle+drain", False),
        ("down+not_responding", False),
        ("idle+reserved", False),
        ("mixed+planned", False),
        ("drained", False),
        ("draining", False),
        ("mixed-", False),  # StateLong: planned
        ("idle*", False),  # StateLong: not responding
    ],
)
def test_node_usable(state, usable):
    line = f"n1|p|{state}|gpu:a6000:2|gpu:a6000:0(IDX:N/A)|8|8000|infinite|(null)"
    (node,) = parse_sinfo_nodes(line)
    assert node.usable is usable
    assert node.gpus_idle() == (2 if usable else 0)


def test_sinfo_empty():
    assert parse_sinfo_nodes("") == []
    assert gpu_availability([]) == {}
    assert discover_catalog("") == {}


# --- catalog discovery ----------------------------------------------------------------------------


def test_discover_catalog_from_the_test_cluster():
    # Both partitions hold both types; the partition named after a type wins.
    catalog = discover_catalog(captured("sinfo_nodes_busy.txt"))
    assert sorted(catalog) == ["a6000", "v100"]
    a6000, v100 = catalog["a6000"], catalog["v100"]
    assert (a6000.partition, a6000.gres, a6000.gpus_per_node, a6000.nodes) == ("gpu-a6000", "a6000", 2, 2)
    assert (v100.partition, v100.gres, v100.gpus_per_node) == ("gpu-v100", "v100", 2)
    assert (a6000.compute_capability, v100.compute_capability) == (8.6, 7.0)
    assert a6000.su_per_gpu_hour is None and a6000.max_time is None
    # 8 CPUs and 8000 MB shared out over the node's 4 GPUs (2 a6000 + 2 v100)
    assert (a6000.cpus_per_gpu, a6000.mem_per_gpu) == (2, "2000M")
    assert (v100.cpus_per_gpu, v100.mem_per_gpu) == (2, "2000M")


def test_discover_catalog_rivanna_layout():
    catalog = discover_catalog(captured("sinfo_nodes_handwritten_rivanna.txt"))
    assert sorted(catalog) == ["a100-40", "a100-80", "a6000", "interactive-rtx3090", "mig", "rtx3090"]
    assert catalog["a100-80"].partition == "gpu-a100-80" and catalog["a100-80"].gres == "a100"
    assert catalog["a100-40"].partition == "gpu-a100-40"
    assert catalog["a6000"].gpus_per_node == 8 and catalog["a6000"].nodes == 4
    assert (catalog["a6000"].cpus_per_gpu, catalog["a6000"].mem_per_gpu) == (6, "32125M")
    assert (catalog["a100-80"].cpus_per_gpu, catalog["a100-80"].mem_per_gpu) == (16, "250000M")
    assert catalog["a6000"].max_time == "3-00:00:00"
    mig = catalog["mig"]
    assert (mig.partition, mig.gres, mig.gpus_per_node, mig.compute_capability) == (
        "gpu-mig",
        "1g.10gb",
        56,
        8.0,
    )
    # rtx3090 is in two partitions whose names both contain it: one type per partition
    assert catalog["rtx3090"].partition == "gpu-rtx3090"
    assert catalog["interactive-rtx3090"].partition == "interactive-rtx3090"
    assert catalog["interactive-rtx3090"].max_time == "12:00:00"


def test_discover_catalog_mixed_partition():
    catalog = discover_catalog(captured("sinfo_nodes_handwritten_mixed.txt"))
    # One "gpu" partition (the default) holds a6000, v100 and t4 nodes: each type by its gres.
    assert {n: (t.partition, t.gres, t.gpus_per_node, t.nodes) for n, t in catalog.items()} == {
        "a6000": ("gpu", "a6000", 4, 2),
        "t4": ("gpu", "t4", 1, 1),
        "v100": ("gpu", "v100", 2, 1),
        "legacy": ("legacy", "", 2, 2),  # untyped gres: named after its partition
    }
    assert catalog["t4"].compute_capability == 7.5
    assert catalog["a6000"].max_time == "2-00:00:00"


# --- accounts -------------------------------------------------------------------------------------


def test_sacctmgr_accounts():
    assert parse_sacctmgr_accounts(captured("sacctmgr_assoc.txt")) == ["rv", "root"]
    assert account_from_sacctmgr(captured("sacctmgr_assoc.txt")) is None  # two: ask the user
    assert account_from_sacctmgr("mylab\nmylab\n") == "mylab"
    assert account_from_sacctmgr("") is None


def test_allocations():
    rows = parse_allocations(captured("allocations_handwritten.txt"))
    assert [(a.account, a.balance, a.reserved, a.available) for a in rows] == [
        ("meng_lab_paid", 10000000, 0, 8742210),
        ("meng_lab", 100000, 2500, 12034),
        ("student_course", 5000, 0, 0),
    ]
    assert account_from_allocations(captured("allocations_handwritten.txt")) == "meng_lab_paid"
    assert account_from_allocations("") is None
    assert account_from_allocations("Account Balance Reserved Available\nx 10 0 0\n") is None


# --- multi-cluster sites and columns we did not ask for --------------------------------------------


def test_squeue_and_sinfo_skip_cluster_header_lines():
    # `squeue -M all` / `sinfo -M all` (or a site's default cluster list) print "CLUSTER: name" before
    # each cluster's rows; rv used to abort on the first one ("expected 12 fields").
    squeue = (
        "CLUSTER: alpha\n" + captured("squeue_mixed.txt") + "CLUSTER: beta\n" + captured("squeue_later.txt")
    )
    jobs = parse_squeue(squeue)
    assert len(jobs) == len(parse_squeue(captured("squeue_mixed.txt"))) + len(
        parse_squeue(captured("squeue_later.txt"))
    )
    assert all(not j.job_id.startswith("CLUSTER") for j in jobs)
    sinfo = "CLUSTER: alpha\n" + captured("sinfo_nodes_busy.txt")
    assert parse_sinfo_nodes(sinfo) == parse_sinfo_nodes(captured("sinfo_nodes_busy.txt"))
    sacct = "CLUSTER: alpha\n" + captured("sacct_mixed.txt")
    assert parse_sacct(sacct) == parse_sacct(captured("sacct_mixed.txt"))


def test_sinfo_ignores_columns_it_did_not_ask_for():
    plain = captured("sinfo_nodes_busy.txt")
    extra = "\n".join(line + "|reason=none|weight=1" for line in plain.splitlines() if line.strip())
    assert parse_sinfo_nodes(extra) == parse_sinfo_nodes(plain)
    assert parse_sinfo_nodes(extra)[0].features == ()
