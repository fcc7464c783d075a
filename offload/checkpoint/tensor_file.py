"""A safetensors file written and read one tensor at a time, with a checksum per tensor.

The safetensors layout (8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes) lets us write the header first, because the engine knows every
name, dtype and shape before it reads any data, and then stream tensors in header order: nothing larger
than one tensor (or one staged record) is ever held in memory. The result loads with
`safetensors.torch.load_file`. Reads go straight into the caller's tensor and are checked against the
checksums the manifest holds.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from offload.checksum import checksum
from offload.errors import OffloadIntegrityError, OffloadIOError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}


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
        return numel * torch.empty((), dtype=self.dtype).element_size()


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
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class TensorFileWriter:
    """Writes `entries` in order; `write(name, tensor)` returns the tensor's checksum. `close()` fsyncs."""

    def __init__(self, path: str, entries: Sequence[Entry], algorithm: str,
                 metadata: Optional[Dict[str, str]] = None, align: int = 8) -> None:
        self.path = path
        self._entries = list(entries)
        self._next = 0
        self._algorithm = algorithm
        self.checksums: Dict[str, int] = {}
        self._file = open(path, "wb", buffering=0)
        self._put(_header(entries, metadata, align))

    def _put(self, data) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                written = self._file.write(view)
                view = view[written:]
        except OSError as exc:
            raise OffloadIOError.from_errno(exc.errno or 5, self.path, self._file.tell(), len(view), "write") from None

    def write(self, name: str, tensor: Tensor) -> int:
        entry = self._entries[self._next]
        if entry.name != name or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise AssertionError(f"{self.path}: expected {entry} next, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        host = tensor.detach().contiguous().cpu() if tensor.device.type != "cpu" else tensor.detach().contiguous()
        data = _bytes_of(host)
        self._put(data)
        value = checksum(data, self._algorithm)
        self.checksums[name] = value
        self._next += 1
        return value

    @property
    def next_name(self) -> str:
        """Name of the entry the next write must be ("" when all are written)."""
        return self._entries[self._next].name if self._next < len(self._entries) else ""

    def write_zeros(self, name: str) -> None:
        """The next entry (alignment padding) as zeros."""
        entry = self._entries[self._next]
        self.write(name, torch.zeros(entry.shape, dtype=entry.dtype))

    def clone(self, items: Sequence[Tuple[str, Tensor]], src_fd: int, src_offset: int) -> bool:
        """The next entries, whose bytes are src[src_offset:...] in order, as a copy-on-write clone of that
        range (the unaligned tail is written). `items` are host copies, for the checksums. False (nothing
        done) when the file system cannot clone."""
        from offload.checkpoint.reflink import BLOCK, clone_range

        position = self._file.tell()
        total = sum(t.numel() * t.element_size() for _n, t in items)
        aligned = total // BLOCK * BLOCK
        if not clone_range(src_fd, src_offset, aligned, self._file.fileno(), position):
            return False
        self._file.seek(position + aligned)
        skip = aligned
        for name, tensor in items:
            entry = self._entries[self._next]
            if entry.name != name or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise AssertionError(f"{self.path}: expected {entry} next, got {name}")
            data = _bytes_of(tensor.contiguous())
            if skip < len(data):
                self._put(data[skip:])
            skip = max(0, skip - len(data))
            self.checksums[name] = checksum(data, self._algorithm)
            self._next += 1
        return True

    def close(self) -> None:
        """Flush to stable storage; an incomplete file is a bug in the caller."""
        if self._next != len(self._entries):
            raise AssertionError(f"{self.path}: {len(self._entries) - self._next} tensors were not written")
        try:
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
        self._verified: set = set()
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

    def read_into(self, name: str, out: Tensor) -> None:
        """Fill the contiguous CPU tensor `out` with tensor `name`, verifying its checksum."""
        if name not in self.entries:
            raise OffloadIntegrityError(f"checkpoint file {self.path!r} has no tensor {name!r} "
                                        f"(block {self._blocks.get(name, '?')!r})", self.path)
        dtype, shape, start, stop = self.entries[name]
        if dtype != out.dtype or stop - start != out.numel() * out.element_size():
            raise OffloadIntegrityError(
                f"{self.path!r}: tensor {name!r} is {dtype} {shape}, the model needs {out.dtype} "
                f"{tuple(out.shape)}: the checkpoint belongs to another model", self.path)
        view = _bytes_of(out)
        done = 0
        while done < len(view):
            got = os.preadv(self._file.fileno(), [view[done:]], self._base + start + done)
            if got <= 0:
                raise OffloadIntegrityError(f"{self.path!r}: short read of tensor {name!r}", self.path)
            done += got
        expected = self._checksums.get(name)
        if expected is None:
            raise OffloadIntegrityError(f"the manifest has no checksum for {name!r} of {self.path!r}", self.path)
        if checksum(view, self._algorithm) != expected:
            raise OffloadIntegrityError(
                f"checksum mismatch in {self.path!r}, tensor {name!r} of block {self._blocks.get(name, '?')!r}: "
                "the file was damaged after it was written", self.path)
        self._verified.add(name)

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

    def verify_rest(self) -> None:
        """Check the tensors not read so far (tied aliases, entries this model does not use), one at a time."""
        for name, (dtype, shape, _start, _stop) in self.entries.items():
            if name not in self._verified:
                self.read_into(name, torch.empty(shape, dtype=dtype))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TensorFileReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def entries_of(tensors: List[Tuple[str, Tensor]]) -> List[Entry]:
    return [Entry(name, t.dtype, tuple(t.shape)) for name, t in tensors]
