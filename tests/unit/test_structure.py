"""The shape of the code: what runs on the cluster stays in rv/agent/, on the oldest python3 a login
node has, and the laptop never loads it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import rv

RV = Path(rv.__file__).resolve().parent
AGENT = RV / "agent"
# The formats both sides share: the only modules of rv/agent/ that laptop code may import.
# rv.agent.container: the runtimes' command lines, which the laptop writes into the script.
SHARED_FORMATS = {
    "rv.agent.manifest", "rv.agent.segment", "rv.agent.layout", "rv.agent.container", "rv.agent.packformat",
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(RV.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (lazy imports inside functions too), absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            # `from rv.agent import store` imports the module rv.agent.store (a name that is a module)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if (RV.parent / (full.replace(".", "/") + ".py")).exists():
                    found.add(full)
    return found


AGENT_FILES = sorted(AGENT.glob("*.py"))


@pytest.mark.parametrize("path", AGENT_FILES, ids=lambda p: p.name)
def test_every_agent_module_parses_as_python_3_6(path):
    # Login nodes may only have RHEL 8's python3.6: no walrus, no positional-only parameters...
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, feature_version=(3, 6))
    assert "from __future__ import annotations" not in source
    new_keywords = {k.arg for k in ast.walk(tree) if isinstance(k, ast.keyword)} & {"capture_output", "text"}
    assert not new_keywords  # subprocess.run(capture_output=, text=) arrived in 3.7
    imports = imported_modules(path)
    assert "dataclasses" not in imports
    # The standard library only (and the agent's own modules).
    third_party = {m for m in imports if m.split(".")[0] not in STDLIB and not m.startswith("rv.agent.")}
    assert not third_party, f"{path.name} imports {sorted(third_party)}"
    assert not {
        m for m in imports if m.startswith("rv.") and not m.startswith("rv.agent.") and m != "rv.agent"
    }


STDLIB = {
    "argparse", "ast", "base64", "contextlib", "errno", "fcntl", "hashlib", "io", "json", "marshal", "os",
    "platform", "pwd", "re", "select", "shutil", "signal", "site", "socket", "stat", "struct", "subprocess",
    "sys", "sysconfig", "tempfile", "time", "types", "zlib", "rv", "functools", "queue", "threading",
    "urllib", "shlex",
}  # fmt: skip


def test_laptop_code_never_imports_the_agent_program():
    offenders = []
    for path in sorted(RV.rglob("*.py")):
        if AGENT in path.parents:
            continue
        for name in imported_modules(path):
            if name.startswith("rv.agent.") and name not in SHARED_FORMATS:
                offenders.append(f"{module_name(path)} imports {name}")
    assert not offenders, offenders


def test_the_shared_formats_import_nothing_of_the_agent():
    for name in SHARED_FORMATS:
        path = RV.parent / (name.replace(".", "/") + ".py")
        if path.exists():
            assert not {m for m in imported_modules(path) if m.startswith("rv.")}, name


def test_the_trainer_takes_from_rv_only_the_contract_which_needs_nothing_else():
    # rv_train runs in the job's environment, where rv's laptop dependencies (click, paramiko) need not
    # be: what it shares with rv is rv.contract, standard library only (as rv_train/__init__ says).
    from_rv = {
        name
        for path in sorted((RV.parent / "rv_train").rglob("*.py"))
        for name in imported_modules(path)
        if name == "rv" or name.startswith("rv.")
    }
    assert from_rv <= {"rv", "rv.contract"}, from_rv
    contract = imported_modules(RV / "contract.py")
    assert {m.split(".")[0] for m in contract} <= STDLIB | {"__future__"}, contract


def test_the_jobs_own_chaining_sbatch_keeps_the_options_of_rv_slurm_commands():
    # job.sh queues a run's next segment itself; the agent's first submission and a sweep's retries
    # use rv.slurm.commands.sbatch. Both must chain alike: one option changed in one place only would
    # make the two kinds of segment behave differently when their dependency cannot be met.
    from rv.slurm import commands

    argv = commands.sbatch("SCRIPT", after="JOB")
    chain = next(line for line in (AGENT / "job.sh").read_text().splitlines() if "exec sbatch" in line)
    words = chain.split("exec ", 1)[1].split()
    assert words[0] == argv[0] == "sbatch"
    for option in argv[1:-1]:  # every option between the program and the script
        as_in_job = option.replace("JOB", '"$3"')
        assert as_in_job in words, (option, chain)


def _private_uses(path: Path) -> set[str]:
    """``module._name`` where ``module`` is another agent module this file imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    agent = {p.stem for p in AGENT_FILES}
    local = {}  # the name a module goes by here -> the agent module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "rv.agent":
            local.update(
                {alias.asname or alias.name: alias.name for alias in node.names if alias.name in agent}
            )
    local = {name: module for name, module in local.items() if module != path.stem}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in local:
            found.add(f"{local[node.value.id]}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rv.agent."):
            module = node.module.rpartition(".")[2]  # from rv.agent.m import _x
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {
        use for use in found if use.split(".")[1].startswith("_") and not use.split(".")[1].startswith("__")
    }


