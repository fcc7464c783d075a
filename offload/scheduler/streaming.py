"""Weight streaming: blocks whose weights do not stay on the device are fetched for each use.

The host copy of a streamed block's compute weights is the authoritative one (the update writes there).
Its device buffer keeps its tensor object; fetching re-grows its storage, copies the host copy in and
points the parameters at views of it; releasing points them at a placeholder and shrinks the storage to zero
bytes. The placeholder is one NaN expanded to the parameter's shape: the shape must stay (autograd's
AccumulateGrad shapes a new gradient after the parameter, possibly while its block is released), a view of
a zero-byte storage would crash the process when read, and NaN makes an accidental read obvious.
Parameters keep their identity throughout.
A block the plan puts on disk has no host copy: its weights live in the swap file and every fetch reads them
through the staging ring (`DiskWeights`, the nvme tier's DiskRing); the optimizer writes the new ones there.
Autograd never holds a streamed weight directly: a saved-tensor hook packs it as a handle, and unpacking
in backward fetches the block again. See docs/design.md [Note: weight streaming].
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Protocol, Tuple

import torch
from torch import Tensor

from offload.scheduler.block import Block, FlatGroup, Residency
from offload.scheduler.streams import CopyContext
from offload.tiers.device import DeviceTier


class PackedWeight(NamedTuple):
    """What autograd keeps instead of a streamed weight: where to find it again after a fetch."""

    block_index: int
    group: FlatGroup
    storage_offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]


class DiskWeights(Protocol):
    """Where disk-resident compute weights are read and written (offload.scheduler.disk_ring.DiskRing)."""

    def read_weights(self, group: FlatGroup, dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None: ...

    def write_weights(self, group: FlatGroup, src: Tensor) -> None: ...

    def start_weights_read(self, group: FlatGroup, itemsize: int) -> Optional[list]: ...

    def finish_weights_read(self, handle: list, dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None: ...

    def cancel_weights_read(self, handle: list) -> None: ...


class WeightStreamer:
    """Fetches, pins and evicts (least recently used first) the streamed blocks within the device budget.

    A block is pinned while a module that owns it runs, while an unpacked saved weight of it is alive,
    and, when fetched during backward for a checkpoint recompute, until that backward ends. Pinned blocks
    are never evicted; when nothing can be evicted the fetch goes over budget (counted, never wrong).
    """

    def __init__(self, device_tier: DeviceTier, copies: CopyContext,
                 next_block: Callable[[Block], Optional[Block]],
                 settled: Callable[[Block], bool] = lambda block: True) -> None:
        self._disk: Optional[DiskWeights] = None
        self._on_disk: set = set()  # ids of groups whose weights live on disk
        self._reads_ahead: Dict[int, list] = {}  # id(group) -> disk reads started by a prefetch
        self._settled = settled  # no update of the block pending: its weights on disk are final
        self._device = device_tier
        self._copies = copies
        self._next_block = next_block
        self._blocks: Dict[int, Block] = {}
        self._host: Dict[int, Tensor] = {}          # id(group) -> host copy of the group's compute weights
        self._lru: "OrderedDict[int, None]" = OrderedDict()  # resident streamed blocks, oldest first
        self._pins: Dict[int, int] = {}
        self._by_storage: Dict[int, Tuple[int, FlatGroup]] = {}  # device storage address -> (block, group)
        self.fetches = 0
        self.evictions = 0
        self.prefetches = 0

    @property
    def active(self) -> bool:
        return bool(self._blocks)

    def is_streamed(self, block: Block) -> bool:
        return block.index in self._blocks

    def adopt(self, block: Block, disk: Optional[DiskWeights] = None) -> None:
        """Take a block whose device buffers hold its weights: keep a host copy (or write them to `disk`),
        then release the device."""
        self._blocks[block.index] = block
        for group in block.groups:
            assert group.device_buffer is not None
            if disk is not None:
                self._disk = disk
                self._on_disk.add(id(group))
                disk.write_weights(group, group.device_buffer.to("cpu"))
            else:  # pinned on CUDA: uploads read it asynchronously
                self._host[id(group)] = self._copies.empty_host(group.numel, group.dtype)
                self._host[id(group)].copy_(group.device_buffer)
            self._by_storage[group.device_buffer.untyped_storage().data_ptr()] = (block.index, group)
        self._lru[block.index] = None
        self._release(block)

    def host_copy(self, group: FlatGroup) -> Optional[Tensor]:
        """The host copy the optimizer writes new weights into (and a fetch reads); None for weights on
        disk (the optimizer writes those through the ring)."""
        return self._host.get(id(group))

    # ----- use ---------------------------------------------------------------------------------------
    def ensure(self, block: Block, *, pin: bool, prefetch: bool) -> None:
        """Make a streamed block resident (fetching, evicting others if needed); optionally pin it."""
        if block.index not in self._blocks:
            return
        if block.residency is Residency.RELEASED:
            self._make_room(block.weight_bytes, keep=block.index)
            self._fetch(block)
        for group in block.groups:
            self._copies.use_upload(id(group))  # the compute stream waits for this block's upload (a prefetch)
        self._lru.move_to_end(block.index)
        if pin:
            self.pin(block.index)
        if prefetch:
            self._prefetch_after(block)

    def pin(self, block_index: int) -> None:
        if block_index in self._blocks:
            self._pins[block_index] = self._pins.get(block_index, 0) + 1

    def unpin(self, block_index: int) -> None:
        if self._pins.get(block_index, 0) > 0:
            self._pins[block_index] -= 1

    def upload(self, block: Block, group: FlatGroup) -> None:
        """Send the updated trainable weights of a resident streamed block to the device."""
        if block.residency is Residency.RESIDENT:
            assert group.device_buffer is not None
            n = group.trainable_numel
            if id(group) in self._on_disk:
                self._read_disk(group)
            else:
                self._copies.upload(id(group), group.device_buffer[:n], self._host[id(group)][:n])

    def restore_all(self) -> None:
        """Fetch every streamed block (budget ignored) so the model works as plain PyTorch after close()."""
        for block in self._blocks.values():
            if self._disk is not None:
                self.invalidate(block)
            if block.residency is Residency.RELEASED:
                self._fetch(block)
        self._blocks.clear()

    def host_weights_of(self) -> Iterable[Tuple[FlatGroup, Tensor]]:
        """(group, current weights on the host) of every streamed group; weights on disk are read."""
        for block in self._blocks.values():
            for group in block.groups:
                yield group, self.weights_of(group)

    def weights_of(self, group: FlatGroup) -> Tensor:
        """A streamed group's current weights on the host: its host copy, or a fresh read of its disk record."""
        if id(group) in self._on_disk:
            assert self._disk is not None
            weights = torch.empty(group.numel, dtype=group.dtype)
            self._disk.read_weights(group, weights, lambda dst, src: dst.copy_(src))
            return weights
        return self._host[id(group)]

    def replace_weights(self, block: Block, group: FlatGroup, flat: Tensor) -> None:
        """New weights for a streamed group (a checkpoint load): into its host copy or its disk record."""
        if id(group) in self._on_disk:
            assert self._disk is not None
            self.invalidate(block)  # reads a prefetch started would return the old weights
            self._disk.write_weights(group, flat.to(group.dtype).contiguous())
        else:
            self._copies.release_source(id(group))  # an upload may still read the host copy
            self._host[id(group)].copy_(flat)

    # ----- saved-tensor hooks ------------------------------------------------------------------------
    def pack(self, tensor: Tensor) -> object:
        """Saved-tensor pack hook: a streamed weight becomes a handle, anything else stays as it is."""
        if tensor.layout is not torch.strided or tensor.is_meta:
            return tensor
        owner = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if owner is None:
            return tensor
        return PackedWeight(owner[0], owner[1], tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))

    def unpack(self, packed: object) -> Tensor:
        """Saved-tensor unpack hook: fetch the block again and pin it while the returned view lives."""
        if not isinstance(packed, PackedWeight):
            return packed  # type: ignore[return-value]
        block = self._blocks[packed.block_index]
        self.ensure(block, pin=True, prefetch=False)
        buffer = packed.group.device_buffer
        assert buffer is not None
        view = buffer.as_strided(packed.shape, packed.stride, packed.storage_offset)
        weakref.finalize(view, self.unpin, block.index)
        return view

    # ----- moves -------------------------------------------------------------------------------------
    def _fetch(self, block: Block) -> None:
        self._device.reserve(block.weight_bytes, f"block {block.name!r}", over_budget_ok=True)
        for group in block.groups:
            assert group.device_buffer is not None
            storage = group.device_buffer.untyped_storage()
            storage.resize_(group.nbytes)
            with torch.no_grad():
                if id(group) in self._on_disk:
                    self._read_disk(group)
                else:
                    self._copies.upload(id(group), group.device_buffer, self._host[id(group)])
            self._by_storage[storage.data_ptr()] = (block.index, group)
            group.point_params_at(group.device_buffer)
        block.move_to(Residency.RESIDENT)
        self._lru[block.index] = None
        self.fetches += 1

    def _read_disk(self, group: FlatGroup) -> None:
        """disk -> host staging slot -> device, slot by slot (finishing a read a prefetch started)."""
        assert self._disk is not None and group.device_buffer is not None
        handle = self._reads_ahead.pop(id(group), None)
        with torch.no_grad():
            if handle:
                self._disk.finish_weights_read(handle, group.device_buffer, self._copies.to_device)
            else:
                self._disk.read_weights(group, group.device_buffer, self._copies.to_device)

    def invalidate(self, block: Block) -> None:
        """An update of the block was scheduled: disk reads a prefetch started are stale; drop them."""
        assert self._disk is not None or not self._reads_ahead
        for group in block.groups:
            handle = self._reads_ahead.pop(id(group), None)
            if handle and self._disk is not None:
                self._disk.cancel_weights_read(handle)

    def _start_disk_reads(self, block: Block) -> None:
        """Prefetch of a block whose weights are on disk: start its reads now, copy to the device at fetch."""
        assert self._disk is not None
        if not self._settled(block):
            return
        for group in block.groups:
            if id(group) not in self._reads_ahead:
                handle = self._disk.start_weights_read(group, group.device_buffer.element_size())
                if handle is None:
                    return
                self._reads_ahead[id(group)] = handle
        self.prefetches += 1

    def _release(self, block: Block) -> None:
        for group in block.groups:
            assert group.device_buffer is not None
            storage = group.device_buffer.untyped_storage()
            self._by_storage.pop(storage.data_ptr(), None)
            fill = float("nan") if group.dtype.is_floating_point else 0
            one = group.device_buffer.new_full((1,), fill)
            for slot in group.slots:
                slot.param.data = one.reshape([1] * len(slot.shape)).expand(slot.shape)
            storage.resize_(0)
        self._device.unreserve(block.weight_bytes)
        block.move_to(Residency.RELEASED)
        self._lru.pop(block.index, None)

    def _make_room(self, nbytes: int, keep: int) -> None:
        for index in list(self._lru):
            if self._device.fits(nbytes):
                return
            if index != keep and self._pins.get(index, 0) == 0:
                self._release(self._blocks[index])
                self.evictions += 1

    def _prefetch_after(self, block: Block) -> None:
        following = self._next_block(block)
        if following is None or following.index not in self._blocks:
            return
        if following.residency is not Residency.RELEASED:
            return
        if any(id(g) in self._on_disk for g in following.groups):
            self._start_disk_reads(following)  # overlaps this block's compute; the fetch finishes it
            return
        self._make_room(following.weight_bytes, keep=block.index)
        if self._device.fits(following.weight_bytes):
            self._fetch(following)
            self.prefetches += 1
