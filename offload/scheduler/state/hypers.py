"""`StepHypers`: the optimizer groups' hyperparameters, read when updates are scheduled.

A block updated during the last backward read them then; `step()` reads them again for the others and
warns when they changed in between (an LR scheduler stepped before `step()`), since the blocks updated
early used the earlier values."""

from __future__ import annotations

from typing import List, Optional, Tuple

from offload.scheduler.state.adamw import AdamHyper


class StepHypers:
    def __init__(self, param_groups: List[dict]) -> None:
        self._groups = param_groups  # engine.optimizer.param_groups: the user changes them in place
        self._early: Optional[Tuple[AdamHyper, ...]] = None

    def read(self) -> Tuple[AdamHyper, ...]:
        """Each optimizer group's hyperparameters as they are now."""
        return tuple(AdamHyper.from_group(group) for group in self._groups)

    def for_early_update(self) -> Tuple[AdamHyper, ...]:
        """Those of an update during the backward (read now, and kept to compare at `step()`)."""
        self._early = self.read()
        return self._early

    def changed_since_early(self, now: Tuple[AdamHyper, ...]) -> bool:
        return self._early is not None and self._early != now

    def reset(self) -> None:
        self._early = None
