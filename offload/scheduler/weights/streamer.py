"""Weight streaming: blocks whose weights do not stay on the device are fetched for each use.

The host copy of a streamed block's compute weights is the authoritative one (the update writes there).
Its device buffer keeps its tensor object; fetching re-grows its storage, copies the host copy in and
points the parameters at views of it; releasing points them at a placeholder and shrinks the storage to zero
bytes. The placeholder is one NaN expanded to the parameter's shape: the shape must stay (autograd's
AccumulateGrad shapes a new gradient after the parameter, possibly while its block is released), a view of
a zero-byte storage would crash the process when read, and NaN makes an accidental read obvious.
Parameters keep their identity throughout.
Where a group's weights live between uses, and how they are moved, is its weight home (weight_home.py:
a host mirror, or a swap-file record read through the staging ring for blocks the plan puts on disk);
this module keeps only the device budget, the LRU and the pins.
Outside the forward of the modules that own them, streamed parameters read through (read_through.py): an
operation on one opens its block first, so it reads the real weights and a write is kept.
Autograd never holds a streamed weight directly: a saved-tensor hook packs it as a handle, and unpacking
in backward fetches the block again. See docs/design.md [Note: weight streaming]. The same hook refuses a
placeholder: autograd saving one means the forward computes with a released block's weights, read outside
the modules that own them ([Note: reading streamed weights outside their module]).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch
from torch import Tensor

from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block, FlatGroup, ParamSlot, Residency
from offload.scheduler.torch_internals import view_base
from offload.scheduler.weights.read_through import ReadThrough
from offload.scheduler.weights.weight_home import WeightHome
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier


class PackedWeight(NamedTuple):
    """What autograd keeps instead of a streamed weight: where to find it again after a fetch."""

    block_index: int
    group: FlatGroup
    storage_offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]


class ReleaseObserver(Protocol):
    """Whoever keeps a streamed block's weights written through its parameters (records/block_record.py)."""

    def keep_writes_before_release(self) -> None: ...


@dataclass
class StreamCounts:
    """What `engine.stats()` reports of the streaming."""

    fetches: int = 0
    evictions: int = 0
    prefetches: int = 0


