"""Applying a plan: open the tiers it needs and give every block its runtime record.

`plan_and_open` plans and makes the device budget, the copy context and, on the nvme tier, the swap file, the staging
pool and the ring through which disk-resident state flows. `materialize` copies each parameter into its
block's flat device buffer, re-points `.data`, and builds each flat group's weight home and, for groups
that train, its state store (memory or disk) and gradient home (records/).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from typing import AbstractSet, Any, Callable, Dict, List, Optional, cast

import torch
from torch import nn

from offload._system import return_freed_memory, unmap_large_allocations
from offload.distributed.agreement import refuse_differences
from offload.distributed.data_parallel import DataParallel, Shard
from offload.distributed.quantized_gather import Int8Blocks
from offload.errors import OffloadConfigError
from offload.optim.functional import resting_supported
from offload.planner.place import make_plan, shards_weights
from offload.planner.plan import GradFlow, Location, Plan, grads_may_rest, human_bytes
from offload.planner.ring import RingSize, ring_size_for
from offload.policy import DiskWeights, OffloadPolicy, ShardWeights, Tier
from offload.scheduler.blocks.block import Block, FlatGroup
from offload.scheduler.records.block_record import BlockRecord, BlockServices
from offload.scheduler.records.grad_home import DiskParking, GradHome
from offload.scheduler.records.group import GroupRecord, GroupState
from offload.scheduler.ring.disk_ring import DiskRing
from offload.scheduler.setup.initial_weights import InitialWeights
from offload.scheduler.state.disk_store import DiskStore
from offload.scheduler.state.sharded_store import ShardedStore, ShardGroup
from offload.scheduler.state.state_store import MemoryStore, StateStore
from offload.scheduler.torch_internals import own_buffers
from offload.scheduler.weights.partitioned_home import DiskPart, HostPart, PartitionedHome, PartKeeper, WeightPart
from offload.scheduler.weights.streamer import WeightStreamer
from offload.scheduler.weights.tiers import Tiers
from offload.scheduler.weights.weight_home import DeviceHome, DiskHome, HostMirror, MasterHome, WeightHome
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier
from offload.tiers.disk import SwapStore
from offload.tiers.grad_window import GradPool
from offload.tiers.host import StagingPool
from offload.tiers.swap_layout import (
    GroupShape,
    WeightRecord,
    plan_grad_layout,
    plan_shadow_layout,
    plan_swap_layout,
    plan_weight_layout,
    round_up,
)
from offload.trace import Tracer


def plan_and_open(blocks: List[Block], policy: OffloadPolicy, tracer: Tracer,
                  dp: Optional[DataParallel] = None) -> "tuple[Plan, Tiers]":
    """The placement plan of `blocks` under the policy's budgets, and the tiers it needs, opened. In
    data-parallel mode the swap file holds this rank's parts only, in its own directory under nvme_path."""
    disk_room = _disk_room(policy, dp)
    sharded = _shards_weights(blocks, policy, dp, disk_room)
    numel_of = None if dp is None else (
        lambda group: dp.state_shard(group.trainable_numel, group.numel, sharded).numel)
    shapes = [g.shape(b.name) for b in blocks for g in b.groups]
    records, swap_size = plan_swap_layout(shapes, numel_of, policy.moments) if policy.tier is Tier.NVME else ({}, 0)
    largest_record = _largest_part(blocks, dp, sharded)
    ring = ring_size_for(largest_record, policy.moments) if records else None
    plan = dataclasses.replace(_make_plan(blocks, policy, ring, dp, sharded, disk_room), precision=_precision(policy))
    if policy.zero_quantized_weights:
        if dp is not None and sharded:
            codes = Int8Blocks()
            dp.quantize_weight_gathers(codes)
            plan = dataclasses.replace(plan, weight_gathers=f"for compute as {codes.describe()} (zero_quantized_weights): about "
                                       f"{(1 + 4 / codes.block) / policy.dtype.itemsize:.2f}x the bytes of "
                                       f"{str(policy.dtype).replace('torch.', '')} weights; reads of them exact")
        else:
            warnings.warn("offload: zero_quantized_weights=True has no effect here: the weights are not sharded "
                          "(one process, tier='gpu', or whole weights that fit host_memory with shard_weights=None; "
                          "shard_weights=True shards them)", RuntimeWarning, stacklevel=4)
    if policy.zero_hpz_partition_size > 1:
        size = policy.zero_hpz_partition_size
        if dp is not None and sharded:
            if dp.world % size:
                raise OffloadConfigError(f"zero_hpz_partition_size={size} must divide the {dp.world} ranks: use the "
                                         f"ranks of one machine ({dp.local_world})")
            kept = sum(-(-g.numel // size) * g.dtype.itemsize for b in blocks for g in b.groups)
            host = plan.bytes_on(Location.HOST)
            if policy.host_memory is not None and host + kept > policy.host_memory:  # refused, never over budget
                raise OffloadConfigError(
                    f"zero_hpz_partition_size={size} keeps a 1/{size} part of every block in host memory between its "
                    f"forward and its update ({human_bytes(kept)} a rank), and the plan already holds "
                    f"{human_bytes(host)} of host_memory={human_bytes(policy.host_memory)}: raise host_memory to at "
                    f"least {human_bytes(host + kept)}, or use zero_hpz_partition_size=1")
            dp.make_secondary_partition(size)
            where = ("within each machine" if dp.local_world % size == 0 else
                     f"in groups of {size} ranks, which span machines ({dp.local_world} ranks each)")
            plan = dataclasses.replace(plan, secondary_partition=f"{size} ranks {where}; up to "
                                       f"{human_bytes(kept)} per rank of host memory besides the host total above "
                                       "(within host_memory), from a block's forward to its update "
                                       "(zero_hpz_partition_size)")
        else:
            warnings.warn("offload: zero_hpz_partition_size has no effect here: the weights are not sharded",
                          RuntimeWarning, stacklevel=4)
    if policy.zero_quantized_gradients:
        if dp is not None:
            codes = Int8Blocks()
            dp.quantize_gradient_reduction(codes)
            levels = "within each machine, then across machines" if dp.reduces_in_two_levels else "one level"
            plan = dataclasses.replace(plan, grad_reduction=f"as {codes.describe()} through all-to-alls, {levels} "
                                                          "(zero_quantized_gradients)")
        else:
            warnings.warn("offload: zero_quantized_gradients=True has no effect in one process: there is no "
                          "gradient to reduce across ranks", RuntimeWarning, stacklevel=4)
    if policy.max_grad_norm is not None and not policy.speculates:
        why = ("speculative_clipping=False" if policy.speculative_clipping is False else
               "the cpu tier computing on the CPU: updates during the backward would share its cores; "
               "speculative_clipping=True forces it")
        plan = dataclasses.replace(plan, speculation=f"off ({why}): every update waits for the global norm, after "
                                                    "the backward")
    if dp is not None:
        _refuse_plans_that_differ(plan, dp)
    if dp is not None and not sharded and plan.disk_weight_blocks:
        raise OffloadConfigError(
            f"shard_weights=False keeps every block's weights in each rank's host memory, but host_memory="
            f"{policy.host_memory} leaves {len(plan.disk_weight_blocks)} blocks' weights on disk: raise host_memory "
            "(per rank), or let each rank keep a part of the weights (shard_weights=True, or None)")
    if policy.bounds_host_memory or plan.shard_world > 1:
        # before materializing: its temporaries too; sharded weights: the gathered blocks' buffers come and go every
        # use, and carved from the heap their freed chunks would stay resident
        unmap_large_allocations()
    device, copies = DeviceTier(policy.device, _device_weight_budget(plan, blocks)), CopyContext(policy.device)
    tiers = Tiers(device, copies, WeightStreamer(device, copies))
    if plan.grad_window_bytes is not None:
        tiers.grad_pool = GradPool(plan.grad_window_bytes)
    if policy.tier is Tier.NVME:
        assert policy.nvme_path is not None
        if not records:  # before any file exists
            raise OffloadConfigError(
                "tier='nvme' keeps the optimizer state on disk, but no parameter of this model requires grad: there "
                "is no state to keep; use tier='cpu' (weights still stream under device_memory), or unfreeze the "
                "parameters to train before offload.wrap()")
        part_of = None if not sharded else (lambda group: dp.weight_part(group.numel).numel)  # type: ignore[union-attr]
        copied = set(plan.disk_weight_blocks) - set(plan.master_weight_blocks)  # the others read their master
        weights, swap_size = plan_weight_layout([s for s in shapes if s.block in copied], swap_size, part_of)
        grads: Dict[str, WeightRecord] = {}
        if plan.grads_on_disk:
            padded = None if dp is None else _grad_record_numel(dp, sharded, policy.max_grad_norm is not None)
            parked = {b.name for b in plan.blocks if b.grad_parks}
            grads, swap_size = plan_grad_layout([s for s in shapes if s.block in parked], swap_size, padded)
        shadowed = set(plan.shadowed_blocks)
        shadows, swap_size = plan_shadow_layout([s.key for s in shapes if s.block in shadowed and s.key in records],
                                                records, weights, swap_size)
        directory = policy.nvme_path
        if dp is not None:
            directory = os.path.join(directory, f"rank-{dp.rank}")
            os.makedirs(directory, exist_ok=True)
        tiers.swap = SwapStore(directory, records, swap_size, weights, grads, shadows)
        try:
            tiers.staging = StagingPool(max(round_up(plan.ring_bytes, 4096), 4096))
            assert plan.ring_slots is not None, "an nvme plan with state records sizes its ring's slots"
            tiers.ring = DiskRing(tiers.swap, tiers.staging, plan.ring_bytes, plan.ring_slots.depth, tracer=tracer,
                                  moments=policy.moments)
            assert tiers.ring.chunk_numel == plan.ring_slots.chunk_numel, "the ring is the one the plan printed"
        except BaseException:
            tiers.close()  # nothing of a failed wrap() stays on disk
            raise
    return plan, tiers


def _precision(policy: OffloadPolicy) -> str:
    """The plan's words for the dtypes ([Note: compute dtypes]): the compute dtype, and what the update keeps."""
    compute = str(policy.dtype).replace("torch.", "")
    mixed = "" if policy.dtype is torch.float32 else " (mixed precision: fp32 parameters cast, norms stay fp32)"
    return f"compute {compute}{mixed}; master weights fp32, Adam moments {policy.moments.value}"


def _device_weight_budget(plan: Plan, blocks: List[Block]) -> Optional[int]:
    """The device budget the streamer keeps gathered weights within: the plan's; sharded weights without a device
    budget keep two of the largest blocks (the one computing and the next), so a gathered block is freed after
    its use, not kept whole ([Note: sharded weights])."""
    if plan.shard_world > 1 and plan.device_weight_budget is None:
        return 2 * max(block.weight_bytes for block in blocks)
    return plan.device_weight_budget


def _disk_room(policy: OffloadPolicy, dp: Optional[DataParallel]) -> Optional[int]:
    """Free disk the speculation's shadows and the choice of `disk_weights` (auto) may plan on: the swap directory's
    free space, shared among the ranks of a node (they write to the same disk, as a rule), the least of any rank
    (every rank must make the same plan). None: nothing on disk to plan."""
    plans_disk = policy.speculates or policy.disk_weights is DiskWeights.AUTO
    if not (plans_disk and policy.tier is Tier.NVME and policy.nvme_path):
        return None
    free = shutil.disk_usage(policy.nvme_path).free
    if dp is None:
        return free
    return min(cast(int, room) for room in dp.all_gather_object(free // dp.local_world))


def _make_plan(blocks: List[Block], policy: OffloadPolicy, ring: Optional[RingSize], dp: Optional[DataParallel],
               sharded: bool, disk_room: Optional[int]) -> Plan:
    """The plan of one rank: its part of the state (and of the weights, `sharded`) among the data-parallel ranks."""
    world = 1 if dp is None else dp.world
    flow = GradFlow(policy.grad_accumulation_steps, policy.max_grad_norm is not None, policy.dtype.itemsize,
                    _grads_may_rest(policy, dp))
    speculate = policy.speculates
    return make_plan([b.spec(policy.tier, policy.moments, world, sharded) for b in blocks], policy.tier,
                     policy.device_memory, policy.host_memory, ring, flow, world if sharded else 1, speculate,
                     disk_room, resident_weight_shadows=policy.device.type == "cpu" and dp is not None,
                     disk_weights=policy.disk_weights, activation_room=policy.activation_memory or 0)


def _grads_may_rest(policy: OffloadPolicy, dp: Optional[DataParallel]) -> bool:
    return grads_may_rest(policy.tier, policy.speculates, policy.moments, 1 if dp is None else dp.world,
                          policy.dtype)


def _shards_weights(blocks: List[Block], policy: OffloadPolicy, dp: Optional[DataParallel],
                    disk_room: Optional[int]) -> bool:
    """Whether each rank keeps a part of the weights: asked for, or (unset) when the whole weights would not fit a
    rank's host memory (the plan with them whole puts some on disk, or fails). One process: never."""
    if dp is None or policy.tier is Tier.GPU or policy.shard_weights is ShardWeights.OFF:
        return False
    if policy.shard_weights is ShardWeights.ON:
        return True
    ring = ring_size_for(_largest_part(blocks, dp, False), policy.moments) if policy.tier is Tier.NVME else None
    return shards_weights(lambda: _make_plan(blocks, policy, ring, dp, False, disk_room))


def _largest_part(blocks: List[Block], dp: Optional[DataParallel], sharded: bool) -> int:
    """The largest state record a rank may hold, which sizes the staging ring: rank 0's parts (the largest), so
    that every rank makes the same plan (a rank's own records may be smaller; its placement, and so the order of
    its gathers, must not differ)."""
    def part(group: FlatGroup) -> int:
        if dp is None:
            return group.trainable_numel
        shard = dp.state_shard(group.trainable_numel, group.numel, sharded)
        return Shard(shard.n, shard.size, 0, shard.world).numel
    return max((part(g) for b in blocks for g in b.groups if g.trainable_numel), default=0)


def _refuse_plans_that_differ(plan: Plan, dp: DataParallel) -> None:
    """Every rank must place the same blocks the same way: which blocks stream, which weights are on disk, and
    whether weights are sharded decide the order of the training thread's collectives (the gathers)."""
    refuse_differences(dp, {"sharded over": str(plan.shard_world), "streamed blocks": str(plan.streamed_blocks),
                            "blocks on disk": str(plan.disk_weight_blocks), "device budget": str(plan.device_budget),
                            "speculating blocks": str(plan.shadowed_blocks),
                            "host budget": str(plan.host_budget)}, "placement plans")


def materialize(blocks: List[Block], module: nn.Module, plan: Plan, policy: OffloadPolicy, tiers: Tiers,
                optimizer_group_of: Dict[nn.Parameter, int], initial: InitialWeights, services: BlockServices,
                dp: Optional[DataParallel] = None) -> List[BlockRecord]:
    """Give every block its flat device buffers, filled from `initial` (the parameters, a checkpoint, or an
    initializer: one block at a time, so a model built on the meta device is never whole in memory), and its
    runtime record (returned, by block index); move the module's buffers to the device. `optimizer_group_of`: each
    trainable parameter's optimizer group. `dp`: every rank starts from rank 0's weights, and keeps the
    optimizer state of its own part of each group."""
    streamed, on_disk = set(plan.streamed_blocks), set(plan.disk_weight_blocks)
    from_master = set(plan.master_weight_blocks)  # weights on disk read from the fp32 master in the state record
    shadowed = set(plan.shadowed_blocks)  # speculative clipping: their state and weights get shadows
    parked_grads = {b.name for b in plan.blocks if b.grad_parks}  # their gradients wait on disk
    sharded = plan.shard_world > 1
    records: List[BlockRecord] = []
    for block in blocks:
        for group in block.groups:
            buffer = tiers.device.allocate(group.numel, group.dtype, f"block {block.name!r}")
            if initial.copies_parameters():
                with torch.no_grad():
                    for slot in group.slots:
                        buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
            group.device_buffer = buffer
            group.point_params_at(buffer)
            for slot in group.slots:
                slot.param.grad = None
        # sharded weights from a checkpoint file: each rank reads its own part, the same file on every rank
        own_parts = sharded and initial.reads_parts()
        assert dp is not None or not own_parts
        initial.fill(block, [(p.lo, p.hi) for p in (dp.weight_part(g.numel) for g in block.groups)]  # type: ignore[union-attr]
                     if own_parts else None)
        groups = []
        for group in block.groups:
            if dp is not None and not own_parts:
                assert group.device_buffer is not None
                dp.broadcast_from_first(group.device_buffer)
            state, shard = None, None
            if group.trainable_numel:
                shard = None if dp is None else dp.state_shard(group.trainable_numel, group.numel, sharded)
                store = _state_store(group, policy, tiers) if shard is None else \
                    ShardedStore(_state_store(ShardGroup(group, shard), policy, tiers), shard)
                grads = _grad_home(group, store.on_host, policy, tiers, plan, shard, block.name in parked_grads,
                                   block.name in shadowed and _grads_may_rest(policy, dp))
                state = GroupState(group, store, grads, [optimizer_group_of[s.param] for s in group.trainable_slots],
                                   shard)
            home = _partitioned_home(block, group, tiers, on_disk, dp, shard) if sharded else \
                _weight_home(block, group, policy, tiers, streamed, on_disk, state is not None, shard is None, from_master)
            if state is not None and block.name in shadowed:
                state.store.add_shadow()
                home.add_shadow()
            groups.append(GroupRecord(block, group, home, state))
        record = BlockRecord(block, groups, block.name in streamed, services)
        records.append(record)
        if record.streamed:  # released before the next block takes its device memory
            tiers.streamer.adopt(block, [g.home for g in groups], record)
        return_freed_memory()  # the temporaries of filling this block: not kept as RSS into the next
    initial.finish(module, policy.device)
    for sub in module.modules():
        buffers = own_buffers(sub)
        for key, buf in buffers.items():
            if buf is None:
                continue
            if buf.device != policy.device:
                buf = buffers[key] = buf.to(policy.device)
            if dp is not None:
                dp.broadcast_from_first(buf)
    return records


def _state_store(group: Any, policy: OffloadPolicy, tiers: Tiers) -> StateStore:  # a FlatGroup, or a ShardGroup as one
    if tiers.ring is not None:
        return DiskStore(group, tiers.ring)
    on_host = policy.tier is not Tier.GPU
    return MemoryStore(group, torch.device("cpu") if on_host else policy.device, on_host, policy.moments)


def _grad_home(group: FlatGroup, on_host: bool, policy: OffloadPolicy, tiers: Tiers, plan: Plan,
               shard: Optional[Shard], parks: bool, rests: bool = False) -> GradHome:
    """Host memory for the host tiers (the nvme tier's gradient window when the plan has one, with the swap
    file for the gradients that must wait when the plan puts this block's on disk: `parks`, and, `rests`, in the
    moments after a speculative update; a block whose gradients the budget holds beside the window keeps a buffer
    of its own), else the device. Data-parallel (`shard`): the whole gradient padded to whole shards; with
    clipping, only this rank's part parks on disk."""
    device = torch.device("cpu") if on_host else policy.device
    padded_numel = None if shard is None else shard.padded
    if parks:
        assert tiers.grad_pool is not None and tiers.ring is not None
        parked = None if shard is None or policy.max_grad_norm is None else (shard.lo, shard.hi)
        return GradHome(group, device, tiers.copies, on_host, padded_numel, tiers.grad_pool,
                        DiskParking(tiers.ring.grads, parked, rests and resting_supported(group.dtype)),
                        tiers.torch_norm)
    if plan.grads_on_disk:  # the budget holds this block's whole, beside the window of those that park
        return GradHome(group, device, tiers.copies, on_host, padded_numel, norms=tiers.torch_norm)
    return GradHome(group, device, tiers.copies, on_host, padded_numel, tiers.grad_pool, norms=tiers.torch_norm)


def _weight_home(block: Block, group: FlatGroup, policy: OffloadPolicy, tiers: Tiers, streamed: set, on_disk: set,
                 trains: bool, whole_state: bool, from_master: AbstractSet[str] = frozenset()) -> WeightHome:
    """Disk for blocks the plan puts there (their own record, or read from the master: `from_master`), a whole host
    copy for other streamed blocks, an upload source for resident trainable weights whose state is on the host of a
    GPU, else the device alone (`whole_state`: this process holds the group's whole master, so a speculation may
    write the device weights in place)."""
    if block.name in from_master:
        assert tiers.ring is not None and whole_state and group.trainable_numel == group.numel
        return MasterHome(group, tiers.ring.masters, tiers.copies)
    if block.name in on_disk:
        assert tiers.ring is not None
        return DiskHome(group, tiers.ring.weights, tiers.copies)
    if block.name in streamed:
        return HostMirror(group, tiers.copies, whole=True)
    if trains and policy.tier is not Tier.GPU and policy.device.type != "cpu":
        return HostMirror(group, tiers.copies, whole=False)  # an upload sends all of it, updated or not
    return DeviceHome(group, whole_state)


def _partitioned_home(block: Block, group: FlatGroup, tiers: Tiers, on_disk: set, dp: Optional[DataParallel],
                      state_shard: Optional[Shard]) -> PartitionedHome:
    """Sharded weights: this rank's part of the group, on disk where the plan puts the block's, else in host
    memory."""
    assert dp is not None and group.device_buffer is not None
    part = dp.weight_part(group.numel)
    initial = group.device_buffer[part.lo:part.hi]
    if block.name in on_disk:
        assert tiers.ring is not None
        keeper: PartKeeper = DiskPart(WeightPart(group, part), tiers.ring.weights, initial)
    else:
        keeper = HostPart(initial)
    return PartitionedHome(group, part, state_shard, dp, keeper)


def _grad_record_numel(dp: DataParallel, sharded: bool, clipping: bool) -> Callable[[GroupShape], int]:
    """A data-parallel rank's gradient record of a group: its averaged part with clipping (a gradient parks only
    after its block's reduce-scatter, for the global norm), else the whole trainable range padded to whole
    shards (a micro-batch's sum parks before any average)."""
    def numel(group: GroupShape) -> int:
        shard = dp.state_shard(group.trainable_numel, group.numel, sharded)
        return shard.numel if clipping else shard.padded
    return numel
