"""A gradient home that parks its sum in the swap file between uses (docs/design.md [Note: gradients on disk]).

On the nvme tier under a host budget too small for every gradient, a group's gradient that must wait (for the
global norm, an undeclared micro-batch) goes to its record in the swap file when its block is complete, and
comes back for the next micro-batch or the update. Torch ops on it while it is there (a clip's norm and scale)
cost no extra trip: a norm reads the record once for every slot, an in-place op waits to be replayed.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.grads.grad_home import WindowedGradAccumulator, in_place
from offload.scheduler.grads.grad_window import GradPool
from offload.tiers.copies import CopyContext

if TYPE_CHECKING:
    from offload.scheduler.ring.weight_io import DiskWeightIO


class SpillingGradAccumulator(WindowedGradAccumulator):
    """A windowed gradient home whose gradient, when it must wait (clipping needs the global norm; accumulation
    is undeclared; a micro-batch is not the last), goes to its record in the swap file (`park`, on the worker
    once the block's gradients are complete) and comes back at its next use: the next micro-batch's first
    gradient reads the sum back and adds to it (torch's order: the running sum, then each new gradient), the
    update, the norms and the finiteness check read it. `disk`: the ring's moves of gradient records
    (ring/weight_io.py, kind GRADS). See docs/design.md [Note: gradients on disk]."""

    parks = True

    def __init__(self, group: FlatGroup, device: torch.device, copies: CopyContext, off_device: bool,
                 pool: GradPool, disk: "DiskWeightIO", padded_numel: Optional[int] = None,
                 parked_range: Optional[Tuple[int, int]] = None) -> None:
        self._disk = disk
        # data-parallel with clipping: a gradient parks only after its block's reduce-scatter, when this rank's
        # part [lo, hi) is all that is read again; its record holds that part
        self._parked = parked_range
        self.on_disk = False  # the sum since `zero` is in the swap file, not in `grad`
        # torch's in-place ops on it while on disk (a clip's scale), replayed in order when it comes back
        self._pending_ops: List[Tuple[int, Any, Sequence[Any], dict]] = []
        self._results: Dict[Tuple[Any, str], List[Any]] = {}  # a read op's result per slot, for the whole group
        super().__init__(group, device, copies, off_device, pool, padded_numel)

    def buffer(self, wait: bool = True) -> Tensor:
        """The flat gradient in host memory: taken from the window, and read back when it waits on disk."""
        with self._lock:
            if self.grad is None:
                self.pool.acquire(self.numel * self.group.dtype.itemsize, wait)
                grad = self._new_buffer()
                if self.on_disk:
                    self._read_into(grad)
                    self._pending_ops.clear()  # applied: in memory from here on
                    self.on_disk = False
                self.grad = grad
            return self.grad

    def park(self) -> None:
        """The gradient waits for a later micro-batch or the update: to its record, the buffer back to the
        window. A buffer of zeros only (no gradient since `zero`) is dropped."""
        with self._lock:
            if self.grad is None:
                return
            self.finish_downloads()
            if any(self.has_grad):
                parked = self._parked_view(self.grad)
                self._disk.write_weights(self.group, parked)
                self.disk_bytes.written += parked.nbytes
                self.on_disk = True
            self.pool.release(self.grad.nbytes)
            self.grad = None

    def release(self) -> None:
        """The update consumed the gradient: the buffer goes back, and what is on disk is stale."""
        super().release()
        self._forget_disk()

    def zero(self, set_to_none: bool) -> None:
        self._forget_disk()  # gone, or zeros (a buffer taken at the next use starts at zero)
        super().zero(set_to_none)

    def accumulate(self, index: int, grad: Tensor, fresh: bool = False) -> int:
        self._results.clear()
        return super().accumulate(index, grad, fresh)

    def apply(self, index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        """On disk, an in-place op waits in order for the sum to come back; a read runs for every slot of the
        group at once on one read back, each slot's result kept until the gradient changes."""
        if self.owner is not None:
            self.owner.check_grads_for_torch()
        self.absorb_pending(index)
        if self.grad is not None or not self.on_disk:
            self._results.clear()
            return super().apply(index, func, args, kwargs)
        if in_place(func):
            self._pending_ops.append((index, func, args, kwargs))
            self._results.clear()
            if self.owner is not None:
                self.owner.grads_changed()
            return self.held[index]
        key = (func, repr((args, kwargs)))
        if key not in self._results:
            with self._read_back():
                assert self.grad is not None
                slots = self.group.trainable_slots
                self._results[key] = [func(self.grad[s.offset:s.offset + s.numel].view(s.shape), *args, **kwargs)
                                      for s in slots]
        return self._results[key][index]

    def _read_into(self, grad: Tensor) -> None:
        """The record into `grad`, then the in-place ops made while it was on disk, in order."""
        parked = self._parked_view(grad)
        self._disk.read_weights(self.group, parked, _copy_staged)
        self.disk_bytes.read += parked.nbytes
        for index, func, args, kwargs in self._pending_ops:
            slot = self.group.trainable_slots[index]
            func(grad[slot.offset:slot.offset + slot.numel].view(slot.shape), *args, **kwargs)

    def _parked_view(self, grad: Tensor) -> Tensor:
        """What parks of `grad`: all of it, or this rank's averaged part (`parked_range`)."""
        if self._parked is None:
            return grad
        if self.owner is not None and not self.owner.reduced:
            raise AssertionError("a data-parallel gradient parks its part only after its block's reduce-scatter")
        lo, hi = self._parked
        return grad[lo:hi]

    def _forget_disk(self) -> None:
        self.on_disk = False
        self._pending_ops.clear()
        self._results.clear()

    def scale_(self, coef: float) -> None:
        """As `GradAccumulator.scale_`; on disk, the scale waits for the sum's next read back (no extra trip)."""
        if self.grad is None and self.on_disk:
            self._results.clear()
            self._pending_ops.extend((i, torch.ops.aten.mul_.Scalar, (coef,), {})
                                     for i, has in enumerate(self.has_grad) if has)
            return
        super().scale_(coef)

    def norms(self) -> List[Tuple[nn.Parameter, float]]:
        with self._read_back():
            return super().norms()

    def all_finite(self, num_threads: Optional[int] = None) -> bool:
        """Read back first when the sum waits on disk, and keep it: the update that asks reads it next."""
        if self.grad is None and self.on_disk:
            self.buffer()
        return super().all_finite(num_threads)

    @contextlib.contextmanager
    def _read_back(self) -> Iterator[None]:
        """A read of the gradient: a sum waiting on disk is read into a window buffer for it, and dropped after
        (the record still holds it)."""
        if self.grad is not None or not self.on_disk:
            yield
            return
        with self._lock:
            self.pool.acquire(self.numel * self.group.dtype.itemsize, True)
            self.grad = self._new_buffer()
            self._read_into(self.grad)  # the waiting in-place ops stay waiting: the record is unchanged
        try:
            yield
        finally:
            with self._lock:
                assert self.grad is not None
                self.pool.release(self.grad.nbytes)
                self.grad = None


def _copy_staged(dst: Tensor, staged: Tensor) -> None:
    """A ring slot's bytes of a gradient record into the host buffer."""
    dst.copy_(staged)
