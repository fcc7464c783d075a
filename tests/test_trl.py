"""TRL (issue 24): `class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer)` trains as the plain `SFTTrainer`
(the same logged losses and gradient norms, the same final weights) on the cpu and nvme tiers and with streamed
blocks, through TRL's own overrides (its `compute_loss` with the fused LM head that reads `lm_head.weight`
directly, its `training_step`, `log` and `_save_checkpoint`, with gradient checkpointing on, TRL's default);
a checkpoint it writes resumes exactly, and a subclass's own `_load_optimizer_and_scheduler` (as GRPOTrainer's) still
runs; a class that lists the mixin after the Trainer is refused, one whose overrides the mixin replaces warns."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from offload.errors import OffloadConfigError
from tests.models import one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
trl = pytest.importorskip("trl", reason="needs trl: pip install -e '.[test]'")

import datasets  # noqa: E402  (trl's dependency)

from offload.integrations.transformers import OffloadTrainerMixin  # noqa: E402  (after the skips)
from tests.test_hf_trainer import TOL, _assert_same_logs, _logged, _max_weight_diff, _model, _offload  # noqa: E402

STREAMED = 300_000  # device_memory under which the decoder layers and lm_head stream (as in test_hf_trainer)
WORDS = "the a cat dog sat ran on under mat tree big small red blue fast slow and then".split()


class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer):
    pass


@pytest.fixture(autouse=True, scope="module")
def _no_telemetry() -> Iterator[None]:
    """TRL's trainers ping the Hub when built (huggingface_hub.send_telemetry): not from the tests."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
        yield


def _tokenizer() -> Any:
    """A word-level tokenizer over WORDS with pad and EOS tokens, built offline (ids fit _model's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def _dataset() -> Any:
    """24 sentences of 6-14 words: SFTTrainer adds the EOS, tokenizes and pads them to each batch's longest."""
    rng = random.Random(0)
    return datasets.Dataset.from_dict({"text": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
                                                for _ in range(24)]})


def _config(output_dir: Path, **overrides: Any) -> Any:
    # TRL's defaults (gradient checkpointing on, its optimizer) except fp32 on the CPU, and test_hf_trainer's
    # schedule: 2 micro-batches of 2 a step, warmup, clipping, weight decay and a 3e-3 peak LR.
    options = dict(output_dir=str(output_dir), bf16=False, use_cpu=True, max_steps=6, logging_steps=1, seed=0,
                   data_seed=0, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                   warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.1, max_grad_norm=1.0, report_to=[],
                   save_strategy="no", disable_tqdm=True)
    options.update(overrides)
    return trl.SFTConfig(**options)


def _options(tier: str, tmp_path: Path) -> Dict[str, Any]:
    return dict(tier="cpu", device_memory=STREAMED) if tier == "streamed" else _offload(tier, tmp_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The plain SFTTrainer with its torch AdamW: logged (step, loss, grad_norm) and final weights."""
    trainer = trl.SFTTrainer(model=_model(), args=_config(tmp_path_factory.mktemp("plain")),
                             train_dataset=_dataset(), processing_class=_tokenizer())
    trainer.train()
    return _logged(trainer), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("tier", ["cpu", "nvme", "streamed"])
def test_sft_trains_as_the_plain_sft_trainer_and_resumes_exactly(tier: str, tmp_path: Path, reference: Any) -> None:
    want_logs, want_weights = reference
    first = OffloadSFTTrainer(model=_model(), args=_config(tmp_path / "run", save_strategy="steps", save_steps=3),
                              train_dataset=_dataset(), processing_class=_tokenizer(),
                              offload=_options(tier, tmp_path))
    assert bool(first.engine.plan.streamed_blocks) == (tier == "streamed")
    first.train()
    assert len(want_logs) == 6
    _assert_same_logs(_logged(first), want_logs)
    assert _max_weight_diff(want_weights, first.engine) <= TOL
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file()  # the mixin's _save_optimizer_and_scheduler
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "tokenizer.json").is_file()  # its _save
    assert (tmp_path / "run" / "README.md").is_file()  # SFTTrainer's _save_checkpoint ran too: its model card
    first.engine.close()

    resumed = OffloadSFTTrainer(model=_model(), args=_config(tmp_path / "run"), train_dataset=_dataset(),
                                processing_class=_tokenizer(), offload=_options(tier, tmp_path))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_logs(_logged(resumed, after_step=3), [entry for entry in want_logs if entry[0] > 3])
    assert _max_weight_diff(want_weights, resumed.engine) <= TOL


class _ExtraStateSFTTrainer(trl.SFTTrainer):
    """Keeps state of its own beside each checkpoint's optimizer state, as TRL's GRPOTrainer keeps its entropy
    controller's: written in `_save_checkpoint`, read back in `_load_optimizer_and_scheduler` after `super()`."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        (Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}" / "extra.txt").write_text("kept")

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        self.extra = None if checkpoint is None else (Path(checkpoint) / "extra.txt").read_text()


def test_a_subclass_override_of_the_load_still_runs(tmp_path: Path, reference: Any) -> None:
    """The mixin's `_load_optimizer_and_scheduler` loads the engine's checkpoint, then calls `super()`, so the
    Trainer subclass's own override restores its state too; defining the class warns about nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class OffloadExtraState(OffloadTrainerMixin, _ExtraStateSFTTrainer):
            pass

    want_logs, want_weights = reference
    first = OffloadExtraState(model=_model(), args=_config(tmp_path, save_strategy="steps", save_steps=3),
                              train_dataset=_dataset(), processing_class=_tokenizer(), offload=dict(tier="cpu"))
    first.train()
    first.engine.close()
    resumed = OffloadExtraState(model=_model(), args=_config(tmp_path), train_dataset=_dataset(),
                                processing_class=_tokenizer(), offload=dict(tier="cpu"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.extra == "kept"
    _assert_same_logs(_logged(resumed, after_step=3), [entry for entry in want_logs if entry[0] > 3])
    assert _max_weight_diff(want_weights, resumed.engine) <= TOL


def test_an_override_the_mixin_replaces_warns() -> None:
    """A Trainer subclass's own `_save` (or another hook the mixin replaces without `super()`) would not run."""

    class OwnSave(transformers.Trainer):
        def _save(self, output_dir: Any = None, state_dict: Any = None) -> None:
            pass

    with pytest.warns(RuntimeWarning, match=r"replaces OwnSave\._save without calling it"):
        class OffloadOwnSave(OffloadTrainerMixin, OwnSave):  # noqa: F841  (defining it warns)
            pass


def test_the_mixin_after_the_trainer_is_refused() -> None:
    with pytest.raises(OffloadConfigError, match=r"list the mixin first, class Late\(OffloadTrainerMixin, SFTTrainer"):
        class Late(trl.SFTTrainer, OffloadTrainerMixin):  # noqa: F841  (the class statement raises)
            pass

    class Alone(OffloadTrainerMixin):
        pass

    with pytest.raises(OffloadConfigError, match="no transformers.Trainer"):
        Alone()


def test_a_user_mixin_and_a_subclass_before_it_are_accepted() -> None:
    """Ahead of the mixin may stand classes that are no Trainer, or that already include the mixin."""

    class Logged:
        pass

    class Mine(Logged, OffloadSFTTrainer):
        pass

    assert Mine.__mro__.index(OffloadTrainerMixin) < Mine.__mro__.index(trl.SFTTrainer)
