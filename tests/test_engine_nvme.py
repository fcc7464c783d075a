"""The nvme tier: optimizer state in one preallocated swap file laid out by parameter name."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

import offload
from offload.errors import OffloadConfigError, OffloadError
from tests.models import TinyGPT, make_batches, one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _train_step(engine):
    (idx, tgt), = make_batches(1, 1)[0]
    engine(idx, tgt).backward()
    engine.step()
    engine.zero_grad()


def test_swap_file_and_layout_keyed_by_names(tmp_path):
    model = TinyGPT()
    with offload.wrap(model, tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu") as engine:
        files = sorted(os.listdir(tmp_path))
        assert len(files) == 2 and files[0].endswith(".swap") and files[1].endswith(".swap.layout.json")
        layout = json.loads((tmp_path / files[1]).read_text())
        names = {p[0] for record in layout["records"] for p in record["params"]}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert names == trainable  # every trainable parameter, by fully-qualified name; frozen ones absent
        assert all(r["offset"] % 4096 == 0 for r in layout["records"])
        assert os.path.getsize(tmp_path / files[0]) >= layout["size"]
        _train_step(engine)
        engine.synchronize()
        stats = engine.stats()
        trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert stats["host_state_bytes"] == 4 * trainable_numel  # only the fp32 gradients stay in RAM
        assert stats["bytes_disk_read"] == stats["bytes_disk_written"] - 12 * trainable_numel == 12 * trainable_numel
    assert os.listdir(tmp_path) == []


def test_no_room_for_the_swap_file_is_refused_at_wrap(tmp_path, monkeypatch):
    import offload.tiers.disk as disk

    monkeypatch.setattr(disk.shutil, "disk_usage", lambda _path: types.SimpleNamespace(free=1000))
    with pytest.raises(OffloadConfigError, match=r"has 1000 bytes free but the optimizer state needs \d+ bytes"):
        offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu")
    assert os.listdir(tmp_path) == []


def test_truncated_swap_file_is_a_clear_error_not_garbage(tmp_path):
    engine = offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                          overlap_step=False)
    _train_step(engine)
    engine.synchronize()
    swap = next(p for p in tmp_path.iterdir() if p.suffix == ".swap")
    before = engine.state_dict()
    engine.optimizer.state_dict()  # reads the swap file whole: the ring's slots keep no chunk after it, so
    # the next updates read the file ([Note: clean chunks])
    os.truncate(swap, 0)
    (idx, tgt), = make_batches(1, 1)[0]
    engine(idx, tgt).backward()
    with pytest.raises(OSError, match=str(swap)):
        engine.step()  # it waits for the updates, which read the truncated file
    with pytest.raises(OffloadError, match="failed earlier"):
        engine(idx, tgt)  # the other blocks' reads failed too: the engine refuses to go on
    with pytest.warns(RuntimeWarning, match="closed after a failed update"):
        engine.close()  # the failure was reported: cleanup does not raise it again
    after = {k: v for k, v in engine.module.state_dict().items()}
    assert all(after[k].equal(v) for k, v in before.items())  # no garbage reached the weights


def test_host_memory_too_small_for_one_block_names_it_and_the_fix(tmp_path):
    with pytest.raises(OffloadConfigError, match=r"block 'h.0'.*raise host_memory to at least \d+ bytes"):
        offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                     host_memory=16 << 10)
    assert os.listdir(tmp_path) == []


def test_plan_shows_the_staging_ring_within_host_memory(tmp_path):
    with offload.wrap(TinyGPT(), tier="nvme", nvme_path=tmp_path, dtype=torch.float32, device="cpu",
                      host_memory=300 << 10) as engine:
        assert "staging ring" in str(engine.plan)
        assert engine.plan.bytes_on(offload.planner.plan.Location.HOST) <= 300 << 10
        assert engine.stats()["nvme_staging_bytes"] <= engine.plan.ring_bytes + 4096
        _train_step(engine)
        engine.synchronize()
        assert engine.stats()["nvme_chunks_moved"] > 0


def test_nvme_path_on_tmpfs_works_with_one_warning():
    import tempfile
    import warnings

    from offload.io.swap_file import file_system_of

    if not os.path.isdir("/dev/shm") or not file_system_of("/dev/shm").startswith("tmpfs"):
        pytest.skip("/dev/shm is not a tmpfs here")
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="offload-test-")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = offload.wrap(TinyGPT(), tier="nvme", nvme_path=directory, dtype=torch.float32, device="cpu")
        ours = [w for w in caught if "offload" in str(w.message)]
        assert len(ours) == 1 and "tmpfs" in str(ours[0].message) and "O_DIRECT" in str(ours[0].message)
        with engine:
            before = engine.state_dict()["h.0.fc.weight"].clone()
            _train_step(engine)
            _train_step(engine)
            after = engine.state_dict()["h.0.fc.weight"]
            assert not after.equal(before) and torch.isfinite(after).all()
            assert engine.stats()["bytes_disk_read"] > 0
        assert os.listdir(directory) == []
    finally:
        os.rmdir(directory)


def test_a_whole_record_round_trips_as_one_request_and_a_range_past_it_is_refused(tmp_path):
    from torch import nn

    from offload.scheduler.blocks.block import build_blocks
    from offload.tiers.disk import RecordKind, SwapStore, state_views
    from offload.tiers.swap_layout import plan_swap_layout

    blocks = build_blocks(nn.Linear(30, 50), torch.float32)
    group = blocks[0].groups[0]
    records, size = plan_swap_layout([g.shape(b.name) for b in blocks for g in b.groups])
    store = SwapStore(str(tmp_path), records, size)
    try:
        record = records[group.key]
        assert record.section_bytes % 4096 == 0 and record.nbytes == 3 * record.section_bytes
        source = torch.arange(record.nbytes // 4, dtype=torch.float32)
        store.write(RecordKind.STATE, group.key, 0, state_views(source, group.numel)).result()
        back = torch.zeros_like(source)
        store.read(RecordKind.STATE, group.key, 0, state_views(back, group.numel)).result()
        assert all(a.equal(b) for a, b in zip(state_views(source, group.numel), state_views(back, group.numel)))
        with pytest.raises(ValueError, match="holds"):
            store.read(RecordKind.STATE, group.key, 1, state_views(back, group.numel))
    finally:
        store.close()
