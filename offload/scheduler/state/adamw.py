"""The one AdamW update loop, run over whatever a `StateStore` hands it, and its hyperparameters.

The maths is torch.optim.AdamW's, per parameter: a parameter that received no gradient since the last
`zero_grad` is skipped (no decay, no step count), exactly as AdamW skips `grad is None`. Spans say which
element ranges to update at which step with which group's hyperparameters: one span for the whole group
in the usual case (records/group.py, `GroupState.advance_steps`), one per parameter otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, cast

import torch
from torch import Tensor

from offload.optim.functional import CRC_PIECES, adam_step_flat, adam_step_resting, adam_step_torch
from offload.optim.moment_format import EXP_AVG, EXP_AVG_SQ, BlockLayout, MomentFormat, slice_moment
from offload.optim.moments import adam_step_moments, decode_moment, encode_moment
from offload.scheduler.state.state_store import StateChunk, StateStore


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters read from `engine.optimizer.param_groups` when an update is scheduled."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @staticmethod
    def from_group(group: dict) -> "AdamHyper":
        beta1, beta2 = group["betas"]
        return AdamHyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                         float(group["weight_decay"]))


UpdateSpan = Tuple[int, int, int, AdamHyper]  # elements [start, stop), the Adam step, its hyperparameters


class RestingSpan(NamedTuple):
    """A span a speculative step took with a 16-bit gradient, which may then rest in the first moment the step
    wrote (records/grad_in_moments.py): elements [lo, hi) of the group, its beta1, and the elements a rebuild
    would miss (group indices, ascending; the gradient's bits as int16)."""

    lo: int
    hi: int
    beta1: float
    miss_index: Tensor
    miss_bits: Tensor


# More misses than this share of a span (plus MISSES_SLACK) and the gradient is kept instead. Measured: 1e-5 to
# 3e-5 (benchmarks/grad_from_moments.py); at this cap the misses a step keeps take at most 10 B / 4096 = 2.5 MB a
# billion parameters, within the host budget's constant (the plan does not count them).
MISSES_PER_ELEMENT = 1 / 4096
MISSES_SLACK = 256


def adamw(store: StateStore, grad: Tensor, spans: List[UpdateSpan], grad_scale: float, out: Optional[Tensor],
          num_threads: Optional[int], out_base: int = 0, shadow: bool = False,
          rest: bool = False) -> Optional[List[RestingSpan]]:
    """One AdamW step of `spans` of the store's state, chunk by chunk; new compute weights go to `out`
    (element 0 = the group's element `out_base`: its first trainable one, or a sharded rank's part's first) or,
    when the store keeps the weights, into the chunk's own weight area. `shadow`: the new state goes to the
    store's shadow (a speculative update). A failure hands the chunk back unwritten (`abandon`). A store that seals
    what it writes (`seals_in_step`) gets the CRCs of a chunk that one span covers from the native step, which
    computes them in the pass that writes the chunk (`StateChunk.crcs`). `rest` (a speculative step of fp32
    moments with the CPU kernel and a 16-bit gradient): the step also finds what the gradient's rebuild from the
    moments would miss; returns the spans with their misses, or None (not asked, or too many misses)."""
    if not store.writes_compute_copy:
        out = None
    assert not rest or (shadow and store.moments is MomentFormat.FP32), "a gradient rests only in fp32 first moments"
    resting: Optional[List[RestingSpan]] = [] if rest else None
    for start, stop in store.chunks():
        chunk = store.load(start, stop, shadow)
        target, base = (out, out_base) if chunk.weights is None else (chunk.weights, start)
        crcs: Optional[Tensor] = None
        try:
            for a, b, step, hyper in spans:
                lo, hi = max(a, start), min(b, stop)
                if lo >= hi:
                    continue
                piece = None if target is None else target[lo - base:hi - base]
                if (lo, hi) == (start, stop) and store.seals_in_step and store.uses_cpu_kernel:
                    crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32)  # the spans are disjoint: the only one
                if store.moments is not MomentFormat.FP32:
                    _adamw_moments(store.moments, chunk, lo, hi, grad[lo:hi], step, hyper, grad_scale, piece,
                                   num_threads, crcs)
                    continue
                exp_avg, exp_avg_sq = cast(Tensor, chunk.exp_avg), cast(Tensor, chunk.exp_avg_sq)  # fp32 moments
                state = (chunk.master[lo - start:hi - start], grad[lo:hi], exp_avg[lo - start:hi - start],
                         exp_avg_sq[lo - start:hi - start])
                if resting is not None:
                    assert store.uses_cpu_kernel and grad_scale == 1.0
                    capacity = int((hi - lo) * MISSES_PER_ELEMENT) + MISSES_SLACK
                    misses = adam_step_resting(*state, step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                                               eps=hyper.eps, weight_decay=hyper.weight_decay, out=piece,
                                               num_threads=num_threads, capacity=capacity, index_base=lo,
                                               crcs=crcs)
                    if misses is None:
                        resting = None  # the step is done; the gradient is kept as it would be without resting
                    else:
                        resting.append(RestingSpan(lo, hi, hyper.beta1, *misses))
                elif store.uses_cpu_kernel:
                    adam_step_flat(*state, step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
                                   eps=hyper.eps, weight_decay=hyper.weight_decay, adamw=True,
                                   grad_scale=grad_scale, out=piece, num_threads=num_threads, crcs=crcs)
                else:
                    _adamw_torch(*state, step, hyper, grad_scale, piece)
        except BaseException:
            store.abandon(chunk)
            raise
        store.store(chunk if crcs is None else chunk._replace(crcs=crcs))
    return resting


