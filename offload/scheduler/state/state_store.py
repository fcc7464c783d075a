"""Where one flat group's optimizer state lives: the `StateStore` protocol every tier implements.

The update loop (adamw.py) and the checkpoint code see only this protocol: they ask for the state chunk
by chunk and hand each chunk back. A memory store (this file: host memory for the cpu tier, the compute
device for the gpu tier) has one chunk, the tensors themselves; the disk store (disk_store.py, the nvme
tier) streams a swap-file record through the staging ring. A new place for the state (a rank's shard, a
store on another device) is a new implementation of this protocol, not a new branch in the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import Tensor

from offload.optim.moment_format import (
    EXP_AVG,
    EXP_AVG_SQ,
    BlockLayout,
    Moment,
    MomentFormat,
    QuantizedMoment,
    moment_nbytes,
    slice_moment,
    zeros_moment,
)
from offload.optim.moments import decode_moment, encode_moment
from offload.scheduler.blocks.block import FlatGroup

Views = Tuple[Tensor, Tensor, Tensor]  # master, exp_avg, exp_avg_sq: fp32, contiguous (the checkpoint side)
EncodedViews = Tuple[Tensor, Moment, Moment]  # master (fp32) and the moments in the store's format, on the host
Span = Tuple[int, int]  # elements [start, stop) of the group's trainable range
Fill = Callable[[int, int, Views], None]  # writes a chunk's new state into host views
Cloned = Sequence[int]  # per section, how many leading elements a swap file already holds (cloned)


class StateChunk(NamedTuple):
    """Elements [start, stop) of a group's state, loaded for an update; `weights` is where the new compute
    weights go when the store keeps them too (disk-resident weights), else None."""

    start: int
    stop: int
    master: Tensor
    exp_avg: Moment  # in the store's `moments` format (a fp32 tensor for MomentFormat.FP32)
    exp_avg_sq: Moment
    weights: Optional[Tensor] = None
    shadow: bool = False  # a speculative update's: `store` writes it to the store's shadow, the live state stays
    # The CRC-32C of each piece the update wrote (offload.optim.moments.CRC_PIECES order: master, each moment's codes
    # and scales, `weights`), computed by the step in the same pass (`seals_in_step`); `store` seals the swap file's
    # pieces with them instead of reading the chunk back. None: the store computes its seals itself.
    crcs: Optional[Tensor] = None
    # int8 moments: where the chunk's quantization blocks lie, from its first element (None: fp32 or bf16)
    blocks: Optional[BlockLayout] = None


def moment_blocks(moments: MomentFormat, group: "FlatGroup | Any") -> Optional[BlockLayout]:
    """The block layout of a group's (or a rank's part's) int8 moments: blocks start over at each parameter
    ([Note: compressed moments]); None for fp32 and bf16, which have no blocks."""
    if moments is not MomentFormat.INT8:
        return None
    return BlockLayout.of_segments(group.trainable_numel, group.trainable_segments)


class SwapSections(NamedTuple):
    """Where a disk-resident record's three sections are, for copy-on-write clones section by section."""

    fd: int
    offsets: Tuple[int, int, int]  # file offset of each section (4 KiB-aligned)
    nbytes: Tuple[int, int, int]  # bytes of the values each section starts with (int8 scales and padding follow)
    itemsizes: Tuple[int, int, int]  # bytes of one element's value or code in each