@pytest.mark.parametrize("path", AGENT_FILES, ids=lambda p: p.name)
def test_no_agent_module_uses_another_ones_private_names(path):
    assert not _private_uses(path)


def test_the_private_name_check_sees_a_private_use(tmp_path):
    # The positive case: a module that reaches into another's private function is caught.
    (tmp_path / "up.py").write_text(
        "from rv.agent import runs as r, common\n"
        "from rv.agent.gc import _plan, Freed\n"
        "r._submit({}, None)\ncommon.x\n"
    )
    assert _private_uses(tmp_path / "up.py") == {"runs._submit", "gc._plan"}


def test_the_agent_program_ships_every_agent_module_after_what_it_imports():
    from rv.remote.agent_client import AGENT_MODULES

    # ranklabel, notify and stats (rv's meter) are no modules of the agent program: they are shipped
    # into <root>/runtime/ beside job.sh, for jobs to run.
    program = {p.stem for p in AGENT_FILES} - {"__init__", "ranklabel", "notify", "stats"}
    assert sorted(AGENT_MODULES) == sorted(program)
    for i, module in enumerate(AGENT_MODULES):
        needs = {
            m.rpartition(".")[2]
            for m in imported_modules(AGENT / f"{module}.py")
            if m.startswith("rv.agent.")
        }
        assert needs <= set(AGENT_MODULES[:i]), (module, needs - set(AGENT_MODULES[:i]))


def test_the_laptop_and_the_agent_agree_on_the_oldest_git_the_store_works_with():
    # rv init checks the cluster's git from the laptop (rv.probe), the agent before every upload.
    from rv.agent import store
    from rv.probe import MIN_GIT

    assert store.MIN_GIT == MIN_GIT


# --- the laptop side's shape (issue 34) ---------------------------------------------------------------

CLI = RV / "cli"
MAX_MODULE_LINES = 900
MAX_COMMAND_BODY_LINES = 80
MAX_TOP_LEVEL_MODULES = 25
# Modules over MAX_MODULE_LINES that other branches are splitting now: each entry names the branch
# that owns the split. Delete an entry when its branch lands (a stale entry fails below, so the list
# only ever shrinks); never add one for new code.
OVER_LENGTH_BEING_SPLIT: dict[str, str] = {}


def _is_click_command(node: ast.AST) -> bool:
    """A function decorated as a click command or group: ``@click.command(...)``, ``@group.command``..."""
    if not isinstance(node, ast.FunctionDef):
        return False
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(target, ast.Attribute) and target.attr in ("command", "group"):
            return True
    return False


def _commands(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node for node in ast.walk(tree) if _is_click_command(node)]  # type: ignore[misc]


COMMAND_MODULES = {module_name(p): p for p in sorted(CLI.glob("*.py")) if _commands(p)}


def test_the_command_modules_are_found():
    # The checks below are only as good as this list: the commands rv has are in it.
    assert {"rv.cli.run", "rv.cli.up", "rv.cli.init", "rv.cli.sync", "rv.cli.gc", "rv.cli.ckpt"} <= set(
        COMMAND_MODULES
    )
    assert "rv.cli.common" not in COMMAND_MODULES and "rv.cli.launchview" not in COMMAND_MODULES


