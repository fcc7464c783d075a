"""The package depends one way (docs/design.md, "Map"), type-only imports included: the scheduler's sub-packages
each import only from themselves and the packages listed before them; the layers below the scheduler (tiers/,
io/, optim/, planner/) name nothing of it; and no module of the package takes part in an import cycle, counting
the imports under `if TYPE_CHECKING:` and those inside functions."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "offload"
SCHEDULER = PACKAGE / "scheduler"
# bottom to top: the model cut into blocks; the nvme ring; optimizer state; the saved-tensor hooks; weight homes
# and streaming; the generic step worker; the per-block records (the unit); the modes; the phases; setup
LAYERS = ["torch_internals", "blocks", "ring", "state", "activations", "weights", "worker", "records", "modes", "phases",
          "setup"]
ABOVE_THE_SCHEDULER = ("offload.engine", "offload.integrations", "offload.cli", "offload.api", "offload.checkpoint")
BELOW_THE_SCHEDULER = ("tiers", "io", "optim", "planner")  # they see none of offload.scheduler, engine, ...


def _imports(tree: ast.Module) -> Iterator[Tuple[int, str, List[str]]]:
    """(line, module, names) of every `from offload... import ...` and `import offload...`, wherever it stands:
    module level, under `if TYPE_CHECKING:`, inside a function."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def _module_of(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_of(module: str) -> str:
    return module.split(".")[2] if module.count(".") >= 2 else ""


def _violations(scheduler: pathlib.Path = SCHEDULER, package: pathlib.Path = PACKAGE) -> List[str]:
    found = []
    for path in sorted(scheduler.rglob("*.py")):
        relative = path.relative_to(scheduler)
        own = relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.stem != "__init__" else ""
        if not own:
            continue
        assert own in LAYERS, f"{relative}: a sub-package missing from LAYERS"
        for line, module, _names in _imports(ast.parse(path.read_text())):
            if module.startswith(ABOVE_THE_SCHEDULER):
                found.append(f"{relative}:{line} imports {module} (above the scheduler)")
            if not module.startswith("offload.scheduler."):
                continue
            other = _layer_of(module)
            if LAYERS.index(other) > LAYERS.index(own):
                found.append(f"{relative}:{line} ({own}) imports {module} ({other}, a layer above)")
    for below in BELOW_THE_SCHEDULER:
        for path in sorted((package / below).rglob("*.py")):
            for line, module, _names in _imports(ast.parse(path.read_text())):
                if module.startswith(("offload.scheduler",) + ABOVE_THE_SCHEDULER):
                    found.append(f"{path.relative_to(package)}:{line} imports {module} (a layer above {below}/)")
    return found


def _import_graph(package: pathlib.Path = PACKAGE) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (a `from offload.x import y` of a sub-module `y` counts as
    an import of `offload.x.y` only; the native `_C` is not a module of the package)."""
    modules = {_module_of(p, package): p for p in package.rglob("*.py")}
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _line, target, names in _imports(ast.parse(path.read_text())):
            if not target.startswith(package.name):
                continue
            subs = [n for n in names if f"{target}.{n}" in modules or n == "_C"]
            graph[module].update(f"{target}.{n}" for n in subs if n != "_C")
            if target in modules and (len(subs) < len(names) or not names):
                graph[module].add(target)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_layers_depend_one_way_type_only_imports_included():
    assert _violations() == []


def test_no_module_of_the_package_is_in_an_import_cycle():
    assert _cycles(_import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle(tmp_path):
    """The checks themselves can fail: a blocks module importing from the phases (a type-only import too), a tier
    naming a scheduler type, and two modules importing each other are reported."""
    package = tmp_path / "offload"
    scheduler = package / "scheduler"
    (scheduler / "blocks").mkdir(parents=True)
    (package / "tiers").mkdir()
    for folder in (package, scheduler, scheduler / "blocks", package / "tiers"):
        (folder / "__init__.py").write_text("")
    (scheduler / "blocks" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from offload.scheduler.phases.step import StepPhase\n")
    (package / "tiers" / "disk.py").write_text("from offload.scheduler.blocks.bad import X\n")
    (package / "a.py").write_text("def f():\n    from offload.b import g\n")
    (package / "b.py").write_text("from offload import a\n")
    assert _violations(scheduler, package) == [
        "blocks/bad.py:3 (blocks) imports offload.scheduler.phases.step (phases, a layer above)",
        "tiers/disk.py:1 imports offload.scheduler.blocks.bad (a layer above tiers/)"]
    assert _cycles(_import_graph(package)) == [["offload.a", "offload.b"]]
