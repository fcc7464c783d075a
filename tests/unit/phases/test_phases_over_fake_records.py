"""The phases over fake records (phases/forward.py, backward.py, step.py, sync.py): each phase only dispatches to
the records and the modes, so every record here is a fake with the methods the phases call on a `BlockRecord`,
logging each call into one shared log, and the modes are fakes too. The small real pieces the phases read are
real: the `BackwardTracker`, the `PhaseClock`, the `ForwardOrder`, the `SlotTable` (over the fakes' parameters),
`StepHypers` and `StepCounters`. Gradients arrive through real backward passes (the post-accumulate-grad hook
calls `on_grad`), since the tracker and the clock read autograd's graph task."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import nn

from offload.errors import OffloadError
from offload.scheduler.modes.clipping import LastBackward
from offload.scheduler.modes.selection import Modes
from offload.scheduler.phases.backward import BackwardPhase
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.phases.forward import ForwardPhase
from offload.scheduler.phases.phase_clock import PhaseClock
from offload.scheduler.phases.step import StepPhase
from offload.scheduler.phases.sync import Synchronizer
from offload.scheduler.records.forward_order import ForwardOrder
from offload.scheduler.records.held_grad import HeldGrad
from offload.scheduler.records.slot_table import SlotTable
from offload.scheduler.state.adamw import AdamHyper
from offload.scheduler.state.hypers import StepHypers
from offload.scheduler.worker.counters import StepCounters
from offload.trace import Tracer

GROUPS = [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
          {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}]
HYPERS = tuple(AdamHyper.from_group(g) for g in GROUPS)


# ----- the fakes --------------------------------------------------------------------------------------------
class FakeGrads:
    """A record's gradient home, as the clip's `clip_in_place` sees it."""

    def __init__(self, log: List, index: int) -> None:
        self.log, self.index = log, index

    def scale_(self, coef: float) -> None:
        self.log.append(("scale_", self.index, coef))


class FakeRecord:
    """The methods the phases call on a `BlockRecord`, each logged as (what, block index, arguments...)."""

    def __init__(self, log: List, index: int, params: List[nn.Parameter]) -> None:
        self.log = log
        self.index = index
        self.block = SimpleNamespace(index=index, name=f"layers.{index}")
        self.params = params
        group = SimpleNamespace(trainable_slots=[SimpleNamespace(param=p) for p in params])
        state = SimpleNamespace(group=group, grads=FakeGrads(log, index))
        self.groups = [SimpleNamespace(group=group, state=state)]  # a GroupRecord: its flat group and its state
        self.states = [state]
        self.trainable_ids = [id(p) for p in params]
        self.updated_early = False
        self.needs_push = False
        self.norms: Optional[list] = ["stale"]
        self.shard_sumsq: Optional[float] = 1.0

    def _log(self, *what: Any) -> None:
        self.log.append((what[0], self.index) + what[1:])

    # forward
    def enter_forward(self, following: Optional["FakeRecord"], in_backward: bool) -> None:
        self._log("enter_forward", None if following is None else following.index, in_backward)

    def keep_writes(self) -> None:
        self._log("keep_writes")

    def settle(self, counted: bool = False) -> None:
        self._log("settle", counted)

    def show_live_weights(self) -> None:
        self._log("show_live_weights")

    def leave_forward(self) -> None:
        self._log("leave_forward")

    # backward
    def receive_grad(self, ref, param: nn.Parameter) -> None:
        assert ref.block is self and ref.param is param
        self._log("receive_grad", ref.index)

    def take_leftover_grads(self, refs) -> None:
        assert all(ref.block is self for ref in refs)
        self._log("take_leftover_grads", [ref.index for ref in refs])

    # step
    def schedule_update(self, hypers, grad_scale: float, check_finite: bool) -> None:
        self._log("schedule_update", hypers, grad_scale, check_finite)

    def end_step(self) -> None:
        self._log("end_step")

    def zero_grads(self, set_to_none: bool) -> None:
        self._log("zero_grads", set_to_none)

    def forget_speculation(self) -> None:
        self._log("forget_speculation")

    # sync
    def push(self) -> None:
        self._log("push")
        self.needs_push = False

    def guard_while_pending(self) -> None:
        self._log("guard_while_pending")

    def unpin(self) -> None:
        self._log("unpin")


class Logger:
    """Any fake whose calls are only logged: `Logger(log, "disk").flush_writes()` logs ("disk.flush_writes",)."""

    def __init__(self, log: List, name: str, **answers: Any) -> None:
        self._log, self._name, self._answers = log, name, answers

    def __getattr__(self, attr: str):
        if attr in self._answers and not callable(self._answers[attr]):
            return self._answers[attr]

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append((f"{self._name}.{attr}",) + args + tuple(kwargs.values()))
            answer = self._answers.get(attr)
            return answer(*args) if callable(answer) else answer
        return call


class FakeClipping:
    def __init__(self, log: List, watch: bool = True, scale: Optional[float] = 1.0, updates_during_backward=True,
                 checks_each_block: bool = True, last_norm: float = math.nan) -> None:
        self.log = log
        self.watch = watch
        self.scale = scale
        self.updates_during_backward = updates_during_backward  # in the declared last one
        self.checks_each_block = checks_each_block
        self.last_norm = last_norm

    def updates_in(self, backward: LastBackward) -> bool:
        return self.updates_during_backward and backward is LastBackward.DECLARED

    def watches(self, block: FakeRecord, backward: LastBackward) -> bool:
        self.log.append(("watches", block.index, backward))
        return self.watch

    def block_complete(self, block: FakeRecord, hypers: StepHypers, backward: LastBackward) -> None:
        self.log.append(("block_complete", block.index, backward))

    def scale_for_step(self, blocks, slots, step: int, hypers) -> Optional[float]:
        self.log.append(("scale_for_step", [b.index for b in blocks], step))
        return self.scale

    def drop_step(self) -> None:
        self.log.append(("drop_step",))


class FakeSavedTensors:
    """The root's saved-tensor hooks, as the forward phase sees them."""

    def __init__(self, log: List) -> None:
        self.log = log
        self.meter = Logger(log, "meter")

    def context(self, training: bool, tokens: Optional[int]):
        self.log.append(("saved_tensors.context", training, tokens))
        log = self.log

        class Context:
            def __enter__(self) -> None:
                log.append(("saved_tensors.enter",))

            def __exit__(self, *exc: Any) -> None:
                log.append(("saved_tensors.exit",))
        return Context()


