"""Optimizer state of one flat group and the per-block AdamW update, run on a background worker.

The maths is torch.optim.AdamW's, per parameter: a parameter that received no gradient since the last
`zero_grad` is skipped (no decay, no step count), exactly as AdamW skips `grad is None`. When every
parameter of a group has a gradient and the same step count (the usual case), the whole group is updated
in one flat call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ContextManager, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from offload.optim.functional import adam_step_flat
from offload.scheduler.block import FlatGroup
from offload.scheduler.streams import CopyContext, GradDownloads

if TYPE_CHECKING:
    from offload.scheduler.disk_ring import DiskRing
    from offload.tiers.disk import SwapStore


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


Hypers = Union[AdamHyper, Sequence[AdamHyper]]  # one for the whole group, or one per trainable slot


class GroupState:
    """fp32 master weights, Adam moments and the gradient accumulator of a group's trainable range.

    `on_host` is True for the CPU tier (state in host memory, the CPU Adam kernel) and False for the GPU
    tier (state on the compute device, torch maths there). In the GPU tier with an fp32 compute dtype the
    master weights are the device buffer itself (no second copy). With `copies` on side streams (CUDA) and
    the state on the host, gradients arrive asynchronously (`grad_downloads`): every read of `grad` settles
    them first (`settle_grads`).
    """

    def __init__(self, group: FlatGroup, state_device: torch.device, on_host: bool,
                 copies: Optional[CopyContext] = None) -> None:
        assert group.device_buffer is not None, "allocate the device buffer first"
        n = group.trainable_numel
        self.group = group
        self.on_host = on_host
        self.grad_downloads = _downloads(copies, group) if on_host else None
        trainable_weights = group.device_buffer[:n]
        aliased = group.dtype == torch.float32 and not on_host
        self.master = trainable_weights if aliased else trainable_weights.to(state_device, torch.float32, copy=True)
        self.writes_compute_copy = not aliased
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=state_device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=state_device)
        self.grad = (torch.zeros(n, dtype=group.dtype, device=state_device) if self.grad_downloads is None
                     else self.grad_downloads.new_accumulator())
        self.steps: List[int] = [0] * len(group.trainable_slots)
        self.has_grad: List[bool] = [False] * len(group.trainable_slots)

    @property
    def nbytes(self) -> int:
        own_master = 0 if self.master.data_ptr() == self.group.device_buffer.data_ptr() else self.master.nbytes
        return own_master + self.exp_avg.nbytes + self.exp_avg_sq.nbytes + self.grad.nbytes

    def accumulate(self, index: int, grad: Tensor) -> int:
        """Add one parameter's gradient into its range (a copy for the first one); returns bytes moved."""
        slot = self.group.trainable_slots[index]
        target = self.grad[slot.offset:slot.offset + slot.numel]
        source = grad.detach().reshape(-1)
        if self.grad_downloads is not None:
            self.grad_downloads.put(target, slot.offset, source, accumulate=self.has_grad[index])
            self.has_grad[index] = True
        elif self.has_grad[index]:
            target.add_(source.to(target.device, target.dtype))
        else:
            target.copy_(source)
            self.has_grad[index] = True
        return source.numel() * source.element_size()

    def settle_grads(self) -> None:
        """Finish the gradient downloads in flight (CUDA): call before reading `grad` (any thread)."""
        if self.grad_downloads is not None:
            self.grad_downloads.settle()

    def zero_grad(self, set_to_none: bool) -> None:
        self.settle_grads()  # a copy still in flight would land after the zeroing or the next first copy
        if set_to_none:
            self.has_grad = [False] * len(self.has_grad)
        else:
            for index, slot in enumerate(self.group.trainable_slots):
                if self.has_grad[index]:
                    self.grad[slot.offset:slot.offset + slot.numel].zero_()

    def grad_norms(self) -> List[Tuple[nn.Parameter, float]]:
        """L2 norm of each accumulated gradient (parameters without one are left out).

        Computed with torch.linalg.vector_norm in fp32, the reduction torch.nn.utils.clip_grad_norm_ uses:
        a more exact fp64 sum differs in the last bit, and Adam amplifies that in elements whose gradient
        is rounding noise (e.g. attention key biases). See docs/design.md [Note: clipping parity]."""
        self.settle_grads()
        norms = []
        for index, slot in enumerate(self.group.trainable_slots):
            if self.has_grad[index]:
                piece = self.grad[slot.offset:slot.offset + slot.numel]
                norms.append((slot.param, float(torch.linalg.vector_norm(piece, 2, dtype=torch.float32))))
        return norms

    def ready_indices(self) -> List[int]:
        """Trainable parameters that have a gradient now: taken when an update is scheduled, because
        `zero_grad()` may clear the flags before the background update runs."""
        return [i for i, has in enumerate(self.has_grad) if has]

    def update(self, ready: List[int], hyper: Hypers, grad_scale: float, out: Optional[Tensor],
               num_threads: Optional[int] = None) -> None:
        """One AdamW step of the parameters in `ready`; new compute weights written to `out` when given.
        `hyper`: one for all, or one per trainable slot (its optimizer group's). `num_threads` caps the native
        kernel's threads (None: all usable cores)."""
        self.settle_grads()
        if not ready:
            return
        if not self.writes_compute_copy:
            out = None
        for start, stop, step, slot_hyper in self._advance_steps(ready, hyper):
            self._adam(slice(start, stop), step, slot_hyper, grad_scale, out, num_threads)

    def _advance_steps(self, ready: List[int], hyper: Hypers) -> List[Tuple[int, int, int, AdamHyper]]:
        """Count the step of every ready parameter; (start, stop, step, hyperparameters) element spans to
        update: the whole group in one span when every parameter is ready, at the same step and in the same
        optimizer group (the usual case), else one span per parameter."""
        hypers = [hyper] * len(self.steps) if isinstance(hyper, AdamHyper) else list(hyper)
        if len(ready) == len(self.steps) and len(set(self.steps)) == 1 and len(set(hypers)) == 1:
            self.steps = [self.steps[0] + 1] * len(self.steps)
            return [(0, self.group.trainable_numel, self.steps[0], hypers[0])]
        spans = []
        for i in ready:
            slot = self.group.trainable_slots[i]
            self.steps[i] += 1
            spans.append((slot.offset, slot.offset + slot.numel, self.steps[i], hypers[i]))
        return spans

    def _adam(self, span: slice, step: int, hyper: AdamHyper, grad_scale: float, out: Optional[Tensor],
              num_threads: Optional[int]) -> None:
        args = (self.master[span], self.grad[span], self.exp_avg[span], self.exp_avg_sq[span])
        target = None if out is None else out[span]
        if self.on_host:
            adam_step_flat(*args, step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
                           weight_decay=hyper.weight_decay, adamw=True, grad_scale=grad_scale, out=target,
                           num_threads=num_threads)
        else:
            _adamw_on_device(*args, step, hyper, grad_scale, target)