class StateStore(Protocol):
    """fp32 master weights and Adam moments of one flat group's trainable range, wherever they live.

    Update side: `announce` (on the training thread, when the update is scheduled: reads may start now),
    then on the worker, for each span of `chunks()`:
    `load`, update in place, `store` (or `abandon` when the update failed: nothing is written back, though
    a store whose `load` hands out the state itself, `MemoryStore`, keeps what the update changed before it
    failed; a failed update poisons the engine either way). `discard` drops what `announce` started when the
    update will not run. Checkpoint side (no update running): `drain`, then `reading()` / `write(fill)`.

    Speculation (docs/design.md [Note: speculative clipping]): a store with a shadow (`shadowed`) loads a chunk
    with `shadow=True` for an update whose result may be thrown away: the chunk holds the live state, and `store`
    puts the new state in the shadow, never over the live one. `commit_shadow` makes what the shadow holds the
    live state (a switch, nothing copied); forgetting a speculation needs nothing of the store."""

    group: FlatGroup
    moments: MomentFormat  # how the chunks' exp_avg and exp_avg_sq are kept; the checkpoint side is fp32 always
    uses_cpu_kernel: bool  # fp32 state in host memory: the fused CPU Adam; else torch maths on the device
    writes_compute_copy: bool  # False when the master weights are the compute weights (fp32 on the gpu tier)
    reads_ahead: bool  # `announce` starts reads that the ring keeps in its slots until `load` or `discard`

    @property
    def nbytes_in_memory(self) -> int: ...

    @property
    def on_host(self) -> bool: ...

    @property
    def seals_in_step(self) -> bool:
        """`store` seals what it writes with CRC-32C: a compressed-moment step over a whole chunk hands it `crcs`."""

    def chunks(self) -> List[Span]: ...

    def announce(self) -> None: ...

    @property
    def shadowed(self) -> bool: ...

    def add_shadow(self) -> None:
        """Room for a speculative update's new state (the placement asks when the plan gives the block a shadow)."""

    def load(self, start: int, stop: int, shadow: bool = False) -> StateChunk: ...

    def store(self, chunk: StateChunk) -> None: ...

    def abandon(self, chunk: StateChunk) -> None: ...

    def discard(self) -> None: ...

    def commit_shadow(self) -> None: ...

    def drain(self) -> None:
        """Every write of the state on its medium, reads ahead dropped (the checkpoint side's first step)."""

    def reading(self, encoded: bool = False) -> "contextlib.AbstractContextManager[Iterator[Tuple[int, int, Views]]]":
        """The state as host chunks (cut where int8 blocks start), fp32; `encoded`: the moments as the store keeps
        them (`Moment`s of its format: what a checkpoint stores of bf16 and int8 moments)."""

    def write(self, fill: Fill, cloned: Cloned = (0, 0, 0), encoded: bool = False) -> None:
        """New state from `fill` (fp32 views; `encoded`: the moments in the store's own format, filled as they
        are, nothing rounded)."""

    def swap_sections(self) -> Optional[SwapSections]: ...


def overwrite_master(store: StateStore, weights: Tensor, ranges: Sequence[Tuple[int, int]]) -> None:
    """New master weights for `ranges` of the group's trainable range (`weights`: that range, any dtype and
    device), keeping the Adam moments, as torch.optim.AdamW keeps them when the user writes weights into
    the model: chunk by chunk through the store's own update path (`load`, change, `store`), so the disk
    store needs no memory of its own; chunks no range touches are not read."""
    for start, stop in store.chunks():
        hits = [(max(a, start), min(b, stop)) for a, b in ranges if a < stop and b > start]
        if not hits:
            continue
        chunk = store.load(start, stop)
        try:
            for a, b in hits:
                chunk.master[a - start:b - start].copy_(weights[a:b])
                if chunk.weights is not None:
                    chunk.weights[a - start:b - start].copy_(weights[a:b])
        except BaseException:
            store.abandon(chunk)
            raise
        store.store(chunk)


def weights_from_master(store: StateStore, weights: Tensor) -> None:
    """The group's trainable compute weights (`weights`) made what the store's live master weights say: the weights
    are a cast of them (an update writes both; a write through a parameter, `overwrite_master`, both), so a
    speculation that wrote the weights in place and is dropped puts them back this way. Through the store's update
    path, chunk by chunk, nothing written back."""
    for start, stop in store.chunks():
        chunk = store.load(start, stop)
        try:
            weights[start:stop].copy_(chunk.master)
        finally:
            store.abandon(chunk)


