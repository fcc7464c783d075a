"""A checkpoint read in parts (sharded weights: each data-parallel rank fills only its part of every flat group):
the part's elements are the checkpoint's, converted to the compute dtype, and nothing outside it is read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from offload.checkpoint.weight_source import WeightSource
from offload.errors import OffloadConfigError
from offload.scheduler.blocks.block import build_blocks
from offload.scheduler.setup.initial_weights import FromSource


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 8))


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_a_part_of_each_group_is_filled_from_the_checkpoint_and_nothing_else(tmp_path, stored):
    model = _model()
    path = tmp_path / "model.safetensors"
    save_file({k: v.to(stored).contiguous() for k, v in model.state_dict().items()}, str(path))
    target = _model()
    blocks = build_blocks(target, torch.float32)
    source = FromSource(WeightSource(path))
    source.check(target, blocks)
    for block in blocks:
        for group in block.groups:
            group.device_buffer = torch.full((group.numel,), float("nan"))
        parts = [(group.numel // 3, group.numel - 5) for group in block.groups]  # cuts through parameters
        source.fill(block, parts)
        for group, (a, b) in zip(block.groups, parts):
            expected = torch.cat([model.state_dict()[s.name].to(stored).float().reshape(-1) for s in group.slots])
            assert torch.equal(group.device_buffer[a:b], expected[a:b])
            assert group.device_buffer[:a].isnan().all() and group.device_buffer[b:].isnan().all()


def test_a_range_outside_the_tensor_is_refused_by_name(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(10, dtype=torch.float32)}, str(path))
    source = WeightSource(path)
    out = torch.empty(4)
    source.read_range_into("w", 6, out)
    assert torch.equal(out, torch.arange(6, 10, dtype=torch.float32))
    with pytest.raises(OffloadConfigError, match=r"'w'.*elements \[7, 11\)"):
        source.read_range_into("w", 7, out)
