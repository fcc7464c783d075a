"""[Note: master weights stored once]: a checkpoint keeps each fp32 master weight once. fp32 compute takes it from
model.safetensors, bf16 compute from the bf16 weight plus the master's low halves and tie bits; both round-trip
bit for bit (ties, infinities, overflow), a master the weights do not give back is stored in full, a damaged
piece is found, and checkpoints of the versions before (masters in the optimizer file) still load exactly."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import offload
from offload.checkpoint import writer
from offload.checkpoint.masters import join_bf16, split_bf16
from offload.checkpoint.reader import master_weights
from offload.errors import OffloadIntegrityError

F32 = torch.float32


def _bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(F32)


# fp32 bit patterns: exact ties below an even and an odd bf16 (both signs), the largest finite fp32 (rounds to inf),
# infinities, zeros, subnormals, a low half of 0x7fff / 0x8001 / 0xffff, and the top of bf16's range
SPECIAL = [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x7F800000,
           0xFF800000, 0x00000000, 0x80000000, 0x00008000, 0x00018000, 0x80008000, 0x00007FFF, 0x00008001,
           0x3F80FFFF, 0xBF80FFFF, 0x3F807FFF, 0x7F7F7FFF]


def test_low_halves_and_tie_bits_give_the_master_back_bit_for_bit():
    master = torch.cat([_bits(SPECIAL), torch.randn(1 << 20) * 1e-3])
    weights = master.to(torch.bfloat16)
    low, tie, ok = split_bf16(master, weights)
    assert ok and low.dtype == torch.int16
    assert torch.equal(join_bf16(weights, low, tie).view(torch.int32), master.view(torch.int32))
    odd_ties = tie[:len(SPECIAL)].nonzero().flatten().tolist()
    assert odd_ties == [1, 3, 5, 12]  # ties above an odd bf16, rounded up (0x7f7f8000 to infinity)
    # without the tie bit those masters come back one bf16 step off: the bit is needed
    wrong = join_bf16(weights, low, torch.zeros_like(tie))
    assert not torch.equal(wrong[odd_ties].view(torch.int32), master[odd_ties].view(torch.int32))


def test_a_master_the_bf16_weight_does_not_round_to_fails_the_check():
    """A NaN whose payload bf16 drops, and a weight that is not the master's rounding (written since), are found."""
    master = _bits([0x7FC00001, 0x3F800000])
    assert not split_bf16(master[:1], master[:1].to(torch.bfloat16))[2]
    assert not split_bf16(master[1:], torch.tensor([2.0], dtype=torch.bfloat16))[2]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 64))


def _wrap(tier: str, tmp_path, dtype=F32, name: str = "swap") -> offload.Engine:
    extra = {}
    if tier == "nvme":
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        extra = {"nvme_path": str(tmp_path / name)}
    return offload.wrap(_model(), tier, dtype=dtype, device="cpu", lr=1e-3, **extra)


def _train(engine, steps: int):
    torch.manual_seed(1)
    dtype = engine.module[0].weight.dtype
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(8, 64, dtype=dtype)).float().square().mean()
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


def _engine_masters(engine) -> dict:
    """The engine's own fp32 master weights by name, read from its state stores."""
    out = {}
    for _block, group, state in engine._checkpoints.checkpoint_groups():
        if state is None:
            continue
        with state.state_store.reading() as chunks:
            for start, stop, (master, _m, _v) in chunks:
                for slot in group.trainable_slots:
                    lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
                    if lo < hi:
                        out.setdefault(slot.name, torch.empty(slot.numel))[lo - slot.offset:hi - slot.offset] = \
                            master[lo - start:hi - start]
    return out


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.int32),
                                                    b[k].reshape(-1).view(torch.int32)) for k in a)


def _set_ties(engine) -> None:
    """Masters at exact ties (and other SPECIAL patterns) in a cpu-tier engine's first parameter, its bf16 weights
    their rounding: set in the store and through `.data`, which the engine does not watch (training reaches a tie
    about once in 65536 elements)."""
    _block, group, state = next(g for g in engine._checkpoints.checkpoint_groups() if g[2] is not None)
    slot = group.trainable_slots[0]
    values = _bits(SPECIAL[:4] + SPECIAL[9:19])  # ties, zeros, subnormals: none that overflows the forward
    state.state_store.master[slot.offset:slot.offset + len(values)] = values
    engine.module.get_parameter(slot.name).data.view(-1)[:len(values)] = values.to(torch.bfloat16)


