"""A gradient home that parks on disk, on its own (records/grad_home.py: `GradHome` of a `WindowBuffer` and a
`DiskParking`), over a real ring and swap file holding a gradient record, built as setup/placement.py builds it
(`plan_grad_layout`, `SwapStore(..., grads)`, `DiskRing`, `ring.grads`): a park writes the sum and gives the
window its bytes back, the next gradient reads the sum back and adds in torch's order, norms and the finiteness
check read it back, torch's in-place ops made while it is on disk are replayed when it comes back, zero and
release forget it, and a data-parallel rank parks only its averaged part."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import nn

from offload.planner.ring import min_ring_bytes
from offload.scheduler.blocks.block import FlatGroup, ParamSlot
from offload.scheduler.records.grad_home import DiskParking, GradHome
from offload.scheduler.records.held_grad import is_held
from offload.scheduler.ring.disk_ring import DiskRing
from offload.tiers.copies import CopyContext
from offload.tiers.disk import SwapStore
from offload.tiers.grad_window import GradPool
from offload.tiers.host import StagingPool
from offload.tiers.swap_layout import plan_grad_layout
from tests.unit.records.groups import TRAINABLE_SHAPES, grad_of, make_group

CPU = torch.device("cpu")
MUL = torch.ops.aten.mul_.Scalar
NORM = torch.ops.aten.linalg_vector_norm.default
TRAINABLE = sum(torch.Size(s).numel() for s in TRAINABLE_SHAPES)  # 23


class Owner:
    """A fake `GradOwner` (the block's record): logs what the home tells it; `reduced` as data-parallel says."""

    def __init__(self, reduced: bool = False) -> None:
        self.reduced = reduced
        self.calls: List[str] = []

    def check_grads_for_torch(self) -> None:
        self.calls.append("check")

    def grads_changed(self) -> None:
        self.calls.append("changed")

    def before_grad_arrives(self) -> None:
        self.calls.append("arrives")


@dataclass
class Parked:
    home: GradHome
    group: FlatGroup
    pool: GradPool
    ring: DiskRing
    swap: SwapStore
    owner: Owner

    def piece(self, index: int) -> torch.Tensor:
        slot = self.group.trainable_slots[index]
        return self.home.buffer()[slot.offset:slot.offset + slot.numel]

    def on_disk(self) -> torch.Tensor:
        """The gradient record as the swap file holds it, read through the ring (not through the home)."""
        numel = self.swap.grads[self.group.key].numel
        out = torch.full((numel,), float("nan"), dtype=self.group.dtype)
        self.ring.grads.read_into(self.group, out, _copy)
        return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _big_group(dtype: torch.dtype) -> FlatGroup:
    """Two trainable parameters of 5100 elements in all (several ring chunks), then a frozen one."""
    slots: List[ParamSlot] = []
    offset = 0
    for i, (shape, trainable) in enumerate((((3000,), True), ((700, 3), True), ((4,), False))):
        param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=trainable)
        slots.append(ParamSlot(f"big.p{i}", param, param.shape, offset, param.numel(), trainable))
        offset += param.numel()
    group = FlatGroup(dtype, slots, "big")
    group.device_buffer = torch.zeros(group.numel, dtype=dtype)
    group.point_params_at(group.device_buffer)
    return group


@contextlib.contextmanager
def parked_home(tmp_path, dtype: torch.dtype = torch.float32, group: Optional[FlatGroup] = None,
                padded_numel: Optional[int] = None, parked_range: Optional[Tuple[int, int]] = None,
                owner: Optional[Owner] = None) -> Iterator[Parked]:
    """The group's home as placement builds it on the nvme tier with gradients on disk; everything closed after."""
    group = group if group is not None else make_group(dtype)
    record_numel = None
    if parked_range is not None:
        record_numel = parked_range[1] - parked_range[0]  # with clipping: the rank's averaged part
    elif padded_numel is not None:
        record_numel = padded_numel
    grads, size = plan_grad_layout([group.shape("blk")], 0,
                                   None if record_numel is None else (lambda _shape: record_numel))
    swap = SwapStore(str(tmp_path), {}, size, None, grads)
    staging = StagingPool(min_ring_bytes())
    ring = DiskRing(swap, staging, min_ring_bytes(), 4)
    pool = GradPool(1 << 20)
    home = GradHome(group, CPU, CopyContext(CPU), True, padded_numel, pool, DiskParking(ring.grads, parked_range))
    owner = owner if owner is not None else Owner()
    home.owner = owner
    try:
        yield Parked(home, group, pool, ring, swap, owner)
    finally:
        ring.drain()
        ring.close()
        swap.close()
        staging.close()


