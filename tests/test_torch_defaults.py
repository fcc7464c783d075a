"""`offload.wrap(model)` with nothing said trains as `torch.optim.AdamW(model.parameters())` would: torch's AdamW
defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) and the model's own dtype. Mixed precision
is asked for by name, and the plan says what it computes in (issue 33)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadConfigError
from tests.models import TinyGPT, make_batches, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_wrap_with_nothing_but_lr_trains_as_torch_adamw(tmp_path, tier):
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    engine = offload.wrap(model, tier, **({"nvme_path": tmp_path} if tier == "nvme" else {}), lr=1e-3)
    assert engine.policy.dtype is torch.float32 and engine.policy.weight_decay == reference.defaults["weight_decay"]
    for ((idx, tgt),) in make_batches(4, 1):
        loss = engine(idx, tgt)
        loss.backward()
        engine.step()
        engine.zero_grad()
        ref_loss = twin(idx, tgt)
        ref_loss.backward()
        reference.step()
        reference.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5
    engine.synchronize()
    for (name, got), ref in zip(model.named_parameters(), twin.parameters()):
        assert (got.detach() - ref.detach()).abs().max().item() <= 1e-5, name
    engine.close()


def test_the_defaults_are_torch_adamws():
    engine = offload.wrap(nn.Linear(4, 4), "cpu")
    group = engine.optimizer.param_groups[0]
    defaults = torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).defaults
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert group[key] == defaults[key], key
    engine.close()


def test_the_compute_dtype_is_the_models_unless_asked_and_the_plan_says_it():
    bf16 = offload.wrap(nn.Linear(4, 4).to(torch.bfloat16), "cpu")
    assert bf16.policy.dtype is torch.bfloat16 and bf16.module.weight.dtype is torch.bfloat16
    bf16.close()
    fp32 = offload.wrap(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), "cpu")
    assert all(p.dtype is torch.float32 for p in fp32.module.parameters())
    assert str(fp32.plan).splitlines()[0] == ("offload plan (tier=cpu; compute float32; master weights fp32, "
                                              "Adam moments fp32)")
    fp32.close()
    mixed = offload.wrap(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), "cpu", dtype=torch.bfloat16)
    assert mixed.module[0].weight.dtype is torch.bfloat16 and mixed.module[1].weight.dtype is torch.float32
    assert "compute bfloat16 (mixed precision" in str(mixed.plan).splitlines()[0]
    mixed.close()


def test_a_model_of_mixed_dtypes_keeps_each_parameters_dtype():
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.LayerNorm(4))
    engine = offload.wrap(model, "cpu")
    assert engine.module[0].weight.dtype is torch.bfloat16 and engine.module[1].weight.dtype is torch.float32
    engine.close()


def test_a_model_in_a_dtype_offload_does_not_compute_in_names_the_fix():
    with pytest.raises(OffloadConfigError, match=r"'weight' is torch.float64.*model.float\(\)"):
        offload.wrap(nn.Linear(4, 4).double(), "cpu")


@pytest.mark.parametrize("tier,options", [("cpu", {}), ("nvme", dict(grad_accumulation_steps=2))])
def test_step_returns_the_norm_max_grad_norm_clipped_with(tmp_path, tier, options):
    """nanoGPT-style loops log the step's gradient norm: `engine.step()` returns it (as clip_grad_norm_ would
    return it before clipping), and `stats()` keeps it; without max_grad_norm there is none."""
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    engine = offload.wrap(model, tier, **({"nvme_path": tmp_path} if tier == "nvme" else {}), max_grad_norm=0.5,
                          **options)
    reference = torch.optim.AdamW(twin.parameters())
    for step in make_batches(2, options.get("grad_accumulation_steps", 1)):
        for idx, tgt in step:
            engine(idx, tgt).backward()
            twin(idx, tgt).backward()
        norm = engine.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5).item()
        reference.step()
        engine.zero_grad()
        reference.zero_grad()
        assert norm == pytest.approx(ref_norm, rel=1e-5) and engine.stats()["grad_norm"] == norm
    engine.close()
    plain = offload.wrap(TinyGPT(), "cpu")
    ((idx, tgt),) = make_batches(1, 1)[0]
    plain(idx, tgt).backward()
    assert plain.step() is None
    plain.close()
