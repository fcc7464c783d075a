"""The device budget keeps room for autograd's largest gradient when weights stream: each parameter's gradient
is made on the device before the engine moves it to its accumulator (docs/design.md [Note: the nvme memory
bound]), so the weights get the budget less that room."""

from __future__ import annotations

import pytest

from offload.errors import OffloadConfigError
from offload.planner.place import make_plan
from offload.planner.plan import BlockSpec, Location
from offload.planner.ring import ring_size_for
from offload.policy import Tier

KiB = 1024
BLOCKS = [BlockSpec("embed", 64 * KiB, 192 * KiB, 64 * KiB, largest_grad_bytes=64 * KiB)] + [
    BlockSpec(f"layer.{i}", 96 * KiB, 288 * KiB, 96 * KiB, largest_grad_bytes=32 * KiB) for i in range(4)]


@pytest.mark.parametrize("tier", [Tier.CPU, Tier.NVME])
def test_streamed_weights_leave_room_for_the_largest_gradient(tier):
    budget = 300 * KiB
    plan = make_plan(BLOCKS, tier, budget, None, ring_size_for(4096) if tier is Tier.NVME else None)
    assert plan.device_grad_bytes == 64 * KiB  # the embedding's, the largest parameter of any block
    assert plan.device_weight_budget == budget - 64 * KiB
    resident = sum(b.weight_bytes for b in plan.blocks if b.weights is Location.DEVICE)
    assert resident + 2 * 96 * KiB <= plan.device_weight_budget  # with two of the largest block in flight
    assert plan.bytes_on(Location.DEVICE) == resident + 64 * KiB
    assert "for the largest gradient autograd makes" in str(plan)


def test_weights_that_all_fit_keep_no_room():
    """Nothing streams: the gradients are made beside weights that stay, as without offload."""
    assert make_plan(BLOCKS, Tier.CPU, 10 * 1024 * KiB, None).device_grad_bytes == 0
    assert make_plan(BLOCKS, Tier.CPU, None, None).device_grad_bytes == 0


def test_a_budget_below_a_block_and_the_room_names_both_and_the_least_that_works():
    least = 96 * KiB + 64 * KiB
    with pytest.raises(OffloadConfigError, match=rf"largest gradient autograd makes.*at least {least} bytes"):
        make_plan(BLOCKS, Tier.CPU, least - 1, None)
    plan = make_plan(BLOCKS, Tier.CPU, least, None)
    assert plan.device_weight_budget == 96 * KiB and not any(b.weights is Location.DEVICE for b in plan.blocks)
