"""CRC-32C: every native path (carry-less folding, SSE4.2 lanes, table) and the pure-Python fallback agree with
the standard and with each other."""

from __future__ import annotations

import zlib

import pytest
import torch

from offload import _native, checksum
from offload.errors import OffloadConfigError

needs_native = pytest.mark.skipif(_native._C is None, reason="offload._C is not built")
PATH_NAMES = ("vpclmulqdq-avx512", "pclmulqdq", "sse4.2", "table")  # preferred first
PATHS = _native._C.crc32c_paths() if _native._C is not None else []  # those this CPU runs; tests use each


def test_standard_check_value():
    assert checksum.crc32c(b"123456789") == 0xE3069283  # RFC 3720 / iSCSI check value
    assert checksum.crc32c(b"") == 0


@needs_native
@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 24575, 24576, 24577, 3 * 8192 * 5 + 13, 1 << 20])
@pytest.mark.parametrize("misalign", [0, 3])
def test_native_lanes_table_and_python_agree(nbytes, misalign):
    data = torch.randint(0, 256, (nbytes + misalign,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    view = data[misalign:]
    C = _native._C
    lanes = C.crc32c(view.data_ptr(), nbytes)
    assert lanes == C.crc32c_portable(view.data_ptr(), nbytes)
    if nbytes <= 24577:
        assert lanes == checksum._crc32c_python(memoryview(view.numpy()), 0)


@needs_native
def test_seed_continues_a_checksum():
    data = torch.arange(100_000, dtype=torch.float32)
    whole = checksum.crc32c(data)
    half = checksum.crc32c(data[:30_001])
    assert checksum.crc32c(data[30_001:], seed=half) == whole
    assert _native._C.crc32c_path() in PATH_NAMES


def test_python_fallback_without_native_core(monkeypatch):
    data = torch.arange(1000, dtype=torch.int32)
    expected = checksum.crc32c(data)
    monkeypatch.setattr(_native, "_C", None)
    assert checksum.crc32c(data) == expected
    assert checksum.preferred_algorithm() == "crc32"
    assert checksum.checksum(data, "crc32") == zlib.crc32(data.numpy().tobytes())


def test_refuses_non_contiguous_tensors_and_unknown_algorithms():
    with pytest.raises(OffloadConfigError, match="contiguous"):
        checksum.crc32c(torch.zeros(4, 4)[:, 1])
    with pytest.raises(OffloadConfigError, match="unknown checksum algorithm 'md5'"):
        checksum.checksum(b"x", "md5")


def _bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@needs_native
def test_paths_are_named_preferred_first_and_checked():
    C = _native._C
    assert PATHS[0] == C.crc32c_path() and PATHS[-1] == "table"
    assert [name for name in PATH_NAMES if name in PATHS] == PATHS
    with pytest.raises(ValueError, match="unknown crc32c path 'md5'"):
        C.crc32c_with("md5", 0, 0)
    for name in PATH_NAMES:
        if name not in PATHS:
            with pytest.raises(ValueError, match="cannot run"):
                C.crc32c_with(name, 0, 0)


@needs_native
@pytest.mark.parametrize("path", PATHS)
def test_each_path_check_value_and_empty_input(path):
    C = _native._C
    data = torch.tensor(list(b"123456789"), dtype=torch.uint8)
    assert C.crc32c_with(path, data.data_ptr(), 9) == 0xE3069283
    assert C.crc32c_with(path, 0, 0) == 0  # null with 0 bytes is never read
    assert C.crc32c_with(path, 0, 0, 0xDEADBEEF) == 0xDEADBEEF


@needs_native
@pytest.mark.parametrize("path", PATHS)
def test_each_path_equals_table_for_every_short_length_misalignment_and_seed(path):
    """Lengths 0..600 cover both sides of the 256-byte switch to folding and every count of leftover
    64-byte, 16-byte and 1-byte pieces; misalignments 0..63 cover every offset within a cache line."""
    C = _native._C
    buffer = _bytes(600 + 128, 1)
    base = buffer.data_ptr() + (-buffer.data_ptr()) % 64  # 64-byte aligned start, then misaligned from it
    bad = []
    for misalign in range(64):
        ptr = base + misalign
        for nbytes in range(601):
            seed = 0 if nbytes % 2 else (nbytes * 2654435761 + misalign) & 0xFFFFFFFF
            if C.crc32c_with(path, ptr, nbytes, seed) != C.crc32c_portable(ptr, nbytes, seed):
                bad.append((misalign, nbytes, seed))
    assert not bad, f"{len(bad)} mismatches, first {bad[:5]}"


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nbytes", [1023, 1024, 1025, 24575, 24576, 24576 + 255, 24576 + 256 + 64 + 17, 3 * 8192 * 5 + 13, (1 << 20) + 1, (1 << 20) + 255 + 64 + 16 + 7])
def test_each_path_equals_table_for_large_sizes(path, nbytes):
    C = _native._C
    buffer = _bytes(nbytes + 64, nbytes)
    for misalign, seed in ((0, 0), (1, 0x12345678), (17, 0), (63, 0xFFFFFFFF)):
        ptr = buffer.data_ptr() + misalign
        assert C.crc32c_with(path, ptr, nbytes, seed) == C.crc32c_portable(ptr, nbytes, seed), (misalign, seed)


@needs_native
@pytest.mark.parametrize("path", PATHS)
def test_each_path_continues_a_checksum_from_any_split(path):
    """crc(A + B) == crc(B, seed=crc(A)), with A and B along this path or along the table path."""
    C = _native._C
    data = _bytes(100_003, 2)
    ptr, nbytes = data.data_ptr(), data.numel()
    whole = C.crc32c_portable(ptr, nbytes)
    for split in (0, 1, 255, 256, 257, 4097, 50_000, 99_747, nbytes):
        head = C.crc32c_with(path, ptr, split)
        assert C.crc32c_with(path, ptr + split, nbytes - split, head) == whole, split
        assert C.crc32c_with(path, ptr + split, nbytes - split, C.crc32c_portable(ptr, split)) == whole, split
        assert C.crc32c_portable(ptr + split, nbytes - split, head) == whole, split
