"""The Adam moment formats (fp32, bf16, int8) and their byte layout: sizes, zero state, views of raw bytes and
slices. The maths that reads and writes them is moments.py ([Note: int8 moment codes] there)."""

from __future__ import annotations

import bisect
import enum
from typing import NamedTuple, Optional, Sequence, Tuple, Union

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
    """An int8 moment of n elements: `codes` (uint8, n) and `scales` (float32, one per block: ceil(n / INT8_BLOCK)
    for one run from element 0; `BlockLayout.scale_count` when blocks start over at each parameter)."""

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


def moment_nbytes(fmt: MomentFormat, n: int, blocks: Optional["BlockLayout"] = None) -> int:
    """Bytes of an n-element moment (laid out as `blocks`, default one run): codes plus scales, no padding."""
    return code_nbytes(fmt, n) + 4 * layout_scale_count(fmt, n, blocks)


# --- construction and views -------------------------------------------------------------------------------


def zeros_moment(fmt: MomentFormat, n: int, device: Union[str, torch.device] = "cpu",
                 blocks: Optional["BlockLayout"] = None) -> Moment:
    """A moment of n elements (int8: laid out as `blocks`) that decodes to exactly 0.0 (int8: codes 0, scales 0)."""
    fmt = MomentFormat.parse(fmt)
    if fmt is MomentFormat.INT8:
        return QuantizedMoment(torch.zeros(n, dtype=torch.uint8, device=device),
                               torch.zeros(layout_scale_count(fmt, n, blocks), dtype=torch.float32, device=device))
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