class MemoryStore:
    """State as three tensors on `device`: host memory (cpu tier, the fused CPU Adam) or the compute
    device (gpu tier, torch maths). On the gpu tier with fp32 compute weights the master weights are the
    device buffer itself (no second copy)."""

    def __init__(self, group: FlatGroup, device: torch.device, on_host: bool,
                 moments: MomentFormat = MomentFormat.FP32) -> None:
        assert group.device_buffer is not None, "allocate the device buffer first"
        n = group.trainable_numel
        self.group = group
        self.moments = moments
        self._on_host = on_host
        self.uses_cpu_kernel = on_host
        self.reads_ahead = False
        self.seals_in_step = False  # nothing to seal: the state never leaves memory
        weights = group.device_buffer[:n]
        aliased = group.dtype == torch.float32 and not on_host
        self.master = weights if aliased else weights.to(device, torch.float32, copy=True)
        self.writes_compute_copy = not aliased
        self.blocks = moment_blocks(moments, group)
        self.exp_avg = zeros_moment(moments, n, device, self.blocks)
        self.exp_avg_sq = zeros_moment(moments, n, device, self.blocks)
        self._shadow: Optional[Tuple[Tensor, Moment, Moment]] = None  # `add_shadow`: where speculation writes

    def add_shadow(self) -> None:
        """A second master and moments, which a speculative update writes (the placement gives one when the
        plan affords its bytes)."""
        assert self.writes_compute_copy, "the master weights are the compute weights: nothing to speculate into"
        n, device = self.group.trainable_numel, self.master.device
        self._shadow = (torch.empty_like(self.master), zeros_moment(self.moments, n, device, self.blocks),
                        zeros_moment(self.moments, n, device, self.blocks))

    @property
    def shadowed(self) -> bool:
        return self._shadow is not None

    @property
    def on_host(self) -> bool:
        return self._on_host

    @property
    def nbytes_in_memory(self) -> int:
        own_master = 0 if not self.writes_compute_copy else self.master.nbytes
        state = own_master + 2 * moment_nbytes(self.moments, self.group.trainable_numel, self.blocks)
        return 2 * state if self._shadow is not None else state

    # ----- update side: one chunk, the tensors themselves; nothing to read ahead or write back -----
    def chunks(self) -> List[Span]:
        return [(0, self.group.trainable_numel)]

    def announce(self) -> None:
        pass

    def load(self, start: int, stop: int, shadow: bool = False) -> StateChunk:
        """The state itself; `shadow`: the shadow's, holding a copy of the live state to update in place."""
        blocks = None if self.blocks is None else self.blocks.sub(start, stop)
        live = (self.master[start:stop], slice_moment(self.exp_avg, self.moments, start, stop, self.blocks),
                slice_moment(self.exp_avg_sq, self.moments, start, stop, self.blocks))
        if not shadow:
            return StateChunk(start, stop, *live, blocks=blocks)
        assert self._shadow is not None
        master, exp_avg, exp_avg_sq = self._shadow
        copies = (master[start:stop], slice_moment(exp_avg, self.moments, start, stop, self.blocks),
                  slice_moment(exp_avg_sq, self.moments, start, stop, self.blocks))
        for target, source in zip(copies, live):
            copy_moment(target, source)
        return StateChunk(start, stop, *copies, shadow=True, blocks=blocks)

    def commit_shadow(self) -> None:
        """The shadow (a speculative update's new state) becomes the state; the old state the next shadow."""
        assert self._shadow is not None
        shadow = self._shadow
        self._shadow = (self.master, self.exp_avg, self.exp_avg_sq)
        self.master, self.exp_avg, self.exp_avg_sq = shadow

    def store(self, chunk: StateChunk) -> None:
        pass

    def abandon(self, chunk: StateChunk) -> None:
        pass

    def discard(self) -> None:
        pass

    def drain(self) -> None:
        pass

    # ----- checkpoint side -----
    @contextlib.contextmanager
    def reading(self, encoded: bool = False) -> Iterator[Iterator[Tuple[int, int, Views]]]:
        """The state as host chunks (read-only): the fp32 tensors themselves on the host, copies from a device;
        compressed moments decoded to fp32 a piece at a time (`DECODE_CHUNK`), or (`encoded`) as they are."""
        if self.moments is not MomentFormat.FP32:
            state = (self, self.master, self.exp_avg, self.exp_avg_sq)
            yield encoded_chunks(*state) if encoded else decoded_chunks(*state)  # type: ignore[misc]
            return
        views = tuple(t.detach().to("cpu").contiguous() for t in self._fp32_state())
        yield iter([(0, self.group.trainable_numel, views)])  # type: ignore[list-item]

    def _fp32_state(self) -> Tuple[Tensor, Tensor, Tensor]:
        """master, exp_avg, exp_avg_sq when the moments are fp32 (plain tensors)."""
        assert self.moments is MomentFormat.FP32
        return self.master, cast(Tensor, self.exp_avg), cast(Tensor, self.exp_avg_sq)

    def write(self, fill: Fill, cloned: Cloned = (0, 0, 0), encoded: bool = False) -> None:
        """New state from `fill`: straight into host tensors (a load verified the files before anything
        changes), through host staging for device tensors; compressed moments are filled in fp32 a piece at
        a time and encoded, or (`encoded`) filled as they are."""
        n = self.group.trainable_numel
        if self.moments is not MomentFormat.FP32:
            if encoded:
                fill_encoded_chunks(self, self.master, self.exp_avg, self.exp_avg_sq, fill)  # type: ignore[arg-type]
            else:
                encode_chunks(self, self.master, self.exp_avg, self.exp_avg_sq, fill)
            return
        targets = self._fp32_state()
        if all(t.device.type == "cpu" and t.is_contiguous() for t in targets):
            fill(0, n, targets)
            return
        staged = tuple(torch.empty(t.shape, dtype=t.dtype) for t in targets)
        fill(0, n, staged)  # type: ignore[arg-type]
        with torch.no_grad():
            for target, source in zip(targets, staged):
                target.copy_(source)

    def swap_sections(self) -> Optional[SwapSections]:
        return None


