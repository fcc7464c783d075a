"""`wrap(moments=...)` through the engine: every tier keeps bf16 or int8 moments, trains, resumes exactly from
its own checkpoints, converts (with a warning) between settings, exports torch AdamW's fp32 state, and on the
nvme tier moves and stores about half the bytes. The kernels themselves are tested in test_moments.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload
from offload.optim.moment_format import EXP_AVG, EXP_AVG_SQ, MomentFormat, zeros_moment
from offload.optim.moments import decode_moment
from offload.planner.ring import min_ring_bytes

COMPRESSED = ["bf16", "int8"]


def _host_for_disk_weights(moments: str) -> int:
    """host_memory for TinyGPT under tests/test_engine_streaming.BUDGET that leaves the streamed layers' weights
    on disk: the least ring of the format (its slots sized by the format's bytes an element) and 104 KiB more."""
    return min_ring_bytes(moments=MomentFormat.parse(moments)) + (104 << 10)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 600), nn.Tanh(), nn.Linear(600, 32), nn.Tanh(), nn.Linear(32, 1))


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 32, generator=gen)
    return x, x[:, :1].sin() + 0.1 * x[:, 1:2]


def _wrap(tier: str, moments: str, tmp_path, **kw) -> offload.Engine:
    tmp_path.mkdir(parents=True, exist_ok=True)
    extra = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
    return offload.wrap(_model(), tier, dtype=torch.float32, device="cpu", lr=1e-2, moments=moments, **extra, **kw)


def _train(engine, steps: int):
    x, y = _data()
    losses = []
    for _ in range(steps):
        loss = ((engine(x) - y) ** 2).mean()
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("moments", COMPRESSED)
def test_every_tier_steps_the_same_compressed_moments_and_tracks_fp32(moments, tmp_path):
    """The cpu and nvme tiers run the same kernel on the same codes (equal losses); the gpu tier, here on the
    CPU, the same maths; each ends within 5% of fp32 moments' loss after 40 steps of a small regression."""
    reference = _train(_wrap("cpu", "fp32", tmp_path / "ref"), 40)
    runs = {tier: _train(_wrap(tier, moments, tmp_path / tier), 40) for tier in ("cpu", "nvme", "gpu")}
    assert runs["cpu"] == runs["nvme"]
    assert runs["gpu"] == pytest.approx(runs["cpu"], rel=1e-4)
    assert runs["cpu"] != reference, "the moments are really kept in another format"
    assert abs(runs["cpu"][-1] - reference[-1]) <= 0.05 * reference[-1]
    assert runs["cpu"][-1] < 0.2 * runs["cpu"][0]


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
@pytest.mark.parametrize("moments", COMPRESSED)
def test_a_checkpoint_resumes_compressed_moments_exactly(tier, moments, tmp_path):
    """The files hold the moments as the engine keeps them (bf16 values; int8 codes and each parameter's scales),
    copied back as they are, so a resumed run equals the uninterrupted one bit for bit."""
    whole = _wrap(tier, moments, tmp_path / "a")
    first = _train(whole, 3)
    whole.save(str(tmp_path / "ckpt"))
    saved = whole.optimizer.state_dict()["state"]
    rest = _train(whole, 4)
    resumed = _wrap(tier, moments, tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same setting loads without a conversion warning
        resumed.load(str(tmp_path / "ckpt"))
    loaded = resumed.optimizer.state_dict()["state"]
    for index, entry in saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[index][key], entry[key]), key
    assert _train(resumed, 4) == rest
    assert first[-1] > rest[-1]


