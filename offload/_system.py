"""Facts about the machine we run on, read when asked (no cached global state)."""

from __future__ import annotations

import ctypes
import ctypes.util
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> Optional[ctypes.CDLL]:
    """glibc, or None elsewhere (musl, macOS): looked up once."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


_LIBC = _libc()


def heap_free_bytes() -> Optional[int]:
    """Bytes glibc's heap holds freed (mallinfo2's fordblks), or None where that cannot be read."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    return int(_LIBC.mallinfo2().fordblks)


def return_freed_memory(if_over: int = 0) -> None:
    """Give the heap's freed chunks back to the system (glibc's malloc_trim; a no-op elsewhere), when it
    holds more than `if_over` bytes freed (0: always).

    glibc keeps freed chunks of up to 32 MiB in the process (its mmap threshold grows to the largest chunk
    freed), so the temporaries of initializing or training a large model pile up as RSS no budget counts.
    Trimming costs the page faults of using that memory again, so a step trims only past a threshold."""
    if _LIBC is None:
        return
    if if_over:
        free = heap_free_bytes()
        if free is not None and free <= if_over:
            return
    _LIBC.malloc_trim(0)


HEAP_SLACK_BYTES = 16 << 20  # freed heap bytes kept before a trim (half the RSS constant of the memory bounds)


def heap_in_use_bytes() -> Optional[int]:
    """Bytes glibc's heap has handed out and not had back (mallinfo2's uordblks), or None where that cannot be read."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    return int(_LIBC.mallinfo2().uordblks)


class KeptHeap:
    """The heap left to glibc between steps (no host budget, or a GPU computing): `FreedHeapTrim`'s calls do nothing."""

    def enter_block(self, index: int) -> None:
        pass

    def after_grad(self) -> None:
        pass


class FreedHeapTrim(KeptHeap):
    """When the CPU computes under a host budget, gives the heap's freed chunks back as the forward enters each
    block and, in the backward, once more than `slack` bytes were freed since the high point of what it has seen.

    A forward's tensors on the CPU come from the heap even above the mmap threshold when its free lists hold chunks
    big enough (initializing the model leaves gigabytes there, trimmed after each block but kept as free chunks, so
    `heap_free_bytes` cannot tell what is resident): each block's temporaries leave holes the next block's tensors
    do not fill, and the saved activations the backward frees stay resident until a trim, beside the gradients it
    makes. Measured on bench_scale's Llama at 50 layers: the heap held 0.77 GB (0.43 of it saved activations) at
    the end of the forward and still 0.78 (0.16 in use) at the peak, the backward's end. A block's temporaries
    come and go within it, unseen by a look between blocks, hence a trim at each; in the backward the freed bytes
    are the activations it consumed, seen as in-use bytes falling. Trimming at every look while `heap_free_bytes`
    passed the slack trimmed 366 times a step at 20 layers (12% of the step); this rule, 33 times, at no
    measurable cost (docs/design.md [Note: the nvme memory bound])."""

    def __init__(self, slack: int = HEAP_SLACK_BYTES) -> None:
        self._slack = slack
        self._high = 0
        self._block = -1

    def enter_block(self, index: int) -> None:
        """A forward enters block `index` (each of its modules enters it: the first trims)."""
        if index != self._block:
            self._block = index
            self._trim()

    def after_grad(self) -> None:
        """A parameter's gradient is complete in a backward."""
        in_use = heap_in_use_bytes()
        if in_use is None:
            return
        self._block = -1  # the next forward trims at its first block
        if in_use >= self._high:
            self._high = in_use
        elif self._high - in_use > self._slack:
            self._trim()

    def _trim(self) -> None:
        return_freed_memory()
        self._high = heap_in_use_bytes() or 0


LARGE_ALLOCATION_BYTES = 1048576


def unmap_large_allocations() -> None:
    """Have glibc serve allocations of LARGE_ALLOCATION_BYTES and more by mmap and return them at free (a
    no-op elsewhere). Process-wide, set once under a host-memory bound, as MALLOC_MMAP_THRESHOLD_ would.

    By default glibc raises its mmap threshold to the largest chunk freed (up to 32 MiB), after which autograd's
    gradients and activations of a few MiB are carved from the heap and their freed chunks stay resident until a
    trim; a fixed threshold keeps them out of the heap (measured on a 112 MiB Llama in backward: 101-114 MiB peak
    RSS growth in some runs, 78-80 MiB in every run with it, set before the model is built). The price is a page fault per page of each such allocation."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES)


_M_MMAP_THRESHOLD = -3  # glibc malloc.h
