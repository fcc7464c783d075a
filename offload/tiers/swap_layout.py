"""The swap file's layout: where each flat group's records live, as a pure function of the blocks.

A state record is three sections: the fp32 master weights, then `exp_avg`, then `exp_avg_sq`, each padded to
a multiple of 4 KiB; a moment section holds the moment in the engine's format (`MomentFormat`: fp32 or bf16
values, or int8 codes followed by their fp32 scales, each part padded to 4 KiB). Weight and gradient records
hold an array in the compute dtype. Records start 4 KiB-aligned, so the step pipeline reads and writes
them in chunks of aligned requests. See docs/design.md [Note: the swap-file layout].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from offload.optim.moment_format import MomentFormat, code_nbytes, scale_count

if TYPE_CHECKING:  # descriptions only: the tiers never call into the scheduler
    from offload.scheduler.blocks.block import Block

ALIGNMENT = 4096
STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")
WEIGHTS, GRADS = "weights", "grads"  # the arrays a group may keep in the swap file besides its state
SCALES = "scales"  # the int8 scales of a moment section: `(section, SCALES)` names that piece
LAYOUT_VERSION = 2  # 2: sections padded to 4 KiB (section_bytes)


@dataclass(frozen=True)
class SwapRecord:
    """Where one flat group's optimizer state lives in the swap file."""

    block: str
    dtype: str
    offset: int
    numel: int  # trainable elements; the record holds numel fp32 master weights and two moments of numel
    params: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (name, shape, element offset in the group)
    moments: str = MomentFormat.FP32.value  # how the two moment sections keep their values (MomentFormat)

    @property
    def section_bytes(self) -> int:
        """Bytes of the fp32 master section (4 x numel, padded to 4 KiB); with fp32 moments, of each section."""
        return section_bytes(self.numel)

    @property
    def moment_format(self) -> MomentFormat:
        return MomentFormat(self.moments)

    @property
    def section_sizes(self) -> Tuple[int, int, int]:
        """Bytes of the three sections: the master weights, then each moment (codes padded to 4 KiB, then its
        scales padded to 4 KiB when it has any: [Note: compressed moments])."""
        moment = moment_section_bytes(self.moment_format, self.numel)
        return self.section_bytes, moment, moment

    def section_offset(self, index: int) -> int:
        """File offset of section `index` (0 master, 1 exp_avg, 2 exp_avg_sq)."""
        return self.offset + sum(self.section_sizes[:index])

    @property
    def nbytes(self) -> int:
        return sum(self.section_sizes)


def section_bytes(numel: int) -> int:
    """Bytes of one fp32 section of a record of `numel` elements: padded so every section starts aligned."""
    return round_up(4 * numel, ALIGNMENT)


def moment_section_bytes(fmt: MomentFormat, numel: int) -> int:
    """Bytes of one moment section: its codes (values) padded to 4 KiB, then its scales padded to 4 KiB."""
    scales = 4 * scale_count(fmt, numel)
    return round_up(code_nbytes(fmt, numel), ALIGNMENT) + (round_up(scales, ALIGNMENT) if scales else 0)


@dataclass(frozen=True)
class WeightRecord:
    """Where an array of one flat group lives in the swap file, in the group's compute dtype, at a 4 KiB-aligned
    offset: its compute weights when the plan puts the block's weights on disk (the whole group, trainable then
    frozen parameters), or its gradient when gradients spill (the trainable range; grad_records)."""

    block: str
    dtype: str
    offset: int
    numel: int
    itemsize: int
    params: Tuple[Tuple[str, Tuple[int, ...], int], ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def plan_grad_layout(blocks: List["Block"], start: int,
                     numel_of: Optional[Callable[[Any], int]] = None) -> Tuple[Dict[str, WeightRecord], int]:
    """A gradient record for every group that trains (its trainable range, in the compute dtype; `numel_of`: a
    data-parallel rank's padded range), placed from byte `start`; the new end. See docs/design.md
    [Note: gradients on disk]."""
    records: Dict[str, WeightRecord] = {}
    offset = round_up(start, ALIGNMENT)
    for block in blocks:
        for group in block.groups:
            if not group.trainable_numel:
                continue
            numel = group.trainable_numel if numel_of is None else numel_of(group)
            params = tuple((s.name, tuple(s.shape), s.offset) for s in group.trainable_slots)
            record = WeightRecord(block.name, str(group.dtype).replace("torch.", ""), offset, numel,
                                  group.dtype.itemsize, params)
            records[group.key] = record
            offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def plan_weight_layout(blocks: List["Block"], names: Tuple[str, ...], start: int,
                       numel_of: Optional[Callable[[Any], int]] = None) -> Tuple[Dict[str, WeightRecord], int]:
    """Weight records (keyed by the group's layout key, `FlatGroup.key`) for the blocks named, placed from byte
    `start`; the new end. `numel_of`: a record's elements when it holds a rank's part of the group (sharded
    weights)."""
    records: Dict[str, WeightRecord] = {}
    offset = round_up(start, ALIGNMENT)
    for block in blocks:
        if block.name not in names:
            continue
        for group in block.groups:
            params = tuple((s.name, tuple(s.shape), s.offset) for s in group.slots)
            itemsize = group.dtype.itemsize
            numel = group.numel if numel_of is None else numel_of(group)
            record = WeightRecord(block.name, str(group.dtype).replace("torch.", ""), offset, numel, itemsize, params)
            records[group.key] = record
            offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def plan_swap_layout(blocks: List["Block"], numel_of: Optional[Callable[[Any], int]] = None,
                     moments: MomentFormat = MomentFormat.FP32) -> Tuple[Dict[str, SwapRecord], int]:
    """Records for every group with trainable parameters (keyed by the group's layout key, `FlatGroup.key`)
    and the file size. `numel_of`: a record's elements when it holds a part of the group (data-parallel);
    `moments`: how the records keep the Adam moments."""
    records: Dict[str, SwapRecord] = {}
    offset = 0
    for block in blocks:
        for group in block.groups:
            if not group.trainable_numel:
                continue
            params = tuple((s.name, tuple(s.shape), s.offset) for s in group.trainable_slots)
            numel = group.trainable_numel if numel_of is None else numel_of(group)
            record = SwapRecord(block.name, str(group.dtype).replace("torch.", ""), offset, numel, params,
                                moments.value)
            records[group.key] = record
            offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset



def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
