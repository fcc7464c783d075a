"""A sharded group's weight home on its own (weights/partitioned_home.py: `PartitionedHome` over a `HostPart` or a
`DiskPart`), in one process. The home asks its data-parallel object for one collective only, `gather_weights`; here
that is `ThreeRanks`, this process as one rank of three whose two peers hold their parts of known weights, with
the signature and the contract of `DataParallel.gather_weights` (every rank's part into `full`; `async_op`: started,
completed by the function it returns). One test runs the real `DataParallel.gather_weights` over a process group
of one. The disk part runs over a real ring and swap file holding the rank's weight record."""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from offload.distributed.data_parallel import DataParallel, Shard
from offload.distributed.gather_check import READ, USE
from offload.planner.ring import min_ring_bytes
from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.ring.disk_ring import DiskRing
from offload.scheduler.weights.partitioned_home import DiskPart, HostPart, PartitionedHome, WeightPart
from offload.tiers.disk import SwapStore
from offload.tiers.host import StagingPool
from offload.tiers.swap_layout import plan_weight_layout
from tests.unit.records.groups import make_group

WORLD = 3
NUMEL, TRAINABLE = 25, 23  # make_group: 23 trainable elements, then 2 frozen


class ThreeRanks:
    """This process as rank `rank` of three; the peers' parts of the group are `peers` (the group's whole
    weights: a peer's part is its range of them). `gather_weights` logs each call and, asked `async_op`, puts
    nothing into `full` until its returned function runs (a gather on the wire)."""

    def __init__(self, rank: int, peers: Tensor) -> None:
        self.world = WORLD
        self.rank = rank
        self.peers = peers
        self.calls: List[Tuple[str, int, bool, Tensor]] = []  # (key, kind, async_op, what this rank sent)
        self.finished = 0
        self.secondary = None  # no hpZ (zero_hpz_partition_size): every gather is a whole one

    def gathered_nbytes(self, part: Shard, itemsize: int, kind: int = USE) -> int:
        return (part.n - part.numel) * itemsize

    def weight_part(self, numel: int) -> Shard:
        return Shard(numel, -(-numel // self.world), self.rank, self.world)

    def state_shard(self, trainable_numel: int, numel: int) -> Shard:
        return Shard(trainable_numel, self.weight_part(numel).size, self.rank, self.world)

    def gather_weights(self, full: Tensor, mine: Tensor, part: Shard, async_op: bool = False, key: str = "",
                       kind: int = USE) -> Optional[Callable[[], None]]:
        assert full.numel() == part.n and mine.numel() == part.numel and part.rank == self.rank
        self.calls.append((key, kind, async_op, mine.clone()))
        sent = mine.clone()

        def finish() -> None:
            self.finished += 1
            for rank in range(self.world):
                lo, hi = min(rank * part.size, part.n), min((rank + 1) * part.size, part.n)
                full[lo:hi] = sent if rank == self.rank else self.peers[lo:hi].to(full.dtype)

        if async_op:
            return finish
        finish()
        return None


class Owner:
    """The block's record, as a home sees it before a prefetch (`UpdateOwner`)."""

    def __init__(self) -> None:
        self.calls: List[dict] = []

    def settle(self, counted: bool = False) -> None:
        self.calls.append({"counted": counted})


class Sharing:
    """The reduction, as a home sees it after an update (`UpdateSharing`): nothing may be sent."""

    def send_new_weights(self, state, out) -> None:
        raise AssertionError("a sharded home's next fetch gathers the new weights: nothing is sent after an update")


def _setup(rank: int, trains: bool = True) -> Tuple[FlatGroup, Tensor, ThreeRanks, Shard, Optional[Shard]]:
    """The group with its whole weights in its device buffer (as materialize leaves it), and this rank's parts."""
    torch.manual_seed(rank)
    group = make_group()
    assert group.device_buffer is not None and group.numel == NUMEL and group.trainable_numel == TRAINABLE
    group.device_buffer.copy_(torch.randn(NUMEL))
    whole = group.device_buffer.clone()
    dp = ThreeRanks(rank, whole)
    part = dp.weight_part(NUMEL)
    return group, whole, dp, part, dp.state_shard(TRAINABLE, NUMEL) if trains else None


def host_home(rank: int, trains: bool = True):
    group, whole, dp, part, shard = _setup(rank, trains)
    home = PartitionedHome(group, part, shard, dp, HostPart(group.device_buffer[part.lo:part.hi]))  # type: ignore
    return home, group, whole, dp, part, shard


@contextlib.contextmanager
def disk_home(tmp_path, rank: int) -> Iterator[tuple]:
    group, whole, dp, part, shard = _setup(rank)
    records, size = plan_weight_layout([group.shape("blk")], 0, lambda _shape: part.numel)  # the part's record
    swap = SwapStore(str(tmp_path), {}, size, records)
    staging = StagingPool(min_ring_bytes())
    ring = DiskRing(swap, staging, min_ring_bytes(), 4)
    try:
        assert group.device_buffer is not None
        keeper = DiskPart(WeightPart(group, part), ring.weights, group.device_buffer[part.lo:part.hi])
        yield PartitionedHome(group, part, shard, dp, keeper), group, whole, dp, part, swap  # type: ignore
    finally:
        ring.drain()
        ring.close()
        swap.close()
        staging.close()


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_fetch_gathers_every_ranks_part_into_the_device_buffer(rank):
    home, group, whole, dp, part, _shard = host_home(rank)
    assert home.pushes and home.partitioned and not home.reads_ahead_from_disk
    group.device_buffer.zero_()  # the block was released: its buffer holds nothing
    home.fetch()
    assert torch.equal(group.device_buffer, whole)
    (key, kind, async_op, sent), = dp.calls
    assert (key, kind, async_op) == (group.key, USE, False)
    assert torch.equal(sent, whole[part.lo:part.hi]), "this rank sends its own part"
    assert home.gathers == 1 and home.bytes_gathered == (NUMEL - part.numel) * 4


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_update_writes_the_trainable_range_of_the_part_where_it_lives(rank):
    home, group, whole, dp, part, shard = host_home(rank)
    assert shard is not None and (shard.lo, shard.hi) == (part.lo, min(part.hi, TRAINABLE))
    target = home.update_target()
    assert target is not None and target.numel() == shard.numel and home.target_base == shard.lo
    assert target.device.type == "cpu" and target.data_ptr() != group.device_buffer.data_ptr()
    new = torch.randn(shard.numel)
    target.copy_(new)  # the update's new weights of this rank's part
    assert torch.equal(group.device_buffer, whole), "nothing reaches the device before the push"
    home.share_update(Sharing(), None, target)
    home.push(resident=False)  # released: the next fetch gathers them anyway
    assert dp.calls == []
    home.push(resident=True)
    want = whole.clone()
    want[shard.lo:shard.hi] = new
    assert torch.equal(group.device_buffer, want), "the push gathers: the new part, the frozen tail kept"


def test_a_group_without_trainable_parameters_has_an_empty_update_target():
    home, _group, _whole, _dp, _part, _shard = host_home(1, trains=False)
    target = home.update_target()
    assert target is not None and target.numel() == 0 and home.target_base == 0


@pytest.mark.parametrize("resident", [True, False])
def test_replace_then_host_weights_round_trip(resident):
    home, group, whole, dp, part, _shard = host_home(1)
    flat = torch.randn(NUMEL)
    dp.peers = flat  # every rank loads the same checkpoint: the peers' parts are its too
    home.replace(flat, resident=resident)
    assert torch.equal(group.device_buffer, flat if resident else whole)
    assert dp.calls == [], "a replace gathers nothing"
    out = home.host_weights()
    assert out.device.type == "cpu" and torch.equal(out, flat)
    (key, kind, async_op, sent), = dp.calls
    assert (key, kind, async_op) == (group.key, READ, False) and torch.equal(sent, flat[part.lo:part.hi])
    assert home.gathers == 1 and home.bytes_gathered == (NUMEL - part.numel) * 4


def test_a_fetch_ahead_completes_when_the_block_is_used():
    home, group, whole, dp, part, _shard = host_home(2)
    group.device_buffer.zero_()
    home.fetch(ahead=True)
    assert dp.calls[0][2] is True and dp.finished == 0
    assert torch.equal(group.device_buffer, torch.zeros(NUMEL)), "still on the wire"
    home.wait_fetched()
    assert torch.equal(group.device_buffer, whole) and dp.finished == 1
    home.wait_fetched()
    assert dp.finished == 1, "completed once"
    assert home.gathers == 1


def test_a_gather_in_flight_completes_before_the_next_fetch_replace_or_read():
    home, group, whole, dp, part, _shard = host_home(0)
    home.fetch(ahead=True)
    home.fetch(ahead=True)
    assert dp.finished == 1, "the first gather done before the second starts"
    flat = torch.randn(NUMEL)
    home.replace(flat, resident=False)
    assert dp.finished == 2, "before its part is overwritten"
    home.fetch(ahead=True)
    home.host_weights()
    assert dp.finished == 4 and home.gathers == 4
    assert home.bytes_gathered == 4 * (NUMEL - part.numel) * 4


def test_before_a_prefetch_the_owner_settles_counted_and_a_host_part_prefetches_nothing():
    home, _group, _whole, dp, _part, _shard = host_home(1)
    owner = Owner()
    home.before_prefetch(owner)
    assert owner.calls == [{"counted": True}], "its update in first: the gather ahead brings the new weights"
    assert home.prefetch() is False, "the streamer gathers host parts ahead itself"
    home.cancel_prefetch()
    assert dp.calls == []


def test_a_disk_part_is_read_from_the_swap_file_at_each_fetch(tmp_path):
    with disk_home(tmp_path, 1) as (home, group, whole, dp, part, swap):
        assert home.reads_ahead_from_disk and home.update_target() is None, "the store's chunks carry the update"
        assert swap.bytes_written == part.numel * 4, "the initial part written at once"
        group.device_buffer.zero_()
        home.fetch()
        assert torch.equal(group.device_buffer, whole)
        assert swap.bytes_read == part.numel * 4
        assert torch.equal(dp.calls[0][3], whole[part.lo:part.hi]), "what it sent: the part read from disk"


def test_a_disk_part_prefetched_is_read_once_and_a_replace_drops_the_prefetch(tmp_path):
    with disk_home(tmp_path, 2) as (home, group, whole, dp, part, swap):
        assert home.prefetch() is True and home.prefetch() is True
        assert swap.bytes_read == part.numel * 4, "one read ahead"
        home.fetch()
        assert torch.equal(group.device_buffer, whole) and swap.bytes_read == part.numel * 4, "the fetch used it"
        home.prefetch()
        flat = torch.randn(NUMEL)
        dp.peers = flat
        home.replace(flat, resident=False)  # the read ahead holds the old part
        home.fetch()
        assert torch.equal(group.device_buffer, flat)
        home.prefetch()
        home.cancel_prefetch()
        group.device_buffer.zero_()
        home.fetch()
        assert torch.equal(group.device_buffer, flat)


class OneRank:
    """The real `DataParallel.gather_weights` over the default process group of one rank (its header exchange
    left out: there is no other rank to disagree with)."""

    world = 1
    rank = 0
    gather_group = None  # the default group
    gather_weights = DataParallel.gather_weights
    gathered_nbytes = DataParallel.gathered_nbytes
    _received = DataParallel._received
    local_world = 1
    weight_codes = None  # exact gathers (no zero_quantized_weights)
    secondary = None  # no hpZ


    def __init__(self) -> None:
        self.announced: List[Tuple[str, int, int]] = []
        self.gather_check = self
        self.traffic = {"bytes_weights_within_machine": 0, "bytes_weights_across_machines": 0}

    def announce(self, key: str, numel: int, kind: int) -> None:
        self.announced.append((key, numel, kind))


@pytest.fixture
def process_group_of_one(tmp_path) -> Iterator[None]:
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not yet initialized")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(str(tmp_path), 'store')}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_real_gather_of_one_rank_fetches_the_whole_part(process_group_of_one):
    torch.manual_seed(5)
    group = make_group()
    group.device_buffer.copy_(torch.randn(NUMEL))
    whole = group.device_buffer.clone()
    dp = OneRank()
    part = Shard(NUMEL, NUMEL, 0, 1)
    home = PartitionedHome(group, part, Shard(TRAINABLE, NUMEL, 0, 1), dp, HostPart(whole))  # type: ignore
    group.device_buffer.zero_()
    home.fetch(ahead=True)
    home.wait_fetched()
    assert torch.equal(group.device_buffer, whole)
    new = torch.randn(TRAINABLE)
    home.update_target().copy_(new)
    home.push(resident=True)
    assert torch.equal(group.device_buffer[:TRAINABLE], new)
    assert torch.equal(home.host_weights(), torch.cat([new, whole[TRAINABLE:]]))
    assert dp.announced == [(group.key, NUMEL, USE), (group.key, NUMEL, USE), (group.key, NUMEL, READ)]
    assert home.gathers == 3 and home.bytes_gathered == 0, "one rank: nothing comes from another"
