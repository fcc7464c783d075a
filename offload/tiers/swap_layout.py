"""The swap file's layout: where each flat group's records live, as a pure function of the groups' shapes.

A state record is three sections: the fp32 master weights, then `exp_avg`, then `exp_avg_sq`, each padded to
a multiple of 4 KiB; a moment section holds the moment in the engine's format (`MomentFormat`: fp32 or bf16
values, or int8 codes followed by their fp32 scales, each part padded to 4 KiB). Weight and gradient records
hold an array in the compute dtype. Records start 4 KiB-aligned, so the step pipeline reads and writes
them in chunks of aligned requests. The layout sees a group as a `GroupShape` (its key, block, dtype and
parameters), never as the scheduler's objects. See docs/design.md [Note: the swap-file layout].
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import torch

from offload.optim.moment_format import MomentFormat, code_nbytes, scale_count

ALIGNMENT = 4096
STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")  # a group's optimizer state, in a record's section order
WEIGHTS, GRADS = "weights", "grads"  # the arrays a group may keep in the swap file besides its state
SCALES = "scales"  # the int8 scales of a moment section: `(section, SCALES)` names that piece
LAYOUT_VERSION = 2  # 2: sections padded to 4 KiB (section_bytes)

Params = Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (name, shape, element offset in the group)


@dataclass(frozen=True)
class GroupShape:
    """What the layout needs of one flat group (the scheduler's `FlatGroup.shape()`): its layout key (stable
    across processes), its block's name, its dtype, its elements, and its parameters, trainable ones first."""

    key: str
    block: str
    dtype: torch.dtype
    numel: int
    trainable_numel: int
    params: Params  # every parameter
    trainable: Params  # the trainable ones (the first `len(trainable)` of `params`)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


@dataclass(frozen=True)
class SwapRecord:
    """Where one flat group's optimizer state lives in the swap file."""

    block: str
    dtype: str
    offset: int
    numel: int  # trainable elements; the record holds numel fp32 master weights and two moments of numel
    params: Params
    moments: str = MomentFormat.FP32.value  # how the two moment sections keep their values (MomentFormat)

    @property
    def section_bytes(self) -> int:
        """Bytes of the fp32 master section (4 x numel, padded to 4 KiB); with fp32 moments, of each section."""
        return section_bytes(self.numel)

    @property
    def moment_format(self) -> MomentFormat:
        return MomentFormat(self.moments)

    @functools.cached_property
    def section_sizes(self) -> Tuple[int, int, int]:
        """Bytes of the three sections: the master weights, then each moment (codes padded to 4 KiB, then its
        scales padded to 4 KiB when it has any: [Note: compressed moments])."""
        moment = moment_section_bytes(self.moment_format, self.numel, len(self.params))
        return self.section_bytes, moment, moment

    @functools.cached_property
    def section_offsets(self) -> Tuple[int, int, int]:
        """File offset of each section (0 master, 1 exp_avg, 2 exp_avg_sq)."""
        sizes = self.section_sizes
        return self.offset, self.offset + sizes[0], self.offset + sizes[0] + sizes[1]

    @functools.cached_property
    def code_itemsize(self) -> int:
        """Bytes of one moment element's code (4 fp32, 2 bf16, 1 int8)."""
        return code_nbytes(self.moment_format, 1)

    @functools.cached_property
    def scales_at(self) -> int:
        """Where a moment section's int8 scales start, from the section's start."""
        return round_up(code_nbytes(self.moment_format, self.numel), ALIGNMENT)

    @property
    def nbytes(self) -> int:
        return sum(self.section_sizes)

    def as_json(self) -> dict:
        """The record as layout.json keeps it."""
        return dict(block=self.block, dtype=self.dtype, offset=self.offset, numel=self.numel, params=self.params,
                    moments=self.moments, section_bytes=self.section_bytes, section_sizes=self.section_sizes)


def section_bytes(numel: int) -> int:
    """Bytes of one fp32 section of a record of `numel` elements: padded so every section starts aligned."""
    return round_up(4 * numel, ALIGNMENT)


