"""engine.save_pretrained: Hugging Face-style safetensors shards of the trained weights, streamed one flat
group at a time, loadable without offload (safetensors, load_state_dict, transformers' from_pretrained)."""

from __future__ import annotations

import json
import os
import weakref

import pytest
import safetensors.torch
import torch

import offload
from offload.checkpoint import export
from offload.errors import OffloadConfigError
from tests.models import TinyGPT, make_batches, one_intraop_thread
from tests.test_engine_streaming import BUDGET

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
SMALL = 6_000  # bytes: several shards for TinyGPT in bf16, and its 8 KiB fc/out weights each over the limit
TIED = {"lm_head.weight": "wte.weight"}  # alias -> the name the export keeps


def _model():
    torch.manual_seed(0)
    model = TinyGPT()
    model.register_buffer("scale", torch.arange(5, dtype=torch.float64))  # persistent: exported
    model.register_buffer("scratch", torch.ones(3), persistent=False)  # not in state_dict: not exported
    return model


def _engine(tier, tmp_path, **kwargs):
    (tmp_path / "swap").mkdir(exist_ok=True)
    options = dict(tier=tier, dtype=torch.bfloat16, device="cpu", lr=1e-2,
                   nvme_path=str(tmp_path / "swap") if tier == "nvme" else None)
    options.update(kwargs)
    return offload.wrap(_model(), **options)


def _train(engine, steps):
    for batch in make_batches(steps, 1, seed=1):
        idx, tgt = batch[0]
        engine(idx, tgt).backward()
        engine.step()
        engine.zero_grad()


def _read_export(directory):
    """(tensors by name, file of each name): from the index when there is one, else model.safetensors."""
    index_path = os.path.join(directory, export.INDEX_FILE)
    if not os.path.exists(index_path):
        return safetensors.torch.load_file(os.path.join(directory, export.SINGLE_FILE)), None
    with open(index_path) as f:
        index = json.load(f)
    tensors, where = {}, {}
    for file in sorted(set(index["weight_map"].values())):
        for name, tensor in safetensors.torch.load_file(os.path.join(directory, file)).items():
            assert name not in tensors, f"{name} stored twice"
            tensors[name], where[name] = tensor, file
    assert where == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def _expected(engine):
    state = engine.state_dict()
    for alias in TIED:
        del state[alias]
    return state


def _assert_equal_bitwise(exported, expected):
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_sharded_export_equals_the_engine_bitwise(tier, tmp_path):
    with _engine(tier, tmp_path) as engine:
        _train(engine, 2)
        out = engine.save_pretrained(tmp_path / "export", max_shard_size=SMALL)
        expected = _expected(engine)
    assert out == str(tmp_path / "export")
    tensors, index = _read_export(out)
    assert index is not None
    _assert_equal_bitwise(tensors, expected)
    assert tensors["h.0.qkv.weight"].dtype == torch.bfloat16 and tensors["h.0.ln1.weight"].dtype == torch.float32
    assert tensors["scale"].dtype == torch.float64 and "scratch" not in tensors
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count > 3 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for file in files:  # each shard within the limit, or a single tensor over it
        shard = safetensors.torch.load_file(os.path.join(out, file))
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= SMALL or len(shard) == 1, (file, size, list(shard))
    assert sorted(os.listdir(out)) == sorted(files + [export.INDEX_FILE])  # no temporary files, no config.json


def test_single_shard_export_and_switching_layouts(tmp_path):
    directory = tmp_path / "export"
    directory.mkdir()
    (directory / "config.json").write_text('{"mine": true}')
    with _engine("cpu", tmp_path) as engine:
        _train(engine, 1)
        engine.save_pretrained(directory, max_shard_size=SMALL)
        assert export.SINGLE_FILE not in os.listdir(directory)
        engine.save_pretrained(directory)  # default 5GB: one file; the earlier shards and index are removed
        assert sorted(os.listdir(directory)) == ["config.json", export.SINGLE_FILE]
        tensors, index = _read_export(directory)
        assert index is None
        _assert_equal_bitwise(tensors, _expected(engine))
        engine.save_pretrained(directory, max_shard_size="20kB")  # sharded again: model.safetensors goes
        assert export.SINGLE_FILE not in os.listdir(directory) and export.INDEX_FILE in os.listdir(directory)
        _assert_equal_bitwise(_read_export(directory)[0], _expected(engine))
    assert (directory / "config.json").read_text() == '{"mine": true}'  # not a Hugging Face model: left alone


def test_streamed_engine_exports_real_weights(tmp_path):
    with offload.wrap(_model(), tier="cpu", dtype=torch.float32, device="cpu", device_memory=BUDGET) as engine:
        assert engine.plan.streamed_blocks  # the layers hold placeholders in the module
        _train(engine, 2)
        engine.save_pretrained(tmp_path / "export", max_shard_size=20_000)
        expected = _expected(engine)
    tensors, _index = _read_export(tmp_path / "export")
    assert all(torch.isfinite(t).all() for t in tensors.values())
    _assert_equal_bitwise(tensors, expected)


