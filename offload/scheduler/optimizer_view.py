"""`engine.optimizer`: a torch.optim.Optimizer facade over the engine's flat optimizer state.

It exists so that LR schedulers, `optimizer.param_groups[0]["lr"] = ...` and code that calls
`optimizer.step()` / `optimizer.zero_grad()` keep working. It calls `Optimizer.__init__` (so step hooks and
the scheduler's step counting work) but keeps no per-parameter state in `self.state`: the state lives in
the engine's flat buffers, in host memory or on disk.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from offload.errors import OffloadConfigError


class EngineOptimizer(torch.optim.Optimizer):
    """One parameter group; hyperparameters are read from it each time updates are scheduled."""

    def __init__(self, params: Iterable[nn.Parameter], defaults: dict, step_fn: Callable[[], None],
                 zero_grad_fn: Callable[[bool], None]) -> None:
        self._step_fn = step_fn
        self._zero_grad_fn = zero_grad_fn
        super().__init__(list(params), defaults)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "param_groups", None):
            raise OffloadConfigError("engine.optimizer has one parameter group; per-group options are not supported yet")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_fn()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grad_fn(set_to_none)
