"""The runtime records: everything that describes one block, and one flat group, during training.

`Block` and `FlatGroup` (block.py) describe the model's layout; the records here hold what changes while it
trains, reached from the block (`block.runtime`): for each flat group its weight home, and for a group with
trainable parameters its optimizer state store, gradient accumulator and step counts; for the block
whether its updated weights wait to be pushed, and the per-step flags (updated early, gradient norms) that
`end_step()` resets.
A parameter finds its slot through one `SlotTable`. Adding per-block state (a rank's shard, gradients on
disk) means a field here, not a side table in the engine.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from torch import Tensor, nn

from offload.distributed.data_parallel import Shard
from offload.scheduler.blocks.block import Block, FlatGroup, Residency
from offload.scheduler.grads.grad_home import GradAccumulator
from offload.scheduler.state.state_store import StateStore, overwrite_master
from offload.scheduler.state.adamw import AdamHyper, UpdateSpan, adamw
from offload.scheduler.weights.weight_home import WeightHome


class GroupState:
    """The optimizer side of one flat group with trainable parameters: its state store (any tier), its
    gradient accumulator, each trainable slot's Adam step count and optimizer group."""

    def __init__(self, group: FlatGroup, store: StateStore, grads: GradAccumulator,
                 optimizer_groups: Sequence[int], shard: Optional[Shard] = None) -> None:
        self.group = group
        self.store = store
        self.grads = grads
        self.shard = shard if shard is not None else Shard.whole(group.trainable_numel)  # this rank's part
        # data-parallel: the parameters any rank had a gradient for, once this step's gradient is averaged
        # into this rank's part (None before); see data_parallel.py
        self.reduced_ready: Optional[List[int]] = None
        self.steps: List[int] = [0] * len(group.trainable_slots)
        self.optimizer_groups = list(optimizer_groups)  # per trainable slot: its index in optimizer.param_groups

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments this rank keeps (its shard), on any tier."""
        return 12 * self.shard.numel

    @property
    def host_bytes(self) -> int:
        """Bytes this state keeps in host memory (0 when it is on the compute device)."""
        return self.store.nbytes_in_memory + self.grads.nbytes if self.store.on_host else 0

    def hypers_of(self, per_group: Tuple[AdamHyper, ...]) -> List[AdamHyper]:
        """Each trainable slot's hyperparameters, from every optimizer group's."""
        return [per_group[g] for g in self.optimizer_groups]

    def restore_steps(self, steps: Sequence[int]) -> None:
        """Step counts of a checkpoint, in trainable-slot order."""
        if len(steps) != len(self.steps):
            raise ValueError(f"{len(steps)} step counts for {len(self.steps)} trainable parameters")
        self.steps = [int(s) for s in steps]

    def update(self, ready: List[int], hypers: Sequence[AdamHyper], grad_scale: float, out: Optional[Tensor],
               num_threads: Optional[int] = None) -> None:
        """One AdamW step of the parameters in `ready` (taken when the update was scheduled); new compute
        weights go to `out` when the store does not keep them. `num_threads` caps the CPU kernel's threads."""
        self.grads.settle()
        if ready:
            adamw(self.store, self.grads.buffer(wait=False), self.advance_steps(ready, hypers), grad_scale, out,
                  num_threads)

    def advance_steps(self, ready: List[int], hypers: Sequence[AdamHyper]) -> List[UpdateSpan]:
        """Count the step of every ready parameter; the spans to update: the whole group in one span when
        every parameter is ready, at the same step and in the same optimizer group (the usual case), else
        one span per parameter."""
        if len(ready) == len(self.steps) and len(set(self.steps)) == 1 and len(set(hypers)) == 1:
            self.steps = [self.steps[0] + 1] * len(self.steps)
            return [(0, self.group.trainable_numel, self.steps[0], hypers[0])]
        spans = []
        for i in ready:
            slot = self.group.trainable_slots[i]
            self.steps[i] += 1
            spans.append((slot.offset, slot.offset + slot.numel, self.steps[i], hypers[i]))
        return spans