def test_export_loads_into_a_plain_model_strictly(tmp_path):
    with _engine("nvme", tmp_path) as engine:
        _train(engine, 2)
        engine.save_pretrained(tmp_path / "sharded", max_shard_size=SMALL)
        engine.save_pretrained(tmp_path / "single")
        expected = engine.state_dict()
    tensors, _index = _read_export(tmp_path / "sharded")
    plain = _model()
    # The tie is stored once (as transformers does; from_pretrained ties it back): put the alias back by the
    # plain model's own ties, then load strictly.
    names = {}
    for name, value in plain.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(name)
    aliases = {alias: kept for group in names.values() for kept in group[:1] for alias in group[1:]}
    assert aliases == TIED
    plain.load_state_dict({**tensors, **{alias: tensors[kept] for alias, kept in aliases.items()}}, strict=True)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, expected[name].to(value.dtype)), name
    assert plain.lm_head.weight is plain.wte.weight
    # One file: safetensors' own loader resolves the tie itself.
    other = _model()
    safetensors.torch.load_model(other, str(tmp_path / "single" / export.SINGLE_FILE), strict=True)
    for name, value in other.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


def test_peak_memory_is_one_group_not_the_model(tmp_path, monkeypatch):
    """Each group's weights come as a fresh tensor (as the nvme tier's do); at every tensor written, the
    group tensors still alive (a view keeps its base alive) must be one group's, never more."""
    with _engine("cpu", tmp_path) as engine:
        _train(engine, 1)
        groups = [g for _b, g, _s in engine._checkpoints.checkpoint_groups()]
        live = []
        original = engine._checkpoints.group_weights

        def fresh(group):
            flat = original(group).clone()
            live.append((weakref.ref(flat), flat.numel() * flat.element_size()))
            return flat

        peak, largest_write = [0], [0]
        write = export.TensorFileWriter.write

        def recording(self, name, tensor):
            peak[0] = max(peak[0], sum(n for ref, n in live if ref() is not None))
            largest_write[0] = max(largest_write[0], tensor.numel() * tensor.element_size())
            return write(self, name, tensor)

        monkeypatch.setattr(engine._checkpoints, "group_weights", fresh)
        monkeypatch.setattr(export.TensorFileWriter, "write", recording)
        engine.save_pretrained(tmp_path / "export")  # one shard holding the whole model: still one group at a time
    assert len(live) == len(groups) > 3
    assert 0 < peak[0] <= max(g.nbytes for g in groups) < sum(g.nbytes for g in groups) // 2
    assert largest_write[0] == max(s.numel * g.nbytes // g.numel for g in groups for s in g.slots)


def test_a_failed_export_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    directory = tmp_path / "export"
    with _engine("cpu", tmp_path) as engine:
        _train(engine, 1)
        engine.save_pretrained(directory, max_shard_size=SMALL)
        before = {name: (directory / name).read_bytes() for name in os.listdir(directory)}
        _train(engine, 1)
        calls = [0]
        write = export.TensorFileWriter.write

        def failing(self, name, tensor):
            calls[0] += 1
            if calls[0] == 12:  # in a later shard: earlier shards are complete temporary files by then
                raise OSError(28, "No space left on device")
            return write(self, name, tensor)

        monkeypatch.setattr(export.TensorFileWriter, "write", failing)
        with pytest.raises(offload.OffloadIOError, match="no space left while exporting"):
            engine.save_pretrained(directory, max_shard_size=SMALL // 2)
        assert {name: (directory / name).read_bytes() for name in os.listdir(directory)} == before
        monkeypatch.undo()
        engine.save_pretrained(directory, max_shard_size=SMALL)  # works afterwards, with the new weights
        _assert_equal_bitwise(_read_export(directory)[0], _expected(engine))


def test_max_shard_size_forms(tmp_path):
    with _engine("cpu", tmp_path) as engine:
        total = sum(g.nbytes for _b, g, _s in engine._checkpoints.checkpoint_groups())
        for size in (total // 4, f"{total // 4}B", f"{total / 4e3}KB"):
            engine.save_pretrained(tmp_path / "e", max_shard_size=size)
            assert export.INDEX_FILE in os.listdir(tmp_path / "e"), size
        for bad in ("5 parsecs", 0, -1, "lots"):
            with pytest.raises(OffloadConfigError, match="max_shard_size"):
                engine.save_pretrained(tmp_path / "bad", max_shard_size=bad)
        (tmp_path / "afile").write_text("x")
        with pytest.raises(OffloadConfigError, match="is a file"):
            engine.save_pretrained(tmp_path / "afile")


@pytest.mark.parametrize("tie", [False, True])
def test_from_pretrained_gives_the_same_logits(tie, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (not a dependency "
                                       "of offload): the from_pretrained round trip is not checked")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", lr=1e-3) as engine:
        engine(input_ids=ids, labels=ids).loss.backward()
        engine.step()
        engine.zero_grad()
        engine.synchronize()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
        engine.save_pretrained(tmp_path / "hf", max_shard_size="40kB")
    files = os.listdir(tmp_path / "hf")
    assert "config.json" in files and export.INDEX_FILE in files
    tensors, _index = _read_export(tmp_path / "hf")
    assert ("lm_head.weight" in tensors) == (not tie) and "model.embed_tokens.weight" in tensors
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.float32
    with torch.no_grad():
        again = loaded(input_ids=ids).logits
    assert torch.equal(again, logits)
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
