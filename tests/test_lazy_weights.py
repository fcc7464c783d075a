"""Lazy construction (issue "larger than RAM"): a model built on the meta device is filled block by block
from a checkpoint (`wrap(model, weights=PATH)`) or initialized block by block (`init=` or the modules'
reset_parameters()), and then trains exactly as plain PyTorch from the same weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import offload
from offload.errors import OffloadConfigError, OffloadIntegrityError
from tests.models import GRAD_ROOM, TinyGPT, make_batches, one_intraop_thread

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
TOL = 1e-5
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _stored(model: nn.Module) -> dict:
    """The state dict as a Hugging Face checkpoint stores it: a tied weight once (lm_head.weight is wte's)."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _save_shards(state: dict, directory, shards: int = 3) -> None:
    """`save_pretrained`'s layout: model-0000i-of-0000n.safetensors and model.safetensors.index.json."""
    names = list(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def _meta_gpt() -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT()


def _torch_losses(reference: nn.Module, batches) -> list:
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, foreach=False)
    losses = []
    for ((idx, tgt),) in batches:
        loss = reference(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _engine_losses(engine, batches) -> list:
    losses = []
    for ((idx, tgt),) in batches:
        loss = engine(idx, tgt)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout", ["file", "shards", "offload-checkpoint"])
@pytest.mark.parametrize("placement", ["cpu", "nvme", "nvme-weights-on-disk"])
def test_a_meta_model_filled_from_a_checkpoint_trains_as_torch(tmp_path, layout, placement):
    torch.manual_seed(0)
    reference = TinyGPT()
    state = _stored(reference)
    if layout == "file":
        weights = tmp_path / "w.safetensors"
        save_file(state, str(weights))
    elif layout == "shards":
        weights = tmp_path / "hf"
        weights.mkdir()
        _save_shards(state, weights)
    else:
        weights = tmp_path / "ckpt"
        with offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu") as saver:
            saver.module.load_state_dict(reference.state_dict())
            saver.save(weights)
    options = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, dtype=torch.float32, device="cpu")
    if placement != "cpu":
        (tmp_path / "swap").mkdir()
        options.update(tier="nvme", nvme_path=tmp_path / "swap")
    if placement == "nvme-weights-on-disk":
        options.update(device_memory=60_000 + GRAD_ROOM, host_memory=250_000)
    batches = make_batches(3, 1)
    want = _torch_losses(reference, batches)
    model = _meta_gpt()
    with offload.wrap(model, weights=weights, **options) as engine:
        if placement == "nvme-weights-on-disk":
            assert engine.plan.disk_weight_blocks  # the weights went from the checkpoint to the swap file
        assert model.lm_head.weight is model.wte.weight  # the tie is kept
        got = _engine_losses(engine, batches)
        trained = engine.state_dict()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=TOL)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, atol=TOL, rtol=TOL, msg=key)


def test_names_and_shapes_must_match_as_strict_load_state_dict(tmp_path):
    state = _stored(TinyGPT())
    state["extra.weight"] = torch.zeros(2)
    del state["h.0.fc.bias"]
    state["h.1.fc.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "w.safetensors"))
    (tmp_path / "swap").mkdir()
    with pytest.raises(OffloadConfigError) as info:
        offload.wrap(_meta_gpt(), tier="nvme", nvme_path=tmp_path / "swap", weights=tmp_path / "w.safetensors",
                     device="cpu")
    message = str(info.value)
    assert "missing from the checkpoint (1): h.0.fc.bias" in message
    assert "not in the model (1): extra.weight" in message
    assert "h.1.fc.weight: checkpoint [3, 3], model [128, 32]" in message
    assert os.listdir(tmp_path / "swap") == []  # refused before any file was made


def test_a_bf16_checkpoint_fills_fp32_weights(tmp_path):
    torch.manual_seed(0)
    state = {k: v.bfloat16() for k, v in _stored(TinyGPT()).items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    with offload.wrap(_meta_gpt(), weights=tmp_path / "w.safetensors", dtype=torch.float32, device="cpu") as engine:
        got = engine.state_dict()
    for key, value in state.items():
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], value.float()), key