@pytest.mark.parametrize("saved", ["cpu", "nvme"])
def test_a_bf16_compute_checkpoint_loads_bit_exact_master_weights(saved, tmp_path):
    """The optimizer file holds no fp32 master, only low halves and tie bits (2.125 bytes a parameter); loaded into
    either tier the masters are the saved engine's bit for bit (ties included), and training resumes exactly."""
    engine = _wrap(saved, tmp_path, torch.bfloat16, "a")
    _train(engine, 2)
    if saved == "cpu":
        _set_ties(engine)
    engine.save(str(tmp_path / "ckpt"))
    masters = _engine_masters(engine)
    rest = _train(engine, 3)
    engine.close()
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["masters"] == dict.fromkeys(masters, "bf16+low")  # none in full
    assert _same_bits(master_weights(str(tmp_path / "ckpt")), masters)
    if saved == "cpu":
        assert (masters["0.weight"].view(torch.int32)[:4] & 0xFFFF == 0x8000).all()
    for tier in ("cpu", "nvme"):
        resumed = _wrap(tier, tmp_path, torch.bfloat16, f"b-{tier}")
        resumed.load(str(tmp_path / "ckpt"))
        assert _same_bits(_engine_masters(resumed), masters)
        assert _train(resumed, 3) == rest
        resumed.close()


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_a_master_the_weights_do_not_give_back_is_stored_in_full(dtype, tmp_path):
    """A weight changed through `.data` (which the engine does not see, [Note: weights written after wrap()])
    differs from its master: the save finds it and stores that master in full, the others still come from the
    weights, and a resumed run equals the uninterrupted one."""
    engine = _wrap("cpu", tmp_path, dtype)
    _train(engine, 2)
    engine.module[2].bias.data.add_(1.0)
    engine.save(str(tmp_path / "ckpt"))
    masters = _engine_masters(engine)
    rest = _train(engine, 2)
    engine.close()
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert "2.bias" not in manifest["masters"] and len(manifest["masters"]) == 3
    assert "master/2.bias" in manifest["files"]["optimizer.safetensors"]["checksums"]
    assert _same_bits(master_weights(str(tmp_path / "ckpt")), masters)
    resumed = _wrap("cpu", tmp_path, dtype)
    resumed.load(str(tmp_path / "ckpt"))
    assert _train(resumed, 2) == rest


def test_a_checkpoint_with_the_masters_in_the_optimizer_file_loads_exactly(tmp_path, monkeypatch):
    """Versions 1 and 2 (every master under master/ of the optimizer file, as the writer still does for a master
    the weights do not give back) load and resume bit for bit."""
    engine = _wrap("nvme", tmp_path, F32, "a")
    _train(engine, 2)
    with monkeypatch.context() as patch:
        patch.setattr(writer, "scheme_for", lambda dtype: None)  # the layout before version 3
        engine.save(str(tmp_path / "v1"))
    rest = _train(engine, 2)
    engine.close()
    manifest = json.loads((tmp_path / "v1" / "manifest.json").read_text())
    assert manifest["version"] == 1 and not manifest["masters"]
    del manifest["masters"]  # as version 1 wrote it
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(manifest))
    resumed = _wrap("nvme", tmp_path, F32, "b")
    resumed.load(str(tmp_path / "v1"))
    assert _train(resumed, 2) == rest


@pytest.mark.parametrize("tensor", ["master_low/0.weight", "master_tie/0.weight"])
def test_a_damaged_low_half_or_tie_bit_is_found_not_loaded(tensor, tmp_path):
    engine = _wrap("cpu", tmp_path, torch.bfloat16)
    _train(engine, 1)
    engine.save(str(tmp_path / "ckpt"))
    before = _engine_masters(engine)
    path = tmp_path / "ckpt" / "optimizer.safetensors"
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        offset = 8 + length + json.loads(f.read(length))[tensor]["data_offsets"][0]
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))  # one bit
    _train(engine, 1)
    after = _engine_masters(engine)
    with pytest.raises(OffloadIntegrityError, match=rf"checksum mismatch .*{tensor}"):
        engine.load(str(tmp_path / "ckpt"))
    assert _same_bits(_engine_masters(engine), after) and not _same_bits(after, before)  # left as it was
    engine.close()
