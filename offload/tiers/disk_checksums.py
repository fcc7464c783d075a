"""Checksums of the swap file's contents: sealed when a range is written, verified when it is read back.

The nvme pipeline moves records in chunks, and other readers (weight fetches) may read whole records, so
checksums cover written *pieces*: (section, first element, element count). Checkpoints read and write
records along the ring's chunks, so they verify, and seal, exactly the pieces the ring uses. A write drops the
seals it overlaps and seals its own piece; a read verifies every sealed piece it covers entirely. A range
never written by this process (fresh preallocated zeros) has no seal and is not checked.
"""

from __future__ import annotations

import threading
from typing import Dict, Hashable, NamedTuple, Tuple

from torch import Tensor

from offload.checksum import checksum, preferred_algorithm
from offload.errors import OffloadIntegrityError

Piece = Tuple[int, int]  # (first element, element count)


class RecordChecksums:
    """Checksum of each piece of each section as last written by this process. Thread-safe."""

    def __init__(self) -> None:
        self._pieces: Dict[Hashable, Dict[int, Tuple[int, int]]] = {}  # key -> start -> (count, crc)
        self._lock = threading.Lock()
        self.algorithm = preferred_algorithm()  # crc32c with the native core, else zlib's crc32 (both fast)

    def seal(self, key: Hashable, start: int, data: Tensor) -> None:
        """Record the checksum of `data`, about to be written as elements [start, start + numel) of `key`."""
        count = data.numel()
        crc = checksum(data, self.algorithm)
        with self._lock:
            pieces = self._pieces.setdefault(key, {})
            for s in [s for s, (n, _c) in pieces.items() if s < start + count and start < s + n]:
                del pieces[s]  # overlapped by this write: stale
            pieces[start] = (count, crc)

    def verify(self, key: Hashable, start: int, data: Tensor, path: str, block: str, offset: int) -> None:
        """Check every sealed piece inside elements [start, start + numel) of `key` against `data`."""
        stop = start + data.numel()
        with self._lock:
            inside = [(s, n, c) for s, (n, c) in self._pieces.get(key, {}).items() if s >= start and s + n <= stop]
        itemsize = data.element_size()
        for s, n, expected in inside:
            if checksum(data[s - start:s - start + n], self.algorithm) != expected:
                raise OffloadIntegrityError(
                    f"swap file {path!r}: block {block!r}, {n * itemsize} bytes at file offset "
                    f"{offset + (s - start) * itemsize} do not match their checksum: the file was changed or "
                    "damaged under the running engine", path)


class ReadPiece(NamedTuple):
    """What a read's data is checked against once it has arrived: the seals of `key` inside
    [start, start + numel) (`path`, `block` and `offset` for the error)."""

    checksums: RecordChecksums
    key: Hashable
    start: int
    data: Tensor
    path: str
    block: str
    offset: int

    def verify(self) -> None:
        self.checksums.verify(self.key, self.start, self.data, self.path, self.block, self.offset)


class VerifiedRead:
    """A read's future that checks the data against its seals once the read has completed."""

    def __init__(self, future, piece: ReadPiece) -> None:
        self._future = future
        self._piece = piece
        self._checked = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout=None) -> int:
        nbytes = self._future.result(timeout)
        if not self._checked:
            self._piece.verify()
            self._checked = True
        return nbytes
