"""Weights on disk read from the fp32 master (`disk_weights="master"`): no copy of them in the swap file, every fetch
reads the master from the state record and casts it. Training is exactly torch AdamW's (fp32) and bit for bit the
run with a copy (bf16 compute, int8 moments, clipping with speculation kept and dropped); checkpoints round-trip; the
plan chooses it by itself only when the copies would not fit the free disk."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import offload
from offload.cli.estimate import ModelShape, disk_bytes, estimate
from offload.cli.estimate import main as estimate_main
from offload.errors import OffloadConfigError
from offload.optim.moment_format import MomentFormat
from offload.planner.plan import GradFlow, Location
from offload.planner.ring import min_ring_bytes
from offload.policy import DiskWeights, Tier
from tests.models import TinyGPT, make_batches, one_intraop_thread, train_steps
from tests.test_engine_parity import _compare
from tests.test_engine_streaming import BUDGET

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
HOST = 300 << 10  # fp32: the streamed layers' weights go to disk (as tests/test_engine_disk_weights.py)


def _wrap(directory, mode, dtype=torch.float32, moments="fp32", **kw):
    """TinyGPT on the nvme tier with its streamed layers' weights on disk (bf16: half the device budget, the least
    ring and the gradients, and clipping's norm copy)."""
    torch.manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    budgets = dict(device_memory=BUDGET, host_memory=HOST) if dtype == torch.float32 else \
        dict(device_memory=BUDGET // 2,  # + clipping's fp32 copy of the largest bf16 gradient (16 KiB), when it clips
             host_memory=min_ring_bytes(moments=MomentFormat.parse(moments)) + (64 << 10) +
             ((16 << 10) if kw.get("max_grad_norm") is not None else 0))
    return offload.wrap(TinyGPT(), tier="nvme", nvme_path=directory, dtype=dtype, device="cpu", lr=1e-3,
                        moments=moments, disk_weights=mode, **budgets, **kw)


def test_plan_reads_weights_on_disk_from_the_master(tmp_path):
    with _wrap(tmp_path / "copy", "copy") as copied, _wrap(tmp_path / "master", "master") as master:
        on_disk = master.plan.disk_weight_blocks
        assert on_disk == copied.plan.disk_weight_blocks and not copied.plan.master_weight_blocks
        # TinyGPT's h.1 has a frozen parameter (no master for it): that block keeps its copy
        assert master.plan.master_weight_blocks == tuple(b for b in on_disk if b != "h.1")
        assert "read from the fp32 master" in str(master.plan) and "4 B/param" in master.plan.disk_weights
        saved = sum(b.weight_bytes for b in master.plan.blocks if b.from_master)
        assert copied.plan.bytes_on(Location.DISK) - master.plan.bytes_on(Location.DISK) == saved > 0
        layout = json.loads(next((tmp_path / "master").glob("*.layout.json")).read_text())
        assert {w["block"] for w in layout["weights"]} == {"h.1"}  # no weight record for the others


@pytest.mark.parametrize("accum,declared,max_norm", [(1, True, None), (2, False, 0.05)])
def test_parity_with_torch(monkeypatch, accum, declared, max_norm):
    """Against torch.optim.AdamW (+ clip_grad_norm_), 1e-5 in fp32, as tests/test_engine_disk_weights.py."""
    monkeypatch.setattr(offload, "wrap", functools.partial(offload.wrap, disk_weights="master"))
    stats = _compare("nvme", accum=accum, declared=declared, max_norm=max_norm, evaluate=True,
                     device_memory=BUDGET, host_memory=HOST)
    assert stats["block_fetches"] > 0


@pytest.mark.parametrize("max_norm", [1e3, 0.05])  # speculation kept (norms below) and dropped (clips every step)
def test_bf16_int8_clipping_bit_identical_to_a_copy(tmp_path, max_norm):
    """bf16 compute, int8 moments, max_grad_norm with speculative clipping: the weights the forward reads are the cast
    of the master, the same bits a copy on disk holds, so losses and every weight equal the copy's run."""
    batches = [b for step in make_batches(4, 1) for b in step]
    runs = {}
    for mode in ("copy", "master"):
        with _wrap(tmp_path / mode, mode, torch.bfloat16, "int8", max_grad_norm=max_norm) as engine:
            assert engine.plan.disk_weight_blocks and engine.plan.shadowed_blocks
            assert bool(engine.plan.master_weight_blocks) == (mode == "master")
            losses = train_steps(engine, batches)
            runs[mode] = losses, engine.state_dict(), engine.stats()
    (copy_losses, copy_state, copy_stats), (losses, state, stats) = runs["copy"], runs["master"]
    assert losses == copy_losses
    assert all(torch.equal(state[k], copy_state[k]) for k in copy_state)
    kept = "committed_speculations"
    assert stats.get(kept) == copy_stats.get(kept) and (stats.get(kept, 0) > 0) == (max_norm > 1)


