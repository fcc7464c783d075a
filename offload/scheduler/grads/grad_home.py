"""A flat group's gradient home: where its gradients go when they leave the device, until the update.

A piece of its own, apart from the optimizer state (state/), so that where gradients are kept can change
without touching the update: `GradAccumulator` holds the group's flat gradient for as long as the engine
lives (host memory, or the device on the gpu tier); `WindowedGradAccumulator` takes its buffer from the
nvme tier's gradient window (grad_window.py) at the first gradient and gives it back after the update.
A `SpillingGradAccumulator` (spilling_home.py) parks it in the swap file
between uses. The placement picks one per group (setup/placement.py). With copies on side streams (CUDA) and the
accumulator on the host, gradients arrive asynchronously (`GradDownloads`): every read first finishes
the downloads in flight (`finish_downloads`).
"""

from __future__ import annotations

import math
import threading
from typing import Any, List, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from offload.errors import OffloadError
from offload.optim.functional import sum_of_squares
from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.grads.grad_window import GradPool
from offload.scheduler.grads.held_grad import HeldGrad
from offload.tiers.copies import CopyContext, GradDownloads
from offload.tiers.mapped import mapped_zeros


class GradDiskBytes:
    """What a spilling home moved to and from its record in the swap file (`engine.stats()`)."""

    def __init__(self) -> None:
        self.written = 0
        self.read = 0


class GradOwner(Protocol):
    """The block a gradient home belongs to (records/block_runtime.py), told of torch ops on its gradients."""

    def check_grads_for_torch(self) -> None:
        """Raise when torch code may not read or change the held gradients now (updated early; data parallel)."""

    def grads_changed(self) -> None:
        """A torch op changed them (a clip): norms taken before are stale."""

    def before_grad_arrives(self) -> None:
        """A gradient is about to be added to the home: its last update must be done with it, the reduction
        must allow it, and norms taken before are stale."""

    @property
    def reduced(self) -> bool:
        """Data-parallel: this step's gradients were averaged across the ranks already."""


