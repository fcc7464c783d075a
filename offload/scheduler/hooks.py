"""Registers every hook the engine needs on the user's model, and removes all of them on `close()`.

- forward pre-hooks on each module that directly owns a block's parameters: wait for that block's
  pending update and make its weights resident (also runs for checkpoint recompute and under no_grad);
- a forward hook on the root module: hooks its outputs to learn when a backward pass begins;
- a post-accumulate-grad hook on each trainable parameter: moves its gradient off the device.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from offload.scheduler.block import Block


class HookSet:
    """The engine's hooks on one model; `remove()` restores the model to plain PyTorch."""

    def __init__(self) -> None:
        self._handles: List[RemovableHandle] = []

    def attach(self, root: nn.Module, blocks: List[Block], owners: Dict[int, List[nn.Module]],
               ensure_blocks: Callable[[List[Block]], None], leave_blocks: Callable[[List[Block]], None],
               on_backward_begin: Callable[[], None], on_grad: Callable[[nn.Parameter], None]) -> None:
        ensure_blocks, leave_blocks = _eager(ensure_blocks), _eager(leave_blocks)
        on_backward_begin, on_grad = _eager(on_backward_begin), _eager(on_grad)
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
        for key, module in modules.items():
            needed = blocks_of_module[key]
            self._handles.append(module.register_forward_pre_hook(lambda _m, _a, needed=needed: ensure_blocks(needed)))
            self._handles.append(module.register_forward_hook(
                lambda _m, _a, _o, needed=needed: leave_blocks(needed), always_call=True))

        def hook_outputs(_module: nn.Module, _args: object, output: object) -> None:
            if not torch.is_grad_enabled():
                return
            for leaf in tree_flatten(output)[0]:
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
                    leaf.register_hook(lambda _grad: on_backward_begin())

        self._handles.append(root.register_forward_hook(hook_outputs))

    def attach_root_context(self, root: nn.Module, enter: Callable[[], None], exit_: Callable[[], None]) -> None:
        """Run `enter` before the root module's forward and `exit_` after it, even when it raises.

        Registered before nothing else on the root, so the output hook sees the same context."""
        enter, exit_ = _eager(enter), _eager(exit_)
        self._handles.append(root.register_forward_pre_hook(lambda _m, _a: enter(), prepend=True))
        self._handles.append(root.register_forward_hook(lambda _m, _a, _o: exit_(), always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _eager(callback: Callable) -> Callable:
    """The hooks wait on threads, move memory and read clocks: torch.compile must run them as they are
    (a graph break) rather than try to trace into them."""
    disable = getattr(torch.compiler, "disable", None)
    return callback if disable is None else disable(callback)