def test_a_materialized_model_is_overwritten_by_the_weights(tmp_path):
    torch.manual_seed(0)
    state = _stored(TinyGPT())
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.manual_seed(1)
    with offload.wrap(TinyGPT(), weights=tmp_path / "w.safetensors", dtype=torch.float32, device="cpu") as engine:
        got = engine.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_meta_buffers_the_weights_do_not_hold_are_named(tmp_path):
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("freqs", torch.ones(4), persistent=False)

        def forward(self, x):
            return self.lin(x * self.freqs).sum()

    with torch.device("meta"):
        model = WithBuffer()
    save_file({"lin.weight": torch.zeros(4, 4), "lin.bias": torch.zeros(4)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(OffloadConfigError, match=r"buffers on the meta device.*'freqs'.*init_empty_weights"):
        offload.wrap(model, weights=tmp_path / "w.safetensors", device="cpu")


def test_a_weights_path_that_is_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(OffloadConfigError, match="does not exist"):
        offload.wrap(_meta_gpt(), weights=tmp_path / "nothing", device="cpu")
    with pytest.raises(OffloadConfigError, match="neither model.safetensors.index.json nor model.safetensors"):
        offload.wrap(_meta_gpt(), weights=tmp_path, device="cpu")


def test_a_meta_model_without_weights_is_initialized_block_by_block_and_reproducibly():
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        with offload.wrap(_meta_gpt(), dtype=torch.float32, device="cpu") as engine:
            runs.append(engine.state_dict())
    first, second = runs
    for key, value in first.items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, second[key]), key  # a fixed seed gives the same weights
    assert first["ln_f.weight"].eq(1).all() and first["h.0.fc.bias"].abs().max() > 0  # reset_parameters ran
    assert first["lm_head.weight"] is not None and torch.equal(first["lm_head.weight"], first["wte.weight"])


def test_init_function_and_what_it_leaves_uninitialized():
    calls = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.01)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Embedding, nn.LayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    with offload.wrap(_meta_gpt(), init=init, dtype=torch.float32, device="cpu") as engine:
        got = engine.state_dict()
    assert torch.equal(got["h.0.fc.weight"], torch.full_like(got["h.0.fc.weight"], 0.01))
    assert "Linear" in calls and "Embedding" in calls

    def partial(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    with pytest.raises(OffloadConfigError, match=r"parameter 'wte.weight' was not initialized"):
        offload.wrap(_meta_gpt(), init=partial, device="cpu")


def test_a_module_without_reset_parameters_needs_init():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return (x * self.gain).sum()

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(OffloadConfigError, match=r"without reset_parameters\(\).*'1'.*init=model._init_weights"):
        offload.wrap(model, device="cpu")


def test_a_checkpoint_of_a_lazily_built_engine_loads_into_a_materialized_one_and_back(tmp_path):
    torch.manual_seed(0)
    reference = TinyGPT()
    save_file(_stored(reference), str(tmp_path / "w.safetensors"))
    batches = make_batches(2, 1)
    with offload.wrap(_meta_gpt(), weights=tmp_path / "w.safetensors", dtype=torch.float32, device="cpu") as lazy:
        _engine_losses(lazy, batches[:1])
        lazy.save(tmp_path / "ckpt")
        expected = lazy.state_dict()
    with offload.wrap(TinyGPT(), dtype=torch.float32, device="cpu") as plain:
        plain.load(tmp_path / "ckpt")
        assert all(torch.equal(plain.state_dict()[k], v) for k, v in expected.items())
        plain.save(tmp_path / "ckpt2")
    with offload.wrap(_meta_gpt(), weights=tmp_path / "ckpt2", dtype=torch.float32, device="cpu") as again:
        assert all(torch.equal(again.state_dict()[k], v) for k, v in expected.items())


def _flip_one_byte_of(directory, name: str) -> None:
    """One bit of tensor `name`'s first byte in `directory`/model.safetensors flipped, as a bad disk would."""
    from safetensors import safe_open

    path = os.path.join(directory, "model.safetensors")
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    with safe_open(path, "pt") as f:
        assert name in f.keys()
    offset = 8 + header_len + header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_weights_from_a_damaged_offload_checkpoint_are_refused_as_engine_load_refuses_them(tmp_path):
    torch.manual_seed(0)
    with offload.wrap(TinyGPT(), dtype=torch.float32, device="cpu") as saver:
        saver.save(tmp_path / "ckpt")
    with offload.wrap(_meta_gpt(), weights=tmp_path / "ckpt", dtype=torch.float32, device="cpu"):
        pass  # intact: loads
    _flip_one_byte_of(tmp_path / "ckpt", "h.1.fc.weight")
    with pytest.raises(OffloadIntegrityError, match=r"checksum mismatch.*h\.1\.fc\.weight"):
        offload.wrap(_meta_gpt(), weights=tmp_path / "ckpt", dtype=torch.float32, device="cpu")
    with offload.wrap(TinyGPT(), dtype=torch.float32, device="cpu") as other, \
            pytest.raises(OffloadIntegrityError, match="checksum mismatch"):
        other.load(tmp_path / "ckpt")


def test_a_directory_with_one_file_and_shards_loads_the_file_as_transformers_does(tmp_path):
    torch.manual_seed(0)
    single, sharded = TinyGPT(), TinyGPT()
    save_file(_stored(single), str(tmp_path / "model.safetensors"))
    _save_shards(_stored(sharded), tmp_path)
    with offload.wrap(_meta_gpt(), weights=tmp_path, dtype=torch.float32, device="cpu") as engine:
        got = engine.state_dict()
        assert all(torch.equal(got[k], v) for k, v in single.state_dict().items())
        assert not torch.equal(got["h.0.fc.weight"], sharded.state_dict()["h.0.fc.weight"])


@pytest.mark.parametrize("index", ['{"weight_map": {"a": "model-00001-of', '{"metadata": {}}', '[1, 2]'])
def test_a_damaged_shard_index_is_named_with_the_fix(tmp_path, index):
    torch.manual_seed(0)
    _save_shards(_stored(TinyGPT()), tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(OffloadConfigError, match=r"model\.safetensors\.index\.json is damaged.*weight_map.*save"):
        offload.wrap(_meta_gpt(), weights=tmp_path, dtype=torch.float32, device="cpu")