class GradAccumulator:
    """The flat gradient of a group's trainable range and which of its parameters have one since `zero`.
    `device`: where it is kept (the host, or the compute device on the gpu tier); `copies`: the device's copy
    context, where gradients that leave the device for the host are counted (`off_device`)."""

    def __init__(self, group: FlatGroup, device: torch.device, copies: CopyContext, off_device: bool,
                 padded_numel: Optional[int] = None) -> None:
        n = padded_numel if padded_numel is not None else group.trainable_numel
        self.numel = n  # the trainable range, padded to whole shards in data-parallel mode (zeros beyond it)
        self.group = group
        self.device = device
        self._counted_at = copies if off_device else None  # where bytes that leave the device are counted
        self.downloads = GradDownloads(copies, n, group.dtype) if device.type == "cpu" and copies.is_async else None
        self._lock = threading.Lock()  # the buffer's taking and giving back (training thread, worker)
        self.grad: Optional[Tensor] = self._first_buffer()
        self.has_grad: List[bool] = [False] * len(group.trainable_slots)
        self.lost: Set[int] = set()  # parameters whose gradient was given back after its update
        # what each parameter's `.grad` holds while its gradient is here (held_grad.py)
        self.held = [HeldGrad(slot.param, slot.name, self, i) for i, slot in enumerate(group.trainable_slots)]
        self.owner: Optional[GradOwner] = None  # set by the block's record
        self.disk_bytes = GradDiskBytes()  # moved to and from the swap file (a spilling home's only)

    @property
    def nbytes(self) -> int:
        return 0 if self.grad is None else self.grad.nbytes

    def _first_buffer(self) -> Optional[Tensor]:
        return self._new_buffer()

    def _new_buffer(self) -> Tensor:
        if self.downloads is not None:
            return self.downloads.new_accumulator()
        return torch.zeros(self.numel, dtype=self.group.dtype, device=self.device)

    def buffer(self, wait: bool = True) -> Tensor:
        """The flat gradient. `wait=False` on the worker (a windowed home must not wait for the worker)."""
        assert self.grad is not None
        return self.grad

    def release(self) -> None:
        """The update has consumed the gradient (a windowed home gives its bytes back)."""

    def must_wait_to_zero(self, set_to_none: bool) -> bool:
        """Whether zeroing must wait for the block's pending update: it still reads the buffer, which zeros
        in place (set_to_none=False) would change under it."""
        return not set_to_none

    parks = False  # its gradient never goes to disk (`SpillingGradAccumulator`)

    def park(self) -> None:
        """The gradient waits for a later use: it stays where it is."""

    def accumulate(self, index: int, grad: Tensor, fresh: bool = False) -> int:
        """Add one parameter's gradient into its range (a copy for the first one since `zero`, or when `fresh`:
        the parameter's `.grad` was cleared outside the engine); returns bytes moved (counted as bytes to the
        host when the gradient left the device)."""
        if fresh:
            self.has_grad[index] = False
            self.lost.discard(index)
        elif index in self.lost:
            raise released_gradient(self.group.trainable_slots[index].name)
        slot = self.group.trainable_slots[index]
        target = self.buffer()[slot.offset:slot.offset + slot.numel]
        source = grad.detach().reshape(-1)
        if self.downloads is not None:
            self.downloads.put(target, slot.offset, source, accumulate=self.has_grad[index])
        elif self.has_grad[index]:
            target.add_(source.to(target.device, target.dtype))
        else:
            target.copy_(source)
        self.has_grad[index] = True
        nbytes = source.numel() * source.element_size()
        if self._counted_at is not None:
            self._counted_at.count_to_host(nbytes)
        return nbytes

    def finish_downloads(self) -> None:
        """Finish the gradient downloads in flight (CUDA): call before reading `grad` (any thread)."""
        if self.downloads is not None:
            self.downloads.finish_downloads()

    def apply(self, index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        """A torch op on the gradient of slot `index`, as on the `.grad` torch would hold (clip_grad_norm_'s
        norm and scale, clip_grad_value_'s clamp: held_grad.py); an in-place one changes it here."""
        if self.owner is not None:
            self.owner.check_grads_for_torch()
        if index in self.lost:
            raise released_gradient(self.group.trainable_slots[index].name)
        self.absorb_pending(index)
        result = func(self._piece(index), *args, **kwargs)
        if in_place(func):
            if self.owner is not None:
                self.owner.grads_changed()
            return self.held[index]
        return result

    def absorb_pending(self, index: int) -> None:
        """What autograd accumulated into the parameter's `.grad` since the engine took it, added here before a
        read: a post-accumulate-grad hook registered before the engine's runs first and reads torch's running
        sum, which then includes this micro-batch's gradient."""
        pending = self.held[index].pop_pending()
        if pending is not None:
            if self.owner is not None:
                self.owner.before_grad_arrives()
            self.accumulate(index, pending)

    def _piece(self, index: int) -> Tensor:
        self.finish_downloads()
        slot = self.group.trainable_slots[index]
        return self.buffer()[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def held_for(self, index: int) -> HeldGrad:
        """The stand-in for the parameter's `.grad` once its gradient is here (nothing pending in it)."""
        held = self.held[index]
        held.pending = None
        return held

    def forget(self, index: int) -> None:
        """The parameter's `.grad` was cleared outside the engine (model.zero_grad()): torch would not step it."""
        self.has_grad[index] = False
        self.lost.discard(index)

    def zero(self, set_to_none: bool) -> None:
        """As torch's zero_grad; each parameter's `.grad` becomes None, or stays held (zeros) for one that
        had a gradient when `set_to_none` is False (a released one comes back as zeros with the buffer)."""
        self.finish_downloads()  # a copy still in flight would land after the zeroing or the next first copy
        for index in self.lost:
            self.has_grad[index] = not set_to_none
        self.lost.clear()
        for index, slot in enumerate(self.group.trainable_slots):
            slot.param.grad = None
            if not set_to_none and self.has_grad[index]:
                if self.grad is not None:
                    self.grad[slot.offset:slot.offset + slot.numel].zero_()
                slot.param.grad = self.held_for(index)
        if set_to_none:
            self.has_grad = [False] * len(self.has_grad)
            self._after_zero()

    def _after_zero(self) -> None:
        pass

    def scale_(self, coef: float) -> None:
        """Multiply every gradient by `coef`, as torch.nn.utils.clip_grad_norm_ does to each `.grad`."""
        self.finish_downloads()
        if self.grad is None:
            return  # zeros (or nothing) stay zeros
        for index, slot in enumerate(self.group.trainable_slots):
            if self.has_grad[index]:
                self.grad[slot.offset:slot.offset + slot.numel].mul_(coef)

    def ready_indices(self) -> List[int]:
        """Trainable parameters that have a gradient now: taken when an update is scheduled, because
        `zero_grad()` may clear the flags before the background update runs."""
        return [i for i, has in enumerate(self.has_grad) if has]

    def norms(self) -> List[Tuple[nn.Parameter, float]]:
        """L2 norm of each accumulated gradient (parameters without one are left out).

        Computed with torch.linalg.vector_norm in fp32, the reduction torch.nn.utils.clip_grad_norm_ uses:
        a more exact fp64 sum differs in the last bit, and Adam amplifies that in elements whose gradient
        is rounding noise (e.g. attention key biases). See docs/design.md [Note: clipping parity]."""
        self.finish_downloads()
        norms = []
        for index, slot in enumerate(self.group.trainable_slots):
            if self.has_grad[index]:
                if self.grad is None:  # zeroed with set_to_none=False after its buffer was given back
                    norms.append((slot.param, 0.0))
                    continue
                piece = self.grad[slot.offset:slot.offset + slot.numel]
                norms.append((slot.param, float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32))))
        return norms

    def all_finite(self, num_threads: Optional[int] = None) -> bool:
        """Whether every accumulated element is finite: one read of the gradient (2-4 B per parameter,
        against ~30 B the Adam update moves), with the update's threads."""
        self.finish_downloads()
        if self.grad is None:
            return True
        grad = self.grad[:self.group.trainable_numel]
        if grad.device.type == "cpu" and grad.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return math.isfinite(sum_of_squares(grad, num_threads=num_threads))
        return bool(torch.isfinite(grad).all())


