"""A flat group's gradient home: where its gradients go when they leave the device, until the update.

One class, `GradHome`, made of two parts the placement chooses per group (setup/placement.py):
- its buffer: `FixedBuffer`, the group's flat gradient for as long as the engine lives (host memory, or the
  device on the gpu tier), or `WindowBuffer`, taken from the nvme tier's gradient window (grad_window.py) at
  the group's first gradient and given back after its update;
- its parking, where the gradient waits between uses (for the global norm, a later micro-batch): `KeptParking`,
  in its buffer, or `DiskParking`, in its record of the swap file, the buffer back to the window meanwhile
  (docs/design.md [Note: gradients on disk]).
With copies on side streams (CUDA) and the home on the host, gradients arrive asynchronously
(`GradDownloads`): every read first finishes the downloads in flight (`finish_downloads`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from offload.errors import OffloadError
from offload.optim.functional import TorchNorm, sum_of_squares
from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.records.grad_in_moments import GradInMoments
from offload.scheduler.records.held_grad import HeldGrad
from offload.scheduler.state.adamw import RestingSpan
from offload.scheduler.state.disk_store import DiskStore
from offload.scheduler.state.state_store import StateStore
from offload.tiers.copies import CopyContext, GradDownloads
from offload.tiers.grad_window import GradPool

if TYPE_CHECKING:
    from offload.scheduler.ring.record_moves import RecordMoves

Op = Tuple[int, Any, Sequence[Any], dict]  # (slot index, aten op, its other arguments, its kwargs)


class GradDiskBytes:
    """What a home moved to and from its record in the swap file (`engine.stats()`)."""

    def __init__(self) -> None:
        self.written = 0
        self.read = 0  # the first moments a rebuild reads included
        self.rested = 0  # times a gradient rested in the moments (nothing written)
        self.rebuilt = 0  # times one was rebuilt from them
        self.missed = 0  # elements the rebuilds patched in (kept by the speculative steps)


class GradOwner(Protocol):
    """The block a gradient home belongs to (block_record.py), told of torch ops on its gradients."""

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


# ----- the buffer ------------------------------------------------------------------------------------------
class FixedBuffer:
    """The flat gradient, made once: it stays for as long as the engine lives."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device,
                 downloads: Optional[GradDownloads]) -> None:
        self._numel, self._dtype, self._device, self._downloads = numel, dtype, device, downloads

    def first(self) -> Optional[Tensor]:
        return self.take(wait=True)

    def take(self, wait: bool) -> Tensor:
        if self._downloads is not None:
            return self._downloads.new_accumulator()
        return torch.zeros(self._numel, dtype=self._dtype, device=self._device)

    def give_back(self, grad: Tensor) -> bool:
        """Whether the buffer went (never: it is kept)."""
        return False

    def zero_waits_for_update(self, set_to_none: bool) -> bool:
        """Whether zeroing must wait for the block's pending update: it still reads the buffer, which zeros
        in place (set_to_none=False) would change under it."""
        return not set_to_none


