"""Gradients outside the engine: torch code that reads or clears `.grad` around a wrapped model works as
in plain PyTorch or raises at once with the fix (issue "never silently wrong"). After backward each
`param.grad` is a storage-less stand-in (offload/scheduler/held_grad.py); each test trains the same model
with torch.optim.AdamW next to the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadError
from tests.models import TinyGPT, make_batches, one_intraop_thread

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
TOL = 1e-5

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _pair(tmp_path, tier: str, **options):
    """A model wrapped at `tier` and its torch twin with AdamW, from the same initial weights."""
    torch.manual_seed(0)
    model, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    kwargs = dict(nvme_path=tmp_path) if tier == "nvme" else {}
    engine = offload.wrap(model, tier=tier, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32,
                          device="cpu", **kwargs, **options)
    return engine, reference, opt


def _assert_same_weights(engine, reference) -> None:
    got = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=TOL, msg=key)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
def test_torch_clip_grad_norm_over_the_model_clips_as_torch(tmp_path, tier, foreach):
    """The line every training loop has. Before: it returned 0.0 and clipped nothing (every `.grad` was None),
    then it raised naming engine.clip_grad_norm_; now it runs on the gradients the engine holds."""
    engine, reference, opt = _pair(tmp_path, tier)
    with engine:
        for ((idx, tgt),) in make_batches(3, 1):
            reference(idx, tgt).backward()
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, foreach=foreach)
            opt.step()
            opt.zero_grad()
            engine(idx, tgt).backward()
            got = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.05, foreach=foreach)
            engine.step()
            engine.zero_grad()
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            assert got > 0.05  # it did clip
        _assert_same_weights(engine, reference)


def test_torch_clip_grad_value_and_a_second_clip_see_what_torch_sees(tmp_path):
    engine, reference, opt = _pair(tmp_path, "nvme")
    with engine:
        for ((idx, tgt),) in make_batches(2, 1):
            for model in (reference, engine.module):
                (engine if model is engine.module else model)(idx, tgt).backward()
            torch.nn.utils.clip_grad_value_(reference.parameters(), 1e-3)
            torch.nn.utils.clip_grad_value_(engine.module.parameters(), 1e-3)
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
            got = engine.clip_grad_norm_(0.01)  # the engine's norm sees torch's clamp
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            opt.step()
            opt.zero_grad()
            engine.step()
            engine.zero_grad()
        _assert_same_weights(engine, reference)


def test_other_reads_of_a_held_gradient_raise_with_the_fix():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu") as engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        engine(idx, tgt).backward()
        with pytest.raises(OffloadError, match="'wte.weight'.*clip_grad_norm_ / clip_grad_value_ work on it"):
            engine.module.wte.weight.grad.sum()  # any other read names the parameter
        with pytest.raises(OffloadError, match="'wte.weight'"):
            engine.module.wte.weight.grad * 2
        assert "held by the offload engine" in repr(engine.module.wte.weight.grad)
        engine.step()  # nothing was changed by the refused reads


def test_torch_clip_after_blocks_updated_during_backward_is_refused():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=1) as engine:
        for ((idx, tgt),) in make_batches(2, 1):
            engine(idx, tgt).backward()
            if engine.stats()["early_block_updates"]:
                with pytest.raises(OffloadError, match="updated during the last backward.*max_grad_norm="):
                    torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
            engine.step()
            engine.zero_grad()
        assert engine.stats()["early_block_updates"] > 0


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
def test_engine_clip_grad_norm_matches_torch_and_returns_the_norm(tmp_path, tier):
    engine, reference, opt = _pair(tmp_path, tier)
    with engine:
        for ((idx, tgt),) in make_batches(3, 1):
            reference(idx, tgt).backward()
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            engine(idx, tgt).backward()
            got = engine.clip_grad_norm_(0.05)
            engine.step()
            engine.zero_grad()
            assert isinstance(got, torch.Tensor)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            assert got > 0.05  # it did clip
        _assert_same_weights(engine, reference)


def test_clip_twice_sees_the_clipped_gradients_as_torch_does():
    engine, reference, opt = _pair(None, "cpu")
    with engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        reference(idx, tgt).backward()
        engine(idx, tgt).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        engine.clip_grad_norm_(0.05)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        got = engine.clip_grad_norm_(0.05)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_clip_after_blocks_updated_during_backward_is_refused():
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", grad_accumulation_steps=1) as engine:
        for ((idx, tgt),) in make_batches(2, 1):  # the first step records which gradients complete a block
            engine(idx, tgt).backward()
            if engine.stats()["early_block_updates"]:
                with pytest.raises(OffloadError, match="max_grad_norm= to offload.wrap"):
                    engine.clip_grad_norm_(1.0)
            engine.step()
            engine.zero_grad()
        assert engine.stats()["early_block_updates"] > 0


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_model_zero_grad_clears_the_engine_gradients_as_torch(tmp_path, tier):
    """HF Trainer clears with model.zero_grad(). Before: it did not reach the engine, gradients piled up."""
    engine, reference, opt = _pair(tmp_path, tier)
    with engine:
        for ((idx, tgt),) in make_batches(3, 1):
            reference(idx, tgt).backward()
            opt.step()
            reference.zero_grad()
            engine(idx, tgt).backward()
            engine.optimizer.step()
            engine.module.zero_grad()
        _assert_same_weights(engine, reference)


def test_no_zero_grad_accumulates_as_torch():
    """torch adds a second backward into `.grad` when nothing cleared it; so does the engine."""
    engine, reference, opt = _pair(None, "cpu")
    with engine:
        for ((idx, tgt),) in make_batches(3, 1):
            reference(idx, tgt).backward()
            opt.step()
            engine(idx, tgt).backward()
            engine.step()
        _assert_same_weights(engine, reference)


def test_cleared_grads_then_step_updates_nothing_as_torch():
    """torch's AdamW skips a parameter whose `.grad` is None (no weight decay either)."""
    engine, reference, opt = _pair(None, "cpu")
    with engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        for model, step in ((reference, opt.step), (engine.module, engine.step)):
            model(idx, tgt).backward()
            step()
            model(idx, tgt).backward()
            model.zero_grad()
            for p in model.h[0].parameters():  # a user's own gradient for one block only
                p.grad = torch.full_like(p, 0.01)
            step()
        _assert_same_weights(engine, reference)


