"""Streamed parameters read and written outside the modules that own them, exactly as plain PyTorch.

A streamed block's parameters point into its device buffer only while it is resident, and at a NaN
placeholder while it is released (streamer.py); a resident block may be released at any later fetch.
Code outside the owning modules' forward (an EMA after `step()`, a callback summing `|w|`, `nn.init` after
`wrap()`, `torch.save(param)`, a tied head written by hand) would read the placeholder, or hold a view of
a buffer about to be freed, and a write would be lost at the next release.

So outside its module's forward a streamed parameter's class is a subclass of its own class
(`isinstance(p, nn.Parameter)` holds) whose `__torch_function__` first opens its block for the caller
(`BlockAccess.open_for_read`: the block's pending update lands, so a read right after `step()` sees the
new weights; the block is made resident and pinned), runs the operation on the real weights, pins the
block while any returned view of its buffer lives (as autograd's unpacked weights do), and closes it
(`close_after_read`: a write, seen by the parameter's version counter, goes to the master weights and the
weight home before anything can release the block). Metadata (shape, dtype, device, `.grad`,
`requires_grad`, the version counter, hooks) is answered without opening anything, so autograd and the
engine's own bookkeeping never fetch. Inside the owning module's forward the parameters are plain again:
the hot path pays nothing. See docs/design.md [Note: reading streamed weights outside their module].
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn

from offload.scheduler.blocks.block import Block
from offload.scheduler.torch_internals import leaves, torch_function_subclasses_disabled

# Tensor properties and methods that describe a parameter without reading its values: answered at once.
_METADATA_PROPERTIES = frozenset({
    "grad", "_grad", "requires_grad", "shape", "dtype", "device", "is_leaf", "grad_fn", "_grad_fn", "_version",
    "layout", "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
    "is_xpu", "is_mps", "is_mtia", "is_ipu", "is_xla", "is_hpu", "is_maia", "is_vulkan", "names", "name",
    "_base", "output_nr", "itemsize", "nbytes", "_backward_hooks", "_post_accumulate_grad_hooks",
    "retains_grad", "_cdata", "is_sparse_csr", "_is_param",
})
_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "data_ptr", "untyped_storage", "_typed_storage",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "get_device", "__hash__",
    "__len__", "retain_grad", "_is_view", "is_shared", "is_pinned", "is_inference", "_use_count",
})


def is_metadata(func: Callable) -> bool:
    """Whether `func` (what `__torch_function__` receives) only describes the tensor: a property's getter of
    the metadata kinds, any property's setter (`.grad =`, `.data =` by the engine), a metadata method."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return True
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_PROPERTIES
    return name in _METADATA_METHODS


class BlockAccess(Protocol):
    """What opening a block for a read outside its forward takes (the step pipeline provides it)."""

    def block_of(self, param: torch.Tensor) -> Optional[Block]: ...

    def open_for_read(self, block: Block) -> None: ...

    def pin_views(self, tensors: List[torch.Tensor]) -> None: ...

    def close_after_read(self, block: Block) -> None: ...


class _ReadThroughParameter:
    """Mixed into a parameter's own class while its block is outside its forward (see the module
    docstring). The class the engine makes holds its `ReadThrough` weakly (`_access`) and the parameter's
    own class (`_own`)."""

    _access: Callable[[], Optional["ReadThrough"]]
    _own: Any  # the parameter's own class
    data: torch.Tensor  # (a parameter's: declared for the type checker)
    requires_grad: bool

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        owner = cls._access()
        if owner is None or is_metadata(func):
            with torch_function_subclasses_disabled():
                return func(*args, **kwargs)
        return owner.call(func, args, kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        """As `Parameter.__deepcopy__`, but the copy is of the parameter's own class (that method builds
        `type(self)(...)`), from the real weights (reading `.data` opens the block)."""
        if id(self) in memo:
            return memo[id(self)]
        result = type(self)._own(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result

    def __repr__(self) -> str:
        """The parameter's own repr, of the real weights."""
        owner = type(self)._access()
        own = type(self)._own
        if owner is None:
            return own.__repr__(self)
        return owner.call(owner.as_own, (self, own.__repr__), {})


class ReadThrough:
    """Swaps streamed parameters between their own class and a read-through subclass of it, and runs
    operations on read-through parameters with their blocks open."""

    def __init__(self) -> None:
        self._classes: Dict[type, type] = {}  # a parameter's own class -> its read-through subclass
        self._access: Optional[BlockAccess] = None

    def serve(self, access: Optional[BlockAccess]) -> None:
        """Reads through `access` from now on (None: the engine is closing; parameters read as they are)."""
        self._access = access

    def mark(self, param: nn.Parameter) -> None:
        """Outside its forward: reads of `param` open its block first."""
        own = type(param)
        if issubclass(own, _ReadThroughParameter):
            return
        cls = self._classes.get(own)
        if cls is None:
            ref = weakref.ref(self)
            cls = type(f"ReadThrough{own.__name__}", (_ReadThroughParameter, own),
                       {"_access": staticmethod(ref), "_own": own})
            self._classes[own] = cls
        param.__class__ = cls

    @staticmethod
    def unmark(param: nn.Parameter) -> None:
        """Inside its forward, or the engine closed: `param` is its own class again."""
        cls = type(param)
        if issubclass(cls, _ReadThroughParameter):
            param.__class__ = cls._own

    def as_own(self, param: nn.Parameter, func: Callable[[nn.Parameter], Any]) -> Any:
        """`func(param)` with `param` of its own class for the call (its block is open)."""
        self.unmark(param)
        try:
            return func(param)
        finally:
            self.mark(param)

    def call(self, func: Callable, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """`func(*args, **kwargs)` with the blocks of every read-through parameter among them open."""
        access = self._access
        params = [t for t in leaves((list(args), kwargs)) if isinstance(t, torch.Tensor) and reads_through(t)]
        blocks: List[Block] = []
        if access is not None:
            for param in params:
                block = access.block_of(param)
                if block is not None and block not in blocks:
                    blocks.append(block)
        if not blocks:
            with torch_function_subclasses_disabled():
                return func(*args, **kwargs)
        assert access is not None
        opened: List[Block] = []
        try:
            for block in blocks:
                access.open_for_read(block)
                opened.append(block)
            with torch_function_subclasses_disabled():
                result = func(*args, **kwargs)
            access.pin_views([t for t in leaves(result) if isinstance(t, torch.Tensor)])
        finally:
            for block in opened:
                access.close_after_read(block)
        return result


def reads_through(param: torch.Tensor) -> bool:
    """Whether `param` currently reads through (its block outside its forward)."""
    return isinstance(param, _ReadThroughParameter)
