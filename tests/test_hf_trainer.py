"""`OffloadTrainer` (issue "HF Trainer"): transformers.Trainer training through an offload engine logs the same
losses and gradient norms and ends at the same weights as the plain Trainer with its AdamW; resuming from its
`checkpoint-N` continues the run exactly; what would train otherwise raises, naming the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from offload.errors import OffloadConfigError
from tests.models import one_intraop_thread

TOL = 1e-5
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")

from offload.integrations.transformers import OffloadTrainer  # noqa: E402  (after the skips)


def _model() -> Any:
    """A tiny Llama, the same weights at every call; biases none, norms present (no weight decay on them)."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _dataset() -> List[Dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(output_dir: Path, **overrides: Any) -> Any:
    # 16 samples, batch 2, 2 micro-batches a step: 4 steps an epoch; weight decay and a 3e-3 peak LR so that a
    # wrong group, hyperparameter or clip shows in the weights far above TOL.
    options = dict(output_dir=str(output_dir), max_grad_norm=1.0, gradient_accumulation_steps=2, warmup_steps=2,
                   lr_scheduler_type="linear", optim="adamw_torch", learning_rate=3e-3, weight_decay=0.1,
                   per_device_train_batch_size=2, num_train_epochs=2, logging_steps=1, report_to=[], seed=0,
                   data_seed=0, use_cpu=True, save_strategy="no", disable_tqdm=True)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def _logged(trainer: Any, after_step: int = 0) -> List[Tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after_step]


def _assert_same_logs(got: List[Tuple[int, float, float]], want: List[Tuple[int, float, float]]) -> None:
    assert [s for s, _l, _n in got] == [s for s, _l, _n in want] and want
    for (step, loss, norm), (_s, ref_loss, ref_norm) in zip(got, want):
        assert abs(loss - ref_loss) <= TOL and abs(norm - ref_norm) <= TOL, (step, loss, ref_loss, norm, ref_norm)


def _max_weight_diff(reference: Dict[str, torch.Tensor], engine: Any) -> float:
    trained = engine.state_dict()
    assert reference.keys() == trained.keys()
    return max((reference[k].float() - trained[k].float()).abs().max().item() for k in reference)


def _offload(tier: str, tmp_path: Path) -> Dict[str, Any]:
    """`tier`: "cpu", "nvme", or "nvme-sharded" (data-parallel ranks keep a part of the weights each)."""
    if tier == "cpu":
        return dict(tier="cpu")
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return dict(tier="nvme", nvme_path=swap, **(dict(shard_weights=True) if tier.startswith("nvme-sharded") else {}))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Tuple[List[Tuple[int, float, float]], Dict[str, Any]]:
    """The plain Trainer with its torch AdamW: logged (step, loss, grad_norm) and final weights."""
    trainer = transformers.Trainer(model=_model(), args=_args(tmp_path_factory.mktemp("plain")),
                                   train_dataset=_dataset())
    trainer.train()
    return _logged(trainer), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.filterwarnings("error:offload. saving between backward:RuntimeWarning")  # engine.zero_grad after a step
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_trains_as_the_plain_trainer_and_resumes_exactly(tier: str, tmp_path: Path, reference: Any) -> None:
    want_logs, want_weights = reference
    first = OffloadTrainer(model=_model(), args=_args(tmp_path / "run", save_strategy="steps", save_steps=3),
                           train_dataset=_dataset(), offload=_offload(tier, tmp_path))
    first.train()
    _assert_same_logs(_logged(first), want_logs)
    assert _max_weight_diff(want_weights, first.engine) <= TOL
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "scheduler.pt").is_file()  # the Trainer's files
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert os.listdir(checkpoint / "offload") == ["offload.json"]  # fp32: nothing beyond them (masters = weights)
    first.engine.close()

    resumed = OffloadTrainer(model=_model(), args=_args(tmp_path / "run"), train_dataset=_dataset(),
                             offload=_offload(tier, tmp_path))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_logs(_logged(resumed, after_step=3), [entry for entry in want_logs if entry[0] > 3])
    assert _max_weight_diff(want_weights, resumed.engine) <= TOL


