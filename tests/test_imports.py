"""The package's import graph, read from the source: no circles, no library module imports an entry script.

Every import counts, top-level and inside functions: a function-level import that closes a circle only hides it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_rl"

# Scripts users run; they only wire library code, and no module imports them.
ENTRY_SCRIPTS = {"torchtitan_rl.simple_grpo", "torchtitan_rl.serve", "torchtitan_rl.evaluate", "torchtitan_rl.launch"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each torchtitan_rl module -> the torchtitan_rl modules it imports (``from a import b`` counts as a.b if b is one)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
    for name in list(graph):
        graph[name] |= {
            parent
            for target in list(graph[name])
            for parent in (".".join(target.split(".")[:i]) for i in range(2, target.count(".") + 1))
            if parent in modules and parent != name and not name.startswith(parent + ".")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_an_entry_script():
    offenders = sorted(f"{m} imports {t}" for m, ts in import_graph().items() for t in ts & ENTRY_SCRIPTS)
    assert not offenders, "; ".join(offenders)
