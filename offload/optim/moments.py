"""Adam moments stored as fp32, bf16 or int8: the formats, their byte layout, and the step that updates them.

The master weights stay fp32 whatever the format; only `exp_avg` (m) and `exp_avg_sq` (v) shrink, from 8 bytes
per parameter (fp32) to 4 (bf16) or about 2.03 (int8: one code byte each plus one fp32 scale per
`INT8_BLOCK` elements). A moment is a flat fp32 tensor (FP32), a flat bfloat16 tensor (BF16) or a
`QuantizedMoment` (INT8). `adam_step_moments` decodes m and v, runs the maths of `adam_step_flat` in fp32,
computes the parameter update from the new fp32 m and v (before they are rounded again, as bitsandbytes' 8-bit
Adam does) and encodes the new m and v. On the CPU with `offload._C` that is one fused native pass
(csrc/adam/adam_moments.h); otherwise the same maths in torch operations, which also run on a CUDA device.

[Note: int8 moment codes]
Each block of `INT8_BLOCK` elements (counted from a parameter's first element when the moment is laid out by
parameters: `BlockLayout`) has one fp32 scale, the block's largest magnitude, and each element one code
byte indexing a non-linear map of [0, 1] ("dynamic" map of 8-bit Adam: bitsandbytes' `create_dynamic_map`,
torchao's): decade d of the map holds 2^(d+1) evenly spaced values (bucket centres), so precision is finest near
the block maximum and the range spans six or seven decades; 0 and 1 are exact. Two maps:

* m (signed): sign bit + 7-bit magnitude, from the unsigned 7-bit map (6 decades, 1e-5..1, 126 values, 0 and 1).
  Its values are bitsandbytes' signed 8-bit map without its smallest entry (5.5e-7) and with -1 added: the map is
  symmetric, so a block whose largest magnitude is negative decodes to exactly -scale and re-encodes to the
  same codes (bitsandbytes' signed map has no -1). A magnitude that rounds to 0 gets sign bit 0 (no -0.0).
* v: stored as sqrt(v) on the unsigned 8-bit map (7 decades, 1e-6..1, 254 values, 0 and 1), decoded as the
  square. Measured against plain v on the same map (the choice is below): sqrt halves v's dynamic range in log
  terms, so far fewer elements of a block fall off the bottom of the map, and the step needs sqrt(v) anyway.
  A positive value never rounds to code 0 (it takes the smallest non-zero code): a v that decodes to 0 while m
  does not would make the update lr*m/eps.

Encoding is round to nearest: the code of y = |x| * (1/scale) is the number of midpoints between consecutive
map values that are < y (ties go to the lower code); a block of zeros gets scale 0 and codes 0 (never 0/0).
Because 1 is in both maps, the largest element of a block decodes to exactly its scale, so decoding, encoding
and decoding again gives back the same values and codes: decoded (fp32) moments (a torch-format state, a
checkpoint of another setting) reload to the same state. (For v this holds while sqrt(v)^2 stays a normal fp32 number, v > 1.2e-38.) A NaN in a block makes
its scale NaN, so the whole block decodes to NaN (the new weights are NaN anyway: they come from fp32 m, v).

Infinities are kept as torch keeps them. A gradient whose square overflows fp32 (|g| above about 1.8e19) makes
v = inf in fp32 moments and in torch's AdamW: that element's update is m / (sqrt(inf) + eps) = 0 from then on
(beta2 * inf stays inf), and its neighbours train on. A block holding an infinity (and no NaN) stores its scale
negated (sign bit set, -0.0 when nothing else in it is non-zero): |scale| is the block's largest *finite*
magnitude, and the map's second-highest value (`inf_code`: magnitude code 126 for m, 254 for v) stands for
infinity (m: with its sign bit). A finite value that would round to that code takes the nearer of its two
neighbours instead (`_skip_midpoint` splits them); everything else is encoded as in any block. So the infinity
decodes to inf, the update is 0 as in fp32, the finite neighbours keep their values (the largest exactly), and
the round trip above holds in these blocks too. (Before, the scale became inf and the neighbours decoded to
0 * inf = NaN: NaN weights at the next step.) The native kernels and this file apply the same rule (csrc/adam/
moment_codes.h), and the NaN elements of a NaN block get code 0 in every path.

Measured choices (torch implementations of each variant, 200 AdamW steps, lr 1e-2, mean of 3 seeds; final loss
÷ fp32's, lower is better; "update error" = ||u_q - u|| / ||u|| for u = m / (sqrt(v) + eps) at an fp32 state after
100 steps, with m and v quantized):

                                 MLP 64-256-16   features over 6 decades   sparse features (embedding-like)
    sqrt(v), nearest (chosen)    0.96 / 0.017    0.77 / 0.16               1.05 / 0.026
    v, nearest                   0.98 / 0.016    1.04 / 0.83               1.03 / 0.032
    v, nearest, no floor at 0    0.97 / 0.016    16.3 / 4500 (v -> 0 in 48% of elements)  1.03 / 0.032
    sqrt(v), stochastic          0.99            1.00                      1.00
    v, stochastic                1.00            1.09                      0.98
    (bf16 moments: 1.07, 1.00, 1.09)

* sqrt(v) over plain v: five times less update error where a block's gradients span several decades, the same
  elsewhere. Without the floor at code 0, plain v diverges there.
* nearest over stochastic rounding: no consistent gain from stochastic rounding over 200 steps (each better on
  some problems, all within seed noise), and nearest is deterministic, which the checkpoint round trip needs.

BF16 moments round to nearest even, like `tensor.to(torch.bfloat16)`.

[Note: step CRCs]
`adam_step_moments(..., crcs=t)` also fills `t` (torch.uint32, CRC_PIECES order) with the CRC-32C
(`offload.checksum.crc32c`) of each piece the step wrote: the param (its fp32 bytes), exp_avg's codes (int8), values
(bf16) or fp32 values, exp_avg's scales (int8; 0 otherwise, the CRC of no bytes), the same two of exp_avg_sq, and out
(0 when there is none). `adam_step_flat` and `adam_step_resting` (offload/optim/functional.py, where CRC_PIECES
is) take the same `crcs` for fp32 moments. Those are the pieces the swap file seals one by one
(offload/tiers/disk.py: a chunk's master, each moment's codes and scales, its compute weights when they are on
disk), so a caller that steps a chunk and then writes it can seal it without reading it again: the nvme tier's
update does (scheduler/state/adamw.py hands them to DiskStore.store in `StateChunk.crcs` when one span covers the
chunk). bf16 and int8 on the CPU with `offload._C`: computed in the same pass by the native kernel (the AVX-512 int8
step feeds crc32 chains in its own loops; the other kernels step a few thousand elements at a time and checksum them
while they are in L1/L2; with several threads each chunk's CRCs are joined with crc32c_combine:
csrc/adam/step_crcs.h). fp32 with `_C` alike (its `out` then written plainly, not streamed, so that it is read back
from the cache). The torch fallback without `_C`: read back after the step (crc32c of each piece). A CUDA step
refuses `crcs`: checksums read host memory.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch
from torch import Tensor

from offload import _native
from offload.errors import OffloadConfigError
from offload.optim.functional import (
    _DTYPE_CODES,
    GRAD_DTYPES,
    OUT_DTYPES,
    _resolve_threads,
    adam_step_flat,
    adam_step_torch,
    check_crcs,
    check_tensor,
    crcs_read_back,
)
from offload.optim.moment_format import (
    _FORMAT_CODES,
    EXP_AVG,
    EXP_AVG_SQ,
    INT8_BLOCK,
    BlockLayout,
    Moment,
    MomentFormat,
    QuantizedMoment,
    scale_count,
    slice_moment,
)

# --- the int8 maps --------------------------------------------------------------------------------------


def _map_values(decades: int) -> list[float]:
    """The unsigned dynamic map with `decades` decades (bitsandbytes' create_dynamic_map(signed=False)): 0, then
    decade d = 0..decades-1 holding 2^(d+1) bucket centres of [0.1, 1] * 10^(d - decades + 1), then 1. Computed
    in double and rounded once to fp32, exactly as csrc/adam/adam_moments_dispatch.cpp does (tests compare)."""
    values = [0.0]
    for d in range(decades):
        k = 2 ** (d + 1)
        scale = 10.0 ** (d - decades + 1)
        values += [scale * (0.1 + 0.9 * (j + 0.5) / k) for j in range(k)]
    values.append(1.0)
    return [float(torch.tensor(x, dtype=torch.float32)) for x in values]


@lru_cache(maxsize=None)
def code_map(which: int) -> tuple[float, ...]:
    """The magnitudes a code indexes: 128 for exp_avg (which=1; sign in bit 7), 256 for exp_avg_sq (which=2,
    of sqrt(v))."""
    _check_which(which)
    return tuple(_map_values(6 if which == EXP_AVG else 7))


@lru_cache(maxsize=None)
def _midpoints(which: int) -> tuple[float, ...]:
    """fp32 midpoints between consecutive map values, computed exactly in double then rounded once."""
    t = code_map(which)
    return tuple(float(torch.tensor((a + b) / 2, dtype=torch.float32)) for a, b in zip(t[:-1], t[1:]))


def inf_code(which: int) -> int:
    """The magnitude code that stands for infinity in a block holding one: the map's second-highest value."""
    _check_which(which)
    return len(code_map(which)) - 2


@lru_cache(maxsize=None)
def _skip_midpoint(which: int) -> float:
    """In a block holding an infinity: the midpoint between the two neighbours of `inf_code` (double, rounded once),
    which splits the finite values that would round to it."""
    t = code_map(which)
    return float(torch.tensor((t[-3] + t[-1]) / 2, dtype=torch.float32))


_device_tables: dict = {}


def _tables(which: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(decode table over all 256 codes, midpoints) as fp32 tensors on `device`."""
    key = (which, str(device))
    if key not in _device_tables:
        mags = torch.tensor(code_map(which), dtype=torch.float32)
        if which == EXP_AVG:  # bit 7 is the sign
            mags = torch.cat([mags, -mags])
        _device_tables[key] = (mags.to(device), torch.tensor(_midpoints(which), dtype=torch.float32).to(device))
    return _device_tables[key]


def _check_which(which: int) -> None:
    if which not in (EXP_AVG, EXP_AVG_SQ):
        raise OffloadConfigError(f"which must be 1 (exp_avg) or 2 (exp_avg_sq), got {which!r}")


# --- torch implementations (the fallback, and the gpu tier's) ---------------------------------------------


def _holds_inf(scales: Tensor) -> Tensor:
    """Blocks whose scale says they hold an infinity: sign bit set (-0.0 too), not NaN."""
    return torch.signbit(scales) & ~torch.isnan(scales)


def _dequantize_torch(q: QuantizedMoment, which: int) -> Tensor:
    table, _ = _tables(which, q.codes.device)
    n = q.codes.numel()
    marked = _holds_inf(q.scales)
    codes = q.codes.long()
    x = table[codes] * torch.where(marked, -q.scales, q.scales).repeat_interleave(INT8_BLOCK)[:n]
    magnitude = codes & 127 if which == EXP_AVG else codes
    is_inf = marked.repeat_interleave(INT8_BLOCK)[:n] & (magnitude == inf_code(which))
    inf = torch.full_like(x, float("inf"))
    x = torch.where(is_inf, torch.where(codes >= 128, -inf, inf), x)
    return x * x if which == EXP_AVG_SQ else x


def _quantize_torch(x: Tensor, which: int, out: QuantizedMoment) -> None:
    """Codes and scales of fp32 `x` (v itself for exp_avg_sq: its sqrt is stored)."""
    table, mids = _tables(which, x.device)
    n = x.numel()
    mag = x.sqrt() if which == EXP_AVG_SQ else x.abs()
    nblocks = -(-n // INT8_BLOCK)
    padded = mag if n == nblocks * INT8_BLOCK else torch.cat([mag, mag.new_zeros(nblocks * INT8_BLOCK - n)])
    blocks = padded.view(nblocks, INT8_BLOCK)
    infinite = blocks == float("inf")
    absmax = torch.where(infinite, 0.0, blocks).amax(dim=1)  # the largest finite magnitude; NaN propagates
    marked = infinite.any(dim=1) & ~torch.isnan(absmax)  # holds an infinity (and no NaN)
    inv = torch.where(absmax > 0, 1.0 / torch.where(absmax > 0, absmax, torch.ones_like(absmax)),
                      torch.zeros_like(absmax))
    y = (blocks * inv[:, None]).view(-1)[:n]
    code = torch.bucketize(y, mids)  # number of midpoints < y: round to nearest, ties down
    code = torch.where(torch.isnan(y), 0, code)  # as the native kernels: a NaN y (a NaN block) gives 0
    in_marked = marked.repeat_interleave(INT8_BLOCK)[:n]
    skip = inf_code(which)
    code = torch.where(in_marked & (code == skip), torch.where(y > _skip_midpoint(which), skip + 1, skip - 1), code)
    if which == EXP_AVG_SQ:
        code = torch.where((y > 0) & (code == 0), torch.ones_like(code), code)  # no positive v decodes to 0
    code = torch.where(in_marked & (mag == float("inf")), skip, code)
    if which == EXP_AVG:
        code = torch.where((x < 0) & (code > 0), code + 128, code)
    out.codes.copy_(code)
    out.scales.copy_(torch.where(marked, -absmax, absmax))


def _decode_torch(m: Moment, fmt: MomentFormat, which: int) -> Tensor:
    if fmt is MomentFormat.INT8:
        assert isinstance(m, QuantizedMoment)
        return _dequantize_torch(m, which)
    assert isinstance(m, Tensor)
    return m.float()


def _encode_torch(src: Tensor, fmt: MomentFormat, which: int, out: Moment) -> None:
    if fmt is MomentFormat.INT8:
        assert isinstance(out, QuantizedMoment)
        _quantize_torch(src, which, out)
    else:
        assert isinstance(out, Tensor)
        out.copy_(src)  # bf16: round to nearest even


# Elements per piece of the torch step: bounds its fp32 temporaries; a multiple of INT8_BLOCK.
_TORCH_CHUNK = 1 << 22


def _adam_step_moments_torch(param: Tensor, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, fmt: MomentFormat, *,
                             step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                             adamw: bool, grad_scale: float, out: Optional[Tensor]) -> None:
    """Decode a piece, run adam_step_torch on fp32 copies, encode: the same maths as the native pass."""
    n = param.numel()
    for start in range(0, n, _TORCH_CHUNK):
        stop = min(n, start + _TORCH_CHUNK)
        m_piece, v_piece = slice_moment(exp_avg, fmt, start, stop), slice_moment(exp_avg_sq, fmt, start, stop)
        m32, v32 = _decode_torch(m_piece, fmt, EXP_AVG), _decode_torch(v_piece, fmt, EXP_AVG_SQ)
        adam_step_torch(param.view(-1)[start:stop], grad.view(-1)[start:stop], m32, v32, step, float(lr), beta1,
                        beta2, eps, weight_decay, adamw, grad_scale,
                        None if out is None else out.view(-1)[start:stop])
        _encode_torch(m32, fmt, EXP_AVG, m_piece)
        _encode_torch(v32, fmt, EXP_AVG_SQ, v_piece)


# --- validation -----------------------------------------------------------------------------------------


def _check_moment(name: str, m: object, fmt: MomentFormat, numel: Optional[int],
                  device: Optional[torch.device], blocks: Optional[BlockLayout] = None) -> int:
    """Checks that `m` is a moment of `fmt` (of `numel` elements when given; int8: laid out as `blocks`, default
    one run); returns its element count."""
    if fmt is MomentFormat.INT8:
        if not isinstance(m, QuantizedMoment):
            raise OffloadConfigError(f"{name} must be a QuantizedMoment (codes, scales) for int8 moments, "
                                     f"got {type(m).__name__}")
        check_tensor(f"{name}.codes", m.codes, (torch.uint8,), numel, device)
        n = m.codes.numel()
        check_tensor(f"{name}.scales", m.scales, (torch.float32,), None, m.codes.device)
        if blocks is not None:
            if blocks.n != n or m.scales.numel() != blocks.scale_count:
                raise OffloadConfigError(f"{name} has {n} codes and {m.scales.numel()} scales; its block layout "
                                         f"{blocks!r} needs {blocks.n} and {blocks.scale_count}")
        elif m.scales.numel() != scale_count(fmt, n):
            raise OffloadConfigError(f"{name}.scales has {m.scales.numel()} scales; {n} codes need "
                                     f"ceil({n} / {INT8_BLOCK}) = {scale_count(fmt, n)}")
        return n
    dtype = torch.float32 if fmt is MomentFormat.FP32 else torch.bfloat16
    if isinstance(m, QuantizedMoment):
        raise OffloadConfigError(f"{name} is a QuantizedMoment but the format is {fmt.value}: pass a {dtype} tensor")
    check_tensor(name, m, (dtype,), numel, device)
    assert isinstance(m, Tensor)
    return m.numel()


def _native_for(*tensors: Tensor) -> Any:
    """offload._C when every tensor is on the CPU and the extension is built, else None (torch path)."""
    native = _native._C  # looked up per call, so a test can force the fallback
    if native is None or any(t.device.type != "cpu" for t in tensors):
        return None
    return native


def _parts(m: Moment) -> tuple[Tensor, Optional[Tensor]]:
    return (m.codes, m.scales) if isinstance(m, QuantizedMoment) else (m, None)


def _addr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _threads(n: int, num_threads: Optional[int]) -> int:
    native = _native._C
    if num_threads is None and native is not None and n < native.PARALLEL_THRESHOLD:
        return 1
    return _resolve_threads(num_threads)


# --- public operations ------------------------------------------------------------------------------------


def _runs(fmt: MomentFormat, blocks: Optional[BlockLayout]) -> Optional[tuple]:
    """The runs of an int8 layout of several runs (each stepped, decoded or encoded as a moment of its own), else
    None: the moment is one run, handled whole."""
    if fmt is not MomentFormat.INT8 or blocks is None or len(blocks.runs) <= 1:
        return None
    return blocks.runs


def _run_of(m: Moment, blocks: BlockLayout, run: tuple) -> QuantizedMoment:
    assert isinstance(m, QuantizedMoment)
    start, stop, first = run
    return QuantizedMoment(m.codes[start:stop], m.scales[first:blocks.scales_before(stop)])


def decode_moment(m: Moment, fmt: MomentFormat, which: int, out: Tensor, blocks: Optional[BlockLayout] = None) -> None:
    """Writes the fp32 values of moment `m` (`which`: 1 = exp_avg, 2 = exp_avg_sq) into `out` (fp32, n); `blocks`:
    the int8 moment's block layout (default: one run from element 0)."""
    fmt = MomentFormat.parse(fmt)
    _check_which(which)
    n = _check_moment("m", m, fmt, None, None, blocks if fmt is MomentFormat.INT8 else None)
    runs = _runs(fmt, blocks)
    if runs is not None:
        assert blocks is not None
        for run in runs:
            decode_moment(_run_of(m, blocks, run), fmt, which, out.view(-1)[run[0]:run[1]])
        return
    codes, scales = _parts(m)
    check_tensor("out", out, (torch.float32,), n, codes.device)
    native = _native_for(codes, out)
    if fmt is MomentFormat.FP32 or native is None:
        out.copy_(_decode_torch(m, fmt, which).view(out.shape))
        return
    native.moments_decode(codes.data_ptr(), _addr(scales), _FORMAT_CODES[fmt], which, n, out.data_ptr(),
                          _threads(n, None))


def encode_moment(src: Tensor, fmt: MomentFormat, which: int, out: Moment,
                  blocks: Optional[BlockLayout] = None) -> None:
    """Encodes fp32 `src` (n elements; v itself for exp_avg_sq) into moment `out` of format `fmt`; `blocks`: the
    int8 moment's block layout (default: one run from element 0)."""
    fmt = MomentFormat.parse(fmt)
    _check_which(which)
    n = _check_moment("out", out, fmt, None, None, blocks if fmt is MomentFormat.INT8 else None)
    runs = _runs(fmt, blocks)
    if runs is not None:
        assert blocks is not None
        for run in runs:
            encode_moment(src.view(-1)[run[0]:run[1]], fmt, which, _run_of(out, blocks, run))
        return
    codes, scales = _parts(out)
    check_tensor("src", src, (torch.float32,), n, codes.device)
    native = _native_for(codes, src)
    if fmt is MomentFormat.FP32 or native is None:
        _encode_torch(src.view(-1), fmt, which, out)
        return
    native.moments_encode(src.data_ptr(), codes.data_ptr(), _addr(scales), _FORMAT_CODES[fmt], which, n,
                          _threads(n, None))


def adam_step_moments(
    param: Tensor,
    grad: Tensor,
    exp_avg: Moment,
    exp_avg_sq: Moment,
    fmt: MomentFormat,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
    out: Optional[Tensor] = None,
    num_threads: Optional[int] = None,
    crcs: Optional[Tensor] = None,
    blocks: Optional[BlockLayout] = None,
) -> None:
    """One Adam/AdamW update of fp32 `param` and the moments `exp_avg`, `exp_avg_sq` (stored as `fmt`) in place.

    FP32 is exactly `adam_step_flat` (on the CPU; on a CUDA device `adam_step_torch`, the gpu tier's step). BF16
    and INT8: m and v are decoded to fp32, updated with the same maths, the parameter update is computed from the
    new fp32 m and v, then m and v are encoded again; one fused pass on the CPU with `offload._C`, torch operations
    otherwise (also on a CUDA device). `grad` may be fp32, bf16 or fp16; `out` (fp32/bf16/fp16) receives the new
    weights; `step` is the 1-based count after this update. INT8 moments must start at a block boundary: whole
    moments or `slice_moment` views. `crcs` (torch.uint32, len(CRC_PIECES) elements, CPU) receives the CRC-32C of each
    piece written, in CRC_PIECES order ([Note: step CRCs]). `blocks`: the int8 moments' block layout (default: one
    run from element 0); a layout of several runs is stepped run by run, and its CRCs are read back after.
    """
    fmt = MomentFormat.parse(fmt)
    check_tensor("param", param, (torch.float32,), None, None)
    n, device = param.numel(), param.device
    check_tensor("grad", grad, GRAD_DTYPES, n, device)
    layout = blocks if fmt is MomentFormat.INT8 else None
    _check_moment("exp_avg", exp_avg, fmt, n, device, layout)
    _check_moment("exp_avg_sq", exp_avg_sq, fmt, n, device, layout)
    runs = _runs(fmt, blocks)
    if runs is not None:
        assert blocks is not None
        if crcs is not None:
            check_crcs(crcs, device)
        native = _native_for(param)
        if native is not None:
            _native_step_runs(native, param, grad, exp_avg, exp_avg_sq, fmt, blocks, step=step, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale,
                              out=out, num_threads=num_threads, crcs=crcs)
            return
        for start, stop, first in runs:
            adam_step_moments(param.view(-1)[start:stop], grad.view(-1)[start:stop],
                              _run_of(exp_avg, blocks, (start, stop, first)),
                              _run_of(exp_avg_sq, blocks, (start, stop, first)), fmt, step=step, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale,
                              out=None if out is None else out.view(-1)[start:stop], num_threads=num_threads)
        if crcs is not None:
            _crcs_after(crcs, param, exp_avg, exp_avg_sq, out)
        return
    if out is not None:
        check_tensor("out", out, OUT_DTYPES, n, device)
    if step < 1:
        raise OffloadConfigError(f"step must be >= 1 (the count after this update), got {step}")
    if num_threads is not None:
        _resolve_threads(num_threads)  # validated on every path
    if crcs is not None:
        check_crcs(crcs, device)
    hp: dict[str, Any] = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
              grad_scale=grad_scale, out=out)
    if fmt is MomentFormat.FP32:
        assert isinstance(exp_avg, Tensor) and isinstance(exp_avg_sq, Tensor)
        if device.type == "cpu":
            adam_step_flat(param, grad, exp_avg, exp_avg_sq, num_threads=num_threads, crcs=crcs, **hp)
        else:
            adam_step_torch(param, grad, exp_avg, exp_avg_sq, step, float(lr), beta1, beta2, eps, weight_decay,
                            adamw, grad_scale, out)
        return
    native = _native_for(param)
    if native is None:
        _adam_step_moments_torch(param, grad, exp_avg, exp_avg_sq, fmt, **hp)
        if crcs is not None:
            _crcs_after(crcs, param, exp_avg, exp_avg_sq, out)
        return
    (m_codes, m_scales), (v_codes, v_scales) = _parts(exp_avg), _parts(exp_avg_sq)
    native.adam_moments_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype], m_codes.data_ptr(), _addr(m_scales),
        v_codes.data_ptr(), _addr(v_scales), _FORMAT_CODES[fmt], n, _addr(out),
        0 if out is None else _DTYPE_CODES[out.dtype], int(step), float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), bool(adamw), float(grad_scale), _threads(n, num_threads), None, "", _addr(crcs))


