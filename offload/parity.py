"""`offload.verify`: train the same steps with plain PyTorch + torch.optim.AdamW and with offload, and
report the largest differences of loss and weights, so users can check parity on their own model."""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import nn

ModelFn = Callable[[], Union[nn.Module, Tuple[nn.Module, Callable[[int], tuple]]]]


@dataclass(frozen=True)
class VerifyReport:
    """Result of `verify`: per-step losses both ways and the largest differences."""

    tier: str
    steps: int
    reference_losses: Tuple[float, ...]
    offload_losses: Tuple[float, ...]
    max_loss_diff: float
    max_weight_diff: float
    worst_parameter: str

    def passed(self, tolerance: float = 1e-5) -> bool:
        return self.max_loss_diff <= tolerance and self.max_weight_diff <= tolerance


def verify(model_fn: ModelFn, steps: int = 4, tier: str = "cpu", *, batch_fn: Optional[Callable[[int], tuple]] = None,
           lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
           max_grad_norm: Optional[float] = None, grad_accumulation_steps: int = 1, dtype: torch.dtype = torch.float32,
           device: Union[str, torch.device, None] = "cpu", nvme_path: Optional[str] = None) -> VerifyReport:
    """Run `steps` optimizer steps of the model from `model_fn()` both ways, from the same weights and batches.

    Args:
        model_fn: returns the model (then give `batch_fn`) or `(model, batch_fn)`. `batch_fn(i)` returns the
            forward's arguments for micro-batch i; the forward returns the loss.
        tier, dtype, device, nvme_path, max_grad_norm, lr, betas, eps, weight_decay: as for `offload.wrap`
            (nvme_path defaults to a temporary directory).
        grad_accumulation_steps: micro-batches per step.
    """
    from offload.api import wrap  # late: offload/__init__ imports this module

    built = model_fn()
    model, batch_fn = (built if isinstance(built, tuple) else (built, batch_fn))
    if batch_fn is None:
        raise TypeError("verify needs batch_fn (or model_fn returning (model, batch_fn))")
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    ref_losses = _train(reference, optimizer.step, optimizer.zero_grad, batch_fn, steps, grad_accumulation_steps,
                        lambda: torch.nn.utils.clip_grad_norm_(params, max_grad_norm) if max_grad_norm else None)
    with tempfile.TemporaryDirectory(prefix="offload-verify-") as scratch:
        engine = wrap(model, tier=tier, nvme_path=nvme_path or (scratch if tier == "nvme" else None), lr=lr,
                      betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm, dtype=dtype,
                      device=device, grad_accumulation_steps=grad_accumulation_steps)
        with engine:
            off_losses = _train(engine, engine.step, engine.zero_grad, batch_fn, steps, grad_accumulation_steps,
                                lambda: None)
            weights = engine.state_dict()
    expected = reference.state_dict()
    worst, worst_diff = "", 0.0
    for name, value in expected.items():
        diff = (value.float().cpu() - weights[name].float()).abs().max().item() if value.numel() else 0.0
        if diff > worst_diff or not worst:
            worst, worst_diff = name, diff
    loss_diff = max((abs(a - b) for a, b in zip(ref_losses, off_losses)), default=0.0)
    return VerifyReport(str(tier), steps, tuple(ref_losses), tuple(off_losses), loss_diff, worst_diff, worst)


def _train(model: Callable, step: Callable, zero_grad: Callable, batch_fn: Callable[[int], tuple], steps: int,
           accum: int, clip: Callable) -> List[float]:
    losses = []
    for i in range(steps):
        for j in range(accum):
            loss = model(*batch_fn(i * accum + j)) / accum
            loss.backward()
            losses.append(float(loss.detach()))
        clip()
        step()
        zero_grad()
    return losses
