"""`engine.optimizer`: a torch.optim.Optimizer facade over the engine's flat optimizer state.

It exists so that LR schedulers, `optimizer.param_groups[0]["lr"] = ...` and code that calls
`optimizer.step()` / `optimizer.zero_grad()` keep working. It calls `Optimizer.__init__` (so step hooks and
the scheduler's step counting work) but keeps no per-parameter state of its own: the state lives in the
engine's flat buffers, in host memory or on disk. `state[p]`, `state_dict()` and `load_state_dict()` speak
torch's AdamW format through the engine's `TorchStateIO` (engine/torch_state.py). Its groups see each
assignment (`WatchedGroup`), so a setting the engine cannot honour raises at the line that makes it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Protocol

import torch
from torch import Tensor, nn

from offload.errors import OffloadConfigError, OffloadError

# what torch.optim.AdamW's groups hold besides the hyperparameters the engine reads: a state dict carries
# them so that torch's AdamW loads it as its own; loading one with amsgrad or maximize set is refused
ADAMW_FLAGS: Dict[str, Any] = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                               "differentiable": False, "fused": None, "decoupled_weight_decay": True}
UNSUPPORTED_FLAGS = ("amsgrad", "maximize")


class StepDriver(Protocol):
    """What `step()` and `zero_grad()` run (phases/step.py's `StepPhase`)."""

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class TorchStateIO(Protocol):
    """The engine's optimizer state per parameter, in torch AdamW's terms (engine/torch_state.py)."""

    def per_param_state(self, only: Optional[nn.Parameter] = None) -> Dict[nn.Parameter, Dict[str, Tensor]]: ...

    def load_per_param_state(self, state: Mapping[nn.Parameter, Mapping[str, Any]]) -> None: ...


class GroupWatcher(Protocol):
    """Told of each assignment to a param group before it is made (state/hypers.py's `StepHypers`)."""

    def group_changes(self, index: int, group: Mapping[str, Any], key: str, value: Any) -> None:
        """Raise when `group[key] = value` cannot be honoured now."""


class WatchedGroup(dict):
    """One of `engine.optimizer.param_groups`: a dict, as torch's, whose assignments (`group["lr"] = ...`,
    `update`, `setdefault`) are checked first: AdamW options the engine does not run raise, and so does a
    hyperparameter changed after blocks already updated with the old value. Copies and pickles are plain dicts."""

    def __init__(self, group: Mapping[str, Any], index: int) -> None:
        super().__init__(group)
        self.index = index
        self.watcher: Optional[GroupWatcher] = None

    def __setitem__(self, key: str, value: Any) -> None:
        if key in UNSUPPORTED_FLAGS and value:
            raise OffloadError(f"engine.optimizer.param_groups[{self.index}][{key!r}] = {value!r}: the engine runs "
                               f"AdamW without {key}, so the setting would be ignored; train with torch.optim.AdamW "
                               f"for {key}")
        if self.watcher is not None:
            self.watcher.group_changes(self.index, self, key, value)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return dict, (dict(self),)


class OptimizerState(Mapping):
    """`engine.optimizer.state`: each stepped parameter's AdamW state as torch keeps it (`step`, `exp_avg`,
    `exp_avg_sq`), read from where the engine keeps it at each look up, so it is current and costs a read of the
    parameter's group (a collective under data parallelism, as `state_dict()`). A copy: it cannot be written to
    (load a state dict to change the state). A parameter not stepped has `{}`, as in torch's defaultdict."""

    def __init__(self, io: TorchStateIO, params: Iterable[nn.Parameter]) -> None:
        self._io = io
        self._params = list(params)  # the trainable ones: only they can have state

    def __getitem__(self, param: Any) -> Mapping[str, Tensor]:
        return _ReadOnlyState(self._io.per_param_state(only=param).get(param, {}))

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self._io.per_param_state())

    def __len__(self) -> int:
        return len(self._io.per_param_state())

    def __contains__(self, param: object) -> bool:
        return any(param is p for p in self._params) and param in self._io.per_param_state(only=param)  # type: ignore[arg-type]

    def __setitem__(self, param: Any, value: Any) -> None:
        raise OffloadError(_STATE_IS_A_COPY)


class _ReadOnlyState(dict):
    """One parameter's entry of `OptimizerState`: its tensors are copies, so a write is refused, naming the way."""

    def __setitem__(self, key: str, value: Any) -> None:
        raise OffloadError(_STATE_IS_A_COPY)

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise OffloadError(_STATE_IS_A_COPY)


_STATE_IS_A_COPY = ("engine.optimizer.state holds copies of the engine's AdamW state (it lives in flat buffers, in "
                    "host memory or on disk, where engine.plan says): change it with "
                    "engine.optimizer.load_state_dict(...), or engine.load(checkpoint)")


