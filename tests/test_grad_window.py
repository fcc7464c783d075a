"""The nvme tier's gradient window (issue "larger than RAM"): with accumulation declared and no clipping,
each block's gradient lives in host memory only from its first part to the end of its update during the
last backward, so host memory holds a window of gradients, not the model's; from the first step on (the
first backward's profile is predicted from the forward). The maths is plain AdamW's."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.errors import OffloadError
from tests.models import TinyGPT, make_batches, one_intraop_thread

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _gpt() -> TinyGPT:
    return TinyGPT(vocab=128, dim=64, layers=12, context=16, heads=4)


def _host_budget(model, dtype) -> int:
    """1/8 of the fp32 optimizer state (12 B per trainable parameter)."""
    return 12 * sum(p.numel() for p in model.parameters() if p.requires_grad) // 8


def test_a_host_budget_of_an_eighth_of_the_state_trains_exactly_as_torch(tmp_path):
    torch.manual_seed(0)
    model, reference = _gpt(), _gpt()
    reference.load_state_dict(model.state_dict())
    host = _host_budget(model, torch.float32)
    with offload.wrap(_gpt(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                      host_memory=host) as undeclared:
        assert undeclared.plan.grads_on_disk  # they wait on disk (tests/test_grad_spill.py); declared, they need not
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, foreach=False)
    batches = make_batches(3, 1, vocab=128)
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      dtype=torch.float32, device="cpu", host_memory=host, grad_accumulation_steps=1) as engine:
        window = engine.plan.grad_window_bytes
        all_grads = sum(b.grad_bytes for b in engine.plan.blocks)
        assert window is not None and window < all_grads / 2
        assert "a window of" in str(engine.plan)
        for ((idx, tgt),) in batches:
            want = reference(idx, tgt)
            want.backward()
            opt.step()
            opt.zero_grad()
            got = engine(idx, tgt)
            got.backward()
            engine.step()
            engine.zero_grad()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        stats = engine.stats()
        trained = engine.state_dict()
    assert stats["host_grad_bytes_peak"] <= window
    assert stats["host_grad_over_budget_events"] == 0
    assert stats["early_block_updates"] >= len(batches) * 12  # from the first step: predicted from the forward
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_without_zero_grad_the_released_gradients_are_refused(tmp_path):
    """torch would add the next backward to the last step's gradients; the window gave them back. (Without a
    host_memory budget there is no window: the gradients stay, and this works as in torch.)"""
    with offload.wrap(_gpt(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                      host_memory=1 << 30, grad_accumulation_steps=1) as engine:
        ((idx, tgt),) = make_batches(1, 1, vocab=128)[0]
        engine(idx, tgt).backward()
        engine.step()
        with pytest.raises(OffloadError, match="given back after its update.*zero_grad\\(\\) after every step"):
            engine.step()  # torch would step again on the same gradients
        with pytest.raises(OffloadError, match="given back after its update"):
            engine(idx, tgt).backward()  # torch would add to them
        engine.zero_grad()
        engine(idx, tgt).backward()  # after zero_grad all is well
        engine.step()


def test_zero_grad_keeping_zeros_after_the_window_gave_the_buffer_back(tmp_path):
    """zero_grad(set_to_none=False) then step(): torch steps on zero gradients (decay and momentum)."""
    torch.manual_seed(0)
    model, reference = _gpt(), _gpt()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, foreach=False)
    ((idx, tgt),) = make_batches(1, 1, vocab=128)[0]
    reference(idx, tgt).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    opt.step()
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      dtype=torch.float32, device="cpu", host_memory=1 << 30, grad_accumulation_steps=1) as engine:
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad(set_to_none=False)
        engine.step()
        trained = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_reentrant_checkpointing_is_not_predicted_and_stays_exact(tmp_path):
    """A block recomputed in a nested backward fires twice: the first step does not predict it (it waits
    for step()); from the second step the measured profile updates it early."""
    torch.manual_seed(0)
    model = TinyGPT(checkpointing="reentrant")
    reference = TinyGPT(checkpointing="reentrant")
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=0.0,
                            foreach=False)
    batches = make_batches(3, 1)
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, lr=LR, weight_decay=0.0, dtype=torch.float32,
                      device="cpu", host_memory=1 << 30, grad_accumulation_steps=1) as engine:
        for ((idx, tgt),) in batches:
            reference(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
            engine(idx, tgt).backward()
            engine.step()
            engine.zero_grad()
        trained = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_without_a_host_budget_the_gradients_stay_and_accumulate_as_torch(tmp_path):
    """No budget, no window: the buffers stay allocated (giving them back would only cost page faults), so
    a second backward without zero_grad adds to the first, as torch does."""
    torch.manual_seed(0)
    model, reference = _gpt(), _gpt()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, foreach=False)
    batches = make_batches(2, 1, vocab=128)
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      dtype=torch.float32, device="cpu", grad_accumulation_steps=1) as engine:
        assert engine.plan.grad_window_bytes is None
        for ((idx, tgt),) in batches:
            reference(idx, tgt).backward()
            opt.step()
            engine(idx, tgt).backward()
            engine.step()
        trained = engine.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=1e-5, rtol=1e-5, msg=key)
