"""Every private piece of torch the scheduler relies on, in one place.

Checked against torch 2.1 through 2.13 (the range pyproject.toml admits; CI runs 2.13.0). When torch
changes one of these, this file is the one to mend, and its tests (tests/unit/test_torch_internals.py)
say which. FSDP2 gathers its own the same way (`torch.distributed.fsdp._fully_shard._fsdp_common`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves


def graph_task_id() -> int:
    """The autograd graph task running on this thread, -1 outside a backward (`torch._C`, since 1.x)."""
    return torch._C._current_graph_task_id()


def is_backward() -> bool:
    """Whether this thread runs inside an autograd backward (a hook, a checkpoint's recompute)."""
    return graph_task_id() != -1


def after_backward(callback: Callable[[], None]) -> None:
    """Run `callback` when the backward now running ends without an error (autograd's final callbacks: not
    run when the graph task raises). Only inside a backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def version_of(tensor: Tensor) -> int:
    """The tensor's version counter: every in-place write through it (or a view sharing it) bumps it;
    `.data` writes and `param.data = ...` do not."""
    return tensor._version


def view_base(tensor: Tensor) -> Tensor:
    """The tensor a view was made from, or the tensor itself."""
    return tensor._base if tensor._base is not None else tensor


def own_parameters(module: nn.Module) -> Dict[str, Optional[nn.Parameter]]:
    """The parameters a module registers itself (not its children's), by attribute name; writable."""
    return module._parameters


def own_buffers(module: nn.Module) -> Dict[str, Optional[Tensor]]:
    """The buffers a module registers itself, by attribute name; writable."""
    return module._buffers


def leaves(tree: Any) -> List[Any]:
    """The leaves of nested containers torch's pytree knows (tuples, lists, dicts, dataclasses, ...)."""
    return tree_leaves(tree)


def flatten(tree: Any) -> List[Any]:
    return tree_flatten(tree)[0]


def torch_function_subclasses_disabled() -> Any:
    """A context in which tensor subclasses' `__torch_function__` is not called (their plain behaviour)."""
    return torch._C.DisableTorchFunctionSubclass()


DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl  # `__torch_function__` of a subclass that has none


def eager(function: Any) -> Any:
    """For the engine's hooks, which wait on threads, move memory and read clocks: torch.compile runs them
    as they are (a graph break) rather than trying to trace into them (`torch.compiler.disable`, torch>=2.1)."""
    disable = getattr(torch.compiler, "disable", None)
    return function if disable is None else disable(function)
