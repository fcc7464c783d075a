"""Registers every hook the engine needs on the user's model, and removes all of them on `close()`.

- forward pre-hooks and hooks on each module that directly owns a block's parameters (`OwnerHooks`): the
  forward phase gets that block ready (also for checkpoint recompute and under no_grad) and lets it go;
- on the root module (`RootHooks`): its forward as a whole (entered before any other pre-hook, left after
  every hook), its outputs hooked to learn when a backward pass begins, its state-dict hooks;
- a post-accumulate-grad hook on each trainable parameter: the backward phase's `on_grad`;
- a `__deepcopy__` on each module holding parameters: a plain PyTorch copy of the current weights
  (records/model_copy.py).
Each hook is a bound method of a named object: nothing anonymous stands between autograd and the phases.
The forward and backward hooks are registered as `eager(...)`: torch.compile runs them as they are (a graph
break). That happens here, at wrap(), not when offload is imported: `torch.compiler.disable` imports dynamo
(about 1.2 s), which `import offload` alone (the CLI, `doctor`) does not need.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from offload.scheduler.activations.meter import token_count
from offload.scheduler.blocks.block import Block
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.model_copy import ModelCopies
from offload.scheduler.torch_internals import eager, flatten


class ForwardHooks(Protocol):
    def begin_root_forward(self, tokens: Optional[int] = None) -> None: ...

    def end_root_forward(self) -> None: ...

    def pre_forward(self, blocks: List[Block]) -> None: ...

    def post_forward(self, blocks: List[Block]) -> None: ...


class BackwardHooks(Protocol):
    def begin_backward(self) -> None: ...

    def on_grad(self, param: nn.Parameter) -> None: ...


class StateDictHooks(Protocol):
    def before_state_dict(self, blocks: Optional[List[Block]] = None) -> None: ...

    def after_state_dict(self, state_dict: Dict[str, Any], prefix: str = "") -> None: ...

    def after_owner_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str) -> None: ...

    def before_load_state_dict(self, blocks: Optional[List[Block]] = None) -> None: ...

    def after_load_state_dict(self) -> None: ...


class Synchronizing(Protocol):
    def synchronize(self) -> None: ...


class OwnerHooks:
    """The hooks of one module that owns parameters of `blocks`: the blocks ready for its forward, and its
    (or any ancestor's) state_dict / load_state_dict reaching them through torch's recursion: their pending
    updates land first; a state dict's entries of streamed blocks become host copies, a load into them is
    refused."""

    def __init__(self, blocks: List[Block], forward: ForwardHooks, state_dicts: StateDictHooks) -> None:
        self._blocks = blocks
        self._forward = forward
        self._state_dicts = state_dicts

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OwnerHooks":
        """`copy.deepcopy(model)` copies the module's hook dicts before the copy's engine hooks are taken
        out (records/model_copy.py): the hook is shared, never copied (it holds the engine)."""
        return self

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self._forward.pre_forward(self._blocks)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward.post_forward(self._blocks)

    def before_state_dict(self, *args: Any) -> None:
        self._state_dicts.before_state_dict(self._blocks)

    def after_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, metadata: Any) -> None:
        self._state_dicts.after_owner_state_dict(module, state_dict, prefix)

    def before_load_state_dict(self, *args: Any) -> None:
        self._state_dicts.before_load_state_dict(self._blocks)


class RootHooks:
    """The root module's hooks: its forward as a whole, its outputs (a backward begins), its state dict."""

    def __init__(self, forward: ForwardHooks, backward: BackwardHooks, state_dicts: StateDictHooks) -> None:
        self._forward = forward
        self._backward = backward
        self._state_dicts = state_dicts
        self._output_grad = eager(self.output_grad)  # registered on each forward's outputs

    def __deepcopy__(self, memo: Dict[int, Any]) -> "RootHooks":
        return self  # as OwnerHooks.__deepcopy__

    def enter(self, module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        self._forward.begin_root_forward(token_count(args, kwargs))

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward.end_root_forward()

    def hook_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for leaf in _tensors_in(output):
            if leaf.requires_grad and leaf.grad_fn is not None:
                leaf.register_hook(self._output_grad)

    def output_grad(self, grad: torch.Tensor) -> None:
        self._backward.begin_backward()

    def before_state_dict(self, *args: Any) -> None:
        self._state_dicts.before_state_dict()  # model.state_dict() right after step(): current weights

    def after_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, metadata: Any) -> None:
        self._state_dicts.after_state_dict(state_dict, prefix)  # entries with storages of their own

    def before_load_state_dict(self, *args: Any) -> None:
        self._state_dicts.before_load_state_dict()

    def after_load_state_dict(self, *args: Any) -> None:
        self._state_dicts.after_load_state_dict()


class HookSet:
    """The engine's hooks on one model; `remove()` restores the model to plain PyTorch."""

    def __init__(self) -> None:
        self._handles: List[RemovableHandle] = []
        self._copies: Optional[ModelCopies] = None

    def attach(self, root: nn.Module, blocks: List[Block], owners: Dict[int, List[nn.Module]],
               forward: ForwardHooks, backward: BackwardHooks, state_dicts: StateDictHooks,
               sync: Synchronizing, records: List[BlockRecord]) -> None:
        """Hook the phases into the model: each block owner's pre- and post-forward, each trainable parameter's
        gradient, the root's outputs (a backward begins), and the root's forward as a whole; `records`: the
        blocks' records, which a deepcopy reads streamed weights through."""
        blocks_of_module: Dict[int, List[Block]] = {}
        modules: Dict[int, nn.Module] = {}
        on_grad = eager(backward.on_grad)
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
            hooks = OwnerHooks(blocks_of_module[key], forward, state_dicts)
            self._handles.append(module.register_forward_pre_hook(eager(hooks.pre_forward)))
            self._handles.append(module.register_forward_hook(eager(hooks.post_forward), always_call=True))
            self._handles.append(module.register_state_dict_pre_hook(hooks.before_state_dict))
            # a partial, not the bound method: torch marks the hook it is given with an attribute
            self._handles.append(module.register_state_dict_post_hook(functools.partial(OwnerHooks.after_state_dict,
                                                                                        hooks)))
            self._handles.append(module.register_load_state_dict_pre_hook(hooks.before_load_state_dict))
        root_hooks = RootHooks(forward, backward, state_dicts)
        self._handles.append(root.register_forward_hook(eager(root_hooks.hook_outputs)))
        # model.load_state_dict(): the engine's copies of the weights (master, host mirrors) follow it (a
        # sub-module's load is caught by the parameters' version counters, [Note: weights written after wrap()]).
        self._handles.append(root.register_load_state_dict_pre_hook(root_hooks.before_load_state_dict))
        self._handles.append(root.register_load_state_dict_post_hook(root_hooks.after_load_state_dict))
        self._handles.append(root.register_state_dict_pre_hook(root_hooks.before_state_dict))
        # a partial, not the bound method: torch marks the hook it is given with an attribute
        self._handles.append(root.register_state_dict_post_hook(functools.partial(RootHooks.after_state_dict,
                                                                                  root_hooks)))
        # The root's context encloses everything above: entered before any pre-hook, left after every hook.
        self._handles.append(root.register_forward_pre_hook(eager(root_hooks.enter), prepend=True,
                                                            with_kwargs=True))
        self._handles.append(root.register_forward_hook(eager(root_hooks.exit), always_call=True))
        # copy.deepcopy(model) or of a sub-module: a plain copy, current weights, no engine hooks (model_copy.py)
        self._copies = ModelCopies(root, records, sync.synchronize, self._handles)

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
    for leaf in flatten(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif depth == 0 and hasattr(leaf, "__dict__") and not isinstance(leaf, (nn.Module, type)):
            found.extend(_tensors_in(vars(leaf), depth + 1))
    return found
