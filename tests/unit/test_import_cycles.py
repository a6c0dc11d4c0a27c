"""No module of `rv/` takes part in an import cycle.

A cycle makes what a module sees at import time depend on which module of the cycle was imported
first (a name missing half-way through), and it means two modules cannot be read, tested or
replaced one without the other. Every import counts wherever it is written: at the top, or lazily
inside a function (lazy imports keep `rv --help` quick, but the dependency is as real). Importing
``a.b.c`` counts as importing ``a.b`` and ``a`` as well (Python runs their ``__init__`` first).

Imports under ``if TYPE_CHECKING:`` do not count: they never run, so they cannot see a module
half-imported; they exist for annotations only (``from __future__ import annotations`` keeps those
strings). Imports by computed name (``importlib.import_module(name)``, the CLI's command table and
the command server's preload) are not seen here: the modules they load are the CLI's commands,
which are leaves that nothing imports back.
"""

from __future__ import annotations

import ast
from pathlib import Path

RV = Path(__file__).resolve().parents[2] / "rv"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in RV.rglob("*.py"):
        parts = list(path.relative_to(RV.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of rv it imports (and their packages), by name."""
    modules = _module_names()

    def with_packages(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    deps |= with_packages(alias.name)
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            deps |= with_packages(source)
            for alias in node.names:  # `from rv import warm` imports the module rv.remote.warm
                deps |= {f"{source}.{alias.name}"} & modules.keys()
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_rv_takes_part_in_an_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (break each by moving what both need below both):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_check_sees_lazy_imports_and_skips_type_checking_ones() -> None:
    # The check itself: a lazy import inside a function closes a cycle; a TYPE_CHECKING one does not.
    lazy = ast.parse("def f():\n    from rv import warm\n")
    assert [type(n).__name__ for n in _imports(lazy)] == ["ImportFrom"]
    typing_only = ast.parse("if TYPE_CHECKING:\n    from rv import warm\nelse:\n    import rv.remote.ssh\n")
    assert [ast.unparse(n) for n in _imports(typing_only)] == ["import rv.remote.ssh"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert (
        "rv.remote.ssh" in graph["rv.remote.connect"] and "rv.remote.warm" in graph["rv.remote.connect"]
    )  # lazy, in functions
    assert "rv.remote.sshconfig" in graph["rv.remote.ssh"]


def test_the_transport_api_imports_neither_of_the_modules_built_on_it() -> None:
    # rv.remote.connect chooses a route; rv.remote.transport is the API every route speaks, below all of them.
    graph = import_graph()
    warm = {"rv.remote.warm", "rv.remote.warmd", "rv.remote.warmwire"}
    assert not {"rv.remote.ssh", "rv.remote.connect", *warm} & graph["rv.remote.transport"]
    assert "rv.remote.connect" not in set().union(*(graph[m] for m in {"rv.remote.ssh", *warm}))


def test_the_warm_client_is_one_route_and_the_wire_sits_below_both_ends() -> None:
    # The client never connects directly (rv.remote.connect alone turns a command direct); the
    # process never imports the client; the frames and errors import neither end.
    graph = import_graph()
    assert "rv.remote.ssh" not in graph["rv.remote.warm"]
    assert "rv.remote.warm" not in graph["rv.remote.warmd"]
    assert not {"rv.remote.warm", "rv.remote.warmd", "rv.remote.ssh"} & graph["rv.remote.warmwire"]
    assert "rv.remote.warmwire" in graph["rv.remote.warm"] & graph["rv.remote.warmd"]
