"""Which backward is running and when a parameter's gradient is complete (grads/backward_tracker.py),
driven by real backward passes through hooks that do what the backward phase does (phases/backward.py);
and the counting of blocks skipped for non-finite gradients (grads/nonfinite.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from offload.errors import OffloadError
from offload.scheduler.modes.clipping import LastBackward
from offload.scheduler.phases.backward_tracker import BackwardTracker
from offload.scheduler.records.nonfinite import NonFiniteSkips
from offload.scheduler.torch_internals import graph_task_id


class Harness:
    """Two parameters whose post-accumulate-grad hooks tell the tracker as `BackwardPhase.on_grad` does; the
    outputs' gradient hook announces the graph task as `begin_backward` does. `seen`: per hook firing, the
    parameter and whether `a` alone and `a` with `b` were complete then."""

    def __init__(self, declared_steps=None) -> None:
        self.tracker = BackwardTracker(declared_steps)
        self.a = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.seen = []
        self.fail = False
        for name, param in (("a", self.a), ("b", self.b)):
            param.register_post_accumulate_grad_hook(lambda p, name=name: self._on_grad(name, p))

    def _on_grad(self, name, param) -> None:
        tracker = self.tracker
        tracker.accumulating(graph_task_id())
        tracker.fire(id(param))
        if tracker.is_last_backward:
            tracker.watch_completion()
        self.seen.append((name, tracker.completes([id(self.a)]), tracker.completes([id(self.a), id(self.b)])))
        if self.fail:
            raise RuntimeError("a bad batch")

    def _begin(self, grad):
        task = graph_task_id()
        if self.tracker.is_new(task):
            self.tracker.announce(task)

    def loss(self, use_b: bool = True):
        x = torch.randn(4)
        out = (self.a * x).sum() + (self.a * x * 2).sum()  # `a` used twice: one firing per backward still
        if use_b:
            out = out + (self.b * x).sum()
        out.register_hook(self._begin)
        return out

    def backward(self, use_b: bool = True) -> None:
        self.seen = []
        self.loss(use_b).backward()


def test_each_backward_graph_task_counts_once():
    h = Harness()
    h.backward()
    assert h.tracker.micro_batches == 1
    h.backward()
    assert h.tracker.micro_batches == 2
    torch.autograd.backward([h.loss(), h.loss()])  # two outputs, one graph task
    assert h.tracker.micro_batches == 3
    torch.autograd.grad(h.loss(), [h.a, h.b])  # writes no `.grad`: not a backward, as torch counts it
    assert h.tracker.micro_batches == 3
    h.tracker.end_step()
    assert h.tracker.micro_batches == 0


def test_the_previous_backwards_firings_say_when_a_gradient_is_complete():
    h = Harness()
    h.backward()
    assert all(not a and not both for _name, a, both in h.seen)  # no profile yet, nothing predicted
    h.backward()
    order = [name for name, _a, _both in h.seen]
    assert sorted(order) == ["a", "b"]  # each fired once
    a_done = order.index("a")
    assert [a for _n, a, _both in h.seen] == [i >= a_done for i in range(2)]
    assert [both for _n, _a, both in h.seen] == [False, True]  # complete at the last firing only


@pytest.mark.parametrize("use_b_now", [True, False])
def test_a_parameter_that_got_no_gradient_last_time_is_never_complete(use_b_now):
    h = Harness()
    h.backward(use_b=False)
    h.backward(use_b=use_b_now)
    assert [both for _n, _a, both in h.seen] == [False] * (2 if use_b_now else 1)  # its block waits for step()
    assert any(a for _n, a, _both in h.seen)


def test_a_graph_task_nested_in_the_counted_backward_is_part_of_it():
    h = Harness()
    x = torch.randn(4, requires_grad=True)
    inner = torch.utils.checkpoint.checkpoint(lambda x: (h.a * x).sum(), x, use_reentrant=True)
    out = inner + (h.b * x).sum()
    out.register_hook(h._begin)
    out.backward()  # `a`'s gradient is accumulated in the recompute's own (nested) graph task
    assert h.tracker.micro_batches == 1
    assert sorted(name for name, _a, _both in h.seen) == ["a", "b"]


@pytest.mark.parametrize("predictable", [True, False])
def test_a_prediction_from_the_forward_stands_in_for_the_first_profile(predictable):
    h = Harness()
    h.tracker.predict_from_forward([id(h.a), id(h.b)], predictable)
    h.backward()
    assert h.seen[-1][2] is predictable


def test_declared_steps_say_which_backward_is_last():
    h = Harness(declared_steps=2)
    t = h.tracker
    no, declared = LastBackward.NO, LastBackward.DECLARED
    assert (t.keeps_grads_on_device, t.next_backward, t.is_last_backward) == (True, no, False)
    h.backward()
    assert (t.keeps_grads_on_device, t.next_backward, t.this_backward, t.is_last_backward) == (True, declared, no, False)
    h.backward()
    assert (t.keeps_grads_on_device, t.next_backward, t.this_backward, t.is_last_backward) == (False, no, declared, True)
    with pytest.raises(OffloadError, match="grad_accumulation_steps=2"):
        h.backward()
    t.end_step()
    h.backward()
    assert t.micro_batches == 1 and t.keeps_grads_on_device


def test_undeclared_steps_never_keep_grads_on_the_device_nor_declare_a_last_backward():
    h = Harness()
    for _ in range(3):
        h.backward()
        t = h.tracker
        assert (t.keeps_grads_on_device, t.next_backward, t.this_backward, t.is_last_backward) == \
            (False, LastBackward.NO, LastBackward.NO, False), "no step yet: nothing to guess from"


def test_undeclared_the_last_steps_count_of_backward_passes_says_which_is_likely_the_last():
    h = Harness()
    t = h.tracker
    h.backward()
    h.backward()
    t.end_step()  # a step of two backward passes
    assert t.next_backward is LastBackward.NO
    h.backward()
    assert (t.this_backward, t.next_backward) == (LastBackward.NO, LastBackward.LIKELY)
    h.backward()
    assert (t.this_backward, t.is_last_backward) == (LastBackward.LIKELY, False), "likely, never declared"
    h.backward()
    assert t.this_backward is LastBackward.NO, "a third: the guess was wrong"
    t.end_step()
    t.end_step()  # zero_grad after step(): no backward in between, the count stays
    assert t.last_step_micro_batches == 3


def test_a_last_backward_that_raises_partway_failed_and_one_that_completes_did_not():
    h = Harness(declared_steps=1)
    h.fail = True
    with pytest.raises(RuntimeError, match="a bad batch"):
        h.backward()
    assert h.tracker.failed_last_backward
    h.fail = False
    with pytest.raises(OffloadError, match="backward called again.*raised partway"):
        h.backward()  # a retry of the failed micro-batch
    h.tracker.end_step()
    assert not h.tracker.failed_last_backward
    h.backward()
    assert h.tracker.is_last_backward and not h.tracker.failed_last_backward


def test_a_failed_backward_that_was_not_the_last_is_not_a_failed_last_backward():
    h = Harness(declared_steps=2)
    h.fail = True
    with pytest.raises(RuntimeError, match="a bad batch"):
        h.backward()
    assert not h.tracker.failed_last_backward


def test_non_finite_skips_count_blocks_and_steps_and_warn_once_per_step():
    skips = NonFiniteSkips()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skips.record(0, "h.1")
        skips.record(0, "h.2")
        skips.record(4, "h.0")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2
    assert "optimizer step 1:" in messages[0] and "'h.1'" in messages[0]
    assert "optimizer step 5:" in messages[1] and "'h.0'" in messages[1]
    assert skips.block_skips == 3 and skips.steps == 2
    skips.reset()
    assert skips.block_skips == 0 and skips.steps == 0
