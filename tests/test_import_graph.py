"""The import structure of metaseq_ds, read from the sources with `ast` (nothing is imported):
- no circle between files, counting every import, those inside functions too (a lazy import
  that only hides a circle is still one); a `mseq` command's module imports no other command's;
- at module level, no circle between subpackages, and the model code never reaches the
  parallelism code (tensor parallelism is applied from outside). There an edge A -> B means a
  module of A imports a module of B at module level (imports inside functions are deliberate
  lazy loads); nodes are metaseq_ds's subpackages and top-level modules.
"""

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

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


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _file_of(module: str) -> Optional[str]:
    """The metaseq_ds file that `import module` runs last (a package: its __init__), or None."""
    base = PACKAGE.parent / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return _module_of(candidate) if candidate.name != "__init__.py" else module
    return None


def file_import_graph() -> Dict[str, Set[str]]:
    """Module -> the metaseq_ds modules it imports anywhere in its file. `from package import name`
    counts as an import of `package.name` where that is a module, else of the package."""
    graph: Dict[str, Set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_of(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {_file_of(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets |= {_file_of(f"{base}.{alias.name}") or _file_of(base) for alias in node.names}
        graph[module] = {target for target in targets if target and target != module}
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


def test_no_import_circle_between_files_counting_lazy_imports():
    graph = file_import_graph()
    assert "metaseq_ds.checkpoint.manager" in graph["metaseq_ds.cli.train"]  # lazy imports are read
    assert find_cycle(graph) == []


def test_no_command_module_imports_another():
    """`mseq`'s app (cli.main) imports its commands; a command imports what it runs, and `cli.guard`."""
    graph = file_import_graph()
    commands = {module for module in graph if module.startswith("metaseq_ds.cli.")} - {
        "metaseq_ds.cli.main", "metaseq_ds.cli.guard"}
    for command in sorted(commands):
        assert not graph[command] & (commands | {"metaseq_ds.cli.main"}), (command, sorted(graph[command] & commands))
