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
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.io import AsyncIO, SwapFile
from offload.io.future import IOFuture, wait_all
from offload.io.swap_file import file_system_of
from offload.optim.moment_format import INT8_BLOCK, Moment, MomentFormat, QuantizedMoment, code_nbytes, slice_moment
from offload.tiers.disk_checksums import ReadPiece, RecordChecksums, VerifiedRead
from offload.tiers.swap_layout import (
    ALIGNMENT,
    GRADS,
    LAYOUT_VERSION,
    SCALES,
    STATE_TENSORS,
    WEIGHTS,
    SwapRecord,
    WeightRecord,
    round_up,
    section_bytes,
)
from offload.tiers.swap_leftovers import hold_lock, remove_leftovers

if TYPE_CHECKING:  # descriptions only: the tiers never call into the scheduler
    from offload.scheduler.blocks.block import FlatGroup

StateSections = Tuple[Tensor, Moment, Moment]  # a chunk of master weights and the two moments, in their format


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
        records = [dict(r.__dict__, section_bytes=r.section_bytes, section_sizes=r.section_sizes)
                   for r in self.records.values()]
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
    def read_chunk(self, group: "FlatGroup", start: int, stop: int, sections: StateSections,
                   weights: Optional[Tensor] = None) -> List[IOFuture]:
        """Start reading elements [start, stop) of the group's three sections into the given fp32 tensors,
        and of its compute weights into `weights` when given and the weights are on disk; one future per
        piece."""
        return self._chunk(self.read_section, self.read_weights, group, start, stop, sections, weights)

    def write_chunk(self, group: "FlatGroup", start: int, stop: int, sections: StateSections,
                    weights: Optional[Tensor] = None) -> List[IOFuture]:
        """Start writing elements [start, stop) of the group's three sections from the given fp32 tensors,
        and of its compute weights from `weights` when given and the weights are on disk; one future per
        piece."""
        return self._chunk(self.write_section, self.write_weights, group, start, stop, sections, weights)

    def _chunk(self, section_io: Callable[..., IOFuture], weights_io: Callable[..., IOFuture], group: "FlatGroup",
               start: int, stop: int, sections: StateSections,
               weights: Optional[Tensor]) -> List[IOFuture]:
        """The body of `read_chunk` and `write_chunk`, given the direction's section and weights methods."""
        futures: List = []
        fmt = self.records[group.key].moment_format
        try:
            if weights is not None and group.key in self.weights:
                futures.append(weights_io(group, start, weights[:stop - start]))
            for index, section in enumerate(sections):
                if index and fmt is not MomentFormat.FP32:
                    futures.extend(self._moment_pieces(section_io, group, index, start,
                                                       slice_moment(section, fmt, 0, stop - start)))
                else:
                    futures.append(section_io(group, index, start, section[:stop - start]))
        except BaseException:
            try:  # the pieces already started use the caller's buffers: finish them before it reuses them
                wait_all(futures)
            except BaseException:  # noqa: B902 - the submission error is the one to report
                pass
            raise
        return futures

    def _moment_pieces(self, section_io: Callable[..., IOFuture], group: "FlatGroup", index: int, start: int,
                       moment: Moment) -> List[IOFuture]:
        """A compressed moment's chunk moves as its codes (values) and, for int8, its scales: two pieces of the
        section, each sealed and verified on its own."""
        if not isinstance(moment, QuantizedMoment):
            return [section_io(group, index, start, moment)]
        codes = section_io(group, index, start, moment.codes)
        try:
            return [codes, section_io(group, (index, SCALES), start, moment.scales)]
        except BaseException:
            wait_all([codes])
            raise

    def read_section(self, group: "FlatGroup", index: Union[int, Tuple[int, str]], start: int,
                     tensor: Tensor) -> IOFuture:
        """Start reading elements [start, start + numel) of one section (0 master, 1 exp_avg, 2 exp_avg_sq)
        into the fp32 `tensor`; verified against its seals once read (`_read`)."""
        return self._read(*self._section_piece(group, index, start), tensor)

    def write_section(self, group: "FlatGroup", index: Union[int, Tuple[int, str]], start: int,
                      tensor: Tensor) -> IOFuture:
        """Start writing the fp32 `tensor` to elements [start, start + numel) of one section (0 master,
        1 exp_avg, 2 exp_avg_sq); sealed before it is written (`_write`)."""
        return self._write(*self._section_piece(group, index, start), tensor)

    def _section_piece(self, group: "FlatGroup", index: Union[int, Tuple[int, str]], start: int,
                       ) -> Tuple[tuple, int, str, int]:
        """(checksum key, file offset, block, first element for the seals) of a section's piece from element
        `start`; `index` (i, SCALES) is the scales of moment section i, from its block of element `start`."""
        record = self.records[group.key]
        if isinstance(index, tuple):
            section, _ = index
            fmt = record.moment_format
            codes = round_up(code_nbytes(fmt, record.numel), ALIGNMENT)
            block = start // INT8_BLOCK
            return (group.key, section, SCALES), record.section_offset(section) + codes + 4 * block, record.block, block
        itemsize = 4 if index == 0 else code_nbytes(record.moment_format, 1)
        return (group.key, index), record.section_offset(index) + itemsize * start, record.block, start

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
    """A whole-record buffer must hold the padded sections (layout v2), or a section would be cut short; its three
    fp32 views (`state_views`) describe fp32 moments only."""
    if record.moment_format is not MomentFormat.FP32:
        raise ValueError(f"the record of block {record.block!r} keeps {record.moments} moments: move it chunk by chunk "
                         "(read_chunk / write_chunk with its moments), not as three fp32 sections")
    if buffer.numel() * buffer.element_size() < record.nbytes:
        raise ValueError(f"buffer of {buffer.numel() * buffer.element_size()} bytes for the record of block "
                         f"{record.block!r}, which needs {record.nbytes} (3 sections of {record.section_bytes})")
    return record.numel


def state_views(buffer: Tensor, numel: int) -> Tuple[Tensor, Tensor, Tensor]:
    """master, exp_avg, exp_avg_sq as views of one record-sized buffer (`SwapRecord.nbytes`): each section
    starts at a multiple of `section_bytes(numel)`, as on disk."""
    stride = section_bytes(numel) // 4
    flat = buffer.view(torch.float32)
    return flat[:numel], flat[stride:stride + numel], flat[2 * stride:2 * stride + numel]
