"""`OffloadTrainer` checkpoints in the plain `transformers.Trainer`'s files (issue 33): a plain Trainer resumed from
an OffloadTrainer `checkpoint-N` logs what the uninterrupted OffloadTrainer run logs, and an OffloadTrainer resumed
from a plain Trainer's logs what the plain run logs (before: the first restarted AdamW's moments and the LR warmup
silently, the second was refused); an fp32 checkpoint is within 1.1x the plain Trainer's bytes (before: 1.72x, the
weights twice and fp32 masters beside fp32 weights); bf16 compute keeps its fp32 masters in `offload/` and
resumes exactly; where the torch-format state does not fit, the plain Trainer refuses the checkpoint, naming why,
and OffloadTrainer still resumes it; the plan is logged when training starts."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tests.models import one_intraop_thread

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")

from offload.integrations import trainer_checkpoint  # noqa: E402  (after the skips)
from offload.integrations.transformers import OffloadTrainer  # noqa: E402
from tests.test_hf_trainer import (  # noqa: E402
    TOL,
    _args,
    _assert_same_logs,
    _dataset,
    _logged,
    _max_weight_diff,
    _model,
    _offload,
)

STREAMED = 300_000  # device_memory under which the decoder layers and lm_head stream (as in test_hf_trainer)
SAVED = 3  # checkpoint-3: mid-epoch, during the LR's linear decay after 2 warmup steps


def _options(tier: str, tmp_path: Path) -> Dict[str, Any]:
    return dict(tier="cpu", device_memory=STREAMED) if tier == "streamed" else _offload(tier, tmp_path)


def _ours(output_dir: Path, tier: str, tmp_path: Path, **args: Any) -> Any:
    return OffloadTrainer(model=_model(), args=_args(output_dir, **args), train_dataset=_dataset(),
                          offload=_options(tier, tmp_path))


def _after(logs: List[Tuple[int, float, float]], step: int = SAVED) -> List[Tuple[int, float, float]]:
    return [entry for entry in logs if entry[0] > step]


def _bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_plain_trainer_resumes_an_offload_checkpoint_exactly(tier: str, tmp_path: Path) -> None:
    """Before: it loaded the weights, found no optimizer.pt / scheduler.pt and restarted AdamW and the warmup."""
    ours = _ours(tmp_path / "ours", tier, tmp_path, save_strategy="steps", save_steps=SAVED)
    ours.train()
    checkpoint = tmp_path / "ours" / f"checkpoint-{SAVED}"
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "model.safetensors",
            "generation_config.json"} <= set(os.listdir(checkpoint))
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain"), train_dataset=_dataset())
    plain.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_logs(_logged(plain, after_step=SAVED), _after(_logged(ours)))
    assert _max_weight_diff(plain.model.state_dict(), ours.engine) <= TOL
    ours.engine.close()


def test_an_fp32_checkpoint_is_the_plain_trainers_files_within_one_tenth(tmp_path: Path) -> None:
    """The same files as the plain Trainer's checkpoint (weights once, optimizer.pt without masters), plus
    offload/offload.json; measured: 1.0005x the plain Trainer's bytes (before: 1.68x on this model)."""
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain", save_strategy="steps",
                                                            save_steps=SAVED, max_steps=SAVED),
                                 train_dataset=_dataset())
    plain.train()
    ours = _ours(tmp_path / "ours", "nvme", tmp_path, save_strategy="steps", save_steps=SAVED, max_steps=SAVED)
    ours.train()
    mine, theirs = tmp_path / "ours" / f"checkpoint-{SAVED}", tmp_path / "plain" / f"checkpoint-{SAVED}"
    assert set(os.listdir(mine)) == set(os.listdir(theirs)) | {"offload"}
    assert os.listdir(mine / "offload") == ["offload.json"]  # fp32: the masters are the weights
    ratio = _bytes(mine) / _bytes(theirs)
    assert ratio <= 1.1, ratio
    for name in ("model.safetensors", "optimizer.pt"):  # the same tensors: within a few bytes of pickle
        assert abs((mine / name).stat().st_size - (theirs / name).stat().st_size) <= 1024, name
    ours.engine.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme", "streamed"])
def test_offload_trainer_resumes_a_plain_trainer_checkpoint_exactly(tier: str, tmp_path: Path) -> None:
    """Before: refused. The weights (streamed blocks too), optimizer.pt and scheduler.pt go into the engine."""
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain", save_strategy="steps",
                                                            save_steps=SAVED), train_dataset=_dataset())
    plain.train()
    ours = _ours(tmp_path / "ours", tier, tmp_path)
    assert bool(ours.engine.plan.streamed_blocks) == (tier == "streamed")
    ours.train(resume_from_checkpoint=str(tmp_path / "plain" / f"checkpoint-{SAVED}"))
    _assert_same_logs(_logged(ours, after_step=SAVED), _after(_logged(plain)))
    assert _max_weight_diff(plain.model.state_dict(), ours.engine) <= TOL
    assert ours.engine.stats()["steps"] == 8 - SAVED  # a plain checkpoint has no engine counters to restore
    ours.engine.close()


