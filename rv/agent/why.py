"""rv why's checks on the cluster: would sbatch take the run's own batch script with other options?

``why-probe``: for each suggestion (``{"script": "job.sbatch", "options": ["--time=9:00"]}``),
``sbatch --test-only OPTIONS <run>/<script>``: options on the command line win over the script's
``#SBATCH`` lines, so each probe is the run's own job with one thing changed. Nothing is submitted.
Every probe runs at once (each costs a round trip to slurmctld); the answers come back in order.
"""

import re

from rv.agent import common, layout, rundir, slurmcmd

# The run's batch script, or one of a run over several GPU types (job.<i>.sbatch).
_SCRIPT = re.compile(r"^job(\.\d+)?%s$" % re.escape(layout.SCRIPT_SUFFIX))
# The options a suggestion may change: rv why builds them; anything else is refused.
_OPTION = re.compile(r"^--(time|gres|partition|qos|nodes)=[A-Za-z0-9:._,/=+-]+$")


def mode_why_probe(args):
    root = common.root_path(args["root"])
    rdir = rundir.run_path(root, args["run_id"])
    started = []
    for probe in args.get("probes") or []:
        script = probe.get("script") or ""
        options = list(probe.get("options") or [])
        if not _SCRIPT.match(script) or not all(_OPTION.match(o) for o in options):
            raise common.AgentError("bad probe %r" % (probe,), "usage")
        path = common.under(rdir, script)
        argv = list(args["test_only"]) + options + [path.decode("utf-8", "surrogateescape")]
        started.append(slurmcmd.start(argv))
    out = []
    for proc in started:
        code, text, err = slurmcmd.finish(proc)
        out.append({"code": code, "text": (text + err)[-2000:]})
    return {"probes": out}
