"""`ReadThrough` on its own (weights/read_through.py), with a fake `BlockAccess` that logs what it is asked:
while "closed" the parameter holds a NaN placeholder, as a released streamed block's does; opening the
block gives it its real weights, closing takes them away again, and the views it is told to pin are
counted until they are collected."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import List, Optional

import torch
from torch import nn

from offload.scheduler.blocks.block import Block, build_blocks
from offload.scheduler.weights.read_through import ReadThrough, is_metadata, reads_through


class FakeAccess:
    """A block of one parameter, "released" (a NaN placeholder) until opened; the log names every call."""

    def __init__(self, block: Block, param: nn.Parameter) -> None:
        self.block = block
        self.param = param
        self.real = param.detach().clone()
        self.log: List[str] = []
        self.pins = 0
        self._close()

    def block_of(self, param: torch.Tensor) -> Optional[Block]:
        return self.block if param is self.param else None

    def open_for_read(self, block: Block) -> None:
        self.log.append("open")
        self.param.data = self.real  # a setter: answered without opening anything

    def pin_views(self, tensors: List[torch.Tensor]) -> None:
        for tensor in tensors:  # as the streamer: a view of the block's weights, not the parameter itself
            if isinstance(tensor, nn.Parameter):
                continue
            if tensor.untyped_storage().data_ptr() == self.real.untyped_storage().data_ptr():
                self.log.append("pin")
                self.pins += 1
                weakref.finalize(tensor, self._unpin)

    def close_after_read(self, block: Block) -> None:
        self.log.append("close")
        self._close()

    def _close(self) -> None:
        self.param.data = torch.full((1,), float("nan")).expand(self.real.shape)

    def _unpin(self) -> None:
        self.pins -= 1


class Scaled(nn.Parameter):
    """A parameter class of the user's own."""


def _setup(param_class=nn.Parameter):
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    if param_class is not nn.Parameter:
        layer.weight = param_class(layer.weight.detach().clone())
    block, = build_blocks(layer, torch.float32)
    weight = layer.weight
    reader = ReadThrough()
    access = FakeAccess(block, weight)
    reader.serve(access)
    reader.mark(weight)
    return reader, access, weight


def test_mark_makes_a_subclass_of_the_parameters_own_class_and_unmark_undoes_it():
    reader, access, weight = _setup()
    assert reads_through(weight) and isinstance(weight, nn.Parameter) and type(weight) is not nn.Parameter
    cls = type(weight)
    reader.mark(weight)  # marking twice changes nothing
    assert type(weight) is cls
    ReadThrough.unmark(weight)
    assert type(weight) is nn.Parameter and not reads_through(weight)
    reader.mark(weight)
    assert type(weight) is cls, "one subclass per own class, made once"
    assert access.log == []


def test_metadata_is_answered_without_opening_the_block():
    _reader, access, weight = _setup()
    assert weight.shape == (3, 4) and weight.dtype == torch.float32 and weight.device.type == "cpu"
    assert weight.requires_grad and weight.grad is None and weight.is_leaf and weight.ndim == 2
    assert weight.size() == (3, 4) and weight.dim() == 2 and weight.numel() == 12 and weight.is_floating_point()
    assert isinstance(weight._version, int) and weight.stride() == (0, 0)  # the placeholder's: nothing opened
    weight.grad = torch.ones(3, 4)  # a setter
    assert weight.grad is not None
    hash(weight)
    assert access.log == []


def test_an_operation_opens_the_block_runs_on_the_real_weights_and_closes_it():
    _reader, access, weight = _setup()
    before = access.real.clone()
    total = weight.sum()
    assert access.log == ["open", "close"]
    assert torch.equal(total, access.real.sum()) and not torch.isnan(total)
    assert type(total) is torch.Tensor, "results are plain tensors"
    access.log.clear()
    out = torch.nn.functional.linear(torch.ones(2, 4), weight)
    assert access.log == ["open", "close"] and torch.equal(out, torch.ones(2, 4) @ access.real.t())
    access.log.clear()
    with torch.no_grad():
        weight.mul_(2.0)  # a write lands in the real weights while the block is open
    assert access.log == ["open", "close"] and torch.equal(access.real, 2.0 * before)
    assert access.pins == 0


def test_a_view_returned_by_an_operation_pins_the_block_until_it_is_collected():
    _reader, access, weight = _setup()
    row = weight[0]
    assert access.log == ["open", "pin", "close"] and access.pins == 1
    assert torch.equal(row, access.real[0])
    copied = weight * 1.0  # a new tensor, not a view of the block: nothing pinned
    assert access.pins == 1 and access.log[-2:] == ["open", "close"]
    del copied, row
    gc.collect()
    assert access.pins == 0


def test_deepcopy_and_repr_give_the_parameters_own_class_from_the_real_weights():
    for own in (nn.Parameter, Scaled):
        _reader, access, weight = _setup(own)
        twin = copy.deepcopy(weight)
        assert type(twin) is own and not reads_through(twin)
        assert torch.equal(twin.detach(), access.real) and twin.requires_grad
        assert "open" in access.log and access.log[-1] == "close"
        access.log.clear()
        text = repr(weight)
        assert access.log == ["open", "close"]
        assert text == own.__repr__(own(access.real.clone()))
        assert "nan" not in text and "ReadThrough" not in text


def test_without_an_access_operations_run_on_whatever_the_parameter_holds():
    reader, access, weight = _setup()
    reader.serve(None)  # the engine is closing
    assert bool(weight.detach().isnan().all())
    assert access.log == []


def test_a_parameter_of_no_served_block_runs_as_it_is():
    reader, access, _weight = _setup()
    other = nn.Parameter(torch.ones(2))
    reader.mark(other)
    assert torch.equal(other * 2, torch.full((2,), 2.0)) and access.log == []


def test_is_metadata_tells_describing_calls_from_reading_ones():
    assert is_metadata(torch.Tensor.size) and is_metadata(torch.Tensor.dim)
    assert is_metadata(torch.Tensor.shape.__get__) and is_metadata(torch.Tensor.grad.__set__)
    assert not is_metadata(torch.Tensor.sum) and not is_metadata(torch.Tensor.data.__get__)