class Net(nn.Module):
    """Three blocks of one linear each (their weight and bias trainable)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Kit:
    """The fakes and the real small pieces over the model `Net`, and every phase built over them."""

    def __init__(self, declared_steps: Optional[int] = None, on_device: bool = True, **clipping: Any) -> None:
        torch.manual_seed(0)
        self.log: List[Tuple] = []
        self.model = Net()
        self.records = [FakeRecord(self.log, i, list(layer.parameters())) for i, layer in enumerate(self.model.layers)]
        self.blocks = [r.block for r in self.records]
        self.slots = SlotTable(self.records, self.model)  # type: ignore[arg-type]
        self.tracker = BackwardTracker(declared_steps, on_device)
        self.clock = PhaseClock()
        self.order = ForwardOrder(len(self.records))
        self.clipping = FakeClipping(self.log, **clipping)
        self.disk = Logger(self.log, "disk")
        self.reduction = Logger(self.log, "reduction", global_norm=lambda blocks, slots, max_norm: (2.0, 0.25))
        self.modes = Modes(self.disk, self.reduction, self.clipping)  # type: ignore[arg-type]
        self.saved = FakeSavedTensors(self.log)
        self.forward = ForwardPhase(self.records, self.model, self.tracker, self.clock, self.order,  # type: ignore
                                    None, self.modes, self.saved)  # type: ignore[arg-type]
        self.param_groups = [dict(g) for g in GROUPS]  # engine.optimizer.param_groups
        self.hypers = StepHypers(self.param_groups)
        self.backward = BackwardPhase(self.slots, self.tracker, self.clock, self.forward, self.clipping,  # type: ignore
                                      self.hypers)
        self.worker = Logger(self.log, "worker")
        self.counters = StepCounters()
        self.services = SimpleNamespace(worker=self.worker, tracer=Tracer(), counters=self.counters, order=self.order)
        self.sync = Logger(self.log, "sync")
        self.writes = Logger(self.log, "writes")
        self.policy = SimpleNamespace(step_returns_early=False, bounds_host_memory=False)
        self.step = StepPhase(self.records, self.slots, self.services, self.tracker, self.hypers,  # type: ignore
                              self.modes, self.backward, self.writes, self.sync, self.policy)  # type: ignore

    def hook_grads(self) -> List[Any]:
        """Each trainable parameter's post-accumulate-grad hook calls `on_grad`, as phases/hooks.py attaches it."""
        return [p.register_post_accumulate_grad_hook(self.backward.on_grad) for p in self.model.parameters()]

    def calls(self, *names: str) -> List[Tuple]:
        return [c for c in self.log if c[0] in names]


