"""`StepHypers`: the optimizer groups' hyperparameters, read when updates are scheduled.

A block updated during the last backward read them then; `step()` reads them again for the others. A change in
between (an LR scheduler stepped, or warm-up set in a step pre-hook, before `step()`) could not reach the blocks
updated early, so the assignment itself raises (`group_changes`, told by phases/optimizer_view.py's groups).
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

from offload.errors import OffloadError
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

    def group_changes(self, index: int, group: Mapping[str, Any], key: str, value: Any) -> None:
        """`group[key] = value` after blocks updated during the last backward with the old value: refused."""
        if self._early is None or key not in ("lr", "betas", "eps", "weight_decay"):
            return
        try:
            changed = AdamHyper.from_group({**group, key: value}) != self._early[index]
        except (TypeError, ValueError, KeyError):
            return  # not a hyperparameter the update could read; the update's own check names it
        if changed:
            raise OffloadError(
                f"engine.optimizer.param_groups[{index}][{key!r}] = {value!r} between the last backward and step(): "
                f"blocks already updated during that backward with {key}={group.get(key)!r} (grad_accumulation_steps "
                "declared lets them update as their gradients complete). Set hyperparameters before the last "
                "backward (an LR scheduler's step() right after engine.step(), warm-up before the forward), or "
                "leave grad_accumulation_steps unset so every update waits for step()")

    def reset(self) -> None:
        self._early = None
