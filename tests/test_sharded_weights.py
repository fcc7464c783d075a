"""Sharded weights (`shard_weights`, ZeRO-3) under torchrun, 2 ranks over gloo on the CPU device: each rank keeps a
part of every block's weights (host memory or its own swap file) and gathers the rest for each use; training
is exactly one process on the whole batch (and DDP on the same halves), the ranks bit-identical, and the
checkpoints move between world sizes and sharded or not (issue 27). The ranks run in tests/dp_child.py."""

from __future__ import annotations

import pytest
import torch

import offload
from tests.models import TinyGPT
from tests.test_data_parallel import assert_matches, optimizer_tensors, reference, run_ranks, train_one_process

HOST, DEVICE = 300_000, 150_000  # TinyGPT: 158 KiB of weights; one process keeps 3 blocks on disk with these

CASES = [
    dict(name="cpu-sharded", tier="cpu", steps=3, micro=1, shard_weights=True, lr=1e-3, ddp=True),
    dict(name="nvme-sharded", tier="nvme", steps=3, micro=2, shard_weights=True, max_grad_norm=0.5,
         grad_accumulation_steps=2, lr=1e-3, ddp=True),
    dict(name="nvme-sharded-disk", tier="nvme", steps=3, micro=1, shard_weights=True, host_memory=HOST,
         device_memory=DEVICE, max_grad_norm=1.0, lr=1e-3),
    dict(name="nvme-auto-disk", tier="nvme", steps=3, micro=2, host_memory=HOST, device_memory=DEVICE,
         grad_accumulation_steps=2, lr=1e-3),
]


def test_sharded_weights_train_exactly_as_one_process_on_the_whole_batch(tmp_path):
    run_ranks(tmp_path, CASES)
    for case in CASES:
        result = torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)
        assert_matches(case["name"], result, reference(case))
        plan = result["plan"]
        assert plan["shard_world"] == 2, (case["name"], plan)  # asked for, or (auto) the weights did not fit
        if "host_memory" in case:
            assert plan["disk"], f"{case['name']}: the parts of the weights went to the swap files"
    whole = _one_process_swap_bytes(tmp_path)
    disk = torch.load(tmp_path / "nvme-sharded-disk.pt", weights_only=False)["plan"]["swap_bytes"]
    assert all(0.4 * whole <= part <= 0.6 * whole for part in disk), (disk, whole)


def _one_process_swap_bytes(tmp_path) -> int:
    """The swap file of one process with the same budgets (state and weights on disk): what two ranks split."""
    torch.manual_seed(0)
    directory = tmp_path / "one-swap"
    directory.mkdir()
    engine = offload.wrap(TinyGPT(), "nvme", nvme_path=str(directory), dtype=torch.float32, device="cpu",
                          host_memory=HOST, device_memory=DEVICE)
    assert engine.plan.disk_weight_blocks
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    engine.close()
    return size


def test_sharded_checkpoints_load_in_one_process_and_into_replicated_ranks(tmp_path):
    """Saved by 2 ranks with sharded weights on disk: one process loads it and continues as the ranks did, and 2
    ranks keeping the whole weights load it too (the checkpoint is the same format, whichever mode saved it)."""
    lr = 1e-3
    run_ranks(tmp_path, [
        dict(name="through", tier="nvme", steps=4, micro=1, lr=lr, shard_weights=True, host_memory=HOST,
             device_memory=DEVICE, save="ck-sharded", save_at=2),
        dict(name="replicated", tier="cpu", steps=4, micro=1, lr=lr, shard_weights=False, load="ck-sharded", skip=2),
    ])
    through = torch.load(tmp_path / "through.pt", weights_only=False)
    replicated = torch.load(tmp_path / "replicated.pt", weights_only=False)
    assert replicated["losses"] == through["losses"][2:] and all(replicated["agree"])
    for name, value in through["weights"].items():
        assert torch.equal(replicated["weights"][name], value), name
    losses, _ = train_one_process("nvme", range(2, 4), tmp_path, load=tmp_path / "ck-sharded",
                                  save=tmp_path / "ck-one", lr=lr)
    assert max(abs(a - b) for a, b in zip(losses, through["losses"][2:])) < 1e-5
    sharded, one = optimizer_tensors(tmp_path / "ck-sharded"), optimizer_tensors(tmp_path / "ck-one")
    assert sharded.keys() == one.keys()


def test_whole_weights_that_do_not_fit_are_refused_when_sharding_is_turned_off(tmp_path):
    run_ranks(tmp_path, [dict(name="off", tier="nvme", steps=1, micro=1, shard_weights=False, host_memory=HOST,
                              device_memory=DEVICE, expect_error="shard_weights=True")])
    for rank in (0, 1):
        message = (tmp_path / f"off-rank{rank}.txt").read_text()
        assert "shard_weights=False keeps every block's weights" in message and "shard_weights=True" in message


def test_shard_weights_in_one_process_is_the_plain_engine_and_bad_settings_are_refused(tmp_path):
    engine = offload.wrap(TinyGPT(), "cpu", dtype=torch.float32, device="cpu", shard_weights=True)
    assert engine.plan.shard_world == 1  # one process: nothing to shard across
    engine.close()
    with pytest.raises(offload.OffloadConfigError, match=r"shard_weights=True.*tier='gpu'"):
        offload.wrap(TinyGPT(), "gpu", device="cpu", shard_weights=True)
    with pytest.raises(offload.OffloadConfigError, match=r"shard_weights='yes'.*None.*True.*False"):
        offload.wrap(TinyGPT(), "cpu", device="cpu", shard_weights="yes")
