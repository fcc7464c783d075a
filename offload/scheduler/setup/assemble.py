"""`assemble`: one engine's training step put together, after the plan and the tiers (placement.py).

The order matters: the worker exists before the blocks' records (they hold it through their services) and
the modes are chosen once, here, from the policy and the placement; then the blocks are materialized, and
the phases made over them. A failure stops the worker again (the caller closes the tiers).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn

from offload._system import FreedHeapTrim, KeptHeap
from offload.distributed.data_parallel import DataParallel
from offload.planner.plan import Plan
from offload.policy import Activations, OffloadPolicy
from offload.scheduler.activations.meter import RootSavedTensors
from offload.scheduler.activations.spill import STAGING_SLOT_BYTES, STAGING_SLOTS, ActivationSpill, storage_keeper
from offload.scheduler.blocks.block import Block
from offload.scheduler.modes.selection import Modes, clipping_for, disk_traffic_for, reduction_for
from offload.scheduler.phases.backward import BackwardPhase
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.phases.forward import ForwardPhase
from offload.scheduler.phases.optimizer_view import EngineOptimizer
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.phases.pipeline import StepPipeline
from offload.scheduler.phases.step import StepPhase
from offload.scheduler.phases.sync import Synchronizer
from offload.scheduler.records.block_record import BlockRecord, BlockServices
from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.records.module_weights import ModuleWeights
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.records.pending_guard import PendingGuard
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.setup.initial_weights import InitialWeights
from offload.scheduler.setup.placement import materialize
from offload.scheduler.state.hypers import StepHypers
from offload.scheduler.weights.tiers import Tiers
from offload.scheduler.worker.counters import StepCounters
from offload.scheduler.worker.step_worker import StepWorker
from offload.tiers.host import StagingPool
from offload.trace import Tracer


def assemble(blocks: List[Block], module: nn.Module, policy: OffloadPolicy, plan: Plan, tiers: Tiers,
             tracer: Tracer, optimizer_groups: List[dict], initial: InitialWeights, num_threads: int,
             dp: Optional[DataParallel] = None) -> StepPipeline:
    """Materialize `blocks` into their tiers and build the step over them (see the module docstring)."""
    disk = disk_traffic_for(tiers.ring)
    worker = StepWorker(num_threads, observer=disk, tracer=tracer)
    try:
        if tiers.grad_pool is not None:
            tiers.grad_pool.bind(worker)  # an update running or queued will give bytes back
        reduction = reduction_for(dp, worker, num_threads)
        modes = Modes(disk, reduction, clipping_for(policy.max_grad_norm, worker, reduction, bool(plan.shadowed_blocks)))
        counters, order = StepCounters(), ForwardOrder(len(blocks))
        services = BlockServices(worker, tiers.streamer, tracer, counters, order, reduction,
                                 PendingGuard(tiers.streamer.read_through), NonFiniteSkips(), num_threads)
        group_of = {p: i for i, g in enumerate(optimizer_groups) for p in g["params"]}
        records = materialize(blocks, module, plan, policy, tiers, group_of, initial, services, dp)
        disk.serve(records)
        disk.drain()  # the start weights' writes on disk, every slot free
        if policy.activations is Activations.OFFLOAD:
            tiers.activations = _activation_spill(blocks, tiers)
        return _phases(blocks, records, module, policy, plan, tiers, optimizer_groups, services, modes)
    except BaseException:
        worker.close()
        raise


def _phases(blocks: List[Block], records: List[BlockRecord], module: nn.Module, policy: OffloadPolicy, plan: Plan,
            tiers: Tiers, optimizer_groups: List[dict], services: BlockServices, modes: Modes) -> StepPipeline:
    slots = SlotTable(records, module)
    tracker = BackwardTracker(policy.grad_accumulation_steps, plan.micro_batches_on_device)
    clock = PhaseClock()
    defaults = dict(lr=policy.lr, betas=policy.betas, eps=policy.eps, weight_decay=policy.weight_decay)
    optimizer = EngineOptimizer(optimizer_groups, defaults)
    hypers = StepHypers(optimizer.param_groups)
    optimizer.watch_groups_with(hypers)
    sync = Synchronizer(records, slots, services.worker, modes.disk, tiers.copies, tiers.streamer, services.guard)
    weights = ModuleWeights(records, sync)
    # the CPU computing under a host budget: its forward's tensors come from the heap, whose holes stay resident
    trims = policy.bounds_host_memory and policy.device.type == "cpu"
    forward = ForwardPhase(records, module, tracker, clock, services.order, tiers.streamer, modes,
                           _root_saved_tensors(blocks, tiers, plan.device_room),
                           FreedHeapTrim() if trims else KeptHeap())
    backward = BackwardPhase(slots, tracker, clock, forward, modes.clipping, hypers)
    step = StepPhase(records, slots, services, tracker, hypers, modes, backward, weights, sync, policy)
    optimizer.drive_with(step)
    tiers.streamer.read_through.serve(sync)  # streamed parameters read outside their forward open their block
    return StepPipeline(blocks, records, forward, backward, step, sync, weights, services, tiers, tracker, clock,
                        optimizer)


def _root_saved_tensors(blocks: List[Block], tiers: Tiers, device_room: Optional[int]) -> RootSavedTensors:
    """The root forward's saved-tensor hooks: the spill's (activations="offload") or the weight streamer's; their
    meter warns once when the activations need more than the `device_room` the plan leaves them."""
    spill, streamer = tiers.activations, tiers.streamer
    names = {b.index: b.name for b in blocks}  # for its error messages: the blocks streaming, a block's name

    def streamed() -> List[str]:
        return [b.name for b in blocks if streamer.streams(b.index)]

    def name(index: int) -> str:
        return names.get(index, str(index))

    if spill is not None:
        return RootSavedTensors(spill.pack, spill.unpack, lambda: True, storage_keeper(_kept_buffers(blocks, tiers)),
                                activations_offloaded=True, streamed_blocks=streamed, block_name=name,
                                device_room=device_room)
    return RootSavedTensors(streamer.pack, streamer.unpack, lambda: streamer.active,
                            storage_keeper(_kept_buffers(blocks, tiers)), streamed_blocks=streamed, block_name=name,
                            device_room=device_room)


def _kept_buffers(blocks: List[Block], tiers: Tiers) -> Callable[[], List[torch.Tensor]]:
    """The flat weight buffers that stay on the device (not a streamed block's: its buffer comes and goes, and the
    streamer's pack sees its tensors first)."""
    return lambda: [g.device_buffer for b in blocks if not tiers.streamer.streams(b.index)
                    for g in b.groups if g.device_buffer is not None]


def _activation_spill(blocks: List[Block], tiers: Tiers) -> ActivationSpill:
    """activations="offload": saved tensors to a file beside the swap file, through a staging area of its own
    (STAGING_SLOTS x STAGING_SLOT_BYTES, outside host_memory: docs/design.md [Note: activations off the
    device])."""
    assert tiers.swap is not None, "the policy allows activations='offload' on the nvme tier only"
    staging = StagingPool(STAGING_SLOTS * STAGING_SLOT_BYTES)
    return ActivationSpill(tiers.swap.directory, staging, STAGING_SLOT_BYTES, STAGING_SLOTS,
                           storage_keeper(_kept_buffers(blocks, tiers)),
                           tiers.streamer.pack, tiers.streamer.unpack)
