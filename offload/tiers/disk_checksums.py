"""Per-record checksums of a swap file: sealed when a record is written, verified when it is read back.

A small, self-contained hook for any code path that moves swap records (SwapStore.read/write here, the
pipelined step ring too): `seal(key, data)` after a write, `verify(key, data, ...)` after a read. A record
never written (fresh preallocated zeros) has no checksum and is not checked.
"""

from __future__ import annotations

from typing import Dict, Hashable

from torch import Tensor

from offload.checksum import checksum, preferred_algorithm
from offload.errors import OffloadIntegrityError


class RecordChecksums:
    """Checksum of each record's bytes as last written by this process."""

    def __init__(self) -> None:
        self._crc: Dict[Hashable, int] = {}
        self.algorithm = preferred_algorithm()  # crc32c with the native core, else zlib's crc32 (both fast)

    def seal(self, key: Hashable, data: Tensor) -> None:
        self._crc[key] = checksum(data, self.algorithm)

    def verify(self, key: Hashable, data: Tensor, path: str, block: str, offset: int) -> None:
        expected = self._crc.get(key)
        if expected is not None and checksum(data, self.algorithm) != expected:
            raise OffloadIntegrityError(
                f"swap file {path!r}: the record of block {block!r} at offset {offset} ({data.numel() * data.element_size()} "
                "bytes) does not match its checksum: the file was changed or damaged under the running engine", path)