def slice_moment(m: Moment, fmt: MomentFormat, start: int, stop: int, blocks: Optional["BlockLayout"] = None) -> Moment:
    """Elements [start, stop) of a moment, as a view. For INT8, start must start a block (of `blocks`, the moment's
    layout when it has several runs; else a multiple of INT8_BLOCK); stop may
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
    if blocks is not None:
        if not blocks.is_boundary(start):
            raise OffloadConfigError(f"an int8 moment slice must start on a quantization block, got {start}")
        return QuantizedMoment(m.codes[start:stop], m.scales[blocks.scales_before(start):blocks.scales_before(stop)])
    if start % INT8_BLOCK:
        raise OffloadConfigError(f"an int8 moment slice must start at a multiple of INT8_BLOCK={INT8_BLOCK}, "
                                 f"got {start}")
    return QuantizedMoment(m.codes[start:stop], m.scales[start // INT8_BLOCK:-(-stop // INT8_BLOCK)])


# --- block layouts ----------------------------------------------------------------------------------------

Run = Tuple[int, int, int]  # elements [start, stop) whose blocks start every INT8_BLOCK from `start`; its first scale


class BlockLayout:
    """Where the int8 quantization blocks of a flat moment of n elements lie: each segment (a parameter, or a
    parameter's part on a data-parallel rank) is cut into blocks of INT8_BLOCK counted from its own start, the last
    one partial, so no block holds two parameters' elements: a parameter stepped alone, or not at all, leaves its
    neighbours' codes and scales as they were, and its own codes and scales can be stored and loaded on their own.
    The scales are the blocks' in order. Consecutive segments whose blocks continue one grid (every segment but
    the last a multiple of INT8_BLOCK) form one *run*: one kernel call steps a run, as it steps a whole moment."""

    def __init__(self, n: int, segment_starts: Sequence[int] = (0,)) -> None:
        starts = sorted({int(s) for s in segment_starts if 0 <= int(s) < n} | ({0} if n else set()))
        runs: list = []
        scale = 0
        for i, start in enumerate(starts):
            stop = starts[i + 1] if i + 1 < len(starts) else n
            if runs and (runs[-1][1] - runs[-1][0]) % INT8_BLOCK == 0:
                runs[-1] = (runs[-1][0], stop, runs[-1][2])  # continues the previous run's grid
            else:
                runs.append((start, stop, scale))
            scale = runs[-1][2] + -(-(stop - runs[-1][0]) // INT8_BLOCK)
        self.n = int(n)
        self.runs: Tuple[Run, ...] = tuple(runs)
        self.scale_count = scale
        self._starts = [r[0] for r in runs]

    @staticmethod
    def of_segments(n: int, segments: Sequence[Tuple[int, int]]) -> "BlockLayout":
        """The layout of n elements cut at each segment's start (segments: (start, stop) pairs)."""
        return BlockLayout(n, [start for start, _stop in segments])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockLayout) and (self.n, self.runs) == (other.n, other.runs)

    def __hash__(self) -> int:
        return hash((self.n, self.runs))

    def __repr__(self) -> str:
        return f"BlockLayout(n={self.n}, runs={len(self.runs)}, scales={self.scale_count})"

    def _run_at(self, offset: int) -> Run:
        return self.runs[max(bisect.bisect_right(self._starts, offset) - 1, 0)]

    def is_boundary(self, offset: int) -> bool:
        """Whether a block starts at `offset` (or it is the end)."""
        if offset == self.n or offset == 0:
            return 0 <= offset <= self.n
        start, _stop, _first = self._run_at(offset)
        return 0 < offset < self.n and (offset - start) % INT8_BLOCK == 0

    def scales_before(self, offset: int) -> int:
        """How many blocks start before element `offset`: the index of the scale of a block starting there."""
        if offset <= 0 or not self.runs:
            return 0
        if offset >= self.n:
            return self.scale_count
        start, _stop, first = self._run_at(offset)
        return first + -(-(offset - start) // INT8_BLOCK)

    def block_start(self, scale: int) -> int:
        """The first element of the block of scale index `scale` (n for scale_count)."""
        if scale >= self.scale_count:
            return self.n
        i = max(bisect.bisect_right([r[2] for r in self.runs], scale) - 1, 0)
        start, _stop, first = self.runs[i]
        return start + (scale - first) * INT8_BLOCK

    def enclosing(self, a: int, b: int) -> Tuple[int, int]:
        """The smallest range of whole blocks that holds [a, b)."""
        first = self.block_start(self.scales_before(a + 1) - 1) if a < self.n else self.n
        return first, self.block_start(self.scales_before(b))

    def sub(self, a: int, b: int) -> "BlockLayout":
        """The layout of elements [a, b) (a on a block boundary), counted from a."""
        if not self.is_boundary(a):
            raise OffloadConfigError(f"a block layout can be cut only where a block starts, not at {a}")
        if (a, b) == (0, self.n):
            return self
        return BlockLayout(b - a, [max(start, a) - a for start, stop, _first in self.runs if stop > a and start < b])

    def pieces(self) -> Tuple[Run, ...]:
        """The runs: ranges one kernel call steps, each with its first scale."""
        return self.runs

    def cuts(self, max_numel: int, max_scales: Optional[int] = None) -> list:
        """Consecutive ranges [start, stop) covering the layout, each cut on block boundaries, at most `max_numel`
        elements (>= INT8_BLOCK) and `max_scales` blocks (default: ceil(max_numel / INT8_BLOCK)) long."""
        if max_numel < INT8_BLOCK:
            raise OffloadConfigError(f"ranges of int8 moments hold at least one block ({INT8_BLOCK}), got {max_numel}")
        max_scales = -(-max_numel // INT8_BLOCK) if max_scales is None else max_scales
        out, pos = [], 0
        while pos < self.n:
            target = min(pos + max_numel, self.n)
            start, _stop, _first = self._run_at(target - 1 if target == self.n else target)
            stop = target if target == self.n else max(start + (target - start) // INT8_BLOCK * INT8_BLOCK, start)
            if stop <= pos:  # target is in a run that starts at pos or right after: its grid gives no cut
                stop = target
            stop = min(stop, self.block_start(self.scales_before(pos) + max_scales))
            assert stop > pos and self.is_boundary(stop), (pos, stop)
            out.append((pos, stop))
            pos = stop
        return out


def layout_scale_count(fmt: MomentFormat, n: int, blocks: Optional[BlockLayout]) -> int:
    """fp32 scales of an n-element moment laid out as `blocks` (None: one run from element 0)."""
    if MomentFormat.parse(fmt) is not MomentFormat.INT8:
        return 0
    return scale_count(fmt, n) if blocks is None else blocks.scale_count
