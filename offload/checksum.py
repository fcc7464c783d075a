"""Checksums of swap records and checkpoint files: CRC-32C, native when `_C` is built.

`crc32c` always computes CRC-32C (the native path chosen for this CPU: carry-less folding or SSE4.2 lanes;
or a slow pure-Python table when `_C` is missing). `preferred_algorithm()` is what new files record:
"crc32c" with the native core, else "crc32" (zlib's, fast everywhere); `checksum(data, algorithm)` computes
either, so a checkpoint written without `_C` is verified with the algorithm its manifest names.
"""

from __future__ import annotations

import zlib
from typing import List, Sequence, Union

import torch
from torch import Tensor

from offload import _native
from offload.errors import OffloadConfigError

Data = Union[Tensor, bytes, bytearray, memoryview]
ALGORITHMS = ("crc32c", "crc32")


def _table() -> list:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = tuple(_table())


def _as_bytes(data: Data) -> memoryview:
    if isinstance(data, Tensor):
        if data.device.type != "cpu":
            raise OffloadConfigError(f"checksums read host memory; got a tensor on {data.device}")
        if not data.is_contiguous():
            raise OffloadConfigError("checksums need a contiguous tensor")
        return data.reshape(-1).view(torch.uint8).numpy().data  # ndarray.data: the array's bytes as a memoryview
    return memoryview(data).cast("B")


def _crc32c_python(view: memoryview, seed: int) -> int:
    crc = seed ^ 0xFFFFFFFF
    table = _TABLE
    for byte in view.tobytes():
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def crc32c(data: Data, seed: int = 0) -> int:
    """CRC-32C of a contiguous CPU tensor's bytes (or a bytes-like), continuing from `seed`."""
    if isinstance(data, Tensor) and _native._C is not None:
        if data.device.type != "cpu" or not data.is_contiguous():
            _as_bytes(data)  # raises the clear error
        return int(_native._C.crc32c(data.data_ptr(), data.numel() * data.element_size(), seed))
    view = _as_bytes(data)
    if _native._C is not None:
        import numpy as np

        array = np.frombuffer(view, dtype=np.uint8)
        return int(_native._C.crc32c(array.ctypes.data if array.size else 0, array.size, seed))
    return _crc32c_python(view, seed)


def preferred_algorithm() -> str:
    """The checksum new files record: fast CRC-32C with the native core, else zlib's CRC-32."""
    return "crc32c" if _native._C is not None else "crc32"


def checksums(datas: Sequence[Tensor], algorithm: str) -> List[int]:
    """`checksum` of each tensor (the pieces of one chunk of a swap record: one call for all of them)."""
    return [checksum(data, algorithm) for data in datas]


def checksum(data: Data, algorithm: str, seed: int = 0) -> int:
    """`algorithm` ("crc32c" or "crc32") of `data`, continuing from `seed`."""
    if algorithm == "crc32c":
        return crc32c(data, seed)
    if algorithm == "crc32":
        return zlib.crc32(_as_bytes(data), seed) & 0xFFFFFFFF
    raise OffloadConfigError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
