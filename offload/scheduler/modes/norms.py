"""Global-norm clipping over the gradients the engine holds, as torch.nn.utils.clip_grad_norm_ computes it:
at `step()` with `max_grad_norm` (the scale goes into the update), and for `engine.clip_grad_norm_`
(the gradients are scaled in place, as torch scales each `.grad`). See docs/design.md [Note: clipping parity]."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Tuple

import torch
from torch import nn

from offload.scheduler.state.adamw import clip_scale

if TYPE_CHECKING:
    from offload.scheduler.records.block_runtime import BlockRuntime
    from offload.scheduler.records.slot_table import SlotTable


def global_norm(blocks: List["BlockRuntime"], slots: "SlotTable", max_norm: float) -> Tuple[float, float]:
    """(total L2 norm, gradient scale min(max_norm / (total + 1e-6), 1)), the per-parameter norms reduced
    in torch's order (`model.parameters()`); a block's norms computed on the worker during backward are used."""
    per_param = [n for b in blocks for n in _norms_of(b)]
    per_param.sort(key=lambda pn: slots[pn[0]].position)
    return clip_scale([n for _p, n in per_param], max_norm)


def clip_scale_of(total: float, max_norm: float) -> Tuple[float, float]:
    """(total, gradient scale) for a total norm computed elsewhere (data-parallel: across the ranks), with
    torch's fp32 arithmetic."""
    coef = torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
    return total, float(coef)


def clip_in_place(blocks: List["BlockRuntime"], norm: Tuple[float, float], error_if_nonfinite: bool) -> float:
    """torch.nn.utils.clip_grad_norm_ over the held gradients, given their (total norm, scale); returns the
    total norm before clipping."""
    total_norm, coef = norm
    if error_if_nonfinite and not math.isfinite(total_norm):
        raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total_norm}), so it "
                           "cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    for block in blocks:
        block.norms = None  # norms computed during backward are of the unclipped gradients
        block.shard_sumsq = None
        for state in block.states:
            state.grads.scale_(coef)
    return total_norm


def _norms_of(runtime: "BlockRuntime") -> List[Tuple[nn.Parameter, float]]:
    if runtime.norms is not None:
        return runtime.norms
    return [n for state in runtime.states for n in state.grads.norms()]
