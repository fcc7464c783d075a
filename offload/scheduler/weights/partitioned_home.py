"""Sharded weights (`shard_weights`, ZeRO-3): a flat group's weight home that keeps only this rank's part.

Each rank keeps elements `[a, b)` of every group (`DataParallel.weight_part`) in host memory (`HostPart`) or in its
own swap file (`DiskPart`); the device holds the whole group only while a module computes with it: a fetch reads
the rank's part and all-gathers the others' into the device buffer (`DataParallel.gather_weights`, on the training
thread's own process group, in the same order on every rank: the forward order, the backward's unpacks, a
checkpoint's walk). The rank's state part is the trainable elements of `[a, b)`, so its update writes the new
weights of its own part, where they live (the host part, or the swap file through the ring's chunks), and
nothing is gathered after an update: the next fetch gathers the new weights. See docs/design.md
[Note: sharded weights].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, cast

import torch
from torch import Tensor

from offload.distributed.data_parallel import DataParallel, Shard
from offload.distributed.gather_check import READ, USE
from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.state.state_store import StateStore
from offload.scheduler.weights.weight_home import UpdateOwner, UpdateSharing

if TYPE_CHECKING:
    from offload.scheduler.ring.record_moves import PieceRead, RecordMoves


class WeightPart:
    """A rank's part `[a, b)` of a flat group, as the swap file's weight record and the ring see a group: the group's
    key and dtype, `numel` elements."""

    def __init__(self, group: FlatGroup, part: Shard) -> None:
        self.key = group.key
        self.dtype = group.dtype
        self.numel = part.numel


class PartKeeper(Protocol):
    """Where a rank's part lives between uses."""

    reads_ahead_from_disk: bool

    def update_target(self, trainable: int) -> Optional[Tensor]: ...

    shadow: Optional[Tensor]  # where a speculative update writes (`add_shadow`); None for a part on disk

    def add_shadow(self, trainable: int) -> None: ...

    def commit_shadow(self) -> None: ...

    def read(self) -> Tensor: ...

    def write(self, part: Tensor) -> None: ...

    def prefetch(self) -> bool: ...

    def cancel_prefetch(self) -> None: ...


class HostPart:
    """The part in host memory: the update writes it in place."""

    reads_ahead_from_disk = False

    def __init__(self, part: Tensor) -> None:
        self.host = part.detach().to("cpu", copy=True)
        self.shadow: Optional[Tensor] = None

    def update_target(self, trainable: int) -> Optional[Tensor]:
        return self.host[:trainable]

    def add_shadow(self, trainable: int) -> None:
        self.shadow = torch.empty(trainable, dtype=self.host.dtype)

    def commit_shadow(self) -> None:
        assert self.shadow is not None
        self.host[:self.shadow.numel()].copy_(self.shadow)

    def read(self) -> Tensor:
        return self.host

    def write(self, part: Tensor) -> None:
        self.host.copy_(part)

    def prefetch(self) -> bool:
        return False  # the streamer fetches (gathers) host parts ahead itself, within the device budget

    def cancel_prefetch(self) -> None:
        pass


class DiskPart:
    """The part in the rank's swap file (a weight record of the part's size): the update writes its new weights
    there through the ring's chunks; a prefetch starts the disk reads, the fetch finishes them."""

    reads_ahead_from_disk = True

    def __init__(self, part: WeightPart, weights: "RecordMoves", initial: Tensor) -> None:
        self._part = part
        self._record = cast(FlatGroup, part)  # the ring and the swap file read its key, dtype and numel only
        self._disk = weights
        self._read_ahead: Optional[List["PieceRead"]] = None
        self.shadow: Optional[Tensor] = None  # the record's shadow copy is the swap file's
        weights.write_from(self._record, initial.detach().to("cpu"))

    def update_target(self, trainable: int) -> Optional[Tensor]:
        return None  # the store's chunks carry the new weights to the record

    def add_shadow(self, trainable: int) -> None:
        pass

    def commit_shadow(self) -> None:
        self.cancel_prefetch()  # a read ahead read the copy that is now the shadow

    def read(self) -> Tensor:
        out = torch.empty(self._part.numel, dtype=self._part.dtype)
        handle, self._read_ahead = self._read_ahead, None
        if handle:
            self._disk.finish_read(handle, out, _copy)
        else:
            self._disk.read_into(self._record, out, _copy)
        return out

    def write(self, part: Tensor) -> None:
        self.cancel_prefetch()  # reads a prefetch started would return the old weights
        self._disk.write_from(self._record, part.to(self._part.dtype).contiguous())

    def prefetch(self) -> bool:
        if self._read_ahead is None:
            self._read_ahead = self._disk.start_read(self._record, self._part.dtype.itemsize)
        return self._read_ahead is not None

    def cancel_prefetch(self) -> None:
        handle, self._read_ahead = self._read_ahead, None
        if handle:
            self._disk.cancel_read(handle)