def _accumulate(kit: Parked, grads: Sequence[Optional[torch.Tensor]]) -> None:
    for index, grad in enumerate(grads):
        if grad is not None:
            kit.home.accumulate(index, grad)


def test_a_park_writes_the_sum_to_the_record_and_gives_the_window_its_bytes_back(tmp_path):
    with parked_home(tmp_path) as kit:
        home = kit.home
        assert home.parks and not home.on_disk and home.grad is None, "a window buffer: taken at the first gradient"
        g0, g2 = grad_of(kit.group, 0), grad_of(kit.group, 2)
        _accumulate(kit, [g0, None, g2])
        assert kit.pool.in_use == TRAINABLE * 4
        expected = home.buffer().clone()
        home.park()
        assert home.grad is None and kit.pool.in_use == 0 and home.on_disk
        assert home.disk_bytes.written == TRAINABLE * 4 and home.disk_bytes.read == 0
        assert kit.swap.bytes_written == TRAINABLE * 4
        assert home.ready_indices() == [0, 2], "the flags stay: the gradients are on disk, not gone"
        assert home.nbytes == 0
        on_disk = kit.on_disk()
        assert torch.equal(on_disk, expected)
        assert torch.equal(on_disk[:12], g0.reshape(-1)) and torch.equal(on_disk[17:], g2.reshape(-1))
        assert torch.equal(on_disk[12:17], torch.zeros(5)), "no gradient: the window's zeros"


def test_a_park_without_a_gradient_writes_nothing(tmp_path):
    with parked_home(tmp_path) as kit:
        home = kit.home
        home.park()  # no buffer was ever taken
        assert not home.on_disk and home.disk_bytes.written == 0
        home.accumulate(1, grad_of(kit.group, 1))
        home.forget(1)  # model.zero_grad() cleared it: the buffer holds no gradient
        home.park()
        assert not home.on_disk and home.disk_bytes.written == 0 and kit.swap.bytes_written == 0
        assert home.grad is None and kit.pool.in_use == 0, "the buffer still goes back to the window"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_micro_batch_adds_to_the_sum_read_back_as_torch_accumulates(tmp_path, dtype):
    """Three micro-batches, the sum parked after each: the same bits as torch's `.grad` after three backward
    passes (AccumulateGrad: running sum + new gradient), in bf16 too, where the order of the additions shows."""
    torch.manual_seed(0)
    with parked_home(tmp_path, dtype) as kit:
        home, group = kit.home, kit.group
        batches = [[grad_of(group, i) * (10.0 ** k) for i in range(3)] for k in range(3)]
        batches[0][1] = None  # the second parameter's first gradient comes in the second micro-batch
        torch_params = [nn.Parameter(torch.zeros(s.shape, dtype=dtype)) for s in group.trainable_slots]
        for batch in batches:
            _accumulate(kit, batch)
            assert not home.on_disk
            home.park()
            assert home.on_disk and home.grad is None and kit.pool.in_use == 0
            for param, grad in zip(torch_params, batch):  # torch's own accumulation of the same gradients
                if grad is not None:
                    (param * grad).sum().backward()
        assert home.disk_bytes.read == 2 * TRAINABLE * dtype.itemsize, "read back once per later micro-batch"
        assert home.disk_bytes.written == 3 * TRAINABLE * dtype.itemsize
        for index, param in enumerate(torch_params):
            assert torch.equal(kit.piece(index), param.grad.reshape(-1)), index
        assert not home.on_disk and kit.pool.in_use == TRAINABLE * dtype.itemsize, "read back: in a window buffer"
        assert home.disk_bytes.read == 3 * TRAINABLE * dtype.itemsize


