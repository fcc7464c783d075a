"""The plan: where each block's weights and optimizer state live, with the bytes each tier holds (`Plan`), and
the sizes it is made from (`BlockSpec`). `engine.plan` prints it; `python -m offload estimate` makes one from a
model's shape. The placement that makes it is place.py; the nvme ring's sizes ring.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from offload.optim.functional import resting_supported
from offload.optim.moment_format import MomentFormat
from offload.planner.activations import ActivationUse
from offload.planner.ring import RingSlots, slot_bytes_per_element
from offload.policy import Tier


class Location(enum.Enum):
    """A memory tier a block's weights or optimizer state can live in."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class BlockSpec:
    """Sizes of one block: compute weights on the device, and its optimizer state (master, m, v, grads)."""

    name: str
    weight_bytes: int
    state_bytes: int
    grad_bytes: int = 0  # nvme tier: the gradient accumulator, which stays in host memory (not in state_bytes)
    largest_grad_bytes: int = 0  # the largest gradient autograd makes on the device for one of its parameters
    part_weight_bytes: Optional[int] = None  # sharded weights: this rank's part, kept in host memory or on disk
    shadow_state_bytes: int = 0  # a speculation's shadow of the state (master, moments): where the state lives
    shadow_weight_bytes: int = 0  # and of the weights an update writes (host memory, or disk with the weights)
    master_bytes: int = 0  # nvme tier: its fp32 master weights' bytes in the state record (weights read from them)


@dataclass(frozen=True)
class BlockPlacement:
    name: str
    weights: Location
    state: Location
    weight_bytes: int
    state_bytes: int
    grad_bytes: int = 0  # on the host
    shadow_host_bytes: int = 0  # speculative clipping's shadows, when the block has them ([Note: speculative
    shadow_disk_bytes: int = 0  # clipping]): in host memory, in the swap file, on the device (the host's CPU
    shadow_device_bytes: int = 0  # computing: a resident block's weights are written there)
    shadowed: bool = False
    from_master: bool = False  # weights on disk read from the state record's fp32 master and cast: no copy of theirs
    grad_parks: bool = False  # its gradient waits on disk, in a record of the swap file (Plan.grads_on_disk)


@dataclass(frozen=True)
class GradFlow:
    """When a step's gradients are consumed, which decides where they may wait (nvme tier, host budget): by the
    updates during the last backward (accumulation declared, no clipping: a window of them suffices), or only
    after it (clipping needs the global norm; undeclared accumulation cannot know which backward is the last).
    See docs/design.md [Note: gradients on disk]."""

    declared_steps: Optional[int] = None  # grad_accumulation_steps when declared
    clipping: bool = False
    itemsize: int = 4  # of the compute dtype: what a gradient element costs
    # clipping speculates and the gradients may rest in the moments the speculative updates write (nvme tier,
    # fp32 moments, 16-bit gradients, one process): the last backward's gradients then need no room of their own
    # unless clipping fires, when they wait on disk ([Note: gradients resting in the moments])
    rests_in_moments: bool = False

    @property
    def consumed_in_backward(self) -> bool:
        return self.declared_steps is not None and not self.clipping


def grads_may_rest(tier: Tier, speculates: bool, moments: MomentFormat, world: int, dtype: torch.dtype) -> bool:
    """Whether a speculating block's gradient may rest in the moments its update writes ([Note: gradients resting
    in the moments]): the nvme tier's two copies of fp32 first moments, a 16-bit gradient they give back, one
    process (a rank's averaged part waits as it is); wrap's placement and `offload estimate` ask alike."""
    return (tier is Tier.NVME and speculates and moments is MomentFormat.FP32 and world == 1
            and resting_supported(dtype))


