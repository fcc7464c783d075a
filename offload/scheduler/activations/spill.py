"""Saved activations off the compute device: the tensors autograd saves during the forward go to a file in the
swap directory, and come back, bit for bit, when the backward unpacks them (`wrap(activations="offload")`).

autograd calls `pack` for every tensor a forward saves for its backward and `unpack` when the backward needs it
(`torch.autograd.graph.saved_tensors_hooks`). `ActivationSpill.pack` hands streamed weights to the weight
streamer (they are fetched again, not saved), keeps small tensors and the model's own parameters as they are,
and copies anything else through a small aligned staging area into the activation file (O_DIRECT writes,
in flight while the forward goes on), returning a `SpilledTensor` that holds no reference to the tensor: the
forward's memory for it is freed as soon as nothing else holds it. `unpack` reads it back into a new tensor
of the same shape and dtype (contiguous, as `torch.autograd.graph.save_on_cpu` gives it back), after the
reads of the tensors the backward needs next were started (the backward unpacks in about the reverse order
of the packs). The file's space is reused once every handle of a forward is gone. See docs/design.md
[Note: activations off the device].
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
import weakref
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from offload.io import AsyncIO, SwapFile
from offload.io.future import IOFuture, wait_all

if TYPE_CHECKING:
    from offload.tiers.host import HostBuffer, StagingPool

MIN_SPILL_BYTES = 1 << 20  # smaller saved tensors stay where they are: the I/O would cost more than they hold
ALIGN = 4096
READ_AHEAD = 2  # saved tensors whose reads start before the backward asks for them


class SpilledTensor:
    """A saved tensor in the activation file: where, its shape and dtype, and its write in flight."""

    __slots__ = ("offset", "nbytes", "shape", "dtype", "device", "index", "writes", "read", "unpacked", "__weakref__")

    def __init__(self, offset: int, nbytes: int, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 index: int) -> None:
        self.offset = offset
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.index = index  # order of the pack within its forward
        self.writes: List[IOFuture] = []
        self.read: Optional[Tuple[Tensor, IOFuture]] = None  # a read started ahead: (aligned buffer, future)
        self.unpacked = False  # the backward has had it once (a read ahead skips it; a second backward reads again)


class ActivationFile:
    """The activation file of one engine: a bump allocator over a file that grows as needed, reset when no
    handle of the forwards that wrote it is alive."""

    def __init__(self, directory: str, io: AsyncIO) -> None:
        self.path = os.path.join(directory, f"offload-{os.getpid()}-{uuid.uuid4().hex[:8]}.activations")
        self._io = io
        self.file: SwapFile = io.open(self.path, size=None)
        self._lock = threading.Lock()
        self._end = 0
        self._live = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.peak_bytes = 0

    def allocate(self, nbytes: int) -> int:
        with self._lock:
            offset = self._end
            self._end += -(-nbytes // ALIGN) * ALIGN
            self._live += 1
            self.peak_bytes = max(self.peak_bytes, self._end)
            return offset

    def release(self, writes: List[IOFuture]) -> None:
        """One handle is gone (its `writes`); when none is left, the file's space is reused from the start. A
        write still in flight would land on the space after reuse: it finishes first."""
        try:
            wait_all(writes)
        except Exception:  # noqa: BLE001, S110 - nobody reads this tensor again; the space is reused anyway
            pass
        with self._lock:
            self._live -= 1
            if self._live == 0:
                self._end = 0

    def close(self) -> None:
        self.file.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ActivationSpill:
    """The saved-tensor hooks of `activations="offload"`: `pack` and `unpack` (see the module docstring).

    `keep(tensor)`: True for tensors that stay (the model's own parameters, whose storage the engine owns);
    `inner_pack` / `inner_unpack`: the weight streamer's hooks, which see every tensor first."""

    def __init__(self, directory: str, staging: "StagingPool", slot_bytes: int, slots: int,
                 keep: Callable[[Tensor], bool], inner_pack: Callable[[Tensor], object],
                 inner_unpack: Callable[[object], Tensor]) -> None:
        self._io = AsyncIO()
        self._file = ActivationFile(directory, self._io)
        self._keep = keep
        self._inner_pack, self._inner_unpack = inner_pack, inner_unpack
        self._slot_bytes = slot_bytes
        self._staging = staging
        self._slots: List[Tuple["HostBuffer", List[IOFuture]]] = [(staging.lease(slot_bytes), []) for _ in range(slots)]
        self._next_slot = itertools.cycle(range(slots))
        self._pack_index = itertools.count()
        self._by_index: "weakref.WeakValueDictionary[int, SpilledTensor]" = weakref.WeakValueDictionary()
        self.tensors_spilled = 0

    # ----- the hooks ---------------------------------------------------------------------------------
    def pack(self, tensor: Tensor) -> object:
        packed = self._inner_pack(tensor)
        if not isinstance(packed, Tensor):
            return packed  # a streamed weight's handle
        if not self._spills(tensor):
            # [Note: a kept saved tensor is detached] returning a node's own output from a pack hook makes a cycle
            # (node -> saved tensor -> its grad_fn -> node) that the collector cannot see: a graph never
            # backwarded would live forever. autograd puts the graph edge back on unpack (as save_on_cpu relies on).
            return tensor.detach() if tensor.grad_fn is not None else tensor
        source = tensor.detach().contiguous()
        nbytes = source.numel() * source.element_size()
        handle = SpilledTensor(self._file.allocate(nbytes), nbytes, tuple(tensor.shape), tensor.dtype, tensor.device,
                               next(self._pack_index))
        weakref.finalize(handle, self._file.release, handle.writes)
        flat = source.view(-1).view(torch.uint8) if nbytes else source.view(torch.uint8)
        for start in range(0, nbytes, self._slot_bytes):
            piece = flat[start:start + self._slot_bytes]
            buffer, writes = self._take_slot()
            staged = buffer.view(torch.uint8, (self._slot_bytes,))[:piece.numel()]
            staged.copy_(piece)  # from the device on CUDA: synchronous here (a side stream is the next step)
            future = self._io.pwrite(_padded(buffer, piece.numel()), self._file.file, handle.offset + start)
            writes.append(future)
            handle.writes.append(future)
        self._file.bytes_written += nbytes
        self._by_index[handle.index] = handle
        self.tensors_spilled += 1
        return handle

    def unpack(self, packed: object) -> Tensor:
        if not isinstance(packed, SpilledTensor):
            return self._inner_unpack(packed)
        wait_all(packed.writes)
        read, packed.read = packed.read, None
        packed.unpacked = True
        self._read_ahead(packed.index)
        if read is None:
            read = self._start_read(packed)
        buffer, future = read
        future.result()
        out = buffer[:packed.nbytes].view(packed.dtype).view(packed.shape)
        return out.to(packed.device) if packed.device.type != "cpu" else out

    # ----- internals ---------------------------------------------------------------------------------
    def _spills(self, tensor: Tensor) -> bool:
        return movable(tensor) and not self._keep(tensor)

    def _take_slot(self) -> Tuple["HostBuffer", List[IOFuture]]:
        """The next staging slot, once the writes from it are done."""
        buffer, writes = self._slots[next(self._next_slot)]
        wait_all(writes)
        writes.clear()
        return buffer, writes

    def _start_read(self, handle: SpilledTensor) -> Tuple[Tensor, IOFuture]:
        """Start reading a saved tensor into a 4 KiB-aligned host buffer of its own (the tensor unpack returns
        is a view of it: no second copy on the CPU)."""
        buffer = _aligned_empty(handle.nbytes)
        self._file.bytes_read += handle.nbytes  # every read counted, reads ahead included
        return buffer, self._io.pread(buffer, self._file.file, handle.offset)

    def _read_ahead(self, index: int) -> None:
        """Start reading the tensors packed just before this one (the backward's next ones), at most READ_AHEAD."""
        for earlier in range(index - 1, index - 1 - READ_AHEAD, -1):
            handle = self._by_index.get(earlier)
            if handle is None or handle.read is not None or handle.unpacked:
                continue
            wait_all(handle.writes)
            handle.read = self._start_read(handle)

    def stats(self) -> Dict[str, float]:
        return {"activation_bytes_to_disk": self._file.bytes_written, "activation_bytes_from_disk": self._file.bytes_read,
                "activation_file_peak_bytes": self._file.peak_bytes, "activation_tensors_spilled": self.tensors_spilled}

    def close(self) -> None:
        """Finish the writes, delete the file, and give the staging slots back (the pool is this spill's)."""
        try:
            self._io.wait_all()
            self._file.close()
            self._io.close()
        finally:
            self._slots.clear()
            self._staging.close()


def movable(tensor: Tensor) -> bool:
    """A saved tensor large enough to go to the activation file (if it is no weight of the engine's)."""
    return (tensor.layout is torch.strided and not tensor.is_meta and not tensor.is_sparse
            and tensor.numel() * tensor.element_size() >= MIN_SPILL_BYTES)


def _padded(buffer: "HostBuffer", nbytes: int) -> Tensor:
    """The first `nbytes` of a staging slot rounded up to 4 KiB (one O_DIRECT request; the slot is that large)."""
    return buffer.view(torch.uint8, (-(-nbytes // ALIGN) * ALIGN,))


def _aligned_empty(nbytes: int) -> Tensor:
    """A 4 KiB-aligned host buffer of at least `nbytes` rounded up to 4 KiB (a read ahead's own room)."""
    padded = -(-nbytes // ALIGN) * ALIGN
    raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift:shift + padded]


STAGING_SLOT_BYTES = 16 << 20  # two of them: one is filled while the other's write is in flight
STAGING_SLOTS = 2


def storage_keeper(buffers: Callable[[], List[Tensor]]) -> Callable[[Tensor], bool]:
    """`keep` for `ActivationSpill`: a tensor whose storage is one of the engine's flat weight buffers (the
    model's own parameters and their views) stays; the set is taken at the first call, after wrap()."""
    storages: List[set] = []

    def keep(tensor: Tensor) -> bool:
        if not storages:
            storages.append({b.untyped_storage().data_ptr() for b in buffers()})
        return tensor.untyped_storage().data_ptr() in storages[0]

    return keep
