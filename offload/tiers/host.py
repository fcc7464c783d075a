"""The host tier's staging pool: a hard budget of 4 KiB-aligned, optionally page-locked host memory.

Every buffer offload stages through (uploads to the device, reads and writes of swap files) is leased from
one `StagingPool`. The pool maps its whole budget once and never grows, so host memory stays bounded
whatever the model size (NEEDS.md P4, P5). For CUDA the region is page-locked once, up front; when that
fails (RLIMIT_MEMLOCK in containers, WSL) the pool warns with the fix and carries on unlocked.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from offload import _native
from offload._system import mem_available, memlock_limit
from offload.errors import OffloadConfigError, OffloadMemoryError

ALIGNMENT = 4096
Shape = Union[int, Sequence[int], torch.Size]


class HostBuffer:
    """A leased range of the pool. Views are tensors over the same memory (no copy).

    The memory goes back to the pool when the buffer is released (or garbage-collected) *and* every view
    made from it is gone, so a view can never see its memory handed to someone else.
    """

    __slots__ = ("_lease", "nbytes", "data_ptr", "_finalizer", "__weakref__")

    def __init__(self, lease: object, nbytes: int, data_ptr: int,
                 on_release: Optional[Callable[[], None]] = None) -> None:
        self._lease = lease
        self.nbytes = nbytes
        self.data_ptr = data_ptr
        self._finalizer = weakref.finalize(self, on_release) if on_release is not None else None

    def view(self, dtype: torch.dtype = torch.uint8, shape: Optional[Shape] = None, *, offset: int = 0) -> Tensor:
        """A tensor of `dtype` and `shape` over the buffer's bytes from `offset` (default: all of it, flat)."""
        if self._lease is None:
            raise OffloadConfigError("this HostBuffer was released; lease a new one from the pool")
        itemsize = dtype.itemsize
        if offset % itemsize:
            raise OffloadConfigError(f"offset {offset} is not a multiple of {dtype}'s size {itemsize}")
        if shape is None:
            numel = (self.nbytes - offset) // itemsize
            shape = (numel,)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = math.prod(shape)
        if offset + numel * itemsize > self.nbytes:
            raise OffloadConfigError(
                f"a view of {numel} x {dtype} at offset {offset} needs {offset + numel * itemsize} bytes; "
                f"the buffer has {self.nbytes}: lease a larger one")
        raw = self._raw_bytes()
        return raw[offset : offset + numel * itemsize].view(dtype).view(shape)

    def _raw_bytes(self) -> Tensor:
        if isinstance(self._lease, Tensor):  # the pure-torch fallback
            return self._lease
        return torch.frombuffer(self._lease, dtype=torch.uint8)  # keeps the native lease alive

    def release(self) -> None:
        """Give the range back (it is reused once the last view of it is gone). Idempotent."""
        self._lease = None
        if self._finalizer is not None:
            self._finalizer()


