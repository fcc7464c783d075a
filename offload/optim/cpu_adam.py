"""`CPUAdam`: a `torch.optim.Optimizer` whose step is the fused native kernel, for CPU fp32 parameters.

Why a real Optimizer subclass: param groups, LR schedulers, `state_dict()`/`load_state_dict()` and
`torch.load(weights_only=True)` then work as users expect. The state has torch's names and types (`step` as a
0-dim fp32 tensor, `exp_avg`, `exp_avg_sq`), so a checkpoint moves between CPUAdam and `torch.optim.AdamW`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple, Union, overload

import torch
from torch import Tensor

from offload import _native
from offload.errors import OffloadConfigError
from offload.optim.functional import GRAD_DTYPES, _adam_step, _resolve_threads

ParamsT = Union[Iterable[Tensor], Iterable[dict]]


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over CPU fp32 parameters, fused in one pass over memory and multithreaded.

    Args:
        params: tensors or param-group dicts, like any torch optimizer. Each must be a CPU fp32 contiguous tensor.
        lr, betas, eps, weight_decay: as in `torch.optim.AdamW`.
        adamw: True for decoupled weight decay (AdamW), False for L2 added to the gradient (Adam). Per group.
        num_threads: worker threads for large tensors (None: the cores this process may use). The threads are
            started on the first step and kept for the life of the optimizer.

    Gradients may be fp32, bf16 or fp16 (upcast in registers); parameters whose `.grad` is None are skipped.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        *,
        num_threads: Optional[int] = None,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw)
        super().__init__(params, defaults)
        self._num_threads = _resolve_threads(num_threads)
        self._pool: Any = None  # a _C.ThreadPool, made on the first step that needs it
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                _check_param(index, p)
                index += 1

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_pool", None)  # threads are not picklable; a copy makes its own
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_num_threads", _resolve_threads(None))
        self._pool = None

    def _thread_pool(self) -> Any:
        native = _native._C
        if native is None or self._num_threads <= 1:
            return None
        if self._pool is None:
            self._pool = native.ThreadPool(self._num_threads)
        return self._pool

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One Adam/AdamW update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pool = self._thread_pool()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    grad = _checked_grad(index, p, grad)
                    state = self._state_for(p)
                    state["step"] += 1
                    _adam_step(
                        p, grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"].item()),
                        lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], adamw=group["adamw"], grad_scale=1.0, out=None,
                        num_threads=self._num_threads, pool=pool,
                    )
                index += 1
        return loss

    def _state_for(self, p: Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:  # a loaded state_dict: torch casts it to the param, but make sure the kernel can read it
            for key in ("exp_avg", "exp_avg_sq"):
                t = state[key]
                if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                    state[key] = t.to(device="cpu", dtype=torch.float32).contiguous()
            if not isinstance(state["step"], Tensor):
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        return state


def _check_hyperparameters(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise OffloadConfigError("lr as a Tensor must hold one value")
        lr = float(lr)
    if not 0.0 <= lr:
        raise OffloadConfigError(f"lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise OffloadConfigError(f"eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise OffloadConfigError(f"betas must be two values in [0, 1), got {betas}")
    if not 0.0 <= weight_decay:
        raise OffloadConfigError(f"weight_decay must be >= 0, got {weight_decay}")


def _check_param(index: int, p: Tensor) -> None:
    if p.device.type != "cpu":
        raise OffloadConfigError(
            f"CPUAdam param {index} is on {p.device}; CPUAdam updates CPU fp32 master weights: "
            "keep an fp32 copy on the CPU (or let offload.wrap() manage it) and pass that")
    if p.dtype != torch.float32:
        raise OffloadConfigError(
            f"CPUAdam param {index} has dtype {p.dtype}; CPUAdam needs fp32 master weights: pass p.float() "
            "copies (and copy the result back), or use offload.wrap() which keeps them for you")
    if not p.is_contiguous():
        raise OffloadConfigError(f"CPUAdam param {index} is not contiguous: make it contiguous before building the optimizer")


def _checked_grad(index: int, p: Tensor, grad: Tensor) -> Tensor:
    if grad.is_sparse:
        raise OffloadConfigError(f"CPUAdam param {index} has a sparse gradient; CPUAdam supports dense gradients only")
    if grad.device.type != "cpu" or grad.dtype not in GRAD_DTYPES:
        raise OffloadConfigError(
            f"CPUAdam param {index} has a {grad.dtype} gradient on {grad.device}; "
            "gradients must be CPU fp32, bf16 or fp16")
    if grad.shape != p.shape:
        raise OffloadConfigError(f"CPUAdam param {index}: gradient shape {tuple(grad.shape)} != param shape {tuple(p.shape)}")
    return grad if grad.is_contiguous() else grad.contiguous()