class EngineOptimizer(torch.optim.Optimizer):
    """The groups given at `wrap()` (offload/param_groups.py); hyperparameters are read from them each time
    updates are scheduled. Groups cannot be added later: the engine placed every parameter at `wrap()`.
    The step phase (`driver`) is attached once it exists (`drive_with`): it reads these groups."""

    def __init__(self, groups: Iterable[dict], defaults: dict) -> None:
        self._driver: Optional[StepDriver] = None
        self._state_io: Optional[TorchStateIO] = None
        self._exporting: Optional[Dict[Any, Any]] = None  # the state `state_dict()` hands torch's
        self._built = False
        super().__init__(list(groups), defaults)
        self.param_groups = [WatchedGroup(group, i) for i, group in enumerate(self.param_groups)]
        self._built = True

    @property  # type: ignore[override]
    def state(self) -> Mapping[Any, Any]:
        """Each parameter's AdamW state as torch keeps it (`OptimizerState`)."""
        if self._exporting is not None:
            return self._exporting
        if self._state_io is None:
            return self._unbuilt_state
        return OptimizerState(self._state_io, (p for group in self.param_groups for p in group["params"]))

    @state.setter
    def state(self, value: Any) -> None:  # torch's __init__ sets it: what the state reads before the engine is built
        self._unbuilt_state = value

    def watch_groups_with(self, watcher: GroupWatcher) -> None:
        for group in self.param_groups:
            assert isinstance(group, WatchedGroup)
            group.watcher = watcher

    def drive_with(self, driver: StepDriver) -> None:
        self._driver = driver

    def keep_state_with(self, state_io: TorchStateIO) -> None:
        self._state_io = state_io

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
        """torch.optim.AdamW's state dict of the engine's state: `param_groups` with AdamW's keys, per stepped
        parameter `step`, `exp_avg`, `exp_avg_sq` (and `offload_master`, the fp32 master weights, where the
        compute weights are not fp32). Waits for the updates in flight. Data-parallel: a collective; every
        rank gets the whole state."""
        if self._state_io is None:
            raise OffloadError("engine.optimizer.state_dict(): the engine is still being built")
        fresh: defaultdict = defaultdict(dict)
        fresh.update(self._state_io.per_param_state())
        self._exporting = fresh
        try:
            out = super().state_dict()
        finally:
            self._exporting = None
        for group in out["param_groups"]:
            for key, value in ADAMW_FLAGS.items():
                group.setdefault(key, value)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of `state_dict()` or of torch.optim.AdamW over the same parameters, in the same
        groups: the state of each parameter (none: it starts afresh, as in torch) and the groups'
        hyperparameters. Checked whole before anything changes."""
        if self._state_io is None:
            raise OffloadError("engine.optimizer.load_state_dict(): the engine is still being built")
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        saved_groups = state_dict["param_groups"]
        _check_groups(saved_groups, self.param_groups)
        index = {i: p for saved, mine in zip(saved_groups, self.param_groups)
                 for i, p in zip(saved["params"], mine["params"])}
        unknown = [k for k in state_dict["state"] if k not in index]
        if unknown:
            raise OffloadError(f"engine.optimizer.load_state_dict(): state for parameter ids {unknown[:5]} that "
                               "no group lists: the state dict is of another optimizer")
        self._state_io.load_per_param_state({index[k]: v for k, v in state_dict["state"].items()})
        for saved, mine in zip(saved_groups, self.param_groups):
            mine.update({k: v for k, v in saved.items() if k not in ("params", "param_names", *ADAMW_FLAGS)})
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError(
            "engine.optimizer cannot be copied or pickled: its state lives in the engine (host memory or the swap "
            "file), which a copy would not own. Copy or save its state instead: "
            "copy.deepcopy(engine.optimizer.state_dict()), torch.save(engine.optimizer.state_dict(), path), or "
            "engine.save(path)")

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


def _check_groups(saved: Any, mine: Any) -> None:
    """Torch's own checks, and AdamW's options the engine does not run."""
    if len(saved) != len(mine) or any(len(a["params"]) != len(b["params"]) for a, b in zip(saved, mine)):
        raise OffloadError(
            f"engine.optimizer.load_state_dict(): the state dict has {len(saved)} parameter groups of sizes "
            f"{[len(g['params']) for g in saved]}, the engine {len(mine)} of sizes {[len(g['params']) for g in mine]}"
            ": load a state dict of the same parameters in the same groups (offload.wrap's param_groups=)")
    for group in saved:
        on = [flag for flag in UNSUPPORTED_FLAGS if group.get(flag)]
        if on:
            raise OffloadError(f"engine.optimizer.load_state_dict(): the state dict's AdamW ran with {on} set; the "
                               "engine runs AdamW without them, so the state would resume other maths")
