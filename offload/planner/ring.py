"""The nvme tier's staging ring, sized: its granule, a slot's layout, least and preferred sizes, depth, and the
read-ahead it gets from host memory left over. Pure functions of record sizes, budgets and the moment format (the
planner and the ring use them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from offload.optim.moment_format import INT8_BLOCK, MomentFormat, moment_nbytes

# The staging ring's sizes (offload/scheduler/ring/disk_ring.py moves the state through it in slot-sized chunks).
CHUNK_GRANULE = 2048  # elements: 8 KiB of fp32 and 4 KiB of bf16, so every chunk is an aligned request
WEIGHT_ROOM_ITEMSIZE = 4  # a slot's room per element for compute weights (<= 4 bytes) of blocks whose weights are on disk
AREA_ALIGNMENT = 4096  # each area of a slot starts here, so each is one O_DIRECT request
MIN_DEPTH = 4  # read i+1, update i, write i-1, and one spare so a write can finish while the next read starts
MAX_DEPTH = 8  # [Note: ring depth] the ring worth having before streamed weights take their share of host memory
MAX_READ_AHEAD_DEPTH = 1024  # [Note: the read-ahead ring] host memory no weight needs adds slots, up to this many
PREFERRED_SLOT_BYTES = 32 << 20  # large enough that per-chunk overhead vanishes, small enough to pipeline


def chunk_granule(moments: MomentFormat = MomentFormat.FP32) -> int:
    """Elements a chunk is a multiple of: every section's piece of a chunk then starts 4 KiB-aligned in the
    file (one byte per int8 code needs twice CHUNK_GRANULE; either is a multiple of INT8_BLOCK, so a chunk never
    starts inside a quantization block)."""
    return 2 * CHUNK_GRANULE if moments is MomentFormat.INT8 else CHUNK_GRANULE


class SlotLayout(NamedTuple):
    """Byte offsets in a slot of the master weights, exp_avg, exp_avg_sq and the compute weights' room, and the
    bytes the slot takes (`nbytes`)."""

    master: int
    exp_avg: int
    exp_avg_sq: int
    weights: int
    nbytes: int


def slot_layout(moments: MomentFormat, chunk: int) -> SlotLayout:
    """The layout of a slot holding `chunk` elements: each area starts 4 KiB-aligned, a moment's int8 scales right
    after its codes, the compute weights' room last (WEIGHT_ROOM_ITEMSIZE bytes an element). fp32 moments give
    three fp32 sections followed by the weights, 16 bytes an element."""
    def after(offset: int, nbytes: int) -> int:
        return -(-(offset + nbytes) // AREA_ALIGNMENT) * AREA_ALIGNMENT

    master = 0
    exp_avg = after(master, 4 * chunk)
    exp_avg_sq = after(exp_avg, moment_nbytes(moments, chunk))
    weights = after(exp_avg_sq, moment_nbytes(moments, chunk))
    return SlotLayout(master, exp_avg, exp_avg_sq, weights, after(weights, WEIGHT_ROOM_ITEMSIZE * chunk))


def slot_bytes_per_element(moments: MomentFormat) -> float:
    """Bytes an element takes in a slot before the areas' alignment: fp32 master, both moments in `moments` (int8:
    a code and its share of the block's fp32 scale) and the compute weights' room. fp32 16, bf16 12, int8 ~10.03."""
    return 4 + 2 * moment_nbytes(moments, INT8_BLOCK) / INT8_BLOCK + WEIGHT_ROOM_ITEMSIZE


def chunk_numel_for(slot_bytes: int, moments: MomentFormat = MomentFormat.FP32) -> int:
    """The most elements a slot of `slot_bytes` holds in the `moments` format: a multiple of the granule whose
    layout, padding included, fits; 0 when not even one granule does. Compressed moments fit more elements in
    the same bytes: the ring is sized in bytes (host memory), its chunks in elements."""
    granule = chunk_granule(moments)
    count = max(slot_bytes, 0) // (8 * granule + 2 * moment_nbytes(moments, granule))  # padding only adds: a bound
    while count and slot_layout(moments, count * granule).nbytes > slot_bytes:
        count -= 1
    return count * granule


@dataclass(frozen=True)
class RingSlots:
    """The ring as built: `depth` slots of `slot_bytes` each (what each leases), holding chunks of up to
    `chunk_numel` elements in the `moments` format."""

    depth: int
    slot_bytes: int
    chunk_numel: int
    moments: MomentFormat

    @staticmethod
    def fit(ring_bytes: int, depth: int, moments: MomentFormat = MomentFormat.FP32) -> "RingSlots":
        """`depth` equal slots within `ring_bytes`, each holding as many elements as its bytes allow in `moments`
        (chunk_numel 0 when a slot cannot hold one granule)."""
        chunk = chunk_numel_for(ring_bytes // depth, moments)
        return RingSlots(depth, slot_layout(moments, chunk).nbytes if chunk else 0, chunk, moments)

    @property
    def nbytes(self) -> int:
        """Host bytes the slots take: never more than the ring budget they were fitted to."""
        return self.depth * self.slot_bytes

    @property
    def in_flight_numel(self) -> int:
        """Elements of optimizer state the ring holds at once (read ahead, updating, being written)."""
        return self.depth * self.chunk_numel


@dataclass(frozen=True)
class RingSize:
    """The nvme tier's staging ring: the least that works and what is worth having (bytes), for records of up to
    `largest_record_numel` elements with moments in `moments`."""

    minimum: int
    preferred: int
    largest_record_numel: int = 0
    moments: MomentFormat = MomentFormat.FP32

    def slots(self, ring_bytes: int) -> RingSlots:
        """The slots a ring of `ring_bytes` gets (`ring_depth_for`), each as large as the budget allows."""
        return RingSlots.fit(ring_bytes, ring_depth_for(ring_bytes, self.largest_record_numel, self.moments),
                             self.moments)


def min_ring_bytes(depth: int = MIN_DEPTH, moments: MomentFormat = MomentFormat.FP32) -> int:
    """The smallest ring that works: `depth` slots of one granule each."""
    return depth * slot_layout(moments, chunk_granule(moments)).nbytes


def _preferred_slot_bytes(largest_record_numel: int, moments: MomentFormat = MomentFormat.FP32) -> int:
    """A slot that holds the largest record whole (one chunk per update), up to PREFERRED_SLOT_BYTES."""
    granule = chunk_granule(moments)
    whole = -(-max(largest_record_numel, 1) // granule) * granule
    return slot_layout(moments, max(min(whole, chunk_numel_for(PREFERRED_SLOT_BYTES, moments)), granule)).nbytes


def ring_size_for(largest_record_numel: int, moments: MomentFormat = MomentFormat.FP32) -> RingSize:
    """The least ring that works and the one worth having for records of up to `largest_record_numel`."""
    return RingSize(min_ring_bytes(MIN_DEPTH, moments), MAX_DEPTH * _preferred_slot_bytes(largest_record_numel, moments),
                    largest_record_numel, moments)


def ring_depth_for(ring_bytes: int, largest_record_numel: int, moments: MomentFormat = MomentFormat.FP32) -> int:
    """How many slots a ring of `ring_bytes` gets: as many preferred-size slots as fit, from MIN_DEPTH up to
    MAX_READ_AHEAD_DEPTH (a small ring keeps MIN_DEPTH smaller slots: a record is then simply more chunks)."""
    slot = _preferred_slot_bytes(largest_record_numel, moments)
    return max(MIN_DEPTH, min(MAX_READ_AHEAD_DEPTH, ring_bytes // slot))


def read_ahead_bytes(host_left: Optional[int], ring_bytes: int, state_bytes: int, slot_bytes: int) -> int:
    """Bytes the ring grows by from host memory left after the gradients, the ring and the streamed weights
    ([Note: the read-ahead ring]): whole slots, up to the state itself (more could never be read ahead)
    and MAX_READ_AHEAD_DEPTH slots in all."""
    if host_left is None or slot_bytes <= 0 or ring_bytes < MAX_DEPTH * slot_bytes:
        return 0  # no budget (the preferred ring), or a ring that could not even get its preferred slots
    room = min(host_left, max(state_bytes - ring_bytes, 0), MAX_READ_AHEAD_DEPTH * slot_bytes - ring_bytes)
    return max(room, 0) // slot_bytes * slot_bytes