class DiskGroupState(GroupState):
    """A GroupState whose master weights and moments live in the swap file (the NVME tier).

    Only the gradient accumulator and the step counts stay in host memory. An update streams the record
    through the engine's `DiskRing` chunk by chunk (read ahead, update, write behind), running the same
    AdamW on each chunk: host memory holds the ring, never the whole state.
    """

    def __init__(self, group: FlatGroup, ring: "DiskRing", copies: Optional[CopyContext] = None) -> None:
        assert group.device_buffer is not None, "allocate the device buffer first"
        n = group.trainable_numel
        self.group = group
        self.on_host = True
        self.writes_compute_copy = True
        self.grad_downloads = _downloads(copies, group)
        self.grad = (torch.zeros(n, dtype=group.dtype) if self.grad_downloads is None
                     else self.grad_downloads.new_accumulator())
        self.steps = [0] * len(group.trainable_slots)
        self.has_grad = [False] * len(group.trainable_slots)
        self._ring = ring
        weights = group.device_buffer

        def fill(start: int, stop: int, sections: Tuple[Tensor, Tensor, Tensor]) -> None:
            master, exp_avg, exp_avg_sq = sections
            master.copy_(weights[start:stop])
            on_disk = ring.weights_of(sections, group)
            if on_disk is not None:
                on_disk.copy_(weights[start:stop])
            exp_avg.zero_()
            exp_avg_sq.zero_()

        ring.write_fresh(group, fill)

    @property
    def nbytes(self) -> int:
        return self.grad.nbytes  # host bytes; the state itself is on disk

    def announce(self) -> None:
        """Start reading this group's state ahead of its update (called when the update is scheduled)."""
        self._ring.announce([self.group])

    @property
    def swap(self) -> "SwapStore":
        """The swap file holding this group's record (for checkpoints, which read and write it directly)."""
        return self._ring.swap

    def chunks(self) -> List[Tuple[int, int]]:
        """The element ranges the ring moves this record in; a reader that follows them covers every piece
        the swap checksums sealed, so it verifies all it reads (tiers/disk_checksums.py)."""
        return self._ring.chunks(self.group)

    def staging(self, count: int = 1) -> ContextManager[List[Tuple[Tensor, Tensor, Tensor]]]:
        """A ring slot (three fp32 sections of one chunk each) to move this record through; after `settle`."""
        return self._ring.borrow(count)

    def settle(self) -> None:
        """Finish every write in flight and drop reads ahead: the swap file then holds the current state."""
        self._ring.drain()

    def skip(self) -> None:
        """The scheduled update will not run (non-finite gradients): release the reads started for it."""
        self._ring.discard(self.group)

    def update(self, ready: List[int], hyper: Hypers, grad_scale: float, out: Optional[Tensor],
               num_threads: Optional[int] = None) -> None:
        self.settle_grads()
        if not ready:
            return
        spans = self._advance_steps(ready, hyper)
        for start, stop in self._ring.chunks(self.group):
            sections = self._ring.load(self.group, start, stop)
            weights = self._ring.weights_of(sections, self.group)  # compute weights on disk: written back
            target = out if weights is None else weights
            base = 0 if weights is None else start
            try:
                for a, b, step, span_hyper in spans:
                    lo, hi = max(a, start), min(b, stop)
                    if lo < hi:
                        master, exp_avg, exp_avg_sq = (t[lo - start:hi - start] for t in sections)
                        adam_step_flat(master, self.grad[lo:hi], exp_avg, exp_avg_sq, step=step,
                                       lr=span_hyper.lr, beta1=span_hyper.beta1, beta2=span_hyper.beta2,
                                       eps=span_hyper.eps, weight_decay=span_hyper.weight_decay, adamw=True,
                                       grad_scale=grad_scale,
                                       out=None if target is None else target[lo - base:hi - base],
                                       num_threads=num_threads)
            except BaseException:
                self._ring.abandon(sections)
                raise
            self._ring.store(self.group, start, stop, sections)


def _downloads(copies: Optional[CopyContext], group: FlatGroup) -> Optional[GradDownloads]:
    """Asynchronous gradient downloads for a group whose accumulator is on the host, when copies are."""
    if copies is None or not copies.is_async:
        return None
    return GradDownloads(copies, group.trainable_numel, group.dtype)


def clip_scale(norms: List[float], max_norm: float) -> Tuple[float, float]:
    """(total norm, gradient scale) exactly as torch.nn.utils.clip_grad_norm_ computes them in fp32: the
    norm of the per-parameter norms, then min(max_norm / (total + 1e-6), 1)."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), 2)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return float(total), float(coef)


def _adamw_on_device(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int,
                     hyper: AdamHyper, grad_scale: float, out: Optional[Tensor]) -> None:
    """torch.optim.AdamW's single-tensor maths, for state kept on the compute device (the GPU tier)."""
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    param.mul_(1.0 - hyper.lr * hyper.weight_decay)
    exp_avg.lerp_(g, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    bias_correction1 = 1.0 - hyper.beta1**step
    bias_correction2_sqrt = (1.0 - hyper.beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-hyper.lr / bias_correction1)
    if out is not None:
        out.copy_(param)