def test_no_command_module_imports_another():
    # What two commands share lives in a module of its own (rv.cli.common, layered, launchview, the
    # views) or in the core; one command reaching another goes through rv.commands.load.
    offenders = [
        f"{name} imports {other}"
        for name, path in COMMAND_MODULES.items()
        for other in sorted(imported_modules(path))
        if other in COMMAND_MODULES and other != name
    ]
    assert not offenders, offenders


def test_no_click_command_body_is_over_80_lines():
    # A command is its options, then a plan, then one call into the core, then rendering. The body
    # counts from its first statement after the docstring to its last (options and help are not in it).
    long = []
    for path in COMMAND_MODULES.values():
        for fn in _commands(path):
            body = fn.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            lines = (body[-1].end_lineno or 0) - body[0].lineno + 1 if body else 0
            if lines > MAX_COMMAND_BODY_LINES:
                long.append(f"{path.relative_to(RV.parent)}:{fn.lineno} {fn.name}: {lines} lines")
    assert not long, long


def test_the_core_imports_neither_click_nor_rich():
    # Everything outside rv/cli/ is the core: it reports through callbacks and returns data; how it
    # looks is the CLI's business (lazy imports and TYPE_CHECKING ones count too).
    offenders = [
        f"{module_name(path)} imports {name}"
        for path in sorted(RV.rglob("*.py"))
        if CLI not in path.parents
        for name in sorted(imported_modules(path))
        if name.split(".")[0] in ("click", "rich")
    ]
    assert not offenders, offenders


def test_no_module_is_over_900_lines():
    over = {}
    for path in sorted([*RV.rglob("*.py"), *(RV.parent / "rv_train").rglob("*.py")]):
        count = len(path.read_text(encoding="utf-8").splitlines())
        if count > MAX_MODULE_LINES:
            over[path.relative_to(RV.parent).as_posix()] = count
    unexpected = {p: n for p, n in over.items() if p not in OVER_LENGTH_BEING_SPLIT}
    assert not unexpected, f"over {MAX_MODULE_LINES} lines (split by concern): {unexpected}"
    stale = sorted(set(OVER_LENGTH_BEING_SPLIT) - set(over))
    assert not stale, f"split now: delete these from OVER_LENGTH_BEING_SPLIT: {stale}"


