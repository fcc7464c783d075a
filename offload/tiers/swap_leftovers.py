"""Swap files left in `nvme_path` by runs that crashed: found by name, proven dead by their lock, removed.

Every live engine holds an exclusive `flock` on its swap file (`hold_lock`); the kernel drops it when the
process dies, however it dies. A file named like ours (`offload-<pid>-<tag>.swap`) whose lock we can take
whose process is gone belongs to no running engine, so it and its layout are removed; one whose lock is held (another engine,
in this process or another) is left alone. A leftover is never read as state: every run writes its own
new file, and resume goes through checkpoints (docs/design.md, "Checkpoints").
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import warnings
from typing import List

from offload.errors import OffloadIOError

_SWAP_NAME = re.compile(r"^offload-(\d+)-[0-9a-f]{8}\.swap$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hold_lock(fd: int, path: str) -> None:
    """Mark a swap file as in use for as long as this process keeps `fd` open."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise OffloadIOError.from_errno(exc.errno or errno.EAGAIN, path, 0, 0, "lock") from None


def remove_leftovers(directory: str) -> List[str]:
    """Remove swap files of dead runs in `directory` (with their layouts); returns what was removed."""
    removed: List[str] = []
    freed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _SWAP_NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue  # not ours, or its process (or one reusing its pid) still runs: leave it
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live engine holds it
            freed += os.fstat(fd).st_size
            for victim in (path, path + ".layout.json"):
                try:
                    os.unlink(victim)
                except FileNotFoundError:
                    pass
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        warnings.warn(f"offload: removed {len(removed)} swap file(s) of crashed runs from {directory!r} "
                      f"({freed / 2**20:.1f} MiB freed)", RuntimeWarning, stacklevel=4)
    return removed
