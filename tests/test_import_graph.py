"""The module-level import structure of metaseq_ds: no circles between its subpackages, and the
model code never reaches the parallelism code (tensor parallelism is applied from outside).

The graph is read from the sources with `ast` (nothing is imported): an edge A -> B means a
module of A imports a module of B at module level (imports inside functions are deliberate
lazy loads and do not count). Nodes are metaseq_ds's subpackages and top-level modules.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "metaseq_ds"


def _unit(module: str) -> str:
    """`metaseq_ds.models.base` -> `models`; `metaseq_ds` itself -> `metaseq_ds`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_level_imports(tree: ast.Module) -> List[str]:
    found = []
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, `try: import x`: still module level
            statements += node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name == "metaseq_ds" or name.startswith("metaseq_ds.")]


def import_graph() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        source = _unit(module)
        for target in _module_level_imports(ast.parse(path.read_text())):
            if _unit(target) != source:
                graph.setdefault(source, set()).add(_unit(target))
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One cycle as a path [a, b, ..., a], or [] when the graph has none (depth-first search)."""
    state: Dict[str, str] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def reachable(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_no_import_circle_between_subpackages():
    graph = import_graph()
    assert "models" in graph and "model_parallel" in graph  # the graph was read at all
    assert find_cycle(graph) == []


def test_model_code_never_reaches_the_parallelism_code():
    graph = import_graph()
    for model_package in ("models", "modules"):
        reached = reachable(graph, model_package)
        assert "distributed" not in reached and "model_parallel" not in reached, (model_package, sorted(reached))