class GroupRuntime:
    """One flat group during training (`group.runtime`): where its weights live, and its optimizer state
    when it trains."""

    def __init__(self, block: Block, group: FlatGroup, home: WeightHome, state: Optional[GroupState]) -> None:
        self.block = block
        self.group = group
        self.home = home
        self.state = state
        self.seen_versions: List[int] = []  # each parameter's `_version` when the engine last looked
        self.mark_seen()

    def replace_weights(self, flat: Tensor) -> None:
        """New compute weights for the whole group (a checkpoint load): into its home, and into the device
        buffer when the block is resident."""
        self.home.replace(flat, resident=self.block.residency is Residency.RESIDENT)
        self.mark_seen()  # what was written in place before the load is replaced by it

    def edited_slots(self) -> List[int]:
        """Trainable parameters written in place through the parameter since `mark_seen` (nn.init, a
        load_state_dict, a torch.no_grad() write: each bumps the parameter's version counter; the engine's own
        writes go through the flat buffer, whose counter is not the parameter's). Indices into
        `trainable_slots`, which are the group's first slots."""
        if self.state is None:
            return []
        return [i for i in range(len(self.group.trainable_slots)) if self._edited(i)]

    def edited_names(self) -> List[str]:
        """Every parameter of the group written in place since `mark_seen`, frozen ones included."""
        return [slot.name for i, slot in enumerate(self.group.slots) if self._edited(i)]

    def _edited(self, index: int) -> bool:
        return self.group.slots[index].param._version != self.seen_versions[index]

    def mark_seen(self) -> None:
        self.seen_versions = [slot.param._version for slot in self.group.slots]

    def keep_writes(self) -> None:
        """Weights written in place through the parameters (into the device buffer) become the group's: the
        trainable ones its master weights (moments kept, as torch.optim would train on from them), and the
        whole buffer its home's copy when the home is not the device buffer (a host mirror, the swap file).
        The caller has checked that no update of the block is pending."""
        edited = self.edited_slots()
        if not edited and not self.edited_names():
            return
        assert self.group.device_buffer is not None
        weights = self.group.device_buffer.detach()
        if edited:
            assert self.state is not None
            slots = [self.group.trainable_slots[i] for i in edited]
            overwrite_master(self.state.store, weights[:self.group.trainable_numel],
                             [(s.offset, s.offset + s.numel) for s in slots])
        if self.home.pushes:
            self.home.replace(weights.to("cpu"), resident=True)
        self.mark_seen()


class BlockRuntime:
    """One block during training. The worker's pending update of the block is found by `block.index`
    (worker.py); its residency is `block.residency`."""

    def __init__(self, block: Block, groups: List[GroupRuntime], streamed: bool) -> None:
        self.block = block
        self.groups = groups
        self.streamed = streamed
        self.trainable_ids = [id(s.param) for s in block.slots if s.trainable]  # BackwardTracker's keys
        self.needs_push = False  # updated weights not yet sent to the device
        self.updated_early = False  # updated during the last backward, before step()
        self.norms: Optional[List[Tuple[nn.Parameter, float]]] = None  # gradient norms computed for clipping
        self.shard_sumsq: Optional[float] = None  # data-parallel: sum of squares of this rank's averaged part
        self.lost_write: Optional[str] = None  # a parameter written while its update ran (overlap_step)

    @property
    def states(self) -> List[GroupState]:
        """The optimizer state of each flat group that has trainable parameters."""
        return [g.state for g in self.groups if g.state is not None]

    @property
    def pushes(self) -> bool:
        """Whether an update writes somewhere the device must then be fed from."""
        return any(g.home.pushes for g in self.groups if g.state is not None)

    def keep_writes_before_release(self) -> None:
        """A resident streamed block about to be released: what was written through its parameters since the
        engine last looked is kept (`GroupRuntime.keep_writes`), unless an update was scheduled since (its
        weights would overwrite the write, or the write the update's): then the next use of the block
        raises (`lost_write`)."""
        for group in self.groups:
            edited = group.edited_names()
            if not edited:
                continue
            if self.needs_push:
                self.lost_write = self.lost_write or edited[0]
                group.mark_seen()
            else:
                group.keep_writes()

    def end_step(self) -> None:
        """Forget the step in progress (after `step()`, or when a checkpoint replaces the state)."""
        self.updated_early = False
        self.norms = None
        self.shard_sumsq = None

    def forget_averages(self) -> None:
        """Data-parallel: the averaged gradients were consumed by the update, or dropped by zero_grad."""
        for state in self.states:
            state.reduced_ready = None

    @property
    def reduced(self) -> bool:
        """Data-parallel: this step's gradients of the block were averaged across the ranks already."""
        return any(state.reduced_ready is not None for state in self.states)


class SlotRef(NamedTuple):
    """Where one trainable parameter lives: its block, its flat group's state, its slot index there, and
    its position in `module.parameters()` (the order torch reduces gradient norms in)."""

    block: BlockRuntime
    state: GroupState
    index: int
    position: int


class SlotTable:
    """Trainable parameter -> its `SlotRef`: the one map from what autograd hands a hook to the engine's
    records. Keyed by `id(param)` inside (the parameters are alive as long as the table: the blocks hold
    them): a lookup runs per gradient, and `Tensor.__hash__` is a Python call several times slower."""

    def __init__(self, blocks: Sequence[Block], module: nn.Module) -> None:
        position = {p: i for i, p in enumerate(module.parameters())}
        self._refs: Dict[int, SlotRef] = {}
        for block in blocks:
            assert block.runtime is not None
            for runtime in block.runtime.groups:
                if runtime.state is not None:
                    for index, slot in enumerate(runtime.group.trainable_slots):
                        self._refs[id(slot.param)] = SlotRef(block.runtime, runtime.state, index, position[slot.param])

    def __getitem__(self, param: nn.Parameter) -> SlotRef:
        return self._refs[id(param)]

    def clear(self) -> None:
        """Drop every reference to the records (the engine is closing: the optimizer state is freed)."""
        self._refs.clear()

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (ref.state.group.trainable_slots[ref.index].param for ref in self._refs.values())