def _native_step_runs(native: Any, param: Tensor, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment,
                      fmt: MomentFormat, blocks: BlockLayout, *, step: int, lr: float, beta1: float, beta2: float,
                      eps: float, weight_decay: float, adamw: bool, grad_scale: float, out: Optional[Tensor],
                      num_threads: Optional[int], crcs: Optional[Tensor]) -> None:
    """The fused native step over every run of a checked int8 layout in one call (`adam_moments_step_runs`):
    one GIL release for a layer's many small parameters, not one a run (the worker's update then waits for the
    training thread at each); a run below PARALLEL_THRESHOLD on one thread; the CRCs those of the whole pieces."""
    assert fmt is MomentFormat.INT8 and isinstance(exp_avg, QuantizedMoment) and isinstance(exp_avg_sq, QuantizedMoment)
    threads = _resolve_threads(num_threads)
    native.adam_moments_step_runs(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype], exp_avg.codes.data_ptr(),
        exp_avg.scales.data_ptr(), exp_avg_sq.codes.data_ptr(), exp_avg_sq.scales.data_ptr(), param.numel(),
        _addr(out), 0 if out is None else _DTYPE_CODES[out.dtype], [list(run) for run in blocks.runs], int(step),
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw), float(grad_scale),
        threads, native.PARALLEL_THRESHOLD, _addr(crcs))


def _crcs_after(crcs: Tensor, param: Tensor, exp_avg: Moment, exp_avg_sq: Moment, out: Optional[Tensor]) -> None:
    """The step CRCs read back from the written pieces (the torch fallback, int8 layouts of several runs)."""
    (m_codes, m_scales), (v_codes, v_scales) = _parts(exp_avg), _parts(exp_avg_sq)
    crcs_read_back(crcs, (param, m_codes, m_scales, v_codes, v_scales, out))


__all__ = ["adam_step_moments", "code_map", "decode_moment", "encode_moment", "inf_code"]
