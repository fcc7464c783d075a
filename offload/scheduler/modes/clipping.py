"""Clipping, chosen once from `max_grad_norm`: what happens when a block's gradients are complete during a
backward, and what the step does before it schedules the updates; and the global norm, as
torch.nn.utils.clip_grad_norm_ computes it (one formula for `max_grad_norm`, `engine.clip_grad_norm_` and the
data-parallel norm). See docs/design.md [Note: clipping parity].

`NoClipping`: the block updates at once, during the declared last backward ([Note: when a block may update
early]), each update checking its own gradients for inf/NaN; the nvme ring reads the updates' state ahead from
the forward on. `NormClipping`: the step's scale needs the global norm, known only when the backward is over.
With `Speculation` (the plan gave the blocks shadows, docs/design.md [Note: speculative clipping]) a block whose
gradients the last backward (declared, or likely) completes updates at once anyway, into its shadows, on the
speculation that the step will not clip; `step()` commits those updates when the scale is exactly 1 (the same
bits the clipped update would make), or forgets them, and every block not committed updates then with the
scale, as without speculation. Without it a completed block only has its gradient norms computed on the worker.
Either way `step()` waits for the norms, computes the global norm (across the ranks in data-parallel mode),
skips the whole step on a non-finite norm, and scales every update. A block whose gradients park on disk when
they wait parks them once complete (an earlier micro-batch's).
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import List, Optional, Protocol, Tuple

import torch
from torch import nn

from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.state.adamw import AdamHyper
from offload.scheduler.state.hypers import StepHypers
from offload.scheduler.worker.step_worker import StepWorker

Hypers = Tuple[AdamHyper, ...]


class LastBackward(enum.Enum):
    """Whether a backward is the last before `step()` (phases/backward_tracker.py tells): declared so
    (`grad_accumulation_steps`), likely (nothing declared, and the previous step had as many backward passes as
    this one would then be), or not known to be."""

    NO = "no"
    LIKELY = "likely"
    DECLARED = "declared"


class Clipping(Protocol):
    checks_each_block: bool  # each update skips a group with inf/NaN gradients (no global norm decides)
    last_norm: float  # the last step's global gradient norm before clipping (nan: none was computed)

    def updates_in(self, backward: LastBackward) -> bool:
        """Whether blocks update during such a backward (the nvme ring then reads their state ahead)."""

    def watches(self, block: BlockRecord, backward: LastBackward) -> bool:
        """Whether the backward should tell when the block's gradients are complete (`block_complete`)."""

    def block_complete(self, block: BlockRecord, hypers: StepHypers, backward: LastBackward) -> None:
        """A backward completed the block's gradients."""

    def scale_for_step(self, blocks: List[BlockRecord], slots: SlotTable, step: int,
                       hypers: Hypers) -> Optional[float]:
        """The gradient scale of this step's updates, or None: skip the step. `hypers`: the step's."""

    def drop_step(self) -> None:
        """The step in progress is dropped (zero_grad before step(), a checkpoint load)."""


class NormSource(Protocol):
    """Where the global norm comes from: the reduction mode (reduction.py), across the ranks in data-parallel."""

    def global_norm(self, blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]: ...

    def everywhere(self, flags: List[bool]) -> List[bool]:
        """Whether each flag holds on every rank (the same answer on every rank; as many flags on every rank)."""


class NoClipping:
    checks_each_block = True
    last_norm = math.nan

    def updates_in(self, backward: LastBackward) -> bool:
        return backward is LastBackward.DECLARED

    def watches(self, block: BlockRecord, backward: LastBackward) -> bool:
        return backward is LastBackward.DECLARED or block.spills

    def block_complete(self, block: BlockRecord, hypers: StepHypers, backward: LastBackward) -> None:
        if backward is LastBackward.DECLARED:
            block.update_early(hypers.for_early_update())
        elif block.spills:
            block.park_grads(norms=False)

    def scale_for_step(self, blocks: List[BlockRecord], slots: SlotTable, step: int,
                       hypers: Hypers) -> Optional[float]:
        return 1.0

    def drop_step(self) -> None:
        pass


class Speculation:
    """When `NormClipping` speculates, decided from the global norms alone, so every rank decides alike and a
    resumed run too (the results are the same bits either way: only the time differs). It speculates until a step
    clips (or skips, or its speculations were dropped); then it waits until the norm has stayed at or below
    `max_norm` for `patience` steps in a row, and `patience` doubles with every such failure (1, 2, 4, ... up to
    MAX_PATIENCE steps), so a run whose steps clip every time pays for one wasted speculation in a hundred."""

    MAX_PATIENCE = 64

    def __init__(self) -> None:
        self.patience = 0  # calm steps to see before speculating again
        self.calm = 0  # steps in a row whose norm was at or below max_norm
        self.failures = 0

    @property
    def now(self) -> bool:
        """Whether this step speculates."""
        return self.calm >= self.patience

    def after_step(self, speculated: bool, committed: bool, calm: bool) -> None:
        """A step ended: whether it speculated, whether its speculations were kept, whether its norm was finite and
        at or below max_norm. Only a norm that said no counts as a failure: a speculation dropped for another
        reason (a hyperparameter set or a weight written before step()) says nothing of the next norms."""
        self.calm = self.calm + 1 if calm else 0
        if speculated and not calm:
            self.failures += 1
            self.patience = min(2 ** (self.failures - 1), self.MAX_PATIENCE)


