"""Blocks, flat buffers and the plan: identity kept, tied weights stored once, frozen weights-only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadError
from offload.planner.plan import Location
from offload.scheduler.blocks.block import Residency, block_key, build_blocks, find_layer_list
from tests.models import TinyGPT, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def test_blocks_follow_the_layer_list():
    model = TinyGPT(layers=3)
    assert find_layer_list(model) == "h"
    names = [b.name for b in build_blocks(model, torch.float32)]
    assert names == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f"]  # lm_head's weight is wte's (tied)


def test_block_key_rules():
    assert block_key("transformer.h.3.attn.weight", "transformer.h.3.attn", "transformer.h") == "transformer.h.3"
    assert block_key("transformer.wte.weight", "transformer.wte", "transformer.h") == "transformer.wte"
    assert block_key("transformer.pos", "transformer", "transformer.h") == "transformer"
    assert block_key("scale", "", "transformer.h") == "<root>"
    assert block_key("head.weight", "head", None) == "head"


def test_identity_kept_and_params_are_views_of_one_flat_buffer():
    model = TinyGPT()
    params_before = {name: p for name, p in model.named_parameters()}
    values_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        for name, p in model.named_parameters():
            assert p is params_before[name]
            assert p.equal(values_before[name])
        block = next(b for b in engine.blocks if b.name == "h.0")
        (group,) = block.groups
        base = group.device_buffer.data_ptr()
        for slot in group.slots:
            assert slot.param.data_ptr() == base + slot.offset * 4
        assert model.lm_head.weight is model.wte.weight


def test_tied_stored_once_frozen_weights_only():
    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        total = sum(b.weight_bytes for b in engine.blocks)
        assert total == 4 * sum(p.numel() for p in model.parameters())  # parameters() dedups tied
        frozen = next(b for b in engine.blocks if b.name == "h.1")
        assert frozen.trainable_numel == 0
        assert engine.records[frozen.index].states == []  # no optimizer state for frozen weights
        placement = {p.name: p for p in engine.plan.blocks}
        assert placement["h.1"].state_bytes == 0 and placement["h.0"].state_bytes > 0
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert engine.stats()["host_state_bytes"] == trainable * (4 + 4 + 4 + 4)  # master, m, v, fp32 grad


def test_mixed_dtypes_norms_stay_fp32():
    model = TinyGPT()
    model.h[0].fc.to(torch.float16)  # a user's own half-precision layer is kept as is
    with offload.wrap(model, tier="cpu", dtype=torch.bfloat16, device="cpu") as engine:
        assert model.h[0].qkv.weight.dtype == torch.bfloat16
        assert model.h[0].ln1.weight.dtype == torch.float32
        assert model.h[0].fc.weight.dtype == torch.float16
        block = next(b for b in engine.blocks if b.name == "h.0")
        assert {g.dtype for g in block.groups} == {torch.bfloat16, torch.float32, torch.float16}


def test_residency_changes_are_checked():
    (block,) = build_blocks(nn.Sequential(nn.Linear(2, 2)), torch.float32)[:1]
    assert block.residency is Residency.RESIDENT
    with pytest.raises(OffloadError, match="illegal residency change resident -> resident"):
        block.move_to(Residency.RESIDENT)
    block.move_to(Residency.RELEASED)
    with pytest.raises(OffloadError, match="illegal residency change released -> released"):
        block.move_to(Residency.RELEASED)
    block.move_to(Residency.RESIDENT)


def test_plan_table_and_totals():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu") as engine:
        text = str(engine.plan)
        assert "block" in text and "h.0" in text and "total on host" in text
        assert engine.plan.bytes_on(Location.DEVICE) == sum(b.weight_bytes for b in engine.blocks)
        assert engine.plan.bytes_on(Location.HOST) == engine.stats()["host_state_bytes"]
        assert engine.plan.bytes_on(Location.DISK) == 0


def test_close_leaves_a_plain_model():
    model = TinyGPT()
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu")
    engine.close()
    assert not any(m._forward_pre_hooks for m in model.modules())
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx).backward()
    assert model.h[0].fc.weight.grad is not None  # gradients stay with the parameters again
