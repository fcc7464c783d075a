"""`WeightStreamer` on its own (weights/streamer.py): a device budget (`DeviceTier` on the cpu) of two blocks
over four tiny streamed blocks, each group's weights in a whole host mirror, as placement builds them
(setup/placement.py) but without an engine: the LRU, the pins, the forward's plain parameters, the
saved-tensor handles, the counts."""

from __future__ import annotations

import gc
from typing import List

import pytest
import torch
from torch import nn

from offload.errors import OffloadError
from offload.scheduler.blocks.block import Block, Residency, build_blocks
from offload.scheduler.weights.read_through import reads_through
from offload.scheduler.weights.streamer import PackedWeight, WeightStreamer
from offload.scheduler.weights.weight_home import HostMirror
from offload.tiers.copies import CopyContext
from offload.tiers.device import DeviceTier

BLOCK_BYTES = (8 * 8 + 8) * 4  # one nn.Linear(8, 8) in fp32
CPU = torch.device("cpu")


class KeepsNothing:
    """The release observer of blocks whose parameters nothing writes here (a block record keeps such writes)."""

    def keep_writes_before_release(self) -> None:
        pass


class Streamed:
    """Four one-layer blocks adopted by a streamer whose budget holds two of them."""

    def __init__(self, budget_blocks: int = 2) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        self.weights = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.device = DeviceTier(CPU, budget_blocks * BLOCK_BYTES)
        copies = CopyContext(CPU)
        self.streamer = WeightStreamer(self.device, copies)
        self.blocks: List[Block] = build_blocks(self.model, torch.float32)
        for block in self.blocks:
            assert block.weight_bytes == BLOCK_BYTES
            homes = []
            for group in block.groups:
                buffer = self.device.allocate(group.numel, group.dtype, block.name)
                for slot in group.slots:
                    buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
                group.device_buffer = buffer
                group.point_params_at(buffer)
                homes.append(HostMirror(group, copies, whole=True))
            self.streamer.adopt(block, homes, KeepsNothing())

    def resident(self) -> List[int]:
        return [b.index for b in self.blocks if b.residency is Residency.RESIDENT]

    def holds_its_weights(self, block: Block) -> bool:
        return all(torch.equal(slot.param.detach(), self.weights[slot.name]) for slot in block.slots)


def test_adopted_blocks_are_released_to_placeholders_that_read_through():
    s = Streamed()
    assert s.resident() == [] and s.device.in_use == 0
    for block in s.blocks:
        for slot in block.slots:
            assert reads_through(slot.param) and slot.param.shape == slot.shape
            with torch.no_grad():
                plain = slot.param.as_subclass(torch.Tensor)  # nobody serves reads: the placeholder itself
            assert bool(plain.isnan().all()) and plain.untyped_storage().nbytes() == 4
        assert s.streamer.block_of(block.groups[0].slots[0].param) is block


def test_least_recently_used_is_evicted_first():
    s = Streamed()
    b0, b1, b2, _b3 = s.blocks
    s.streamer.ensure(b0, pin=False)
    s.streamer.ensure(b1, pin=False)
    s.streamer.ensure(b0, pin=False)  # used again: b1 is now the oldest
    assert s.resident() == [0, 1] and s.streamer.counts.fetches == 2
    s.streamer.ensure(b2, pin=False)
    assert s.resident() == [0, 2]
    assert s.streamer.counts.evictions == 1 and s.streamer.counts.fetches == 3
    assert s.device.in_use == 2 * BLOCK_BYTES and s.device.over_budget_events == 0
    assert s.holds_its_weights(b0) and s.holds_its_weights(b2)


def test_pinned_blocks_are_never_evicted_and_the_fetch_goes_over_budget():
    s = Streamed()
    b0, b1, b2, b3 = s.blocks
    s.streamer.ensure(b0, pin=True)
    s.streamer.ensure(b1, pin=True)
    s.streamer.ensure(b2, pin=False)  # nothing can go: over budget, counted, never wrong
    assert s.resident() == [0, 1, 2]
    assert s.device.over_budget_events == 1 and s.device.in_use == 3 * BLOCK_BYTES
    assert s.streamer.counts.evictions == 0
    s.streamer.unpin(b0.index)
    s.streamer.ensure(b3, pin=False)  # b0 (unpinned, oldest) and b2 go; b1 stays pinned
    assert s.resident() == [1, 3] and s.streamer.counts.evictions == 2
    s.streamer.pin(b1.index)  # pins count: two pins need two unpins
    s.streamer.unpin(b1.index)
    s.streamer.ensure(b0, pin=False)
    assert s.resident() == [0, 1], "b1 is still pinned (two pins, one unpin): b3 goes instead"
    assert s.holds_its_weights(b1) and s.holds_its_weights(b0)