def in_place(func: Any) -> bool:
    """Whether an aten op writes its first argument (`mul_`, `clamp_`: the name's trailing underscore)."""
    return func._schema.name.endswith("_")


class WindowedGradAccumulator(GradAccumulator):
    """A gradient home whose buffer exists only from the group's first gradient until its update is done
    (`release`): it comes from the nvme tier's gradient window (grad_window.py), so host memory holds a few
    blocks' gradients, not the model's. The gradients it held are then `lost`: torch would still have
    them, so adding to one, or stepping on one again, without a zero_grad in between raises."""

    def __init__(self, group: FlatGroup, device: torch.device, copies: CopyContext, off_device: bool,
                 pool: GradPool, padded_numel: Optional[int] = None) -> None:
        self.pool = pool
        super().__init__(group, device, copies, off_device, padded_numel)

    def _first_buffer(self) -> Optional[Tensor]:
        return None  # taken at the first gradient

    def _new_buffer(self) -> Tensor:
        if self.downloads is None and self.device.type == "cpu":
            return mapped_zeros(self.numel, self.group.dtype)  # its pages go back at release
        return super()._new_buffer()

    def buffer(self, wait: bool = True) -> Tensor:
        """The flat gradient, taken from the window first if it was given back (zeros: a parameter with a
        gradient then is one zeroed with set_to_none=False). `wait=False` on the worker: it would wait for
        itself."""
        with self._lock:
            if self.grad is None:
                self.pool.acquire(self.numel * self.group.dtype.itemsize, wait)
                self.grad = self._new_buffer()
            return self.grad

    def release(self) -> None:
        """The update has consumed the gradient: give its bytes back to the window."""
        with self._lock:
            if self.grad is None:
                return
            self.finish_downloads()
            self.pool.release(self.grad.nbytes)
            self.grad = None
            self.lost.update(i for i, has in enumerate(self.has_grad) if has)
            self.has_grad = [False] * len(self.has_grad)

    def must_wait_to_zero(self, set_to_none: bool) -> bool:
        return True  # the update may still read the buffer, or give it back

    def _after_zero(self) -> None:
        self.release()
        self.lost.clear()


def released_gradient(name: str) -> OffloadError:
    return OffloadError(
        f"the gradient of {name!r} was given back after its update (the nvme tier keeps only a window of "
        "gradients in host memory), but torch would now add to it or step on it again: call zero_grad() after "
        "every step(), or leave grad_accumulation_steps unset")
