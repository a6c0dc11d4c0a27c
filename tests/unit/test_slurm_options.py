"""The one table of Slurm options (rv.slurmoptions.TABLE): each product is made from its rows, so a
row added is a flag of rv run (and of rv up, rv code and rv jupyter when the row says so), a profile
key, an #SBATCH line and an entry of the --sbatch guard, with nothing else written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rv.cli.layered import UP_DEFAULTS
from rv.cli.run import run
from rv.cli.up import up
from rv.config import parse_config
from rv.errors import ConfigError
from rv.placement import check_sbatch_option
from rv.slurmoptions import TABLE, flag_rows, profile_keys, refused, typed_names

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the table is given two rows before anything of rv reads it, as if they
# had been written into rv/slurmoptions.py. --licenses is a row rv up takes too, --wckey one it does
# not. What each product then holds comes back as JSON.
ADD_ROWS = r"""
import json, sys
from pathlib import Path

import rv.slurmoptions as o

o.TABLE = (
    *o.TABLE[:6],
    o.SlurmOption("licenses", help="Licenses the job needs, e.g. matlab:1.", metavar="LIST"),
    o.SlurmOption("wckey", help="A workload key to charge.", up=False),
    *o.TABLE[6:],
)

import click

from rv.catalog import RIVANNA
from rv.cli.defaults import Layer, apply_layers
from rv.cli.layered import UP_DEFAULTS, placement_of
from rv.cli.run import run
from rv.cli.up import up
from rv.commands import load
from rv.config import parse_config
from rv.errors import RvError
from rv.placement import build_placement, check_sbatch_option
from rv.request import build_request
from rv.slurm.script import ScriptContext, render_script


def error(call):
    try:
        call()
    except RvError as exc:
        return [exc.message, exc.hint]
    return None


out = {}
out["run"] = [p.name for p in run.params]
out["up"] = [p.name for p in up.params]
out["code"] = [p.name for p in load("code").params]
out["jupyter"] = [p.name for p in load("jupyter").params]
out["up_defaults"] = list(UP_DEFAULTS)
out["help"] = {p.name: [p.opts, p.help, p.metavar] for p in run.params if p.name in ("licenses", "wckey")}
typed = ["--licenses", "matlab:1", "--wckey", "lab", "--sbatch=--begin=now", "--", "true"]
ctx = run.make_context("run", typed)
options = placement_of(ctx.params)
out["typed"] = [list(pair) for pair in options.values]
config = 'default = "a"\n[profiles.a]\nhost = "h"\nlicenses = "matlab:2"\n'
out["profile"] = parse_config(config, Path("/c.toml")).profile().placement
out["profile_error"] = error(lambda: parse_config(config.replace('"matlab:2"', "2"), Path("/c.toml")))


@click.command()
@click.pass_context
def tiny(ctx, **_):
    out["project"] = error(lambda: apply_layers(ctx, [Layer("project", {"licenses": 3})]))


for param in run.params:
    if param.name in ("licenses", "sbatch_options"):
        tiny.params.append(param)
tiny.main([], standalone_mode=False)
req = build_request(RIVANNA, command=["python", "t.py"], gpu_type="a100", time="2h")
place = build_placement(options)
ctx = ScriptContext(remote_root="/r", snapshot_id="s1", project="p", run_id="r1", placement=place)
out["lines"] = [line for line in render_script(req, ctx).splitlines() if line.startswith("#SBATCH")]
out["unsafe"] = error(lambda: build_placement(licenses="a b"))
texts = ("--licenses=x", "-L x", "--lic=x", "--wckey=y")
out["guard"] = [error(lambda t=t: check_sbatch_option(t)) for t in texts]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def added() -> dict:
    done = subprocess.run(
        [sys.executable, "-c", ADD_ROWS], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_row_added_is_a_flag_of_rv_run_and_of_rv_up_and_its_sessions_when_it_says_so(added):
    run_names = [p.name for p in run.params]
    assert "licenses" not in run_names and "wckey" not in run_names  # the positive case: added by the row
    # In the table's place: after --reservation, before --account (rv run --help lists them so).
    at = added["run"].index("reservation")
    assert added["run"][at : at + 4] == ["reservation", "licenses", "wckey", "account"]
    assert added["help"]["licenses"] == [["--licenses"], "Licenses the job needs, e.g. matlab:1.", "LIST"]
    for command in ("up", "code", "jupyter"):
        assert "licenses" in added[command] and "wckey" not in added[command], command
    assert "licenses" in added["up_defaults"] and "wckey" not in added["up_defaults"]
    assert added["typed"] == [["licenses", "matlab:1"], ["wckey", "lab"]]


def test_a_row_added_is_a_profile_key_and_a_project_key_of_its_type(added):
    assert added["profile"] == {"licenses": "matlab:2"}
    assert added["profile_error"] == ["/c.toml: profile 'a': licenses must be a string, not 2", None]
    assert added["project"][0] == "project: licenses = 3 (an integer): licenses must be a string"
    with pytest.raises(ConfigError, match="unknown key 'licenses'"):  # without the row: no such key
        parse_config('default = "a"\n[profiles.a]\nhost = "h"\nlicenses = "x"\n', Path("/c.toml"))


def test_a_row_added_is_an_sbatch_line_in_the_table_s_order_and_checked_as_the_others(added):
    lines = added["lines"]
    at = lines.index("#SBATCH --licenses=matlab:1")
    assert lines[at + 1] == "#SBATCH --wckey=lab" and lines[at + 2].startswith("#SBATCH --nodes=")
    assert lines[-1] == "#SBATCH --begin=now"  # the user's own options still last
    assert added["unsafe"][0] == "--licenses 'a b' cannot go into an #SBATCH line"


def test_a_row_added_is_refused_in_sbatch_in_every_spelling_naming_its_flag(added):
    assert added["guard"][:3] == [
        ["--sbatch '--licenses=x': rv sets --licenses itself", "use rv run --licenses"],
        [
            "--sbatch '-L x': rv sets --licenses itself (sbatch reads -L as --licenses)",
            "use rv run --licenses",
        ],
        [
            "--sbatch '--lic=x': rv sets --licenses itself (sbatch reads --lic as --licenses)",
            "use rv run --licenses",
        ],
    ]
    assert added["guard"][3][0] == "--sbatch '--wckey=y': rv sets --wckey itself"
    assert check_sbatch_option("--licenses=x") == "--licenses=x"  # without the row it passes through


def test_the_table_s_products_as_rv_has_them():
    assert typed_names() == (
        "partition",
        "qos",
        "constraint",
        "exclude",
        "nodelist",
        "reservation",
        "account",
    )
    assert profile_keys() == ("partition", "qos", "constraint", "exclude", "nodelist", "reservation")
    assert [row.param_name for row in flag_rows(up=True)] == [*typed_names(), "sbatch_options"]
    assert set(UP_DEFAULTS) >= {row.param_name for row in flag_rows(up=True)}
    assert {p.name for p in up.params} >= set(UP_DEFAULTS)
    guard = refused()
    assert guard["nodefile"] == guard["nodelist"] == "rv run --nodelist"
    assert guard["tres-bind"] == "rv run -g/-t" and "sbatch" not in guard and "begin" not in guard
    # Every name a row spells is sbatch's own (or a later Slurm's): a typo would be a flag sbatch refuses.
    from rv.slurmoptions import LATER_OPTIONS, LONG_OPTIONS

    names = {name for row in TABLE if row.name != "sbatch" for name in (row.name, *row.same)}
    assert names <= {*LONG_OPTIONS, *LATER_OPTIONS}, names - {*LONG_OPTIONS, *LATER_OPTIONS}