def moment_section_bytes(fmt: MomentFormat, numel: int, segments: int = 1) -> int:
    """Bytes of one moment section: its codes (values) padded to 4 KiB, then its scales padded to 4 KiB: room for
    the int8 blocks of `numel` elements in `segments` parameters (each may end in a partial block)."""
    scales = 4 * scale_capacity(fmt, numel, segments)
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
    params: Params

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def as_json(self) -> dict:
        return dict(block=self.block, dtype=self.dtype, offset=self.offset, numel=self.numel, itemsize=self.itemsize,
                    params=self.params)


def plan_grad_layout(groups: Iterable[GroupShape], start: int,
                     numel_of: Optional[Callable[[GroupShape], int]] = None) -> Tuple[Dict[str, WeightRecord], int]:
    """A gradient record for every group that trains (its trainable range, in the compute dtype; `numel_of`: a
    data-parallel rank's padded range), placed from byte `start`; the new end. See docs/design.md
    [Note: gradients on disk]."""
    records: Dict[str, WeightRecord] = {}
    offset = round_up(start, ALIGNMENT)
    for group in groups:
        if not group.trainable_numel:
            continue
        numel = group.trainable_numel if numel_of is None else numel_of(group)
        record = WeightRecord(group.block, group.dtype_name, offset, numel, group.dtype.itemsize, group.trainable)
        records[group.key] = record
        offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def plan_weight_layout(groups: Iterable[GroupShape], start: int,
                       numel_of: Optional[Callable[[GroupShape], int]] = None) -> Tuple[Dict[str, WeightRecord], int]:
    """Weight records (keyed by the group's layout key) for these groups (those of the blocks whose weights the
    plan puts on disk), placed from byte `start`; the new end. `numel_of`: a record's elements when it holds a
    rank's part of the group (sharded weights)."""
    records: Dict[str, WeightRecord] = {}
    offset = round_up(start, ALIGNMENT)
    for group in groups:
        numel = group.numel if numel_of is None else numel_of(group)
        record = WeightRecord(group.block, group.dtype_name, offset, numel, group.dtype.itemsize, group.params)
        records[group.key] = record
        offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def plan_swap_layout(groups: Iterable[GroupShape], numel_of: Optional[Callable[[GroupShape], int]] = None,
                     moments: MomentFormat = MomentFormat.FP32) -> Tuple[Dict[str, SwapRecord], int]:
    """Records for every group with trainable parameters (keyed by the group's layout key) and the file size.
    `numel_of`: a record's elements when it holds a part of the group (data-parallel); `moments`: how the
    records keep the Adam moments."""
    records: Dict[str, SwapRecord] = {}
    offset = 0
    for group in groups:
        if not group.trainable_numel:
            continue
        numel = group.trainable_numel if numel_of is None else numel_of(group)
        record = SwapRecord(group.block, group.dtype_name, offset, numel, group.trainable, moments.value)
        records[group.key] = record
        offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def scale_capacity(fmt: MomentFormat, numel: int, segments: int) -> int:
    """The most int8 scales `numel` elements cut into `segments` parameters (or parts of them) can have: the
    blocks start over at each one, so each may add one partial block."""
    count = scale_count(fmt, numel)
    return count + max(segments - 1, 0) if count else 0


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class ShadowRecords(NamedTuple):
    """The swap file's second copies, by the group's key: state records, and weight records of groups whose weights
    live on disk. A speculative update writes a group's shadow; committing it makes the shadow the live copy
    (tiers/disk.py, `SwapStore.flip`)."""

    state: Dict[str, SwapRecord]
    weights: Dict[str, WeightRecord]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.state.values()) + sum(r.nbytes for r in self.weights.values())


def plan_shadow_layout(keys: Iterable[str], records: Dict[str, SwapRecord], weights: Dict[str, WeightRecord],
                       start: int) -> Tuple[ShadowRecords, int]:
    """A second copy of the state record (and of the weight record, if any) of each group of `keys`, placed from byte
    `start`, as the first copies are; the new end."""
    offset = round_up(start, ALIGNMENT)
    state: Dict[str, SwapRecord] = {}
    shadow_weights: Dict[str, WeightRecord] = {}
    for key in keys:
        record = records[key]
        state[key] = dataclasses.replace(record, offset=offset)
        offset += round_up(record.nbytes, ALIGNMENT)
        if key in weights:
            shadow_weights[key] = dataclasses.replace(weights[key], offset=offset)
            offset += round_up(weights[key].nbytes, ALIGNMENT)
    return ShadowRecords(state, shadow_weights), offset
