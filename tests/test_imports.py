"""The package's import graph, read from the source: no circles, no upward import, no library module imports
an entry script; and no module over MAX_LINES lines without a reason in its docstring.

Every import counts, top-level and inside functions: a function-level import that closes a circle only hides it.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_rl"

# Scripts users run; they only wire library code, and no module imports them.
ENTRY_SCRIPTS = {"torchtitan_rl.simple_grpo", "torchtitan_rl.serve", "torchtitan_rl.evaluate", "torchtitan_rl.launch",
                 "torchtitan_rl.fetch"}


# The declared order, lowest first (docs/design.md's map): a package may import its own modules and those of
# lower layers only; packages in one layer import none of each other. Names are torchtitan_rl's top-level
# packages and modules.
LAYERS: list[set[str]] = [
    {"collector", "compat", "config", "disk"},  # the cycle collector, version shims, the typed config, writing to disk
    {"distributed"},  # process groups, determinism, DTensor helpers
    {"kernels"},  # batch-invariant and paged-attention kernels, trainer and engine alike
    {"models"},  # what a model is: families, shapes, LoRA, its HF folder
    {"engine"},  # vLLM in this process, running torchtitan's decoder: prompts -> Rollouts
    {"weight_sync"},  # the sync plan and its transports, trainer -> engine
    {"grpo"},  # tasks, rewards, advantages, the loss, rollouts -> TrainBatch
    {"trainer"},  # torchtitan's model trained with the loss, checkpoints
    {"serving"},  # the generator side in its own process: the HTTP rollout server, the own-rank replica
    {"rollout"},  # the loop's generator interface and its clients (colocated, own rank, server)
    {"run"},  # one run: its folder and latest link, its plan (new or resumed), its parts, exits, memory, metrics
    {"export"},  # the policy as an HF folder
    {m.rpartition(".")[2] for m in ENTRY_SCRIPTS},  # the commands users run
]
MAX_LINES = 400
"""A module longer than this says why in its docstring, in a sentence starting "Long:"."""


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module under ``root`` -> the modules of ``root`` it imports (``from a import b`` counts as a.b if b is one)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
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


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's top-level package (``pkg.models.lora`` -> models' layer)."""
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: its package {top!r} is in no layer of LAYERS (tests/test_imports.py)")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module to one of a higher layer, or of another package of the same layer."""
    out = []
    for m, targets in graph.items():
        if m.count(".") == 0:
            continue  # the package's own __init__
        for t in targets:
            if t.count(".") == 0 or m.split(".")[1] == t.split(".")[1]:
                continue
            if layer_of(t) >= layer_of(m):
                out.append(f"{m} imports {t}")
    return sorted(out)


def test_no_package_imports_a_higher_one():
    offenders = upward_imports(import_graph())
    assert not offenders, "; ".join(offenders)


def test_layer_check_catches_an_upward_import(tmp_path):
    """The same checker, run on a copy of the package with one function-level import from models up to trainer."""
    import shutil

    root = tmp_path / "torchtitan_rl"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "data", "*.json"))
    assert upward_imports(import_graph(root)) == []
    lora = root / "models" / "lora.py"
    lora.write_text(lora.read_text() + "\n\ndef _late():\n    from torchtitan_rl.trainer.trainer import Trainer\n")
    assert upward_imports(import_graph(root)) == [
        "torchtitan_rl.models.lora imports torchtitan_rl.trainer",
        "torchtitan_rl.models.lora imports torchtitan_rl.trainer.trainer",
    ]


def test_every_package_has_a_layer():
    for m in import_graph():
        if "." in m:
            layer_of(m)


def test_long_modules_say_why():
    """A module over MAX_LINES lines has a reason in its docstring ("Long: ...")."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_LINES and "Long:" not in (ast.get_docstring(ast.parse(text)) or ""):
            offenders.append(f"{path.relative_to(PACKAGE.parent)} ({lines} lines)")
    assert not offenders, "over %d lines without a 'Long:' reason in the docstring: %s" % (MAX_LINES, ", ".join(offenders))
