"""The shape the engine's code keeps (issue "the engine's inside, round two"): small files, small classes, small
folders, and phases that ask no tier or mode (the modes are objects chosen at placement, scheduler/modes/)."""

from __future__ import annotations

import ast
import pathlib
from typing import List

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "offload"
MAX_FILE_LINES = 400
MAX_CLASS_ATTRIBUTES = 12
MAX_FOLDER_FILES = 15
# what a phase would read to learn which tier or mode runs (the policy's options, the tiers' optional parts)
MODE_NAMES = {"tier", "Tier", "ring", "dp", "data_parallel", "max_grad_norm", "windowed", "grad_pool", "streamed",
              "swap", "staging", "grad_accumulation_steps"}


def _sources() -> List[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_is_longer_than_400_lines():
    long = [(str(p.relative_to(PACKAGE)), n) for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def _attributes(cls: ast.ClassDef) -> set:
    """Names assigned on `self` anywhere in the class (its instance attributes)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def test_no_class_holds_more_than_12_attributes():
    big = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and len(_attributes(node)) > MAX_CLASS_ATTRIBUTES:
                big.append((str(path.relative_to(PACKAGE)), node.name, sorted(_attributes(node))))
    assert big == []


def test_no_folder_holds_more_than_15_python_files():
    folders = {p.parent for p in _sources()}
    crowded = [(str(f.relative_to(PACKAGE.parent)), n) for f in folders if (n := len(list(f.glob("*.py")))) > MAX_FOLDER_FILES]
    assert crowded == []


def test_the_phases_ask_no_tier_or_mode():
    """Outside docstrings and comments, no phase module names the policy's tier or options, the ring, the data-
    parallel group or the gradient window: each mode answers for itself."""
    found = []
    for path in sorted((PACKAGE / "scheduler" / "phases").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in MODE_NAMES:
                found.append(f"{path.name}:{node.lineno} {name}")  # type: ignore[attr-defined]
    assert found == []


def test_the_checks_can_fail(tmp_path):
    """The attribute count and the mode check see what they look for."""
    cls = ast.parse("class C:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(13)))
    assert len(_attributes(cls.body[0])) == 13  # type: ignore[arg-type]
    phase = ast.parse("def f(self):\n    if self.policy.tier is Tier.NVME:\n        pass\n")
    names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(phase)
             if isinstance(n, (ast.Attribute, ast.Name))}
    assert {"tier", "Tier"} <= names & MODE_NAMES
