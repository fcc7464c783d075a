"""ZeRO++'s quantized weight gathers (offload/distributed/quantized_gather.py): the int8 blocks a rank's part is
sent as, and what every rank decodes from them."""

from __future__ import annotations

import warnings

import pytest
import torch

import offload
from offload.distributed.quantized_gather import BLOCK, Int8Blocks
from tests.models import TinyGPT


@pytest.mark.parametrize("numel", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_element_decodes_within_half_a_step_of_its_blocks_scale(numel, dtype):
    codes = Int8Blocks()
    torch.manual_seed(0)
    part = (torch.randn(numel) * torch.logspace(-3, 1, numel)).to(dtype)
    packed = codes.encode(part)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.packed_nbytes(numel) == numel + 4 * -(-numel // BLOCK)
    out = torch.empty(numel, dtype=dtype)
    codes.decode(packed, numel, out)
    values = part.float()
    for start in range(0, numel, BLOCK):
        block = values[start:start + BLOCK]
        step = block.abs().max() / 127
        error = (out.float()[start:start + BLOCK] - block).abs().max()
        rounding = block.abs().max() * (2 ** -8 if dtype == torch.bfloat16 else 0)  # the decoded value's own dtype
        assert error <= step / 2 * 1.0001 + rounding, (start, float(error), float(step))
    assert torch.equal(out.float()[values == 0], values[values == 0])
    if numel > 1:  # one element is its block's largest: it decodes exactly
        assert not torch.equal(out.float(), values), "a quantization that changes nothing measures nothing here"


def test_zero_blocks_and_the_largest_magnitude_survive_exactly():
    codes = Int8Blocks()
    part = torch.zeros(2 * BLOCK)
    part[BLOCK + 5] = -3.25
    out = torch.empty_like(part)
    codes.decode(codes.encode(part), part.numel(), out)
    assert torch.equal(out[:BLOCK], torch.zeros(BLOCK)) and out[BLOCK + 5] == -3.25


def test_the_option_needs_sharded_weights():
    with pytest.raises(offload.OffloadConfigError, match="set shard_weights=True"):
        offload.wrap(TinyGPT(), tier="cpu", shard_weights=False, zero_quantized_weights=True)
    with pytest.raises(offload.OffloadConfigError, match="zero_quantized_weights must be True or False"):
        offload.wrap(TinyGPT(), tier="cpu", zero_quantized_weights="yes")
    with warnings.catch_warnings(record=True) as caught:  # one process: nothing is sharded, it says so
        warnings.simplefilter("always")
        engine = offload.wrap(TinyGPT(), tier="cpu", zero_quantized_weights=True)
        engine.close()
    assert any("zero_quantized_weights=True has no effect" in str(w.message) for w in caught)