@pytest.fixture
def kit() -> Iterator[Kit]:
    yield Kit()


# ----- ForwardPhase -----------------------------------------------------------------------------------------
def test_pre_forward_gets_each_block_ready_in_order(kit):
    kit.forward.pre_forward([kit.blocks[2], kit.blocks[0]])  # a module owning parameters of two blocks (tied)
    assert kit.log == [("meter.enter_block", 0),  # what it saves counts for the block entered last
                       ("enter_forward", 2, None, False), ("enter_forward", 0, None, False)], \
        "the first step: no forward order to prefetch by"


def test_pre_forward_prefetches_the_next_block_of_the_recorded_forward_order(kit):
    for index in (1, 0, 2):  # the first step's forward
        kit.forward.pre_forward([kit.blocks[index]])
    assert [c[2] for c in kit.calls("enter_forward")] == [None, None, None], "the order is not known yet"
    kit.order.known = True  # an update was scheduled: a whole step seen
    kit.log.clear()
    for index in (1, 0, 2):
        kit.forward.pre_forward([kit.blocks[index]])
    assert kit.calls("enter_forward") == [("enter_forward", 1, 0, False), ("enter_forward", 0, 2, False),
                                          ("enter_forward", 2, None, False)]
    kit.forward.post_forward([kit.blocks[1], kit.blocks[2]])
    assert kit.log[-2:] == [("leave_forward", 1), ("leave_forward", 2)]


def test_the_root_forward_encloses_the_saved_tensor_hooks_and_is_timed(kit):
    kit.forward.begin_root_forward(tokens=12)
    kit.forward.end_root_forward()
    assert kit.log == [("reduction.refuse_unknown_ranks",), ("saved_tensors.context", True, 12),
                       ("saved_tensors.enter",), ("saved_tensors.exit",), ("meter.end",)]
    assert kit.clock.forward_seconds > 0
    kit.log.clear()
    with torch.no_grad():  # an evaluation forward: the hooks for no graph
        kit.forward.begin_root_forward()
    kit.forward.end_root_forward()
    assert kit.log[1] == ("saved_tensors.context", False, None)


def test_a_root_forward_with_grad_predicts_one_firing_per_parameter_of_each_block(kit):
    kit.forward.pre_forward([kit.blocks[0]])  # outside a root forward: no prediction
    assert kit.tracker.predicted == {}
    kit.forward.begin_root_forward()
    kit.forward.pre_forward([kit.blocks[0]])
    with torch.no_grad():  # the same block again under no_grad in a grad forward (reentrant checkpointing)
        kit.forward.pre_forward([kit.blocks[1]])
        kit.forward.pre_forward([kit.blocks[2]])
    kit.forward.pre_forward([kit.blocks[2]])
    kit.forward.end_root_forward()
    ids = kit.records
    assert kit.tracker.predicted == {pid: 1 for pid in ids[0].trainable_ids}
    assert kit.tracker.unpredictable == set(ids[1].trainable_ids) | set(ids[2].trainable_ids)