class NormClipping:
    """Clip to `max_norm` by the global L2 norm, as torch.nn.utils.clip_grad_norm_ (inf: measure only);
    `speculation`: updates start during the last backward (see the module docstring)."""

    checks_each_block = False

    def __init__(self, max_norm: float, worker: StepWorker, reduction: NormSource,
                 speculation: Optional[Speculation] = None) -> None:
        self.max_norm = max_norm
        self._worker = worker
        self._reduction = reduction
        self.speculation = speculation
        self.last_norm = math.nan
        self._speculated_with: Optional[Hypers] = None  # the hyperparameters this step's speculations read

    def _speculates(self, backward: LastBackward) -> bool:
        return backward is not LastBackward.NO and self.speculation is not None and self.speculation.now

    def updates_in(self, backward: LastBackward) -> bool:
        return self._speculates(backward)

    def watches(self, block: BlockRecord, backward: LastBackward) -> bool:
        return backward is not LastBackward.NO or block.spills

    def block_complete(self, block: BlockRecord, hypers: StepHypers, backward: LastBackward) -> None:
        """The update at once, into the shadows, when this step speculates; else the norms while the gradient is
        in memory (the last backward's are the step's; an earlier one's serve when the block gets no more), then
        the gradient parks."""
        if block.shadowed and self._speculates(backward):
            if self._speculated_with is None:
                self._speculated_with = hypers.read()
            block.speculate(self._speculated_with)
        else:
            block.park_grads(norms=True)

    def scale_for_step(self, blocks: List[BlockRecord], slots: SlotTable, step: int,
                       hypers: Hypers) -> Optional[float]:
        """The global norm and the scale; the speculations of this step committed when the scale is exactly 1 with
        the step's hyperparameters and no parameter of theirs was written since (on every rank), else forgotten."""
        self._worker.wait_all()  # the norms computed during the backward (and the speculative updates)
        total_norm, scale = self._reduction.global_norm(blocks, slots, self.max_norm)
        self.last_norm = total_norm
        finite = math.isfinite(total_norm)
        calm = finite and scale == 1.0
        if self.speculation is not None:  # one collective a step on every rank, whatever each speculated
            tried = self._speculated_with is not None
            keep_all = tried and calm and self._speculated_with == hypers
            mine = [keep_all and b.speculated and not b.written_since_speculation() for b in blocks]
            *keep, kept_all, none_tried = self._reduction.everywhere(mine + [keep_all, not tried])
            for block, kept in zip(blocks, keep):  # a block kept only where every rank speculated and keeps it
                if not block.speculated:
                    continue
                if kept:
                    block.commit_speculation()
                else:
                    block.forget_speculation(redone=finite)  # a finite norm: step() runs the update again now
            self.speculation.after_step(not none_tried, kept_all, calm)
        self._speculated_with = None
        if not finite:
            warnings.warn(f"offload: optimizer step {step + 1} skipped: the gradient norm is {total_norm}",
                          RuntimeWarning, stacklevel=2)
            return None
        return scale

    def drop_step(self) -> None:
        self._speculated_with = None  # the records forgot their speculations (zero_grads, end_step)


# ----- the global norm ------------------------------------------------------------------------------------
def clip_scale_of(total: float, max_norm: float) -> Tuple[float, float]:
    """(total, gradient scale) with torch's fp32 arithmetic: min(max_norm / (total + 1e-6), 1), the one formula
    of the clip coefficient."""
    coef = torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
    return total, float(coef)


def global_norm(blocks: List[BlockRecord], slots: SlotTable, max_norm: float) -> Tuple[float, float]:
    """(total L2 norm, gradient scale), the per-parameter norms reduced in torch's order (`model.parameters()`)
    in fp32, as clip_grad_norm_ does; a block's norms computed on the worker during backward are used."""
    per_param = [n for b in blocks for n in _norms_of(b)]
    by_id = slots.by_id
    per_param.sort(key=lambda pn: by_id[id(pn[0])].position)
    return clip_scale([n for _p, n in per_param], max_norm)


def clip_scale(norms: List[float], max_norm: float) -> Tuple[float, float]:
    """(total, gradient scale) from the per-parameter norms: their fp32 L2 norm, as clip_grad_norm_ takes it."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), 2)
    return clip_scale_of(float(total), max_norm)


def clip_in_place(blocks: List[BlockRecord], norm: Tuple[float, float], error_if_nonfinite: bool) -> float:
    """torch.nn.utils.clip_grad_norm_ over the held gradients, given their (total norm, scale); returns the
    total norm before clipping."""
    total_norm, coef = norm
    if error_if_nonfinite and not math.isfinite(total_norm):
        raise RuntimeError(f"The total norm of order 2.0 for gradients is non-finite ({total_norm}), so it "
                           "cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    if coef == 1.0:
        return total_norm  # x * 1.0 is x, bit for bit: the gradients, their norms and any speculation stand
    for block in blocks:
        block.forget_speculation()  # it stepped on the unclipped gradients
        block.norms = None  # norms computed during backward are of the unclipped gradients
        block.shard_sumsq = None
        for state in block.states:
            state.grads.scale_(coef)
    return total_norm


def _norms_of(record: BlockRecord) -> List[Tuple[nn.Parameter, float]]:
    if record.norms is not None:
        return record.norms
    return [n for state in record.states for n in state.grads.norms()]
