"""The Adam moment formats (fp32, bf16, int8) and their byte layout: sizes, zero state, views of raw bytes and
slices. The maths that reads and writes them is moments.py ([Note: int8 moment codes] there)."""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from offload.errors import OffloadConfigError

INT8_BLOCK = 256  # elements per quantization block (one fp32 scale each)


class MomentFormat(enum.Enum):
    """How `exp_avg` and `exp_avg_sq` are stored (the master weights are fp32 in every format)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"

    @staticmethod
    def parse(value: "str | MomentFormat") -> "MomentFormat":
        """`"fp32"`, `"bf16"`, `"int8"` (any case) or a MomentFormat; anything else raises OffloadConfigError."""
        if isinstance(value, MomentFormat):
            return value
        if isinstance(value, str):
            for fmt in MomentFormat:
                if value.strip().lower() == fmt.value:
                    return fmt
        choices = ", ".join(repr(f.value) for f in MomentFormat)
        raise OffloadConfigError(f"moments={value!r} is not a moment format: use one of {choices}")


class QuantizedMoment(NamedTuple):
    """An int8 moment of n elements: `codes` (uint8, n) and `scales` (float32, ceil(n / INT8_BLOCK))."""

    codes: Tensor
    scales: Tensor


Moment = Union[Tensor, QuantizedMoment]

EXP_AVG, EXP_AVG_SQ = 1, 2  # `which`: the moment's role picks its int8 map
_FORMAT_CODES = {MomentFormat.BF16: 1, MomentFormat.INT8: 2}  # csrc/adam/adam_moments.h: MomentFormat


# --- sizes ------------------------------------------------------------------------------------------------


def scale_count(fmt: MomentFormat, n: int) -> int:
    """fp32 scales of an n-element moment: ceil(n / INT8_BLOCK) for INT8, else 0."""
    return -(-int(n) // INT8_BLOCK) if MomentFormat.parse(fmt) is MomentFormat.INT8 else 0


def code_nbytes(fmt: MomentFormat, n: int) -> int:
    """Bytes of the values (fp32, bf16) or codes (int8) of an n-element moment."""
    return int(n) * {MomentFormat.FP32: 4, MomentFormat.BF16: 2, MomentFormat.INT8: 1}[MomentFormat.parse(fmt)]


def moment_nbytes(fmt: MomentFormat, n: int) -> int:
    """Bytes of an n-element moment: codes plus scales, no padding."""
    return code_nbytes(fmt, n) + 4 * scale_count(fmt, n)


# --- construction and views -------------------------------------------------------------------------------


def zeros_moment(fmt: MomentFormat, n: int, device: Union[str, torch.device] = "cpu") -> Moment:
    """A moment of n elements that decodes to exactly 0.0 (int8: codes 0 and scales 0)."""
    fmt = MomentFormat.parse(fmt)
    if fmt is MomentFormat.INT8:
        return QuantizedMoment(torch.zeros(n, dtype=torch.uint8, device=device),
                               torch.zeros(scale_count(fmt, n), dtype=torch.float32, device=device))
    return torch.zeros(n, dtype=torch.float32 if fmt is MomentFormat.FP32 else torch.bfloat16, device=device)


def _raw_view(name: str, raw: Tensor, nbytes: int, dtype: torch.dtype) -> Tensor:
    if not isinstance(raw, Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
        raise OffloadConfigError(f"{name} must be a contiguous 1-D uint8 tensor of raw bytes")
    if raw.numel() != nbytes:
        raise OffloadConfigError(f"{name} has {raw.numel()} bytes; this moment needs exactly {nbytes}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if raw.data_ptr() % itemsize:
        raise OffloadConfigError(f"{name} starts at an address not aligned to {itemsize} bytes (its {dtype} values)")
    return raw.view(dtype)


def moment_from_bytes(fmt: MomentFormat, n: int, codes: Tensor, scales: Optional[Tensor]) -> Moment:
    """Views raw bytes (carved out of a staging buffer) as an n-element moment, without a copy. `codes` holds
    `code_nbytes(fmt, n)` bytes; `scales` `4 * scale_count(fmt, n)` bytes for INT8, else None (or empty)."""
    fmt = MomentFormat.parse(fmt)
    if fmt is MomentFormat.INT8:
        if scales is None:
            raise OffloadConfigError("an int8 moment needs its scales bytes: scales=None")
        return QuantizedMoment(_raw_view("codes", codes, n, torch.uint8),
                               _raw_view("scales", scales, 4 * scale_count(fmt, n), torch.float32))
    if scales is not None and scales.numel():
        raise OffloadConfigError(f"a {fmt.value} moment has no scales: pass scales=None")
    return _raw_view("codes", codes, code_nbytes(fmt, n), torch.float32 if fmt is MomentFormat.FP32 else torch.bfloat16)


def moment_numel(m: Moment) -> int:
    return m.codes.numel() if isinstance(m, QuantizedMoment) else m.numel()


def slice_moment(m: Moment, fmt: MomentFormat, start: int, stop: int) -> Moment:
    """Elements [start, stop) of a moment, as a view. For INT8, start must be a multiple of INT8_BLOCK; stop may
    cut a block, and that whole block then belongs to the view: a step on the view rescales it, so the elements
    of that block past `stop` must be unused (padding) or past the end of the moment."""
    fmt = MomentFormat.parse(fmt)
    n = moment_numel(m)
    if not 0 <= start <= stop <= n:
        raise OffloadConfigError(f"slice [{start}, {stop}) is outside the moment's {n} elements")
    if fmt is not MomentFormat.INT8:
        if isinstance(m, QuantizedMoment):
            raise OffloadConfigError(f"a {fmt.value} moment is a tensor, got a QuantizedMoment")
        return m[start:stop]
    if not isinstance(m, QuantizedMoment):
        raise OffloadConfigError("an int8 moment is a QuantizedMoment, got a tensor")
    if start % INT8_BLOCK:
        raise OffloadConfigError(f"an int8 moment slice must start at a multiple of INT8_BLOCK={INT8_BLOCK}, "
                                 f"got {start}")
    return QuantizedMoment(m.codes[start:stop], m.scales[start // INT8_BLOCK:-(-stop // INT8_BLOCK)])