@pytest.mark.parametrize("updates_during_backward", [True, False])
def test_the_first_block_of_a_later_forward_before_the_last_backward_reads_state_ahead(updates_during_backward):
    kit = Kit(declared_steps=2, updates_during_backward=updates_during_backward)
    for index in (2, 0, 1):
        kit.forward.pre_forward([kit.blocks[index]])
    assert kit.calls("disk.read_ahead_for_backward") == [], "the first step: no order yet"
    kit.order.known = True
    kit.forward.pre_forward([kit.blocks[2]])
    assert kit.calls("disk.read_ahead_for_backward") == [], "the next backward is not the last"
    kit.tracker.begin_backward(12345)  # one backward counted: the next is the last of 2
    assert kit.tracker.next_backward is LastBackward.DECLARED
    kit.forward.pre_forward([kit.blocks[0]])
    assert kit.calls("disk.read_ahead_for_backward") == [], "not the forward's first block"
    kit.forward.pre_forward([kit.blocks[2]])
    reads = kit.calls("disk.read_ahead_for_backward")
    if updates_during_backward:
        assert len(reads) == 1 and [r.index for r in reads[0][1]] == [1, 0, 2], "the reverse of the forward"
    else:
        assert reads == [], "with clipping no block updates during the backward"


# ----- BackwardPhase ----------------------------------------------------------------------------------------
def _backward(kit: Kit) -> None:
    out = kit.model(torch.randn(4, 3))
    out.register_hook(lambda grad: kit.backward.begin_backward())  # the first gradient of the module's outputs
    out.square().sum().backward()


def test_each_gradient_goes_to_its_record_and_the_block_completes_after_its_last(kit):
    handles = kit.hook_grads()
    for record in kit.records:
        kit.tracker.predict_from_forward(record.trainable_ids, True)
    _backward(kit)
    got = kit.calls("receive_grad", "block_complete")
    assert sorted(c for c in got if c[0] == "receive_grad") == [("receive_grad", b, i) for b in range(3)
                                                                for i in range(2)]
    for block in range(3):  # each block's completion comes right after its second gradient, once
        position = got.index(("block_complete", block, LastBackward.NO))
        assert [c[1] for c in got[position - 2:position]] == [block, block]
        assert got.count(("block_complete", block, LastBackward.NO)) == 1
    assert [c[1] for c in got if c[0] == "block_complete"] == [2, 1, 0], "the backward's order"
    assert kit.tracker.micro_batches == 1 and kit.clock.backward_seconds > 0
    for handle in handles:
        handle.remove()


def test_a_block_is_not_completed_when_the_clipping_mode_does_not_watch_it():
    kit = Kit(watch=False)
    kit.hook_grads()
    for record in kit.records:
        kit.tracker.predict_from_forward(record.trainable_ids, True)
    _backward(kit)
    assert len(kit.calls("receive_grad")) == 6 and kit.calls("block_complete") == []
    assert [c[1:] for c in kit.calls("watches")] == [(c[1], LastBackward.NO) for c in kit.calls("receive_grad")]


def test_without_a_profile_or_a_prediction_no_block_completes(kit):
    kit.hook_grads()
    _backward(kit)
    assert len(kit.calls("receive_grad")) == 6 and kit.calls("block_complete") == []
    kit.log.clear()
    _backward(kit)  # the first backward's firings are now the profile
    assert sorted(c[1] for c in kit.calls("block_complete")) == [0, 1, 2]


def test_the_declared_last_backward_completes_blocks_as_last_and_reads_ahead():
    kit = Kit(declared_steps=2, on_device=False)  # under a device budget: every micro-batch leaves the device
    kit.hook_grads()
    kit.order.record(0)
    kit.order.known = True
    for record in kit.records:
        kit.tracker.predict_from_forward(record.trainable_ids, True)
    _backward(kit)
    assert [c[2] for c in kit.calls("block_complete")] == [LastBackward.NO] * 3
    assert kit.calls("disk.read_ahead_for_backward") == []
    kit.log.clear()
    _backward(kit)
    assert kit.calls("disk.read_ahead_for_backward") != [], "begin_backward: the last one's updates read ahead"
    assert [c[2] for c in kit.calls("block_complete")] == [LastBackward.DECLARED] * 3
    assert not kit.tracker.failed_last_backward, "it ran to its end"