def _optimizer_entries(path) -> dict:
    """name -> (dtype, bytes) of each tensor of a checkpoint's optimizer.safetensors, from its header."""
    import json
    import struct

    with open(path / "optimizer.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {name: (info["dtype"], info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items() if name != "__metadata__"}


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 0.3), (torch.bfloat16, 0.45)])
def test_an_int8_checkpoints_optimizer_files_are_under_0_3x_an_fp32_ones(tier, dtype, bound, tmp_path):
    """The same model saved with fp32 and with int8 moments: the optimizer files of the int8 one, summed, are at
    most 0.3x the fp32 one's with fp32 compute (codes and scales, ~2.03 bytes a parameter against 8; the masters
    are the weights, left to model.safetensors: [Note: master weights stored once]), and at most 0.45x with bf16
    compute (each file also holds the masters' low halves and tie bits, ~2.13 bytes a parameter: 4.16 / 10.13)."""
    def save(moments: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1000), nn.Tanh(), nn.Linear(1000, 256))
        extra = {"nvme_path": str(tmp_path / moments)} if tier == "nvme" else {}
        (tmp_path / moments).mkdir()
        engine = offload.wrap(model, tier, dtype=dtype, device="cpu", lr=1e-2, moments=moments, **extra)
        x = torch.randn(16, 256, dtype=dtype)
        engine(x).float().square().mean().backward()
        engine.step()
        engine.zero_grad()
        directory = tmp_path / f"ckpt-{moments}"
        engine.save(str(directory))
        engine.close()
        optim = sum(f.stat().st_size for f in directory.iterdir() if f.name.startswith("optimizer"))
        return _optimizer_entries(directory), optim, sum(f.stat().st_size for f in directory.iterdir())

    (_fp32, fp32_optim, fp32_all), (int8, int8_optim, int8_all) = save("fp32"), save("int8")
    print(f"{dtype} int8 / fp32 optimizer files: {int8_optim} / {fp32_optim} = {int8_optim / fp32_optim:.4f}; "
          f"whole checkpoint: {int8_all} / {fp32_all} = {int8_all / fp32_all:.4f}")
    assert int8_optim <= bound * fp32_optim
    assert int8["exp_avg/0.weight"] == ("U8", 256 * 1000)
    assert int8["exp_avg_sq_scales/0.bias"] == ("F32", 4 * 4)  # 1000 elements: 4 blocks of its own
    assert not any(name.startswith("master/") for name in int8)  # every master came back from the weights
    if dtype == torch.bfloat16:
        assert int8["master_low/0.weight"] == ("I16", 2 * 256 * 1000) and int8["master_tie/0.bias"] == ("U8", 125)


@pytest.mark.parametrize("saved_as, loaded_as", [("int8", "fp32"), ("int8", "bf16"), ("bf16", "int8"),
                                                 ("bf16", "fp32")])
def test_a_compressed_checkpoint_loads_into_another_setting_decoded_with_a_warning(saved_as, loaded_as, tmp_path):
    """Codes or bf16 values are decoded to fp32 and encoded in the loading engine's format: exactly into fp32 (the
    torch-format state equals the saved engine's), rounded into another compressed format."""
    saved = _wrap("cpu", saved_as, tmp_path / "a")
    _train(saved, 3)
    saved.save(str(tmp_path / "ckpt"))
    state = saved.optimizer.state_dict()["state"]
    engine = _wrap("nvme", loaded_as, tmp_path / "b")
    with pytest.warns(RuntimeWarning, match=rf"moments='{saved_as}'.*moments='{loaded_as}'"):
        engine.load(str(tmp_path / "ckpt"))
    loaded = engine.optimizer.state_dict()["state"]
    for index, entry in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if loaded_as == "fp32":
                assert torch.equal(loaded[index][key], entry[key]), key
            else:
                scale = float(entry[key].abs().max())
                assert torch.allclose(loaded[index][key], entry[key], atol=0.02 * scale, rtol=0.05), key
        assert torch.equal(loaded[index]["step"], entry["step"])
    assert _train(engine, 2)[-1] < 1.0


def test_a_checkpoint_of_another_setting_loads_converted_with_a_warning(tmp_path):
    saved = _wrap("cpu", "fp32", tmp_path / "a")
    _train(saved, 3)
    saved.save(str(tmp_path / "ckpt"))
    state = saved.optimizer.state_dict()["state"]
    engine = _wrap("nvme", "int8", tmp_path / "b")
    with pytest.warns(RuntimeWarning, match=r"moments='fp32'.*moments='int8'.*rounded"):
        engine.load(str(tmp_path / "ckpt"))
    loaded = engine.optimizer.state_dict()["state"]
    for index, entry in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = entry[key].abs().max()
            assert torch.allclose(loaded[index][key], entry[key], atol=0.02 * float(scale), rtol=0.05), key
        assert torch.equal(loaded[index]["step"], entry["step"])
    assert _train(engine, 2)[-1] < 1.0