def _adamw_moments(fmt: MomentFormat, chunk: StateChunk, lo: int, hi: int, grad: Tensor, step: int, hyper: AdamHyper,
                   grad_scale: float, out: Optional[Tensor], num_threads: Optional[int],
                   crcs: Optional[Tensor] = None) -> None:
    """AdamW on elements [lo, hi) of a chunk whose moments are compressed: the fused kernel on the compressed
    form when the range is whole quantization blocks (int8 blocks start over at each parameter, so every span of
    parameters is); else [Note: compressed moments] the blocks the range touches are decoded, stepped in fp32
    and encoded again (the other elements of those blocks are re-encoded at the block's new scale). `crcs` (the
    whole chunk): receives the CRC-32C of each piece written ([Note: step CRCs])."""
    a, b = lo - chunk.start, hi - chunk.start
    size = chunk.stop - chunk.start
    blocks = chunk.blocks if fmt is MomentFormat.INT8 else None
    if fmt is MomentFormat.INT8 and blocks is None:
        blocks = BlockLayout(size)  # one run from the chunk's start
    first, last = (a, b) if blocks is None else blocks.enclosing(a, b)
    if (first, last) == (a, b) or (first == a and b == size):  # whole blocks: nothing outside [a, b) shares a scale
        adam_step_moments(chunk.master[a:b], grad, slice_moment(chunk.exp_avg, fmt, a, b, blocks),
                          slice_moment(chunk.exp_avg_sq, fmt, a, b, blocks), fmt, step=step, lr=hyper.lr,
                          beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
                          adamw=True, grad_scale=grad_scale, out=out, num_threads=num_threads, crcs=crcs,
                          blocks=None if blocks is None else blocks.sub(a, b))
        return
    assert crcs is None, "the CRCs of a whole chunk come from one fused step"
    assert blocks is not None
    part = blocks.sub(first, last)
    moments = [slice_moment(m, fmt, first, last, blocks) for m in (chunk.exp_avg, chunk.exp_avg_sq)]
    values = [torch.empty(last - first, dtype=torch.float32, device=chunk.master.device) for _ in moments]
    for which, moment, fp32 in zip((EXP_AVG, EXP_AVG_SQ), moments, values):
        decode_moment(moment, fmt, which, fp32, part)
    state = (chunk.master[a:b], grad, values[0][a - first:b - first], values[1][a - first:b - first])
    if chunk.master.device.type == "cpu":
        adam_step_flat(*state, step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
                       weight_decay=hyper.weight_decay, adamw=True, grad_scale=grad_scale, out=out,
                       num_threads=num_threads)
    else:
        _adamw_torch(*state, step, hyper, grad_scale, out)
    for which, moment, fp32 in zip((EXP_AVG, EXP_AVG_SQ), moments, values):
        encode_moment(fp32, fmt, which, moment, part)


def _adamw_torch(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int,
                 hyper: AdamHyper, grad_scale: float, out: Optional[Tensor]) -> None:
    """torch.optim.AdamW's single-tensor maths, for state kept on the compute device (the gpu tier)."""
    adam_step_torch(param, grad, exp_avg, exp_avg_sq, step, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
                    hyper.weight_decay, True, grad_scale, out)