def test_micro_batches_kept_on_the_device_reach_no_record():
    kit = Kit(declared_steps=2, on_device=True)
    kit.hook_grads()
    _backward(kit)
    assert kit.calls("receive_grad") == [] and kit.calls("watches") == []
    assert all(p.grad is not None for p in kit.model.parameters()), "torch's own accumulation on the device"
    _backward(kit)  # the last one: every gradient (the sum, in .grad) goes to its record
    assert len(kit.calls("receive_grad")) == 6


def test_collect_grads_hands_each_record_its_own_refs(kit):
    kit.backward.collect_grads()
    assert kit.log == [("take_leftover_grads", b, [0, 1]) for b in range(3)]


# ----- StepPhase --------------------------------------------------------------------------------------------
def test_step_schedules_every_record_not_updated_early_in_update_order_with_the_modes_scale():
    kit = Kit(scale=0.25, checks_each_block=False, last_norm=3.5)
    for index in (2, 0):  # the forward used block 2, then 0; block 1 never
        kit.order.record(index)
    kit.records[0].updated_early = True
    kit.step.step()
    updates = kit.calls("schedule_update")
    assert updates == [("schedule_update", 2, HYPERS, 0.25, False), ("schedule_update", 1, HYPERS, 0.25, False)]
    names = [c[0] for c in kit.log]
    assert names[:1] == ["sync.check_open"] and ("worker.raise_if_failed",) in kit.log
    assert names.index("writes.refuse_unfrozen") < names.index("take_leftover_grads") \
        < names.index("scale_for_step") < names.index("schedule_update")
    assert ("scale_for_step", [2, 0, 1], 0) in kit.log, "the mode decides over every record, in update order"
    assert [c[1] for c in kit.calls("end_step")] == [0, 1, 2]
    assert names.index("end_step") > max(i for i, n in enumerate(names) if n == "schedule_update")
    assert names[-1] == "sync.settle_weights", "step() returns once every block's weights are in"
    assert kit.counters.steps == 1 and kit.counters.skipped_steps == 0 and kit.counters.grad_norm == 3.5


def test_step_returning_early_guards_the_pending_blocks_instead_of_waiting(kit):
    kit.policy.step_returns_early = True
    kit.step.step()
    assert ("sync.guard_pending",) in kit.log and ("sync.settle_weights",) not in kit.log
    assert len(kit.calls("schedule_update")) == 3


def test_a_step_the_clipping_mode_skips_is_counted_and_updates_nothing():
    kit = Kit(scale=None, last_norm=math.inf)
    kit.step.step()
    assert kit.calls("schedule_update") == []
    assert kit.counters.skipped_steps == 1 and kit.counters.steps == 1 and kit.counters.grad_norm == math.inf
    assert [c[1] for c in kit.calls("end_step")] == [0, 1, 2], "the step is over all the same"
    kit.step.step()
    assert kit.counters.skipped_steps == 2 and kit.counters.steps == 2


def test_the_step_reads_the_hyperparameters_now_and_forgets_the_early_ones(kit):
    kit.hypers.for_early_update()
    kit.param_groups[1]["lr"] = 1.0  # an LR scheduler between steps
    kit.step.step()
    hypers = kit.calls("schedule_update")[0][2]
    assert hypers[1].lr == 1.0
    kit.hypers.group_changes(0, GROUPS[0], "lr", 5.0)  # reset: no early update to protect any more


def test_zero_grad_zeroes_every_record_and_ends_the_steps_backward_count(kit):
    kit.tracker.begin_backward(1)
    kit.step.zero_grad(set_to_none=False)
    assert kit.log == [("sync.check_open",)] + [("zero_grads", b, False) for b in range(3)] + [("drop_step",)]
    assert kit.tracker.micro_batches == 0


def test_zero_grad_refuses_after_a_block_was_updated_early(kit):
    kit.records[1].updated_early = True
    with pytest.raises(OffloadError, match=r"zero_grad\(\) between the last backward and step\(\).*'layers.1'"):
        kit.step.zero_grad()
    assert kit.calls("zero_grads") == []