def test_int8_moments_through_offload_train_close_to_the_plain_trainer_and_resume_exactly(tmp_path: Path,
                                                                                        reference: Any) -> None:
    """offload=dict(moments="int8"): the Trainer's losses track the plain Trainer's (not exact: the moments
    are rounded), and a resume from checkpoint-3 continues the int8 run itself bit for bit."""
    want_logs, _want_weights = reference
    options = dict(_offload("nvme", tmp_path), moments="int8")
    first = OffloadTrainer(model=_model(), args=_args(tmp_path / "run", save_strategy="steps", save_steps=3),
                           train_dataset=_dataset(), offload=options)
    first.train()
    logs = _logged(first)
    assert [s for s, _l, _n in logs] == [s for s, _l, _n in want_logs]
    assert logs != want_logs and all(abs(got - w) <= 0.02 * w for (_s, got, _n), (_t, w, _m) in zip(logs, want_logs))
    first.engine.close()
    resumed = OffloadTrainer(model=_model(), args=_args(tmp_path / "run"), train_dataset=_dataset(), offload=options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert _logged(resumed, after_step=3) == [entry for entry in logs if entry[0] > 3]


def test_bf16_mixed_precision_matches_the_plain_trainer(tmp_path: Path) -> None:
    """bf16=True: fp32 weights, the forward under accelerate's autocast, as the plain Trainer runs it."""
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain", bf16=True, num_train_epochs=1),
                                 train_dataset=_dataset())
    plain.train()
    ours = OffloadTrainer(model=_model(), args=_args(tmp_path / "ours", bf16=True, num_train_epochs=1),
                          train_dataset=_dataset(), offload=dict(tier="cpu"))
    ours.train()
    _assert_same_logs(_logged(ours), _logged(plain))
    assert _max_weight_diff(plain.model.state_dict(), ours.engine) <= TOL


def test_no_clipping_still_logs_the_norm(tmp_path: Path) -> None:
    """max_grad_norm=0: nothing is clipped, and grad_norm is logged as the plain Trainer logs it."""
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain", max_grad_norm=0.0,
                                                            num_train_epochs=1), train_dataset=_dataset())
    plain.train()
    ours = OffloadTrainer(model=_model(), args=_args(tmp_path / "ours", max_grad_norm=0.0, num_train_epochs=1),
                          train_dataset=_dataset(), offload=dict(tier="cpu"))
    ours.train()
    _assert_same_logs(_logged(ours), _logged(plain))
    assert _max_weight_diff(plain.model.state_dict(), ours.engine) <= TOL


def test_the_plain_trainer_over_an_engines_optimizer_trains_as_the_plain_trainer(tmp_path: Path) -> None:
    """Before: refused, accelerate's prepare read engine.optimizer.state_dict(). Now torch's format and torch's
    clip over the held gradients make it the Trainer's own loop, given the Trainer's groups and hyperparameters
    (no weight decay on biases and norms); its optimizer.pt checkpoint round-trips."""
    import offload

    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "plain"), train_dataset=_dataset())
    plain.train()
    model = _model()
    decay = [p for name, p in model.named_parameters() if "norm" not in name]
    no_decay = [p for name, p in model.named_parameters() if "norm" in name]
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu", lr=3e-3, weight_decay=0.1,
                          param_groups=[dict(params=decay), dict(params=no_decay, weight_decay=0.0)])
    with engine:
        ours = transformers.Trainer(model=engine.module, args=_args(tmp_path / "ours", save_strategy="steps",
                                                                    save_steps=4),
                                    train_dataset=_dataset(), optimizers=(engine.optimizer, None))
        ours.train()
        _assert_same_logs(_logged(ours), _logged(plain))
        assert _max_weight_diff(plain.model.state_dict(), engine) <= TOL
        saved = torch.load(tmp_path / "ours" / "checkpoint-4" / "optimizer.pt", weights_only=True)
        assert len(saved["state"]) == len(decay) + len(no_decay)


def _misuse_cases() -> List[Any]:
    def torch_optimizer() -> Dict[str, Any]:
        model = _model()
        return dict(model=model, optimizers=(torch.optim.AdamW(model.parameters()), None))

    return [
        pytest.param(torch_optimizer, {}, {}, "optimizers=", id="optimizers"),
        pytest.param(lambda: dict(model=_model()), dict(optim="sgd"), {}, "optim='sgd'", id="sgd"),
        pytest.param(lambda: dict(model=_model()), {}, dict(lr=1e-3), "learning_rate", id="lr-in-offload"),
        pytest.param(lambda: dict(model=_model()), {}, dict(dtype=torch.bfloat16), "bf16=True", id="bf16-weights"),
        pytest.param(lambda: dict(model_init=_model), {}, {}, "model_init", id="model_init"),
        pytest.param(lambda: dict(model=_model()), dict(auto_find_batch_size=True), {}, "auto_find_batch_size",
                     id="auto-batch"),
    ]


