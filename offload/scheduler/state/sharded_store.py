"""A rank's shard of a flat group's optimizer state, as a `StateStore` (data-parallel mode).

The store underneath (memory or disk, unchanged) is built on a `ShardGroup`: the group as that store needs
to see it (its layout key, dtype, and as its whole trainable range this rank's part `[lo, hi)`, with the
device buffer's view of it for the start weights). `ShardedStore` speaks the group's coordinates to the
update loop and the checkpoint code: its chunks lie in `[lo, hi)`, so `adamw` reads the gradient at
`grad[lo:hi]` and writes the new weights to `out[lo:hi]`, and the rest of the engine never learns that
the state is a part. See data_parallel.py.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

from torch import Tensor

from offload.distributed.data_parallel import Shard
from offload.scheduler.blocks.block import FlatGroup, ParamSlot
from offload.scheduler.state.state_store import Cloned, Fill, Span, StateChunk, StateStore, SwapSections, Views


class ShardGroup:
    """What a store needs of a flat group, for this rank's part of its trainable range."""

    def __init__(self, group: FlatGroup, shard: Shard) -> None:
        assert group.device_buffer is not None, "allocate the device buffer first"
        self.whole = group
        self.shard = shard
        self.key = group.key  # the swap record and the ring know the part under the group's own key
        self.dtype = group.dtype
        self.trainable_numel = shard.numel
        self.device_buffer: Optional[Tensor] = group.device_buffer[shard.lo:shard.hi]
        self.trainable_slots: List[ParamSlot] = group.trainable_slots  # names for the swap layout only

    @property
    def trainable_segments(self) -> List[Tuple[int, int]]:
        """Each trainable parameter's part on this rank, in the part's own coordinates: where int8 moments'
        blocks start over (a block never crosses a parameter nor a rank's boundary)."""
        lo, hi = self.shard.lo, self.shard.hi
        return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in self.whole.trainable_segments if a < hi and b > lo]


class ShardedStore:
    """The `StateStore` of `[lo, hi)` of a group: `inner` holds that part as its own `[0, hi - lo)`."""

    def __init__(self, inner: StateStore, shard: Shard) -> None:
        self.inner = inner
        self.shard = shard
        self.group = inner.group
        self.moments = inner.moments
        self.uses_cpu_kernel = inner.uses_cpu_kernel
        self.writes_compute_copy = True  # the other ranks' parts arrive by all-gather into the compute copy
        self.reads_ahead = inner.reads_ahead
        self.seals_in_step = inner.seals_in_step

    @property
    def nbytes_in_memory(self) -> int:
        return self.inner.nbytes_in_memory

    @property
    def on_host(self) -> bool:
        return self.inner.on_host

    def chunks(self) -> List[Span]:
        lo = self.shard.lo
        return [(lo + a, lo + b) for a, b in self.inner.chunks()]

    def announce(self) -> None:
        self.inner.announce()

    @property
    def shadowed(self) -> bool:
        return self.inner.shadowed

    def add_shadow(self) -> None:
        self.inner.add_shadow()

    def load(self, start: int, stop: int, shadow: bool = False) -> StateChunk:
        lo = self.shard.lo
        chunk = self.inner.load(start - lo, stop - lo, shadow)
        return chunk._replace(start=start, stop=stop)

    def commit_shadow(self) -> None:
        self.inner.commit_shadow()

    def store(self, chunk: StateChunk) -> None:
        lo = self.shard.lo
        self.inner.store(chunk._replace(start=chunk.start - lo, stop=chunk.stop - lo))

    def abandon(self, chunk: StateChunk) -> None:
        lo = self.shard.lo
        self.inner.abandon(chunk._replace(start=chunk.start - lo, stop=chunk.stop - lo))

    def discard(self) -> None:
        self.inner.discard()

    def drain(self) -> None:
        self.inner.drain()

    @contextlib.contextmanager
    def reading(self, encoded: bool = False) -> Iterator[Iterator[Tuple[int, int, Views]]]:
        lo = self.shard.lo
        with self.inner.reading(encoded) as chunks:
            yield ((lo + a, lo + b, views) for a, b, views in chunks)

    def write(self, fill: Fill, cloned: Cloned = (0, 0, 0), encoded: bool = False) -> None:
        """`fill` in the group's coordinates. Nothing is cloned into a part (`swap_sections` is None)."""
        if any(cloned):
            raise ValueError(f"a rank's part of the optimizer state is written, never cloned (cloned={cloned})")
        self.inner.write(_InPartCoordinates(fill, self.shard.lo), encoded=encoded)

    def swap_sections(self) -> Optional[SwapSections]:
        return None  # a part's sections are not a checkpoint file's: no copy-on-write clones


class _InPartCoordinates:
    """A `Fill` in the group's coordinates, called by the inner store in the part's own ([0, hi - lo))."""

    def __init__(self, fill: Fill, lo: int) -> None:
        self._fill = fill
        self._lo = lo

    def __call__(self, start: int, stop: int, views: Views) -> None:
        self._fill(self._lo + start, self._lo + stop, views)