def test_torch_format_state_is_the_decoded_fp32_moments(tmp_path):
    """engine.optimizer.state_dict() hands torch AdamW's fp32 moments: the decoded values of the codes."""
    engine = _wrap("cpu", "int8", tmp_path)
    _train(engine, 2)
    state = engine.optimizer.state_dict()["state"]
    store = next(g.state.store for r in engine.records for g in r.groups if g.state is not None)
    n = store.group.trainable_numel
    values = torch.empty(n)
    decode_moment(store.exp_avg, MomentFormat.INT8, EXP_AVG, values, store.blocks)
    first = store.group.trainable_slots[0]
    assert torch.equal(state[0]["exp_avg"].reshape(-1), values[first.offset:first.offset + first.numel])
    assert all(v["exp_avg"].dtype == torch.float32 for v in state.values())
    decode_moment(store.exp_avg_sq, MomentFormat.INT8, EXP_AVG_SQ, values, store.blocks)
    assert torch.equal(state[0]["exp_avg_sq"].reshape(-1), values[first.offset:first.offset + first.numel])


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
@pytest.mark.parametrize("moments", COMPRESSED)
@pytest.mark.parametrize("skipped", ["0.weight", "0.bias"])
def test_a_parameter_without_a_gradient_keeps_its_moments_bit_for_bit(tier, moments, skipped, tmp_path):
    """A parameter that got no gradient is skipped as torch skips it: its step count, master weights and moments
    stay exactly as they were, as fp32 moments do. The first layer's weight has 1200 elements, so its bias starts
    inside the weight's fifth 256-element block; int8 blocks start over at each parameter, so neither one's step
    touches the other's codes or scales (before, the shared block was re-encoded at its new scale)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    extra = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 1))
    engine = offload.wrap(model, tier, dtype=torch.float32, device="cpu", lr=1e-2, moments=moments, **extra)
    x, y = _data()
    x = x[:, :30]
    names = [n for n, _ in engine.module.named_parameters()]
    index = names.index(skipped)
    param = dict(engine.module.named_parameters())[skipped]
    for step in range(3):
        loss = ((engine(x) - y) ** 2).mean()
        loss.backward()
        if step == 1:
            param.grad = None
            before = engine.optimizer.state_dict()["state"][index]
            weights = param.detach().clone()
        engine.step()
        if step == 1:
            after = engine.optimizer.state_dict()["state"][index]
            assert torch.equal(param.detach(), weights), "a skipped parameter's weights do not move"
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(after[key], before[key]), f"{key} of a skipped parameter changed"
            assert int(after["step"]) == int(before["step"]) == 1
        engine.zero_grad()
    state = engine.optimizer.state_dict()["state"]
    steps = {names[i]: int(v["step"]) for i, v in state.items()}
    assert steps[skipped] == 2 and steps["2.weight"] == 3
    assert all(torch.isfinite(v["exp_avg"]).all() for v in state.values())


def test_the_nvme_tier_moves_and_stores_about_half_the_bytes_with_int8(tmp_path):
    def bytes_per_step(moments: str):
        directory = tmp_path / moments
        engine = _wrap("nvme", moments, directory)
        swap_file = sum(p.stat().st_size for p in directory.glob("*.swap"))
        _train(engine, 1)
        engine.synchronize()
        before = engine.stats()
        _train(engine, 3)
        engine.synchronize()
        after = engine.stats()
        # writes: each update writes its record once (reads ahead may run into the next step, so reads are
        # not counted per step)
        return after["bytes_disk_written"] - before["bytes_disk_written"], swap_file

    fp32, int8 = bytes_per_step("fp32"), bytes_per_step("int8")
    assert int8[0] <= 0.55 * fp32[0], (int8, fp32)
    assert int8[1] <= 0.6 * fp32[1], (int8, fp32)


@pytest.mark.skipif(offload._native._C is None, reason="the step computes CRC-32C with offload._C")
@pytest.mark.parametrize("moments", COMPRESSED)
@pytest.mark.parametrize("weights_on_disk", [False, True])
def test_the_nvme_update_seals_its_chunks_with_the_steps_crcs(moments, weights_on_disk, tmp_path, monkeypatch):
    """The update's chunk writes are sealed with the CRCs the moment step computed while writing them ([Note: step
    CRCs]), the compute weights' too when they live on disk, nothing read back; every later read of those chunks
    verifies against them (a wrong CRC raises OffloadIntegrityError), and the run equals the cpu tier's."""
    from offload.tiers.disk_checksums import RecordChecksums
    from tests.models import TinyGPT, train_steps
    from tests.test_engine_streaming import BUDGET

    given, computed = [], []
    seal = RecordChecksums.seal

    def spy(self, pieces, crcs=None):
        (given if crcs is not None else computed).append(len(pieces))
        if crcs is not None:  # they are the checksums of the bytes being written
            assert list(crcs) == [offload.checksum.crc32c(p.data) for p in pieces]
        return seal(self, pieces, crcs)

    monkeypatch.setattr(RecordChecksums, "seal", spy)

    def run(tier: str):
        torch.manual_seed(0)
        directory = tmp_path / tier
        directory.mkdir()
        extra = {}
        if tier == "nvme":
            extra = dict(nvme_path=str(directory))
            if weights_on_disk:
                extra.update(device_memory=BUDGET, host_memory=_host_for_disk_weights(moments))
        engine = offload.wrap(TinyGPT(), tier, dtype=torch.float32, device="cpu", lr=1e-2, moments=moments, **extra)
        gen = torch.Generator().manual_seed(2)
        losses = train_steps(engine, [tuple(torch.randint(0, 64, (4, 16), generator=gen) for _ in range(2))
                                      for _ in range(4)])
        plan = engine.plan
        engine.close()
        return losses, plan

    nvme, plan = run("nvme")
    assert bool(plan.disk_weight_blocks) == weights_on_disk
    pieces = 5 if moments == "int8" else 3  # master, each moment's codes (and scales)
    assert given.count(pieces) >= 4, (given, computed)  # every update's chunks
    # the compute weights the step wrote as its `out`, sealed with its CRC at every update when they live on disk,
    # never otherwise
    assert (given.count(1) >= 4) if weights_on_disk else (1 not in given), (given, weights_on_disk)
    assert nvme == run("cpu")[0]


