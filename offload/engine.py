"""The Engine: the user's model with its parameters in flat per-block buffers and AdamW run per block.

Forward and backward are the model's own; hooks (scheduler/hooks.py) make each block's weights ready
before use and move each gradient off the device as autograd produces it. Updates run per block on a
background worker, so `step()` may return before all blocks are updated: the next use of a block waits
for that block only. See docs/design.md, section "The engine", for the Notes cited below.
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from offload._interrupts import deferred_keyboard_interrupt
from offload._system import usable_cores
from offload.checkpoint.engine_access import CheckpointAccess
from offload.errors import OffloadConfigError, OffloadError
from offload.param_groups import optimizer_groups, slot_group_indices
from offload.planner import Plan, make_plan
from offload.policy import OffloadPolicy, Tier
from offload.scheduler.block import Block, build_blocks, param_owners
from offload.scheduler.disk_ring import DiskRing, ring_depth_for, ring_size_for
from offload.scheduler.forward_order import ForwardOrder
from offload.scheduler.grads import BackwardTracker
from offload.scheduler.hooks import HookSet
from offload.scheduler.nonfinite import NonFiniteSkips, grads_finite
from offload.scheduler.optimizer_view import EngineOptimizer
from offload.scheduler.phase_clock import PhaseClock
from offload.scheduler.step import AdamHyper, DiskGroupState, GroupState, clip_scale
from offload.scheduler.worker import StepWorker
from offload.scheduler.streaming import WeightStreamer
from offload.scheduler.streams import CopyContext
from offload.tiers.device import DeviceTier
from offload.tiers.disk import SwapStore, plan_swap_layout, plan_weight_layout
from offload.tiers.host import StagingPool

_MARKER = "_offload_engine"


class Engine(CheckpointAccess):
    """Trains `module` with AdamW, its optimizer state placed per `policy`. Made by `offload.wrap`.

    Use it as the model (`loss = engine(batch)`), call `loss.backward()`, `engine.step()`,
    `engine.zero_grad()`. `engine.module` is the user's model (parameter identity kept), `engine.optimizer` a
    torch Optimizer whose `param_groups` changes take effect, `engine.plan` the placement table.
    """

    def __init__(self, module: nn.Module, policy: OffloadPolicy) -> None:
        if not isinstance(module, nn.Module):
            raise OffloadConfigError(f"offload.wrap needs a torch.nn.Module, got {type(module).__name__}")
        previous = getattr(module, _MARKER, None)
        if previous is not None and previous() is not None:
            raise OffloadConfigError("this model is already wrapped by an offload engine; call engine.close() "
                                     "on the first one before wrapping it again")
        self.module = module
        self.policy = policy
        self._closed = False
        self.blocks: List[Block] = build_blocks(module, policy.dtype)
        records, swap_size = plan_swap_layout(self.blocks) if policy.tier is Tier.NVME else ({}, 0)
        largest_record = max((r.numel for r in records.values()), default=0)
        ring = ring_size_for(largest_record) if records else None
        self.plan: Plan = make_plan([b.spec(policy.tier) for b in self.blocks], policy.tier,
                                    policy.device_memory, policy.host_memory, ring)
        self._swap: Optional[SwapStore] = None
        self._staging: Optional[StagingPool] = None
        self._ring: Optional[DiskRing] = None
        if policy.tier is Tier.NVME:
            assert policy.nvme_path is not None
            weights, swap_size = plan_weight_layout(self.blocks, self.plan.disk_weight_blocks, swap_size)
            self._swap = SwapStore(policy.nvme_path, records, swap_size, weights)
            self._staging = StagingPool(max(_round_up(self.plan.ring_bytes, 4096), 4096))
            self._ring = DiskRing(self._swap, self._staging, self.plan.ring_bytes,
                                  ring_depth_for(self.plan.ring_bytes, largest_record))
        self._device_tier = DeviceTier(policy.device, policy.device_memory)
        self._copies = CopyContext(policy.device)
        self._order = ForwardOrder(len(self.blocks))
        self._streamer = WeightStreamer(self._device_tier, self._copies, self._next_in_forward_order,
                                        settled=lambda block: not self._worker.is_pending(block.index))
        self._saved_tensor_hooks: List[object] = []
        self._states: Dict[int, List[GroupState]] = {}
        self._where: Dict[int, Tuple[Block, GroupState, int]] = {}
        self._trainable_ids: Dict[int, List[int]] = {}
        self._upload_sources: Dict[int, torch.Tensor] = {}
        try:
            self._materialize()
            if self._ring is not None:
                self._ring.drain()
        except BaseException:
            if self._swap is not None:  # nothing of a failed wrap() stays on disk
                self._swap.close()
            raise
        trainable = [s.param for b in self.blocks for s in b.slots if s.trainable]
        defaults = dict(lr=policy.lr, betas=policy.betas, eps=policy.eps, weight_decay=policy.weight_decay)
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        self.optimizer = EngineOptimizer(optimizer_groups(policy.param_groups, trainable, names), defaults,
                                         self._step, self._zero_grad)
        self._slot_groups = slot_group_indices(self.optimizer.param_groups, self._states.values())
        self._tracker = BackwardTracker(policy.grad_accumulation_steps)
        cores = usable_cores()
        self._worker = StepWorker(max(1, cores // 2) if policy.device.type == "cpu" else cores,
                                  on_next=self._read_ahead_of if self._ring is not None else None)
        self._needs_upload: set = set()
        self._updated_early: set = set()
        self._early_hyper: Optional[Tuple[AdamHyper, ...]] = None
        self._block_norms: Dict[int, list] = {}
        self._param_position = {id(p): i for i, p in enumerate(module.parameters())}
        self._stats = dict(steps=0, skipped_steps=0, block_updates=0, early_block_updates=0,
                           update_seconds=0.0, wait_seconds=0.0)
        self._nonfinite = NonFiniteSkips()
        self._clock = PhaseClock()
        self._hooks = HookSet()
        self._hooks.attach(module, self.blocks, param_owners(module), self._ensure_blocks, self._leave_blocks,
                           self._on_backward_begin, self._on_grad)
        self._hooks.attach_root_context(module, self._enter_forward, self._exit_forward)
        setattr(module, _MARKER, weakref.ref(self))

    # ----- setup -----------------------------------------------------------------------------------
    def _materialize(self) -> None:
        """Copy every parameter into its block's flat device buffer, re-point `.data`, build optimizer state."""
        streamed = set(self.plan.streamed_blocks)
        state_on_host = self.policy.tier is not Tier.GPU
        state_device = torch.device("cpu") if state_on_host else self.policy.device
        for block in self.blocks:
            states = []
            for group in block.groups:
                buffer = self._device_tier.allocate(group.numel, group.dtype, f"block {block.name!r}")
                with torch.no_grad():
                    for slot in group.slots:
                        buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
                group.device_buffer = buffer
                group.point_params_at(buffer)
                for slot in group.slots:
                    slot.param.grad = None
                if group.trainable_numel:
                    state = (DiskGroupState(group, self._ring, self._copies) if self._ring is not None
                             else GroupState(group, state_device, state_on_host, self._copies))
                    states.append(state)
                    if state_on_host and self.policy.device.type != "cpu":
                        source = self._copies.empty_host(group.trainable_numel, group.dtype)
                        source.copy_(buffer[:group.trainable_numel])  # an upload sends all of it, updated or not
                        self._upload_sources[id(state)] = source
                    for index, slot in enumerate(group.trainable_slots):
                        self._where[id(slot.param)] = (block, state, index)
            self._states[block.index] = states
            if block.name in streamed:
                self._streamer.adopt(block, self._ring if block.name in self.plan.disk_weight_blocks else None)
            self._trainable_ids[block.index] = [id(s.param) for s in block.slots if s.trainable]
        for sub in self.module.modules():
            for key, buf in sub._buffers.items():
                if buf is not None and buf.device != self.policy.device:
                    sub._buffers[key] = buf.to(self.policy.device)

    # ----- hooks -----------------------------------------------------------------------------------
    def _ensure_blocks(self, blocks: List[Block]) -> None:
        """Forward pre-hook: wait for each block's pending update, make its weights resident and current.

        Runs in forward, under no_grad, and for checkpoint recompute during backward; there a streamed block
        stays pinned until the backward ends (see [Note: weight streaming])."""
        in_backward = torch._C._current_graph_task_id() != -1
        for block in blocks:
            if self._worker.is_pending(block.index):
                start = time.perf_counter()
                self._worker.wait(block.index)
                self._stats["wait_seconds"] += time.perf_counter() - start
            else:
                self._worker.wait(block.index)  # surfaces an exception of a finished update
            if block.index in self._needs_upload:
                self._upload(block)  # before a fetch, which reads the updated host copy anyway
            self._streamer.ensure(block, pin=True, prefetch=self._order.known and not in_backward)
            if in_backward and self._streamer.is_streamed(block):
                self._streamer.pin(block.index)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda index=block.index: self._streamer.unpin(index))
            if not self._order.record(block.index) and not in_backward and block.index == self._order.first \
                    and self._tracker.next_is_last:
                self._read_ahead_for_backward()  # the disk is otherwise idle during the forward

    def _leave_blocks(self, blocks: List[Block]) -> None:
        """Forward post-hook (also after an exception): the module no longer needs these blocks."""
        for block in blocks:
            self._streamer.unpin(block.index)

    def _upload(self, block: Block) -> None:
        for state in self._states[block.index]:
            group = state.group
            assert group.device_buffer is not None
            if self._streamer.is_streamed(block):
                self._streamer.upload(block, group)  # a released block reads the host copy when fetched
            else:
                self._copies.upload(id(group), group.device_buffer[:group.trainable_numel], self._host_weights(state))
            self._copies.use_upload(id(group))  # the compute stream waits for it; see [Note: CUDA streams]
        self._needs_upload.discard(block.index)

    def _next_in_forward_order(self, block: Block) -> Optional[Block]:
        following = self._order.after(block.index)
        return None if following is None else self.blocks[following]

    def _enter_forward(self) -> None:
        """Root pre-hook: time the forward; when streaming, autograd saves streamed weights as handles
        (fetched again in backward)."""
        self._clock.forward_begins()
        if self._streamer.active:
            context = torch.autograd.graph.saved_tensors_hooks(self._streamer.pack, self._streamer.unpack)
            context.__enter__()
            self._saved_tensor_hooks.append(context)

    def _exit_forward(self) -> None:
        if self._streamer.active and self._saved_tensor_hooks:
            self._saved_tensor_hooks.pop().__exit__(None, None, None)
        self._clock.forward_ends()

    def _on_backward_begin(self) -> None:
        self._clock.backward_begins(torch._C._current_graph_task_id())
        self._tracker.begin_backward(torch._C._current_graph_task_id())
        if self._tracker.is_last_backward:
            self._read_ahead_for_backward()

    def _read_ahead_for_backward(self) -> None:
        """Blocks update as their gradients complete, roughly in reverse forward order: start reading their
        state as soon as slots allow (from the forward on), not when each block's gradients are in."""
        if self._ring is not None and self._order.known and self.policy.max_grad_norm is None:
            order = [self.blocks[i] for i in self._order.reversed()]
            self._ring.announce([s.group for b in order for s in self._states[b.index]
                                 if isinstance(s, DiskGroupState)])

    def _on_grad(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook. See [Note: when a block may update early]."""
        block, state, index = self._where[id(param)]
        tracker = self._tracker
        if tracker.micro_batches == 0:  # a backward that did not pass through the root module's outputs
            tracker.begin_backward(torch._C._current_graph_task_id())
        tracker.fire(id(param))
        if tracker.keeps_grads_on_device:
            return
        if block.index in self._updated_early:
            raise OffloadError(
                f"parameter of block {block.name!r} received a gradient after the block was updated early; the "
                "autograd graph changed between backward passes in a way the engine cannot see ahead of time "
                "(e.g. reentrant checkpointing of a module used twice); leave grad_accumulation_steps unset")
        self._offload_grad(block, state, index, param)
        if tracker.is_last_backward and tracker.completes(self._trainable_ids[block.index]):
            if self.policy.max_grad_norm is None:
                self._early_hyper = self._hypers()
                self._updated_early.add(block.index)
                self._stats["early_block_updates"] += 1
                self._submit_update(block, self._early_hyper, 1.0)
            else:
                self._submit_norms(block)

    def _offload_grad(self, block: Block, state: GroupState, index: int, param: nn.Parameter) -> None:
        self._worker.wait(block.index)  # the previous step's update may still read this gradient buffer
        assert param.grad is not None
        nbytes = state.accumulate(index, param.grad)
        param.grad = None
        if self.policy.tier is not Tier.GPU:
            self._copies.count_to_host(nbytes)

    # ----- updates ---------------------------------------------------------------------------------
    def _host_weights(self, state: GroupState) -> Optional[torch.Tensor]:
        """Where the update writes new compute weights: the device buffer itself when the CPU computes or
        the state is on the device, else a host copy that `_upload` sends to the device."""
        group = state.group
        assert group.device_buffer is not None
        if self._streamer.is_streamed(self._where[id(group.trainable_slots[0].param)][0]):
            host = self._streamer.host_copy(group)  # None: weights on disk, the update writes them there
            return None if host is None else host[:group.trainable_numel]
        copy = self._upload_sources.get(id(state))
        return group.device_buffer[:group.trainable_numel] if copy is None else copy

    def _hypers(self) -> Tuple[AdamHyper, ...]:
        """Each optimizer group's hyperparameters as they are now (read when updates are scheduled)."""
        return tuple(AdamHyper.from_group(group) for group in self.optimizer.param_groups)

    def _submit_update(self, block: Block, hypers: Tuple[AdamHyper, ...], grad_scale: float) -> None:
        jobs = [(state, state.ready_indices(), self._host_weights(state),
                 [hypers[g] for g in self._slot_groups[id(state)]]) for state in self._states[block.index]]
        if not any(ready for _s, ready, _o, _h in jobs):
            return
        for state, ready, _out, _h in jobs:
            if ready and isinstance(state, DiskGroupState):
                state.announce()  # its disk reads start now, ahead of the worker reaching it
        stats, threads, skips, step = self._stats, self._worker.num_threads, self._nonfinite, self._stats["steps"]
        copies = self._copies
        check = self.policy.max_grad_norm is None  # with clipping the global norm decides for the whole step

        def work() -> None:
            start = time.perf_counter()
            with torch.profiler.record_function("offload::cpu_step"):
                for state, ready, out, hyper in jobs:
                    if check and not grads_finite(state, threads):
                        skips.record(step, block.name)
                        if isinstance(state, DiskGroupState):
                            state.skip()  # its announced disk reads would otherwise hold ring slots
                        continue
                    copies.release_source(id(state.group))  # the last upload of `out` has read it
                    state.update(ready, hyper, grad_scale, out, threads)
            stats["update_seconds"] += time.perf_counter() - start

        if self._streamer.is_streamed(block) and self._ring is not None:
            self._streamer.invalidate(block)  # disk reads a prefetch started would be stale
        self._worker.submit(block.index, work, self._priority(block))
        self._stats["block_updates"] += 1
        self._order.known = True
        if self._streamer.is_streamed(block) or any(id(state) in self._upload_sources for state, *_rest in jobs):
            self._needs_upload.add(block.index)

    def _submit_norms(self, block: Block) -> None:
        states = self._states[block.index]
        norms = self._block_norms

        def work() -> None:
            norms[block.index] = [n for state in states for n in state.grad_norms()]

        self._worker.submit(block.index, work, self._priority(block))

    def _priority(self, block: Block) -> int:
        """Updates run in the order the next forward needs the blocks (see scheduler/worker.py)."""
        return self._order.priority(block.index)

    def _read_ahead_of(self, block_indices: List[int]) -> None:
        """Worker callback: the ring reads ahead the state of the queued updates, in the order they will run."""
        assert self._ring is not None
        self._ring.announce([s.group for i in block_indices for s in self._states.get(i, ())
                             if isinstance(s, DiskGroupState)], replace=True)

    def _update_order(self) -> List[Block]:
        """Blocks in the order the forward used them first, then any never seen in a forward."""
        return [self.blocks[i] for i in self._order.update_order()]

    def _step(self) -> None:
        """engine.optimizer.step(): schedule the remaining block updates in forward order and return.
        Ctrl-C waits until the step is fully scheduled (offload/_interrupts.py)."""
        self._check_open()
        self._worker.raise_if_failed()
        with deferred_keyboard_interrupt():
            self._schedule_step()

    def _schedule_step(self) -> None:
        self._tracker.end_step()
        hyper = self._hypers()
        for block in self.blocks:  # gradients still on the device (fewer backward calls than declared)
            for slot in block.slots:
                if slot.trainable and slot.param.grad is not None:
                    _b, state, index = self._where[id(slot.param)]
                    self._offload_grad(block, state, index, slot.param)
        if self._updated_early and self._early_hyper != hyper:
            warnings.warn("optimizer hyperparameters changed between the last backward and step(); blocks updated "
                          "early used the earlier values (set them before the last backward)", RuntimeWarning)
        scale = 1.0
        if self.policy.max_grad_norm is not None:
            self._worker.wait_all()
            per_param = [n for b in self.blocks for n in (
                self._block_norms[b.index] if b.index in self._block_norms
                else [n for s in self._states[b.index] for n in s.grad_norms()])]
            per_param.sort(key=lambda pn: self._param_position[id(pn[0])])  # torch's order: model.parameters()
            total_norm, scale = clip_scale([n for _p, n in per_param], self.policy.max_grad_norm)
            if not math.isfinite(total_norm):
                self._skip_step(f"the gradient norm is {total_norm}")
                return
        for block in self._update_order():
            if block.index not in self._updated_early:
                self._submit_update(block, hyper, scale)
        self._finish_step()

    def _skip_step(self, reason: str) -> None:
        self._stats["skipped_steps"] += 1
        warnings.warn(f"offload: optimizer step {self._stats['steps'] + 1} skipped: {reason}", RuntimeWarning)
        self._finish_step()

    def _finish_step(self) -> None:
        self._updated_early.clear()
        self._block_norms.clear()
        self._early_hyper = None
        self._stats["steps"] += 1

    def _zero_grad(self, set_to_none: bool = True) -> None:
        self._check_open()
        for block in self.blocks:
            for slot in block.slots:
                if slot.trainable:
                    slot.param.grad = None
            if not set_to_none:
                self._worker.wait(block.index)
            for state in self._states[block.index]:
                state.zero_grad(set_to_none)

    # ----- public API ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The wrapped model's forward."""
        self._check_open()
        self._worker.raise_if_failed()
        return self.module(*args, **kwargs)

    def step(self) -> None:
        """Apply AdamW to every block (through `engine.optimizer.step()`, so LR schedulers see it)."""
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients, as `torch.optim.Optimizer.zero_grad`."""
        self.optimizer.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Wait for every pending block update, so that the module's weights are the current ones."""
        self._check_open()
        self._worker.wait_all()
        if self._ring is not None:
            try:
                self._ring.flush_writes()  # reads ahead (of groups that got no update) are kept
            except BaseException as exc:  # a swap write failed: the file no longer holds the state
                self._worker.fail(exc)
                raise
        for block in self.blocks:
            if block.index in self._needs_upload:
                self._upload(block)
        self._copies.synchronize()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The model's state dict as full, real CPU tensors (copies), with all updates applied."""
        self.synchronize()
        streamed = {}
        for group, host in self._streamer.host_weights_of():
            for slot in group.slots:
                streamed[id(slot.param)] = host[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return {k: (streamed[id(v)] if id(v) in streamed else v.detach()).to("cpu", copy=True)
                for k, v in self.module.state_dict(keep_vars=True).items()}

    def stats(self) -> Dict[str, float]:
        """Counters since `wrap()`: steps, skipped steps, block updates (and how many ran during backward),
        bytes moved per link, seconds in forward and backward, seconds spent updating (worker) and waiting
        for updates (training thread), the nvme ring's disk waits, device-tier bytes."""
        out: Dict[str, float] = dict(self._stats)
        out["skipped_steps"] += self._nonfinite.steps  # steps where some block had non-finite gradients
        out["skipped_block_updates"] = self._nonfinite.block_skips
        out.update(forward_seconds=self._clock.forward_seconds, backward_seconds=self._clock.backward_seconds)
        out.update(bytes_device_to_host=self._copies.bytes_to_host, bytes_host_to_device=self._copies.bytes_to_device,
                   copies_on_side_streams=self._copies.async_copies,
                   device_bytes=self._device_tier.in_use, device_peak_bytes=self._device_tier.peak,
                   device_over_budget_events=self._device_tier.over_budget_events,
                   block_fetches=self._streamer.fetches, block_evictions=self._streamer.evictions,
                   block_prefetches=self._streamer.prefetches,
                   bytes_disk_read=0 if self._swap is None else self._swap.bytes_read,
                   bytes_disk_written=0 if self._swap is None else self._swap.bytes_written,
                   host_state_bytes=sum(s.nbytes for states in self._states.values() for s in states
                                        if s.on_host))
        if self._ring is not None:
            out.update(self._ring.stats())
        return out

    def close(self) -> None:
        """Finish pending updates, remove every hook, bring streamed weights back and free the optimizer
        state: the module stays usable as a plain PyTorch model with its trained weights. Idempotent.
        An update that failed and was not reported yet is raised after the cleanup."""
        if self._closed:
            return
        failure: Optional[BaseException] = None
        try:
            self._worker.close()
            if self._ring is not None:
                self._ring.drain()
        except Exception as exc:  # still clean up; report it at the end
            failure = exc
        self._closed = True
        for block in self.blocks:
            if block.index in self._needs_upload:
                self._upload(block)
        self._streamer.restore_all()
        self._copies.synchronize()  # the module is plain PyTorch from here on
        self._hooks.remove()
        self._states.clear()
        if self._swap is not None:
            self._swap.close()
        if self._staging is not None:
            self._staging.close()
        self._where.clear()
        if getattr(self.module, _MARKER, None) is not None:
            delattr(self.module, _MARKER)
        if failure is not None:
            raise failure
        if self._worker.failure is not None:
            warnings.warn(f"offload: closed after a failed update ({self._worker.failure}); the model keeps "
                          "inconsistent weights (some blocks updated, some not): load a checkpoint into it",
                          RuntimeWarning)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this engine is closed; wrap the model again to keep training")

    def __repr__(self) -> str:
        return f"Engine(tier={self.policy.tier.value}, blocks={len(self.blocks)}, device={self.policy.device})"


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


__all__ = ["Engine"]
