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


# ----- activation_memory: device room no weight takes -------------------------------------------------------------
def _resident(plan):
    return [b.name for b in plan.blocks if b.weights is Location.DEVICE]


@pytest.mark.parametrize("tier", [Tier.CPU, Tier.NVME])
def test_activation_memory_keeps_device_room_free_of_weights(tier):
    budget = 600 * KiB
    ring = ring_size_for(4096) if tier is Tier.NVME else None
    without = make_plan(BLOCKS, tier, budget, None, ring)
    kept = make_plan(BLOCKS, tier, budget, None, ring, activation_room=200 * KiB)
    assert len(_resident(kept)) < len(_resident(without))
    assert kept.device_room >= 200 * KiB > without.device_room
    assert kept.device_weight_budget == budget - kept.device_grad_bytes - 200 * KiB  # the streamer's limit too
    assert "free of weights for the activations (activation_memory)" in str(kept)


def test_activation_memory_makes_a_model_that_fits_the_device_stream():
    """The whole model fits the budget, but not with the activations' room: it streams, keeping that room."""
    total = sum(b.weight_bytes for b in BLOCKS)
    budget = total + 100 * KiB
    assert make_plan(BLOCKS, Tier.CPU, budget, None).streamed_blocks == ()
    plan = make_plan(BLOCKS, Tier.CPU, budget, None, activation_room=200 * KiB)
    assert plan.streamed_blocks and plan.device_room >= 200 * KiB


def test_activation_memory_beyond_the_device_budget_names_it_and_the_least_that_works():
    least = 96 * KiB + 64 * KiB + 50 * KiB
    with pytest.raises(OffloadConfigError, match=rf"activation_memory .*at least {least} bytes"):
        make_plan(BLOCKS, Tier.CPU, least - 1, None, activation_room=50 * KiB)
    with pytest.raises(OffloadConfigError, match="activation_memory"):
        make_plan(BLOCKS, Tier.GPU, sum(b.weight_bytes + b.state_bytes for b in BLOCKS), None,
                  activation_room=1)


# ----- clipping's fp32 norm scratch, counted in the host budget ---------------------------------------------------
@pytest.mark.parametrize("tier", [Tier.CPU, Tier.NVME])
def test_clipping_half_precision_gradients_counts_the_fp32_norm_copy_in_host_memory(tier, monkeypatch):
    """Where the native core cannot take a half-precision norm in torch's order (optim/functional.py TorchNorm)."""
    from offload.planner import place
    from offload.planner.plan import GradFlow

    monkeypatch.setattr(place, "torch_norm_order", lambda: None)
    ring = ring_size_for(4096) if tier is Tier.NVME else None
    bf16 = GradFlow(1, True, 2)
    plan = make_plan(BLOCKS, tier, None, 10 * 1024 * KiB, ring, bf16)
    assert plan.norm_scratch_bytes == 64 * KiB // 2 * 4  # the embedding's gradient in fp32
    assert "fp32 copy of the largest half-precision gradient" in str(plan)
    assert plan.bytes_on(Location.HOST) <= 10 * 1024 * KiB
    unclipped = make_plan(BLOCKS, tier, None, 10 * 1024 * KiB, ring, GradFlow(1, False, 2))
    fp32 = make_plan(BLOCKS, tier, None, 10 * 1024 * KiB, ring, GradFlow(1, True, 4))
    assert unclipped.norm_scratch_bytes == 0 and fp32.norm_scratch_bytes == 0  # no copy is made
    with pytest.raises(OffloadConfigError, match="fp32 copy of the largest half-precision gradient"):
        make_plan(BLOCKS, tier, None, 64 * KiB, ring, bf16)


@pytest.mark.parametrize("tier", [Tier.CPU, Tier.NVME])
def test_a_norm_taken_in_place_needs_no_fp32_copy(tier):
    from offload.optim.functional import torch_norm_order
    from offload.planner.plan import GradFlow

    if torch_norm_order() is None:
        pytest.skip("no native core, or a torch whose order it does not follow: the copy is needed")
    ring = ring_size_for(4096) if tier is Tier.NVME else None
    plan = make_plan(BLOCKS, tier, None, 10 * 1024 * KiB, ring, GradFlow(1, True, 2))
    assert plan.norm_scratch_bytes == 0 and "fp32 copy" not in str(plan)
