"""`python -m offload estimate`: the planner's memory per tier for a model size, without a model."""

from __future__ import annotations

import torch

from offload.__main__ import main
from offload.cli.estimate import ModelShape, estimate
from offload.planner import Location
from offload.policy import Tier


def test_gpt_shape_counts_parameters():
    shape = ModelShape.gpt(layers=2, dim=64, vocab=512, context=32)
    layer = 12 * 64 * 64 + 13 * 64
    assert shape.params == 512 * 64 + 32 * 64 + 2 * layer + 2 * 64
    assert ModelShape.uniform(1000, 3).params == 1000


def test_nvme_estimate_keeps_state_on_disk_and_host_within_budget():
    shape = ModelShape.uniform(int(1e9), 16)
    host = 3 << 30
    plan = estimate(shape, Tier.NVME, torch.bfloat16, device_memory=1 << 30, host_memory=host)
    assert plan.bytes_on(Location.DISK) >= 12 * int(1e9)  # fp32 master + m + v, and weights spilled there
    assert plan.bytes_on(Location.HOST) <= host
    assert plan.disk_weight_blocks  # 2 GB of weights do not fit next to 2 GB of gradients in 3 GiB


def test_cli_reports_each_tier_and_what_does_not_fit(capsys):
    assert main(["estimate", "--params", "7e9", "--host-memory", "64GB", "--device-memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "tier=gpu   does not fit" in out and "tier=cpu   does not fit" in out
    assert "tier=nvme  device" in out
    assert main(["estimate", "--layers", "2", "--dim", "64", "--tier", "cpu", "--blocks"]) == 0
    assert "offload plan (tier=cpu)" in capsys.readouterr().out
    assert main(["estimate"]) == 2
