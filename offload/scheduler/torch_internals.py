"""Every private piece of torch the scheduler relies on, in one place.

Checked against torch 2.1 through 2.13 (the range pyproject.toml admits; CI runs 2.13.0). When torch
changes one of these, this file is the one to mend, and its tests (tests/unit/test_torch_internals.py)
say which. FSDP2 gathers its own the same way (`torch.distributed.fsdp._fully_shard._fsdp_common`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

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


def versions_of(tensors: Sequence[Tensor]) -> List[int]:
    """`version_of` of each tensor (one call for a group's parameters)."""
    return [tensor._version for tensor in tensors]


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


def group_timeout(group: Any) -> Optional[timedelta]:
    """The timeout a process group was made with (`init_process_group(timeout=)` for the default one): its
    backend's options (`ProcessGroupGloo` / `ProcessGroupNCCL`, `options._timeout`, torch>=2.0); None where torch
    does not show it."""
    try:
        for device in group._device_types:
            timeout = group._get_backend(device).options._timeout
            if isinstance(timeout, timedelta):
                return timeout
    except (AttributeError, RuntimeError, TypeError):
        pass
    return None


def default_group_timeout() -> Optional[timedelta]:
    """The default process group's timeout, for the engine's own groups: `new_group` gives a group the backend's
    default (gloo: 30 minutes), not the user's `init_process_group(timeout=)`."""
    from torch.distributed import distributed_c10d

    try:
        return group_timeout(distributed_c10d._get_default_group())
    except (AttributeError, RuntimeError, ValueError):
        return None


# --- the saved-tensor hooks' own version check (activations/meter.py: torch checks versions only without hooks) ---


def version_probe(tensor: Tensor) -> Optional[Tensor]:
    """An empty tensor that shares `tensor`'s version counter and none of its memory: a detached alias (it shares
    the counter) pointed at an empty storage by `set_()`, whose bump of the shared counter is undone at once
    (`torch.autograd._unsafe_preserve_version_counter`, torch>=2.1). None where that cannot be done."""
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    if preserve is None:
        return None
    try:
        probe = tensor.detach()
        with preserve(probe):
            probe.set_()  # type: ignore[call-overload]  # no arguments: an empty storage (torch's stubs omit it)
    except (RuntimeError, TypeError, NotImplementedError):  # a subclass or a kind of tensor set_() refuses
        return None
    return probe


def node_name(tensor: Tensor) -> Optional[str]:
    """The name of the autograd node that made `tensor` (`ExpBackward0`), None for a leaf."""
    grad_fn = tensor.grad_fn
    return None if grad_fn is None else grad_fn.name()


# torch.func transforms (vmap, grad, jacrev, ...) refuse to start while saved-tensor hooks are on; their error says
FUNC_TRANSFORMS_REFUSE_HOOKS = "don't yet support saved tensor hooks"
