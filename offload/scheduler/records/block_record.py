"""`BlockRecord`: one block during training, with the work each phase does for it and the jobs the worker
runs for it.

The phases (phases/) only dispatch: for each block they ask its record to get ready for the forward, to take
a gradient, to schedule its update or to forget its gradients, and the record does it with its groups
(group.py: weight home, optimizer state, gradient home) and the engine's shared services (`BlockServices`, below). Its
update and the parking of its gradients are jobs (`UpdateJob`, `ParkJob`) made here on the training thread and
run here on the step worker (`run_update`, `run_park`); the reduction mode says which parameters step and the
record runs the loop. State and the logic that changes it live here together, as in FSDP2's `FSDPParamGroup`.
What a record holds per step (`updated_early`, `norms`, `shard_sumsq`) is reset by one `end_step()`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Protocol, Tuple

from torch import Tensor, nn

from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block, Residency
from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.records.grad_home import released_gradient
from offload.scheduler.records.group import GroupRecord, GroupState
from offload.scheduler.records.held_grad import HeldGrad
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.records.pending_guard import PendingGuard
from offload.scheduler.state.adamw import AdamHyper
from offload.scheduler.torch_internals import after_backward
from offload.scheduler.weights.streamer import WeightStreamer
from offload.scheduler.worker.counters import StepCounters
from offload.scheduler.worker.step_worker import StepWorker
from offload.trace import Tracer


class SlotRef(NamedTuple):
    """Where one trainable parameter lives: its block's record, its flat group's state, its slot index there,
    and its position in `module.parameters()` (the order torch reduces gradient norms in)."""

    block: "BlockRecord"
    state: GroupState
    index: int  # type: ignore[assignment]  # the slot's index in its group (shadows tuple.index, unused here)
    position: int
    param: nn.Parameter


@dataclass(frozen=True)
class GroupUpdate:
    """One flat group's part of a block update: ready slots, their hyperparameters, the weights' target."""

    group: GroupRecord
    ready: List[int]
    hypers: List[AdamHyper]
    out: Optional[Tensor]
    out_base: int = 0  # the group element `out[0]` is (sharded weights: the rank's part starts there)


@dataclass(frozen=True)
class UpdateJob:
    """A block's AdamW update, captured on the training thread when it is scheduled (which parameters have
    gradients, the hyperparameters, where new weights go: nothing that may change before it runs).
    `check_finite`: skip groups with inf/NaN gradients (no clipping); `step`: the optimizer step it belongs to
    (for the non-finite warning)."""

    record: "BlockRecord"
    parts: List[GroupUpdate]
    grad_scale: float
    check_finite: bool
    step: int
    speculative: bool = False  # its new state and weights go to the shadows; the gradients stay (see `speculate`)

    def __call__(self) -> None:
        self.record.run_update(self)


@dataclass(frozen=True)
class ParkJob:
    """A block's gradients are complete for this backward and wait for later: on the worker, their norms when
    `norms` (clipping: taken before they leave memory), then each group's gradient home parks them (a disk
    parking writes them to the swap file; the others keep them)."""

    record: "BlockRecord"
    norms: bool

    def __call__(self) -> None:
        self.record.run_park(self.norms)


class GradReduction(Protocol):
    """How a block's gradients become the ones it steps on: as they are (one process), or averaged across the
    data-parallel ranks into this rank's part (modes/reduction.py). The record runs its update's loop itself;
    the reduction answers what steps and how the new weights reach the other ranks."""

    zero_waits: bool  # zero_grad() waits for each block's pending job (it reads the gradients)

    def priority(self, forward_position: int) -> int:
        """The worker's priority of a block's job, from its position in the forward."""

    def park_priority(self) -> int:
        """The worker's priority of a block's gradient parking."""

    def runs_every_update(self, has_trainable: bool) -> bool:
        """Whether a block's update runs even when no parameter of it has a gradient here."""

    def take_back_average(self, block: BlockRecord) -> None:
        """A gradient of the block arrives after its step's gradients were averaged (`block.reduced`): the
        average is taken back into this rank's share of the sum."""

    def check_torch_reads(self, block: BlockRecord) -> None:
        """Torch code reads the block's held gradients (a clip): refused where they are not what it expects."""

    def ready_to_step(self, block: BlockRecord, job: UpdateJob) -> List[Optional[List[int]]]:
        """On the worker, before the update: per group of the job, the parameters to step (None: skip the group;
        a skip for non-finite gradients is counted here)."""

    def send_new_weights(self, state: GroupState, out: Optional[Tensor]) -> None:
        """On the worker, after a group stepped: its new weights to every rank (nothing in one process)."""

    def norms(self, block: BlockRecord, step: int) -> None:
        """On the worker: what clipping needs of the block's gradients."""


