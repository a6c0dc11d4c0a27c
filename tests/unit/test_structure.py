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
SHARED_FORMATS = {"rv.agent.manifest", "rv.agent.segment"}


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
    "urllib",
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


def test_the_laptop_and_the_agent_agree_on_the_oldest_git_the_store_works_with():
    # rv init checks the cluster's git from the laptop (rv.probe), the agent before every upload.
    from rv.agent import store
    from rv.probe import MIN_GIT

    assert store.MIN_GIT == MIN_GIT
