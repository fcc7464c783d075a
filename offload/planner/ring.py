"""The nvme tier's staging ring, sized: its granule, least and preferred sizes, depth, and the read-ahead it
gets from host memory left over. Pure functions of record sizes and budgets (the planner and the ring use them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from offload.optim.moment_format import MomentFormat


@dataclass(frozen=True)
class RingSize:
    """The nvme tier's staging ring: the least that works and what is worth having (bytes)."""

    minimum: int
    preferred: int


# The staging ring's sizes (offload/scheduler/ring/disk_ring.py moves the state through it in slot-sized chunks).
CHUNK_GRANULE = 2048  # elements: 8 KiB of fp32 and 4 KiB of bf16, so every chunk is an aligned request
SLOT_BYTES_PER_ELEMENT = 16  # the state, and room for compute weights (<= 4 bytes) of blocks whose weights are on disk
MIN_DEPTH = 4  # read i+1, update i, write i-1, and one spare so a write can finish while the next read starts
MAX_DEPTH = 8  # [Note: ring depth] the ring worth having before streamed weights take their share of host memory
MAX_READ_AHEAD_DEPTH = 1024  # [Note: the read-ahead ring] host memory no weight needs adds slots, up to this many
PREFERRED_SLOT_BYTES = 32 << 20  # large enough that per-chunk overhead vanishes, small enough to pipeline


def chunk_granule(moments: MomentFormat = MomentFormat.FP32) -> int:
    """Elements a chunk is a multiple of: every section's piece of a chunk then starts 4 KiB-aligned in the
    file (one byte per int8 code needs twice CHUNK_GRANULE)."""
    return 2 * CHUNK_GRANULE if moments is MomentFormat.INT8 else CHUNK_GRANULE


def min_ring_bytes(depth: int = MIN_DEPTH, moments: MomentFormat = MomentFormat.FP32) -> int:
    """The smallest ring that works: `depth` slots of one granule each."""
    return depth * chunk_granule(moments) * SLOT_BYTES_PER_ELEMENT


def _preferred_slot_bytes(largest_record_numel: int, moments: MomentFormat = MomentFormat.FP32) -> int:
    """A slot that holds the largest record whole (one chunk per update), up to PREFERRED_SLOT_BYTES."""
    granule = chunk_granule(moments)
    granules = -(-max(largest_record_numel, 1) // granule)
    unit = granule * SLOT_BYTES_PER_ELEMENT
    return max(min(granules * unit, PREFERRED_SLOT_BYTES) // unit, 1) * unit


def ring_size_for(largest_record_numel: int, moments: MomentFormat = MomentFormat.FP32) -> RingSize:
    """The least ring that works and the one worth having for records of up to `largest_record_numel`."""
    return RingSize(min_ring_bytes(MIN_DEPTH, moments), MAX_DEPTH * _preferred_slot_bytes(largest_record_numel, moments))


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
