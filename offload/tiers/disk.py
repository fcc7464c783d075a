"""The disk tier: optimizer state of every block in one preallocated swap file, laid out by name.

Each flat group with trainable parameters owns one record: its fp32 master weights, then `exp_avg`, then
`exp_avg_sq` (3 x 4 bytes per parameter, contiguous, so one read and one write per update), starting at a
4 KiB-aligned offset. The layout is a pure function of the blocks and is written next to the swap file as
`layout.json`, keyed by block and fully-qualified parameter names, never by object ids, so a later process
(checkpoint resume, issue 4) can find every parameter's state again. See docs/design.md
[Note: the swap-file layout].
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Tuple

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.tiers.disk_checksums import RecordChecksums
from offload.tiers.swap_leftovers import hold_lock, remove_leftovers
from offload.io import AsyncIO, SwapFile

if TYPE_CHECKING:  # descriptions only: the tiers never call into the scheduler
    from offload.scheduler.block import Block, FlatGroup

ALIGNMENT = 4096
STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class SwapRecord:
    """Where one flat group's optimizer state lives in the swap file."""

    block: str
    dtype: str
    offset: int
    numel: int  # trainable elements; the record holds 3 x numel fp32 values
    params: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (name, shape, element offset in the group)

    @property
    def nbytes(self) -> int:
        return 3 * 4 * self.numel


def plan_swap_layout(blocks: List["Block"]) -> Tuple[Dict[int, SwapRecord], int]:
    """Records for every group with trainable parameters (keyed by id of the group) and the file size."""
    records: Dict[int, SwapRecord] = {}
    offset = 0
    for block in blocks:
        for group in block.groups:
            if not group.trainable_numel:
                continue
            params = tuple((s.name, tuple(s.shape), s.offset) for s in group.trainable_slots)
            record = SwapRecord(block.name, str(group.dtype).replace("torch.", ""), offset, group.trainable_numel,
                                params)
            records[id(group)] = record
            offset += _round_up(record.nbytes, ALIGNMENT)
    return records, offset


def check_room(directory: str, needed: int) -> None:
    """Refuse at wrap() a swap directory without room for the swap file, naming needed and free bytes."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OffloadConfigError(
            f"nvme_path {directory!r} has {free} bytes free but the optimizer state needs {needed} bytes "
            f"({needed / 2**30:.2f} GiB); free space or choose another directory")


class SwapStore:
    """The swap file of one engine: created at wrap(), preallocated, removed at close()."""

    def __init__(self, directory: str, records: Dict[int, SwapRecord], size: int) -> None:
        remove_leftovers(directory)  # of crashed runs: before the room check, so their space counts
        check_room(directory, size)
        self.directory = directory
        self.records = records
        self.path = os.path.join(directory, f"offload-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap")
        self.layout_path = self.path + ".layout.json"
        self._io = AsyncIO()
        self._file: SwapFile = self._io.open(self.path, size=max(size, ALIGNMENT))
        hold_lock(self._file.buffered_fd, self.path)
        self.bytes_read = 0
        self.bytes_written = 0
        self.checksums = RecordChecksums()  # sealed on write, verified on read (disk_checksums.py)
        self._write_layout(size)

    def _write_layout(self, size: int) -> None:
        layout = {"version": LAYOUT_VERSION, "swap_file": os.path.basename(self.path), "size": size,
                  "tensors": list(STATE_TENSORS), "records": [r.__dict__ for r in self.records.values()]}
        tmp = self.layout_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(layout, f, indent=1)
        os.replace(tmp, self.layout_path)

    def read(self, group: "FlatGroup", into: Tensor) -> None:
        """Fill `into` (3 x numel fp32, contiguous) with the group's state; raises on a short or failed read."""
        record = self.records[id(group)]
        self._io.pread(into, self._file, record.offset).result()
        self.bytes_read += record.nbytes
        self.checksums.verify(id(group), into[:3 * record.numel], self.path, record.block, record.offset)

    def write(self, group: "FlatGroup", source: Tensor) -> None:
        record = self.records[id(group)]
        self._io.pwrite(source, self._file, record.offset).result()
        self.bytes_written += record.nbytes
        self.checksums.seal(id(group), source[:3 * record.numel])

    def close(self) -> None:
        """Close and delete the swap file and its layout (this run's state only)."""
        try:
            self._io.close()
        finally:
            for path in (self.path, self.layout_path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def state_views(buffer: Tensor, numel: int) -> Tuple[Tensor, Tensor, Tensor]:
    """master, exp_avg, exp_avg_sq as views of one record-sized fp32 buffer."""
    flat = buffer.view(torch.float32)[:3 * numel]
    return flat[:numel], flat[numel:2 * numel], flat[2 * numel:]
