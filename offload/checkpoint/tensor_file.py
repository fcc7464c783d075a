"""A safetensors file written and read one tensor at a time, with a checksum per tensor.

The safetensors layout (8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes) lets us write the header first, because the engine knows every
name, dtype and shape before it reads any data, and then put each tensor at its place, whole or in parts
(a swap record arrives chunk by chunk, its three sections interleaved), building each checksum as the
parts arrive: nothing larger than the caller's buffer is ever held here. The result loads with
`safetensors.torch.load_file`. Reads go straight into the caller's tensor, whole or in parts, and are
checked against the checksums the manifest holds; `verify_all` checks a whole file through one buffer.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from offload.checksum import checksum
from offload.errors import OffloadIntegrityError, OffloadIOError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}


def dtype_of_code(code: str) -> Optional[torch.dtype]:
    """The torch dtype of a safetensors dtype code ("BF16", "F32", ...), None for one offload cannot hold."""
    return _BY_CODE.get(code)


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, dtype and shape (the header order is the data order)."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def dtype_code(dtype: torch.dtype) -> str:
    return _DTYPES[dtype]


def _header(entries: Sequence[Entry], metadata: Optional[Dict[str, str]], align: int = 8) -> bytes:
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)  # JSON allows trailing spaces; the data then starts aligned
    return struct.pack("<Q", len(raw)) + raw


def _bytes_of(tensor: Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


class TensorFileWriter:
    """Writes the data of `entries` behind their header, each tensor at its place: whole (`write`) or in
    parts, in order within a tensor (`put`), so a record can arrive chunk by chunk and section by section.
    Each tensor's checksum is built as its parts arrive. `close()` fsyncs."""

    def __init__(self, path: str, entries: Sequence[Entry], algorithm: str,
                 metadata: Optional[Dict[str, str]] = None, align: int = 8) -> None:
        self.path = path
        self._algorithm = algorithm
        self.checksums: Dict[str, int] = {}
        self._running: Dict[str, Tuple[int, int]] = {}  # name -> (bytes so far, checksum so far)
        self._file = open(path, "wb", buffering=0)
        header = _header(entries, metadata, align)
        self._places: Dict[str, Tuple[Entry, int]] = {}  # name -> (entry, absolute file offset)
        offset = len(header)
        for entry in entries:
            self._places[entry.name] = (entry, offset)
            offset += entry.nbytes
        self._size = offset
        self._pwrite(header, 0)

    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.pwrite(self._file.fileno(), view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            raise OffloadIOError.from_errno(exc.errno or 5, self.path, offset, len(view), "write") from None

    def offset_of(self, name: str) -> int:
        """Absolute file offset of tensor `name`'s data."""
        return self._places[name][1]

    def put(self, name: str, start: int, data: memoryview, written: bool = True) -> None:
        """Bytes [start, start + len(data)) of tensor `name`, which must follow the part before; `written`
        False: the file already holds them (cloned), they only enter the checksum."""
        entry, offset = self._places[name]
        done, value = self._running.get(name, (0, 0))
        if start != done or done + len(data) > entry.nbytes or name in self.checksums:
            raise AssertionError(f"{self.path}: {name} part at byte {start} of {entry.nbytes}, expected {done}")
        if written:
            self._pwrite(data, offset + start)
        value = checksum(data, self._algorithm, value)
        if done + len(data) == entry.nbytes:
            self.checksums[name] = value
            self._running.pop(name, None)
        else:
            self._running[name] = (done + len(data), value)

    def write(self, name: str, tensor: Tensor) -> None:
        """The whole tensor `name` (its dtype and shape checked against the header)."""
        entry = self._places[name][0]
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise AssertionError(f"{self.path}: expected {entry}, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        host = tensor.detach().contiguous().cpu() if tensor.device.type != "cpu" else tensor.detach().contiguous()
        self.put(name, 0, _bytes_of(host))

    def write_zeros(self, name: str) -> None:
        """Tensor `name` (alignment padding) as zeros."""
        entry = self._places[name][0]
        self.write(name, torch.zeros(entry.shape, dtype=entry.dtype))

    def clone(self, name: str, nbytes: int, src_fd: int, src_offset: int) -> bool:
        """Make the first `nbytes` from tensor `name` on a copy-on-write clone of src[src_offset:+nbytes]
        (they may run on into the tensors after it). False (nothing done) when the file system cannot clone
        or a range is not block-aligned. The bytes still go through `put(..., written=False)`."""
        from offload.checkpoint.reflink import clone_range

        return clone_range(src_fd, src_offset, nbytes, self._file.fileno(), self.offset_of(name))

    def close(self) -> None:
        """Flush to stable storage; an incomplete file is a bug in the caller."""
        for name, (entry, _offset) in self._places.items():
            if entry.nbytes == 0 and name not in self.checksums:
                self.checksums[name] = checksum(b"", self._algorithm)
        missing = [name for name in self._places if name not in self.checksums]
        try:
            if missing:
                raise AssertionError(f"{self.path}: {len(missing)} tensors were not written (first: {missing[0]})")
            size = os.fstat(self._file.fileno()).st_size
            if size != self._size:
                raise AssertionError(f"{self.path}: {size} bytes written, the header needs {self._size}")
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OffloadIOError.from_errno(exc.errno or 5, self.path, 0, 0, "fsync") from None
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()


class TensorFileReader:
    """Reads named tensors of a safetensors file into the caller's memory, checking size and checksums."""

    def __init__(self, path: str, checksums: Dict[str, int], algorithm: str, blocks: Dict[str, str]) -> None:
        self.path = path
        self._checksums = checksums
        self._algorithm = algorithm
        self._blocks = blocks  # tensor name -> block name, for error messages
        try:
            self._file = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise OffloadIntegrityError(f"checkpoint file {path!r} is missing", path) from None
        size = os.fstat(self._file.fileno()).st_size
        try:
            head = self._file.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or length > size - 8:
                raise ValueError("header length out of range")
            header = json.loads(self._file.read(length))
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            self._file.close()
            raise OffloadIntegrityError(f"checkpoint file {path!r} has a damaged header ({exc})", path) from None
        header.pop("__metadata__", None)
        self._base = 8 + length
        self.entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
        self._running: Dict[str, Tuple[int, int]] = {}  # name -> (bytes read so far, checksum so far)
        end = 0
        for name, info in header.items():
            start, stop = info["data_offsets"]
            self.entries[name] = (_BY_CODE[info["dtype"]], tuple(info["shape"]), start, stop)
            end = max(end, stop)
        if size != self._base + end:
            self._file.close()
            raise OffloadIntegrityError(
                f"checkpoint file {path!r} is {size} bytes, its header says {self._base + end}: truncated or "
                "extended after it was written", path)

    def dtype_of(self, name: str) -> Optional[torch.dtype]:
        """The dtype tensor `name` is stored in (None: the file has no such tensor)."""
        entry = self.entries.get(name)
        return entry[0] if entry is not None else None

    def require(self, name: str, numel: int, dtype: Optional[torch.dtype] = None) -> None:
        """Tensor `name` exists with `numel` elements (of `dtype` when given), else the checkpoint belongs
        to another model: checked before anything is read."""
        if name not in self.entries:
            raise OffloadIntegrityError(f"checkpoint file {self.path!r} has no tensor {name!r} "
                                        f"(block {self._blocks.get(name, '?')!r})", self.path)
        have, shape, start, stop = self.entries[name]
        count = 1
        for d in shape:
            count *= d
        itemsize = have.itemsize
        if count != numel or stop - start != count * itemsize or (dtype is not None and have != dtype):
            raise OffloadIntegrityError(
                f"{self.path!r}: tensor {name!r} is {have} {shape}, the model needs {numel} elements"
                f"{f' of {dtype}' if dtype is not None else ''}: the checkpoint belongs to another model", self.path)

    def read_into(self, name: str, out: Tensor) -> None:
        """Fill the contiguous CPU tensor `out` with tensor `name`, verifying its checksum."""
        self.require(name, out.numel(), out.dtype)
        self.read_part(name, 0, out)

    def read_part(self, name: str, start: int, out: Tensor) -> None:
        """Fill the contiguous CPU tensor `out` with bytes [start, ...) of tensor `name`. Parts of a tensor
        come in order (each starting where the one before ended, or at 0 to start over); the tensor's
        checksum is verified when its last byte has been read."""
        _dtype, _shape, first, stop = self.entries[name]
        view = _bytes_of(out)
        done, value = self._running.get(name, (0, 0)) if start else (0, 0)
        if start != done or first + start + len(view) > stop:
            raise AssertionError(f"{self.path}: part of {name!r} at byte {start}, expected {done}")
        self._pread(view, self._base + first + start, name)
        value = checksum(view, self._algorithm, value)
        done += len(view)
        if done < stop - first:
            self._running[name] = (done, value)
            return
        self._running.pop(name, None)
        self._check(name, value)

    def read_at(self, name: str, start: int, out: Tensor) -> None:
        """Bytes [start, ...) of tensor `name` into `out`: through `read_part` (checksum verified when the
        last byte is read) while the tensor is read in order from its start; a part read from its middle (a
        data-parallel rank's share of a parameter) is read as it is, having been verified by `verify_all`."""
        running = self._running.get(name)
        if start == 0 or (running is not None and running[0] == start):
            self.read_part(name, start, out)
            return
        self._running.pop(name, None)
        _dtype, _shape, first, stop = self.entries[name]
        view = _bytes_of(out)
        if first + start + len(view) > stop:
            raise AssertionError(f"{self.path}: bytes {start}+{len(view)} of {name!r} lie beyond it")
        self._pread(view, self._base + first + start, name)

    def verify_all(self, scratch: memoryview, progress: Callable[[int], object] = lambda n: None) -> None:
        """Read every tensor through `scratch` (bounded memory, the caller's buffer) and check its checksum:
        the first pass of a load, which changes nothing. The two halves of `scratch` alternate: a helper
        thread reads the next piece while this one checksums the last (both release the GIL), and the
        kernel is told the file is read sequentially, so the pass runs at the disk's speed, not at the sum
        of read and checksum times."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        half = len(scratch) // 2
        buffers = (scratch[:half], scratch[half:2 * half])
        plan = []  # (name, file offset, bytes, last piece of the tensor)
        for name, (_dtype, _shape, start, stop) in self.entries.items():
            for offset in range(start, stop, half):
                plan.append((name, offset, min(half, stop - offset), offset + half >= stop))
        with ThreadPoolExecutor(1, thread_name_prefix="offload-verify") as reader:
            def read(i: int) -> Any:
                name, offset, size, _last = plan[i]
                view = buffers[i % 2][:size]
                return reader.submit(self._pread, view, self._base + offset, name)

            pending = read(0) if plan else None
            value = 0
            for i, (name, _offset, size, last) in enumerate(plan):
                assert pending is not None
                pending.result()
                pending = read(i + 1) if i + 1 < len(plan) else None  # the other half: free since piece i-1
                value = checksum(buffers[i % 2][:size], self._algorithm, value)
                progress(size)
                if last:
                    self._check(name, value)
                    value = 0
            if pending is not None:
                pending.result()

    def _pread(self, view: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            except OSError as exc:
                raise OffloadIOError.from_errno(exc.errno or 5, self.path, offset + done, len(view) - done,
                                                "read") from None
            if got <= 0:
                raise OffloadIntegrityError(f"{self.path!r}: short read of tensor {name!r}", self.path)
            done += got

    def _check(self, name: str, value: int) -> None:
        expected = self._checksums.get(name)
        if expected is None:
            raise OffloadIntegrityError(f"the manifest has no checksum for {name!r} of {self.path!r}", self.path)
        if value != expected:
            raise OffloadIntegrityError(
                f"checksum mismatch in {self.path!r}, tensor {name!r} of block {self._blocks.get(name, '?')!r}: "
                "the file was damaged after it was written", self.path)

    def span(self, names: Sequence[str]) -> Optional[Tuple[int, int]]:
        """(file offset, bytes) when the named tensors lie back to back in this order, else None."""
        if not names or any(n not in self.entries for n in names):
            return None
        first, end = self.entries[names[0]][2], self.entries[names[0]][2]
        for name in names:
            _dtype, _shape, start, stop = self.entries[name]
            if start != end:
                return None
            end = stop
        return self._base + first, end - first

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFileReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
