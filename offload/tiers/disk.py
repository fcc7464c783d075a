"""The disk tier: optimizer state of every block in one preallocated swap file, laid out by name.

Each flat group with trainable parameters owns a state record: three sections, its fp32 master weights, then
`exp_avg`, then `exp_avg_sq` (swap_layout.py), each padded to a multiple of 4 KiB, the record starting at a
4 KiB-aligned offset, so any element range of any section is one O_DIRECT request when the range starts at a
multiple of 1024 elements and the step pipeline reads and writes records in chunks. A group may also keep its
compute weights (a weights record) and its waiting gradient (a grads record). The layout is a pure function of
the groups' shapes and is written next to the swap file as `layout.json`, keyed by block and fully-qualified
parameter names, never by object ids, so a later process can find every parameter's state again. See
docs/design.md [Note: the swap-file layout].

One verb per direction: `read(kind, key, start, data)` and `write(...)` move elements [start, ...) of one
record (`RecordKind`: a state chunk's sections, or a stretch of the weights or gradient array) as one request
with one future, its pieces sealed on write and verified on read (disk_checksums.py); the blocking forms are
`read(...).result()`.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import uuid
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.io import AsyncIO, SwapFile
from offload.io.future import IOFuture
from offload.io.swap_file import file_system_of
from offload.optim.moment_format import INT8_BLOCK, BlockLayout, Moment, QuantizedMoment
from offload.tiers.disk_checksums import Piece, RecordChecksums, VerifiedRead
from offload.tiers.swap_layout import (
    ALIGNMENT,
    GRADS,
    LAYOUT_VERSION,
    SCALES,
    STATE_TENSORS,
    WEIGHTS,
    ShadowRecords,
    SwapRecord,
    WeightRecord,
    section_bytes,
)
from offload.tiers.swap_leftovers import hold_lock, remove_leftovers

# a chunk of master weights and the two moments, in their format (a section None: not moved)
StateSections = Tuple[Optional[Tensor], Optional[Moment], Optional[Moment]]


class RecordKind(enum.Enum):
    """Which record of a group a move is of."""

    STATE = "state"  # its optimizer state: a chunk's three sections
    WEIGHTS = WEIGHTS  # its compute weights (the blocks the plan puts on disk)
    GRADS = GRADS  # its gradient, waiting on disk (gradients on disk)


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
    """The swap file of one engine: created at wrap(), preallocated, removed at close(). Records are keyed by
    their group's layout key (`GroupShape.key`).

    A group may have a second copy of its state record (and of its weight record, when its weights live on disk):
    its shadow, which a speculative update writes (`write(..., shadow=True)`) while reads keep getting the live
    copy; `flip` makes the shadow the live copy, with no byte moved (docs/design.md [Note: speculative
    clipping])."""

    def __init__(self, directory: str, records: Dict[str, SwapRecord], size: int,
                 weights: Optional[Dict[str, WeightRecord]] = None,
                 grads: Optional[Dict[str, WeightRecord]] = None,
                 shadows: Optional[ShadowRecords] = None) -> None:
        remove_leftovers(directory)  # of crashed runs: before the room check, so their space counts
        check_room(directory, size)
        self.directory = directory
        self.records = records  # state records by the group's layout key, as `weights`, `grads` and the seals
        self.weights: Dict[str, WeightRecord] = weights or {}
        self.grads: Dict[str, WeightRecord] = grads or {}  # spilled gradients (plan.grads_on_disk)
        self.shadows = shadows or ShadowRecords({}, {})
        self._shadow_live: Dict[str, bool] = {}  # a group's key -> True while its shadow copy is the live one
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
        # int8 state records' block layouts by key (blocks start over at each parameter), set by the ring that
        # moves them (`DiskRing.blocks`); a record without one is one run from element 0
        self.blocks: Dict[str, BlockLayout] = {}
        self._write_layout(size)

    def _write_layout(self, size: int) -> None:
        layout = {"version": LAYOUT_VERSION, "swap_file": os.path.basename(self.path), "size": size,
                  "tensors": list(STATE_TENSORS), "records": [r.as_json() for r in self.records.values()],
                  "weights": [r.as_json() for r in self.weights.values()],
                  "grads": [r.as_json() for r in self.grads.values()],
                  "shadow_records": [r.as_json() for r in self.shadows.state.values()],
                  "shadow_weights": [r.as_json() for r in self.shadows.weights.values()]}
        tmp = self.layout_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(layout, f, indent=1)
        os.replace(tmp, self.layout_path)

    # ----- the one read and the one write ----------------------------------------------------------------
    def read(self, kind: RecordKind, key: str, start: int, data: Union[StateSections, Tensor],
             shadow: bool = False) -> IOFuture:
        """Start reading elements [start, ...) of the group's record of `kind` (its live copy, or its shadow:
        `shadow`) into `data` (a state chunk's sections, each the chunk's size, None for a section not read; or a
        tensor in the record's dtype): one request, verified against its seals when its result is taken. The caller
        keeps the tensors alive until it is done and orders a read after any write of the same range (the ring:
        ring_slots.WriteOrder)."""
        pieces, block = self._pieces(kind, key, start, data, shadow)
        self.bytes_read += sum(p.data.nbytes for p in pieces)
        future = self._io.preadv([(p.data, p.offset) for p in pieces], self._file)
        return VerifiedRead(future, self.checksums, pieces, self.path, block)

    def write(self, kind: RecordKind, key: str, start: int, data: Union[StateSections, Tensor],
              shadow: bool = False, crcs: Optional[Sequence[int]] = None,
              in_file: Sequence[int] = (0, 0, 0)) -> IOFuture:
        """Start writing `data` to elements [start, ...) of the group's record of `kind` (its live copy, or its
        shadow: `shadow`), sealed first (no reader ever checks new bytes against an old seal): one request.
        `crcs`: the checksum of each piece `data` is cut into (`step_seals`), computed by whoever wrote it, when
        `checksums.algorithm` is crc32c; else they are computed here. `in_file`: for each state section, how many
        of its leading elements (values or codes) the file holds already, a checkpoint having cloned them there
        copy-on-write: they are sealed with the rest of their piece, and not written."""
        pieces, _block = self._pieces(kind, key, start, data, shadow)
        self.checksums.seal(pieces, crcs)
        if any(in_file):  # a load after clones; every step's writes take the plain path
            writes = [w for w in (_not_in_file(p, in_file) for p in pieces) if w is not None]
        else:
            writes = [(p.data, p.offset) for p in pieces]
        self.bytes_written += sum(tensor.nbytes for tensor, _offset in writes)
        return self._io.pwritev(writes, self._file)

    def has_shadow(self, key: str) -> bool:
        """Whether the group's records have a second copy (speculative updates write it)."""
        return key in self.shadows.state

    def has_weight_shadow(self, key: str) -> bool:
        """Whether the group's weight record (weights on disk) has a second copy."""
        return key in self.shadows.weights

    def flip(self, key: str) -> None:
        """The group's shadow copies (state, and weights when they live on disk) become its live ones, and the
        live ones its shadows: a speculative update is committed."""
        assert self.has_shadow(key)
        self._shadow_live[key] = not self._shadow_live.get(key, False)

    def live_copy(self, key: str) -> int:
        """Which of the group's two state copies is live now (0: the first, 1: its shadow record): a copy named
        this way stays the same bytes across `flip`s."""
        return int(self._shadow_live.get(key, False))

    def _copy(self, key: str, shadow: bool) -> bool:
        """Whether the copy meant (the live one, or the shadow) is the second one."""
        second = self._shadow_live.get(key, False) != shadow
        if second and key not in self.shadows.state:
            raise KeyError(f"the record {key!r} has no shadow copy")
        return second

    def _state_record(self, key: str, shadow: bool) -> Tuple[str, SwapRecord]:
        """(the key its seals are under, the record) of the group's state copy meant."""
        if self._copy(key, shadow):
            return key + SHADOW_SUFFIX, self.shadows.state[key]
        return key, self.records[key]

    def _pieces(self, kind: RecordKind, key: str, start: int, data: Union[StateSections, Tensor],
                shadow: bool) -> Tuple[List[Piece], str]:
        """The file's byte ranges `data` covers, each with its seal's key and first element; the block's name."""
        if kind is RecordKind.STATE:
            assert isinstance(data, tuple)
            seal_key, record = self._state_record(key, shadow)
            return _state_pieces(record, seal_key, start, data, self.blocks.get(key)), record.block
        assert isinstance(data, Tensor)
        seal_key = key
        if kind is RecordKind.WEIGHTS and key in self.shadows.weights and self._copy(key, shadow):
            array, seal_key = self.shadows.weights[key], key + SHADOW_SUFFIX
        else:
            array = (self.weights if kind is RecordKind.WEIGHTS else self.grads)[key]
        if start < 0 or start + data.numel() > array.numel:
            raise ValueError(f"elements [{start}, {start + data.numel()}) of the {kind.value} record of block "
                             f"{array.block!r}, which holds {array.numel}")
        return [Piece((seal_key, kind.value), start, data, array.offset + start * array.itemsize)], array.block

    def section_spans(self, key: str) -> Tuple[int, Tuple[int, int, int], Tuple[int, int, int]]:
        """(file descriptor, file offset of each of the three sections of its live copy, the bytes of the
        values each starts with: 4 x numel of master weights, then each moment's values or int8 codes (its scales
        come after padding)), for copy-on-write clones of a record section by section (each section starts 4
        KiB-aligned)."""
        _seal_key, record = self._state_record(key, shadow=False)
        codes = record.code_itemsize * record.numel
        return self._file.buffered_fd, record.section_offsets, (4 * record.numel, codes, codes)

    def close(self) -> None:
        """Close and delete the swap file and its layout (this run's state only)."""
        try:
            self._io.close()
        finally:
            self._forget.detach()
            _remove_files((self.path, self.layout_path), os.getpid())