def test_inside_the_forward_the_parameters_are_plain_and_read_through_again_after():
    s = Streamed()
    block = s.blocks[0]
    params = [slot.param for slot in block.slots]
    s.streamer.ensure(block, pin=True)
    assert all(reads_through(p) for p in params), "resident, but outside its forward"
    s.streamer.enter_forward(block)
    s.streamer.enter_forward(block)  # nested: the same block's module called inside another owner
    assert all(type(p) is nn.Parameter for p in params)
    s.streamer.leave_forward(block)
    assert all(type(p) is nn.Parameter for p in params), "still inside the outer forward"
    s.streamer.leave_forward(block)
    assert all(reads_through(p) and isinstance(p, nn.Parameter) for p in params)
    s.streamer.leave_forward(block)  # one more leave than enters changes nothing
    assert all(reads_through(p) for p in params)


def test_a_saved_weight_is_packed_as_a_handle_and_unpacked_by_fetching_its_block_again():
    s = Streamed(budget_blocks=1)
    b0, b1 = s.blocks[:2]
    s.streamer.ensure(b0, pin=True)
    s.streamer.enter_forward(b0)
    weight = b0.groups[0].slots[0].param
    packed = s.streamer.pack(weight.t())  # what autograd saves for a linear: a view of the weight
    assert isinstance(packed, PackedWeight) and packed.block_index == b0.index
    other = torch.ones(3)
    assert s.streamer.pack(other) is other, "anything else is kept as it is"
    s.streamer.leave_forward(b0)
    s.streamer.unpin(b0.index)
    s.streamer.ensure(b1, pin=False)  # b0 is evicted
    assert s.resident() == [1]
    view = s.streamer.unpack(packed)
    assert s.resident() == [0], "unpacked: b0 fetched again (b1 evicted for it)"
    assert torch.equal(view, s.weights["0.weight"].t())
    s.streamer.ensure(b1, pin=False)  # the unpacked view pins b0: over budget rather than evicting it
    assert s.resident() == [0, 1] and s.device.over_budget_events == 1
    del view
    gc.collect()
    s.streamer.ensure(s.blocks[2], pin=False)
    assert 0 not in s.resident(), "once the view is gone, b0 may go"
    assert s.streamer.unpack(other) is other  # type: ignore[arg-type]


def test_a_released_blocks_placeholder_is_refused_by_name_when_saved():
    s = Streamed()
    block = s.blocks[1]
    with pytest.raises(OffloadError, match="parameter '1.weight' of block '1'.*outside the modules that own it"):
        s.streamer.pack(block.groups[0].slots[0].param)


def test_views_of_a_resident_block_pin_it_while_they_live():
    s = Streamed(budget_blocks=1)
    b0, b1 = s.blocks[:2]
    s.streamer.ensure(b0, pin=False)
    buffer = b0.groups[0].device_buffer
    assert buffer is not None
    view = buffer[:8]
    s.streamer.pin_views([view, torch.zeros(2), b0.groups[0].slots[0].param])  # only the view pins
    s.streamer.ensure(b1, pin=False)
    assert s.resident() == [0, 1]
    del view
    gc.collect()
    s.streamer.ensure(s.blocks[2], pin=False)
    assert s.resident() == [2]


def test_a_prefetch_fetches_the_next_block_when_the_budget_has_room_and_counts_it():
    s = Streamed()
    b0, b1, b2, _b3 = s.blocks
    s.streamer.ensure(b0, pin=True, prefetch=b1)
    assert s.resident() == [0, 1]
    assert s.streamer.counts.prefetches == 1 and s.streamer.counts.fetches == 2
    s.streamer.ensure(b1, pin=True, prefetch=b2)  # no room: b0 and b1 are pinned, so no prefetch
    assert s.resident() == [0, 1] and s.streamer.counts.prefetches == 1
    assert s.device.over_budget_events == 0


def test_restore_all_brings_every_block_back_as_plain_parameters():
    s = Streamed()
    s.streamer.ensure(s.blocks[0], pin=False)
    s.streamer.restore_all()
    assert s.resident() == [0, 1, 2, 3] and not s.streamer.active
    for block in s.blocks:
        assert all(type(slot.param) is nn.Parameter for slot in block.slots)
        assert s.holds_its_weights(block)
    assert [p.detach() for p in s.model.parameters()][0].equal(s.weights["0.weight"])


def test_a_handle_packed_before_restore_all_unpacks_to_the_restored_weights():
    s = Streamed()
    block = s.blocks[0]
    s.streamer.ensure(block, pin=True)
    s.streamer.enter_forward(block)
    packed = s.streamer.pack(block.groups[0].slots[0].param)
    s.streamer.leave_forward(block)
    s.streamer.unpin(block.index)
    s.streamer.restore_all()  # engine.close(): every block back, the model plain PyTorch
    view = s.streamer.unpack(packed)
    assert torch.equal(view, s.weights["0.weight"])
