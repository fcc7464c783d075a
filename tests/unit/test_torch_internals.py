"""Every private piece of torch the scheduler relies on (offload/scheduler/torch_internals.py), each checked for
the behaviour the engine depends on: when a torch release changes one, this file says which."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
from torch import nn

from offload.scheduler import torch_internals as ti


def test_the_graph_task_is_minus_one_outside_a_backward_and_the_same_for_one_backward():
    assert ti.graph_task_id() == -1 and not ti.is_backward()
    seen = []
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda g: seen.append((ti.graph_task_id(), ti.is_backward())) or g)
    x.register_hook(lambda g: seen.append((ti.graph_task_id(), ti.is_backward())) or g)
    y.backward()
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][0] != -1 and seen[0][1]


def test_after_backward_runs_once_the_backward_ends():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 3).sum()
    x.register_hook(lambda g: (order.append("hook"), ti.after_backward(lambda: order.append("after")))[1] or g)
    y.backward()
    assert order == ["hook", "after"]


def test_version_counters_count_in_place_writes_not_data_writes():
    p = nn.Parameter(torch.zeros(4))
    before = ti.version_of(p)
    with torch.no_grad():
        p.add_(1)
    assert ti.version_of(p) == before + 1
    p.data = torch.ones(4)
    assert ti.versions_of([p, p]) == [ti.version_of(p)] * 2
    assert ti.version_of(p) in (before + 1, before + 2)  # `.data =` replaces the counter's tensor, never bumps it


def test_view_base_is_the_tensor_a_view_was_made_from():
    base = torch.zeros(6)
    assert ti.view_base(base[2:4]) is base and ti.view_base(base) is base


def test_own_parameters_and_buffers_are_the_modules_own_and_writable():
    parent = nn.Sequential(nn.BatchNorm1d(3))
    norm = parent[0]
    assert set(ti.own_parameters(norm)) == {"weight", "bias"} and ti.own_parameters(parent) == {}
    assert "running_mean" in ti.own_buffers(norm)
    ti.own_buffers(norm)["running_mean"] = torch.full((3,), 5.0)
    assert torch.equal(norm.running_mean, torch.full((3,), 5.0))


def test_pytree_sees_through_containers_and_dataclasses():
    @dataclasses.dataclass
    class Out:
        a: torch.Tensor
        b: list

    t1, t2 = torch.zeros(1), torch.ones(1)
    assert ti.flatten({"x": (t1, [t2])}) == [t1, t2]
    assert ti.leaves((t1, {"k": t2})) == [t1, t2]


def test_subclasses_torch_function_is_off_inside_the_context():
    calls = []

    class Loud(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    loud = torch.zeros(2).as_subclass(Loud)
    with ti.torch_function_subclasses_disabled():
        loud + 1
    assert calls == []
    loud + 1
    assert calls


def test_eager_functions_still_run():
    assert ti.eager(lambda: 7)() == 7


def test_a_version_probe_shares_the_counter_and_no_memory():
    t = torch.zeros(8)
    probe = ti.version_probe(t)
    assert probe is not None and probe.numel() == 0 and torch.equal(t, torch.zeros(8))
    before = ti.version_of(probe)
    t.add_(1)
    assert ti.version_of(probe) == before + 1


def test_node_name_of_a_result_and_of_a_leaf():
    x = torch.ones(2, requires_grad=True)
    assert ti.node_name(x) is None and ti.node_name(x.exp()) == "ExpBackward0"


def test_a_group_timeout_is_read_or_none():
    assert ti.group_timeout(object()) is None  # not a process group: None, never an error
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        assert ti.default_group_timeout() is None
    else:  # pragma: no cover - the suite runs without a default group
        assert isinstance(ti.default_group_timeout(), timedelta)


def test_func_transforms_refuse_saved_tensor_hooks_with_the_message_offload_names():
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with hooks, pytest.raises(RuntimeError, match=ti.FUNC_TRANSFORMS_REFUSE_HOOKS):
        torch.func.grad(lambda x: (x * x).sum())(torch.ones(3))
