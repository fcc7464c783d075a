"""On a CUDA device: the engine with its side streams trains like plain torch.optim.AdamW on the same GPU.

Each case runs the tiny GPT (tests/models.py) both ways from the same weights and batches, fp32, and
compares every loss and the final weights. The `slow` cases make every layer's forward and backward sleep on
the compute stream (`torch.cuda._sleep`), so the GPU lags far behind the CPU: a side-stream copy that does not
wait for the compute stream, or a host read that does not wait for a copy, then sees stale bytes and the
weights differ by about lr. Skipped without a GPU; these have not run on one yet (docs/design.md
[Note: CUDA streams]).
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.models import TinyGPT, make_batches
from tests.test_engine_parity import STEPS, _engine, _reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = 1e-4  # the CPU Adam kernel and torch's CUDA AdamW round differently (~1e-7); a missed wait costs ~lr
BUDGET = 120_000  # tests/test_engine_streaming.py: the three layers stream
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time per layer call, forward and backward


def _slow_down(model):
    """Every layer call sleeps on the current stream, in forward and in backward."""
    def before(_module, _args):
        torch.cuda._sleep(SLEEP_CYCLES)

    def after(_module, _args, output):
        torch.cuda._sleep(SLEEP_CYCLES)
        if output.requires_grad:
            output.register_hook(lambda grad: (torch.cuda._sleep(SLEEP_CYCLES), grad)[1])

    for layer in model.h:
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)


def _cuda_batches(accum):
    return [[(idx.cuda(), tgt.cuda()) for idx, tgt in micro] for micro in make_batches(STEPS, accum)]


def _compare(tier, accum=1, declared=False, max_norm=None, device_memory=None, slow=False, dtype=torch.float32):
    torch.manual_seed(0)
    model = TinyGPT()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    twin.cuda()
    if slow:
        _slow_down(model)
        _slow_down(twin)
    batches = _cuda_batches(accum)
    ref_losses, _evals, ref_state = _reference(twin, batches, accum, max_norm, False, None)
    losses, _evals, state, stats = _engine(model, batches, accum, max_norm, False, None, tier, declared, device_memory,
                                           dtype=dtype, device="cuda")
    if dtype is torch.float32:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
        for name, ref in ref_state.items():
            diff = (state[name] - ref.cpu()).abs().max().item()
            assert diff <= TOL, f"{name}: max abs diff {diff}"
    if tier != "gpu":  # gradients went down and weights up on the side streams
        assert stats["copies_on_side_streams"] > 0
    return stats, losses


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
@pytest.mark.parametrize("accum,declared", [(1, False), (1, True), (4, False), (4, True)])
def test_cuda_parity(tier, accum, declared):
    stats, _ = _compare(tier, accum=accum, declared=declared)
    if tier == "gpu":
        assert stats["copies_on_side_streams"] == 0  # nothing crosses the link


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
@pytest.mark.parametrize("accum,declared", [(1, False), (4, True)])
def test_cuda_parity_clipping(tier, accum, declared):
    _compare(tier, accum=accum, declared=declared, max_norm=0.05)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("accum,declared,max_norm", [(1, False, None), (4, True, None), (4, False, 0.05)])
def test_cuda_parity_streamed_weights(tier, accum, declared, max_norm):
    stats, _ = _compare(tier, accum=accum, declared=declared, max_norm=max_norm, device_memory=BUDGET)
    assert stats["block_fetches"] > 0 and stats["block_evictions"] > 0
    assert stats["device_peak_bytes"] <= BUDGET


@pytest.mark.parametrize("tier,device_memory", [("cpu", None), ("cpu", BUDGET), ("nvme", BUDGET)])
@pytest.mark.parametrize("accum,declared,max_norm", [(1, True, None), (4, False, None), (4, False, 0.05)])
def test_cuda_parity_with_a_lagging_gpu(tier, device_memory, accum, declared, max_norm):
    _compare(tier, accum=accum, declared=declared, max_norm=max_norm, device_memory=device_memory, slow=True)


def test_cuda_bf16_gradients_cross_as_bf16():
    stats, losses = _compare("cpu", accum=1, dtype=torch.bfloat16)
    model = TinyGPT()  # same shapes and dtypes as the wrapped one
    with offload.wrap(model, tier="cpu", dtype=torch.bfloat16, device="cpu"):
        bf16 = sum(p.numel() for p in model.parameters() if p.requires_grad and p.dtype == torch.bfloat16)
        fp32 = sum(p.numel() for p in model.parameters() if p.requires_grad and p.dtype == torch.float32)
    assert stats["bytes_device_to_host"] == STEPS * (2 * bf16 + 4 * fp32)
    assert losses[-1] < losses[0]
