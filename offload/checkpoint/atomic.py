"""Atomic replacement of a checkpoint directory: a kill at any moment leaves the old or the new one.

Sequence (see docs/design.md, "Checkpoints"):
  1. write everything into `<path>.tmp-<random>`, fsync each file, fsync that directory;
  2. rename the previous checkpoint (if any) to `<path>.old-<random>`;
  3. rename the temporary directory to `<path>`, fsync the parent;
  4. remove `<path>.old-<random>`.
A kill before 3 leaves the old checkpoint (under `<path>` before 2, under `<path>.old-*` between 2 and 3;
`resolve` finds it there); after 3 the new one is in place. Leftover `.tmp-*` directories are never
loaded and are removed by the next save.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
import warnings
from typing import Iterator

from offload.errors import OffloadConfigError, OffloadIntegrityError, OffloadIOError

MANIFEST = "manifest.json"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_leftovers(path: str) -> None:
    """Temporary directories of saves that were killed (never a complete checkpoint under the final name)."""
    for leftover in glob.glob(glob.escape(path) + ".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
    """Yield a fresh temporary directory; on success it replaces `path` atomically, on error it is removed
    and `path` is untouched."""
    tmp = begin(path)
    try:
        yield tmp
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, path)


def begin(path: str) -> str:
    """Steps before 1: check `path` may be replaced, remove leftovers, make the temporary directory."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)  # an empty directory made for the checkpoint
    if os.path.exists(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
        raise OffloadIOError(17, "exists and is not an offload checkpoint; refusing to replace it", path, 0, 0,
                             "save")
    _remove_leftovers(path)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    return tmp


def publish(tmp: str, path: str) -> None:
    """Steps 2-4: the complete, fsynced temporary directory `tmp` replaces `path`."""
    path = os.path.abspath(path)
    tag = tmp.rsplit("-", 1)[-1]
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{tag}"
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for stale in glob.glob(glob.escape(path) + ".old-*"):  # from an earlier save killed between renames
        shutil.rmtree(stale, ignore_errors=True)


def resolve(path: str) -> str:
    """The directory to load for checkpoint `path`: itself, or the previous checkpoint a killed save left
    under `<path>.old-*` (with a warning)."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    olds = [d for d in glob.glob(glob.escape(path) + ".old-*") if os.path.isfile(os.path.join(d, MANIFEST))]
    if olds:
        olds.sort(key=os.path.getmtime)
        warnings.warn(f"offload: {path!r} is missing (a save was interrupted); loading the previous checkpoint "
                      f"{olds[-1]!r}", RuntimeWarning, stacklevel=3)
        return olds[-1]
    if os.path.exists(path) and not os.path.isdir(path):
        raise OffloadConfigError(f"checkpoint {path!r} is a file, not a checkpoint directory: engine.save(path) "
                                 "writes a directory (model.safetensors, optimizer.safetensors, manifest.json); "
                                 "pass that directory to engine.load")
    if os.path.isdir(path):
        raise OffloadIntegrityError(f"{path!r} has no {MANIFEST}: not an offload checkpoint, or damaged", path)
    raise OffloadIntegrityError(f"checkpoint {path!r} does not exist", path)