def test_zero_grad_keeping_zeros_still_decays_as_torch():
    """zero_grad(set_to_none=False): torch steps on zero gradients (weight decay, momentum apply)."""
    engine, reference, opt = _pair(None, "cpu")
    with engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        reference(idx, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad(set_to_none=False)
        with pytest.raises(OffloadError, match="zero_grad"):
            engine.module.zero_grad(set_to_none=False)  # torch would zero the tensors in place
        engine.step()
        _assert_same_weights(engine, reference)


class _Critic(nn.Module):
    """Two blocks with smooth activations: a gradient penalty needs double backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)).pow(2).mean()


def test_gradient_penalty_with_autograd_grad_under_declared_accumulation():
    """autograd.grad writes no `.grad`: torch counts one backward. Before: "backward called 2 times"."""
    torch.manual_seed(0)
    model, reference = _Critic(), _Critic()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    inputs = [torch.randn(4, 8) for _ in range(3)]
    with offload.wrap(model, tier="cpu", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32,
                      device="cpu", grad_accumulation_steps=1) as engine:
        for x in inputs:
            for net, run, step, zero in ((reference, reference, opt.step, opt.zero_grad),
                                         (model, engine, engine.step, engine.zero_grad)):
                loss = run(x)
                grads = torch.autograd.grad(loss, list(net.inner.parameters()), create_graph=True)
                penalty = sum(g.pow(2).sum() for g in grads)
                (loss + 0.1 * penalty).backward()
                step()
                zero()
        _assert_same_weights(engine, reference)


def test_grad_scaler_is_refused_with_the_fix():
    """Before: a torch assertion that said nothing about offload."""
    with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu") as engine:
        scaler = torch.amp.GradScaler("cpu")
        ((idx, tgt),) = make_batches(1, 1)[0]
        scaler.scale(engine(idx, tgt)).backward()
        with pytest.raises(OffloadError, match="GradScaler.*bfloat16"):
            scaler.step(engine.optimizer)


def test_close_drops_the_stand_ins():
    model = TinyGPT()
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu") as engine:
        ((idx, tgt),) = make_batches(1, 1)[0]
        engine(idx, tgt).backward()
    assert all(p.grad is None for p in model.parameters())
    model(idx, tgt).backward()  # plain PyTorch again
    assert all(type(p.grad) is torch.Tensor for p in model.parameters() if p.requires_grad)
