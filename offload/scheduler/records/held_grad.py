"""What `param.grad` holds once the engine has taken a gradient off the device: a `HeldGrad`.

Torch code around a model reads `.grad` (torch.nn.utils.clip_grad_norm_, GradScaler, gradient logging) and
clears it (`model.zero_grad()`, HF Trainer's way, `p.grad = None`). The engine keeps gradients in its own
homes (grad_home.py), so with `.grad` left None every reader would silently see "no gradient"
(clip_grad_norm_ returned 0.0 and clipped nothing) and a clear through the model would not reach the engine.
A HeldGrad is a tensor with the parameter's shape, dtype and device and no storage:

- what torch.nn.utils.clip_grad_norm_ and clip_grad_value_ do to it runs on the gradient the engine holds
  (a norm, a scale, a clamp: `HeldGradSource.apply`), exactly as on the `.grad` torch would hold, so the most
  common line of a training loop keeps working; any other read raises OffloadError naming the parameter and
  the engine's way to do it;
- clearing it is seen: `param.grad is None` at the next gradient or at `step()` means "zeroed", exactly the
  state torch would be in, so `model.zero_grad()` works as `engine.zero_grad()`;
- autograd accumulating into it (a backward without zero_grad in between, as torch allows) lands in
  `pending`, which the engine adds into its accumulator: torch's accumulation, kept.

See docs/design.md [Note: where a gradient is after backward].
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
from torch import Tensor, nn

from offload.errors import OffloadError
from offload.scheduler.torch_internals import DISABLED_TORCH_FUNCTION, flatten

_aten = torch.ops.aten
_ACCUMULATE = (_aten.add_.Tensor, _aten.add.Tensor)  # what autograd's AccumulateGrad does with a grad present
# what clip_grad_norm_ / clip_grad_value_ do to each gradient: a norm, then a scale; a clamp
_CLIP_OPS = frozenset({_aten.linalg_vector_norm.default, _aten.mul_.Tensor, _aten.mul_.Scalar,
                       _aten.clamp_.default, _aten.clamp_.Tensor, _aten.clamp_min_.default, _aten.clamp_max_.default})
_FOREACH_CLIP_OPS = frozenset({_aten._foreach_norm.Scalar, _aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar,
                               _aten._foreach_clamp_min_.Scalar, _aten._foreach_clamp_max_.Scalar})


class HeldGradSource(Protocol):
    """Where a held gradient is (grad_home.py's `GradHome`): `apply` runs a torch op on it."""

    def apply(self, index: int, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        """`func(gradient of slot `index`, *args, **kwargs)`: an in-place op changes the held gradient."""


class HeldGrad(Tensor):
    """Stands in `param.grad` for a gradient the engine holds; see the module docstring."""

    param_name: str
    pending: Optional[Tensor]
    source: Optional[HeldGradSource]  # where the gradient is (None: nowhere to read it from)
    slot_index: int  # the parameter's slot there

    @staticmethod
    def __new__(cls, param: nn.Parameter, param_name: str, source: Optional[HeldGradSource] = None,
                slot_index: int = 0) -> "HeldGrad":
        held = Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                             requires_grad=False)
        held.param_name = param_name
        held.pending = None
        held.source = source
        held.slot_index = slot_index
        return held

    __torch_function__ = DISABLED_TORCH_FUNCTION  # type: ignore[assignment]  # torch's own, for wrapper subclasses

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _ACCUMULATE and type(args[0]) is cls and isinstance(args[1], Tensor) \
                and not isinstance(args[1], HeldGrad) and kwargs.get("alpha", 1) == 1:
            held = args[0]
            held.accumulate_pending(args[1])
            return held
        if func in _CLIP_OPS and type(args[0]) is cls and args[0].source is not None \
                and not any(isinstance(a, HeldGrad) for a in flatten((args[1:], kwargs))):
            return args[0].source.apply(args[0].slot_index, func, args[1:], kwargs)
        if func in _FOREACH_CLIP_OPS and all(type(t) is cls and t.source is not None for t in args[0]):
            return _foreach(func, args, kwargs)
        leaves = flatten((args, kwargs))
        name = next(t.param_name for t in leaves if isinstance(t, HeldGrad))
        raise OffloadError(_read_error(name, str(func)))

    def accumulate_pending(self, grad: Tensor) -> None:
        """Autograd accumulated `grad` into this gradient (no zero_grad since the engine took it)."""
        grad = grad.detach()
        self.pending = grad.clone() if self.pending is None else self.pending.add_(grad)

    def pop_pending(self) -> Optional[Tensor]:
        pending, self.pending = self.pending, None
        return pending

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]  # stub names no param
        return f"HeldGrad({self.param_name!r}: the gradient is held by the offload engine)"

    def __deepcopy__(self, memo: dict) -> "HeldGrad":
        raise OffloadError(_read_error(self.param_name, "deepcopy"))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise OffloadError(_read_error(self.param_name, "pickle"))


def _foreach(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    """A foreach op over held gradients, one gradient at a time (`clip_grad_norm_(foreach=True)`)."""
    single = {_aten._foreach_norm.Scalar: _aten.linalg_vector_norm.default,
              _aten._foreach_mul_.Tensor: _aten.mul_.Tensor, _aten._foreach_mul_.Scalar: _aten.mul_.Scalar,
              _aten._foreach_clamp_min_.Scalar: _aten.clamp_min_.default,
              _aten._foreach_clamp_max_.Scalar: _aten.clamp_max_.default}[func]
    results = [held.source.apply(held.slot_index, single, args[1:], kwargs) for held in args[0]]
    return results if func is _aten._foreach_norm.Scalar else None


def _read_error(name: str, what: str) -> str:
    if "amp" in what and "unscale" in what:
        return (f"torch.amp.GradScaler cannot unscale the gradient of {name!r}: the offload engine holds the "
                "gradients off the device. Train with dtype=torch.bfloat16 (no loss scaling needed) or float32")
    if "zero" in what:
        return (f"the gradient of {name!r} is held by the offload engine: clear it with engine.zero_grad() or "
                "model.zero_grad() (set_to_none=True); engine.zero_grad(set_to_none=False) keeps zeros")
    return (f"the gradient of {name!r} is held by the offload engine, off the device ({what} read it): "
            "torch.nn.utils.clip_grad_norm_ / clip_grad_value_ work on it, as do engine.clip_grad_norm_(max_norm) "
            "and max_grad_norm= in offload.wrap; torch.amp.GradScaler is not supported (train in bfloat16); the "
            "gradient is not otherwise readable from the model")


def is_held(grad: Optional[Tensor]) -> bool:
    return type(grad) is HeldGrad


__all__ = ["HeldGrad", "is_held"]