class StagingPool:
    """A fixed budget of 4 KiB-aligned host memory handed out as `HostBuffer` leases.

    Args:
        budget_bytes: the most host memory the pool may ever use. Exhausting it raises
            `OffloadMemoryError`, or waits for a release when `lease(..., wait=True)`.
        pin: page-lock for CUDA. None (default): when CUDA is available. Page-locking commits the whole
            budget at once, so it is refused up front when the budget exceeds available memory.
    """

    def __init__(self, budget_bytes: int, *, pin: Optional[bool] = None) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise OffloadConfigError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.pinned = False
        self.pin_reason = "not requested"
        self._closed = False
        self._lock = threading.Condition()
        self._in_use = 0  # the fallback's accounting; the native arena keeps its own
        self._peak = 0
        want_pin = torch.cuda.is_available() if pin is None else bool(pin)
        if want_pin and not torch.cuda.is_available():
            raise OffloadConfigError("pin=True needs CUDA, which is not available: pass pin=None or pin=False")
        C = _native._C
        self._native = C  # the arena's module, kept: _native._C may be swapped out later (tests do)
        self._arena = C.HostArena(budget_bytes) if C is not None else None
        if want_pin:
            self._pin()

    # --- page-locking -----------------------------------------------------------------------------------
    def _pin(self) -> None:
        available = mem_available()
        if available is not None and self.budget_bytes > available:
            raise OffloadMemoryError(
                f"page-locking a staging pool of {self.budget_bytes} bytes needs that much free RAM, "
                f"but only {available} bytes are available: lower host_memory")
        if self._arena is None:  # fallback: torch allocates pinned memory per lease
            self.pinned, self.pin_reason = True, "torch pinned allocator (native core unavailable)"
            return
        ptr, size = self._arena.base_ptr, self._arena.capacity
        ok, reason = self._register(ptr, size)
        if ok:
            self.pinned, self.pin_reason = True, reason
            return
        limit = memlock_limit()
        limit_text = "unlimited" if limit is None else f"{limit} bytes"
        warnings.warn(
            f"offload: could not page-lock the {size}-byte staging pool ({reason}; memlock limit {limit_text}). "
            "Using unlocked memory: copies to the GPU will be slower. To fix, raise the memlock limit "
            "(`ulimit -l unlimited`, or `docker run --ulimit memlock=-1`) or lower host_memory.",
            RuntimeWarning, stacklevel=3)
        self.pin_reason = f"page-locking failed: {reason}"

    @staticmethod
    def _register(ptr: int, size: int) -> tuple:
        C = _native._C
        if C is not None and getattr(C, "built_with_cuda", False):
            ok, msg = C.cuda_host_register(ptr, size)
            if ok:
                return True, "cudaHostRegister (offload._C)"
            first = f"offload._C: {msg}"
        else:
            first = "offload._C built without CUDA"
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 1)  # 1 = cudaHostRegisterPortable
        code = int(getattr(err, "value", err))
        if code == 0:
            return True, "cudaHostRegister (torch runtime)"
        return False, f"{first}; torch cudaHostRegister error {code}"

    def _unregister(self) -> None:
        assert self._arena is not None and self._native is not None  # only a native arena is locked here
        ptr = self._arena.base_ptr
        if self.pin_reason.endswith("(offload._C)"):
            self._native.cuda_host_unregister(ptr)
        else:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    # --- leases -------------------------------------------------------------------------------------------
    def lease(self, nbytes: int, *, wait: bool = False, timeout: Optional[float] = None) -> HostBuffer:
        """A 4 KiB-aligned buffer of `nbytes`. Raises OffloadMemoryError when the budget is exhausted, or, with
        wait=True, blocks until a release makes room (at most `timeout` seconds when given)."""
        if self._closed:
            raise OffloadConfigError("this StagingPool is closed; create a new one")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise OffloadConfigError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if self._arena is not None:
            assert self._native is not None  # the arena is the native core's
            try:
                lease = self._arena.lease(nbytes, wait, -1.0 if timeout is None else float(timeout))
            except self._native.ArenaExhausted as exc:
                raise OffloadMemoryError(f"{exc}: raise the pool's budget (host_memory) or release buffers") from None
            return HostBuffer(lease, nbytes, lease.ptr)
        return self._lease_fallback(nbytes, wait, timeout)

    def _lease_fallback(self, nbytes: int, wait: bool, timeout: Optional[float]) -> HostBuffer:
        rounded = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            fits = lambda: self._in_use + rounded <= self.budget_bytes  # noqa: E731
            if rounded > self.budget_bytes or (not fits() and not (wait and self._lock.wait_for(fits, timeout))):
                raise OffloadMemoryError(
                    f"staging pool exhausted: a lease of {nbytes} bytes does not fit (budget {self.budget_bytes} "
                    f"bytes, {self._in_use} leased): raise the pool's budget (host_memory) or release buffers")
            self._in_use += rounded
            self._peak = max(self._peak, self._in_use)
        backing = torch.empty(rounded + ALIGNMENT, dtype=torch.uint8, pin_memory=self.pinned)
        start = (-backing.data_ptr()) % ALIGNMENT
        aligned = backing[start : start + nbytes]
        return HostBuffer(aligned, nbytes, backing.data_ptr() + start, on_release=lambda: self._return(rounded))

    def _return(self, rounded: int) -> None:
        with self._lock:
            self._in_use -= rounded
            self._lock.notify_all()

    # --- accounting ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """capacity, in_use, peak_in_use, largest_free, live_leases, total_leases (bytes and counts)."""
        if self._arena is not None:
            return dict(self._arena.stats())
        with self._lock:
            return {"capacity": self.budget_bytes, "in_use": self._in_use, "peak_in_use": self._peak,
                    "largest_free": self.budget_bytes - self._in_use}

    @property
    def bytes_in_use(self) -> int:
        return int(self.stats()["in_use"])

    def close(self) -> None:
        """Unlock the region and let go of it: its memory goes back to the system once the last lease is gone
        (leases keep the region alive), now rather than whenever this pool is collected (the nvme tier's
        objects sit in reference cycles). Page-locked with live leases, it stays locked until process exit."""
        if self._closed:
            return
        self._closed = True
        if self._arena is None:
            return
        if self.pinned:
            if self.stats()["live_leases"] != 0:
                warnings.warn("offload: StagingPool closed with buffers still leased; its page-locked memory "
                              "is kept until they are gone", RuntimeWarning, stacklevel=2)
                return
            self._unregister()
        self._arena = None

    def __enter__(self) -> "StagingPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"StagingPool(budget={self.budget_bytes}, in_use={s['in_use']}, pinned={self.pinned}, "
                f"native={self._arena is not None})")