def test_clip_grad_norm_takes_the_leftovers_waits_and_scales_every_record_by_the_reductions_scale(kit):
    total = kit.step.clip_grad_norm(1.0)
    assert total == 2.0
    names = [c[0] for c in kit.log]
    assert names.index("take_leftover_grads") < names.index("worker.wait_all") < names.index("reduction.global_norm")
    assert kit.calls("scale_") == [("scale_", b, 0.25) for b in range(3)]
    assert all(r.norms is None and r.shard_sumsq is None for r in kit.records), "taken before the clip: stale"


def test_clip_grad_norm_refuses_another_norm_type_and_an_early_update(kit):
    with pytest.raises(OffloadError, match="L2 norm only"):
        kit.step.clip_grad_norm(1.0, norm_type=1.0)
    kit.records[2].updated_early = True
    with pytest.raises(OffloadError, match="'layers.2'"):
        kit.step.clip_grad_norm(1.0)
    assert kit.calls("scale_") == []


# ----- Synchronizer -----------------------------------------------------------------------------------------
def _sync(kit: Kit) -> Synchronizer:
    copies, streamer, guard = Logger(kit.log, "copies"), Logger(kit.log, "streamer"), Logger(kit.log, "guard")
    return Synchronizer(kit.records, kit.slots, kit.worker, kit.disk, copies, streamer, guard)  # type: ignore


def test_settle_weights_waits_for_every_update_then_pushes_the_records_that_need_it(kit):
    sync = _sync(kit)
    kit.records[0].needs_push = kit.records[2].needs_push = True
    sync.settle_weights()
    assert kit.log == [("worker.wait_all",), ("show_live_weights", 0), ("push", 0), ("show_live_weights", 1),
                       ("show_live_weights", 2), ("push", 2), ("copies.synchronize",), ("guard.release_all",)]
    kit.log.clear()
    sync.settle_weights()
    assert ("push", 0) not in kit.log, "pushed once"


def test_settle_blocks_settles_only_those(kit):
    _sync(kit).settle_blocks([kit.blocks[2], kit.blocks[0]])
    assert kit.log == [("settle", 2, False), ("settle", 0, False), ("copies.synchronize",)]


def test_synchronize_puts_every_write_on_disk_between_the_updates_and_the_pushes(kit):
    sync = _sync(kit)
    kit.records[1].needs_push = True
    sync.synchronize()
    assert [c[0] for c in kit.log if c[0] != "show_live_weights"] == [
        "worker.wait_all", "disk.flush_writes", "worker.wait_all", "push", "copies.synchronize", "guard.release_all"]


def test_a_failed_flush_fails_the_worker_and_raises(kit):
    error = OSError("the disk is gone")

    def flush() -> None:
        raise error
    kit.disk = Logger(kit.log, "disk", flush_writes=flush)
    sync = _sync(kit)
    with pytest.raises(OSError, match="gone"):
        sync.synchronize()
    assert ("worker.fail", error) in kit.log and ("worker.wait_all",) == kit.log[0]


def test_guard_pending_asks_every_record(kit):
    _sync(kit).guard_pending()
    assert kit.log == [("guard_while_pending", b) for b in range(3)]


def test_close_finishes_pushes_restores_drops_held_grads_and_refuses_later_use(kit):
    sync = _sync(kit)
    kit.records[2].needs_push = True
    param = kit.records[0].params[0]
    param.grad = HeldGrad(param, "layers.0.weight")
    plain = kit.records[1].params[0]
    plain.grad = torch.ones_like(plain)
    assert sync.close() is None
    assert [c[0] for c in kit.log] == ["worker.close", "disk.drain", "push", "guard.release_all",
                                       "streamer.restore_all", "copies.synchronize"]
    assert param.grad is None, "the gradients the engine held go with it"
    assert plain.grad is not None, "a plain .grad is the user's"
    assert list(kit.slots) == [] and sync.closed
    with pytest.raises(OffloadError, match="this engine is closed"):
        sync.check_open()


def test_close_without_restoring_pushes_nothing_and_returns_the_workers_failure(kit):
    error = RuntimeError("an update failed")

    def close() -> None:
        raise error
    kit.worker = Logger(kit.log, "worker", close=close)
    kit.records[2].needs_push = True
    assert _sync(kit).close(restore=False) is error
    assert [c[0] for c in kit.log] == ["worker.close", "guard.release_all", "copies.synchronize"]
