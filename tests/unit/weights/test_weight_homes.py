"""Each weight home on its own (weights/weight_home.py): one parametrized test holds every home to the
`WeightHome` protocol, then what each home does of its own. The disk home runs over a real swap file and
ring (tests/unit/ring/gated_swap.py logs the requests), its updates written as the real ones are: through
the chunk weights of a `DiskStore`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import pytest
import torch
from torch import Tensor, nn

from offload.planner.ring import min_ring_bytes
from offload.scheduler.blocks.block import FlatGroup
from offload.scheduler.state.disk_store import DiskStore
from offload.scheduler.weights.weight_home import DeviceHome, DiskHome, HostMirror, WeightHome
from offload.tiers.copies import CopyContext
from tests.unit.ring.gated_swap import GatedSwap, gated_ring

HOMES = ["device", "mirror", "mirror-trainable", "disk"]


def _layer() -> nn.Module:
    """One block of one fp32 group: 6400 trainable elements (several ring chunks), then 100 frozen ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 100))
    model[0].bias.requires_grad_(False)
    return model


@dataclass
class Kit:
    kind: str
    home: WeightHome
    group: FlatGroup
    initial: Tensor  # the group's whole flat weights when the home was made
    write_update: Callable[[Tensor], None]  # an update's new trainable weights, written where the home says
    swap: Optional[GatedSwap] = None


