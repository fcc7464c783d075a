"""The disk tier: optimizer state of every block in one preallocated swap file, laid out by name.

Each flat group with trainable parameters owns one record: three sections, its fp32 master weights, then
`exp_avg`, then `exp_avg_sq`, each 4 x numel bytes padded to a multiple of 4 KiB (`section_bytes`), the
record starting at a 4 KiB-aligned offset: any element range of any section is one O_DIRECT request when
the range starts at a multiple of 1024 elements, so the step pipeline can read and write records in chunks. The layout is a pure function of the blocks and is written next to the swap file as
`layout.json`, keyed by block and fully-qualified parameter names, never by object ids, so a later process
(checkpoint resume, issue 4) can find every parameter's state again. See docs/design.md
[Note: the swap-file layout].
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.io import AsyncIO, SwapFile
from offload.io.future import IOFuture, wait_all
from offload.io.swap_file import file_system_of
from offload.tiers.disk_checksums import ReadPiece, RecordChecksums, VerifiedRead
from offload.tiers.swap_leftovers import hold_lock, remove_leftovers

if TYPE_CHECKING:  # descriptions only: the tiers never call into the scheduler
    from offload.scheduler.blocks.block import Block, FlatGroup

ALIGNMENT = 4096
STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")
WEIGHTS, GRADS = "weights", "grads"  # the arrays a group may keep in the swap file besides its state
LAYOUT_VERSION = 2  # 2: sections padded to 4 KiB (section_bytes)


@dataclass(frozen=True)
class SwapRecord:
    """Where one flat group's optimizer state lives in the swap file."""

    block: str
    dtype: str
    offset: int
    numel: int  # trainable elements; the record holds 3 x numel fp32 values
    params: Tuple[Tuple[str, Tuple[int, ...], int], ...]  # (name, shape, element offset in the group)

    @property
    def section_bytes(self) -> int:
        """Bytes of each of the three sections (4 x numel, padded to 4 KiB)."""
        return section_bytes(self.numel)

    @property
    def nbytes(self) -> int:
        return 3 * self.section_bytes


def section_bytes(numel: int) -> int:
    """Bytes of one fp32 section of a record of `numel` elements: padded so every section starts aligned."""
    return round_up(4 * numel, ALIGNMENT)


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


def plan_weight_layout(blocks: List["Block"], names: Tuple[str, ...], start: int) -> Tuple[Dict[str, WeightRecord], int]:
    """Weight records (keyed by the group's layout key, `FlatGroup.key`) for the blocks named, placed from byte
    `start`; the new end."""
    records: Dict[str, WeightRecord] = {}
    offset = round_up(start, ALIGNMENT)
    for block in blocks:
        if block.name not in names:
            continue
        for group in block.groups:
            params = tuple((s.name, tuple(s.shape), s.offset) for s in group.slots)
            itemsize = group.dtype.itemsize
            record = WeightRecord(block.name, str(group.dtype).replace("torch.", ""), offset, group.numel, itemsize,
                                  params)
            records[group.key] = record
            offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def plan_swap_layout(blocks: List["Block"], numel_of: Optional[Callable[[Any], int]] = None,
                     ) -> Tuple[Dict[str, SwapRecord], int]:
    """Records for every group with trainable parameters (keyed by the group's layout key, `FlatGroup.key`)
    and the file size. `numel_of`: a record's elements when it holds a part of the group (data-parallel)."""
    records: Dict[str, SwapRecord] = {}
    offset = 0
    for block in blocks:
        for group in block.groups:
            if not group.trainable_numel:
                continue
            params = tuple((s.name, tuple(s.shape), s.offset) for s in group.trainable_slots)
            numel = group.trainable_numel if numel_of is None else numel_of(group)
            record = SwapRecord(block.name, str(group.dtype).replace("torch.", ""), offset, numel, params)
            records[group.key] = record
            offset += round_up(record.nbytes, ALIGNMENT)
    return records, offset


def check_room(directory: str, needed: int) -> None:
    """Refuse at wrap() a swap directory without room for the swap file, naming needed and free bytes."""
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OffloadConfigError(
            f"nvme_path {directory!r} has {free} bytes free but the optimizer state needs {needed} bytes "
            f"({needed / 2**30:.2f} GiB); free space or choose another directory")


RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


def warn_if_ram_backed(directory: str) -> bool:
    """Warn once when the swap directory lives in RAM (tmpfs, /dev/shm): it works, with buffered I/O since
    O_DIRECT is unsupported or pointless there, but the swap file then takes memory outside host_memory."""
    fs = file_system_of(directory)
    if fs.split(" ")[0] not in RAM_FILE_SYSTEMS:
        return False
    warnings.warn(
        f"offload: nvme_path {directory!r} is on {fs}, which keeps files in RAM: the swap file works (buffered "
        "I/O, O_DIRECT is unsupported or pointless there) but uses memory outside host_memory; use a directory "
        "on a local NVMe disk to free RAM", RuntimeWarning, stacklevel=4)
    return True