def test_int8_slots_sized_by_their_format_step_exactly_as_slots_sized_for_fp32(tmp_path, monkeypatch):
    """The same host_memory's ring holds 1.5x the int8 elements once its slots are sized by the int8 format (~10 B
    an element) instead of fp32's 16 B; chunks still start on multiples of INT8_BLOCK, so every quantization block
    is the same and the weights after a few steps are equal bit for bit (fewer, larger chunks)."""
    import offload.planner.ring as ring

    grads = 4 * sum(p.numel() for p in _model().parameters())
    ring_bytes = 4 * (128 << 10)  # 4 slots of 128 KiB: 12288 int8 elements each, 8192 sized as fp32
    host = grads + 2 * ring_bytes - min_ring_bytes(moments=MomentFormat.INT8)  # the ring gets half of the spare

    def fp32_sized(slot_bytes: int, moments: MomentFormat = MomentFormat.FP32) -> int:
        granule = ring.chunk_granule(moments)
        return slot_bytes // 16 // granule * granule  # the rule before slots were sized by their format

    def run(name: str):
        engine = _wrap("nvme", "int8", tmp_path / name, host_memory=host)
        _train(engine, 4)
        chunk, moved = engine.stats()["nvme_chunk_numel"], engine.stats()["nvme_chunks_moved"]
        assert engine.plan.ring_bytes == ring_bytes and engine.plan.ring_slots.chunk_numel == chunk
        weights = [p.detach().clone() for p in engine.module.parameters()]
        engine.close()
        return weights, chunk, moved

    sized, sized_chunk, sized_moved = run("int8-sized")
    monkeypatch.setattr(ring, "chunk_numel_for", fp32_sized)
    old, old_chunk, old_moved = run("fp32-sized")
    assert (sized_chunk, old_chunk) == (12288, 8192) and sized_moved < old_moved
    assert all(torch.equal(a, b) for a, b in zip(sized, old))
    assert not all(torch.equal(a, b) for a, b in zip(sized, _model().parameters()))  # they did train


