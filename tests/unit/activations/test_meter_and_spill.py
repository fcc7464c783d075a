"""The saved-tensor hooks on their own (scheduler/activations/): `SavedTensorMeter` and `RootSavedTensors`
(meter.py: what a training forward saves, counted once per tensor for the block entered last, weights left out,
and torch's own check of saved tensors written in place), `ActivationSpill` (spill.py: saved tensors to a file in
a test's directory and back, bit for bit) and the plan's `ActivationUse` (planner/activations.py). Small forwards
of plain torch ops stand for the model; the block owners' `enter_block` calls are made by hand."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator, List, Optional

import pytest
import torch
from torch import Tensor, nn

from offload.planner.activations import ActivationUse
from offload.scheduler.activations.meter import RootSavedTensors, SavedTensorMeter, token_count
from offload.scheduler.activations.spill import MIN_SPILL_BYTES, ActivationSpill, SpilledTensor, movable
from offload.tiers.host import StagingPool

MiB = 1 << 20
SIDE = 512  # a SIDE x SIDE fp32 tensor is 1 MiB: the smallest that spills
TORCH_TEXT = "one of the variables needed for gradient computation has been modified by an inplace operation"


def _same(tensor: Tensor) -> Tensor:
    return tensor


class Handle:
    """A streamed weight's handle, as the weight streamer's pack returns it."""

    def __init__(self, weight: Tensor) -> None:
        self.weight = weight


@contextlib.contextmanager
def spill_in(tmp_path, slot_bytes: int = MiB, slots: int = 2, keep=lambda t: False, inner_pack=_same,
             inner_unpack=_same) -> Iterator[ActivationSpill]:
    spill = ActivationSpill(str(tmp_path), StagingPool(slots * slot_bytes), slot_bytes, slots, keep, inner_pack,
                            inner_unpack)
    try:
        yield spill
    finally:
        spill.close()


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's bytes (NaN payloads and signed zeros compared too)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


# ----- the meter --------------------------------------------------------------------------------------------
def test_what_a_forward_saves_counts_once_per_tensor_for_the_block_entered_last_and_no_weight():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(SIDE, SIDE))
    root = RootSavedTensors(_same, _same, lambda: True, lambda t: t.data_ptr() == weight.data_ptr())
    x = torch.randn(SIDE, SIDE, requires_grad=True)
    small = torch.randn(10, requires_grad=True)
    with root.context(True, 77):
        root.meter.enter_block(0)
        y = x.exp()  # saves its result y
        z = y * weight  # saves y again (held once) and the weight (not an activation)
        root.meter.enter_block(1)
        s = small.exp()  # 40 bytes: too small to spill
        b = z.tanh()  # saves its result
    root.meter.end()
    assert root.meter.last == ActivationUse(saved_bytes=2 * MiB + 40, movable_bytes=2 * MiB, moved_bytes=0,
                                            largest_block_bytes=MiB + 40, tokens=77)
    (b.sum() + s.sum()).backward()
    got = x.grad.clone(), weight.grad.clone(), small.grad.clone()
    x.grad = weight.grad = small.grad = None
    (((x.exp() * weight).tanh()).sum() + small.exp().sum()).backward()  # torch alone
    assert all(torch.equal(a, b) for a, b in zip(got, (x.grad, weight.grad, small.grad)))


def test_a_streamed_weights_handle_is_not_counted_and_its_unpack_is_the_inner_one():
    weight = torch.randn(SIDE, SIDE, requires_grad=True)
    unpacked: List[Handle] = []

    def pack(tensor: Tensor) -> object:
        return Handle(tensor) if tensor is weight else tensor

    def unpack(packed: object) -> Tensor:
        if isinstance(packed, Handle):
            unpacked.append(packed)
            return packed.weight
        return packed  # type: ignore[return-value]

    root = RootSavedTensors(pack, unpack, lambda: True, lambda t: False)
    x = torch.randn(SIDE, SIDE, requires_grad=True)
    with root.context(True, None):
        out = x * weight  # saves x (an activation) and the weight (a handle)
    root.meter.end()
    assert root.meter.last == ActivationUse(MiB, MiB, 0, MiB, None)
    out.sum().backward()
    assert len(unpacked) == 1 and torch.equal(x.grad, weight.detach())


def test_no_hooks_needed_means_nothing_is_metered():
    root = RootSavedTensors(_same, _same, lambda: False, lambda t: False)
    x = torch.randn(SIDE, SIDE, requires_grad=True)
    context = root.context(True, 3)
    with context:
        x.exp().sum().backward()
    root.meter.end()
    assert isinstance(context, contextlib.nullcontext) and root.meter.last is None


def test_an_evaluation_forward_is_not_metered_and_a_new_forward_starts_from_zero():
    root = RootSavedTensors(_same, _same, lambda: True, lambda t: False)
    x = torch.randn(SIDE, SIDE, requires_grad=True)
    with root.context(True, None):
        x.exp()
        x.sin()
    root.meter.end()
    assert root.meter.last is not None and root.meter.last.saved_bytes == 2 * MiB
    with root.context(False, None):  # no graph recorded: the hooks check, nothing is measured
        x.exp()
    root.meter.end()
    assert root.meter.last.saved_bytes == 2 * MiB
    with root.context(True, 5):
        x.exp()
    root.meter.end()
    assert root.meter.last == ActivationUse(MiB, MiB, 0, MiB, 5)


def test_a_recompute_marks_the_last_measurement():
    meter = SavedTensorMeter(_same, lambda t: False)
    meter.saw_recompute()
    assert meter.last is None, "nothing measured yet"
    meter.begin(4)
    meter.enter_block(2)
    meter.pack(torch.zeros(SIDE, SIDE))
    meter.end()
    first = meter.last
    meter.saw_recompute()
    assert meter.last == ActivationUse(first.saved_bytes, first.movable_bytes, first.moved_bytes,
                                       first.largest_block_bytes, 4, recomputed=True)


def test_the_meter_counts_only_while_a_training_forward_runs_and_skips_what_is_no_activation():
    meter = SavedTensorMeter(_same, lambda t: t.numel() == 7)
    meter.pack(torch.zeros(SIDE, SIDE))  # before begin: not counted
    meter.begin(None)
    meter.enter_block(0)
    big = torch.zeros(SIDE, SIDE)
    assert meter.pack(big) is big, "the inner pack's result"
    meter.pack(big)  # saved by a second node: held once
    meter.pack(big[:SIDE // 2])  # a view of it of another size: another saved tensor
    meter.pack(torch.zeros(7))  # a weight
    meter.pack(torch.zeros(3, device="meta"))
    meter.enter_block(1)
    meter.pack(torch.zeros(100))
    meter.end()
    assert meter.last == ActivationUse(MiB + MiB // 2 + 400, MiB, 0, MiB + MiB // 2, None)


def test_token_count_finds_the_token_input():
    ids = torch.zeros(2, 9, dtype=torch.long)
    assert token_count((), {"input_ids": ids}) == 18
    assert token_count((torch.zeros(3), ids), {}) == 18, "the first integer tensor"
    assert token_count((torch.zeros(3, dtype=torch.bool),), {}) is None
    assert token_count((torch.zeros(3),), {}) is None


# ----- torch's check of saved tensors written in place -------------------------------------------------------
def _torch_error(rows: int) -> str:
    x = torch.randn(rows, 64, requires_grad=True)
    y = (x * 1.0).exp()
    y.mul_(2)
    with pytest.raises(RuntimeError) as raised:
        (y * 1.0).sum().backward()
    return str(raised.value)


def _check_raises_as_torch(root: RootSavedTensors, rows: int, where: str) -> None:
    want = _torch_error(rows)
    assert TORCH_TEXT in want.lower()
    x = torch.randn(rows, 64, requires_grad=True)
    with root.context(True, None):
        y = (x * 1.0).exp()  # saves its result
        y.mul_(2)  # exp's backward would read 2 * exp(x)
        out = (y * 1.0).sum()
    root.meter.end()
    with pytest.raises(RuntimeError) as raised:
        out.backward()
    got = str(raised.value)
    assert TORCH_TEXT in got.lower()
    tensor = want[want.index("["):want.index("]]") + 2]  # "[torch.FloatTensor [8, 64]]"
    versions = want[want.index(" is at version"):want.index(" instead.")]
    assert tensor in got and versions in got and "which is output 0 of Exp," in got, (got, want)
    assert "offload" in got and where in got, got


def test_a_kept_tensor_written_in_place_raises_torchs_error():
    root = RootSavedTensors(_same, _same, lambda: True, lambda t: False)
    _check_raises_as_torch(root, 8, "kept on the device under the hooks that are on while weights stream")


def test_a_spilled_tensor_written_in_place_raises_torchs_error(tmp_path):
    with spill_in(tmp_path) as spill:
        root = RootSavedTensors(spill.pack, spill.unpack, lambda: True, lambda t: False, activations_offloaded=True)
        _check_raises_as_torch(root, 8192, "written to the swap file by activations='offload' (2,097,152 bytes)")
        assert spill.tensors_spilled >= 1


def test_a_write_before_the_save_is_allowed_and_the_gradient_is_torchs(tmp_path):
    with spill_in(tmp_path) as spill:
        root = RootSavedTensors(spill.pack, spill.unpack, lambda: True, lambda t: False, activations_offloaded=True)
        torch.manual_seed(0)
        x = torch.randn(SIDE * 2, SIDE, requires_grad=True)
        with root.context(True, None):
            h = x * 3.0
            h.add_(1.0)  # nothing saved h yet
            y = torch.relu_(h).exp()  # relu_ saves its result after its own write; exp its result (2 MiB: spilled)
            out = (y * y).sum()
        root.meter.end()
        out.backward()
        got = x.grad.clone()
        assert root.meter.last is not None and root.meter.last.moved_bytes >= 2 * MiB
        x.grad = None
        h = x * 3.0
        h.add_(1.0)
        y = torch.relu_(h).exp()
        (y * y).sum().backward()
        assert torch.equal(got, x.grad)


# ----- the spill ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_spilled_tensor_comes_back_bit_for_bit(tmp_path, dtype):
    torch.manual_seed(0)
    with spill_in(tmp_path, slot_bytes=MiB) as spill:
        numel = (5 * MiB // 2) // dtype.itemsize  # 2.5 MiB: three slots' worth
        tensor = torch.randn(numel).to(dtype)
        tensor[:4] = torch.tensor([float("nan"), -0.0, float("-inf"), 1e-40]).to(dtype)
        tensor = tensor.view(-1, 64)
        want = _bits(tensor).clone()
        packed = spill.pack(tensor)
        assert isinstance(packed, SpilledTensor) and packed.shape == tuple(tensor.shape) and packed.dtype == dtype
        assert packed.nbytes == tensor.numel() * dtype.itemsize and len(packed.writes) == 3
        tensor.zero_()  # its memory is the forward's again: the file holds the values
        back = spill.unpack(packed)
        assert back.shape == packed.shape and back.dtype == dtype and torch.equal(_bits(back), want)
        stats = spill.stats()
        assert stats["activation_bytes_to_disk"] == packed.nbytes == stats["activation_bytes_from_disk"]
        assert stats["activation_tensors_spilled"] == 1


def test_a_non_contiguous_tensor_comes_back_contiguous_with_its_values(tmp_path):
    with spill_in(tmp_path) as spill:
        tensor = torch.randn(SIDE, SIDE * 2).t()
        want = tensor.clone()
        back = spill.unpack(spill.pack(tensor))
        assert back.is_contiguous() and torch.equal(back, want)


def test_small_tensors_kept_tensors_and_streamed_weights_stay(tmp_path):
    weight = torch.randn(SIDE, SIDE)
    inner_unpacked: List[object] = []

    def inner_pack(tensor: Tensor) -> object:
        return Handle(tensor) if tensor is weight else tensor

    def inner_unpack(packed: object) -> Tensor:
        inner_unpacked.append(packed)
        return packed.weight  # type: ignore[attr-defined]

    big_kept = torch.randn(SIDE, SIDE)
    with spill_in(tmp_path, keep=lambda t: t is big_kept, inner_pack=inner_pack, inner_unpack=inner_unpack) as spill:
        small = torch.randn(MIN_SPILL_BYTES // 4 - 1)
        assert not movable(small) and movable(big_kept)
        assert spill.pack(small) is small and spill.pack(big_kept) is big_kept
        handle = spill.pack(weight)
        assert isinstance(handle, Handle) and spill.unpack(handle) is weight and inner_unpacked == [handle]
        x = torch.randn(10, requires_grad=True)
        y = x.exp()
        kept = spill.pack(y)
        assert kept is not y and kept.grad_fn is None and kept.data_ptr() == y.data_ptr(), "detached, no cycle"
        assert spill.tensors_spilled == 0 and spill.stats()["activation_bytes_to_disk"] == 0


def test_the_unpack_of_a_tensor_reads_the_two_packed_before_it_ahead(tmp_path):
    torch.manual_seed(1)
    with spill_in(tmp_path) as spill:
        tensors = [torch.randn(SIDE, SIDE) for _ in range(4)]
        handles = [spill.pack(t) for t in tensors]
        assert spill.unpack(handles[3]).equal(tensors[3])
        assert spill.stats()["activation_bytes_from_disk"] == 3 * MiB, "its own read and two ahead"
        for index in (2, 1):
            assert spill.unpack(handles[index]).equal(tensors[index])
        assert spill.stats()["activation_bytes_from_disk"] == 4 * MiB, "1 was read ahead by 3's unpack, 0 now by 2's"
        assert spill.unpack(handles[0]).equal(tensors[0])
        assert spill.stats()["activation_bytes_from_disk"] == 4 * MiB
        assert spill.unpack(handles[3]).equal(tensors[3]), "a second backward reads it again"
        assert spill.stats()["activation_bytes_from_disk"] == 5 * MiB


def test_the_files_space_is_reused_once_every_handle_is_gone(tmp_path):
    with spill_in(tmp_path) as spill:
        first: Optional[SpilledTensor] = spill.pack(torch.randn(SIDE, SIDE))  # type: ignore[assignment]
        second: Optional[SpilledTensor] = spill.pack(torch.randn(SIDE, SIDE))  # type: ignore[assignment]
        assert first is not None and second is not None and (first.offset, second.offset) == (0, MiB)
        first = None
        gc.collect()
        third = spill.pack(torch.randn(SIDE, SIDE))
        assert third.offset == 2 * MiB, "a handle is still alive: no reuse"  # type: ignore[attr-defined]
        second = third = None
        gc.collect()
        fourth = spill.pack(torch.randn(SIDE, SIDE))
        assert fourth.offset == 0, "every handle gone: from the start"  # type: ignore[attr-defined]
        assert spill.stats()["activation_file_peak_bytes"] == 3 * MiB


def test_a_backward_through_spilled_activations_equals_torchs(tmp_path):
    torch.manual_seed(2)
    lin = nn.Linear(SIDE, SIDE)
    x = torch.randn(SIDE * 2, SIDE, requires_grad=True)

    def forward() -> Tensor:
        h = torch.tanh(lin(x))  # 2 MiB results
        return (torch.exp(h) * h).sum()

    with spill_in(tmp_path) as spill:
        with torch.autograd.graph.saved_tensors_hooks(spill.pack, spill.unpack):
            loss = forward()
        assert spill.tensors_spilled >= 3
        loss.backward()
        got = [t.grad.clone() for t in (x, lin.weight, lin.bias)]
    for t in (x, lin.weight, lin.bias):
        t.grad = None
    forward().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(got, (x, lin.weight, lin.bias)))


# ----- the plan's numbers ------------------------------------------------------------------------------------
def test_activation_use_numbers():
    use = ActivationUse(saved_bytes=1000, movable_bytes=800, moved_bytes=0, largest_block_bytes=300, tokens=10)
    assert not use.offloaded
    assert use.on_device_offloaded == 500, "the small ones (200) and one block's set (300)"
    assert ActivationUse(1000, 100, 0, 950).on_device_offloaded == 1000, "never more than keeping them all"
    assert use.tokens_that_fit(250, offloaded=False) == 2  # 250 * 10 // 1000
    assert use.tokens_that_fit(250, offloaded=True) == 5  # 250 * 10 // 500
    assert use.tokens_that_fit(-5, offloaded=False) == 0
    assert ActivationUse(1000, 800, 0, 300).tokens_that_fit(250, False) is None, "no token count"
    assert ActivationUse(1000, 800, 800, 300).offloaded


def test_activation_use_lines():
    def human(n):
        return f"{n}B"

    kept = ActivationUse(1000, 800, 0, 300, tokens=10).lines(250, human)
    assert kept[0] == ("activations (measured in the last training forward, 10 tokens): 1000B saved for the "
                       "backward (100B a token), the largest block 300B")
    assert kept[1] == ("  activations=None: all of it stays on the device; activations='offload' would move 800B "
                       "to the swap file, leaving about 500B on the device at once")
    assert kept[2] == ("  the device room the plan leaves (250B) holds the activations of about 2 tokens per "
                       "micro-batch kept, 5 offloaded")
    moved = ActivationUse(1000, 800, 800, 300, recomputed=True).lines(None, human)
    assert moved[1] == ("  activations='offload': 800B to the swap file, 200B stay on the device (tensors under "
                        "1 MiB); on the device at once about 500B")
    assert moved[2].startswith("  activation checkpointing:") and len(moved) == 3