class WeightStreamer:
    """Fetches, pins and evicts (least recently used first) the streamed blocks within the device budget.

    A block is pinned while a module that owns it runs, while an unpacked saved weight of it is alive,
    and, when fetched during backward for a checkpoint recompute, until that backward ends. Pinned blocks
    are never evicted; when nothing can be evicted the fetch goes over budget (counted, never wrong).
    The data moves through each group's weight home (given with the block: `adopt`).
    """

    def __init__(self, device_tier: DeviceTier, copies: CopyContext) -> None:
        self._device = device_tier
        self._copies = copies
        self._blocks: Dict[int, Block] = {}
        self._homes: Dict[int, List[WeightHome]] = {}  # each streamed block's groups' homes, in group order
        self._owners: Dict[int, ReleaseObserver] = {}  # told before a block is released
        self._lru: "OrderedDict[int, None]" = OrderedDict()  # resident streamed blocks, oldest first
        self._pins: Dict[int, int] = {}
        self._in_forward: Dict[int, int] = {}  # blocks inside an owning module's forward: plain parameters
        self.read_through = ReadThrough()  # the parameters of the others read through
        self._by_storage: Dict[int, Tuple[int, FlatGroup]] = {}  # device storage address -> (block, group)
        # a released group's placeholder: its storage address -> (block, group), and group -> that address
        self._placeholders: Dict[int, Tuple[int, FlatGroup]] = {}
        self._placeholder_of: Dict[int, int] = {}
        self.counts = StreamCounts()

    @property
    def active(self) -> bool:
        return bool(self._blocks)

    def streams(self, index: int) -> bool:
        """Whether the block of this index streams (its device buffer comes and goes)."""
        return index in self._blocks

    def adopt(self, block: Block, homes: List[WeightHome], owner: "ReleaseObserver") -> None:
        """Take a block whose weight homes (one per group, in group order) hold its weights now, and release its
        device buffers; `owner` is told before each release."""
        self._blocks[block.index] = block
        self._homes[block.index] = homes
        self._owners[block.index] = owner
        for group in block.groups:
            assert group.device_buffer is not None
            self._by_storage[group.device_buffer.untyped_storage().data_ptr()] = (block.index, group)
        self._lru[block.index] = None
        self._release(block)

    # ----- use ---------------------------------------------------------------------------------------
    def ensure(self, block: Block, *, pin: bool, prefetch: Optional[Block] = None, settled: bool = True) -> None:
        """Make a streamed block resident (fetching, evicting others if needed); optionally pin it, and
        prefetch the block that comes next (`settled`: no update of it is pending, so its weights on disk
        are final and may be read ahead)."""
        if block.index not in self._blocks:
            return
        if block.residency is Residency.RELEASED:
            self._make_room(block.weight_bytes, keep=block.index)
            self._fetch(block)
        for group, home in zip(block.groups, self._homes[block.index]):
            self._copies.use_upload(group.key)  # the compute stream waits for this block's upload (a prefetch)
            home.wait_fetched()  # or for its gather (sharded weights)
        self._lru.move_to_end(block.index)
        if pin:
            self.pin(block.index)
        if prefetch is not None:
            self._prefetch(prefetch, keep=block.index, settled=settled)

    def pin(self, block_index: int) -> None:
        if block_index in self._blocks:
            self._pins[block_index] = self._pins.get(block_index, 0) + 1

    def unpin(self, block_index: int) -> None:
        if self._pins.get(block_index, 0) > 0:
            self._pins[block_index] -= 1

    def enter_forward(self, block: Block) -> None:
        """A module owning the (resident, pinned) block runs: its parameters are plain for the forward."""
        if block.index in self._blocks:
            self._in_forward[block.index] = self._in_forward.get(block.index, 0) + 1
            for slot in block.slots:
                self.read_through.unmark(slot.param)

    def leave_forward(self, block: Block) -> None:
        """The module is done: outside any owning module's forward the parameters read through again."""
        depth = self._in_forward.get(block.index, 0)
        if depth > 0:
            self._in_forward[block.index] = depth - 1
            if depth == 1:
                for slot in block.slots:
                    self.read_through.mark(slot.param)

    def block_of(self, param: Tensor) -> Optional[Block]:
        """The streamed block whose device buffer or placeholder `param` points into, if any."""
        address = param.untyped_storage().data_ptr()
        owner = self._by_storage.get(address) or self._placeholders.get(address)
        return None if owner is None else self._blocks.get(owner[0])

    def pin_views(self, tensors: List[Tensor]) -> None:
        """Each tensor that views a resident streamed block's buffer (not a parameter itself) pins the block
        while it lives: its buffer is never freed under it."""
        for tensor in tensors:
            if isinstance(tensor, torch.nn.Parameter) or tensor.layout is not torch.strided or tensor.is_meta:
                continue
            owner = self._by_storage.get(tensor.untyped_storage().data_ptr())
            if owner is not None:
                self._pin_while_alive(tensor, owner[0])

    def restore_all(self) -> None:
        """Fetch every streamed block (budget ignored) so the model works as plain PyTorch after close()."""
        self.read_through.serve(None)
        for block in self._blocks.values():
            self.invalidate(block)
            if block.residency is Residency.RELEASED:
                self._fetch(block)
            for slot in block.slots:
                self.read_through.unmark(slot.param)
        self._blocks.clear()
        self._homes.clear()
        self._owners.clear()

    def invalidate(self, block: Block) -> None:
        """An update of the block was scheduled: disk reads a prefetch started are stale; drop them. A sharded block
        gathered now and in no use is released: the update makes its gathered copy stale, and gathering it again at
        the push would only repeat what its next use does ([Note: sharded weights])."""
        if block.index not in self._blocks:
            return  # it stays resident: nothing is read ahead for it
        homes = self._homes[block.index]
        for home in homes:
            home.cancel_prefetch()
        if (block.residency is Residency.RESIDENT and all(h.partitioned for h in homes)
                and not self._pins.get(block.index, 0) and not self._in_forward.get(block.index, 0)):
            self._release(block)

    # ----- saved-tensor hooks ------------------------------------------------------------------------
    def pack(self, tensor: Tensor) -> object:
        """Saved-tensor pack hook: a streamed weight becomes a handle, anything else stays as it is; a
        placeholder (a released block's parameter, read outside its modules) is refused by name."""
        if tensor.layout is not torch.strided or tensor.is_meta:
            return tensor
        address = tensor.untyped_storage().data_ptr()
        owner = self._by_storage.get(address)
        if owner is None:
            released = self._placeholders.get(address)
            if released is not None:
                raise self._read_outside_its_module(tensor, self._blocks[released[0]], released[1])
            # [Note: a kept saved tensor is detached] (activations/spill.py): a node's own output returned
            # as it is would keep a graph that is never backwarded alive forever
            return tensor.detach() if tensor.grad_fn is not None else tensor
        return PackedWeight(owner[0], owner[1], int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()))

    def unpack(self, packed: object) -> Tensor:
        """Saved-tensor unpack hook: fetch the block again and pin it while the returned view lives (after
        `restore_all`, a graph built before close() reads the restored buffer, which stays)."""
        if not isinstance(packed, PackedWeight):
            return packed  # type: ignore[return-value]
        buffer = packed.group.device_buffer
        assert buffer is not None
        block = self._blocks.get(packed.block_index)
        if block is None:
            return buffer.as_strided(packed.shape, packed.stride, packed.storage_offset)
        self.ensure(block, pin=True)
        view = buffer.as_strided(packed.shape, packed.stride, packed.storage_offset)
        weakref.finalize(view, self.unpin, block.index)  # the pin ensure() took
        return view

    def _pin_while_alive(self, view: Tensor, block_index: int) -> None:
        self.pin(block_index)
        weakref.finalize(view, self.unpin, block_index)

    # ----- moves -------------------------------------------------------------------------------------
    def _fetch(self, block: Block, ahead: bool = False) -> None:
        """Make the block resident; `ahead` (a prefetch): a gather may still be running at return (`ensure` waits)."""
        self._device.reserve(block.weight_bytes, f"block {block.name!r}", over_budget_ok=True)
        for group, home in zip(block.groups, self._homes[block.index]):
            assert group.device_buffer is not None
            self._device.regrow(group.device_buffer, group.numel)
            storage = group.device_buffer.untyped_storage()
            with torch.no_grad():
                home.fetch(ahead)
            self._by_storage[storage.data_ptr()] = (block.index, group)
            group.point_params_at(group.device_buffer)
            placeholder = self._placeholder_of.pop(id(group), None)
            if placeholder is not None:  # it is freed now: its address may come back for any tensor
                del self._placeholders[placeholder]
        block.move_to(Residency.RESIDENT)
        self._lru[block.index] = None
        self.counts.fetches += 1

    def _release(self, block: Block) -> None:
        self._owners[block.index].keep_writes_before_release()  # written through a parameter since its last use
        for home in self._homes[block.index]:
            home.wait_fetched()  # a gather started ahead writes into the buffer until it is done
        for group in block.groups:
            assert group.device_buffer is not None
            storage = group.device_buffer.untyped_storage()
            self._by_storage.pop(storage.data_ptr(), None)
            fill = float("nan") if group.dtype.is_floating_point else 0
            one = group.device_buffer.new_full((1,), fill)
            for slot in group.slots:
                slot.param.data = one.reshape([1] * len(slot.shape)).expand(slot.shape)
                self.read_through.mark(slot.param)
            address = one.untyped_storage().data_ptr()  # alive while the parameters point at it
            self._placeholders[address] = (block.index, group)
            self._placeholder_of[id(group)] = address
            self._device.shrink(group.device_buffer)
        self._device.unreserve(block.weight_bytes)
        block.move_to(Residency.RELEASED)
        self._lru.pop(block.index, None)

    def _make_room(self, nbytes: int, keep: int) -> None:
        for index in list(self._lru):
            if self._device.fits(nbytes):
                return
            if index != keep and self._pins.get(index, 0) == 0:
                self._release(self._blocks[index])
                self.counts.evictions += 1

    def _prefetch(self, following: Block, keep: int, settled: bool) -> None:
        if following.index not in self._blocks:
            return
        if following.residency is not Residency.RELEASED:
            return
        homes = self._homes[following.index]
        if any(home.reads_ahead_from_disk for home in homes):
            # overlaps this block's compute; the fetch finishes it. Not while an update may still write them.
            if settled and all(home.prefetch() for home in homes):
                self.counts.prefetches += 1
            return
        self._make_room(following.weight_bytes, keep=keep)
        if self._device.fits(following.weight_bytes):
            self._fetch(following, ahead=True)
            self.counts.prefetches += 1

    @staticmethod
    def _read_outside_its_module(tensor: Tensor, block: Block, group: FlatGroup) -> OffloadError:
        """The error for a placeholder autograd was about to save, naming the parameter when it can tell."""
        slot = _slot_of(tensor, group)
        what = (f"parameter {slot.name!r} of block {block.name!r}" if slot is not None else
                f"a parameter of block {block.name!r} ({', '.join(repr(s.name) for s in group.slots[:4])}"
                f"{', ...' if len(group.slots) > 4 else ''})")
        return OffloadError(
            f"the forward computes with {what} outside the modules that own it, while that block is streamed out "
            "(device_memory is smaller than the weights): there its value is a NaN placeholder, and only a forward "
            "of a module that owns the parameter makes it resident. Use a streamed block's parameters only inside "
            "a module that owns them: call the module (module(x), not module.forward(x)); for a tied output head "
            "written by hand (F.linear(h, self.emb.weight)) make the head an nn.Linear whose weight is the "
            "embedding's parameter (head.weight = emb.weight) and call it, so both owners are hooked; or give "
            f"device_memory room to keep block {block.name!r} resident. See docs/design.md [Note: reading "
            "streamed weights outside their module]")


def _slot_of(tensor: Tensor, group: FlatGroup) -> Optional[ParamSlot]:
    """The parameter `tensor` is (or is a view of), else the only one of its shape (or transposed)."""
    base = view_base(tensor)
    for slot in group.slots:
        if base is slot.param:
            return slot
    shape = tuple(tensor.shape)
    alike = [s for s in group.slots if tuple(s.shape) in (shape, shape[::-1])]
    return alike[0] if len(alike) == 1 else None

