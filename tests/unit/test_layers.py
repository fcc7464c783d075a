"""The scheduler's sub-packages depend one way (docs/design.md, "Map"): each imports only from itself and
the packages listed before it, at run time (imports under `if TYPE_CHECKING:` name types only)."""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, List, Tuple

SCHEDULER = pathlib.Path(__file__).resolve().parents[2] / "offload" / "scheduler"
# bottom to top: the model cut into blocks; the nvme ring; optimizer state; gradients; weight homes and
# streaming; the step worker and its jobs; the per-block runtime records; the modes; the phases; setup
LAYERS = ["torch_internals", "blocks", "ring", "state", "activations", "weights", "worker", "records", "modes", "phases",
          "setup"]
ABOVE_THE_SCHEDULER = ("offload.engine", "offload.integrations", "offload.cli", "offload.api")


def _runtime_imports(tree: ast.Module) -> Iterator[Tuple[int, str]]:
    """(line, module) of every import executed at run time: not those under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _layer_of(module: str) -> str:
    return module.split(".")[2] if module.count(".") >= 2 else ""


def _violations() -> List[str]:
    found = []
    for path in sorted(SCHEDULER.rglob("*.py")):
        relative = path.relative_to(SCHEDULER)
        own = relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.stem != "__init__" else ""
        if not own:
            continue
        assert own in LAYERS, f"{relative}: a sub-package missing from LAYERS"
        for line, module in _runtime_imports(ast.parse(path.read_text())):
            if module.startswith(ABOVE_THE_SCHEDULER):
                found.append(f"{relative}:{line} imports {module} (above the scheduler)")
            if not module.startswith("offload.scheduler."):
                continue
            other = _layer_of(module)
            if LAYERS.index(other) > LAYERS.index(own):
                found.append(f"{relative}:{line} ({own}) imports {module} ({other}, a layer above)")
    return found


def test_the_scheduler_packages_depend_one_way():
    assert _violations() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a blocks module importing from the phases is reported."""
    fake = tmp_path / "scheduler"
    (fake / "blocks").mkdir(parents=True)
    (fake / "blocks" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nfrom offload.scheduler.phases.step import StepPhase\n"
        "if TYPE_CHECKING:\n    from offload.scheduler.setup.assemble import assemble\n")
    import tests.unit.test_layers as me

    monkeypatch.setattr(me, "SCHEDULER", fake)
    assert me._violations() == ["blocks/bad.py:2 (blocks) imports offload.scheduler.phases.step (phases, a layer above)"]