DECODE_CHUNK = 1 << 22  # elements a checkpoint decodes or encodes at once: 32 MiB of fp32 moments


def decode_cuts(n: int, blocks: Optional[BlockLayout]) -> List[Span]:
    """[0, n) in pieces of at most DECODE_CHUNK elements, each cut where an int8 block starts."""
    if blocks is None:
        return [(start, min(start + DECODE_CHUNK, n)) for start in range(0, n, DECODE_CHUNK)]
    return blocks.cuts(DECODE_CHUNK, DECODE_CHUNK)


def decoded_chunks(store: StateStore, master: Tensor, exp_avg: Moment,
                   exp_avg_sq: Moment) -> Iterator[Tuple[int, int, Views]]:
    """A memory store's compressed state as fp32 host chunks of at most DECODE_CHUNK elements (cut where
    quantization blocks start): the checkpoint side sees fp32 whatever the format."""
    blocks = moment_blocks(store.moments, store.group)
    for start, stop in decode_cuts(store.group.trainable_numel, blocks):
        yield start, stop, decode_views(store.moments, master[start:stop].detach(),
                                        slice_moment(exp_avg, store.moments, start, stop, blocks),
                                        slice_moment(exp_avg_sq, store.moments, start, stop, blocks),
                                        None if blocks is None else blocks.sub(start, stop))


def _host_moment(m: Moment) -> Moment:
    if isinstance(m, QuantizedMoment):
        return QuantizedMoment(m.codes.to("cpu"), m.scales.to("cpu"))
    return m.to("cpu")


