"""Hugging Face models larger than RAM (issue "larger than RAM"): `offload.integrations.transformers.
from_pretrained(dir, ...)` builds the model from `config.json` on the meta device and fills it block by block
from `save_pretrained`'s shards; it then trains as plain PyTorch from the same checkpoint does."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from offload.errors import OffloadConfigError
from tests.models import one_intraop_thread
from tests.proc_status import CAN_RESET_PEAK, SKIP_REASON

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1
TOL = 1e-5
LAYER_FP32 = 147968  # bytes of one decoder layer of the tiny model below in fp32
GRAD_ROOM = 256 * 64 * 4  # its largest parameter (the embedding): the device keeps room for its gradient
RSS_SLACK = 32 << 20  # as tests/test_engine_memory.py: docs/design.md [Note: the nvme memory bound]
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


def _transformers():
    pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
    return pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")


def _tiny_llama(directory: Path, tie: bool = False, layers: int = 6, seed: int = 0) -> int:
    """A tiny LlamaForCausalLM saved as several shards; returns its fp32 weight bytes."""
    transformers = _transformers()
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="100KB")
    assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) > 2
    return 4 * sum(p.numel() for p in model.parameters())


def _batches(steps: int = 3, batch: int = 2, context: int = 16, vocab: int = 256):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, context), generator=gen) for _ in range(steps)]


def _torch_run(directory: Path, batches):
    transformers = _transformers()
    reference = transformers.LlamaForCausalLM.from_pretrained(directory).train()  # fp32, as saved
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    return _train(reference, opt, batches), reference.state_dict()


def _engine_run(engine, batches):
    return _train(engine, engine, batches)


def _train(model, optimizer, batches):
    """The losses of one step per batch: `optimizer` is a torch optimizer, or the engine itself."""
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _nvme_options(swap: Path, host_memory: int, device_memory: int) -> dict:
    swap.mkdir(exist_ok=True)
    # grad_accumulation_steps: each block is updated during the backward, so host memory holds a window of
    # gradients rather than all of them ([Note: the gradient window]); the maths is unchanged.
    return dict(tier="nvme", nvme_path=swap, dtype=torch.float32, device="cpu", host_memory=host_memory,
                device_memory=device_memory, grad_accumulation_steps=1, lr=LR, betas=BETAS, eps=EPS,
                weight_decay=WD)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied-embeddings"])
def test_a_model_larger_than_both_budgets_trains_as_torch_from_pretrained(tmp_path, tie):
    from offload.integrations.transformers import from_pretrained

    weights = _tiny_llama(tmp_path / "hf", tie=tie)
    host_memory, device_memory = 600_000, LAYER_FP32 + GRAD_ROOM
    assert host_memory + device_memory < weights  # the model does not fit the budgets together
    batches = _batches()
    want_losses, want_state = _torch_run(tmp_path / "hf", batches)
    with from_pretrained(tmp_path / "hf", **_nvme_options(tmp_path / "swap", host_memory, device_memory)) as engine:
        model = engine.module
        assert type(model).__name__ == "LlamaForCausalLM"
        assert engine.plan.disk_weight_blocks  # streamed from the shards to the swap file, never whole in RAM
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        assert not any(b.is_meta for b in model.buffers())  # real, as computed in __init__ (rotary frequencies)
        got_losses = _engine_run(engine, batches)
        got_state = engine.state_dict()
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), atol=TOL, rtol=TOL)
    for key, value in want_state.items():
        torch.testing.assert_close(got_state[key], value, atol=TOL, rtol=TOL, msg=key)


def test_a_missing_tensor_is_named_before_any_swap_file_exists(tmp_path):
    from safetensors.torch import load_file, save_file

    from offload.integrations.transformers import from_pretrained

    _tiny_llama(tmp_path / "hf")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = "model.layers.1.mlp.down_proj.weight"
    shard = tmp_path / "hf" / index["weight_map"].pop(gone)
    tensors = load_file(str(shard))
    del tensors[gone]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    (tmp_path / "swap").mkdir()
    with pytest.raises(OffloadConfigError, match=rf"missing from the checkpoint \(1\): {gone}"):
        from_pretrained(tmp_path / "hf", tier="nvme", nvme_path=tmp_path / "swap", dtype=torch.float32,
                        device="cpu")
    assert os.listdir(tmp_path / "swap") == []


def test_norm_weights_stay_fp32_when_the_compute_dtype_is_bf16(tmp_path):
    from offload.integrations.transformers import from_pretrained

    _tiny_llama(tmp_path / "hf", layers=2)
    with from_pretrained(tmp_path / "hf", dtype=torch.bfloat16, device="cpu") as engine:
        model = engine.module
        norms = [model.model.norm.weight] + [p for layer in model.model.layers
                                             for p in (layer.input_layernorm.weight,
                                                       layer.post_attention_layernorm.weight)]
        assert all(p.dtype == torch.float32 for p in norms)
        assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
        assert model.lm_head.weight.dtype == torch.bfloat16
        state = engine.state_dict()
        assert state["model.norm.weight"].dtype == torch.float32
        # Under autocast, as offload's fp32 norms assume: LlamaRMSNorm returns `weight * x`, fp32 with an fp32
        # weight, which a bf16 Linear refuses without autocast (docs/design.md [Note: Hugging Face models]).
        ids = _batches(1)[0]
        before = state["model.norm.weight"].clone()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.step()
        assert torch.isfinite(loss)
        after = engine.state_dict()["model.norm.weight"]
        assert after.dtype == torch.float32 and not torch.equal(after, before)


def test_init_trains_from_the_config_alone(tmp_path):
    from offload.integrations.transformers import from_pretrained

    _tiny_llama(tmp_path / "hf", layers=2)
    for name in os.listdir(tmp_path / "hf"):
        if "safetensors" in name:
            os.remove(tmp_path / "hf" / name)  # config.json only
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        with from_pretrained(tmp_path / "hf", init="hf", dtype=torch.float32, device="cpu") as engine:
            runs.append(engine.state_dict())
    first, second = runs
    assert torch.equal(first["model.norm.weight"], torch.ones(64))  # transformers' own _init_weights ran
    std = float(first["model.layers.0.mlp.up_proj.weight"].std())
    assert 0.015 < std < 0.025  # initializer_range 0.02
    assert all(torch.equal(v, second[k]) for k, v in first.items())  # reproducible under a seed
    with pytest.raises(OffloadConfigError, match="neither model.safetensors.index.json nor model.safetensors"):
        from_pretrained(tmp_path / "hf", dtype=torch.float32, device="cpu")


def test_a_base_model_checkpoint_into_a_model_with_a_head_gets_a_hint(tmp_path):
    transformers = _transformers()
    from offload.integrations.transformers import from_pretrained

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaModel(config).save_pretrained(tmp_path / "base")
    with pytest.raises(OffloadConfigError, match=r"names start with 'model\.', the checkpoint's do not"):
        from_pretrained(tmp_path / "base", device="cpu")
    with from_pretrained(tmp_path / "base", model_class=transformers.AutoModel, device="cpu") as engine:
        assert type(engine.module).__name__ == "LlamaModel"


def test_paths_that_are_not_a_local_model_are_named(tmp_path, monkeypatch):
    _transformers()
    from offload.integrations.transformers import from_pretrained

    with pytest.raises(OffloadConfigError, match="no config.json"):
        from_pretrained(tmp_path, device="cpu")
    with pytest.raises(OffloadConfigError, match="does not exist"):
        from_pretrained(tmp_path / "nothing", device="cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local_files_only already keeps it off the network
    with pytest.raises(OffloadConfigError, match="offload downloads nothing"):
        from_pretrained("no-such-org-offload-test/no-such-model", device="cpu")


def test_missing_transformers_is_an_import_error_naming_the_install(monkeypatch):
    from offload.integrations import transformers as integration

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ImportError, match="pip install transformers accelerate") as info:
        integration.from_pretrained("anything")
    assert isinstance(info.value, OffloadConfigError)


def test_import_offload_imports_neither_transformers_nor_accelerate():
    code = ("import sys, offload, offload.integrations; "
            "print(sorted(m for m in ('transformers', 'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ----- peak host memory of a model larger than both budgets (a fresh process, as test_engine_memory.py) -------
_CHILD = textwrap.dedent('''
    import ctypes, json, sys, torch
    torch.set_num_threads(1)
    import offload, transformers
    from offload.integrations.transformers import from_pretrained
    from tests.proc_status import reset_peak, status

    directory, nvme_path, host_memory, device_memory = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ids = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    # One-time costs any training with transformers pays, kept out of the baseline: the modules a Llama forward
    # and backward load, torch._dynamo (the first torch.optim.Optimizer), autograd's threads.
    warm_config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2)
    warm = transformers.LlamaForCausalLM(warm_config)
    torch.optim.SGD(warm.parameters(), lr=0.1)
    warm(input_ids=ids % 64, labels=ids % 64).loss.backward()
    del warm
    baseline, baseline_anon = status("VmRSS"), status("RssAnon")
    reset_peak()
    engine = from_pretrained(directory, tier="nvme", nvme_path=nvme_path, dtype=torch.float32, device="cpu",
                             host_memory=host_memory, device_memory=device_memory, grad_accumulation_steps=1, lr=1e-3)
    after_wrap = status("VmHWM")
    losses = []
    for _ in range(3):  # the same batch: the loss must fall
        loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    engine.synchronize()
    peak = status("VmHWM")
    anon_end = status("RssAnon")
    try:  # what the allocator holds freed: glibc returns it on malloc_trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    anon_trimmed = status("RssAnon")
    disk_weights = len(engine.plan.disk_weight_blocks)
    engine.close()
    print(json.dumps(dict(growth=peak - baseline, growth_during_wrap=after_wrap - baseline,
                          anon_growth_at_end=anon_end - baseline_anon, anon_growth_after_trim=anon_trimmed - baseline_anon,
                          losses=losses, disk_weights=disk_weights)))
''')


def test_loading_and_training_a_model_larger_than_both_budgets_stays_within_them(tmp_path):
    """A meta model filled from shards, then trained three steps: peak RSS growth, while wrap() loads and over
    the steps, stays within host_memory + device_memory + RSS_SLACK, with the model's fp32 weights larger than
    that bound (docs/design.md [Note: the nvme memory bound]: 78-80 MiB measured against 94 MiB)."""
    transformers = _transformers()
    if not CAN_RESET_PEAK:
        pytest.skip(SKIP_REASON)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    weights = 4 * sum(p.numel() for p in model.parameters())
    layer = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
    model.save_pretrained(tmp_path / "hf", max_shard_size="20MB")
    del model
    # The gradient window (3 blocks) and the staging ring on the host, two layers on the "device" (host RAM on
    # a machine without a GPU): together well under the weights, so that the model whole would break the bound.
    host_memory, device_memory = 3 * layer + (2 << 20), 2 * layer
    bound = host_memory + device_memory + RSS_SLACK
    assert weights > bound
    (tmp_path / "swap").mkdir()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "hf"), str(tmp_path / "swap"),
                           str(host_memory), str(device_memory)], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(weights=weights, host_memory=host_memory, device_memory=device_memory, bound=bound)
    assert result["disk_weights"] > 0, result
    assert not any(math.isnan(loss) for loss in result["losses"]) and result["losses"][-1] < result["losses"][0], result
    assert result["growth_during_wrap"] <= bound, result
    assert result["growth"] <= bound, result
