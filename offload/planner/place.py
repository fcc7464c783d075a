"""Placement: a pure function from block sizes, the tier and the budgets to a `Plan` (plan.py).

Faster tiers are filled first, in forward order; only what does not fit spills down. Nothing here allocates or
measures: the engine builds `BlockSpec`s from its blocks (`spec_of`) and applies the plan.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Callable, FrozenSet, List, Optional, Sequence, Tuple

import torch

from offload.errors import OffloadConfigError
from offload.optim.functional import torch_norm_order
from offload.optim.moment_format import MomentFormat, moment_nbytes
from offload.planner.plan import BlockPlacement, BlockSpec, GradFlow, Location, Plan
from offload.planner.plan import human_bytes as _human
from offload.planner.ring import MAX_DEPTH, RingSize, read_ahead_bytes
from offload.policy import DiskWeights, Tier


def make_plan(blocks: Sequence[BlockSpec], tier: Tier, device_budget: Optional[int],
              host_budget: Optional[int], ring: Optional[RingSize] = None, grads: Optional[GradFlow] = None,
              shard_world: int = 1, speculate: bool = False, disk_room: Optional[int] = None,
              resident_weight_shadows: bool = False, disk_weights: DiskWeights = DiskWeights.AUTO,
              activation_room: int = 0) -> Plan:
    """Place each block; raises OffloadConfigError naming the block or budget that cannot work.

    nvme tier (`ring` given): host memory holds the gradients (all of them; or a window of GRAD_WINDOW_BLOCKS
    of the largest when `grads` are consumed during the last backward, or when they must wait and do not all
    fit: then whole gradients where the budget holds them beside the window, and the others wait on disk), then
    the staging ring (at least its minimum, up to its preferred size
    or a quarter of what is left), then streamed weights in forward order; weights that do not fit go to disk.
    See docs/design.md [Note: the nvme step pipeline], [Note: the gradient window], [Note: gradients on
    disk].

    Sharded weights (`shard_world` > 1, each spec's `part_weight_bytes`): no block stays on the device; a rank's
    part of each goes to host memory, else to disk, and the device holds the blocks gathered for compute.

    Speculative clipping (`speculate`: clipping asked for, and speculation allowed): the shadows come last, from
    what the budgets leave (`disk_room`: free bytes where the swap file goes, None: not measured), last blocks of
    the forward first, since their gradients complete first in the backward ([Note: speculative clipping]).
    `resident_weight_shadows`: a resident block's speculative weights need a shadow, in device memory (else host
    memory: the same RAM), because the CPU computes with each data-parallel rank holding a part of the master;
    otherwise none: one process writes them in place and puts them back from the master when dropped, a GPU's
    update writes a host upload source.

    Weights on disk (nvme tier): a record of their own, or read from the fp32 master and cast (`disk_weights`;
    AUTO: when the copies would not fit `disk_room`), see `_disk_weights`.

    `activation_room` (wrap's `activation_memory`): device bytes no weight takes, for the forward's saved
    activations; clipping half-precision gradients in host memory keeps one fp32 copy of the largest for its norm
    (`norm_scratch_bytes`), counted in the host budget before anything else is placed there."""
    grads = grads if grads is not None else GradFlow()
    if not blocks:
        raise OffloadConfigError("the model has no parameters to offload")
    if tier is Tier.GPU:
        placements = [BlockPlacement(b.name, Location.DEVICE, Location.DEVICE, b.weight_bytes, b.state_bytes)
                      for b in blocks]
        need = sum(b.weight_bytes + b.state_bytes for b in blocks)
        if device_budget is not None and need + activation_room > device_budget:
            room_said = f" and activation_memory {_human(activation_room)}" if activation_room else ""
            raise OffloadConfigError(
                f"tier='gpu' keeps everything on the device: {_human(need)} needed{room_said}, device_memory is "
                f"{_human(device_budget)}; use tier='cpu' or tier='nvme'")
        said = "off: the gpu tier updates on the device, right after the backward" if speculate else ""
        return Plan(tier, tuple(placements), device_budget, host_budget, speculation=said,
                    activation_room=activation_room)

    largest = max(blocks, key=lambda b: b.weight_bytes)
    total_weights = sum(b.weight_bytes for b in blocks)
    # Weights that stream: each parameter's gradient is made by autograd on the device before the engine moves
    # it to its accumulator, so the device budget keeps room for the largest ([Note: the nvme memory bound]).
    sharded = shard_world > 1
    streams = device_budget is not None and (sharded or total_weights + activation_room > device_budget)
    workspace = 0
    if streams:
        workspace = max(b.largest_grad_bytes for b in blocks)
    if device_budget is not None and largest.weight_bytes + workspace + activation_room > device_budget:
        also = f" and {_human(workspace)} for the largest gradient autograd makes" if workspace else ""
        also += f" and activation_memory {_human(activation_room)}" if activation_room else ""
        raise OffloadConfigError(
            f"device_memory ({_human(device_budget)}) is smaller than block {largest.name!r} "
            f"({_human(largest.weight_bytes)} of weights){also}, which must fit on the device to compute; "
            f"raise device_memory to at least {largest.weight_bytes + workspace + activation_room} bytes")
    state_home = Location.HOST if tier is Tier.CPU else Location.DISK
    scratch = _norm_scratch_bytes(blocks, grads)
    host_left = None if host_budget is None else host_budget - scratch
    if host_left is not None and host_left < 0:
        raise OffloadConfigError(
            f"host_memory ({_human(host_budget)}) is smaller than the {_human(scratch)} clipping needs for the fp32 "
            "copy of the largest half-precision gradient, whose norm it takes; raise host_memory")
    if state_home is Location.HOST:
        state_total = sum(b.state_bytes for b in blocks)
        if host_left is not None and state_total > host_left:
            also = f" and {_human(scratch)} for clipping's fp32 gradient norm" if scratch else ""
            raise OffloadConfigError(
                f"tier='cpu' keeps the optimizer state in host memory: {_human(state_total)} needed{also}, "
                f"host_memory is {_human(host_budget)}; use tier='nvme' or raise host_memory")
        host_left = None if host_left is None else host_left - state_total
    ring_bytes = 0
    window: Optional[int] = None
    on_disk = False
    parked: FrozenSet[str] = frozenset()  # blocks whose gradients wait on disk
    on_device = device_budget is None  # declared accumulation's earlier micro-batches sum on the device
    if tier is Tier.NVME:
        ring = ring or RingSize(0, 0)
        window, on_disk = _grad_home(blocks, host_left, ring, grads, on_device)
        if on_disk:
            assert host_left is not None and window is not None, "gradients go to disk only under a host budget"
            if _all_rest(grads, on_device):  # none kept beside the window: the ring reads ahead with that memory
                parked = frozenset(b.name for b in blocks)
            else:
                window, parked = _parked_grads(blocks, host_left, ring, window)
        host_left, ring_bytes = _reserve_nvme_host(blocks, host_left, ring, window, grads, parked)
    device_left: Optional[int] = None
    if device_budget is not None:
        device_left = device_budget - workspace - activation_room
        if streams:
            # Streaming: keep room for the blocks in flight, two of the largest when the budget allows.
            # See docs/design.md [Note: weight streaming].
            in_flight = 2 * largest.weight_bytes if device_left >= 2 * largest.weight_bytes else largest.weight_bytes
            device_left -= in_flight
    placements = []
    for block in blocks:
        kept = block.weight_bytes if block.part_weight_bytes is None else block.part_weight_bytes
        if not sharded and (device_left is None or block.weight_bytes <= device_left):
            weights = Location.DEVICE
            device_left = None if device_left is None else device_left - block.weight_bytes
        elif host_left is None or kept <= host_left:
            weights = Location.HOST
            host_left = None if host_left is None else host_left - kept
        elif tier is Tier.NVME:
            weights = Location.DISK
        else:
            raise OffloadConfigError(
                f"block {block.name!r} ({_human(block.weight_bytes)} of weights) fits neither the device nor "
                "the host budget left after the optimizer state; use tier='nvme' or raise a budget")
        placements.append(BlockPlacement(block.name, weights, state_home, kept, block.state_bytes,
                                         block.grad_bytes, grad_parks=block.name in parked))
    parked_bytes = sum(b.grad_bytes for b in blocks if b.name in parked)
    disk_traffic = _grad_disk_bytes(parked_bytes, grads, on_device) if on_disk else 0
    placements, weights_said = _disk_weights(blocks, placements, disk_weights, disk_room,
                                             Plan(tier, tuple(placements), device_budget, host_budget,
                                                  grads_on_disk=on_disk).bytes_on(Location.DISK))
    said = ""
    if speculate:
        disk_left = None
        if disk_room is not None:
            unshadowed = Plan(tier, tuple(placements), device_budget, host_budget, grads_on_disk=on_disk)
            disk_left = disk_room - unshadowed.bytes_on(Location.DISK) - DISK_SLACK
        placements, host_left, said = _shadows(blocks, placements, host_left, disk_left,
                                               device_left if resident_weight_shadows else None,
                                               resident_weight_shadows)
    slots = None
    if tier is Tier.NVME and ring is not None:
        ring_bytes += read_ahead_bytes(host_left, ring_bytes, sum(b.state_bytes for b in blocks),
                                       ring.preferred // MAX_DEPTH)
        slots = ring.slots(ring_bytes) if ring_bytes else None
    return Plan(tier, tuple(placements), device_budget, host_budget, ring_bytes, slots, window, workspace, on_disk,
                disk_traffic, on_device, shard_world, speculation=said, disk_weights=weights_said,
                grads_rest=on_disk and _all_rest(grads, on_device) and any(p.shadowed for p in placements),
                activation_room=activation_room, norm_scratch_bytes=scratch)


def _norm_scratch_bytes(blocks: Sequence[BlockSpec], flow: GradFlow) -> int:
    """Host bytes of the fp32 copy in which clipping takes the norm of a half-precision gradient held in host
    memory (the cpu and nvme tiers'), where the native core cannot take it in place in torch's order
    (offload/optim/functional.py `TorchNorm`, kept between steps): the largest gradient's, in fp32."""
    if not flow.clipping or flow.itemsize >= 4 or torch_norm_order() is not None:
        return 0
    return max(b.largest_grad_bytes for b in blocks) // flow.itemsize * 4


def _disk_weights(blocks: Sequence[BlockSpec], placements: List[BlockPlacement], choice: DiskWeights,
                  disk_room: Optional[int], disk_need: int) -> Tuple[List[BlockPlacement], str]:
    """Whether the blocks whose weights are on disk keep a copy of them in the swap file or read them from their fp32
    master in the state record and cast them (`from_master`): asked for (MASTER), or (AUTO) when the swap file with
    the copies (`disk_need` bytes, shadows apart) would not fit `disk_room` (free disk, None: not measured). A block
    with frozen parameters (no master for them) or sharded weights keeps its copy. (placements, the plan's line.)
    The cost: a fetch reads 4 B/param of master instead of the copy's bytes, in the forward and in the backward."""
    on_disk = [i for i, p in enumerate(placements) if p.weights is Location.DISK]
    if not on_disk:
        return placements, ""
    eligible = [i for i in on_disk if blocks[i].part_weight_bytes is None and blocks[i].master_bytes
                and blocks[i].shadow_weight_bytes == blocks[i].weight_bytes]
    copies = sum(placements[i].weight_bytes for i in on_disk)
    short = disk_room is not None and disk_need > disk_room - DISK_SLACK
    if choice is DiskWeights.COPY or not eligible or (choice is DiskWeights.AUTO and not short):
        why = "disk_weights='copy'" if choice is DiskWeights.COPY else \
            "no block's weights all have a master" if not eligible else \
            "free disk not measured" if disk_room is None else "they fit the free disk"
        return placements, (f"{len(on_disk)} blocks' weights kept as a copy in the swap file ({_human(copies)}; {why}"
                            "; disk_weights='master' reads them from the fp32 master instead)")
    out = list(placements)
    for i in eligible:
        out[i] = dataclasses.replace(placements[i], from_master=True)
    saved = sum(placements[i].weight_bytes for i in eligible)
    extra = sum(blocks[i].master_bytes - placements[i].weight_bytes for i in eligible)
    why = "disk_weights='master'" if choice is DiskWeights.MASTER else \
        f"the swap file with the copies, {_human(disk_need)}, would not fit the {_human(disk_room or 0)} free"
    kept = len(on_disk) - len(eligible)
    return out, (f"{len(eligible)} of {len(on_disk)} blocks' weights read from the fp32 master in the state record and "
                 f"cast, no copy on disk ({why}): {_human(saved)} less disk; each fetch reads the master's 4 B/param, "
                 f"{_human(2 * extra)} more read per step (a forward and a backward)"
                 + (f"; {kept} blocks with frozen parameters keep a copy" if kept else ""))


DISK_SLACK = 64 << 20  # free disk the shadows leave: the layout's padding, the layout file, the checkpoints' temporaries


def _shadows(blocks: Sequence[BlockSpec], placements: List[BlockPlacement], host_left: Optional[int],
             disk_left: Optional[int], device_left: Optional[int],
             resident_weight_shadows: bool) -> Tuple[List[BlockPlacement], Optional[int], str]:
    """Speculative clipping's shadows, last blocks first, while the budgets leave room: each block's state shadow
    lives where its state does, its weight shadow where the update writes (host memory for weights kept there;
    disk with weights on disk; for resident weights only with `resident_weight_shadows`, on the device, or in host
    memory when the device budget is full, since both are the same RAM there). (placements, host bytes left, the
    plan's line)."""
    out = list(placements)
    missing: Optional[Tuple[str, Tuple[int, int, int]]] = None  # the first block left without, and its needs
    for index in reversed(range(len(blocks))):
        spec, placed = blocks[index], placements[index]
        if not spec.shadow_state_bytes:
            continue
        weights_at: Optional[Location] = placed.weights
        if weights_at is Location.DEVICE and not resident_weight_shadows:
            weights_at = None  # written in place (put back from the master when dropped), or a GPU's upload source
        # on disk the weight record's shadow is the whole record (its frozen part too), the rank's part if sharded
        weight_need = {Location.DISK: 0 if placed.from_master else
                       spec.weight_bytes if spec.part_weight_bytes is None else spec.part_weight_bytes}
        left = {Location.HOST: host_left, Location.DISK: disk_left, Location.DEVICE: device_left}
        # the CPU computing: its "device" memory is host memory, so a resident block's weight shadow may take
        # either budget (device first)
        choices = [weights_at, Location.HOST] if weights_at is Location.DEVICE else [weights_at]
        for weights_at in choices:
            need = {location: (spec.shadow_state_bytes if placed.state is location else 0)
                    + (weight_need.get(location, spec.shadow_weight_bytes) if weights_at is location else 0)
                    for location in (Location.HOST, Location.DISK, Location.DEVICE)}
            if not any(left[at] is not None and need[at] > left[at] for at in need):  # type: ignore[operator]
                break
        else:
            missing = missing or (placed.name, (need[Location.HOST], need[Location.DISK], need[Location.DEVICE]))
            continue
        host_left = None if host_left is None else host_left - need[Location.HOST]
        disk_left = None if disk_left is None else disk_left - need[Location.DISK]
        device_left = None if device_left is None else device_left - need[Location.DEVICE]
        out[index] = dataclasses.replace(placed, shadow_host_bytes=need[Location.HOST],
                                         shadow_disk_bytes=need[Location.DISK],
                                         shadow_device_bytes=need[Location.DEVICE], shadowed=True)
    trained = [p for p, b in zip(out, blocks) if b.shadow_state_bytes]
    shadowed = [p for p in trained if p.shadowed]
    costs = [(sum(p.shadow_host_bytes for p in shadowed), "host memory"),
             (sum(p.shadow_disk_bytes for p in shadowed), "disk"),
             (sum(p.shadow_device_bytes for p in shadowed), "device memory")]
    cost = ", ".join(f"{_human(n)} {where}" for n, where in costs if n) or "nothing"
    said = (f"{len(shadowed)} of {len(trained)} blocks update during the last backward into shadows ({cost}); "
            "step() keeps them when it does not clip")
    if missing is not None:
        name, needs = missing
        wanted = " and ".join(f"{_human(n)} {where}" for n, where in zip(needs, ("host memory", "disk",
                                                                                 "device memory")) if n)
        said += (f"; the others wait for the global norm: no room for their shadows (block {name!r} needs "
                 f"{wanted}; raise host_memory or device_memory, or free disk space)")
    return out, host_left, said


GRAD_WINDOW_BLOCKS = 3  # gradients in host memory at once: one filling, one updating (or going to disk), one slack
MIN_GRAD_WINDOW_BLOCKS = 2  # the least that works: one filling while one updates or goes to disk


def grad_window_bytes(blocks: Sequence[BlockSpec], count: int = GRAD_WINDOW_BLOCKS) -> int:
    """The gradient window: the gradients of the `count` largest blocks (at most all of them)."""
    return sum(sorted((b.grad_bytes for b in blocks), reverse=True)[:count])


def _grad_home(blocks: Sequence[BlockSpec], host_left: Optional[int], ring: RingSize, flow: GradFlow,
               micro_batches_on_device: bool) -> Tuple[Optional[int], bool]:
    """(host window bytes or None for all of them, whether gradients that must wait go to disk)."""
    if host_left is None:
        return None, False  # no budget: every gradient stays in host memory
    window = grad_window_bytes(blocks)
    least = grad_window_bytes(blocks, MIN_GRAD_WINDOW_BLOCKS)
    if window + ring.minimum > host_left >= least + ring.minimum:
        window = least  # the backward then waits for each update (or write) before taking the next buffer
    earlier_wait = (flow.declared_steps or 1) > 1 and not micro_batches_on_device
    if flow.consumed_in_backward and not earlier_wait:
        return window, False  # the fast path: the last backward's updates consume each block's gradient
    if _all_rest(flow, micro_batches_on_device):
        # Gradients resting in the moments after speculative updates need no room: kept whole they would take the
        # ring's reads ahead (at 1.2B parameters 2.4 GiB of 3 GB, the ring left at 157 MiB), so the window it is,
        # with a record on disk for steps that do not speculate (clipping fired) ([Note: gradients resting in the
        # moments])
        return window, True
    if sum(b.grad_bytes for b in blocks) + ring.minimum <= host_left:
        return None, False  # they all fit
    return window, True


def _all_rest(flow: GradFlow, micro_batches_on_device: bool) -> bool:
    """Whether every gradient a step waits for is the last backward's, which rests in the moments: accumulation
    declared with one micro-batch, or with the earlier ones summed on the device (undeclared, any backward may be
    followed by another, whose sum would wait on disk)."""
    earlier_wait = (flow.declared_steps or 1) > 1 and not micro_batches_on_device
    return flow.rests_in_moments and flow.declared_steps is not None and not earlier_wait


def _parked_grads(blocks: Sequence[BlockSpec], host_left: int, ring: RingSize,
                  window: int) -> Tuple[int, FrozenSet[str]]:
    """Gradients must wait and do not all fit: (the window, the blocks whose gradients wait on disk). What host
    memory holds beyond the window and the ring keeps whole gradients, in forward order, which then never go to
    disk: each saves its record in the swap file and twice its bytes of disk traffic a step, as a streamed
    weight kept in host memory would save its reads, and it is the disk, not the RAM, that bounds the model
    ([Note: gradients on disk]). The window is then sized on the parked blocks alone."""
    preferred = ring.minimum + 2 * max(ring.preferred - ring.minimum, 0)  # _reserve_nvme_host gives half the spare
    ring_room = preferred if host_left - window >= preferred else ring.minimum
    room = host_left - window - ring_room
    kept: set = set()
    for block in blocks:
        if block.grad_bytes <= room:
            kept.add(block.name)
            room -= block.grad_bytes
    parked = [b for b in blocks if b.name not in kept]
    assert parked, "gradients go to disk only when they do not all fit beside the ring"
    count = GRAD_WINDOW_BLOCKS if window == grad_window_bytes(blocks) else MIN_GRAD_WINDOW_BLOCKS
    window = grad_window_bytes(parked, count)
    return window, frozenset(b.name for b in parked)


def _grad_disk_bytes(all_grads: int, flow: GradFlow, micro_batches_on_device: bool) -> int:
    """Gradient bytes written and read back per step: every micro-batch's sum goes to disk and comes back (the
    next micro-batch adds to it, the update reads it), except the last one's when the last backward's updates
    consume it."""
    micro = flow.declared_steps or 1
    waiting = micro - 1 if flow.consumed_in_backward or _all_rest(flow, micro_batches_on_device) else micro
    if micro_batches_on_device and flow.declared_steps is not None:
        waiting = 0 if flow.consumed_in_backward else 1  # the earlier micro-batches summed on the device
    return 2 * waiting * all_grads


def _reserve_nvme_host(blocks: Sequence[BlockSpec], host_left: Optional[int], ring: RingSize,
                       window: Optional[int], flow: GradFlow, parked: AbstractSet[str]) -> Tuple[Optional[int], int]:
    """Host bytes left for streamed weights after the gradients (all, or the window and those kept beside it
    while the `parked` ones wait on disk) and the staging ring, and the ring size."""
    if host_left is None:
        return None, ring.preferred
    kept = sum(b.grad_bytes for b in blocks if b.name not in parked) if parked else 0
    grads = sum(b.grad_bytes for b in blocks) if window is None else window + kept
    need = grads + ring.minimum
    if need > host_left:  # only a window can fail to fit: all the gradients are held only when they fit
        least = grad_window_bytes(blocks, MIN_GRAD_WINDOW_BLOCKS)
        raise OffloadConfigError(_too_small(blocks, host_left, ring, flow, least))
    spare = host_left - need
    # Half of what is left, up to the preferred ring: when weights spill to disk every fetch and update goes
    # through the ring, and a deeper one pipelines them (bench_train's weights-on-disk row: 1.89x -> 1.63x
    # torch AdamW's step time, three runs each, against a quarter).
    ring_bytes = ring.minimum + min(max(ring.preferred - ring.minimum, 0), spare // 2)
    return host_left - grads - ring_bytes, ring_bytes


def _too_small(blocks: Sequence[BlockSpec], host_left: int, ring: RingSize, flow: GradFlow, least: int) -> str:
    """The refusal of a host budget too small for the nvme tier even with the least gradient window (`least`
    bytes): the least host budget that works, and every option."""
    biggest = max(blocks, key=lambda b: b.grad_bytes)
    need = least + ring.minimum
    options = [f"raise host_memory to at least {need} bytes"]
    if flow.itemsize > 2:
        options.append(f"compute in bfloat16 (dtype=torch.bfloat16): the gradients take half, the window then "
                       f"{_human(least // 2)}")
    options.append("a model with smaller blocks (layers): the window holds the largest blocks' gradients")
    return (f"host_memory ({_human(host_left)} left for it) is too small for tier='nvme': the gradient window (the "
            f"{MIN_GRAD_WINDOW_BLOCKS} largest blocks' gradients; the largest, block {biggest.name!r}, "
            f"{_human(biggest.grad_bytes)}) needs {_human(least)} and the staging ring at least "
            f"{_human(ring.minimum)}; " + "; or ".join(options))


def group_bytes(trainable_numel: int, dtype: torch.dtype, tier: Tier,
                moments: MomentFormat = MomentFormat.FP32) -> Tuple[int, int]:
    """(optimizer state bytes, gradient accumulator bytes) of `trainable_numel` parameters computed in
    `dtype`: fp32 master (none on the gpu tier when the weights are fp32 already), Adam m and v in the
    `moments` format, gradient."""
    master = 0 if (tier is Tier.GPU and dtype == torch.float32) else 4 * trainable_numel
    grad = trainable_numel * dtype.itemsize
    return master + 2 * moment_nbytes(moments, trainable_numel), grad


def spec_of(name: str, weight_bytes: int, groups: Sequence[Tuple[int, torch.dtype]], tier: Tier,
            largest_grad_bytes: int = 0, moments: MomentFormat = MomentFormat.FP32, world: int = 1,
            part_weight_bytes: Optional[int] = None, per_rank: Optional[Sequence[Tuple[int, int]]] = None) -> BlockSpec:
    """The BlockSpec of a block from its (trainable numel, dtype) groups; the nvme tier keeps gradients on
    the host apart from the state on disk, the other tiers count them with the state. `world`: data-parallel
    ranks, each keeping the state of its 1/world part (the largest part: the same plan on every rank) and the
    whole gradient (reduce-scattered at the update); `per_rank`: instead, each group's (state, gradient)
    elements of the largest rank; `part_weight_bytes`: sharded weights, a rank's part."""
    state = grads = shadow_weights = master = 0
    for index, (numel, dtype) in enumerate(groups):
        state_numel, grad_numel = per_rank[index] if per_rank is not None else (-(-numel // world), numel)
        master += 4 * state_numel if world == 1 and per_rank is None else 0  # one process holds the whole master
        s, _ = group_bytes(state_numel, dtype, tier, moments)
        _, g = group_bytes(grad_numel, dtype, tier, moments)
        state, grads = state + s, grads + g
        # the weights an update writes: a sharded rank's part of them, else the whole trainable range
        shadow_weights += (state_numel if per_rank is not None else numel) * dtype.itemsize
    shadows = dict(shadow_state_bytes=state, shadow_weight_bytes=shadow_weights) if tier is not Tier.GPU else {}
    if tier is Tier.NVME:
        return BlockSpec(name, weight_bytes, state, grads, largest_grad_bytes, part_weight_bytes, **shadows,
                         master_bytes=master)
    return BlockSpec(name, weight_bytes, state + grads, 0, largest_grad_bytes, part_weight_bytes, **shadows)


def shards_weights(whole_plan: Callable[[], Plan]) -> bool:
    """Whether data-parallel ranks keep a part of the weights each when `shard_weights` is unset (None): when the
    plan of ranks that keep them whole puts some on disk, or cannot be made at all."""
    try:
        return bool(whole_plan().disk_weight_blocks)
    except OffloadConfigError:
        return True