def encoded_chunks(store: StateStore, master: Tensor, exp_avg: Moment,
                   exp_avg_sq: Moment) -> Iterator[Tuple[int, int, EncodedViews]]:
    """A memory store's compressed state as host chunks in its own format (copies from a device)."""
    blocks = moment_blocks(store.moments, store.group)
    for start, stop in decode_cuts(store.group.trainable_numel, blocks):
        yield start, stop, (master[start:stop].detach().to("cpu"),
                            _host_moment(slice_moment(exp_avg, store.moments, start, stop, blocks)),
                            _host_moment(slice_moment(exp_avg_sq, store.moments, start, stop, blocks)))


def fill_encoded_chunks(store: StateStore, master: Tensor, exp_avg: Moment, exp_avg_sq: Moment,
                        fill: Callable[[int, int, EncodedViews], None]) -> None:
    """A memory store's new compressed state from `fill`, in its own format: straight into host tensors,
    through host staging for device ones."""
    blocks = moment_blocks(store.moments, store.group)
    for start, stop in decode_cuts(store.group.trainable_numel, blocks):
        targets = (master[start:stop], slice_moment(exp_avg, store.moments, start, stop, blocks),
                   slice_moment(exp_avg_sq, store.moments, start, stop, blocks))
        if master.device.type == "cpu":
            fill(start, stop, targets)
            continue
        staged = tuple(_host_moment(t) for t in targets)
        fill(start, stop, staged)  # type: ignore[arg-type]
        with torch.no_grad():
            for target, source in zip(targets, staged):
                copy_moment(target, source)


def decode_views(moments: MomentFormat, master: Tensor, exp_avg: Moment, exp_avg_sq: Moment,
                 blocks: Optional[BlockLayout] = None) -> Views:
    """fp32 host copies of one chunk's state (the master weights as they are when already on the host)."""
    n = master.numel()
    out = []
    for which, moment in ((EXP_AVG, exp_avg), (EXP_AVG_SQ, exp_avg_sq)):
        values = torch.empty(n, dtype=torch.float32, device=master.device)
        decode_moment(moment, moments, which, values, blocks)
        out.append(values.to("cpu"))
    return master.to("cpu").contiguous(), out[0], out[1]


def encode_chunks(store: StateStore, master: Tensor, exp_avg: Moment, exp_avg_sq: Moment, fill: Fill) -> None:
    """A memory store's new compressed state from `fill`, DECODE_CHUNK elements at a time through fp32 host
    staging; the master weights are filled in place when they are on the host."""
    blocks = moment_blocks(store.moments, store.group)
    for start, stop in decode_cuts(store.group.trainable_numel, blocks):
        on_host = master.device.type == "cpu"
        target = master[start:stop] if on_host else torch.empty(stop - start, dtype=torch.float32)
        staged = (target, torch.empty(stop - start, dtype=torch.float32), torch.empty(stop - start, dtype=torch.float32))
        fill(start, stop, staged)
        with torch.no_grad():
            if not on_host:
                master[start:stop].copy_(target)
            for which, moment, values in ((EXP_AVG, exp_avg, staged[1]), (EXP_AVG_SQ, exp_avg_sq, staged[2])):
                piece = slice_moment(moment, store.moments, start, stop, blocks)
                encode_moment(values.to(master.device), store.moments, which, piece,
                              None if blocks is None else blocks.sub(start, stop))


def copy_moment(target: Moment, source: Moment) -> None:
    """`target` := `source`, two moments of one format (or two master weight tensors)."""
    if isinstance(source, QuantizedMoment):
        assert isinstance(target, QuantizedMoment)
        target.codes.copy_(source.codes)
        target.scales.copy_(source.scales)
    else:
        assert isinstance(target, Tensor)
        target.copy_(source)