@dataclass(frozen=True)
class Plan:
    """Where each block's weights and state live, with the bytes each tier must hold."""

    tier: Tier
    blocks: Tuple[BlockPlacement, ...]
    device_budget: Optional[int]
    host_budget: Optional[int]
    ring_bytes: int = 0  # nvme tier: host staging ring through which disk-resident state and weights flow
    ring_slots: Optional[RingSlots] = None  # nvme tier: the ring's slots within ring_bytes, and the elements each holds
    grad_window_bytes: Optional[int] = None  # nvme tier, gradients windowed: host bytes for gradients at once
    device_grad_bytes: int = 0  # streamed weights under a device budget: room for autograd's largest gradient
    grads_on_disk: bool = False  # gradients that must wait go to disk: the blocks' whose placement parks them
    grad_disk_bytes_per_step: int = 0  # bytes of gradients written and read back per step (an estimate)
    micro_batches_on_device: bool = True  # declared accumulation's earlier micro-batches sum on the device
    shard_world: int = 1  # > 1: weights sharded across that many ranks (blocks' weight bytes are a rank's part)
    weight_gathers: str = ""  # how sharded weights travel when quantized (zero_quantized_weights), for the plan
    grad_reduction: str = ""  # how gradients are averaged when quantized (zero_quantized_gradients), for the plan
    secondary_partition: str = ""  # hpZ's secondary parts (zero_hpz_partition_size), for the plan
    activations: Optional[ActivationUse] = None  # measured in a training forward (engine.plan adds it)
    precision: str = ""  # the compute and master dtypes, in words (the engine's plan sets it; estimate leaves it)
    speculation: str = ""  # max_grad_norm: where speculative clipping runs, or why not, in words ("": no clipping)
    disk_weights: str = ""  # weights on disk: kept as a copy, or read from the fp32 master, and why, in words
    activation_room: int = 0  # device bytes no weight takes: the forward's saved activations (activation_memory)
    norm_scratch_bytes: int = 0  # host: the fp32 copy of the largest half-precision gradient clipping takes a norm of
    grads_rest: bool = False  # with grads_on_disk: a speculating block's rest in the moments its update wrote

    @property
    def host_grad_bytes(self) -> int:
        """Host bytes the gradient accumulators take: all of them, or the window (and, when gradients wait on
        disk, those of the blocks whose gradients do not: the budget holds them whole)."""
        if self.grad_window_bytes is not None:
            return self.grad_window_bytes + (self.all_grad_bytes - self.parked_grad_bytes if self.grads_on_disk else 0)
        return self.all_grad_bytes

    @property
    def device_weight_budget(self) -> Optional[int]:
        """What the device budget leaves for weights: `device_grad_bytes` is kept for autograd's gradient and
        `activation_room` for the activations."""
        if self.device_budget is None:
            return None
        return self.device_budget - self.device_grad_bytes - self.activation_room

    @property
    def device_room(self) -> Optional[int]:
        """What the device budget leaves after the plan's weights, the blocks streaming through it (two of the
        largest when it holds them, else one) and the gradient room: for activations."""
        if self.device_budget is None:
            return None
        left = self.device_budget - self.bytes_on(Location.DEVICE)
        largest = max((b.weight_bytes for b in self.blocks if b.weights is not Location.DEVICE), default=0)
        largest *= self.shard_world  # a sharded block's part, gathered whole
        return max(left - (2 * largest if left >= 2 * largest else largest), 0)

    @property
    def all_grad_bytes(self) -> int:
        return sum(b.grad_bytes for b in self.blocks)

    @property
    def parked_grad_bytes(self) -> int:
        """Bytes of the gradients that wait on disk (their records in the swap file)."""
        return sum(b.grad_bytes for b in self.blocks if b.grad_parks)

    def bytes_on(self, location: Location) -> int:
        total = self.ring_bytes + self.host_grad_bytes + self.norm_scratch_bytes if location is Location.HOST else 0
        total += self.device_grad_bytes if location is Location.DEVICE else 0
        total += self.parked_grad_bytes if location is Location.DISK else 0
        for block in self.blocks:
            total += block.weight_bytes if block.weights is location and not block.from_master else 0
            total += block.state_bytes if block.state is location else 0
            total += block.shadow_host_bytes if location is Location.HOST else 0
            total += block.shadow_disk_bytes if location is Location.DISK else 0
            total += block.shadow_device_bytes if location is Location.DEVICE else 0
        return total

    @property
    def shadowed_blocks(self) -> Tuple[str, ...]:
        """Blocks whose updates may run speculatively during the backward (speculative clipping)."""
        return tuple(b.name for b in self.blocks if b.shadowed)

    @property
    def disk_weight_blocks(self) -> Tuple[str, ...]:
        """Blocks whose compute weights live on disk (streamed disk -> host staging -> device)."""
        return tuple(b.name for b in self.blocks if b.weights is Location.DISK)

    @property
    def master_weight_blocks(self) -> Tuple[str, ...]:
        """Blocks whose weights on disk are read from their fp32 master and cast (no copy of their own on disk)."""
        return tuple(b.name for b in self.blocks if b.from_master)

    @property
    def streamed_blocks(self) -> Tuple[str, ...]:
        """Blocks whose weights do not stay on the device and must be fetched for each use."""
        return tuple(b.name for b in self.blocks if b.weights is not Location.DEVICE)

    def __str__(self) -> str:
        rows = [("block", "weights", "state", "weight bytes", "state bytes")]
        rows += [(b.name, b.weights.value, b.state.value, human_bytes(b.weight_bytes), human_bytes(b.state_bytes))
                 for b in self.blocks]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [f"offload plan (tier={self.tier.value}" + (f"; {self.precision})" if self.precision else ")")]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) if j < 3 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        for location, budget in ((Location.DEVICE, self.device_budget), (Location.HOST, self.host_budget),
                                 (Location.DISK, None)):
            limit = "no budget" if budget is None else f"budget {human_bytes(budget)}"
            lines.append(f"total on {location.value}: {human_bytes(self.bytes_on(location))} ({limit})")
        if self.shard_world > 1:
            lines.append(f"  weights sharded across {self.shard_world} ranks: each keeps its part of every block (the "
                         "weight bytes above), gathered whole on the device for each use; state bytes are this rank's")
            if self.weight_gathers:
                lines.append(f"  weights gathered {self.weight_gathers}")
            if self.secondary_partition:
                lines.append(f"  backward gathers from a secondary partition among {self.secondary_partition}")
        if self.grad_reduction:
            lines.append(f"  gradients averaged {self.grad_reduction}")
        if self.ring_bytes:
            lines.append(f"  gradients: {self.grads_placement()}")
            lines.append(f"  host holds: gradients {human_bytes(self.host_grad_bytes)}, staging ring "
                         f"{human_bytes(self.ring_bytes)}")
            if self.ring_slots is not None:
                lines.append(f"  staging ring: {self.ring_placement()}")
        if self.speculation:
            lines.append(f"  speculative clipping: {self.speculation}")
        if self.disk_weights:
            lines.append(f"  disk-resident weights: {self.disk_weights}")
        if self.device_grad_bytes:
            lines.append(f"  device keeps {human_bytes(self.device_grad_bytes)} for the largest gradient autograd makes "
                         "before the engine takes it")
        if self.activation_room:
            lines.append(f"  device keeps {human_bytes(self.activation_room)} free of weights for the activations "
                         "(activation_memory)")
        if self.norm_scratch_bytes:
            lines.append(f"  host keeps {human_bytes(self.norm_scratch_bytes)} for the fp32 copy of the largest "
                         "half-precision gradient, whose norm clipping takes in fp32 as torch does")
        if self.activations is not None:
            lines += self.activations.lines(self.device_room, human_bytes)
        return "\n".join(lines)

    def grads_placement(self) -> str:
        """Where the gradients live, in words (the plan's table and `python -m offload estimate` print it)."""
        everything = human_bytes(self.all_grad_bytes)
        if self.grads_on_disk and self.grads_rest:
            return (f"a window of {human_bytes(self.grad_window_bytes)} in host memory (of {everything}): after its "
                    "speculative update a block's gradient rests in the first moments the update wrote, nothing "
                    f"written; in steps that do not speculate (after one that clipped) they go to disk ({human_bytes(self.parked_grad_bytes)} "
                    f"written and read back, records in the swap file for {sum(b.grad_parks for b in self.blocks)} of "
                    f"{len(self.blocks)} blocks)")
        if self.grads_on_disk:
            parked = human_bytes(self.parked_grad_bytes)
            kept = self.all_grad_bytes - self.parked_grad_bytes
            kept_said = "" if not kept else (f"; the other {human_bytes(kept)} stay whole in host memory beside "
                                             "the window")
            return (f"a window of {human_bytes(self.grad_window_bytes)} in host memory, {parked} of {everything} on "
                    f"disk (records in the swap file for {sum(b.grad_parks for b in self.blocks)} of "
                    f"{len(self.blocks)} blocks{kept_said}): about {human_bytes(self.grad_disk_bytes_per_step)} written and "
                    "read back per step, per micro-batch without declared accumulation (declaring "
                    "grad_accumulation_steps without max_grad_norm is the fast path: no gradient goes to disk)")
        if self.grad_window_bytes is not None:
            return (f"a window of {human_bytes(self.grad_window_bytes)} (of {everything}; the fast path: each block's "
                    "update consumes its gradient during the last backward)")
        return f"all {everything} in host memory"


    def ring_placement(self) -> str:
        """The staging ring's slots and what each holds, in words (the plan and `python -m offload estimate`)."""
        slots = self.ring_slots
        if slots is None:
            return "none"
        each, unpadded = slots.slot_bytes / max(slots.chunk_numel, 1), slot_bytes_per_element(slots.moments)
        padding = f", {unpadded:.2f} B unpadded" if f"{each:.2f}" != f"{unpadded:.2f}" else ""  # small slots
        return (f"{slots.depth} slots x {human_bytes(slots.slot_bytes)}, {human_count(slots.chunk_numel)} elements "
                f"each at {each:.2f} B ({slots.moments.value} moments{padding}): "
                f"{human_count(slots.in_flight_numel)} elements of optimizer state in flight")


def human_count(count: int) -> str:
    """1234 -> '1234', 770048 -> '770.0K', 3355443 -> '3.36M'."""
    if count >= 10**9:
        return f"{count / 1e9:.3g}G"
    if count >= 10**6:
        return f"{count / 1e6:.3g}M"
    if count >= 10**4:
        return f"{count / 1e3:.4g}K"
    return str(count)


def human_bytes(nbytes: Optional[int]) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"
