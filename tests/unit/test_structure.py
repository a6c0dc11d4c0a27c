"""The shape of the code: what runs on the cluster stays in rv/agent/, on the oldest python3 a login
node has, and the laptop never loads it."""

from __future__ import annotations

import ast
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


def shell_functions(text: str) -> dict[str, int]:
    """Each top-level function of a bash file (``name() {`` to the ``}`` that starts a line): its lines."""
    sizes, name, start = {}, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.endswith("() {") and not line.startswith((" ", "#")):
            name, start = line.split("(")[0], n
        elif line == "}" and name:
            sizes[name], name = n - start + 1, ""
    return sizes


def test_no_job_runtime_function_is_over_60_lines():
    # The decisions are functions of their own (rv_end_decide: tested case by case), not shell ladders.
    sizes = shell_functions((AGENT / "job.sh").read_text(encoding="utf-8"))
    assert len(sizes) > 40 and sizes["rv_end_decide"] > 20  # the positive case: it finds them
    long = sorted(name for name, lines in sizes.items() if lines > MAX_SHELL_FUNCTION_LINES)
    assert not long, f"rv/agent/job.sh: over {MAX_SHELL_FUNCTION_LINES} lines: {long}"
