"""Where one flat group's compute weights live between uses: one home object per group.

- `DeviceHome`: on the device only (the usual case when they fit, and always when the CPU computes with
  the state on the host): the update writes the device buffer itself.
- `HostMirror`: a (pinned on CUDA) host copy the update writes and the device is fed from: the whole
  group for a streamed block (the host copy is then the authoritative one, fetched at each use), or only
  the trainable range of a resident block whose state is on the host of a CUDA machine (an upload source).
- `DiskHome`: the nvme tier's blocks the plan puts on disk: the weights live in the swap file, the update
  writes them there through the ring (the store's chunk weights), and every fetch reads them back.
- `MasterHome`: the same blocks with no copy of their weights on disk (`disk_weights="master"`): every fetch reads
  the fp32 master from the state record and casts it.

Callers need only these operations: where the update writes (`update_target`), bring the updated weights
to the device (`push`) or all of them into a regrown buffer (`fetch`), read the current ones on the host
(`host_weights`), replace them (`replace`, a checkpoint load). Residency, the budget and the LRU are the
streamer's (streamer.py); CUDA events are the copy context's (tiers/copies.py).

A speculative update ([Note: speculative clipping]) writes its new weights where nothing reads them: a shadow in
host memory (`add_shadow`, `shadow_target`), or, for weights on disk, the record's shadow copy through the store's
chunks; `commit_shadow` makes them the weights. One home writes them in place instead: the CPU's own weights of a
resident block, when this process holds the whole master (`DeviceHome`): a dropped speculation puts the live weights
back from the live master (`forget_shadow`), and the block's parameters are guarded meanwhile
(`speculates_in_params`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol

import torch
from torch import Tensor

from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.state.state_store import StateStore, weights_from_master
from offload.tiers.copies import CopyContext

if TYPE_CHECKING:
    from offload.scheduler.ring.master_reads import MasterReads
    from offload.scheduler.ring.record_moves import PieceRead, RecordMoves


class WeightHome(Protocol):
    """The operations every home offers; `resident` says whether the group's device buffer holds data."""

    pushes: bool  # an update writes elsewhere than the device buffer: `push` must follow it
    reads_ahead_from_disk: bool  # a prefetch starts disk reads (`prefetch`) instead of a fetch
    partitioned: bool  # it keeps this rank's part only (sharded weights), gathered whole for each use
    target_base: int  # the group element that `update_target()`'s element 0 is
    speculates_in_params: bool  # a speculative update writes the weights the parameters show (guard them)

    def update_target(self) -> Optional[Tensor]: ...

    def release_source(self) -> None: ...

    def push(self, resident: bool) -> None: ...

    @property
    def shadow_nbytes(self) -> int:
        """Host bytes a shadow of the trainable weights takes (0: they live on disk, the record's shadow copy)."""

    def add_shadow(self) -> None: ...

    def shadow_target(self) -> Optional[Tensor]:
        """Where a speculative update writes the new weights (laid out as `update_target()`); None: the store's
        chunks carry them to the shadow copy on disk."""

    def commit_shadow(self) -> None:
        """The speculative update's weights become the weights (the caller pushes them to the device after)."""

    def forget_shadow(self, live: StateStore) -> None:
        """The speculative update's weights are dropped (the worker is done with them); `live`: the group's state,
        whose master weights (never touched by a speculation) the live weights are a cast of."""

    def fetch(self, ahead: bool = False) -> None: ...

    def wait_fetched(self) -> None: ...

    def host_weights(self) -> Tensor: ...

    def replace(self, flat: Tensor, resident: bool) -> None: ...

    def prefetch(self) -> bool: ...

    def cancel_prefetch(self) -> None: ...

    def before_prefetch(self, owner: "UpdateOwner") -> None:
        """The block before its block in the forward is about to fetch it ahead."""

    def share_update(self, sharing: "UpdateSharing", state: Any, out: Optional[Tensor]) -> None:
        """After an update wrote `out` (this rank's part of `state`): the other data-parallel ranks get it."""