class SwapStore:
    """The swap file of one engine: created at wrap(), preallocated, removed at close()."""

    def __init__(self, directory: str, records: Dict[str, SwapRecord], size: int,
                 weights: Optional[Dict[str, WeightRecord]] = None,
                 grads: Optional[Dict[str, WeightRecord]] = None) -> None:
        remove_leftovers(directory)  # of crashed runs: before the room check, so their space counts
        check_room(directory, size)
        self.directory = directory
        self.records = records  # by the group's layout key (`FlatGroup.key`), as `weights` and the checksums
        self.weights: Dict[str, WeightRecord] = weights or {}
        self.grads: Dict[str, WeightRecord] = grads or {}  # spilled gradients (plan.grads_on_disk)
        self.path = os.path.join(directory, f"offload-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap")
        self.layout_path = self.path + ".layout.json"
        # A script that ends (or drops its engine) without close(): the files go at interpreter exit or
        # when this store is collected, not at the next wrap() into the same directory.
        self._forget = weakref.finalize(self, _remove_files, (self.path, self.layout_path), os.getpid())
        self._io = AsyncIO()
        ram_backed = warn_if_ram_backed(directory)
        self._file: SwapFile = self._io.open(self.path, size=max(size, ALIGNMENT),
                                             direct=False if ram_backed else None)
        hold_lock(self._file.buffered_fd, self.path)
        self.bytes_read = 0
        self.bytes_written = 0
        self.checksums = RecordChecksums()  # sealed on write, verified on read (disk_checksums.py)
        self._write_layout(size)

    def _write_layout(self, size: int) -> None:
        records = [dict(r.__dict__, section_bytes=r.section_bytes) for r in self.records.values()]
        layout = {"version": LAYOUT_VERSION, "swap_file": os.path.basename(self.path), "size": size,
                  "tensors": list(STATE_TENSORS), "records": records,
                  "weights": [r.__dict__ for r in self.weights.values()],
                  "grads": [r.__dict__ for r in self.grads.values()]}
        tmp = self.layout_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(layout, f, indent=1)
        os.replace(tmp, self.layout_path)

    def read(self, group: "FlatGroup", into: Tensor) -> None:
        """Fill `into` (a record-sized buffer, see `state_views`) with the group's state; raises on a short or
        failed read."""
        numel = _check_record_buffer(self.records[group.key], into)
        for future in self.read_chunk(group, 0, numel, state_views(into, numel)):
            future.result()

    def write(self, group: "FlatGroup", source: Tensor) -> None:
        numel = _check_record_buffer(self.records[group.key], source)
        for future in self.write_chunk(group, 0, numel, state_views(source, numel)):
            future.result()

    # The read_/write_ pairs below start I/O and return its futures without waiting (`read` and `write`
    # above are the blocking whole-record moves). The caller keeps the tensors alive until the futures are
    # done and orders a read after any write of the same range (the ring: ring_slots.WriteOrder).
    def read_chunk(self, group: "FlatGroup", start: int, stop: int, sections: Tuple[Tensor, Tensor, Tensor],
                   weights: Optional[Tensor] = None) -> List[IOFuture]:
        """Start reading elements [start, stop) of the group's three sections into the given fp32 tensors,
        and of its compute weights into `weights` when given and the weights are on disk; one future per
        piece."""
        return self._chunk(self.read_section, self.read_weights, group, start, stop, sections, weights)

    def write_chunk(self, group: "FlatGroup", start: int, stop: int, sections: Tuple[Tensor, Tensor, Tensor],
                    weights: Optional[Tensor] = None) -> List[IOFuture]:
        """Start writing elements [start, stop) of the group's three sections from the given fp32 tensors,
        and of its compute weights from `weights` when given and the weights are on disk; one future per
        piece."""
        return self._chunk(self.write_section, self.write_weights, group, start, stop, sections, weights)

    def _chunk(self, section_io: Callable[..., IOFuture], weights_io: Callable[..., IOFuture], group: "FlatGroup",
               start: int, stop: int, sections: Tuple[Tensor, Tensor, Tensor],
               weights: Optional[Tensor]) -> List[IOFuture]:
        """The body of `read_chunk` and `write_chunk`, given the direction's section and weights methods."""
        futures: List = []
        try:
            if weights is not None and group.key in self.weights:
                futures.append(weights_io(group, start, weights[:stop - start]))
            for index, tensor in enumerate(sections):
                futures.append(section_io(group, index, start, tensor[:stop - start]))
        except BaseException:
            try:  # the pieces already started use the caller's buffers: finish them before it reuses them
                wait_all(futures)
            except BaseException:  # noqa: B902 - the submission error is the one to report
                pass
            raise
        return futures

    def read_section(self, group: "FlatGroup", index: int, start: int, tensor: Tensor) -> IOFuture:
        """Start reading elements [start, start + numel) of one section (0 master, 1 exp_avg, 2 exp_avg_sq)
        into the fp32 `tensor`; verified against its seals once read (`_read`)."""
        return self._read(*self._section_piece(group, index, start), start, tensor)

    def write_section(self, group: "FlatGroup", index: int, start: int, tensor: Tensor) -> IOFuture:
        """Start writing the fp32 `tensor` to elements [start, start + numel) of one section (0 master,
        1 exp_avg, 2 exp_avg_sq); sealed before it is written (`_write`)."""
        return self._write(*self._section_piece(group, index, start), start, tensor)

    def _section_piece(self, group: "FlatGroup", index: int, start: int) -> Tuple[tuple, int, str]:
        """(checksum key, file offset, block) of a section's piece from element `start`."""
        record = self.records[group.key]
        return (group.key, index), record.offset + index * record.section_bytes + 4 * start, record.block

    def adopt(self, group: "FlatGroup", index: int, start: int, tensor: Tensor) -> None:
        """The file already holds `tensor` at elements [start, ...) of a section (a checkpoint cloned it there
        copy-on-write): seal it as if it had been written, so later reads of the piece are verified."""
        self.checksums.seal((group.key, index), start, tensor)

    def read_weights(self, group: "FlatGroup", start: int, tensor: Tensor) -> IOFuture:
        """Start reading the group's compute weights from element `start` into `tensor` (its dtype)."""
        return self._read(*self._array_piece(WEIGHTS, group, start), start, tensor)

    def write_weights(self, group: "FlatGroup", start: int, tensor: Tensor) -> IOFuture:
        """Start writing `tensor` (the group's compute dtype) to the group's compute weights from element
        `start`."""
        return self._write(*self._array_piece(WEIGHTS, group, start), start, tensor)

    def read_grads(self, group: "FlatGroup", start: int, tensor: Tensor) -> IOFuture:
        """Start reading the group's spilled gradient from element `start` into `tensor` (its dtype)."""
        return self._read(*self._array_piece(GRADS, group, start), start, tensor)

    def write_grads(self, group: "FlatGroup", start: int, tensor: Tensor) -> IOFuture:
        """Start writing `tensor` to the group's gradient record from element `start`."""
        return self._write(*self._array_piece(GRADS, group, start), start, tensor)

    def _array_piece(self, kind: str, group: "FlatGroup", start: int) -> Tuple[tuple, int, str]:
        record = (self.weights if kind == WEIGHTS else self.grads)[group.key]
        return (group.key, kind), record.offset + start * record.itemsize, record.block

    def _read(self, key: tuple, offset: int, block: str, start: int, tensor: Tensor):
        """One piece of a record, verified after it is read (disk_checksums.py)."""
        self.bytes_read += tensor.numel() * tensor.element_size()
        future = self._io.pread(tensor, self._file, offset)
        return VerifiedRead(future, ReadPiece(self.checksums, key, start, tensor, self.path, block, offset))

    def _write(self, key: tuple, offset: int, block: str, start: int, tensor: Tensor):
        """One piece of a record, sealed before it is written (disk_checksums.py): no reader ever checks new
        bytes against an old seal."""
        self.checksums.seal(key, start, tensor)
        self.bytes_written += tensor.numel() * tensor.element_size()
        return self._io.pwrite(tensor, self._file, offset)

    def section_spans(self, group: "FlatGroup") -> Tuple[int, Tuple[int, int, int], int]:
        """(file descriptor, file offset of each of the three sections, data bytes per section = 4 x numel),
        for copy-on-write clones of a record section by section (each section starts 4 KiB-aligned)."""
        record = self.records[group.key]
        offsets = tuple(record.offset + index * record.section_bytes for index in range(3))
        return self._file.buffered_fd, offsets, 4 * record.numel  # type: ignore[return-value]

    def close(self) -> None:
        """Close and delete the swap file and its layout (this run's state only)."""
        try:
            self._io.close()
        finally:
            self._forget.detach()
            _remove_files((self.path, self.layout_path), os.getpid())


def _remove_files(paths: Tuple[str, ...], owner_pid: int) -> None:
    """Delete this process's swap files (never a forked child's copy of the store: the parent owns them)."""
    if os.getpid() != owner_pid:
        return
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _check_record_buffer(record: SwapRecord, buffer: Tensor) -> int:
    """A whole-record buffer must hold the padded sections (layout v2), or a section would be cut short."""
    if buffer.numel() * buffer.element_size() < record.nbytes:
        raise ValueError(f"buffer of {buffer.numel() * buffer.element_size()} bytes for the record of block "
                         f"{record.block!r}, which needs {record.nbytes} (3 sections of {record.section_bytes})")
    return record.numel


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def state_views(buffer: Tensor, numel: int) -> Tuple[Tensor, Tensor, Tensor]:
    """master, exp_avg, exp_avg_sq as views of one record-sized buffer (`SwapRecord.nbytes`): each section
    starts at a multiple of `section_bytes(numel)`, as on disk."""
    stride = section_bytes(numel) // 4
    flat = buffer.view(torch.float32)
    return flat[:numel], flat[stride:stride + numel], flat[2 * stride:2 * stride + numel]
