"""Every file path the docs and the package's comments name exists (issue 34: "no stale file name in comments or
docs"). Read: README.md, docs/**/*.md, examples/README.md, and the comments and docstrings of offload/**/*.py.
A name that looks like a repository file (ending in .py, .md, .sh, .cpp or .h) is found when it exists relative
to the repository root, offload/, offload/scheduler/ or csrc/, or is the tail of some file's path
(`records/block_runtime.py`, `unit/phases/test_hooks.py`); a bare name in prose (`block_runtime.py`) when some
file of that name exists anywhere. A failure prints each stale name with its file:line."""

from __future__ import annotations

import ast
import io
import os
import pathlib
import re
import tokenize
from typing import Iterator, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASES = ("", "offload/", "offload/scheduler/", "csrc/")
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules", "offload-demo", "runs"}
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:py|md|sh|cpp|h))(?![\w/-])")
URL = re.compile(r"\w+://\S+")

# Names that are no file of this repository, by design.
NOT_REPOSITORY_FILES = {
    "train.py",  # the user's own training script (docs/guide/distributed.md's launch lines)
    "summary.md",  # what benchmarks/gpu_check.sh writes into $OUT (docs/benchmarks.md)
    "DESIGN.md", "shared/DESIGN.md", "NEEDS.md",  # the project's shared documents, beside the repository
    "transformer.h",  # GPT-2's layer list, `model.transformer.h` (docs/design.md), no header
    "malloc.h",  # glibc's header (offload/_system.py)
    "saved_variable.cpp",  # PyTorch's source, quoted for its message (scheduler/activations/meter.py)
}

# Stale names in files another change is rewriting now (issue 34, items 1-3: offload/scheduler/, offload/tiers/,
# offload/planner.py, offload/ring_sizes.py). That change fixes them and empties this list; it may only shrink.
KNOWN_STALE: Set[Tuple[str, str]] = set()


def _repository_files() -> Tuple[Set[str], Set[str]]:
    """(every file's path relative to the root, every file's bare name), hidden folders and build outputs left out."""
    paths, names = set(), set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = pathlib.Path(folder).relative_to(ROOT).as_posix()
        for f in files:
            paths.add(f if rel == "." else f"{rel}/{f}")
            names.add(f)
    return paths, names


def _exists(name: str, paths: Set[str], names: Set[str]) -> bool:
    name = name.removeprefix("./")
    if "/" not in name:
        return name in names
    return any(base + name in paths for base in BASES) or any(p.endswith("/" + name) for p in paths)


def _markdown_lines(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
    yield from enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)


def _python_comment_lines(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
    """The comments and docstrings of one module, line by line."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for offset, line in enumerate(first.value.value.splitlines()):
                    yield first.lineno + offset, line


def _documents() -> List[Tuple[pathlib.Path, Iterator[Tuple[int, str]]]]:
    markdown = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    docs = [(p, _markdown_lines(p)) for p in markdown if p.is_file()]
    code = [(p, _python_comment_lines(p)) for p in sorted((ROOT / "offload").rglob("*.py"))]
    return docs + code


def stale_references() -> List[Tuple[str, int, str]]:
    """(file, line, name) of every named path that does not exist."""
    paths, names = _repository_files()
    stale = []
    for path, lines in _documents():
        rel = path.relative_to(ROOT).as_posix()
        for number, line in lines:
            for match in PATH.finditer(URL.sub(" ", line)):
                name = match.group(1)
                if name in NOT_REPOSITORY_FILES or (rel, name) in KNOWN_STALE:
                    continue
                if not _exists(name, paths, names):
                    stale.append((rel, number, name))
    return sorted(set(stale))


def test_every_named_file_exists():
    stale = stale_references()
    for rel, number, name in stale:
        print(f"{rel}:{number}: {name}")
    assert stale == [], "stale file names (printed above as file:line: name): " + ", ".join(
        f"{rel}:{number} {name}" for rel, number, name in stale)


def test_known_exceptions_are_still_stale():
    """An allowlisted (file, name) that is fixed comes off the list, so the list only shrinks."""
    paths, names = _repository_files()
    still = set()
    for path, lines in _documents():
        rel = path.relative_to(ROOT).as_posix()
        for _, line in lines:
            for match in PATH.finditer(URL.sub(" ", line)):
                if (rel, match.group(1)) in KNOWN_STALE and not _exists(match.group(1), paths, names):
                    still.add((rel, match.group(1)))
    fixed = sorted(KNOWN_STALE - still)
    assert fixed == [], f"no longer stale, take them off KNOWN_STALE: {fixed}"