def test_bf16_compute_keeps_its_fp32_masters_and_resumes_exactly(tmp_path: Path) -> None:
    """dtype=bfloat16: model.safetensors holds the bf16 weights, optimizer.pt torch's state, offload/masters.pt
    the fp32 masters (which the plan's log names); the resumed run equals the uninterrupted one bit for bit."""
    options = dict(tier="cpu", dtype=torch.bfloat16)
    first = OffloadTrainer(model=_model(), args=_args(tmp_path / "run", bf16=True, save_strategy="steps",
                                                      save_steps=SAVED), train_dataset=_dataset(), offload=options)
    first.train()
    checkpoint = tmp_path / "run" / f"checkpoint-{SAVED}"
    masters = torch.load(checkpoint / "offload" / "masters.pt", weights_only=True)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert all(set(entry) == {"step", "exp_avg", "exp_avg_sq"} for entry in saved["state"].values())
    assert masters and all(m.dtype == torch.float32 for m in masters.values())
    assert "masters.pt" in trainer_checkpoint.stored_where(first.engine)
    want, weights = _logged(first), first.engine.state_dict()
    first.engine.close()
    resumed = OffloadTrainer(model=_model(), args=_args(tmp_path / "run", bf16=True, save_strategy="steps",
                                                        save_steps=SAVED),  # checkpoint-6 again: replaced
                             train_dataset=_dataset(), offload=options)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert _logged(resumed, after_step=SAVED) == _after(want)
    assert all(torch.equal(weights[k], v) for k, v in resumed.engine.state_dict().items())
    resumed.engine.close()


def test_where_the_torch_format_state_does_not_fit_the_plain_trainer_refuses_naming_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """offload/ is then the engine's own checkpoint and optimizer.pt a stub whose load raises with the reason
    (weights_only or not); OffloadTrainer resumes the checkpoint exactly."""
    reason = "the optimizer state in torch's format needs 2.00 TiB of available host memory (a test)"
    monkeypatch.setattr(trainer_checkpoint, "_no_room_for_torch_state", lambda engine: reason)
    first = _ours(tmp_path / "run", "nvme", tmp_path, save_strategy="steps", save_steps=SAVED)
    with pytest.warns(RuntimeWarning, match="keeps the optimizer state in offload/ only"):
        first.train()
    monkeypatch.undo()
    checkpoint = tmp_path / "run" / f"checkpoint-{SAVED}"
    assert (checkpoint / "offload" / "manifest.json").is_file() and (checkpoint / "scheduler.pt").is_file()
    for weights_only in (True, False):
        with pytest.raises(Exception, match="holds no optimizer state.*a test.*resume this checkpoint with "
                                            "OffloadTrainer"):
            torch.load(checkpoint / "optimizer.pt", weights_only=weights_only)
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain"), train_dataset=_dataset())
    with pytest.raises(Exception, match="holds no optimizer state"):
        plain.train(resume_from_checkpoint=str(checkpoint))
    want = _logged(first)
    first.engine.close()
    resumed = _ours(tmp_path / "run", "nvme", tmp_path)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_logs(_logged(resumed, after_step=SAVED), _after(want))
    resumed.engine.close()


def test_the_plan_is_logged_at_info_when_training_starts(tmp_path: Path) -> None:
    """Through transformers' logging, at TrainingArguments' log_level (as DeepSpeed logs its config)."""
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.integrations.offload")
    logger.addHandler(handler)
    try:
        ours = _ours(tmp_path / "run", "cpu", tmp_path, max_steps=1, log_level="info")
        ours.train()
    finally:
        logger.removeHandler(handler)
    table = str(ours.engine.plan).splitlines()[1]  # the placement table's header
    plans = [r for r in records if table in r.getMessage()]
    assert len(plans) == 1 and plans[0].levelno == logging.INFO
    assert "optimizer.pt" in plans[0].getMessage() and "masters" not in plans[0].getMessage()  # fp32: the weights
    ours.engine.close()


@pytest.mark.parametrize("direction", ["offload-to-plain", "plain-to-offload"])
def test_lora_checkpoints_resume_exactly_in_either_trainer(direction: str, tmp_path: Path) -> None:
    """A PEFT (LoRA) checkpoint: the adapter files, optimizer.pt over the adapter's parameters, scheduler.pt;
    the other trainer resumes it with the same logs (OffloadTrainer with its blocks streamed)."""
    pytest.importorskip("peft", reason="needs peft: pip install -e '.[test]'")
    from tests.test_hf_peft import _lora_model, _peft_args

    def ours(output_dir: Path) -> Any:
        return OffloadTrainer(model=_lora_model(), args=_peft_args(output_dir), train_dataset=_dataset(),
                              offload=dict(tier="cpu", device_memory=STREAMED))

    def plain(output_dir: Path) -> Any:
        return transformers.Trainer(model=_lora_model(), args=_peft_args(output_dir), train_dataset=_dataset())

    first, second = (ours, plain) if direction == "offload-to-plain" else (plain, ours)
    saver = first(tmp_path / "first")
    saver.train()
    resumed = second(tmp_path / "second")
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    _assert_same_logs(_logged(resumed, after_step=2), _after(_logged(saver), 2))
    for trainer in (saver, resumed):
        if getattr(trainer, "engine", None) is not None:
            trainer.engine.close()


def test_an_engine_checkpoint_without_the_empty_weight_decay_group_still_loads(tmp_path: Path) -> None:
    """OffloadTrainer left out an empty weight-decay group (a LoRA model's) before issue 33, and keeps it now (as
    optimizer.pt must); its earlier checkpoints (offload/ an engine checkpoint of one group) load into two."""
    import offload

    def wrapped(empty_group: bool) -> Any:
        model = _model()
        groups = [dict(params=list(model.parameters()), weight_decay=0.1)]
        groups += [dict(params=[], weight_decay=0.0)] if empty_group else []
        return offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", param_groups=groups)

    with wrapped(empty_group=False) as saver:
        saver.save(str(tmp_path / "ckpt"))
    with wrapped(empty_group=True) as loader:
        loader.load(str(tmp_path / "ckpt"))
        assert [group["weight_decay"] for group in loader.optimizer.param_groups] == [0.1, 0.0]