@dataclass(frozen=True)
class BlockServices:
    worker: StepWorker  # runs the updates (and, with clipping, the norms) in the background
    streamer: WeightStreamer  # the device budget's LRU of streamed blocks
    tracer: Tracer
    counters: StepCounters
    order: ForwardOrder  # the forward's block order: prefetch, update priority
    reduction: GradReduction  # local, or averaged across data-parallel ranks (modes/reduction.py)
    guard: PendingGuard  # resident parameters read through while their update is pending (step() returned)
    nonfinite: NonFiniteSkips  # blocks skipped for non-finite gradients (no clipping)
    num_threads: Optional[int]  # the CPU Adam's threads


class BlockRecord:
    """One block during training. Its residency is `block.residency`; its pending job (an update, a parking) is
    `job`, the future the worker gave it, until waited for."""

    def __init__(self, block: Block, groups: List[GroupRecord], streamed: bool, services: BlockServices) -> None:
        self.block = block
        self.groups = groups
        self.streamed = streamed
        self.services = services
        self.trainable_ids = [id(s.param) for s in block.slots if s.trainable]  # BackwardTracker's keys
        self.job: Optional[Future] = None  # its last job submitted to the worker, until `wait_for_update`
        self.needs_push = False  # updated weights not yet sent to the device
        self.updated_early = False  # updated during the last backward, before step()
        self.speculated = False  # a speculative update was scheduled, neither committed nor forgotten yet
        self.norms: Optional[List[Tuple[nn.Parameter, float]]] = None  # gradient norms computed for clipping
        self.shard_sumsq: Optional[float] = None  # data-parallel: sum of squares of this rank's averaged part
        self.lost_write: Optional[str] = None  # a parameter written while its update ran (overlap_step)
        # the optimizer state of each flat group that has trainable parameters
        self.states: List[GroupState] = [g.state for g in groups if g.state is not None]
        # whether an update writes somewhere the device must then be fed from
        self.pushes = any(g.home.pushes for g in groups if g.state is not None)
        # whether its gradients go to disk when they must wait (docs/design.md [Note: gradients on disk])
        self.spills = any(state.grads.parks for state in self.states)
        # whether its update may run speculatively: every state has a shadow (the plan gave it room)
        self.shadowed = bool(self.states) and all(state.store.shadowed for state in self.states)
        for state in self.states:
            state.grads.owner = self  # told of torch's ops on its held gradients (held_grad.py)

    @property
    def partitioned(self) -> bool:
        """Whether its weights are sharded across the data-parallel ranks (each keeps a part, gathered for use)."""
        return any(g.home.partitioned for g in self.groups)

    @property
    def reduced(self) -> bool:
        """Data-parallel: this step's gradients of the block were averaged across the ranks already."""
        return any(state.reduced_ready is not None for state in self.states)

    # ----- its update -----------------------------------------------------------------------------------
    def is_settled(self) -> bool:
        """No update of the block is pending: its weights at home are final."""
        return self.job is None or self.job.done()

    def wait_for_update(self, counted: bool) -> None:
        """Wait for the block's pending job (one that finished with an error raises here, and once any job of the
        worker failed every wait does: [Note: a failed update poisons the engine]). `counted`: the wait is the
        forward's, reported as waiting time. Nothing submitted since the last wait and nothing failed: no wait."""
        worker = self.services.worker
        if self.job is None and worker.failure is None:
            return
        blocked = worker.wait(self.block.index, self.block.name)  # an error of the job raises (`job` stays)
        self.job = None
        if counted:
            self.services.counters.wait_seconds += blocked

    def push(self) -> None:
        """Send the block's updated weights from their homes to the device (a released block fetches them
        at its next use anyway)."""
        resident = self.block.residency is Residency.RESIDENT
        for group in self.groups:
            if group.state is not None:
                group.home.push(resident)
        self.needs_push = False

    def settle(self, counted: bool = False) -> None:
        """Its pending update done and its new weights in the parameters, which are then plain again (no
        longer guarded). `counted`: the wait is the forward's (reported as waiting time). A speculation that wrote
        the parameters in place is dropped first: whatever reads them before step() sees the weights torch would."""
        self.show_live_weights()
        self.wait_for_update(counted)
        if self.needs_push:
            self.push()
        self.services.guard.release(self.block)

    def guard_while_pending(self) -> None:
        """step() returns early: a resident block whose update is pending reads through until it settles
        (records/pending_guard.py); a streamed one reads through outside its forward anyway."""
        if not self.streamed and (not self.is_settled() or self.needs_push):
            self.services.guard.guard(self.block)

    def schedule_update(self, hypers: Tuple[AdamHyper, ...], grad_scale: float, check_finite: bool,
                        speculative: bool = False) -> None:
        """Queue the block's AdamW update on the worker (nothing when no parameter of it has a gradient).
        `check_finite`: skip groups whose gradients hold inf/NaN (no global norm decides). `speculative`: into
        the shadows (`speculate`)."""
        self.keep_writes()
        self._submit_update(hypers, grad_scale, check_finite, speculative)

    def _submit_update(self, hypers: Tuple[AdamHyper, ...], grad_scale: float, check_finite: bool,
                       speculative: bool) -> None:
        """`schedule_update` once the writes through the parameters are kept."""
        parts = [GroupUpdate(g, g.state.grads.ready_indices(), g.state.hypers_of(hypers),
                             g.home.shadow_target() if speculative else g.home.update_target(), g.home.target_base)
                 for g in self.groups if g.state is not None]
        services = self.services
        if not any(part.ready for part in parts) and not services.reduction.runs_every_update(bool(parts)):
            return
        for part in parts:
            if part.ready:
                assert part.group.state is not None
                part.group.state.store.announce()  # its reads (disk) start now, ahead of the worker reaching it
        if self.streamed:
            services.streamer.invalidate(self.block)  # disk reads a prefetch started would be stale
        job = UpdateJob(self, parts, grad_scale, check_finite, services.counters.steps, speculative)
        self.job = services.worker.submit(self.block.index, job, self.priority())
        services.counters.block_updates += 1
        services.order.known = True
        if self.pushes and not speculative:
            self.needs_push = True

    def update_early(self, hypers: Tuple[AdamHyper, ...]) -> None:
        """The declared last backward completed the block's gradients (no clipping): update it now."""
        self.updated_early = True
        self.services.counters.early_block_updates += 1
        self.schedule_update(hypers, 1.0, check_finite=True)

    def speculate(self, hypers: Tuple[AdamHyper, ...]) -> None:
        """The last backward completed the block's gradients, and clipping waits for the global norm: the update
        runs now anyway, on the speculation that the step will not clip (scale 1), writing its state and weights
        into the shadows, which nothing reads; its gradients stay as clipping keeps them. At step() it is
        committed (`commit_speculation`: the shadows become live) when the scale is 1, or forgotten
        (`forget_speculation`) and run again from the untouched state. See docs/design.md [Note: speculative
        clipping]."""
        self.keep_writes()  # before the flag: a write kept now forgets no speculation (the job below reads it)
        self.speculated = True
        self.services.counters.speculative_updates += 1
        if self.speculates_in_params:  # before the job writes them: any read from now on drops the speculation
            self.services.guard.guard(self.block)
        self._submit_update(hypers, 1.0, check_finite=False, speculative=True)

    @property
    def speculates_in_params(self) -> bool:
        """Whether its speculative update writes the weights its parameters show (put back when dropped)."""
        return any(group.home.speculates_in_params for group in self.groups if group.state is not None)

    def show_live_weights(self) -> None:
        """Before anything but step() reads its weights: a speculation that wrote them in place is dropped."""
        if self.speculated and self.speculates_in_params:
            self.forget_speculation()

    def commit_speculation(self) -> None:
        """The step scales by 1: the speculative update's state and weights become the block's (a switch of the
        swap file's copies on disk, the weights copied in memory), and the block counts as updated early."""
        self.wait_for_update(counted=False)
        if not self.speculated:
            return
        for group in self.groups:
            if group.state is not None and group.state.speculated:
                group.commit_shadow()
        self.speculated = False
        self.updated_early = True
        self.forget_averages()
        self.services.counters.committed_speculations += 1
        if self.pushes:
            self.needs_push = True
        self.services.guard.release(self.block)  # written in place: the new weights are the block's now

    def forget_speculation(self, redone: bool = False) -> None:
        """The speculative update's result is dropped (the step clips or skips; a gradient, a weight or a
        hyperparameter changed since; zero_grad): nothing it wrote is live, so the block is as before it, and its
        update runs at step() as without speculation. `redone`: step() schedules that update now, on the same
        gradients, so it rewrites every weight the speculation wrote in place before anything reads them (the
        step waits for it, or guards the block until it lands): they need not be put back first."""
        if not self.speculated:
            return
        self.wait_for_update(counted=False)
        for group in self.groups:
            if group.state is not None:
                group.state.forget_shadow()
                if not (redone and group.home.speculates_in_params):
                    group.home.forget_shadow(group.state.store)
        self.speculated = False
        self.services.counters.forgotten_speculations += 1
        self.services.guard.release(self.block)  # weights written in place are the live ones again

    def written_since_speculation(self) -> bool:
        """Whether a parameter was written through since the speculative update read the master weights (its
        result would then overwrite the write)."""
        return self.speculated and any(group.edited_names() for group in self.groups)

    def park_grads(self, norms: bool) -> None:
        """The block's gradients are complete for this backward and wait for a later use: queue, on the worker,
        their norms (`norms`: clipping) and their parking (to disk, for a disk parking)."""
        self.job = self.services.worker.submit(self.block.index, ParkJob(self, norms),
                                               self.services.reduction.park_priority())

    # ----- on the worker ------------------------------------------------------------------------------
    def run_update(self, job: UpdateJob) -> None:
        """AdamW over each group of the block: the reduction says which parameters of each group step (None:
        the group is skipped, its announced reads dropped), the groups step, the reduction shares the new
        weights; a write through a parameter meanwhile is noted."""
        services = self.services
        start = time.perf_counter()
        speculative = job.speculative
        with services.tracer.span("update", self.block.name):
            if speculative:
                services.reduction.norms(self, job.step)  # the global norm's share, as clipping takes it
            readies = services.reduction.ready_to_step(self, job)
            for part, ready in zip(job.parts, readies):
                state = part.group.state
                assert state is not None
                resting = None
                if ready:
                    part.group.home.release_source()  # the last upload of `out` has read it
                    resting = state.update(ready, part.hypers, job.grad_scale, part.out, services.num_threads,
                                           part.out_base, speculative)
                    if not speculative:
                        self.lost_write = part.group.writes_during_update() or self.lost_write
                    part.group.home.share_update(services.reduction, state, part.out)
                elif ready is None:
                    state.store.discard()  # skipped: its announced reads would otherwise hold ring slots
                if speculative and resting is not None:
                    state.grads.rest(state.store, resting)  # in the moments the step wrote: nothing kept or written
                elif speculative:
                    state.grads.park()  # kept for the step, as clipping keeps them (to disk, when they spill)
                else:
                    state.grads.release()  # the gradient window (nvme) gets its bytes back
            if not speculative:
                self.forget_averages()  # (a speculation's stay, for a step that runs it again)
        services.counters.update_seconds += time.perf_counter() - start

    def run_park(self, norms: bool) -> None:
        """Its norms (clipping), then each group's gradient parks."""
        if norms:
            self.services.reduction.norms(self, self.services.counters.steps)
        for state in self.states:
            state.grads.park()

    def priority(self) -> int:
        """The worker runs the block needed soonest by the next forward first (data-parallel: in submission
        order, the same on every rank)."""
        return self.services.reduction.priority(self.services.order.priority(self.block.index))

    # ----- its gradients ------------------------------------------------------------------------------
    def receive_grad(self, ref: SlotRef, param: nn.Parameter) -> None:
        """A gradient of one of its parameters is complete for this backward (the autograd hook)."""
        if self.updated_early:
            raise OffloadError(
                f"parameter of block {self.block.name!r} received a gradient after the block was updated early; "
                "the autograd graph changed between backward passes in a way the engine cannot see ahead of time "
                "(e.g. reentrant checkpointing of a module used twice); leave grad_accumulation_steps unset")
        self.offload_grad(ref, param)

    def offload_grad(self, ref: SlotRef, param: nn.Parameter) -> None:
        """Move `param.grad` into its group's gradient home and leave the stand-in there ([Note: where a
        gradient is after backward]): a plain tensor means `.grad` was None before autograd wrote it (cleared
        since the engine took the last one), a HeldGrad with `pending` that autograd accumulated into it."""
        self.before_grad_arrives()
        grad, grads = param.grad, ref.state.grads
        if isinstance(grad, HeldGrad):
            pending = grad.pop_pending()
            if pending is None:
                return
            grads.accumulate(ref.index, pending)
        else:
            assert grad is not None
            grads.accumulate(ref.index, grad, fresh=True)
        param.grad = grads.held_for(ref.index)

    def before_grad_arrives(self) -> None:
        """See `GradOwner.before_grad_arrives`."""
        self.wait_for_update(counted=False)  # the last update (or parking) may still read the gradients
        self.forget_speculation()  # it stepped on a gradient without this one
        if self.reduced:  # data-parallel: averaged already (a spilled gradient parks averaged; a clip)
            self.services.reduction.take_back_average(self)
        self.norms = None  # of a sum this gradient changes

    def take_leftover_grads(self, refs: List[SlotRef]) -> None:
        """Before the step reads the gradients (`refs`: its trainable parameters): take those still in `.grad`
        (fewer backward calls than declared, or a `.grad` the user set), and forget those cleared outside the
        engine (model.zero_grad())."""
        for ref in refs:
            param = ref.param
            grad, grads = param.grad, ref.state.grads
            if grad is not None and not (isinstance(grad, HeldGrad) and grad.pending is None):
                self.offload_grad(ref, param)
            elif grad is not None and ref.index in grads.lost and not self.updated_early:
                # held since an update of an earlier step gave its bytes back (nvme gradient window)
                raise released_gradient(ref.state.group.trainable_slots[ref.index].name)
            elif grad is None and self.updated_early and (grads.has_grad[ref.index] or ref.index in grads.lost):
                # cleared outside the engine (model.zero_grad()) after its update (which the nvme gradient window
                # may have let give the gradient back: `lost`): torch would not step the parameter, the update did
                raise zeroed_after_early_update(self.block.name)
            elif grad is None and grads.has_grad[ref.index]:
                self.forget_speculation()  # it stepped on the gradient cleared since
                grads.forget(ref.index)
                self.norms = None  # they counted it; torch's clip_grad_norm_ leaves a parameter without .grad out

    def check_grads_for_torch(self) -> None:
        """Torch code (clip_grad_norm_, clip_grad_value_) reads or changes the block's held gradients: refused
        where torch would not see what it expects."""
        if self.updated_early:
            raise OffloadError(
                f"torch clips the gradients of block {self.block.name!r} after it was updated during the last "
                "backward (grad_accumulation_steps declared, no max_grad_norm): the update already used them. Pass "
                "max_grad_norm= to offload.wrap (it clips before any update), or leave grad_accumulation_steps "
                "unset")
        self.services.reduction.check_torch_reads(self)
        # the job the backward queued (its norms, its parking, a speculative update) reads the gradients: it is
        # done before torch's op reads or changes them, so the norms it keeps are never of the gradients before
        # the op (a clip right after the backward raced it)
        self.wait_for_update(counted=False)

    def grads_changed(self) -> None:
        self.forget_speculation()  # it stepped on the gradients before the op (a clip that scaled them)
        self.norms = None  # of gradients a torch op (a clip) changed since

    def zero_grads(self, set_to_none: bool) -> None:
        """The block's part of zero_grad(): wait for its update where it still reads the gradients, then drop
        them (or zero them), and the step's norms and averages with them."""
        states = self.states
        self.forget_speculation()
        if self.services.reduction.zero_waits or any(s.grads.must_wait_to_zero(set_to_none) for s in states):
            self.wait_for_update(counted=False)
        self.forget_averages()
        for state in states:
            state.grads.zero(set_to_none)
        self.end_step()

    def forget_averages(self) -> None:
        """Data-parallel: the averaged gradients were consumed by the update, or dropped by zero_grad."""
        for state in self.states:
            state.reduced_ready = None

    def end_step(self) -> None:
        """Forget the step in progress (after `step()`, or when a checkpoint replaces the state)."""
        self.forget_speculation()
        self.updated_early = False
        self.norms = None
        self.shard_sumsq = None

    # ----- its weights --------------------------------------------------------------------------------
    def enter_forward(self, following: Optional["BlockRecord"], in_backward: bool) -> None:
        """Get ready for its module's forward: parameters still in the engine's buffers, a write through them
        kept (before the wait: a write made while the update was pending is refused), its pending update waited
        for and its new weights pushed (before a fetch, which reads the home anyway), then, when it streams, made
        resident with `following` (the next block of the recorded forward order) prefetched."""
        self.refuse_moved_parameters()
        self.keep_writes()
        self.settle(counted=True)
        self.make_resident(following, in_backward)

    def refuse_moved_parameters(self) -> None:
        if self.block.residency is Residency.RESIDENT and not all(g.params_in_place() for g in self.groups):
            raise OffloadError(
                f"the parameters of block {self.block.name!r} no longer point into the engine's buffers: the model "
                "was moved or converted after offload.wrap() (model.to(), .double(), .half(), .cuda()), so "
                "training would not reach them; convert the model first, then wrap it (engine.close() first)")

    def make_resident(self, following: Optional["BlockRecord"], in_backward: bool) -> None:
        """A streamed block made resident and pinned for its module's forward (its parameters plain for it),
        the one after it prefetched when its weights are final; in a backward's recompute it stays pinned
        until that backward ends ([Note: weight streaming])."""
        if not self.streamed:
            return
        streamer = self.services.streamer
        settled = following is None or following.ready_to_prefetch()
        streamer.ensure(self.block, pin=True, prefetch=None if following is None else following.block,
                        settled=settled)
        if in_backward:
            streamer.pin(self.block.index)
            after_backward(self.unpin)
        streamer.enter_forward(self.block)

    def ready_to_prefetch(self) -> bool:
        """Whether its weights at home are final, so the block before it in the forward may fetch them ahead; a
        home whose fetch gathers (sharded weights) waits for the update first, so the gather ahead brings the new
        weights and the push after the update has nothing left to gather (one gather a use)."""
        for group in self.groups:
            group.home.before_prefetch(self)
        return self.is_settled()

    def leave_forward(self) -> None:
        """The module is done with the block (also after an exception); a block that does not stream was never
        made resident for it (`make_resident`), so there is nothing to let go."""
        if self.streamed:
            self.services.streamer.leave_forward(self.block)
            self.unpin()

    def unpin(self) -> None:
        self.services.streamer.unpin(self.block.index)

    def keep_writes(self) -> None:
        """Weights written in place through the parameters since the engine last looked become the master
        weights, moments kept, as torch.optim would train on from them; the host mirror (or the swap file)
        follows. Run before each use of the block and before its update reads the master. A released
        streamed block's parameters read through (weights/read_through.py): a write to one opened the block
        and was kept when it closed. See docs/design.md [Note: weights written after wrap()]."""
        if self.lost_write is not None:
            name, self.lost_write = self.lost_write, None
            raise written_while_pending(name, "the update overwrote the write")
        if self.block.residency is Residency.RELEASED:
            return
        for group in self.groups:
            edited = group.edited_names()
            if not edited:
                continue
            self.forget_speculation()  # it stepped from the weights before the write
            if not self.is_settled() or self.needs_push:
                raise written_while_pending(edited[0], "the update would overwrite it")
            group.keep_writes()

    def keep_writes_before_release(self) -> None:
        """A resident streamed block about to be released: what was written through its parameters since the
        engine last looked is kept (`GroupRecord.keep_writes`), unless an update was scheduled since (its
        weights would overwrite the write, or the write the update's): then the next use of the block
        raises (`lost_write`)."""
        for group in self.groups:
            edited = group.edited_names()
            if not edited:
                continue
            self.forget_speculation()  # it stepped from the weights before the write
            if self.needs_push:
                self.lost_write = self.lost_write or edited[0]
                group.mark_seen()
            else:
                group.keep_writes()


def written_while_pending(name: str, consequence: str) -> OffloadError:
    return OffloadError(
        f"parameter {name!r} was written while its block's update was still pending (overlap_step=True: step() "
        f"returns before the updates run), and {consequence}; call engine.synchronize() after step() before "
        "writing weights, or leave overlap_step off")


def zeroed_after_early_update(block_name: str) -> OffloadError:
    return OffloadError(
        f"zero_grad() between the last backward and step(): with grad_accumulation_steps declared, blocks "
        f"(first: {block_name!r}) were already updated during that backward; call zero_grad() after step(), "
        "or leave grad_accumulation_steps unset")