def test_wrap_refuses_an_unknown_moments_setting():
    with pytest.raises(offload.OffloadConfigError, match=r"moments='fp8'.*'fp32', 'bf16', 'int8'"):
        offload.wrap(_model(), "cpu", moments="fp8")


def test_zero_moments_decode_to_zero():
    for fmt in MomentFormat:
        out = torch.ones(1000)
        decode_moment(zeros_moment(fmt, 1000), fmt, EXP_AVG_SQ, out)
        assert not out.any()


@pytest.mark.parametrize("moments", COMPRESSED)
def test_weights_and_gradients_on_disk_step_the_same_compressed_moments(moments, tmp_path):
    """With host_memory too small for the streamed weights (they live in the swap file beside the records) and
    clipping over undeclared accumulation (the gradients wait on disk), the nvme tier's slots carry weights,
    gradients and compressed moments at once: the run equals the cpu tier's with the same moments."""
    from tests.models import TinyGPT
    from tests.test_engine_streaming import BUDGET

    def run(tier: str):
        torch.manual_seed(0)
        directory = tmp_path / tier
        directory.mkdir()
        extra = dict(nvme_path=str(directory), device_memory=BUDGET,
                     host_memory=_host_for_disk_weights(moments)) if tier == "nvme" else {}
        engine = offload.wrap(TinyGPT(), tier, dtype=torch.float32, device="cpu", lr=1e-2, max_grad_norm=0.05,
                              moments=moments, **extra)
        gen = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(3):
            for _ in range(2):
                idx, tgt = (torch.randint(0, 64, (4, 16), generator=gen) for _ in range(2))
                loss = engine(idx, tgt)
                (loss / 2).backward()
                losses.append(loss.item())
            engine.step()
            engine.zero_grad()
        plan = engine.plan
        engine.close()
        return losses, plan

    nvme, plan = run("nvme")
    assert plan.disk_weight_blocks and plan.grads_on_disk
    assert nvme == run("cpu")[0]


@pytest.mark.parametrize("tier", ["cpu", "nvme", "gpu"])
@pytest.mark.parametrize("moments", COMPRESSED)
def test_a_gradient_whose_square_overflows_trains_on_as_fp32_moments(tier, moments, tmp_path):
    """A step whose gradients reach 1e21 (the loss scaled by 1e21: g*g overflows fp32 in most elements, not in the
    smallest) and ordinary steps after it: fp32 moments, like torch's AdamW, keep v = inf where g*g overflowed and
    stop updating those weights; compressed moments do the same and train on (int8 gave NaN weights at the next
    step), their weights within the format's rounding of fp32 moments'."""
    def run(fmt: str):
        engine = _wrap(tier, fmt, tmp_path / f"{fmt}", weight_decay=0.01)
        x, y = _data()
        for step in range(5):
            loss = ((engine(x) - y) ** 2).mean()
            (loss * (1e21 if step == 1 else 1.0)).backward()
            engine.step()
            engine.zero_grad()
        weights = [p.detach().clone() for p in engine.module.parameters()]
        state = engine.optimizer.state_dict()["state"]
        engine.close()
        return weights, state

    want, want_state = run("fp32")
    got, got_state = run(moments)
    assert any(torch.isinf(s["exp_avg_sq"]).any() for s in want_state.values())  # the overflow happened
    for a, b, sa, sb in zip(got, want, got_state.values(), want_state.values()):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        assert torch.equal(torch.isinf(sa["exp_avg_sq"]), torch.isinf(sb["exp_avg_sq"]))
        assert not torch.isnan(sa["exp_avg_sq"]).any() and not torch.isnan(sa["exp_avg"]).any()
        torch.testing.assert_close(a, b, rtol=0, atol=0.02)  # lr 1e-2, 5 steps (measured: int8 7.6e-3, bf16 9e-5)