def test_the_top_of_rv_holds_at_most_25_modules():
    # The rest lives in the wings: remote/ (connections), files/ (listing, snapshots, sync), job/,
    # slurm/, pyenv/, agent/, cli/.
    top = sorted(p.name for p in RV.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_the_script_context_is_built_in_one_place():
    # rv.job.launch.Plan.context: every job script's context, dry runs, probes and sweeps included.
    calls = [
        f"{module_name(path)}:{node.lineno}"
        for path in sorted(RV.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "script_context"
    ]
    assert calls == [calls[0]] and calls[0].startswith("rv.job.launch:"), calls


def test_a_plan_is_built_whole_and_never_patched():
    # rv.job.launch.Plan is frozen and validated as a whole: plan_run and plan_up build it once, with
    # every field, never dataclasses.replace(plan, ...) after the checks.
    patched, built = [], []
    for path in sorted(RV.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name == "replace" and node.args and getattr(node.args[0], "id", "").endswith("plan"):
                patched.append(f"{module_name(path)}:{node.lineno}")
            if name == "Plan":
                built.append(module_name(path))
    assert not patched, patched
    assert built == ["rv.job.launch", "rv.job.launch"], built  # plan_run's and plan_up's


# Floors, lowest first: a module imports only modules on its own floor or below (lazy imports and
# TYPE_CHECKING ones too). So a floor can be read, tested and changed knowing nothing above it, and no
# circle spans floors (tests/unit/test_import_cycles.py forbids circles within one). Every module of
# rv/ is on one: a new top module or package fails below until it is placed.
FLOORS: tuple[tuple[str, ...], ...] = (
    # the ground: values, checks and formats every wing shares; the agent (standard library only)
    ("rv", "rv.agent", "rv.contract", "rv.errors", "rv.units", "rv.timespec", "rv.names", "rv.catalog",
     "rv.launcher", "rv.layout", "rv.runtime", "rv.commands", "rv.gpustat", "rv.config", "rv.secrets",
     "rv.notify", "rv.sweep", "rv.request", "rv.misplaced",
     # the one table of Slurm options is data (it imports nothing of rv): config reads its keys
     "rv.slurmoptions"),
    ("rv.remote",),  # how a command reaches the cluster
    ("rv.files", "rv.slurm"),  # what a run sends: its files, Slurm's words
    ("rv.placement", "rv.probe", "rv.pyenv"),  # built on Slurm's words and the connection
    ("rv.job",),  # a run's life
    ("rv.ui",),  # the page
    ("rv.cli",),  # the commands
    ("rv.entry", "rv.forkserver", "rv.__main__"),  # the program
)  # fmt: skip
# Arrows up a floor that a branch is removing now: delete the entry when it lands (a stale one fails).
# Never add one for new code.
FLOOR_EXCEPTIONS: set[tuple[str, str]] = set()


def floor_of(module: str) -> int:
    """The floor of ``module``: that of the longest name in FLOORS it is or is under ("rv" is the
    package's own __init__ only)."""
    found = [
        (len(name), n)
        for n, names in enumerate(FLOORS)
        for name in names
        if module == name or (name != "rv" and module.startswith(name + "."))
    ]
    assert found, f"{module} is on no floor: place it in FLOORS"
    return max(found)[1]


def imports_up_a_floor() -> set[tuple[str, str]]:
    """(module, what it imports on a higher floor), for every module of rv/."""
    up = set()
    for path in sorted(RV.rglob("*.py")):
        me = module_name(path)
        for other in imported_modules(path):
            if (other == "rv" or other.startswith("rv.")) and floor_of(other) > floor_of(me):
                up.add((me, other))
    return up


def test_no_module_imports_one_on_a_higher_floor():
    up = imports_up_a_floor()
    assert not up - FLOOR_EXCEPTIONS, sorted(up - FLOOR_EXCEPTIONS)
    stale = sorted(FLOOR_EXCEPTIONS - up)
    assert not stale, f"gone now: delete these from FLOOR_EXCEPTIONS: {stale}"


def test_the_floor_rule_sees_an_arrow_up():
    assert floor_of("rv.config") == 0 and floor_of("rv.job.workdir") == floor_of("rv.job") > 0
    assert floor_of("rv.slurm.script") < floor_of("rv.placement") < floor_of("rv.job.launch")
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("rv.newthing")


# Each package's docstring is its door: it names every module it holds, one line each, and no module
# that is gone. A module added or removed without its line fails here.
DOORS = ("job", "files", "remote", "slurm", "pyenv", "agent")


@pytest.mark.parametrize("package", DOORS)
def test_each_packages_docstring_names_each_of_its_modules_and_no_other(package):
    folder = RV / package
    tree = ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    # A module's line starts with its file name (ruff's format may move the list's indentation).
    named = {line.split()[0] for line in doc.splitlines() if line.split()}
    named = {name for name in named if name.endswith((".py", ".sh"))}
    files = {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    assert not files - named, f"rv/{package}/__init__.py does not name {sorted(files - named)}"
    assert not named - files, f"rv/{package}/__init__.py names modules that are gone: {sorted(named - files)}"


MAX_FUNCTION_LINES = 120


def test_no_function_is_over_120_lines():
    long = set()
    for path in [*RV.rglob("*.py"), *(RV.parent / "rv_train").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            lines = (node.end_lineno or 0) - node.lineno + 1 if isinstance(node, ast.FunctionDef) else 0
            if lines > MAX_FUNCTION_LINES:
                long.add(f"{path.relative_to(RV.parent)}:{node.name}")
    assert not long, f"over {MAX_FUNCTION_LINES} lines (split by step): {sorted(long)}"


MAX_SHELL_FUNCTION_LINES = 60


_SHELL_FUNCTION = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\(\) \{(.*)")


def shell_functions(text: str) -> dict[str, int]:
    """Each top-level function of a bash file (``name() {``, a comment after it or not, to the ``}``
    that starts a line; ``name() { ...; }`` on one line is one line): its lines."""
    sizes, name, start = {}, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        found = _SHELL_FUNCTION.fullmatch(line)
        if found and found[2].strip() and not found[2].strip().startswith("#"):
            sizes[found[1]] = 1
        elif found:
            name, start = found[1], n
        elif line == "}" and name:
            sizes[name], name = n - start + 1, ""
    return sizes


SHELL_FILES = sorted(AGENT.glob("*.sh"))


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_no_job_runtime_file_is_over_900_lines_nor_a_function_over_60(path):
    # The decisions are functions of their own (rv_end_decide: tested case by case), not shell ladders;
    # a concern of its own is a part of its own (job.sh's header lists them).
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"rv/agent/{path.name}: over {MAX_MODULE_LINES} lines"
    sizes = shell_functions(text)
    assert sizes  # the positive case: it finds them
    long = sorted(name for name, lines in sizes.items() if lines > MAX_SHELL_FUNCTION_LINES)
    assert not long, f"rv/agent/{path.name}: over {MAX_SHELL_FUNCTION_LINES} lines: {long}"


def test_the_shell_rules_see_the_job_runtime_and_a_long_function():
    sizes = shell_functions((AGENT / "job.sh").read_text(encoding="utf-8"))
    assert len(sizes) > 30 and sizes["rv_end_decide"] > 20
    assert shell_functions("f() {  # f ARG\n" + "    :\n" * 70 + "}\ng() { :; }\n") == {"f": 72, "g": 1}


def test_every_part_of_the_job_runtime_is_shipped_in_its_one_file():
    # The parts are joined into one runtime file (rv.slurm.script.job_runtime): a part left out of
    # JOB_RUNTIME_PARTS would be missing on the cluster, and a function defined twice would be
    # silently replaced by the later part's.
    from rv.slurm.script import JOB_RUNTIME_PARTS, runtime_files

    assert sorted(JOB_RUNTIME_PARTS) == SHELL_FILES and JOB_RUNTIME_PARTS[0].name == "job.sh"
    (shipped,) = (text for name, text in runtime_files().items() if name.startswith("job-"))
    names: list[str] = []
    for part in JOB_RUNTIME_PARTS:
        text = part.read_text(encoding="utf-8")
        assert text in shipped, part.name
        names += shell_functions(text)
    assert len(names) == len(set(names)) and set(names) == set(shell_functions(shipped))


# --- one table of Slurm options (issue 42) ------------------------------------------------------------

# A Slurm option rv knows is spelled (a string in the code: its flag, its config key, its #SBATCH word)
# in the table of rv.slurmoptions, and in at most two modules beside it: the flags, the profile's
# keys, the script's lines and the --sbatch guard are made from the table's rows. Docstrings and
# comments may name an option; code that needs one reads it from the table.
SLURM_OPTION_WORDS = ("constraint", "exclude", "nodelist", "reservation")
MAX_MODULES_SPELLING_AN_OPTION = 3
# The same word, no Slurm option's.
NOT_SLURMS = {
    ("rv.pyenv.spec", "constraint"): "pip's -c/--constraint, a requirements file",
    ("rv.files.sync", "exclude"): "git's .git/info/exclude",
}


def spells(path: Path, word: str) -> bool:
    """Whether a string of ``path``'s code (not a docstring) is ``word`` (a config key, a parameter's
    name) or holds ``--word`` (a flag; in an f-string too): ``--cluster-constraint`` is another."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    flag = re.compile(rf"--{word}(?![\w-])")
    return any(
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and (node.value == word or flag.search(node.value))
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("word", SLURM_OPTION_WORDS)
def test_each_slurm_option_is_spelled_in_the_table_and_at_most_two_other_modules(word):
    modules = [
        module_name(path)
        for path in sorted(RV.rglob("*.py"))
        if spells(path, word) and (module_name(path), word) not in NOT_SLURMS
    ]
    assert "rv.slurmoptions" in modules  # the positive case: the table itself is found
    assert len(modules) <= MAX_MODULES_SPELLING_AN_OPTION, (
        f"--{word} is spelled in {modules}: read it from rv.slurmoptions.TABLE"
    )


def test_the_spelling_check_sees_a_flag_a_key_and_an_f_string_but_no_docstring(tmp_path):
    cases = {
        'x = ["--exclude", "gpu-07"]\n': True,
        'x = {"exclude": str}\n': True,
        'x = f"--exclude={node}"\n': True,
        '"""Leave out nodes (--exclude)."""\n# --exclude\nx = "--exclude-newer"\n': False,
    }
    for n, (text, found) in enumerate(cases.items()):
        (tmp_path / f"m{n}.py").write_text(text)
        assert spells(tmp_path / f"m{n}.py", "exclude") is found, text