def _not_in_file(piece: Piece, in_file: Sequence[int]) -> Optional[Tuple[Tensor, int]]:
    """(data, file offset) of what a piece adds to the file: all of it, but for a state section's values or codes
    (not its int8 scales) the elements below that section's `in_file` count, which a clone put there."""
    section = piece.key[1] if isinstance(piece.key, tuple) and len(piece.key) == 2 else None
    below = in_file[section] if isinstance(section, int) else 0
    skip = min(max(below - piece.start, 0), piece.data.numel())
    if skip and skip == piece.data.numel():
        return None
    return piece.data.reshape(-1)[skip:], piece.offset + skip * piece.data.element_size()


SHADOW_SUFFIX = "#shadow"  # the seals of a group's second copy are under its key with this suffix


def _state_pieces(record: SwapRecord, key: str, start: int, sections: Sequence[Optional[Moment]],
                  blocks: Optional[BlockLayout] = None) -> List[Piece]:
    """A state chunk's pieces: the master weights, and each moment as its values, or as its int8 codes and
    scales (two pieces, each sealed on its own), from element `start` of each given section; `blocks`: the
    record's int8 block layout (None: one run from element 0)."""
    pieces: List[Piece] = []
    for index, section in enumerate(sections):
        if section is None:
            continue
        numel = section.codes.numel() if isinstance(section, QuantizedMoment) else section.numel()
        if start < 0 or start + numel > record.numel:
            raise ValueError(f"elements [{start}, {start + numel}) of section {index} of the state record of block "
                             f"{record.block!r}, which holds {record.numel}")
        at = record.section_offsets[index]
        if index == 0:
            assert isinstance(section, Tensor)
            pieces.append(Piece((key, 0), start, section, at + 4 * start))
        elif isinstance(section, QuantizedMoment):
            block = start // INT8_BLOCK if blocks is None else blocks.scales_before(start)
            pieces.append(Piece((key, index), start, section.codes, at + start))
            pieces.append(Piece((key, index, SCALES), block, section.scales, at + record.scales_at + 4 * block))
        else:
            pieces.append(Piece((key, index), start, section, at + record.code_itemsize * start))
    return pieces


