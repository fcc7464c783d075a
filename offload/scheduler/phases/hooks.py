"""Registers every hook the engine needs on the user's model, and removes all of them on `close()`.

- forward pre-hooks on each module that directly owns a block's parameters: wait for that block's
  pending update and make its weights resident (also runs for checkpoint recompute and under no_grad);
- a forward hook on the root module: hooks its outputs to learn when a backward pass begins;
- a post-accumulate-grad hook on each trainable parameter: moves its gradient off the device;
- a `__deepcopy__` on each module holding parameters: a plain PyTorch copy of the current weights
  (model_copy.py).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from offload.scheduler.blocks.block import Block
from offload.scheduler.records.model_copy import ModelCopies


class ForwardPhases(Protocol):
    """The phases the hooks run (scheduler/pipeline.py's `StepPipeline`)."""

    def begin_root_forward(self) -> None: ...

    def end_root_forward(self) -> None: ...

    def pre_forward(self, blocks: List[Block]) -> None: ...

    def post_forward(self, blocks: List[Block]) -> None: ...

    def begin_backward(self) -> None: ...

    def on_grad(self, param: nn.Parameter) -> None: ...

    def before_load_state_dict(self, blocks: Optional[List[Block]] = None) -> None: ...

    def before_state_dict(self, blocks: Optional[List[Block]] = None) -> None: ...

    def after_load_state_dict(self) -> None: ...

    def synchronize(self) -> None: ...


class HookSet:
    """The engine's hooks on one model; `remove()` restores the model to plain PyTorch."""

    def __init__(self) -> None:
        self._handles: List[RemovableHandle] = []
        self._copies: Optional[ModelCopies] = None

    def attach(self, root: nn.Module, blocks: List[Block], owners: Dict[int, List[nn.Module]],
               phases: ForwardPhases) -> None:
        """Hook `phases` into the model: each block owner's pre- and post-forward, each trainable parameter's
        gradient, the root's outputs (a backward begins), and the root's forward as a whole."""
        pre_forward, post_forward = _eager(phases.pre_forward), _eager(phases.post_forward)
        begin_backward, on_grad = _eager(phases.begin_backward), _eager(phases.on_grad)
        blocks_of_module: Dict[int, List[Block]] = {}
        modules: Dict[int, nn.Module] = {}
        for block in blocks:
            for slot in block.slots:
                for module in owners.get(id(slot.param), []):
                    listed = blocks_of_module.setdefault(id(module), [])
                    if block not in listed:
                        listed.append(block)
                    modules[id(module)] = module
                if slot.trainable:
                    self._handles.append(slot.param.register_post_accumulate_grad_hook(on_grad))
        before_load, after_load = phases.before_load_state_dict, phases.after_load_state_dict
        before_state_dict = phases.before_state_dict
        for key, module in modules.items():
            needed = blocks_of_module[key]
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a, needed=needed: pre_forward(needed)))
            self._handles.append(module.register_forward_hook(
                lambda _m, _a, _o, needed=needed: post_forward(needed), always_call=True))
            # a sub-module's (or any ancestor's) state_dict / load_state_dict reaches these through torch's
            # recursion: its blocks' pending updates land first, and streamed placeholders are refused
            self._handles.append(module.register_state_dict_pre_hook(
                lambda *_args, needed=needed: before_state_dict(needed)))
            self._handles.append(module.register_load_state_dict_pre_hook(
                lambda *_args, needed=needed: before_load(needed)))

        def hook_outputs(_module: nn.Module, _args: object, output: object) -> None:
            if not torch.is_grad_enabled():
                return
            for leaf in _tensors_in(output):
                if leaf.requires_grad and leaf.grad_fn is not None:
                    leaf.register_hook(lambda _grad: begin_backward())

        self._handles.append(root.register_forward_hook(hook_outputs))
        # model.load_state_dict(): the engine's copies of the weights (master, host mirrors) follow it (a
        # sub-module's load is caught by the parameters' version counters, [Note: weights written after wrap()]).
        self._handles.append(root.register_load_state_dict_pre_hook(lambda *_args: before_load()))
        self._handles.append(root.register_load_state_dict_post_hook(lambda *_args: after_load()))
        # model.state_dict() right after step(): current weights
        self._handles.append(root.register_state_dict_pre_hook(lambda *_args: before_state_dict()))
        # The root's context encloses everything above: entered before any pre-hook, left after every hook.
        enter, exit_ = _eager(phases.begin_root_forward), _eager(phases.end_root_forward)
        self._handles.append(root.register_forward_pre_hook(lambda _m, _a: enter(), prepend=True))
        self._handles.append(root.register_forward_hook(lambda _m, _a, _o: exit_(), always_call=True))
        # copy.deepcopy(model) or of a sub-module: a plain copy, current weights, no engine hooks (model_copy.py)
        self._copies = ModelCopies(root, blocks, phases.synchronize, self._handles)

    def remove(self) -> None:
        if self._copies is not None:
            self._copies.remove()
            self._copies = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _tensors_in(output: object, depth: int = 0) -> List[torch.Tensor]:
    """The tensors of a module's output: in containers torch's pytree knows, and one level into the
    attributes of a plain object (a model returning its own result class), where pytree sees one leaf."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif depth == 0 and hasattr(leaf, "__dict__") and not isinstance(leaf, (nn.Module, type)):
            found.extend(_tensors_in(vars(leaf), depth + 1))
    return found


def _eager(callback: Callable) -> Callable:
    """The hooks wait on threads, move memory and read clocks: torch.compile must run them as they are
    (a graph break) rather than try to trace into them."""
    disable = getattr(torch.compiler, "disable", None)
    return callback if disable is None else disable(callback)