@contextlib.contextmanager
def home_kit(kind: str, tmp_path) -> Iterator[Kit]:
    model = _layer()
    with gated_ring(tmp_path, model, min_ring_bytes(), weights_on_disk=kind == "disk") as (ring, swap, groups):
        group, = groups
        assert group.device_buffer is not None
        for slot in group.slots:
            group.device_buffer[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
        group.point_params_at(group.device_buffer)
        initial = group.device_buffer.clone()
        copies = CopyContext(torch.device("cpu"))
        if kind == "disk":
            store = DiskStore(group, ring)
            home: WeightHome = DiskHome(group, ring.weights, copies)

            def write_update(new: Tensor) -> None:
                for start, stop in store.chunks():  # as adamw: the new weights go into the chunk's weight area
                    chunk = store.load(start, stop)
                    assert chunk.weights is not None
                    chunk.weights.copy_(new[start:stop])
                    store.store(chunk)

            yield Kit(kind, home, group, initial, write_update, swap)
            ring.drain()
            return
        if kind == "device":
            home = DeviceHome(group, whole_state=True)
        else:
            home = HostMirror(group, copies, whole=kind == "mirror")

        def write_target(new: Tensor) -> None:
            target = home.update_target()
            assert target is not None
            target.copy_(new)

        yield Kit(kind, home, group, initial, write_target, swap)


@pytest.fixture(params=HOMES)
def kit(request, tmp_path) -> Iterator[Kit]:
    with home_kit(request.param, tmp_path) as made:
        yield made


def _buffer(group: FlatGroup) -> Tensor:
    assert group.device_buffer is not None
    return group.device_buffer


def test_every_home_keeps_the_protocol(kit):
    home, group = kit.home, kit.group
    n, t = group.numel, group.trainable_numel
    assert torch.equal(home.host_weights(), kit.initial)
    # where the update writes: the device buffer itself (no push), a host copy, or the disk (None)
    target = home.update_target()
    if target is not None:
        assert target.numel() == t
        assert (target.data_ptr() == _buffer(group).data_ptr()) == (not home.pushes)
    else:
        assert home.pushes and home.reads_ahead_from_disk
    # an update's new trainable weights reach the resident buffer by the push (at once when it writes there)
    new = kit.initial.clone()
    new[:t] = torch.randn(t)
    kit.write_update(new[:t])
    assert torch.equal(_buffer(group)[:t], new[:t]) == (not home.pushes), "pushes: the update writes elsewhere"
    home.release_source()
    home.push(resident=True)
    assert torch.equal(_buffer(group), new), "the frozen weights stay, the trainable ones are the update's"
    assert torch.equal(home.host_weights(), new)
    # a checkpoint's weights replace the whole group, at home and in the resident buffer
    flat = torch.randn(n)
    home.replace(flat, resident=True)
    assert torch.equal(_buffer(group), flat) and torch.equal(home.host_weights(), flat)
    # a prefetch is optional (disk reads ahead only); cancelled, the next push still brings the current weights
    assert home.prefetch() == home.reads_ahead_from_disk
    home.cancel_prefetch()
    home.push(resident=True)
    assert torch.equal(_buffer(group), flat)


def test_a_device_home_is_the_device_buffer_and_is_never_fetched(tmp_path):
    with home_kit("device", tmp_path) as kit:
        home, t = kit.home, kit.group.trainable_numel
        assert not home.pushes and not home.reads_ahead_from_disk
        target = home.update_target()
        assert target is not None
        target.fill_(3.0)  # the update writes the compute weights themselves
        assert bool((kit.group.slots[0].param == 3.0).all())
        assert torch.equal(_buffer(kit.group)[t:], kit.initial[t:])
        with pytest.raises(AssertionError, match="never fetched"):
            home.fetch()


def test_a_whole_host_mirror_holds_the_group_and_feeds_a_released_buffer(tmp_path):
    with home_kit("mirror", tmp_path) as kit:
        home, group = kit.home, kit.group
        assert isinstance(home, HostMirror)
        assert home.host.numel() == group.numel and home.host.data_ptr() != _buffer(group).data_ptr()
        _buffer(group).fill_(float("nan"))  # as if released: the buffer's bytes are gone
        home.fetch()
        assert torch.equal(_buffer(group), kit.initial), "a fetch brings the whole group, frozen part included"
        flat = torch.randn(group.numel)
        _buffer(group).zero_()
        home.replace(flat, resident=False)  # a released block: only the host copy changes
        assert torch.equal(home.host, flat) and bool((_buffer(group) == 0).all())
        home.push(resident=False)  # nothing to upload into a released buffer
        assert bool((_buffer(group) == 0).all())
        home.fetch()
        assert torch.equal(_buffer(group), flat)


def test_a_trainable_host_mirror_is_an_upload_source_next_to_resident_weights(tmp_path):
    with home_kit("mirror-trainable", tmp_path) as kit:
        home, group = kit.home, kit.group
        t = group.trainable_numel
        assert isinstance(home, HostMirror)
        assert home.host.numel() == t, "only the trainable range has a host copy"
        _buffer(group)[t:] = 7.0  # the frozen weights live on the device only: host_weights reads them there
        assert bool((home.host_weights()[t:] == 7.0).all())
        flat = torch.randn(group.numel)
        home.replace(flat, resident=False)  # never released: the device buffer takes the weights all the same
        assert torch.equal(_buffer(group), flat) and torch.equal(home.host, flat[:t])
        with pytest.raises(AssertionError):
            home.fetch()  # a resident block's upload source is never fetched whole


def _reads(swap: Optional[GatedSwap]) -> int:
    assert swap is not None
    return sum(1 for e in swap.events if e[0] == "read weights")


def test_a_disk_home_reads_the_swap_file_at_each_fetch_and_only_then(tmp_path):
    with home_kit("disk", tmp_path) as kit:
        home, group = kit.home, kit.group
        assert home.update_target() is None
        before = _reads(kit.swap)
        _buffer(group).zero_()
        home.push(resident=False)  # released: the next fetch reads them, not the push
        assert _reads(kit.swap) == before and bool((_buffer(group) == 0).all())
        home.fetch()
        assert torch.equal(_buffer(group), kit.initial) and _reads(kit.swap) > before


def test_a_disk_prefetch_is_finished_by_the_fetch_without_reading_again(tmp_path):
    with home_kit("disk", tmp_path) as kit:
        home, group = kit.home, kit.group
        assert home.prefetch()
        assert home.prefetch(), "a second prefetch keeps the reads the first started"
        started = _reads(kit.swap)
        _buffer(group).zero_()
        home.fetch()
        assert _reads(kit.swap) == started, "the fetch waited for the prefetch's reads"
        assert torch.equal(_buffer(group), kit.initial)


def test_a_disk_prefetch_made_stale_is_dropped(tmp_path):
    """Reads a prefetch started hold the old weights: a replace drops them, and so does `cancel_prefetch`
    (the streamer's, when an update of the block is scheduled); the next fetch reads the new weights."""
    with home_kit("disk", tmp_path) as kit:
        home, group = kit.home, kit.group
        t = group.trainable_numel
        assert home.prefetch()
        flat = torch.randn(group.numel)
        home.replace(flat, resident=False)
        _buffer(group).zero_()
        home.fetch()
        assert torch.equal(_buffer(group), flat)
        assert home.prefetch()
        home.cancel_prefetch()
        new = flat.clone()
        new[:t] = torch.randn(t)
        kit.write_update(new[:t])
        home.fetch()
        assert torch.equal(_buffer(group), new)