def test_save_and_load(tmp_path):
    """A checkpoint reads the weights from the master, a load writes the master, and training goes on as without
    the round trip (bf16, int8 moments: the checkpoint's weights are the master's cast)."""
    batches = [b for step in make_batches(4, 1) for b in step]
    with _wrap(tmp_path / "a", "master", torch.bfloat16, "int8") as first:
        assert first.plan.master_weight_blocks
        train_steps(first, batches[:2])
        first.save(tmp_path / "ckpt")
        saved = first.state_dict()
        expected = train_steps(first, batches[2:])
        after = first.state_dict()
    with _wrap(tmp_path / "b", "master", torch.bfloat16, "int8") as second:
        second.load(tmp_path / "ckpt")
        assert all(torch.equal(v, saved[k]) for k, v in second.state_dict().items())
        assert train_steps(second, batches[2:]) == expected
        assert all(torch.equal(v, after[k]) for k, v in second.state_dict().items())


def test_loaded_weights_become_the_master(tmp_path):
    """Weights loaded into a running engine (engine.load_weights, from a safetensors file) become the master, so
    the next fetch from disk reads them (the loads `load_state_dict` refuses for streamed blocks)."""
    from safetensors.torch import save_file

    from offload.checkpoint.weight_source import WeightSource

    with _wrap(tmp_path / "a", "master") as engine:
        new = {k: torch.full_like(v, 0.25) for k, v in engine.state_dict().items()}
        save_file({k: v.contiguous() for k, v in new.items() if k != "lm_head.weight"}, str(tmp_path / "w.safetensors"))
        source = WeightSource(tmp_path / "w.safetensors")
        assert engine.load_weights({k: (source, k) for k in new if k != "lm_head.weight"}) > 0
        engine(*make_batches(1, 1)[0][0]).backward()  # forward and backward fetch every streamed block from disk
        engine.zero_grad()
        assert all(torch.equal(v, new[k]) for k, v in engine.state_dict().items())


def _plan(mode: DiskWeights, disk_room=None):
    shape = ModelShape.uniform(int(1e9), 16)
    return estimate(shape, Tier.NVME, torch.bfloat16, 1 << 30, 3 << 30, GradFlow(1, True, 2), MomentFormat.INT8,
                    disk_weights=mode, disk_room=disk_room)


def test_auto_reads_the_master_only_when_the_disk_is_short():
    copies = _plan(DiskWeights.COPY)
    need = disk_bytes(copies)
    assert copies.disk_weight_blocks and not copies.master_weight_blocks
    assert not _plan(DiskWeights.AUTO).master_weight_blocks  # free disk not measured: copies
    assert not _plan(DiskWeights.AUTO, need + (1 << 30)).master_weight_blocks
    short = _plan(DiskWeights.AUTO, need - (1 << 30))
    assert short.master_weight_blocks == short.disk_weight_blocks
    assert "would not fit" in short.disk_weights and "more read per step" in short.disk_weights
    assert disk_bytes(short) == need - sum(b.weight_bytes for b in short.blocks if b.from_master)


def test_estimate_prints_each_choice(capsys):
    assert estimate_main(["--params", "7e9", "--tier", "nvme", "--moments", "int8", "--max-grad-norm",
                          "--dtype", "bf16", "--host-memory", "20GB", "--device-memory", "2GB", "--disk", "45GB"]) == 0
    out = capsys.readouterr().out
    rows = {m: line for line in out.splitlines() for m in ("copy", "master") if f"weights={m}" in line
            and "moments=int8" in line}
    assert set(rows) == {"copy", "master"}
    assert "disk  6.03 B" in rows["master"] and "disk  6.03 B" not in rows["copy"]


def test_options_checked():
    with pytest.raises(OffloadConfigError, match="disk_weights="):
        offload.wrap(TinyGPT(), tier="nvme", nvme_path="/tmp", disk_weights="mirror")
    with pytest.raises(OffloadConfigError, match="only tier='nvme'"):
        offload.wrap(TinyGPT(), tier="cpu", disk_weights="master")


def test_close_without_restoring_the_weights(tmp_path):
    """engine.close(restore_weights=False), for a model larger than RAM: no streamed weights come back, the swap
    file goes, and the engine is closed (a second close does nothing)."""
    engine = _wrap(tmp_path / "a", "master")
    train_steps(engine, [b for step in make_batches(1, 1) for b in step])
    engine.close(restore_weights=False)
    assert list((tmp_path / "a").iterdir()) == []
    engine.close()
