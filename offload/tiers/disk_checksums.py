"""Checksums of the swap file's contents: sealed when a range is written, verified when it is read back.

The nvme pipeline moves records in chunks, and other readers (weight fetches) may read whole records, so
checksums cover written *pieces*: (section, first element, element count). Checkpoints read and write
records along the ring's chunks, so they verify, and seal, exactly the pieces the ring uses. A write drops the
seals it overlaps and seals its own piece; a read verifies every sealed piece it covers entirely. A range
never written by this process (fresh preallocated zeros) has no seal and is not checked. The pieces of one
chunk are sealed, and verified, together: one checksum call for all of them.
"""

from __future__ import annotations

import threading
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

from torch import Tensor

from offload.checksum import checksums, preferred_algorithm
from offload.errors import OffloadIntegrityError
from offload.io.future import IOFuture


class Piece(NamedTuple):
    """One contiguous range of a record in the swap file: what `key` seals, from element `start`, held by `data`
    (to write, or to read into) at byte `offset` of the file."""

    key: Hashable
    start: int
    data: Tensor
    offset: int


class RecordChecksums:
    """Checksum of each piece of each section as last written by this process. Thread-safe."""

    def __init__(self) -> None:
        self._pieces: Dict[Hashable, Dict[int, Tuple[int, int]]] = {}  # key -> start -> (count, crc)
        self._lock = threading.Lock()
        self.algorithm = preferred_algorithm()  # crc32c with the native core, else zlib's crc32 (both fast)

    def seal(self, pieces: Sequence[Piece], crcs: Optional[Sequence[int]] = None) -> None:
        """Record the checksum of each piece's data, about to be written as elements [start, start + numel).
        `crcs`: those checksums, computed by whoever wrote the data (the compressed-moment step does, in the pass
        that writes it: CRC-32C, so only when `algorithm` is crc32c); else they are computed here."""
        if crcs is None:
            crcs = checksums([p.data for p in pieces], self.algorithm)
        elif self.algorithm != "crc32c" or len(crcs) != len(pieces):
            raise ValueError(f"{len(crcs)} CRC-32C for {len(pieces)} pieces sealed with {self.algorithm}")
        with self._lock:
            for piece, crc in zip(pieces, crcs):
                count = piece.data.numel()
                sealed = self._pieces.setdefault(piece.key, {})
                for s in [s for s, (n, _c) in sealed.items() if s < piece.start + count and piece.start < s + n]:
                    del sealed[s]  # overlapped by this write: stale
                sealed[piece.start] = (count, crc)

    def verify(self, pieces: Sequence[Piece], path: str, block: str) -> None:
        """Check every sealed piece inside each read piece against the bytes read."""
        checks: List[Tuple[Piece, int, int, int]] = []  # (read piece, sealed start, count, crc)
        with self._lock:
            for piece in pieces:
                stop = piece.start + piece.data.numel()
                checks.extend((piece, s, n, c) for s, (n, c) in self._pieces.get(piece.key, {}).items()
                              if s >= piece.start and s + n <= stop)
        if not checks:
            return
        found = checksums([p.data[s - p.start:s - p.start + n] for p, s, n, _c in checks], self.algorithm)
        for (piece, s, n, expected), crc in zip(checks, found):
            if crc != expected:
                itemsize = piece.data.element_size()
                raise OffloadIntegrityError(
                    f"swap file {path!r}: block {block!r}, {n * itemsize} bytes at file offset "
                    f"{piece.offset + (s - piece.start) * itemsize} do not match their checksum: the file was changed "
                    "or damaged under the running engine", path)


class VerifiedRead(IOFuture):
    """A chunk's read (one request for its pieces) that checks the data against its seals once it has arrived:
    an `IOFuture` whose `result()` also verifies."""

    def __init__(self, future: IOFuture, checksums_: RecordChecksums, pieces: Sequence[Piece], path: str,
                 block: str) -> None:
        super().__init__(future._request, None, future.path, future.offset, future.size, future.op)
        self._future = future
        self._checksums = checksums_
        self._pieces = pieces
        self._path = path
        self._block = block
        self._checked = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> int:
        nbytes = self._future.result(timeout)
        if not self._checked:
            self._checksums.verify(self._pieces, self._path, self._block)
            self._checked = True
        return nbytes