class WindowBuffer:
    """A buffer from the nvme tier's gradient window: taken at the group's first gradient (`take`), given back
    once its update is done or it parks on disk (`give_back`), so host memory holds a few blocks' gradients,
    not the model's."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, downloads: Optional[GradDownloads],
                 pool: GradPool) -> None:
        self._numel, self._dtype, self._device, self._downloads = numel, dtype, device, downloads
        self.pool = pool
        self._in_host_pages = downloads is None and device.type == "cpu"  # the pool's own buffers (and spares)

    def first(self) -> Optional[Tensor]:
        return None  # taken at the first gradient

    def take(self, wait: bool) -> Tensor:
        """Zeros from the window; `wait=False` on the worker, which would wait for itself."""
        if self._in_host_pages:
            return self.pool.take_zeros(self._numel, self._dtype, wait)  # a spare's pages, or fresh ones
        self.pool.acquire(self._numel * self._dtype.itemsize, wait)
        if self._downloads is not None:
            return self._downloads.new_accumulator()
        return torch.zeros(self._numel, dtype=self._dtype, device=self._device)

    def give_back(self, grad: Tensor) -> bool:
        if self._in_host_pages:
            self.pool.give_back(grad)
        else:
            self.pool.release(grad.nbytes)
        return True

    def zero_waits_for_update(self, set_to_none: bool) -> bool:
        return True  # the update may still read the buffer, or give it back


# ----- the parking -----------------------------------------------------------------------------------------
class KeptParking:
    """The gradient waits in its buffer."""

    parks = False
    on_disk = False
    rests = False
    resting = False

    def park(self, home: "GradHome") -> None:
        pass

    def rest(self, home: "GradHome", moments: GradInMoments) -> None:
        raise AssertionError("a gradient kept in memory does not rest in the moments")

    def bring_back(self, home: "GradHome", grad: Tensor) -> None:
        pass

    def forget(self) -> None:
        pass

    def apply(self, home: "GradHome", index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        return home.apply_in_memory(index, func, args, kwargs)

    def scale_later(self, home: "GradHome", coef: float) -> bool:
        return False

    def changed(self) -> None:
        pass

    @contextlib.contextmanager
    def reading(self, home: "GradHome") -> Iterator[None]:
        yield


class DiskParking:
    """The gradient waits in its record of the swap file: written when its block is complete (`park`, on the
    worker), read back at its next use (the next micro-batch adds to the sum: torch's order; the update, the
    norms and the finiteness check read it). Torch ops on it meanwhile cost no extra trip: a read runs for every
    slot at once on one read back, an in-place op (a clip's scale) waits to be replayed in order. `moves`: the
    ring's moves of gradient records (ring/record_moves.py); `parked_range`: data-parallel with clipping, the
    rank's averaged part [lo, hi), all that is read again after its block's reduce-scatter."""

    parks = True

    def __init__(self, moves: "RecordMoves", parked_range: Optional[Tuple[int, int]] = None,
                 rests: bool = False) -> None:
        assert not (rests and parked_range is not None), "a data-parallel part does not rest in the moments"
        self._moves = moves
        self._range = parked_range
        self.rests = rests  # after a speculative update, the gradient may rest in the moments (grad_in_moments.py)
        self._moments: Optional[GradInMoments] = None  # where it rests, instead of its record
        self.on_disk = False  # the sum since `zero` is in the swap file (its record, or the moments), not in the buffer
        self._ops: List[Op] = []  # torch's in-place ops while on disk, replayed in order when it comes back
        self._results: Dict[Tuple[Any, str], List[Any]] = {}  # a read op's result per slot, for the whole group

    def park(self, home: "GradHome") -> None:
        """The buffer to the record (unless it holds no gradient), its bytes back to the window."""
        grad = home.grad
        if grad is None:
            return
        home.finish_downloads()
        self._moments = None
        if any(home.has_grad):
            parked = self._parked_view(home, grad)
            self._moves.write_from(home.group, parked)
            home.disk_bytes.written += parked.nbytes
            self.on_disk = True
        home.give_back_buffer()

    def rest(self, home: "GradHome", moments: GradInMoments) -> None:
        """After its speculative update (on the worker): the gradient rests in the moments the update wrote, its
        buffer back to the window, nothing written."""
        home.finish_downloads()
        self._moments = moments
        self.on_disk = True
        home.disk_bytes.rested += 1
        home.give_back_buffer()

    @property
    def resting(self) -> bool:
        return self.on_disk and self._moments is not None

    def bring_back(self, home: "GradHome", grad: Tensor) -> None:
        """A fresh buffer of the home: the sum read back into it (or rebuilt from the moments), when it waits on
        disk."""
        if self.on_disk:
            self._read_into(home, grad)
            self._ops.clear()  # applied: in memory from here on
            self.on_disk = False
            self._moments = None

    def forget(self) -> None:
        """What is on disk is stale (the update consumed it, or zero_grad)."""
        self.on_disk = False
        self._moments = None
        self._ops.clear()
        self._results.clear()

    def apply(self, home: "GradHome", index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        if home.grad is not None or not self.on_disk:
            self._results.clear()
            return home.apply_in_memory(index, func, args, kwargs)
        if in_place(func):
            self._ops.append((index, func, args, kwargs))
            self._results.clear()
            home.owner_grads_changed()
            return home.held[index]
        key = (func, repr((args, kwargs)))
        if key not in self._results:
            with self.reading(home):
                grad = home.grad
                assert grad is not None
                self._results[key] = [func(grad[s.offset:s.offset + s.numel].view(s.shape), *args, **kwargs)
                                      for s in home.group.trainable_slots]
        return self._results[key][index]

    def scale_later(self, home: "GradHome", coef: float) -> bool:
        """On disk, a scale waits for the sum's next read back (no extra trip)."""
        if home.grad is not None or not self.on_disk:
            return False
        self._results.clear()
        self._ops.extend((i, torch.ops.aten.mul_.Scalar, (coef,), {}) for i, has in enumerate(home.has_grad) if has)
        return True

    def changed(self) -> None:
        self._results.clear()

    @contextlib.contextmanager
    def reading(self, home: "GradHome") -> Iterator[None]:
        """A read of the gradient: a sum waiting on disk is read into a window buffer for it, and dropped after
        (the record still holds it; the waiting in-place ops stay waiting)."""
        if home.grad is not None or not self.on_disk:
            yield
            return
        with home.lock:
            grad = home.take_buffer()
            try:
                self._read_into(home, grad)
            except BaseException:
                home.give_back_buffer()  # the sum stays on disk, the buffer goes back unread
                raise
        try:
            yield
        finally:
            with home.lock:
                home.give_back_buffer()

    def _read_into(self, home: "GradHome", grad: Tensor) -> None:
        """The record into `grad` (or the gradient rebuilt from the moments it rests in), then the in-place ops
        made while it was on disk, in order."""
        if self._moments is not None:
            self._moments.rebuild_into(grad)
            home.disk_bytes.read += self._moments.bytes_read
            home.disk_bytes.rebuilt += 1
            home.disk_bytes.missed += self._moments.missed
        else:
            parked = self._parked_view(home, grad)
            self._moves.read_into(home.group, parked, _copy_staged)
            home.disk_bytes.read += parked.nbytes
        for index, func, args, kwargs in self._ops:
            slot = home.group.trainable_slots[index]
            func(grad[slot.offset:slot.offset + slot.numel].view(slot.shape), *args, **kwargs)

    def _parked_view(self, home: "GradHome", grad: Tensor) -> Tensor:
        """What parks of `grad`: all of it, or this rank's averaged part (`parked_range`)."""
        if self._range is None:
            return grad
        if home.owner is not None and not home.owner.reduced:
            raise AssertionError("a data-parallel gradient parks its part only after its block's reduce-scatter")
        lo, hi = self._range
        return grad[lo:hi]


class GradBuffer(Protocol):
    """Where the flat gradient is while in memory: `FixedBuffer` or `WindowBuffer`."""

    def first(self) -> Optional[Tensor]: ...

    def take(self, wait: bool) -> Tensor: ...

    def give_back(self, grad: Tensor) -> bool: ...

    def zero_waits_for_update(self, set_to_none: bool) -> bool: ...


class GradParking(Protocol):
    """Where the gradient waits between uses: `KeptParking` or `DiskParking`."""

    parks: bool
    on_disk: bool
    rests: bool  # whether the gradient may rest in the moments after a speculative update

    @property
    def resting(self) -> bool:
        """Whether it rests in the moments now."""

    def park(self, home: "GradHome") -> None: ...

    def rest(self, home: "GradHome", moments: GradInMoments) -> None: ...

    def bring_back(self, home: "GradHome", grad: Tensor) -> None: ...

    def forget(self) -> None: ...

    def apply(self, home: "GradHome", index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any: ...

    def scale_later(self, home: "GradHome", coef: float) -> bool: ...

    def changed(self) -> None: ...

    def reading(self, home: "GradHome") -> "contextlib.AbstractContextManager[None]": ...


# ----- the home --------------------------------------------------------------------------------------------
class GradHome:
    """The flat gradient of a group's trainable range and which of its parameters have one since `zero`.
    `device`: where it is kept (the host, or the compute device on the gpu tier); `copies`: the device's copy
    context, where gradients that leave the device for the host are counted (`off_device`); `buffer` and
    `parking`: see the module docstring (None: a `FixedBuffer`, `KeptParking`); `norms`: what takes the gradients'
    norms as torch would (one per engine: its fp32 buffer, where it needs one, is freed at the engine's close)."""

    def __init__(self, group: FlatGroup, device: torch.device, copies: CopyContext, off_device: bool,
                 padded_numel: Optional[int] = None, pool: Optional[GradPool] = None,
                 parking: Optional[DiskParking] = None, norms: Optional[TorchNorm] = None) -> None:
        n = padded_numel if padded_numel is not None else group.trainable_numel
        self.numel = n  # the trainable range, padded to whole shards in data-parallel mode (zeros beyond it)
        self.group = group
        self.device = device
        self._counted_at = copies if off_device else None  # where bytes that leave the device are counted
        self.downloads = GradDownloads(copies, n, group.dtype) if device.type == "cpu" and copies.is_async else None
        self.pool = pool  # the nvme tier's gradient window the buffer comes from (None: a buffer of its own)
        self._buffer: GradBuffer = (FixedBuffer(n, group.dtype, device, self.downloads) if pool is None else
                                    WindowBuffer(n, group.dtype, device, self.downloads, pool))
        self._parking: GradParking = parking if parking is not None else KeptParking()
        self.lock = threading.Lock()  # the buffer's taking and giving back (training thread, worker)
        self.grad: Optional[Tensor] = self._buffer.first()
        self.has_grad: List[bool] = [False] * len(group.trainable_slots)
        self.lost: Set[int] = set()  # parameters whose gradient was given back after its update
        # what each parameter's `.grad` holds while its gradient is here (held_grad.py)
        self.held = [HeldGrad(slot.param, slot.name, self, i) for i, slot in enumerate(group.trainable_slots)]
        self.owner: Optional[GradOwner] = None  # set by the block's record
        self.disk_bytes = GradDiskBytes()  # moved to and from the swap file (a disk parking's only)
        self._norms = norms if norms is not None else TorchNorm()  # the engine's, shared by its homes

    @property
    def nbytes(self) -> int:
        return 0 if self.grad is None else self.grad.nbytes

    @property
    def parks(self) -> bool:
        """Whether its gradient goes to disk when it must wait."""
        return self._parking.parks

    @property
    def on_disk(self) -> bool:
        return self._parking.on_disk

    # ----- the buffer ----------------------------------------------------------------------------------
    def buffer(self, wait: bool = True) -> Tensor:
        """The flat gradient in memory: taken from the window first if it was given back (zeros: a parameter
        with a gradient then is one zeroed with set_to_none=False), read back when it waits on disk. `wait=False`
        on the worker (it must not wait for itself)."""
        with self.lock:
            if self.grad is None:
                grad = self._buffer.take(wait)
                try:
                    self._parking.bring_back(self, grad)
                except BaseException:
                    self._buffer.give_back(grad)  # the window gets its bytes back; the sum stays where it was
                    raise
                self.grad = grad
            return self.grad

    def take_buffer(self) -> Tensor:
        """A buffer for a read back (the caller holds `lock`)."""
        self.grad = self._buffer.take(True)
        return self.grad

    def give_back_buffer(self) -> None:
        """The buffer's bytes back to the window: it parked, or a read back is done (the caller holds `lock`)."""
        if self.grad is not None and self._buffer.give_back(self.grad):
            self.grad = None

    def release(self) -> None:
        """The update has consumed the gradient: a window buffer's bytes go back (the gradients it held are
        then `lost`: torch would still have them, so adding to one, or stepping on one again, without a
        zero_grad in between raises), and what waits on disk is stale."""
        with self.lock:
            if self.grad is not None:
                self.finish_downloads()
                if self._buffer.give_back(self.grad):
                    self.grad = None
                    self.lost.update(i for i, has in enumerate(self.has_grad) if has)
                    self.has_grad = [False] * len(self.has_grad)
        self._parking.forget()

    def must_wait_to_zero(self, set_to_none: bool) -> bool:
        """Whether zeroing must wait for the block's pending update (it still reads or gives back the buffer)."""
        return self._buffer.zero_waits_for_update(set_to_none)

    def park(self) -> None:
        """The gradient waits for a later use (on the worker, once its block is complete)."""
        with self.lock:
            self._parking.park(self)

    @property
    def may_rest(self) -> bool:
        """Whether, after a speculative update, the gradient may rest in the moments it wrote (the placement
        decides: nvme tier, fp32 moments, a 16-bit gradient, one process; grad_in_moments.py)."""
        return self._parking.rests

    def rest(self, store: StateStore, spans: List[RestingSpan]) -> None:
        """After its speculative update (on the worker): the gradient rests in the moments, its buffer back."""
        assert isinstance(store, DiskStore), "only the nvme tier's records keep both first moments"
        with self.lock:
            self._parking.rest(self, GradInMoments(store, store.live_copy(), spans))

    # ----- gradients in --------------------------------------------------------------------------------
    def accumulate(self, index: int, grad: Tensor, fresh: bool = False) -> int:
        """Add one parameter's gradient into its range (a copy for the first one since `zero`, or when `fresh`:
        the parameter's `.grad` was cleared outside the engine); returns bytes moved (counted as bytes to the
        host when the gradient left the device)."""
        if fresh:
            self.has_grad[index] = False
            self.lost.discard(index)
        elif index in self.lost:
            raise released_gradient(self.group.trainable_slots[index].name)
        self._parking.changed()  # a read's results kept for the whole group are stale
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
            self._counted_at.bytes_to_host += nbytes  # a download done while adding (no copy of its own)
        return nbytes

    def finish_downloads(self) -> None:
        """Finish the gradient downloads in flight (CUDA): call before reading `grad` (any thread)."""
        if self.downloads is not None:
            self.downloads.finish_downloads()

    # ----- torch ops on the held gradients (held_grad.py) ---------------------------------------------
    def apply(self, index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        """A torch op on the gradient of slot `index`, as on the `.grad` torch would hold (clip_grad_norm_'s
        norm and scale, clip_grad_value_'s clamp: held_grad.py); an in-place one changes it here."""
        if self.owner is not None:
            self.owner.check_grads_for_torch()
        if scales_by_one(func, args):  # clip_grad_norm_ below its threshold: x * 1.0 is x, nothing to do
            return self.held[index]
        self.absorb_pending(index)
        return self._parking.apply(self, index, func, args, kwargs)

    def apply_in_memory(self, index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        if index in self.lost:
            raise released_gradient(self.group.trainable_slots[index].name)
        result = func(self._piece(index), *args, **kwargs)
        if in_place(func):
            self.owner_grads_changed()
            return self.held[index]
        return result

    def owner_grads_changed(self) -> None:
        if self.owner is not None:
            self.owner.grads_changed()

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

    # ----- zero, scale, read ------------------------------------------------------------------------------
    def forget(self, index: int) -> None:
        """The parameter's `.grad` was cleared outside the engine (model.zero_grad()): torch would not step it."""
        self.has_grad[index] = False
        self.lost.discard(index)

    def zero(self, set_to_none: bool) -> None:
        """As torch's zero_grad; each parameter's `.grad` becomes None, or stays held (zeros) for one that
        had a gradient when `set_to_none` is False (a released one comes back as zeros with the buffer)."""
        self._parking.forget()  # gone, or zeros (a buffer taken at the next use starts at zero)
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
            self.release()
            self.lost.clear()

    def scale_(self, coef: float) -> None:
        """Multiply every gradient by `coef`, as torch.nn.utils.clip_grad_norm_ does to each `.grad`."""
        if self._parking.scale_later(self, coef):
            return
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

    def norms(self, num_threads: Optional[int] = None) -> List[Tuple[nn.Parameter, float]]:
        """L2 norm of each accumulated gradient (parameters without one are left out), over `num_threads`.

        Computed with torch.linalg.vector_norm in fp32, the reduction torch.nn.utils.clip_grad_norm_ uses:
        a more exact fp64 sum differs in the last bit, and Adam amplifies that in elements whose gradient
        is rounding noise (e.g. attention key biases). See docs/design.md [Note: clipping parity]."""
        with self._parking.reading(self):
            self.finish_downloads()
            slots = [slot for index, slot in enumerate(self.group.trainable_slots) if self.has_grad[index]]
            if self.grad is None:  # zeroed with set_to_none=False after its buffer was given back
                return [(slot.param, 0.0) for slot in slots]
            grad = self.grad
            values = self._norms.norms([grad[slot.offset:slot.offset + slot.numel] for slot in slots], num_threads)
            return [(slot.param, value) for slot, value in zip(slots, values)]

    def all_finite(self, num_threads: Optional[int] = None) -> bool:
        """Whether every accumulated element is finite: one read of the gradient (2-4 B per parameter,
        against ~30 B the Adam update moves), with the update's threads. A sum waiting on disk is read back
        and kept: the update that asks reads it next."""
        if self.grad is None and self._parking.on_disk:
            self.buffer()
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


def _copy_staged(dst: Tensor, staged: Tensor) -> None:
    """A ring slot's bytes of a gradient record into the host buffer."""
    dst.copy_(staged)


def released_gradient(name: str) -> OffloadError:
    return OffloadError(
        f"the gradient of {name!r} was given back after its update (the nvme tier keeps only a window of "
        "gradients in host memory), but torch would now add to it or step on it again: call zero_grad() after "
        "every step(), or leave grad_accumulation_steps unset")


_SCALES = (torch.ops.aten.mul_.Tensor, torch.ops.aten.mul_.Scalar)


def scales_by_one(func: Any, args: Sequence[Any]) -> bool:
    """Whether an op on a held gradient is an in-place multiplication by exactly 1 (torch's clip_grad_norm_ when the
    norm is within the threshold): it changes no bit, so the gradient, its norms and a speculative update that
    read it stand."""
    if func not in _SCALES or len(args) != 1:
        return False
    factor = args[0]
    if isinstance(factor, Tensor):
        return factor.numel() == 1 and not factor.is_complex() and bool(factor.item() == 1.0)
    return isinstance(factor, (int, float)) and factor == 1.0