@pytest.mark.parametrize("make, args, offload, match", _misuse_cases())
def test_misuse_raises_naming_the_fix(make: Any, args: Dict[str, Any], offload: Dict[str, Any], match: str,
                                      tmp_path: Path) -> None:
    with pytest.raises(OffloadConfigError, match=match):
        OffloadTrainer(args=_args(tmp_path, **args), train_dataset=_dataset(), offload=dict(tier="cpu", **offload),
                       **make())


def test_an_engine_as_the_model_is_refused(tmp_path: Path) -> None:
    import offload

    engine = offload.wrap(_model(), tier="cpu", dtype=torch.float32, device="cpu")
    with pytest.raises(OffloadConfigError, match="not an engine"):
        OffloadTrainer(model=engine, args=_args(tmp_path), train_dataset=_dataset())


@pytest.mark.parametrize("tier", ["nvme", "nvme-sharded", "nvme-sharded-4x"])
def test_under_torchrun_trains_data_parallel_as_the_plain_trainer_and_resumes(tier: str, tmp_path: Path,
                                                                             reference: Any) -> None:
    """2 ranks (gloo), one sample each per micro-batch: the same logged losses and norms and the same final
    weights as the plain Trainer taking both samples in one process; resumed from checkpoint-3 on 2 ranks,
    it continues with the same logs. Sharded weights: the checkpoint's model files are written by rank 0 from
    gathers every rank takes part in (-4x: with transformers 4.x's save_model, which calls _save on rank 0 only)."""
    import subprocess
    import sys

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not in this build")
    root = Path(__file__).resolve().parent.parent

    def launch(*extra: str) -> None:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(root / "tests" / "trainer_dp_child.py"), str(root), str(tmp_path), tier, *extra],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-6000:]

    want_logs, want_weights = reference
    launch()
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)
    _assert_same_logs(trained["logs"], want_logs)
    assert max((want_weights[k].float() - v.float()).abs().max().item() for k, v in trained["weights"].items()) <= TOL
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file() and os.listdir(checkpoint / "offload") == ["offload.json"]
    launch(str(checkpoint))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    _assert_same_logs([entry for entry in resumed["logs"] if entry[0] > 3],  # 1-3: the checkpoint's history
                      [entry for entry in want_logs if entry[0] > 3])
    assert max((want_weights[k].float() - v.float()).abs().max().item() for k, v in resumed["weights"].items()) <= TOL


STREAMED = 300_000  # device_memory under which the decoder layers and lm_head stream


def _best_args(output_dir: Path, **overrides: Any) -> Any:
    """4 steps, evaluated and saved every 2; the best is the HIGHEST eval loss, so checkpoint-2, not the last."""
    return _args(output_dir, num_train_epochs=1, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                 save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
                 **overrides)


@pytest.mark.parametrize("device_memory, save_only_model", [(None, False), (STREAMED, False), (None, True),
                                                          (STREAMED, True)],
                         ids=["resident", "streamed", "resident-save_only_model", "streamed-save_only_model"])
def test_load_best_model_at_end_loads_the_best_checkpoint(device_memory: Any, save_only_model: bool,
                                                          tmp_path: Path) -> None:
    """The engine ends with checkpoint-2's weights, as the plain Trainer's model does, read from its
    model.safetensors into the engine, streamed blocks too (model.load_state_dict cannot write them: with
    save_only_model this was refused at construction)."""
    from safetensors.torch import load_file

    evaluation = _dataset()[:4]
    plain = transformers.Trainer(model=_model(), args=_best_args(tmp_path / "plain", save_only_model=save_only_model),
                                 train_dataset=_dataset(), eval_dataset=evaluation)
    plain.train()
    ours = OffloadTrainer(model=_model(), args=_best_args(tmp_path / "ours", save_only_model=save_only_model),
                          train_dataset=_dataset(), eval_dataset=evaluation,
                          offload=dict(tier="cpu", device_memory=device_memory))
    assert bool(ours.engine.plan.streamed_blocks) == (device_memory is not None)
    ours.train()
    assert ours.state.best_model_checkpoint == str(tmp_path / "ours" / "checkpoint-2")
    assert plain.state.best_model_checkpoint == str(tmp_path / "plain" / "checkpoint-2")
    assert _max_weight_diff(plain.model.state_dict(), ours.engine) <= TOL
    weights, best, last = ours.engine.state_dict(), *(load_file(tmp_path / "ours" / f"checkpoint-{step}" /
                                                                "model.safetensors") for step in (2, 4))
    assert all(torch.equal(weights[k], best[k]) for k in best)
    assert not all(torch.equal(weights[k], last[k]) for k in last)
    ours.engine.close()
