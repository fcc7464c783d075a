"""`OffloadTrainer` with a PEFT (LoRA) model (issue 24): `save_model` and every `checkpoint-N` hold the adapter as
the plain `transformers.Trainer` writes it (`adapter_config.json` + `adapter_model.safetensors`, through the
PeftModel's own `save_pretrained`) with the weights the engine trained, whether its blocks stay on the device
or stream; resuming from such a checkpoint continues the run exactly."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import torch

from tests.models import one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
peft = pytest.importorskip("peft", reason="needs peft: pip install -e '.[test]'")

from offload.integrations.transformers import OffloadTrainer  # noqa: E402  (after the skips)
from tests.test_hf_trainer import TOL, _args, _assert_same_logs, _dataset, _logged, _model  # noqa: E402

STREAMED = 300_000  # device_memory under which both decoder layers (and their LoRA weights) stream
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def _lora_model(**options: Any) -> Any:
    """The tiny Llama of test_hf_trainer with LoRA on q_proj and v_proj: lora_B starts at zero."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **options)
    return peft.get_peft_model(_model(), config)


def _peft_args(output_dir: Path, **overrides: Any) -> Any:
    return _args(output_dir, num_train_epochs=1, save_strategy="steps", save_steps=2, **overrides)  # 4 steps


def _adapter(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k}


def _loaded_adapter(directory: Path) -> Dict[str, torch.Tensor]:
    """The adapter weights `PeftModel.from_pretrained(fresh base, directory)` puts into the model."""
    loaded = peft.PeftModel.from_pretrained(_model(), str(directory))
    return {k: v.detach().clone() for k, v in _adapter(loaded.state_dict()).items()}


def _ours(output_dir: Path, device_memory: Optional[int], **lora: Any) -> Any:
    trainer = OffloadTrainer(model=_lora_model(**lora), args=_peft_args(output_dir), train_dataset=_dataset(),
                             offload=dict(tier="cpu", device_memory=device_memory))
    assert bool(trainer.engine.plan.streamed_blocks) == (device_memory is not None)
    return trainer


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The plain Trainer on the same LoRA model, its adapter saved by save_model into `final/`."""
    root = tmp_path_factory.mktemp("plain")
    trainer = transformers.Trainer(model=_lora_model(), args=_peft_args(root / "run"), train_dataset=_dataset())
    trainer.train()
    trainer.save_model(str(root / "final"))
    return trainer, root


@pytest.mark.parametrize("device_memory", [None, STREAMED], ids=["resident", "streamed"])
def test_save_model_writes_the_trained_adapter_as_the_plain_trainer(device_memory: Optional[int], tmp_path: Path,
                                                                    plain: Any) -> None:
    plain_trainer, plain_root = plain
    ours = _ours(tmp_path / "run", device_memory)
    initial = _adapter(ours.engine.state_dict())
    ours.train()
    read = _spy_group_reads(ours.engine)
    ours.save_model(str(tmp_path / "final"))

    files = set(os.listdir(tmp_path / "final"))
    assert files == set(os.listdir(plain_root / "final")) and ADAPTER_FILES <= files
    assert "model.safetensors" not in files and "config.json" not in files
    # only the groups holding the adapter were read (a streamed block's from its host copy)
    assert read == ["base_model.model.model.layers.0/float32", "base_model.model.model.layers.1/float32"]
    trained = _adapter(ours.engine.state_dict())
    loaded = _loaded_adapter(tmp_path / "final")
    assert loaded.keys() == trained.keys() == initial.keys() and len(trained) == 8  # 2 layers x q, v x A, B
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert all(not torch.equal(trained[k], initial[k]) for k in trained if "lora_B" in k)  # lora_B left zero
    want = _adapter(plain_trainer.model.state_dict())
    assert max((want[k] - trained[k]).abs().max().item() for k in want) <= TOL  # training itself is exact

    for step in (2, 4):
        checkpoint = tmp_path / "run" / f"checkpoint-{step}"
        plain_files = set(os.listdir(plain_root / "run" / f"checkpoint-{step}"))
        # the plain Trainer's files (optimizer.pt: the adapter's AdamW state in torch's format), and offload/
        assert set(os.listdir(checkpoint)) == plain_files | {"offload"}
        assert ADAPTER_FILES <= plain_files
    last = _loaded_adapter(tmp_path / "run" / "checkpoint-4")
    assert all(torch.equal(last[k], trained[k]) for k in trained)
    ours.engine.close()


@pytest.mark.parametrize("device_memory", [None, STREAMED], ids=["resident", "streamed"])
def test_resumes_from_an_adapter_checkpoint_exactly(device_memory: Optional[int], tmp_path: Path,
                                                    plain: Any) -> None:
    plain_trainer, _root = plain
    first = _ours(tmp_path / "run", device_memory)
    first.train()
    first.engine.close()
    resumed = _ours(tmp_path / "run", device_memory)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    _assert_same_logs(_logged(resumed, after_step=2), _logged(plain_trainer, after_step=2))
    want, got = _adapter(plain_trainer.model.state_dict()), _adapter(resumed.engine.state_dict())
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= TOL


def test_modules_to_save_of_a_streamed_block_are_saved(tmp_path: Path) -> None:
    """modules_to_save=["lm_head"]: PEFT's save reads the copy's state-dict names from the module, which the
    engine refuses for a streamed block unless the engine itself asks; the values come from the engine."""
    ours = _ours(tmp_path / "run", STREAMED, modules_to_save=["lm_head"])
    assert "base_model.model.lm_head" in ours.engine.plan.streamed_blocks
    initial = _adapter(ours.engine.state_dict())
    ours.train()
    ours.save_model(str(tmp_path / "final"))
    trained = _adapter(ours.engine.state_dict())
    loaded = _loaded_adapter(tmp_path / "final")
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    assert loaded.keys() == trained.keys() and head in trained and len(trained) == 9
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert not torch.equal(trained[head], initial[head])
    ours.engine.close()


def _spy_group_reads(engine: Any) -> list:
    """The keys of the flat groups the engine reads (its checkpoint adapter's `group_weights`) from now on."""
    read = []
    group_weights = engine._checkpoints.group_weights

    def spy(group: Any) -> torch.Tensor:
        read.append(group.key)
        return group_weights(group)

    engine._checkpoints.group_weights = spy
    return read