class DiskReads(Protocol):
    """Where a disk home's fetches read: the weight record (ring/record_moves.py) or the master (ring/master_reads.py)."""

    def read_into(self, group: FlatGroup, dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None: ...

    def start_read(self, group: FlatGroup, itemsize: int) -> Optional[List["PieceRead"]]: ...

    def finish_read(self, handle: List["PieceRead"], dst: Tensor, copy: Callable[[Tensor, Tensor], None]) -> None: ...

    def cancel_read(self, handle: List["PieceRead"]) -> None: ...


class UpdateOwner(Protocol):
    """The block record a home belongs to (records/block_record.py)."""

    def settle(self, counted: bool = False) -> None: ...


class UpdateSharing(Protocol):
    """How new weights reach the other data-parallel ranks (modes/reduction.py; nothing in one process)."""

    def send_new_weights(self, state: Any, out: Optional[Tensor]) -> None: ...


class WholeWeights:
    """What the homes of whole weights share: a fetch ahead reads what is at home (nothing to wait for), every
    rank's new part of an update is gathered into each rank's weights at once, and a speculative update's weights
    wait in a shadow of the trainable range (copied in when committed)."""

    _shadow: Optional[Tensor] = None
    speculates_in_params = False

    def before_prefetch(self, owner: UpdateOwner) -> None:
        pass

    def share_update(self, sharing: UpdateSharing, state: Any, out: Optional[Tensor]) -> None:
        sharing.send_new_weights(state, out)

    @property
    def shadow_nbytes(self) -> int:
        return 0 if self._shadow is None else self._shadow.nbytes

    def shadow_target(self) -> Optional[Tensor]:
        assert self._shadow is not None, "no shadow: the plan gave this group none"
        return self._shadow

    def forget_shadow(self, live: StateStore) -> None:
        pass  # nothing reads a shadow before the next speculative update writes it whole


class DeviceHome(WholeWeights):
    """Weights on the compute device only.

    A speculative update of a block whose whole master this process holds (`whole_state`: one process) writes
    these weights in place, with nothing to allocate or copy at the commit: the weights are a cast of the master,
    which the speculation never touches, so a dropped one is put back from it, and the block's parameters read
    through the pending guard until step() decides (a read first drops the speculation: torch shows the weights
    before the step there). Only the CPU computing speculates into a device home (a GPU's updates write a host
    mirror); a data-parallel rank holds a part of the master only, so its shadow is a second buffer."""

    pushes = False
    reads_ahead_from_disk = False
    partitioned = False
    target_base = 0

    def __init__(self, group: FlatGroup, whole_state: bool) -> None:
        assert group.device_buffer is not None
        self._group = group
        self._buffer = group.device_buffer
        self._whole_state = whole_state
        self.speculates_in_params = False

    def update_target(self) -> Optional[Tensor]:
        return self._buffer[:self._group.trainable_numel]

    def release_source(self) -> None:
        pass

    def push(self, resident: bool) -> None:
        pass

    def add_shadow(self) -> None:
        if self._whole_state:
            self.speculates_in_params = True
        else:
            self._shadow = torch.empty(self._group.trainable_numel, dtype=self._group.dtype,
                                       device=self._buffer.device)

    def shadow_target(self) -> Optional[Tensor]:
        return self.update_target() if self.speculates_in_params else super().shadow_target()

    def commit_shadow(self) -> None:
        if self.speculates_in_params:
            return  # written in place
        assert self._shadow is not None
        with torch.no_grad():
            self._buffer[:self._group.trainable_numel].copy_(self._shadow)

    def forget_shadow(self, live: StateStore) -> None:
        if self.speculates_in_params:
            weights_from_master(live, self._buffer[:self._group.trainable_numel])

    def fetch(self, ahead: bool = False) -> None:
        raise AssertionError("a block whose weights stay on the device is never fetched")

    def wait_fetched(self) -> None:
        pass

    def host_weights(self) -> Tensor:
        return self._buffer.detach().to("cpu")

    def replace(self, flat: Tensor, resident: bool) -> None:
        self._buffer.copy_(flat)

    def prefetch(self) -> bool:
        return False

    def cancel_prefetch(self) -> None:
        pass


class HostMirror(WholeWeights):
    """A host copy the update writes; uploads (asynchronous on CUDA, see [Note: CUDA streams]) feed the device.
    `whole`: the copy holds the whole group and is the authoritative one (a streamed block); else only the
    trainable range, next to device weights that stay resident."""

    pushes = True
    reads_ahead_from_disk = False
    partitioned = False
    target_base = 0

    def __init__(self, group: FlatGroup, copies: CopyContext, whole: bool) -> None:
        assert group.device_buffer is not None
        self._group = group
        self._copies = copies
        self._whole = whole
        numel = group.numel if whole else group.trainable_numel
        self.host = copies.empty_host(numel, group.dtype)  # pinned on CUDA: uploads read it asynchronously
        self.host.copy_(group.device_buffer[:numel])

    def update_target(self) -> Optional[Tensor]:
        return self.host[:self._group.trainable_numel]

    def release_source(self) -> None:
        """Block until the last upload has read the host copy (before anything overwrites it)."""
        self._copies.release_source(self._group.key)

    def add_shadow(self) -> None:
        """A whole copy is what the next fetch and every read of the weights take: it needs a shadow. The upload
        source of a resident block is read only by the upload after an update, which a speculative update does not
        make before it is committed: the speculation may write it in place (nothing to allocate or copy)."""
        if self._whole:
            self._shadow = self._copies.empty_host(self._group.trainable_numel, self._group.dtype)

    def shadow_target(self) -> Optional[Tensor]:
        return self._shadow if self._whole else self.update_target()

    def commit_shadow(self) -> None:
        if not self._whole:
            return  # written in place; the push that follows the commit uploads it
        assert self._shadow is not None
        self.release_source()
        self.host[:self._group.trainable_numel].copy_(self._shadow)

    def forget_shadow(self, live: StateStore) -> None:
        """A resident block's upload source holds the dropped update's weights: the device's (the live ones) go
        back in, since the next push uploads the whole trainable range, also parameters a later update skips."""
        if not self._whole:
            n = self._group.trainable_numel
            assert self._group.device_buffer is not None
            self.host[:n].copy_(self._group.device_buffer[:n])

    def push(self, resident: bool) -> None:
        if resident:
            n = self._group.trainable_numel
            assert self._group.device_buffer is not None
            self._copies.upload(self._group.key, self._group.device_buffer[:n], self.host[:n])
        self._copies.use_upload(self._group.key)  # the compute stream waits for it

    def fetch(self, ahead: bool = False) -> None:
        assert self._whole and self._group.device_buffer is not None
        self._copies.upload(self._group.key, self._group.device_buffer, self.host)

    def wait_fetched(self) -> None:
        pass  # the compute stream waits for the upload (`CopyContext.use_upload`)

    def host_weights(self) -> Tensor:
        if self._whole:
            return self.host
        assert self._group.device_buffer is not None
        return self._group.device_buffer.detach().to("cpu")

    def replace(self, flat: Tensor, resident: bool) -> None:
        self.release_source()  # an upload may still read the host copy
        self.host.copy_(flat[:self.host.numel()])
        if resident or not self._whole:
            assert self._group.device_buffer is not None
            self._group.device_buffer.copy_(flat)

    def prefetch(self) -> bool:
        return False  # the streamer fetches host-mirrored blocks ahead itself, within the budget

    def cancel_prefetch(self) -> None:
        pass


class DiskHome(WholeWeights):
    """Compute weights in the swap file, moved disk -> staging slot -> device slot by slot. A prefetch starts
    the disk reads ahead (`prefetch`), the next fetch or push finishes them; an update of the block makes
    them stale (`cancel_prefetch`)."""

    pushes = True
    reads_ahead_from_disk = True
    partitioned = False
    target_base = 0

    def __init__(self, group: FlatGroup, weights: "RecordMoves", copies: CopyContext) -> None:
        assert group.device_buffer is not None
        self._group = group
        self._disk: DiskReads = weights  # the ring's weight moves (ring/record_moves.py)
        self._copies = copies
        self._read_ahead: Optional[list] = None  # the ring's handle of reads a prefetch started
        weights.write_from(group, group.device_buffer.to("cpu"))
        self._weights = weights

    def update_target(self) -> Optional[Tensor]:
        return None  # the update writes the new weights into the store's chunks, and the ring to disk

    def release_source(self) -> None:
        pass

    def add_shadow(self) -> None:
        pass  # the weight record's shadow copy is the swap file's (the state store flips both)

    def shadow_target(self) -> Optional[Tensor]:
        return None

    def commit_shadow(self) -> None:
        self.cancel_prefetch()  # a read ahead read the copy that is now the shadow

    def push(self, resident: bool) -> None:
        if resident:
            self.fetch()
        self._copies.use_upload(self._group.key)

    def wait_fetched(self) -> None:
        pass  # the compute stream waits for the upload (`CopyContext.use_upload`)

    def fetch(self, ahead: bool = False) -> None:
        buffer = self._group.device_buffer
        assert buffer is not None
        handle, self._read_ahead = self._read_ahead, None
        with torch.no_grad():
            if handle:
                self._disk.finish_read(handle, buffer, self._copies.to_device)
            else:
                self._disk.read_into(self._group, buffer, self._copies.to_device)

    def host_weights(self) -> Tensor:
        weights = torch.empty(self._group.numel, dtype=self._group.dtype)
        self._disk.read_into(self._group, weights, _host_copy)
        return weights

    def replace(self, flat: Tensor, resident: bool) -> None:
        self.cancel_prefetch()  # reads a prefetch started would return the old weights
        self._weights.write_from(self._group, flat.to(self._group.dtype).contiguous())
        if resident:
            assert self._group.device_buffer is not None
            self._group.device_buffer.copy_(flat)

    def prefetch(self) -> bool:
        """Start the disk reads of the weights without blocking; False when the ring has no slots to spare."""
        if self._read_ahead is None:
            assert self._group.device_buffer is not None
            self._read_ahead = self._disk.start_read(self._group, self._group.device_buffer.element_size())
        return self._read_ahead is not None

    def cancel_prefetch(self) -> None:
        handle, self._read_ahead = self._read_ahead, None
        if handle:
            self._disk.cancel_read(handle)


class MasterHome(DiskHome):
    """Weights on disk with no copy of their own ([Note: weights from the master]): every fetch, prefetch and read
    of them reads the group's fp32 master from its state record and casts it, which is the cast an update makes, so
    the weights are the same bits as a copy's. Whatever sets the weights sets the master: an update (a speculative
    one its shadow copy, live once committed: reads ahead are dropped then), a checkpoint load (the master from the
    checkpoint), a write through the parameters (`overwrite_master`). Only a group whose every parameter trains
    has a master for each element; the plan keeps a copy for the others."""

    def __init__(self, group: FlatGroup, masters: "MasterReads", copies: CopyContext) -> None:
        assert group.device_buffer is not None and group.trainable_numel == group.numel
        self._group = group
        self._disk = masters  # the state store wrote the master when it was made: nothing to write here
        self._copies = copies
        self._read_ahead = None

    def replace(self, flat: Tensor, resident: bool) -> None:
        """The caller writes the master as well (a checkpoint load's masters, `overwrite_master`): fetches read it
        there; the device buffer takes the weights now when the block is resident."""
        self.cancel_prefetch()  # reads a prefetch started would return the old master
        if resident:
            assert self._group.device_buffer is not None
            self._group.device_buffer.copy_(flat)


def _host_copy(dst: Tensor, src: Tensor) -> None:
    """A staging slot's bytes into a host tensor (the weights read back for a checkpoint or an export)."""
    dst.copy_(src)
