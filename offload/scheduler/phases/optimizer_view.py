"""`engine.optimizer`: a torch.optim.Optimizer facade over the engine's flat optimizer state.

It exists so that LR schedulers, `optimizer.param_groups[0]["lr"] = ...` and code that calls
`optimizer.step()` / `optimizer.zero_grad()` keep working. It calls `Optimizer.__init__` (so step hooks and
the scheduler's step counting work) but keeps no per-parameter state in `self.state`: the state lives in
the engine's flat buffers, in host memory or on disk.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Protocol

import torch

from offload.errors import OffloadConfigError, OffloadError


class StepDriver(Protocol):
    """What `step()` and `zero_grad()` run (phases/step.py's `StepPhase`)."""

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class EngineOptimizer(torch.optim.Optimizer):
    """The groups given at `wrap()` (offload/param_groups.py); hyperparameters are read from them each time
    updates are scheduled. Groups cannot be added later: the engine placed every parameter at `wrap()`.
    The step phase (`driver`) is attached once it exists (`drive_with`): it reads these groups."""

    def __init__(self, groups: Iterable[dict], defaults: dict) -> None:
        self._driver: Optional[StepDriver] = None
        self._built = False
        super().__init__(list(groups), defaults)
        self._built = True

    def drive_with(self, driver: StepDriver) -> None:
        self._driver = driver

    def add_param_group(self, param_group: dict) -> None:
        if self._built:
            raise OffloadConfigError("engine.optimizer's groups are fixed at wrap(): pass param_groups=[...] to "
                                     "offload.wrap instead of adding a group afterwards")
        super().add_param_group(param_group)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler.step() asks this first: refuse with the fix instead of its assertion."""
        raise OffloadError(
            "torch.amp.GradScaler cannot drive engine.optimizer: the offload engine holds the gradients off the "
            "device, where GradScaler cannot unscale or check them. Train with dtype=torch.bfloat16 (no loss "
            "scaling needed) or float32")

    def state_dict(self) -> dict:
        raise OffloadError(
            "engine.optimizer.state_dict() has no per-parameter state in torch's format: the Adam moments and "
            "fp32 master weights live in the engine's flat buffers (host memory or the swap file), so a torch-"
            "style checkpoint would resume wrong; save and resume with engine.save(path) / engine.load(path). "
            "(The HF Trainer and accelerate.prepare() call this too: train with "
            "offload.integrations.transformers.OffloadTrainer(model=model, args=args, ..., offload=dict(tier=...)), "
            "or your own loop: loss = engine(batch); loss.backward(); engine.step(); engine.zero_grad())")

    def load_state_dict(self, state_dict: dict) -> None:
        raise OffloadError(
            "engine.optimizer.load_state_dict() cannot restore the engine's optimizer state; resume with "
            "engine.load(path) from a checkpoint written by engine.save(path)")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self._driver is not None
        self._driver.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        assert self._driver is not None
        self._driver.zero_grad(set_to_none)
