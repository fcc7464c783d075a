"""The flat-buffer Adam step the engine calls once per block, and the squared-norm used for clipping.

Dispatches to the fused native kernel when `offload._C` is available, else runs the same maths in torch.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from offload import _native
from offload._system import usable_cores
from offload.checksum import crc32c
from offload.errors import OffloadConfigError

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The dtype codes the native kernels take (csrc/adam/adam_kernels.h: DType).
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check(name: str, t: Tensor, dtypes: tuple, numel: Optional[int]) -> None:
    """A CPU Adam step's operand: on the CPU, then as `check_tensor`."""
    if isinstance(t, Tensor) and t.device.type != "cpu":
        raise OffloadConfigError(f"{name} is on {t.device}; the CPU Adam step needs CPU tensors: pass {name}.cpu()")
    check_tensor(name, t, dtypes, numel)


def check_tensor(name: str, t: object, dtypes: tuple, numel: Optional[int],
                 device: Optional[torch.device] = None) -> None:
    """A step's operand: a contiguous tensor of one of `dtypes`, of `numel` elements and on `device` when given;
    else a clear error naming it and the fix."""
    if not isinstance(t, Tensor):
        raise OffloadConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise OffloadConfigError(f"{name} has dtype {t.dtype}; expected one of {names}")
    if not t.is_contiguous():
        raise OffloadConfigError(f"{name} is not contiguous: pass {name}.contiguous()")
    if numel is not None and t.numel() != numel:
        raise OffloadConfigError(f"{name} has {t.numel()} elements but param has {numel}")
    if device is not None and t.device != device:
        raise OffloadConfigError(f"{name} is on {t.device} but param is on {device}: keep them on one device")


def adam_step_flat(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    out: Optional[Tensor] = None,
    num_threads: Optional[int] = None,
    crcs: Optional[Tensor] = None,
) -> None:
    """One Adam/AdamW update of fp32 `param`, `exp_avg`, `exp_avg_sq` in place, in one pass.

    `grad` may be fp32, bf16 or fp16 (upcast in registers, multiplied by `grad_scale`, which is how gradient
    clipping costs no extra pass). When `out` is given, the new weights are also written there in its dtype:
    the buffer the next upload to the device reads. `step` is the 1-based count after this update. `crcs`
    (torch.uint32, len(CRC_PIECES) elements) receives the CRC-32C of each piece written ([Note: step CRCs]).
    """
    _check("param", param, (torch.float32,), None)
    n = param.numel()
    _check("grad", grad, GRAD_DTYPES, n)
    _check("exp_avg", exp_avg, (torch.float32,), n)
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if out is not None:
        _check("out", out, OUT_DTYPES, n)
    if crcs is not None:
        check_crcs(crcs, param.device)
    if step < 1:
        raise OffloadConfigError(f"step must be >= 1 (the count after this update), got {step}")
    _adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale, out=out,
               num_threads=_threads_for(n, num_threads), pool=None, crcs=crcs)


# The pieces a step writes, in the order of its `crcs` ([Note: step CRCs], offload/optim/moments.py): what the swap
# file seals one by one. fp32 moments have no scales (their CRCs are 0, of no bytes).
CRC_PIECES = ("param", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales", "out")


def check_crcs(crcs: object, device: torch.device) -> None:
    """`crcs` of a step: host memory, torch.uint32, one element per CRC_PIECES."""
    if device.type != "cpu":
        raise OffloadConfigError(f"crcs: the step's CRCs checksum host memory, but param is on {device}; step on the "
                                 "CPU or drop crcs")
    check_tensor("crcs", crcs, (torch.uint32,), None, device)
    assert isinstance(crcs, Tensor)
    if crcs.numel() != len(CRC_PIECES):
        raise OffloadConfigError(f"crcs has {crcs.numel()} elements; it needs {len(CRC_PIECES)}, one per piece "
                                 f"({', '.join(CRC_PIECES)}): torch.zeros({len(CRC_PIECES)}, dtype=torch.uint32)")


def crcs_read_back(crcs: Tensor, pieces: Sequence[Optional[Tensor]]) -> None:
    """`crcs` := the CRC-32C of each of the pieces (CRC_PIECES order, None: absent, 0), read back after a step
    that did not compute them (the torch fallbacks)."""
    crcs.copy_(torch.tensor([0 if t is None else crc32c(t) for t in pieces], dtype=torch.int64).to(torch.uint32))


def _threads_for(numel: int, num_threads: Optional[int]) -> int:
    """Small buffers run on the calling thread anyway: skip asking the OS for the core count (~10 us)."""
    native = _native._C
    if num_threads is None and native is not None and numel < native.PARALLEL_THRESHOLD:
        return 1
    return _resolve_threads(num_threads)


def _resolve_threads(num_threads: Optional[int]) -> int:
    if num_threads is None:
        return usable_cores()
    if int(num_threads) < 1:
        raise OffloadConfigError(f"num_threads must be >= 1 or None (all usable cores), got {num_threads}")
    return int(num_threads)


def _adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, adamw: bool, grad_scale: float, out: Optional[Tensor],
               num_threads: int, pool: Any, crcs: Optional[Tensor] = None) -> None:
    """The validated step: native when `offload._C` is importable, else torch. `pool` is a `_C.ThreadPool`
    owned by the caller (CPUAdam keeps one), or None to use `num_threads` for this call only."""
    native = _native._C  # looked up per call, so a test can force the fallback
    if native is None:
        adam_step_torch(param, grad, exp_avg, exp_avg_sq, step, float(lr), beta1, beta2, eps, weight_decay, adamw,
                        grad_scale, out)
        if crcs is not None:
            crcs_read_back(crcs, (param, exp_avg, None, exp_avg_sq, None, out))
        return
    native.adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        param.numel(), 0 if out is None else out.data_ptr(), 0 if out is None else _DTYPE_CODES[out.dtype],
        int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
        float(grad_scale), num_threads, pool, "", 0 if crcs is None else crcs.data_ptr(),
    )


