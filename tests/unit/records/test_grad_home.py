"""A group's gradient home on its own (offload/scheduler/grads/grad_home.py): accumulation, the flags the
update reads, zeroing and what `.grad` holds after it, scaling, norms and the non-finite check. The same
checks over the plain accumulator and the windowed one, where they behave alike."""

from __future__ import annotations

import pytest
import torch

from offload.scheduler.records.held_grad import HeldGrad, is_held
from tests.unit.records.groups import HOME_KINDS, grad_of, make_group, make_home, piece


@pytest.mark.parametrize("kind", HOME_KINDS)
def test_the_first_gradient_is_copied_and_later_ones_added(kind):
    group = make_group()
    home, _copies = make_home(kind, group)
    g1, g2 = grad_of(group, 0), grad_of(group, 0)
    assert home.accumulate(0, g1) == g1.numel() * 4
    assert torch.equal(piece(home, 0), g1.reshape(-1))
    home.accumulate(0, g2)
    assert torch.equal(piece(home, 0), (g1 + g2).reshape(-1))
    assert torch.equal(piece(home, 1), torch.zeros(5)) and torch.equal(piece(home, 2), torch.zeros(6))
    assert home.ready_indices() == [0]


@pytest.mark.parametrize("kind", HOME_KINDS)
def test_a_fresh_gradient_replaces_what_was_accumulated(kind):
    group = make_group()
    home, _copies = make_home(kind, group)
    home.accumulate(0, grad_of(group, 0))
    g = grad_of(group, 0)
    home.accumulate(0, g, fresh=True)  # the parameter's `.grad` was cleared outside the engine
    assert torch.equal(piece(home, 0), g.reshape(-1))


@pytest.mark.parametrize("off_device", [True, False])
@pytest.mark.parametrize("kind", HOME_KINDS)
def test_bytes_to_the_host_are_counted_only_for_gradients_that_leave_the_device(kind, off_device):
    group = make_group()
    home, copies = make_home(kind, group, off_device=off_device)
    moved = home.accumulate(0, grad_of(group, 0)) + home.accumulate(2, grad_of(group, 2))
    assert moved == (12 + 6) * 4
    assert copies.bytes_to_host == (moved if off_device else 0)
    assert copies.bytes_to_device == 0


@pytest.mark.parametrize("kind", HOME_KINDS)
def test_ready_indices_and_forget(kind):
    group = make_group()
    home, _copies = make_home(kind, group)
    home.accumulate(2, grad_of(group, 2))
    home.accumulate(0, grad_of(group, 0))
    assert home.ready_indices() == [0, 2]
    home.forget(2)  # model.zero_grad() cleared its `.grad`
    assert home.ready_indices() == [0]
    g = grad_of(group, 2)
    home.accumulate(2, g)  # copied, not added to the forgotten one
    assert torch.equal(piece(home, 2), g.reshape(-1))


@pytest.mark.parametrize("kind", HOME_KINDS)
def test_zero_to_none_clears_every_grad_and_the_next_gradient_is_copied(kind):
    group = make_group()
    home, _copies = make_home(kind, group)
    home.accumulate(0, grad_of(group, 0))
    home.accumulate(1, grad_of(group, 1))
    group.trainable_slots[0].param.grad = home.held_for(0)
    home.zero(set_to_none=True)
    assert all(slot.param.grad is None for slot in group.trainable_slots)
    assert home.ready_indices() == []
    if kind == "windowed":  # its buffer went back to the window
        assert home.grad is None and home.pool.in_use == 0
    g = grad_of(group, 0)
    home.accumulate(0, g)
    assert torch.equal(piece(home, 0), g.reshape(-1))


@pytest.mark.parametrize("kind", HOME_KINDS)
def test_zero_keeping_zeros_holds_each_gradient_as_a_held_grad(kind):
    group = make_group()
    home, _copies = make_home(kind, group)
    home.accumulate(0, grad_of(group, 0))
    home.accumulate(2, grad_of(group, 2))
    slots = group.trainable_slots
    slots[1].param.grad = torch.ones(5)  # no gradient in the engine: becomes None
    home.zero(set_to_none=False)
    for index in (0, 2):
        held = slots[index].param.grad
        assert is_held(held) and held is home.held[index] and held.pending is None
        assert held.shape == slots[index].shape and held.dtype == group.dtype
        assert torch.equal(piece(home, index), torch.zeros(slots[index].numel))
    assert slots[1].param.grad is None
    assert home.ready_indices() == [0, 2]  # zeros, as torch keeps them: stepped on (decay, step count)
    g = grad_of(group, 0)
    home.accumulate(0, g)  # added onto the zeros
    assert torch.equal(piece(home, 0), g.reshape(-1))


def test_held_for_drops_what_autograd_left_pending():
    group = make_group()
    home, _copies = make_home("host", group)
    home.held[1].accumulate_pending(torch.ones(5))
    held = home.held_for(1)
    assert isinstance(held, HeldGrad) and held.pending is None and held.param_name == "blk.p1"


@pytest.mark.parametrize("kind", HOME_KINDS)
def test_scale_multiplies_only_the_gradients_held(kind):
    group = make_group()
    home, _copies = make_home(kind, group)
    g0, g1, g2 = (grad_of(group, i) for i in range(3))
    for i, g in enumerate((g0, g1, g2)):
        home.accumulate(i, g)
    home.forget(1)  # its range keeps stale values, which are no gradient
    home.scale_(0.25)
    assert torch.equal(piece(home, 0), (g0 * 0.25).reshape(-1))
    assert torch.equal(piece(home, 1), g1.reshape(-1))
    assert torch.equal(piece(home, 2), (g2 * 0.25).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", HOME_KINDS)
def test_norms_equal_vector_norm_of_each_parameter_with_a_gradient(kind, dtype):
    group = make_group(dtype)
    home, _copies = make_home(kind, group)
    g0, g2 = grad_of(group, 0) * 3, grad_of(group, 2)
    home.accumulate(0, g0)
    home.accumulate(2, g2)
    norms = home.norms()
    assert [p for p, _n in norms] == [group.trainable_slots[0].param, group.trainable_slots[2].param]
    for (_p, norm), g in zip(norms, (g0, g2)):
        assert norm == float(torch.linalg.vector_norm(g, 2, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("kind", HOME_KINDS)
def test_all_finite_sees_a_non_finite_element_in_any_gradient(kind, bad, dtype):
    group = make_group(dtype)
    home, _copies = make_home(kind, group)
    home.accumulate(0, grad_of(group, 0))
    assert home.all_finite()
    g = grad_of(group, 2)
    g[1, 2] = bad
    home.accumulate(2, g)
    assert not home.all_finite()
    home.zero(set_to_none=False)  # zeros: finite again
    assert home.all_finite()


def test_all_finite_ignores_the_padding_past_the_trainable_range():
    group = make_group()
    home, _copies = make_home("host", group, padded_numel=32)
    assert home.buffer().numel() == 32 and home.numel == 32
    home.accumulate(0, grad_of(group, 0))
    home.buffer()[23:] = float("nan")  # beyond the group's 23 trainable elements
    assert home.all_finite()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_must_wait_to_zero(set_to_none):
    group = make_group()
    host, _copies = make_home("host", group)
    windowed, _copies = make_home("windowed", group)
    assert host.must_wait_to_zero(set_to_none) is (not set_to_none)  # zeros in place change what it reads
    assert windowed.must_wait_to_zero(set_to_none) is True  # the update may also give the buffer back