def test_the_first_accumulate_after_a_park_reads_back_then_adds(tmp_path):
    with parked_home(tmp_path) as kit:
        home = kit.home
        a, b = grad_of(kit.group, 0), grad_of(kit.group, 0)
        home.accumulate(0, a)
        home.park()
        assert home.accumulate(0, b) == a.numel() * 4
        assert home.disk_bytes.read == TRAINABLE * 4
        assert torch.equal(kit.piece(0), (a + b).reshape(-1))
        assert not home.on_disk
        home.park()  # parked again: the new sum is written
        assert torch.equal(kit.on_disk()[:12], (a + b).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_read_from_disk_equal_vector_norm_and_leave_the_sum_on_disk(tmp_path, dtype):
    with parked_home(tmp_path, dtype) as kit:
        home, group = kit.home, kit.group
        g0, g2 = grad_of(group, 0) * 3, grad_of(group, 2)
        _accumulate(kit, [g0, None, g2])
        home.park()
        norms = home.norms()
        assert [p for p, _n in norms] == [group.trainable_slots[0].param, group.trainable_slots[2].param]
        for (_p, norm), g in zip(norms, (g0, g2)):
            assert norm == float(torch.linalg.vector_norm(g, 2, dtype=torch.float32))
        assert home.disk_bytes.read == TRAINABLE * dtype.itemsize
        assert home.on_disk and home.grad is None and kit.pool.in_use == 0, "the read back is dropped after"
        assert home.norms() == norms
        assert home.disk_bytes.read == 2 * TRAINABLE * dtype.itemsize, "each read of it is one read back"
        assert home.disk_bytes.written == TRAINABLE * dtype.itemsize


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_finiteness_check_reads_the_sum_back_and_keeps_it_for_the_update(tmp_path, bad):
    with parked_home(tmp_path) as kit:
        home = kit.home
        g = grad_of(kit.group, 2)
        g[0, 1] = bad
        _accumulate(kit, [grad_of(kit.group, 0), None, g])
        home.park()
        assert not home.all_finite()
        assert home.grad is not None and not home.on_disk and kit.pool.in_use == TRAINABLE * 4
        read = home.disk_bytes.read
        assert read == TRAINABLE * 4
        torch.testing.assert_close(kit.piece(2), g.reshape(-1), rtol=0, atol=0, equal_nan=True)
        home.buffer()
        assert home.disk_bytes.read == read, "the update's read finds it in memory"


def test_read_ops_while_on_disk_cost_one_read_back_for_the_whole_group(tmp_path):
    with parked_home(tmp_path) as kit:
        home, group = kit.home, kit.group
        grads = [grad_of(group, i) for i in range(3)]
        _accumulate(kit, grads)
        home.park()
        for index, g in enumerate(grads):
            norm = home.apply(index, NORM, (2.0,), {})
            assert torch.equal(norm, torch.linalg.vector_norm(g, 2.0))
        assert home.disk_bytes.read == TRAINABLE * 4, "one read for every slot's norm"
        assert home.on_disk and home.grad is None and kit.pool.in_use == 0
        assert kit.owner.calls == ["check"] * 3
        home.apply(0, MUL, (2.0,), {})  # an in-place op: the results kept are stale
        home.apply(0, NORM, (2.0,), {})
        assert home.disk_bytes.read == 2 * TRAINABLE * 4


def test_in_place_ops_while_on_disk_wait_and_are_replayed_in_order_when_it_comes_back(tmp_path):
    with parked_home(tmp_path) as kit:
        home, group = kit.home, kit.group
        g0, g1, g2 = (grad_of(group, i) for i in range(3))
        _accumulate(kit, [g0, None, g2])
        home.park()
        held = home.apply(0, MUL, (0.3,), {})  # clip_grad_norm_'s scale of one `.grad`
        assert held is home.held[0] and is_held(held)
        assert kit.owner.calls == ["check", "changed"], "checked, and the norms taken before are stale"
        home.scale_(0.7)  # max_grad_norm's scale of every held gradient
        home.apply(2, torch.ops.aten.clamp_.default, (-0.1, 0.1), {})  # clip_grad_value_
        assert home.disk_bytes.read == 0 and home.on_disk and home.grad is None, "no trip to disk for them"
        assert kit.on_disk()[:12].equal(g0.reshape(-1)), "the record keeps the sum as parked"
        home.accumulate(1, g1)  # the next micro-batch: read back, the ops replayed, then its gradient added
        assert home.disk_bytes.read == TRAINABLE * 4
        assert torch.equal(kit.piece(0), g0.clone().mul_(0.3).mul_(0.7).reshape(-1))
        assert torch.equal(kit.piece(1), g1.reshape(-1)), "no gradient before: not scaled"
        assert torch.equal(kit.piece(2), g2.clone().mul_(0.7).clamp_(-0.1, 0.1).reshape(-1))
        home.park()
        home.buffer()
        assert torch.equal(kit.piece(0), g0.clone().mul_(0.3).mul_(0.7).reshape(-1)), "replayed once only"


@pytest.mark.parametrize("foreach", [False, True])
def test_torch_clip_grad_norm_over_held_gradients_on_disk_equals_torch(tmp_path, foreach):
    """torch.nn.utils.clip_grad_norm_ over the `.grad` stand-ins while the sum is on disk: its norms read it back
    once, its scale waits; the gradients the update then reads equal what torch leaves in plain `.grad`s."""
    torch.manual_seed(1)
    with parked_home(tmp_path) as kit:
        home, group = kit.home, kit.group
        grads = [grad_of(group, i) * 4 for i in range(3)]
        _accumulate(kit, grads)
        home.park()
        params = [slot.param for slot in group.trainable_slots]
        for index, param in enumerate(params):
            param.grad = home.held_for(index)
        plain = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for param, g in zip(plain, grads):
            param.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(plain, 1.0, foreach=foreach)
        total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
        assert torch.equal(total, want)
        assert home.disk_bytes.read == TRAINABLE * 4 and home.on_disk, "the norms' read only; the scale waits"
        for index, param in enumerate(plain):
            assert torch.equal(kit.piece(index), param.grad.reshape(-1)), index
        for param in params:
            param.grad = None


def test_zero_forgets_what_is_on_disk(tmp_path):
    with parked_home(tmp_path) as kit:
        home = kit.home
        _accumulate(kit, [grad_of(kit.group, 0), None, grad_of(kit.group, 2)])
        home.park()
        home.apply(0, MUL, (3.0,), {})
        home.zero(set_to_none=True)
        assert not home.on_disk and home.ready_indices() == []
        g = grad_of(kit.group, 0)
        home.accumulate(0, g)
        assert home.disk_bytes.read == 0, "nothing read back"
        assert torch.equal(kit.piece(0), g.reshape(-1))
        assert torch.equal(kit.piece(2), torch.zeros(6))


def test_zero_keeping_zeros_forgets_the_disk_and_keeps_the_flags(tmp_path):
    with parked_home(tmp_path) as kit:
        home, group = kit.home, kit.group
        _accumulate(kit, [grad_of(group, 0), None, grad_of(group, 2)])
        home.park()
        home.zero(set_to_none=False)
        assert not home.on_disk and home.ready_indices() == [0, 2]
        assert is_held(group.trainable_slots[0].param.grad) and group.trainable_slots[1].param.grad is None
        assert torch.equal(home.buffer(), torch.zeros(TRAINABLE)), "zeros, not the parked sum"
        assert home.disk_bytes.read == 0
        for slot in group.trainable_slots:
            slot.param.grad = None


def test_release_after_the_update_forgets_the_disk_and_the_ops_waiting(tmp_path):
    with parked_home(tmp_path) as kit:
        home = kit.home
        g0 = grad_of(kit.group, 0)
        home.accumulate(0, g0)
        home.park()
        assert torch.equal(kit.piece(0), g0.reshape(-1)), "the update reads it back"
        home.release()
        assert home.grad is None and kit.pool.in_use == 0 and not home.on_disk
        assert home.lost == {0} and home.ready_indices() == []
        read = home.disk_bytes.read
        g = grad_of(kit.group, 0)
        home.accumulate(0, g, fresh=True)  # the next step's first gradient
        assert home.disk_bytes.read == read and torch.equal(kit.piece(0), g.reshape(-1))


def test_release_of_a_parked_sum_leaves_no_in_place_op_for_the_next_one(tmp_path):
    with parked_home(tmp_path) as kit:
        home = kit.home
        home.accumulate(0, grad_of(kit.group, 0))
        home.park()
        home.apply(0, MUL, (0.0,), {})  # waits for the next read back
        home.buffer()
        home.release()
        g = grad_of(kit.group, 0)
        home.accumulate(0, g, fresh=True)
        home.park()
        assert torch.equal(kit.on_disk()[:12], g.reshape(-1))
        home.buffer()
        assert torch.equal(kit.piece(0), g.reshape(-1)), "the old scale by 0 was not replayed onto the new sum"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_of_several_ring_chunks_parks_and_comes_back_whole(tmp_path, dtype):
    torch.manual_seed(2)
    group = _big_group(dtype)
    with parked_home(tmp_path, dtype, group=group) as kit:
        home = kit.home
        assert group.trainable_numel > 2 * kit.ring.chunk_numel
        g0, g1 = torch.randn(3000).to(dtype), torch.randn(700, 3).to(dtype)
        home.accumulate(0, g0)
        home.accumulate(1, g1)
        home.park()
        assert home.disk_bytes.written == group.trainable_numel * dtype.itemsize
        h1 = torch.randn(700, 3).to(dtype)
        home.accumulate(1, h1)
        assert torch.equal(home.buffer()[:3000], g0)
        assert torch.equal(home.buffer()[3000:], (g1 + h1).reshape(-1))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_data_parallel_rank_parks_only_its_averaged_part(tmp_path, rank):
    """Two ranks, clipping: the 23 trainable elements padded to 24, rank r's part [12 r, min(12 (r + 1), 23))."""
    lo, hi = 12 * rank, min(12 * (rank + 1), TRAINABLE)
    with parked_home(tmp_path, padded_numel=24, parked_range=(lo, hi), owner=Owner(reduced=True)) as kit:
        home, group = kit.home, kit.group
        assert home.numel == 24 and kit.swap.grads[group.key].numel == hi - lo
        _accumulate(kit, [grad_of(group, i) for i in range(3)])
        whole = home.buffer().clone()
        home.park()
        assert home.disk_bytes.written == (hi - lo) * 4 and kit.pool.in_use == 0
        assert torch.equal(kit.on_disk(), whole[lo:hi])
        back = home.buffer()
        assert home.disk_bytes.read == (hi - lo) * 4
        assert torch.equal(back[lo:hi], whole[lo:hi])
        outside = torch.cat([back[:lo], back[hi:]])
        assert torch.equal(outside, torch.zeros(24 - (hi - lo))), "the other ranks' parts are not read back"


def test_a_data_parallel_part_parks_only_after_its_blocks_reduce_scatter(tmp_path):
    with parked_home(tmp_path, padded_numel=24, parked_range=(12, 23), owner=Owner(reduced=False)) as kit:
        home = kit.home
        _accumulate(kit, [grad_of(kit.group, i) for i in range(3)])
        with pytest.raises(AssertionError, match="only after its block's reduce-scatter"):
            home.park()
        assert home.grad is not None and not home.on_disk and home.disk_bytes.written == 0
        assert kit.swap.bytes_written == 0
        kit.owner.reduced = True
        home.park()
        assert home.on_disk and home.disk_bytes.written == 11 * 4


class FailingReads:
    """The ring's gradient moves, whose next read fails (an I/O error, a checksum that does not match) when told."""

    def __init__(self, moves) -> None:
        self._moves = moves
        self.fail_next_read = False

    def write_from(self, group, src) -> None:
        self._moves.write_from(group, src)

    def read_into(self, group, dst, copy) -> None:
        if self.fail_next_read:
            self.fail_next_read = False
            raise OSError("the read failed")
        self._moves.read_into(group, dst, copy)


@contextlib.contextmanager
def failing_home(tmp_path) -> Iterator[Tuple[Parked, FailingReads]]:
    with parked_home(tmp_path) as kit:
        moves = FailingReads(kit.ring.grads)
        home = GradHome(kit.group, CPU, CopyContext(CPU), True, None, kit.pool, DiskParking(moves))  # type: ignore
        home.owner = kit.owner
        kit.home = home
        yield kit, moves


def test_a_failed_read_back_for_the_norms_leaves_the_sum_on_disk(tmp_path):
    with failing_home(tmp_path) as (kit, moves):
        home = kit.home
        g0 = grad_of(kit.group, 0)
        home.accumulate(0, g0)
        home.park()
        moves.fail_next_read = True
        with pytest.raises(OSError, match="the read failed"):
            home.norms()
        assert home.on_disk
        assert home.grad is None and kit.pool.in_use == 0, "no half-read buffer is left as the gradient"
        assert torch.equal(kit.piece(0), g0.reshape(-1)), "the next use reads the parked sum"


def test_a_failed_read_back_for_the_next_gradient_gives_the_window_its_bytes_back(tmp_path):
    with failing_home(tmp_path) as (kit, moves):
        home = kit.home
        g0, g1 = grad_of(kit.group, 0), grad_of(kit.group, 0)
        home.accumulate(0, g0)
        home.park()
        moves.fail_next_read = True
        with pytest.raises(OSError, match="the read failed"):
            home.accumulate(0, g1)
        assert home.on_disk and home.grad is None
        assert kit.pool.in_use == 0, "the window's bytes of the failed read back"