ChunkSeals = Tuple[List[int], Optional[List[int]]]  # a chunk's state pieces' checksums, its compute weights' (or None)


def step_seals(crcs: Sequence[int], sections: Sequence[Optional[Moment]], with_weights: bool) -> ChunkSeals:
    """The seals of a state chunk written by a compressed-moment step from the CRCs the step returned
    (offload.optim.moments.CRC_PIECES order: param, exp_avg, exp_avg_scales, exp_avg_sq, exp_avg_sq_scales, out): the
    state's in `_state_pieces` order (an int8 moment is two pieces, codes and scales), and the compute weights' (its
    `out`) when they move with the chunk."""
    state = [int(crcs[0])]
    for section, (codes, scales) in zip(sections[1:], ((1, 2), (3, 4))):
        state.append(int(crcs[codes]))
        if isinstance(section, QuantizedMoment):
            state.append(int(crcs[scales]))
    return state, [int(crcs[5])] if with_weights else None


def _remove_files(paths: Tuple[str, ...], owner_pid: int) -> None:
    """Delete this process's swap files (never a forked child's copy of the store: the parent owns them)."""
    if os.getpid() != owner_pid:
        return
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def state_views(buffer: Tensor, numel: int) -> Tuple[Tensor, Tensor, Tensor]:
    """master, exp_avg, exp_avg_sq as views of one record-sized buffer (`SwapRecord.nbytes`): each section
    starts at a multiple of `section_bytes(numel)`, as on disk."""
    stride = section_bytes(numel) // 4
    flat = buffer.view(torch.float32)
    return flat[:numel], flat[stride:stride + numel], flat[2 * stride:2 * stride + numel]
