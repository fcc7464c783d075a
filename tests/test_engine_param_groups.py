"""`offload.wrap(..., param_groups=[...])`: per-group AdamW options, exactly as torch.optim.AdamW applies them.

The usual recipe: no weight decay on biases, norms and embeddings, and here a different learning rate for
them too, with an LR scheduler that changes each group's rate. Every tier must match torch.optim.AdamW built
with the same groups (fp32, CPU, max abs diff <= 1e-5).
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch

import offload
from offload.errors import OffloadConfigError
from tests.models import TinyGPT, make_batches, one_intraop_thread

TOL = 1e-5
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _groups(model):
    """No decay (and a smaller lr, other betas) for vectors and embeddings; the rest is left to the defaults."""
    no_decay = [p for name, p in model.named_parameters() if p.dim() < 2 or "wte" in name or "wpe" in name]
    return [{"params": no_decay, "weight_decay": 0.0, "lr": LR / 3, "betas": (0.8, 0.99)}]


def _train(model, step, zero_grad, batches, scheduler):
    losses = []
    for micro_batches in batches:
        for idx, tgt in micro_batches:
            loss = model(idx, tgt) / len(micro_batches)
            loss.backward()
            losses.append(loss.item())
        step()
        zero_grad()
        scheduler.step()
    return losses


@pytest.mark.parametrize("tier,accum,declared,max_norm", [
    ("gpu", 1, False, None), ("cpu", 1, False, None), ("nvme", 1, False, None),
    ("cpu", 2, True, None),      # blocks updated during backward, with per-group hyperparameters
    ("nvme", 2, True, None),
    ("cpu", 1, False, 0.5),      # clipping: the global norm over every group
], ids=["gpu", "cpu", "nvme", "cpu-early", "nvme-early", "cpu-clip"])
def test_param_groups_match_adamw_with_the_same_groups(tier, accum, declared, max_norm):
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    batches = make_batches(4, accum)

    trainable = [p for p in twin.parameters() if p.requires_grad]
    twin_groups = _groups(twin)
    no_decay_ids = {id(p) for p in twin_groups[0]["params"]}
    twin_groups[0]["params"] = [p for p in twin_groups[0]["params"] if p.requires_grad]
    twin_groups.append({"params": [p for p in trainable if id(p) not in no_decay_ids]})
    reference = torch.optim.AdamW(twin_groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)

    def reference_step():
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        reference.step()

    ref_losses = _train(twin, reference_step, reference.zero_grad, batches,
                        torch.optim.lr_scheduler.StepLR(reference, step_size=1, gamma=0.5))

    nvme_path = tempfile.mkdtemp(prefix="offload-test-") if tier == "nvme" else None
    with offload.wrap(model, tier=tier, nvme_path=nvme_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      max_grad_norm=max_norm, dtype=torch.float32, device="cpu", param_groups=_groups(model),
                      grad_accumulation_steps=accum if declared else None) as engine:
        assert len(engine.optimizer.param_groups) == 2
        assert engine.optimizer.param_groups[0]["weight_decay"] == 0.0
        assert engine.optimizer.param_groups[1]["weight_decay"] == WD
        losses = _train(model, engine.step, engine.zero_grad, batches,
                        torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5))
        state = engine.state_dict()
        if declared:
            assert engine.stats()["early_block_updates"] > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    ref_state = twin.state_dict()
    for name, ref in ref_state.items():
        assert (state[name] - ref).abs().max().item() <= TOL, name
    # the groups really differ: decayed weights moved differently from an all-defaults run
    torch.manual_seed(0)
    plain = TinyGPT()
    with offload.wrap(plain, tier="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=max_norm,
                      dtype=torch.float32, device="cpu") as engine:
        _train(plain, engine.step, engine.zero_grad, batches,
               torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5))
        assert (engine.state_dict()["h.0.ln1.weight"] - state["h.0.ln1.weight"]).abs().max() > 1e-4


def test_bad_param_groups_are_refused_at_wrap_naming_the_problem():
    model = TinyGPT()
    bias = model.h[0].proj.bias
    with pytest.raises(OffloadConfigError, match=r"unknown option\(s\) 'momentum'.*valid: params, lr"):
        offload.wrap(model, tier="cpu", device="cpu", param_groups=[{"params": [bias], "momentum": 0.9}])
    with pytest.raises(OffloadConfigError, match=r"'h.0.proj.bias' is in param_groups\[0\] and param_groups\[1\]"):
        offload.wrap(model, tier="cpu", device="cpu", param_groups=[{"params": [bias]}, {"params": [bias]}])
    with pytest.raises(OffloadConfigError, match="not in the wrapped model"):
        offload.wrap(model, tier="cpu", device="cpu", param_groups=[{"params": [torch.nn.Parameter(torch.ones(3))]}])
    with pytest.raises(OffloadConfigError, match=r"param_groups\[0\]\['weight_decay'\] must be a number >= 0"):
        offload.wrap(model, tier="cpu", device="cpu", param_groups=[{"params": [bias], "weight_decay": -1}])
    with pytest.raises(OffloadConfigError, match="must be a list of dicts"):
        offload.wrap(model, tier="cpu", device="cpu", param_groups={"params": [bias]})
    with offload.wrap(model, tier="cpu", device="cpu", param_groups=[{"params": [bias], "lr": 0.0}]) as engine:
        with pytest.raises(OffloadConfigError, match="fixed at wrap"):
            engine.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})


def test_checkpoint_keeps_each_groups_options_and_refuses_other_groupings(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    batches = make_batches(2, 1)
    with offload.wrap(model, tier="cpu", lr=LR, weight_decay=WD, dtype=torch.float32, device="cpu",
                      param_groups=_groups(model)) as engine:
        scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
        _train(model, engine.step, engine.zero_grad, batches, scheduler)
        engine.save(tmp_path / "ckpt", scheduler=scheduler)
        saved_lrs = [g["lr"] for g in engine.optimizer.param_groups]
    torch.manual_seed(1)
    fresh = TinyGPT()
    with offload.wrap(fresh, tier="nvme", nvme_path=str(tmp_path), lr=LR, weight_decay=WD, dtype=torch.float32,
                      device="cpu", param_groups=_groups(fresh)) as engine:
        scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
        engine.load(tmp_path / "ckpt", scheduler=scheduler)
        assert [g["lr"] for g in engine.optimizer.param_groups] == saved_lrs
        assert engine.optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    other = TinyGPT()
    with offload.wrap(other, tier="cpu", lr=LR, dtype=torch.float32, device="cpu") as engine:
        with pytest.raises(OffloadConfigError, match="2 optimizer parameter groups.*this engine has 1"):
            engine.load(tmp_path / "ckpt")


def test_a_checkpoint_of_other_group_members_is_refused(tmp_path):
    model = TinyGPT()
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu",
                      param_groups=[{"params": biases, "weight_decay": 0.0}]) as engine:
        engine.save(tmp_path / "ckpt")
    other = TinyGPT()
    norms = [p for name, p in other.named_parameters() if "ln" in name]
    with offload.wrap(other, tier="cpu", dtype=torch.float32, device="cpu",
                      param_groups=[{"params": norms, "weight_decay": 0.0}]) as engine:
        before = engine.state_dict()
        with pytest.raises(OffloadConfigError, match="group 0 .* holds other parameters"):
            engine.load(tmp_path / "ckpt")
        assert all(torch.equal(engine.state_dict()[k], v) for k, v in before.items())
