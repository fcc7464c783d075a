"""One flat group during training: `GroupRecord`, where its weights live (its weight home), its optimizer state
when it trains (`GroupState`), and which of its parameters were written in place since the engine last looked.

`GroupState` is the optimizer side: its state store (memory or the swap file, state/), its gradient home
(grad_home.py), each trainable slot's Adam step count and optimizer group, and, in data-parallel mode, this
rank's part of the group. The update of a group runs here (`update`), over whatever the store hands the AdamW
loop (state/adamw.py). The checkpoint code sees a group through the `GroupStateView` protocol
(checkpoint/target.py), which `GroupState` keeps. See docs/design.md [Note: weights written after wrap()].
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import Tensor

from offload.distributed.data_parallel import Shard
from offload.optim.moment_format import moment_nbytes
from offload.scheduler.blocks.block import Block, FlatGroup, Residency
from offload.scheduler.records.grad_home import GradHome
from offload.scheduler.state.adamw import AdamHyper, RestingSpan, UpdateSpan, adamw
from offload.scheduler.state.state_store import StateStore, moment_blocks, overwrite_master
from offload.scheduler.torch_internals import versions_of
from offload.scheduler.weights.weight_home import WeightHome


class GroupState:
    """The optimizer side of one flat group with trainable parameters: its state store (any tier), its
    gradient accumulator, each trainable slot's Adam step count and optimizer group."""

    def __init__(self, group: FlatGroup, store: StateStore, grads: GradHome,
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
        self._shadow_steps: Optional[List[int]] = None  # a speculative update's step counts, until committed

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of fp32 master weights and Adam moments (in the store's format) this rank keeps (its shard), on
        any tier."""
        blocks = moment_blocks(self.store.moments, self.store.group)  # int8: one scale more a partial block
        return 4 * self.shard.numel + 2 * moment_nbytes(self.store.moments, self.shard.numel, blocks)

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
               num_threads: Optional[int] = None, out_base: int = 0,
               shadow: bool = False) -> Optional[List[RestingSpan]]:
        """One AdamW step of the parameters in `ready` (taken when the update was scheduled); new compute
        weights go to `out` (its element 0 is the group's element `out_base`) when the store does not keep them.
        `num_threads` caps the CPU kernel's threads. `shadow`: a speculative update, whose state goes to the store's
        shadow and whose step counts wait here, until `commit_shadow` (or `forget_shadow`). Returns, when the
        gradient's home may let it rest in the moments the speculative step wrote (`GradHome.may_rest`), what the
        rebuild needs (`GradHome.rest`); else None."""
        self.grads.finish_downloads()
        if not ready:
            return None
        steps = list(self.steps) if shadow else self.steps
        spans = advance_steps(self.group, steps, ready, hypers)
        rest = shadow and self.grads.may_rest
        resting = adamw(self.store, self.grads.buffer(wait=False), spans, grad_scale, out, num_threads, out_base,
                        shadow, rest)
        if shadow:
            self._shadow_steps = steps
        else:
            self.steps = steps
        return resting

    @property
    def speculated(self) -> bool:
        """Whether a speculative update's result waits in the shadow."""
        return self._shadow_steps is not None

    def commit_shadow(self) -> None:
        """The speculative update's state and step counts become the group's."""
        assert self._shadow_steps is not None
        self.store.commit_shadow()
        self.steps, self._shadow_steps = self._shadow_steps, None

    def forget_shadow(self) -> None:
        """The speculative update's result is dropped: the live state never changed."""
        self._shadow_steps = None

    @property
    def state_store(self) -> StateStore:
        return self.store

    @property
    def part(self) -> Tuple[int, int]:
        return self.shard.lo, self.shard.hi

    @property
    def has_pending_grads(self) -> bool:
        """Whether any parameter holds a gradient not yet stepped on (a checkpoint now would lose it)."""
        return any(self.grads.has_grad)


def advance_steps(group: FlatGroup, steps: List[int], ready: List[int],
                  hypers: Sequence[AdamHyper]) -> List[UpdateSpan]:
    """Count the step of every ready parameter in `steps` (in place); the spans to update: the whole group in one
    span when every parameter is ready, at the same step and in the same optimizer group (the usual case), else
    one span per parameter."""
    if len(ready) == len(steps) and len(set(steps)) == 1 and len(set(hypers)) == 1:
        steps[:] = [steps[0] + 1] * len(steps)
        return [(0, group.trainable_numel, steps[0], hypers[0])]
    spans = []
    for i in ready:
        slot = group.trainable_slots[i]
        steps[i] += 1
        spans.append((slot.offset, slot.offset + slot.numel, steps[i], hypers[i]))
    return spans


class GroupRecord:
    """One flat group during training: where its weights live (`home`), its optimizer state when it trains
    (`state`), and the version of each parameter when the engine last looked (writes through the parameters)."""

    def __init__(self, block: Block, group: FlatGroup, home: WeightHome, state: Optional[GroupState]) -> None:
        self.block = block
        self.group = group
        self.home = home
        self.state = state
        self.params = [slot.param for slot in group.slots]  # trainable ones first, as the slots
        self.seen_versions: List[int] = []  # each parameter's `_version` when the engine last looked
        self.mark_seen()

    def params_in_place(self) -> bool:
        """Whether the first parameter still is a view of the device buffer (model.to(), .double(), .cuda()
        after wrap() replace `.data` and so disconnect the parameters from the engine)."""
        group = self.group
        if group.device_buffer is None or not group.slots or group.slots[0].numel == 0:
            return True
        param = group.slots[0].param
        return param.dtype == group.dtype and param.data_ptr() == group.device_buffer.data_ptr()

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
        now = versions_of(self.params)
        return [i for i in range(len(self.group.trainable_slots)) if now[i] != self.seen_versions[i]]

    def edited_names(self) -> List[str]:
        """Every parameter of the group written in place since `mark_seen`, frozen ones included."""
        now = versions_of(self.params)
        return [slot.name for slot, seen, version in zip(self.group.slots, self.seen_versions, now) if seen != version]

    def mark_seen(self) -> None:
        self.seen_versions = versions_of(self.params)

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

    def commit_shadow(self) -> None:
        """A speculative update's state and weights become the group's (no parameter written since: the caller
        checked `edited_names`)."""
        assert self.state is not None
        self.state.commit_shadow()
        self.home.commit_shadow()
        self.mark_seen()  # the engine's own write of the weights (a copy into the device buffer)

    def writes_during_update(self) -> Optional[str]:
        """On the worker, after the group's update: a parameter written meanwhile (overlap_step: after step()
        returned) was overwritten by the update, whose name the block's next use says."""
        edited = self.edited_slots()
        if not edited:
            return None
        self.mark_seen()
        return self.group.trainable_slots[edited[0]].name