class PartitionedHome:
    """The `WeightHome` of a sharded group (see the module docstring)."""

    pushes = True
    partitioned = True
    speculates_in_params = False

    def __init__(self, group: FlatGroup, part: Shard, state_shard: Optional[Shard], dp: DataParallel,
                 keeper: PartKeeper) -> None:
        assert group.device_buffer is not None
        self._group = group
        self._part = part
        self._dp = dp
        self._keeper = keeper
        self._trainable = 0 if state_shard is None else state_shard.numel
        self.target_base = 0 if state_shard is None else state_shard.lo  # the update's element 0 is the part's
        self.reads_ahead_from_disk = keeper.reads_ahead_from_disk
        self._gathering: Optional[Callable[[], None]] = None  # a gather started ahead (`fetch(ahead=True)`)
        self.gathers = 0  # for engine.stats(): gathers made, and the other ranks' bytes they brought
        self.bytes_gathered = 0
        self.bytes_gathered_for_compute = 0  # of those, the gathers' for a forward or backward (not reads)
        # hpZ (zero_hpz_partition_size): this rank's secondary part, cut from the first gather after the weights
        # changed (a forward's), from which the next gathers (the backward's) are made within the rank's group
        secondary = dp.secondary
        self._secondary_part = None if secondary is None else secondary.part_of(group.numel, dp.rank)
        self._secondary: Optional[Tensor] = None  # current while not None

    @property
    def secondary_nbytes(self) -> int:
        """Host bytes hpZ's secondary part takes between a forward and the next update (0 without hpZ)."""
        part = self._secondary_part
        return 0 if part is None else part.size * self._group.dtype.itemsize

    def update_target(self) -> Optional[Tensor]:
        self._secondary = None  # the update writes new weights: the next gather is a whole one again
        return self._keeper.update_target(self._trainable)

    def release_source(self) -> None:
        pass  # a gather reads the part synchronously

    @property
    def shadow_nbytes(self) -> int:
        shadow = self._keeper.shadow
        return 0 if shadow is None else shadow.nbytes

    def add_shadow(self) -> None:
        self._keeper.add_shadow(self._trainable)

    def shadow_target(self) -> Optional[Tensor]:
        return self._keeper.shadow

    def commit_shadow(self) -> None:
        self.wait_fetched()  # a gather started ahead read the part
        self._secondary = None
        self._keeper.commit_shadow()

    def forget_shadow(self, live: StateStore) -> None:
        pass  # the part's shadow (a host tensor, or the record's other copy) is written whole before it is read

    def push(self, resident: bool) -> None:
        if resident:
            self.fetch()  # the device copy is stale: gather the new weights (every rank pushes the same block)

    def before_prefetch(self, owner: UpdateOwner) -> None:
        """Its update in first, so the gather ahead brings the new weights and the push after the update has
        nothing left to gather (one gather a use; the same wait on every rank)."""
        owner.settle(counted=True)

    def share_update(self, sharing: UpdateSharing, state: Any, out: Optional[Tensor]) -> None:
        pass  # each rank wrote its own part: the next fetch gathers every rank's

    def fetch(self, ahead: bool = False) -> None:
        """Gather the whole group into its device buffer; `ahead` (a prefetch): started, finished by `wait_fetched`
        when the block is used (its forward computes meanwhile)."""
        self.wait_fetched()
        buffer = self._group.device_buffer
        assert buffer is not None
        with torch.no_grad():
            if self._secondary is not None:  # hpZ: within the rank's group (the same decision on every rank)
                assert self._secondary_part is not None
                self._dp.gather_secondary(buffer, self._secondary.to(buffer.device), self._secondary_part)
                nbytes = (self._secondary_part.world - 1) * self._secondary_part.size * self._group.dtype.itemsize
                self.gathers += 1
                self.bytes_gathered += nbytes
                self.bytes_gathered_for_compute += nbytes
                return
            self._gathering = self._dp.gather_weights(buffer, self._keeper.read().to(buffer.device), self._part,
                                                      async_op=ahead, key=self._group.key)
            if self._secondary_part is not None:
                self._gathering = self._keep_secondary(self._gathering)
        self._count_gather(USE)

    def _keep_secondary(self, gathering: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """Once the gather into the device buffer is done, keep this rank's secondary part of it (hpZ)."""
        def finish() -> None:
            if gathering is not None:
                gathering()
            part, buffer = self._secondary_part, self._group.device_buffer
            assert part is not None and buffer is not None
            kept = torch.zeros(part.size, dtype=buffer.dtype)
            kept[:part.numel].copy_(buffer[part.lo:part.hi])
            self._secondary = kept

        if gathering is not None:
            return finish
        finish()
        return None

    def wait_fetched(self) -> None:
        gathering, self._gathering = self._gathering, None
        if gathering is not None:
            gathering()

    def host_weights(self) -> Tensor:
        """The whole group's weights on the host: a gather, so every rank calls it for the same group."""
        self.wait_fetched()
        assert self._group.device_buffer is not None
        whole = torch.empty(self._group.numel, dtype=self._group.dtype, device=self._group.device_buffer.device)
        self._dp.gather_weights(whole, self._keeper.read().to(whole.device), self._part, key=self._group.key, kind=READ)
        self._count_gather(READ)
        return whole.to("cpu")

    def _count_gather(self, kind: int) -> None:
        nbytes = self._dp.gathered_nbytes(self._part, self._group.dtype.itemsize, kind)
        self.gathers += 1
        self.bytes_gathered += nbytes
        if kind == USE:
            self.bytes_gathered_for_compute += nbytes

    def replace(self, flat: Tensor, resident: bool) -> None:
        self.wait_fetched()
        self._secondary = None
        self._keeper.write(flat[self._part.lo:self._part.hi].to("cpu"))
        if resident:
            assert self._group.device_buffer is not None
            self._group.device_buffer.copy_(flat)

    def prefetch(self) -> bool:
        return self._keeper.prefetch()

    def cancel_prefetch(self) -> None:
        self._keeper.cancel_prefetch()


def _copy(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src)