def adam_step_torch(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, grad_scale: float,
                    out: Optional[Tensor]) -> None:
    """torch's single-tensor AdamW/Adam in torch operations, same order: the fallback of the native kernel, and
    the gpu tier's step (state on the device)."""
    p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g = grad.view(-1).float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        if adamw:
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias_correction1)
    if out is not None:
        out.view(-1).copy_(p)


def sum_of_squares(t: Tensor, num_threads: Optional[int] = None) -> float:
    """Sum of squares of a fp32/bf16/fp16 CPU tensor, accumulated in fp64; inf/nan propagate."""
    _check("t", t, GRAD_DTYPES, None)
    native = _native._C
    if native is None:
        return float(t.view(-1).double().square().sum())
    return native.sum_of_squares(t.data_ptr(), _DTYPE_CODES[t.dtype], t.numel(), _threads_for(t.numel(), num_threads))


# Shorter gradients go to torch (cheap there; and torch takes a 1-element norm as |x|, not as sqrt(x*x)).
IN_PLACE_NORM_MIN = 4096


@functools.lru_cache(maxsize=None)
def torch_norm_order() -> Optional[Tuple[int, bool]]:
    """How this process's torch reduces a contiguous fp32 vector in `torch.linalg.vector_norm`, as (lanes, whether
    each square is fused into its add), when one of the orders csrc/adam/torch_order_norm.h can follow gives
    torch's bits on every probe below; else None (no native core, or a torch that reduces otherwise: then the
    norm converts to fp32 and asks torch). Probed once per process: bf16 and fp16 vectors of short, ragged and
    long lengths (from `IN_PLACE_NORM_MIN` on, the ones it serves), at scales where the squares are exact and
    where bf16's underflow fp32 (there the fused and unfused adds differ)."""
    native = _native._C
    if native is None:
        return None
    gen = torch.Generator().manual_seed(0)
    probes = []
    for dtype, tiny in ((torch.bfloat16, 2.0**-68), (torch.float16, 1e-4)):
        for n in (IN_PLACE_NORM_MIN, IN_PLACE_NORM_MIN + 7, IN_PLACE_NORM_MIN + 9, 65_541, (1 << 21) + 5):
            for scale in (1.0, 1e-3, tiny):
                probes.append((torch.randn(n, generator=gen) * scale).to(dtype))
    for lanes, fused in ((8, False), (8, True), (16, False), (16, True)):
        if all(native.torch_order_norm(x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), lanes, fused)
               == float(torch.linalg.vector_norm(x.float(), 2)) for x in probes):
            return lanes, fused
    return None


