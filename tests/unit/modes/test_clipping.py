"""The clip coefficient (modes/clipping.py), one formula for max_grad_norm, engine.clip_grad_norm_ and the
data-parallel norm, against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from offload.scheduler.modes.clipping import clip_scale


def _grads(seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * scale for shape in ((30, 150), (100,), (40, 50))]


@pytest.mark.parametrize("scale, max_norm", [(3.0, 0.5), (3.0, 1e6), (1e-6, 1e-5)],
                         ids=["clips", "does-not-clip", "tiny-norm"])  # tiny: the 1e-6 in the divisor shows
def test_clip_scale_equals_clip_grad_norm(scale, max_norm):
    grads = _grads(0, scale)
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch_total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    norms = [float(torch.linalg.vector_norm(g, 2, dtype=torch.float32)) for g in grads]
    total, coef = clip_scale(norms, max_norm)
    assert total == float(torch_total)
    assert (coef < 1.0) == (max_norm < total)
    for p, g in zip(params, grads):
        assert torch.equal(g * coef, p.grad)  # the gradients torch left, exactly
