"""What `.grad` holds once the engine has a parameter's gradient (offload/scheduler/grads/held_grad.py): a
`HeldGrad` that raises on any read naming the parameter, and into which autograd's accumulation lands."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from offload.errors import OffloadError
from offload.scheduler.records.held_grad import HeldGrad, is_held

NAME = r"'layer\.weight'"


def _held():
    param = nn.Parameter(torch.randn(3, 4))
    held = HeldGrad(param, "layer.weight")
    param.grad = held
    return param, held


def test_a_held_grad_has_the_parameters_shape_dtype_and_device():
    param, held = _held()
    assert param.grad is held and is_held(param.grad) and not is_held(torch.zeros(3, 4))
    assert (held.shape, held.dtype, held.device) == (param.shape, param.dtype, param.device)
    assert held.pending is None


@pytest.mark.parametrize("read", [
    lambda g: g.sum(),
    lambda g: g + 1,
    lambda g: g.clone(),
    lambda g: torch.linalg.vector_norm(g),
    lambda g: g.mul_(0.5),
    lambda g: g.add_(torch.ones(3, 4), alpha=2.0),  # not autograd's plain accumulation
], ids=["sum", "add", "clone", "norm", "mul_", "add_alpha"])
def test_reading_a_held_grad_raises_naming_the_parameter(read):
    _param, held = _held()
    with pytest.raises(OffloadError, match=NAME):
        read(held)


def test_clip_grad_norm_on_held_grads_raises_naming_the_parameter():
    param, _held_grad = _held()
    with pytest.raises(OffloadError, match=NAME + r".*engine\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_([param], 1.0)


def test_zeroing_a_held_grad_in_place_raises_with_the_way_to_clear_it():
    _param, held = _held()
    with pytest.raises(OffloadError, match=NAME + r".*engine\.zero_grad\(\)"):
        held.zero_()


@pytest.mark.parametrize("copy_it", [copy.deepcopy, pickle.dumps], ids=["deepcopy", "pickle"])
def test_copying_a_held_grad_raises_naming_the_parameter(copy_it):
    _param, held = _held()
    with pytest.raises(OffloadError, match=NAME):
        copy_it(held)


def test_autograd_accumulating_into_a_held_grad_lands_in_pending():
    param, held = _held()
    x = torch.randn(3, 4)
    (param * x).sum().backward()  # a backward without zero_grad since the engine took the gradient
    assert param.grad is held
    assert torch.equal(held.pending, x)
    (param * x * 2).sum().backward()
    assert param.grad is held
    assert torch.equal(held.pending, x * 3)
    assert torch.equal(held.pop_pending(), x * 3)
    assert held.pending is None and held.pop_pending() is None


def test_pending_is_a_copy_not_the_incoming_gradient():
    _param, held = _held()
    incoming = torch.ones(3, 4)
    held.accumulate_pending(incoming)
    held.accumulate_pending(incoming)
    assert torch.equal(incoming, torch.ones(3, 4)), "the incoming gradient was changed in place"
    assert torch.equal(held.pending, torch.full((3, 4), 2.0))
