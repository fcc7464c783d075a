"""Facts about the machine we run on, read when asked (no cached global state)."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Optional


def usable_cores() -> int:
    """Cores this process may use: the affinity mask, capped by a cgroup CPU quota when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = max(1, min(cores, int(quota + 0.5)))
    return max(1, cores)


def _cgroup_cpu_quota() -> Optional[float]:
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return None
    if len(text) != 2 or text[0] == "max":
        return None
    return int(text[0]) / int(text[1])


def memlock_limit() -> Optional[int]:
    """RLIMIT_MEMLOCK soft limit in bytes (None when unlimited): what page-locking may use."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def mem_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo, capped by the cgroup memory limit, in bytes."""
    available: Optional[int] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            room = int(limit) - usage
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def _libc_trim():
    """glibc's malloc_trim, or None elsewhere (musl, macOS): looked up once."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def return_freed_memory() -> None:
    """Give the heap's freed chunks back to the system (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps freed chunks of up to 32 MiB in the process (its mmap threshold grows to the largest chunk
    freed), so the temporaries of initializing or training a large model pile up as RSS no budget counts.
    Called where that happens in bulk: after each block is materialized, after each step on the nvme tier."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
