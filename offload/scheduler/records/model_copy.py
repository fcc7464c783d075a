"""`copy.deepcopy` of a wrapped model, or of any of its sub-modules: a plain PyTorch copy of the current weights.

Without this, `ema = copy.deepcopy(model)` copied what the module holds: a streamed block's parameters are a
NaN placeholder outside their module's forward, and the engine's hooks live in the module's own hook dicts,
so the copy carried them and called into the original engine (its forward waited on the original's blocks,
its backward counted as one of the original's micro-batches) and carried the engine's mark (`wrap(copy)`
refused it as wrapped already).

`copy.deepcopy(x)` looks `__deepcopy__` up on the instance, so `ModelCopies` puts one into the `__dict__` of
every module that holds parameters (removed with the hooks at `close()`). It waits for the pending updates,
refuses a copy in the middle of a step whose blocks were already updated during the backward, puts real
copies of the streamed parameters (from their weight homes, in the dtype and on the device of the
wrapped parameters) into deepcopy's memo, copies the module with torch's own machinery, and strips the
engine's hooks and mark from the copy. Gradients are not copied (`Parameter.__deepcopy__` never copies
`.grad`), nor is anything of the engine. See docs/design.md [Note: reading streamed weights outside their
module].
"""

from __future__ import annotations

import copy
import weakref
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from offload.errors import OffloadError
from offload.scheduler.blocks.block import MARKER, ParamSlot
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.group import GroupRecord

_MARKS = (MARKER,)  # what the engine sets on the root module


class ModelCopies:
    """Intercepts `copy.deepcopy` of the model and of its sub-modules while the engine is attached."""

    def __init__(self, root: nn.Module, records: List[BlockRecord], synchronize: Callable[[], None],
                 handles: List[RemovableHandle]) -> None:
        self._records = records
        self._synchronize = synchronize
        self._handles = handles  # the engine's hooks, read at copy time (every one attached by then)
        self._installed: Dict[int, "weakref.ref[nn.Module]"] = {}
        self._copiers: Dict[int, Callable] = {}
        for module in root.modules():
            if next(module.parameters(), None) is None:
                continue  # nothing of the engine inside: torch's own deepcopy is right
            copier = _copier(weakref.ref(module), weakref.ref(self))
            module.__dict__["__deepcopy__"] = copier
            self._installed[id(module)] = weakref.ref(module)
            self._copiers[id(module)] = copier

    def remove(self) -> None:
        """Take every `__deepcopy__` back (the model is plain PyTorch again)."""
        for key, ref in self._installed.items():
            module = ref()
            if module is not None and module.__dict__.get("__deepcopy__") is self._copiers[key]:
                del module.__dict__["__deepcopy__"]
        self._installed.clear()
        self._copiers.clear()

    # ----- the copy ----------------------------------------------------------------------------------
    def copy(self, module: nn.Module, memo: Optional[dict]) -> nn.Module:
        memo = {} if memo is None else memo
        self._refuse_mid_step(module)
        self._synchronize()  # step() returns before the updates run; a failed engine raises here
        try:
            self._memo_streamed(module, memo)
            with self._without_copiers():
                result = copy.deepcopy(module, memo)
        except torch.cuda.OutOfMemoryError as exc:  # torch.OutOfMemoryError from torch 2.5 on
            raise OffloadError(
                f"copy.deepcopy of {type(module).__name__}: the copy of all its weights (streamed blocks included) "
                f"does not fit on {self._device_of(module)}; build a fresh model on the CPU and load "
                "engine.state_dict() into it (CPU copies of the current weights)") from exc
        self._strip(result)
        return result

    def _refuse_mid_step(self, module: nn.Module) -> None:
        """With grad_accumulation_steps declared, blocks update during the last backward: between it and
        step(), a copy would mix stepped blocks and blocks not yet stepped (torch would copy none stepped)."""
        early = [r.block.name for r in self._records if r.updated_early]
        if early:
            raise OffloadError(
                f"copy.deepcopy of {type(module).__name__} between the last backward and step(): with "
                f"grad_accumulation_steps declared, blocks (first: {early[0]!r}) were already updated during that "
                "backward, others not yet, so the copy would mix the two; copy after engine.step()")

    def _memo_streamed(self, module: nn.Module, memo: dict) -> None:
        """A real parameter for each streamed one under `module`, made from its weight home; deepcopy then
        takes it from the memo (tied parameters stay tied, being one entry)."""
        inside = {id(p) for _n, p in module.named_parameters(remove_duplicate=False)}
        for record in self._records:
            if not record.streamed:
                continue
            for group in record.groups:
                wanted = [s for s in group.group.slots if id(s.param) in inside and id(s.param) not in memo]
                if wanted:
                    _memo_group(group, wanted, memo)

    def _without_copiers(self) -> "_Detached":
        return _Detached(self)

    def _strip(self, result: nn.Module) -> None:
        """Drop the engine's hooks (by their handles' ids: the user's own hooks stay) and its mark."""
        ids = {handle.id for handle in self._handles}
        for sub in result.modules():
            for name, value in vars(sub).items():
                if "hooks" in name and isinstance(value, dict):
                    for key in ids & value.keys():
                        del value[key]
            for mark in _MARKS:
                sub.__dict__.pop(mark, None)
        for _name, param in result.named_parameters(remove_duplicate=False):
            hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            if isinstance(hooks, dict):
                for key in ids & hooks.keys():
                    del hooks[key]

    @staticmethod
    def _device_of(module: nn.Module) -> str:
        param = next(module.parameters(), None)
        return "the device" if param is None else str(param.device)


class _Detached:
    """Takes the copiers out of the modules' `__dict__` while torch's deepcopy runs (it would call them for
    every sub-module, and copy them into the copy), and puts them back after."""

    def __init__(self, owner: ModelCopies) -> None:
        self._owner = owner
        self._taken: List[nn.Module] = []

    def __enter__(self) -> None:
        owner = self._owner
        for key, ref in owner._installed.items():
            module = ref()
            if module is not None and module.__dict__.get("__deepcopy__") is owner._copiers[key]:
                del module.__dict__["__deepcopy__"]
                self._taken.append(module)

    def __exit__(self, *exc: object) -> None:
        owner = self._owner
        for module in self._taken:
            module.__dict__["__deepcopy__"] = owner._copiers[id(module)]
        self._taken.clear()


def _copier(module_ref: "weakref.ref[nn.Module]", owner_ref: "weakref.ref[ModelCopies]") -> Callable:
    """The `__deepcopy__(memo)` found on one module. A plain function: deepcopy treats it as atomic (a bound
    method would be deep-copied with its object), and weak references keep the module and engine free."""

    def __deepcopy__(memo: Optional[dict] = None) -> nn.Module:
        module, owner = module_ref(), owner_ref()
        if module is None or owner is None:
            raise OffloadError("copy.deepcopy of a module whose offload engine is gone; engine.close() first")
        return owner.copy(module, memo)

    return __deepcopy__


def _memo_group(group: GroupRecord, slots: List[ParamSlot], memo: dict) -> None:
    host = group.home.host_weights()  # the authoritative copy of a streamed block (all updates in)
    for slot in slots:
        value = host[slot.offset:slot.offset + slot.numel].view(slot.shape)
        value = value.to(slot.param.device, copy=True)  # placeholders live on the device the weights compute on
        memo[id(slot.param)] = type(slot.param)(value, slot.param.requires_grad)


__all__ = ["ModelCopies"]
