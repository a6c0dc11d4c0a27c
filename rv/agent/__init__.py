"""Everything rv runs on the cluster, and nothing else: one stdlib-only program, the agent.

rv installs nothing on the cluster. Each cluster-side step runs these modules as one
``python3 -I -S -c`` program over the SSH connection (see :mod:`rv.remote.agent_client`); bulk data travels
on the same command's stdin or stdout, so a step is one round trip however much it moves. The mode
table is in :mod:`rv.agent.__main__`; the job's shell runtime (``job.sh``), the rank labeller
(``ranklabel.py``), the webhook poster (``notify.py``), the store's repairs (``storecheck.py``,
also a module of the agent) and the meter (``stats.py``: what the program used, on each node) are
shipped beside it into the remote root, once per content.

Laptop code imports four modules of this package, the formats both sides share:
:mod:`rv.agent.manifest` (a snapshot's file list), :mod:`rv.agent.segment` (what a job records
about a segment), :mod:`rv.agent.layout` (where things are under the remote root, and in a
checkpoint folder) and :mod:`rv.agent.container` (each container runtime's command line, which the
laptop writes into the job's script and the agent uses to build environments). Nothing else here
is imported on the laptop (``tests/unit/test_structure.py``), and no module here uses another's
private (``_``) names.

Every module must run on the oldest ``python3`` a login node has (RHEL 8: 3.6): no dataclasses, no
walrus, no ``capture_output``, no postponed annotations; a test parses each file as 3.6.
"""
