"""The training step as named phases, in the order they run; the hooks (hooks.py) call them.

Forward: `begin_root_forward`, then per block `pre_forward` (wait for the block's pending update, push
its updated weights, fetch it if streamed) and `post_forward`; `end_root_forward`. Backward:
`begin_backward` (the first gradient of the module's outputs), then `on_grad` per parameter (the gradient
leaves the device into its group's accumulator; when the declared last backward completes a block, its
update is scheduled at once). `schedule_step` (optimizer.step()) schedules every block not updated early;
the worker runs each `UpdateJob` in `BlockJobs.run_block_update` (block_jobs.py). The path of one gradient: autograd ->
`on_grad` -> `GradAccumulator.accumulate` -> `UpdateJob` -> `run_block_update` -> `GroupState.update`
-> `adamw` over the group's `StateStore` (memory, or the swap file through the ring) -> the weight home
-> `push` at the block's next `pre_forward`. See docs/design.md, "Map", and the Notes cited below.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from offload._interrupts import deferred_keyboard_interrupt
from offload._system import return_freed_memory
from offload.distributed.data_parallel import DataParallel
from offload.distributed.guard import refuse_outer_data_parallel, refuse_ranks_unknown_at_wrap
from offload.errors import OffloadError
from offload.policy import OffloadPolicy, Tier
from offload.scheduler.blocks.block import Block, Residency
from offload.scheduler.phases.clipping import clip_in_place, clip_scale_of, global_norm
from offload.scheduler.blocks.forward_order import ForwardOrder
from offload.scheduler.grads.grad_home import released_gradient
from offload.scheduler.worker.block_jobs import BlockJobs
from offload.scheduler.modes.grad_sync import GradSync
from offload.scheduler.grads.backward_tracker import BackwardTracker
from offload.scheduler.grads.held_grad import is_held
from offload.scheduler.worker.jobs import GroupUpdate, NormJob, UpdateJob
from offload.scheduler.records.module_weights import ModuleWeights
from offload.scheduler.grads.nonfinite import NonFiniteSkips
from offload.scheduler.phases.optimizer_view import EngineOptimizer
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.setup.placement import Tiers
from offload.scheduler.records.runtime import BlockRuntime, SlotRef, SlotTable
from offload.scheduler.phases.step_stats import StepCounters, engine_stats
from offload.trace import Tracer
from offload.scheduler.state.adamw import AdamHyper
from offload.scheduler.worker.step_worker import StepWorker


HEAP_SLACK_BYTES = 16 << 20  # freed heap bytes a step keeps before trimming (half the RSS constant)


class StepPipeline:
    """The phases of a training step over one model's blocks (each with its runtime record, `block.runtime`)."""

    def __init__(self, blocks: List[Block], module: nn.Module, policy: OffloadPolicy, tiers: Tiers,
                 tracer: Tracer, num_threads: int, optimizer_groups: List[dict],
                 dp: Optional[DataParallel] = None) -> None:
        self.blocks = blocks
        self.dp = dp  # data-parallel mode: each block's update averages, steps a part, gathers (grad_sync.py)
        self.sync = GradSync(dp, num_threads) if dp is not None else None
        self.slots = SlotTable(blocks, module)
        self.tiers = tiers
        self.tracer = tracer
        self.policy = policy
        self.module = module
        self.order = ForwardOrder(len(blocks))
        self.tracker = BackwardTracker(policy.grad_accumulation_steps)
        self.streamer = tiers.streamer
        self.counters = StepCounters()
        self.clock = PhaseClock()
        defaults = dict(lr=policy.lr, betas=policy.betas, eps=policy.eps, weight_decay=policy.weight_decay)
        self.optimizer = EngineOptimizer(optimizer_groups, defaults, self.step, self.zero_grad)
        self.closed = False
        # last: nothing above may fail with the worker's thread already running
        self.worker = StepWorker(num_threads, on_next=self._read_ahead_of if tiers.ring is not None else None)
        if tiers.grad_pool is not None:
            tiers.grad_pool.bind(self.worker.has_work)  # an update running or queued will give bytes back
        self._early_hyper: Optional[Tuple[AdamHyper, ...]] = None
        self._saved_tensor_hooks: List[object] = []
        self.weights = ModuleWeights(blocks, self)  # the module's own state_dict/load_state_dict, weight writes
        self.jobs = BlockJobs(tracer, self.counters, self.weights, num_threads, self.sync)  # run on the worker
        self._root_grad_enabled = False  # whether the root forward in progress records a graph
        self.streamer.read_through.serve(self)  # streamed parameters read outside their forward open their block

    # ----- forward -----------------------------------------------------------------------------------
    def begin_root_forward(self) -> None:
        """Time the forward; when streaming, autograd saves streamed weights as handles (fetched again in
        backward)."""
        refuse_ranks_unknown_at_wrap(self.dp)  # a process group started after wrap()
        refuse_outer_data_parallel(self.module)  # DDP / FSDP around the engine's module
        self._root_grad_enabled = torch.is_grad_enabled()
        self.clock.forward_begins()
        if self.streamer.active:
            context = torch.autograd.graph.saved_tensors_hooks(self.streamer.pack, self.streamer.unpack)
            context.__enter__()
            self._saved_tensor_hooks.append(context)

    def end_root_forward(self) -> None:
        if self.streamer.active and self._saved_tensor_hooks:
            self._saved_tensor_hooks.pop().__exit__(None, None, None)
        self.clock.forward_ends()

    def pre_forward(self, blocks: List[Block]) -> None:
        """Wait for each block's pending update, push its new weights, make it resident.

        Runs in forward, under no_grad, and for checkpoint recompute during backward; there a streamed block
        stays pinned until the backward ends (see [Note: weight streaming])."""
        in_backward = torch._C._current_graph_task_id() != -1
        for block in blocks:
            runtime = _runtime(block)
            if block.residency is Residency.RESIDENT and not all(g.params_in_place() for g in block.groups):
                raise OffloadError(
                    f"the parameters of block {block.name!r} no longer point into the engine's buffers: the model "
                    "was moved or converted after offload.wrap() (model.to(), .double(), .half(), .cuda()), so "
                    "training would not reach them; convert the model first, then wrap it (engine.close() first)")
            self.weights.adopt(runtime)  # before the wait: a write made while the update was pending is refused
            self._wait_for_update(block, counted=True)
            if runtime.needs_push:
                self.push(runtime)  # before a fetch, which reads the updated home anyway
            if runtime.streamed:
                following = self._next_in_forward_order(block) if self.order.known and not in_backward else None
                self.streamer.ensure(block, pin=True, prefetch=following,
                                     settled=following is None or not self.worker.is_pending(following.index))
                if in_backward:
                    self.streamer.pin(block.index)
                    torch.autograd.Variable._execution_engine.queue_callback(
                        lambda index=block.index: self.streamer.unpin(index))
                self.streamer.enter_forward(block)
            if not in_backward and self.tracker.profile is None and self._root_grad_enabled:
                self.tracker.predict_from_forward(runtime.trainable_ids, torch.is_grad_enabled())
            if not self.order.record(block.index) and not in_backward and block.index == self.order.first \
                    and self.tracker.next_is_last:
                self._read_ahead_for_backward()  # the disk is otherwise idle during the forward

    def post_forward(self, blocks: List[Block]) -> None:
        """The module no longer needs these blocks (also after an exception)."""
        for block in blocks:
            self.streamer.leave_forward(block)
            self.streamer.unpin(block.index)

    def push(self, runtime: BlockRuntime) -> None:
        """Send a block's updated weights from their homes to the device (a released block fetches them)."""
        resident = runtime.block.residency is Residency.RESIDENT
        for group in runtime.groups:
            if group.state is not None:
                group.home.push(resident)
        runtime.needs_push = False

    # ----- backward ----------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """The first gradient of the module's outputs in a graph task. The task counts as a backward only at
        its first accumulated gradient (`on_grad`): `torch.autograd.grad` (a gradient penalty) passes here
        too but writes no `.grad`, and torch would not count it."""
        task = torch._C._current_graph_task_id()
        self.clock.backward_begins(task)
        if self.tracker.is_new(task):
            self.tracker.announce(task)
            if self.tracker.next_is_last:
                self._read_ahead_for_backward()

    def on_grad(self, param: nn.Parameter) -> None:
        """A parameter's gradient is complete for this backward. See [Note: when a block may update early]."""
        ref = self.slots[param]
        tracker, block = self.tracker, ref.block
        tracker.accumulating(torch._C._current_graph_task_id())
        tracker.fire(id(param))
        if tracker.keeps_grads_on_device:
            return
        if tracker.is_last_backward:
            tracker.watch_completion()  # blocks update during it: a failure partway must be told apart
        if block.updated_early:
            raise OffloadError(
                f"parameter of block {block.block.name!r} received a gradient after the block was updated early; "
                "the autograd graph changed between backward passes in a way the engine cannot see ahead of time "
                "(e.g. reentrant checkpointing of a module used twice); leave grad_accumulation_steps unset")
        self._offload_grad(ref, param)
        if tracker.is_last_backward and tracker.completes(block.trainable_ids):
            if self.policy.max_grad_norm is None:
                self._early_hyper = self.read_hypers()
                block.updated_early = True
                self.counters.early_block_updates += 1
                self.submit_update(block, self._early_hyper, 1.0)
            else:
                self.worker.submit(block.block.index, NormJob(block, self.jobs.run_block_norms), self._priority(block))

    def _offload_grad(self, ref: SlotRef, param: nn.Parameter) -> None:
        """Move `param.grad` into its accumulator and leave the stand-in there ([Note: where a gradient is
        after backward]): a plain tensor means `.grad` was None before autograd wrote it (cleared since the
        engine took the last one), a HeldGrad with `pending` that autograd accumulated into it."""
        self._wait_for_update(ref.block.block, counted=False)  # the last update may still read the gradients
        if ref.block.reduced:
            raise OffloadError(
                f"a gradient of block {ref.block.block.name!r} arrived after this step's gradients of it were "
                "averaged across the data-parallel ranks (by clip_grad_norm_, or an update during the last "
                "declared backward): call backward before clipping, and step() before the next backward")
        grad, grads = param.grad, ref.state.grads
        if is_held(grad):
            pending = grad.pop_pending()
            if pending is None:
                return
            nbytes = grads.accumulate(ref.index, pending)
        else:
            assert grad is not None
            nbytes = grads.accumulate(ref.index, grad, fresh=True)
        param.grad = grads.held_for(ref.index)
        if self.policy.tier is not Tier.GPU:
            self.tiers.copies.count_to_host(nbytes)

    def _collect_grads(self) -> None:
        """Before the step reads the gradients: take those still in `.grad` (fewer backward calls than
        declared, or a `.grad` the user set), and forget those cleared outside the engine (model.zero_grad())."""
        for param in self.slots:
            grad, ref = param.grad, self.slots[param]
            grads = ref.state.grads
            if grad is not None and not (is_held(grad) and grad.pending is None):
                self._offload_grad(ref, param)
            elif grad is not None and ref.index in grads.lost and not ref.block.updated_early:
                # held since an update of an earlier step gave its bytes back (nvme gradient window)
                raise released_gradient(ref.state.group.trainable_slots[ref.index].name)
            elif grad is None and grads.has_grad[ref.index]:
                if ref.block.updated_early:
                    raise self._zeroed_after_early_update(ref.block.block.name)
                grads.forget(ref.index)

    def _read_ahead_for_backward(self) -> None:
        """Blocks update as their gradients complete, roughly in reverse forward order: start reading their
        state as soon as slots allow (from the forward on), not when each block's gradients are in."""
        if self.tiers.ring is not None and self.order.known and self.policy.max_grad_norm is None:
            order = [self.blocks[i] for i in self.order.reversed()]
            self.tiers.ring.announce(_disk_groups(order))

    # ----- step --------------------------------------------------------------------------------------
    def read_hypers(self) -> Tuple[AdamHyper, ...]:
        """Each optimizer group's hyperparameters as they are now (read when updates are scheduled)."""
        return tuple(AdamHyper.from_group(group) for group in self.optimizer.param_groups)

    def step(self) -> None:
        """engine.optimizer.step(): schedule the remaining block updates in forward order, then (unless
        `overlap_step`) wait until every block's new weights are in its parameters, as torch's step leaves
        them. Ctrl-C waits until the step is fully scheduled (offload/_interrupts.py); in the wait after
        that, it reaches the user and the updates run on ([Note: step returns early])."""
        self.check_open()
        self.worker.raise_if_failed()
        refuse_ranks_unknown_at_wrap(self.dp)  # a process group started after wrap(), e.g. for DDP
        with self.tracer.span("step()"), deferred_keyboard_interrupt():
            self.schedule_step()
        if not self.policy.overlap_step:
            start = time.perf_counter()
            with self.tracer.span("wait for updates", "step()"):
                self.settle_weights()
            self.counters.wait_seconds += time.perf_counter() - start
        if self.policy.bounds_host_memory:
            # autograd's temporaries of this step, kept freed by glibc: RSS stays near the budgets asked for
            return_freed_memory(if_over=HEAP_SLACK_BYTES)

    def schedule_step(self) -> None:
        """optimizer.step(): offload the gradients still on the device, clip, and schedule every block's update
        in forward order."""
        self.weights.refuse_unfrozen()
        if self.tracker.failed_last_backward:
            warnings.warn("offload: step() after the last declared backward raised partway: the blocks updated "
                          "during it stepped on their complete gradients, the others now step on what they "
                          "received (engine.load(checkpoint) instead goes on exactly)", RuntimeWarning)
        self.tracker.end_step()
        hyper = self.read_hypers()
        self._collect_grads()
        if any(_runtime(b).updated_early for b in self.blocks) and self._early_hyper != hyper:
            warnings.warn("optimizer hyperparameters changed between the last backward and step(); blocks updated "
                          "early used the earlier values (set them before the last backward)", RuntimeWarning)
        scale = 1.0
        if self.policy.max_grad_norm is not None:
            self.worker.wait_all()
            total_norm, scale = self._global_norm(self.policy.max_grad_norm)
            if not math.isfinite(total_norm):
                self.counters.skipped_steps += 1
                warnings.warn(f"offload: optimizer step {self.counters.steps + 1} skipped: the gradient norm is "
                              f"{total_norm}", RuntimeWarning)
                self.finish_step()
                return
        for index in self.order.update_order():
            if not _runtime(self.blocks[index]).updated_early:
                self.submit_update(_runtime(self.blocks[index]), hyper, scale)
        self.finish_step()

    def submit_update(self, runtime: BlockRuntime, hypers: Tuple[AdamHyper, ...], grad_scale: float) -> None:
        """Queue the block's update on the worker (nothing when no parameter of it has a gradient)."""
        self.weights.adopt(runtime)
        parts = [GroupUpdate(g, g.state.grads.ready_indices(), g.state.hypers_of(hypers), g.home.update_target())
                 for g in runtime.groups if g.state is not None]
        if not any(part.ready for part in parts) and (self.dp is None or not parts):
            return  # data-parallel: another rank may have gradients for the block; every rank runs its job
        for part in parts:
            if part.ready:
                part.runtime.state.store.announce()  # its reads (disk) start now, ahead of the worker reaching it
        if runtime.streamed:
            self.streamer.invalidate(runtime.block)  # disk reads a prefetch started would be stale
        job = UpdateJob(runtime, parts, grad_scale, self.policy.max_grad_norm is None, self.counters.steps,
                        self.jobs.run_block_update)
        self.worker.submit(runtime.block.index, job, self._priority(runtime))
        self.counters.block_updates += 1
        self.order.known = True
        if runtime.pushes:
            runtime.needs_push = True

    def _global_norm(self, max_norm: float) -> Tuple[float, float]:
        """(total norm, gradient scale) over every rank's gradients (the worker is idle). Data-parallel:
        each block's averaged gradient, reduced on the worker first, then the parts' squares summed across
        the ranks (the same total on every rank)."""
        if self.sync is None or self.dp is None:
            return global_norm(self.blocks, self.slots, max_norm)
        for index in self.order.update_order():
            runtime = _runtime(self.blocks[index])
            if runtime.states and runtime.shard_sumsq is None:
                self.worker.submit(index, NormJob(runtime, self.jobs.run_block_norms), self._priority(runtime))
        self.worker.wait_all()
        local = sum(_runtime(b).shard_sumsq or 0.0 for b in self.blocks)
        return clip_scale_of(math.sqrt(self.dp.sum_all(local)), max_norm)

    def finish_step(self) -> None:
        self.reset_step()
        self.counters.steps += 1

    def reset_step(self) -> None:
        """Forget the step in progress: blocks updated early, gradient norms, the early hyperparameters."""
        for block in self.blocks:
            _runtime(block).end_step()
        self._early_hyper = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """engine.optimizer.zero_grad(): drop the accumulated gradients (or zero them)."""
        self.check_open()
        early = [b.name for b in self.blocks if _runtime(b).updated_early]
        if early and self.tracker.failed_last_backward:
            raise self.tracker.failed_backward_error("zero_grad()", early[0])
        if early:  # torch would now step on no gradient at all; these blocks already stepped on the gradients
            raise self._zeroed_after_early_update(early[0])
        for block in self.blocks:
            states = _runtime(block).states
            if not set_to_none or any(s.grads.windowed for s in states) or self.dp is not None:
                self.worker.wait(block.index)  # the update may still read (or give back) the buffer
            _runtime(block).forget_averages()
            for state in states:
                state.grads.zero(set_to_none)
            _runtime(block).end_step()  # norms and (data-parallel) averages of the gradients just dropped
        self.tracker.end_step()  # the backward passes counted toward the next step held those gradients

    @staticmethod
    def _zeroed_after_early_update(block_name: str) -> OffloadError:
        return OffloadError(
            f"zero_grad() between the last backward and step(): with grad_accumulation_steps declared, blocks "
            f"(first: {block_name!r}) were already updated during that backward; call zero_grad() after step(), "
            "or leave grad_accumulation_steps unset")

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
        """engine.clip_grad_norm_(): torch.nn.utils.clip_grad_norm_ over the gradients the engine holds (scaled
        in place, so the step and a later norm see them clipped); returns the total norm before clipping."""
        self.check_open()
        self.worker.raise_if_failed()
        if float(norm_type) != 2.0:
            raise OffloadError(f"engine.clip_grad_norm_ computes the L2 norm only (norm_type=2), got {norm_type!r}")
        early = [b.name for b in self.blocks if _runtime(b).updated_early]
        if early:
            raise OffloadError(
                f"engine.clip_grad_norm_() after blocks (first: {early[0]!r}) were updated during the last backward "
                "(grad_accumulation_steps declared, no max_grad_norm): pass max_grad_norm= to offload.wrap, which "
                "clips before any update, or leave grad_accumulation_steps unset")
        self._collect_grads()
        self.worker.wait_all()  # norm jobs, and (overlap_step) updates that still read the gradients
        return clip_in_place(self.blocks, self.slots, max_norm, error_if_nonfinite, self._global_norm(max_norm))

    # ----- the user's model.state_dict() and model.load_state_dict() (module_weights.py) ---------------
    def before_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        self.weights.before_state_dict(blocks)

    def before_load_state_dict(self, blocks: Optional[List[Block]] = None) -> None:
        self.weights.before_load_state_dict(blocks)

    def after_load_state_dict(self) -> None:
        """The loaded weights become the master weights (the Adam moments stay, as torch.optim.AdamW's do)."""
        self.weights.adopt_all()

    def engine_reads(self) -> ContextManager[None]:
        return self.weights.engine_reads()

    # ----- streamed parameters read outside their forward (read_through.BlockAccess) -------------------
    def block_of(self, param: nn.Parameter) -> Optional[Block]:
        return self.streamer.block_of(param)

    def open_for_read(self, block: Block) -> None:
        """The block's pending update landed and its weights resident and pinned, for one operation."""
        self.check_open()
        self._wait_for_update(block, counted=False)
        if _runtime(block).needs_push:
            self.push(_runtime(block))
        self.streamer.ensure(block, pin=True)

    def pin_views(self, tensors: List[torch.Tensor]) -> None:
        self.streamer.pin_views(tensors)

    def close_after_read(self, block: Block) -> None:
        """A write through the parameters is kept now (before anything can release the block)."""
        try:
            self.weights.adopt(_runtime(block))
        finally:
            self.streamer.unpin(block.index)

    # ----- synchronization ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Every pending update done, every write on disk, every updated weight on the device."""
        self.worker.wait_all()
        if self.tiers.ring is not None:
            try:
                self.tiers.ring.flush_writes()  # reads ahead (of groups that got no update) are kept
            except Exception as exc:  # a swap write failed: the file no longer holds the state. (Ctrl-C only
                # interrupts the wait: the writes go on, and the next flush waits for them.)
                self.worker.fail(exc)
                raise
        self.settle_weights()

    def settle_blocks(self, blocks: List[Block]) -> None:
        """These blocks' pending updates done and their weights in the parameters."""
        for block in blocks:
            self._wait_for_update(block, counted=False)
            if _runtime(block).needs_push:
                self.push(_runtime(block))
        self.tiers.copies.synchronize()

    def is_pending(self, block: Block) -> bool:
        return self.worker.is_pending(block.index)

    def settle_weights(self) -> None:
        """Every pending update done and its weights in the parameters (swap writes may still be in flight)."""
        self.worker.wait_all()
        for block in self.blocks:
            if _runtime(block).needs_push:
                self.push(_runtime(block))
        self.tiers.copies.synchronize()

    @contextlib.contextmanager
    def replacing_state(self) -> Iterator[None]:
        """Around a checkpoint load: an update that failed unseen counts as a failure; a failed state is
        let through (the load replaces all of it) and stays failed if the load changes nothing."""
        self.worker.collect_failure()
        prior = self.worker.failure
        if prior is not None:
            self.worker.clear_failure()
            if self.tiers.ring is not None:
                try:
                    self.tiers.ring.drain()  # every slot comes back
                except (OSError, OffloadError):
                    pass  # errors of writes the failed state made; the load rewrites every record
        try:
            yield
        except BaseException:
            if prior is not None:
                self.worker.fail(prior)  # nothing was loaded: the state is still the inconsistent one
            raise

    def close(self) -> Optional[BaseException]:
        """Finish the updates, push every new weight, bring streamed blocks back; returns an update's error
        that was never reported (raised by the caller after its own cleanup)."""
        failure: Optional[BaseException] = None
        try:
            self.worker.close()
            if self.tiers.ring is not None:
                self.tiers.ring.drain()
        except Exception as exc:  # still clean up; report it at the end
            failure = exc
        self.closed = True
        for block in self.blocks:
            if _runtime(block).needs_push:
                self.push(_runtime(block))
        self.streamer.restore_all()
        self.tiers.copies.synchronize()  # the module is plain PyTorch from here on
        for param in self.slots:
            if is_held(param.grad):
                param.grad = None  # the gradients the engine held go with its buffers
        self.slots.clear()
        return failure

    def restore_counters(self, steps: int, skipped_steps: int) -> None:
        """A checkpoint's step counts (its skips for non-finite gradients are part of `skipped_steps`)."""
        self.counters.steps, self.counters.skipped_steps = steps, skipped_steps
        self.jobs.nonfinite = NonFiniteSkips()

    def check_open(self) -> None:
        if self.closed:
            raise OffloadError("this engine is closed; wrap the model again to keep training")

    # ----- order -------------------------------------------------------------------------------------
    def _wait_for_update(self, block: Block, counted: bool) -> None:
        """Wait for the block's pending update (an update that finished with an error raises here)."""
        if not self.worker.is_pending(block.index):
            self.worker.wait(block.index)  # surfaces an exception of a finished update
            return
        start = time.perf_counter()
        with self.tracer.span("wait for update", block.name):
            self.worker.wait(block.index)
        if counted:
            self.counters.wait_seconds += time.perf_counter() - start

    def _priority(self, runtime: BlockRuntime) -> int:
        """Updates run in the order the next forward needs the blocks (see scheduler/worker.py); in
        data-parallel mode in the order they were submitted, which is the same on every rank (each job runs
        collectives, and every rank must run them in the same order)."""
        return 0 if self.dp is not None else self.order.priority(runtime.block.index)

    def _next_in_forward_order(self, block: Block) -> Optional[Block]:
        following = self.order.after(block.index)
        return None if following is None else self.blocks[following]

    def _read_ahead_of(self, block_indices: List[int]) -> None:
        """Worker callback: the ring reads ahead the state of the queued updates, in the order they will run."""
        assert self.tiers.ring is not None
        self.tiers.ring.announce(_disk_groups([self.blocks[i] for i in block_indices]), replace=True)

    def stats(self) -> Dict[str, float]:
        return engine_stats(self.counters, self.jobs.nonfinite, self.clock, self.tiers, self.blocks)


def _runtime(block: Block) -> BlockRuntime:
    assert block.runtime is not None, "the block has no runtime record (not materialized, or closed)"
    return block.runtime


def _disk_groups(blocks: List[Block]) -> list:
    """The flat groups of these blocks whose state the ring reads ahead, in block order (as their stores
    see them: a rank's part in data-parallel mode)."""
    return [s.store.group for b in blocks for s in _runtime(b).states if s.store.reads_ahead]