class TorchNorm:
    """The L2 norm of a gradient with the bits `torch.linalg.vector_norm(x, dtype=torch.float32)` gives, the
    reduction clipping must reproduce (docs/design.md [Note: clipping parity]).

    A bf16/fp16 gradient in host memory is reduced in place by the native core in torch's order
    (`torch_norm_order`): 2 B read per element in one thread, against torch's conversion (a fresh fp32 tensor, 6 B
    moved per element) and its norm. Elsewhere (an order the core does not follow, a gradient on the device) the
    gradient is converted into a kept fp32 buffer and torch takes the norm of that: the same bits, without the
    fresh pages torch's own conversion faults in (5x the time of converting into a kept buffer, measured on an
    82M-element bf16 gradient). One buffer, the size of the largest gradient converted, kept until `release` (the
    engine's close); a second thread meanwhile converts as torch does."""

    def __init__(self) -> None:
        self._buffer: Optional[Tensor] = None
        self._lock = threading.Lock()

    def norm(self, piece: Tensor) -> float:
        if piece.dtype == torch.float32:
            return float(torch.linalg.vector_norm(piece, 2))
        on_cpu = piece.device.type == "cpu"
        if on_cpu and piece.numel() < IN_PLACE_NORM_MIN:
            return float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32))
        order = torch_norm_order()
        if order is not None and on_cpu and piece.is_contiguous():
            native = _native._C
            assert native is not None
            return native.torch_order_norm(piece.data_ptr(), _DTYPE_CODES[piece.dtype], piece.numel(), *order)
        if not self._lock.acquire(blocking=False):
            return float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32))
        try:
            n = piece.numel()
            if self._buffer is None or self._buffer.numel() < n:
                self._buffer = None
                self._buffer = torch.empty(n, dtype=torch.float32)
            scratch = self._buffer[:n]
            scratch.copy_(piece.reshape(-1))
            return float(torch.linalg.vector_norm(scratch, 2))
        finally:
            self._lock.release()

    def norms(self, pieces: List[Tensor], num_threads: Optional[int] = None) -> List[float]:
        """`norm` of each piece, the same bits; the pieces the native core reduces in place are spread over
        `num_threads` (each one whole on one thread: a block's norms take the time of its largest parameters)."""
        batch = [i for i, piece in enumerate(pieces) if piece.device.type == "cpu" and piece.is_contiguous()
                 and piece.dtype in (torch.bfloat16, torch.float16) and piece.numel() >= IN_PLACE_NORM_MIN]
        native = _native._C
        order = torch_norm_order() if batch else None  # probed only where it serves, as `norm` does: it allocates
        if order is None or native is None:
            return [self.norm(piece) for piece in pieces]
        result: List[Optional[float]] = [None] * len(pieces)
        for dtype in (torch.bfloat16, torch.float16):
            same = [i for i in batch if pieces[i].dtype == dtype]
            if same:
                numels = [pieces[i].numel() for i in same]
                values = native.torch_order_norms([pieces[i].data_ptr() for i in same], numels, _DTYPE_CODES[dtype],
                                                  *order, _threads_for(sum(numels), num_threads))
                for i, value in zip(same, values):
                    result[i] = value
        return [self.norm(piece) if value is None else value for piece, value in zip(pieces, result)]

    def release(self) -> None:
        """Free the buffer (the engine closes); a later norm makes a new one."""
        with self._lock:
            self._buffer = None


def adam_step_resting(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, out: Optional[Tensor],
                      num_threads: Optional[int], capacity: int, index_base: int = 0,
                      crcs: Optional[Tensor] = None) -> Optional[Tuple[Tensor, Tensor]]:
    """`adam_step_flat` (AdamW, grad_scale 1) of a bf16 or fp16 gradient that may then rest in the first moment:
    the step also finds the elements `rebuild_gradient` would not give back exactly (grad_rebuild.h), in the same
    pass. Returns them, (indices + `index_base` as int64, ascending; the gradient's bits as int16), or None when
    there are more than `capacity` (the gradient must then be kept). The step is done either way. Needs the native
    core (`resting_supported`). The native call sorts them and adds the base, into numpy scratch: the engine's
    worker runs this once a chunk, and keeps its Python work there to one copy of each list. `crcs`: as for
    `adam_step_flat`."""
    native = _native._C
    assert native is not None and grad.dtype in REBUILT_DTYPES
    n = param.numel()
    for name, t, dtypes in (("param", param, (torch.float32,)), ("grad", grad, REBUILT_DTYPES),
                            ("exp_avg", exp_avg, (torch.float32,)), ("exp_avg_sq", exp_avg_sq, (torch.float32,))):
        _check(name, t, dtypes, n)
    if out is not None:
        _check("out", out, OUT_DTYPES, n)
    if crcs is not None:
        check_crcs(crcs, param.device)
    index = np.empty(capacity, dtype=np.int64)
    bits = np.empty(capacity, dtype=np.int16)
    count = native.adam_step_resting(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
        0 if out is None else out.data_ptr(), 0 if out is None else _DTYPE_CODES[out.dtype], int(step), float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), index.ctypes.data, bits.ctypes.data, capacity,
        _threads_for(n, num_threads), None, "", int(index_base), 0 if crcs is None else crcs.data_ptr())
    if count > capacity:
        return None
    return torch.from_numpy(index[:count].copy()), torch.from_numpy(bits[:count].copy())


def rebuild_gradient(m_old: Tensor, m_new: Tensor, beta1: float, out: Tensor, num_threads: Optional[int]) -> None:
    """`out` (bf16 or fp16) := the gradient an AdamW step with `beta1` took m_old to m_new with, as the resting step
    checks it (the misses it kept are the caller's to patch in)."""
    native = _native._C
    assert native is not None
    n = out.numel()
    _check("m_old", m_old, (torch.float32,), n)
    _check("m_new", m_new, (torch.float32,), n)
    _check("out", out, REBUILT_DTYPES, n)
    native.rebuild_gradient(m_old.data_ptr(), m_new.data_ptr(), float(beta1), out.data_ptr(), _DTYPE_CODES[out.dtype],
                            n, _threads_for(n, num_threads), None)


REBUILT_DTYPES = (torch.bfloat16, torch.float16)  # what a first moment gives back: 8 or 11 significant bits


def resting_supported(grad_dtype: torch.dtype) -> bool:
    """Whether a gradient of this dtype can rest in the first moment: 16-bit, and the native core is built."""
    return grad_dtype in REBUILT_DTYPES and _native._C is not None
