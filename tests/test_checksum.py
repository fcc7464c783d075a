"""CRC-32C: the native multi-lane path, its table fallback and the pure-Python fallback agree with the standard."""

from __future__ import annotations

import zlib

import pytest
import torch

from offload import _native, checksum
from offload.errors import OffloadConfigError

needs_native = pytest.mark.skipif(_native._C is None, reason="offload._C is not built")


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
    assert _native._C.crc32c_path() in ("sse4.2", "table")


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
