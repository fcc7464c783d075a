"""TRL's preference and RL trainers through `OffloadTrainerMixin` (issue 37, item 3).

`class OffloadDPOTrainer(OffloadTrainerMixin, trl.DPOTrainer)` and `class OffloadGRPOTrainer(OffloadTrainerMixin,
trl.GRPOTrainer)` train the policy through an engine, and log the same losses and gradient norms (1e-5, fp32 on
the CPU) and end at the same weights as the plain trainers, on the cpu and nvme tiers and with the policy's blocks
streamed: DPO with its reference model as TRL builds it (`create_model_from_path` of the policy's directory,
not offloaded), and with `sync_ref_model`, which mixes the policy's weights into it; GRPO with a reward function,
its KL term against the reference model TRL builds (beta=0.04), and sampled generation through the engine's
module on the CPU (`generate` brings streamed blocks in for each forward). A checkpoint-3 of each resumes exactly.
Before: the mixin passed `args=` positionally, which DPOTrainer and GRPOTrainer take as `ref_model` /
`reward_funcs`. What cannot generate through the engine is refused at construction, naming why and what works:
vLLM, and continuous batching under bf16 (TRL casts the policy model in place).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Tuple

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
from tests.test_trl import STREAMED, WORDS, _no_telemetry, _tokenizer  # noqa: E402, F401  (a fixture)

STEPS, SAVE_AT = 6, 3


class OffloadDPOTrainer(OffloadTrainerMixin, trl.DPOTrainer):
    pass


class OffloadGRPOTrainer(OffloadTrainerMixin, trl.GRPOTrainer):
    pass


def _sentences(n: int, shortest: int, longest: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest))) for _ in range(n)]


def _preferences() -> Any:
    return datasets.Dataset.from_dict({"prompt": _sentences(24, 3, 6, 0), "chosen": _sentences(24, 2, 5, 1),
                                       "rejected": _sentences(24, 2, 5, 2)})


def _prompts() -> Any:
    return datasets.Dataset.from_dict({"prompt": _sentences(24, 3, 6, 0)})


def _reward(completions: List[str], **kwargs: Any) -> List[float]:
    """More animals, fewer words."""
    return [sum(word in ("cat", "dog") for word in c.split()) - 0.1 * len(c.split()) for c in completions]


def _schedule(output_dir: Path, **overrides: Any) -> Dict[str, Any]:
    # test_hf_trainer's schedule (2 micro-batches a step, warmup, clipping, weight decay, a 3e-3 peak LR), fp32 on the CPU
    options = dict(output_dir=str(output_dir), bf16=False, use_cpu=True, max_steps=STEPS, logging_steps=1, seed=0,
                   data_seed=0, gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=1,
                   lr_scheduler_type="linear", weight_decay=0.1, max_grad_norm=1.0, report_to=[], save_strategy="no",
                   disable_tqdm=True)
    options.update(overrides)
    return options


def _dpo_config(output_dir: Path, **overrides: Any) -> Any:
    return trl.DPOConfig(**_schedule(output_dir, per_device_train_batch_size=2, **overrides))


def _grpo_config(output_dir: Path, **overrides: Any) -> Any:
    # 4 completions of up to 8 tokens per prompt, sampled; the KL term against TRL's reference model
    return trl.GRPOConfig(**_schedule(output_dir, per_device_train_batch_size=4, num_generations=4,
                                      max_completion_length=8, beta=0.04, **overrides))


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved, so the policy comes from a directory, and TRL builds the reference model from it
    (`create_model_from_path(model.config._name_or_path)`) as it does for a Hub model."""
    directory = tmp_path_factory.mktemp("policy")
    _model().save_pretrained(directory)
    return directory


def _policy(directory: Path) -> Any:
    return transformers.LlamaForCausalLM.from_pretrained(directory)


def _options(tier: str, tmp_path: Path) -> Dict[str, Any]:
    return dict(tier="cpu", device_memory=STREAMED) if tier == "streamed" else _offload(tier, tmp_path)


Reference = Tuple[List[Tuple[int, float, float]], Dict[str, Any]]


def _weights(trainer: Any) -> Dict[str, Any]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def dpo_reference(tmp_path_factory: pytest.TempPathFactory, policy_dir: Path) -> Reference:
    trainer = trl.DPOTrainer(model=_policy(policy_dir), args=_dpo_config(tmp_path_factory.mktemp("dpo")),
                             train_dataset=_preferences(), processing_class=_tokenizer())
    trainer.train()
    return _logged(trainer), _weights(trainer)


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory: pytest.TempPathFactory, policy_dir: Path) -> Reference:
    trainer = trl.GRPOTrainer(model=_policy(policy_dir), reward_funcs=_reward,
                              args=_grpo_config(tmp_path_factory.mktemp("grpo")), train_dataset=_prompts(),
                              processing_class=_tokenizer())
    trainer.train()
    return _logged(trainer), _weights(trainer)


def _trains_and_resumes(make: Any, config: Any, tmp_path: Path, reference: Reference) -> Any:
    """`make(args)` trains STEPS steps saving at SAVE_AT; then a fresh one resumes from checkpoint-SAVE_AT."""
    want_logs, want_weights = reference
    first = make(config(tmp_path / "run", save_strategy="steps", save_steps=SAVE_AT))
    first.train()
    assert len(want_logs) == STEPS
    _assert_same_logs(_logged(first), want_logs)
    assert _max_weight_diff(want_weights, first.engine) <= TOL
    checkpoint = tmp_path / "run" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "model.safetensors").is_file()
    first.engine.close()
    resumed = make(config(tmp_path / "run"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    _assert_same_logs(_logged(resumed, after_step=SAVE_AT), [entry for entry in want_logs if entry[0] > SAVE_AT])
    assert _max_weight_diff(want_weights, resumed.engine) <= TOL
    return resumed


@pytest.mark.parametrize("tier", ["cpu", "nvme", "streamed"])
def test_dpo_trains_as_the_plain_dpo_trainer_and_resumes_exactly(tier: str, tmp_path: Path, policy_dir: Path,
                                                                  dpo_reference: Reference) -> None:
    def make(args: Any) -> Any:
        trainer = OffloadDPOTrainer(model=_policy(policy_dir), args=args, train_dataset=_preferences(),
                                    processing_class=_tokenizer(), offload=_options(tier, tmp_path))
        assert bool(trainer.engine.plan.streamed_blocks) == (tier == "streamed")
        # TRL's own, from the policy's directory, beside the engine (not offloaded)
        assert isinstance(trainer.ref_model, transformers.LlamaForCausalLM) and trainer.ref_model is not trainer.model
        return trainer

    resumed = _trains_and_resumes(make, _dpo_config, tmp_path, dpo_reference)
    assert "rewards/margins" in resumed.state.log_history[-2]  # DPO's own logging ran


def test_dpo_with_the_reference_model_synced_from_the_policy(tmp_path: Path, policy_dir: Path) -> None:
    """`sync_ref_model` mixes the policy's parameters into the reference model after each step (TRL's
    SyncRefModelCallback reads `param.data`): through streamed blocks too, as the plain trainer."""
    sync = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, max_steps=4)
    plain = trl.DPOTrainer(model=_policy(policy_dir), args=_dpo_config(tmp_path / "plain", **sync),
                           train_dataset=_preferences(), processing_class=_tokenizer())
    plain.train()
    ours = OffloadDPOTrainer(model=_policy(policy_dir), args=_dpo_config(tmp_path / "ours", **sync),
                             train_dataset=_preferences(), processing_class=_tokenizer(),
                             offload=_options("streamed", tmp_path))
    ours.train()
    _assert_same_logs(_logged(ours), _logged(plain))
    for key, value in plain.ref_model.state_dict().items():
        assert (ours.ref_model.state_dict()[key] - value).abs().max().item() <= TOL, key
    ours.engine.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme", "streamed"])
def test_grpo_trains_as_the_plain_grpo_trainer_and_resumes_exactly(tier: str, tmp_path: Path, policy_dir: Path,
                                                                    grpo_reference: Reference) -> None:
    def make(args: Any) -> Any:
        trainer = OffloadGRPOTrainer(model=_policy(policy_dir), reward_funcs=_reward, args=args,
                                     train_dataset=_prompts(), processing_class=_tokenizer(),
                                     offload=_options(tier, tmp_path))
        assert bool(trainer.engine.plan.streamed_blocks) == (tier == "streamed")
        assert isinstance(trainer.ref_model, transformers.LlamaForCausalLM)
        return trainer

    resumed = _trains_and_resumes(make, _grpo_config, tmp_path, grpo_reference)
    rewards = [h["reward"] for h in resumed.state.log_history if "reward" in h]
    assert len(rewards) == STEPS and len(set(rewards)) > 1  # sampled completions, scored (3 of them resumed)


@pytest.mark.parametrize("option, message", [
    (dict(use_vllm=True), r"use_vllm=True \(vLLM generates from a second copy.*use_vllm=False generates with "
                          r"transformers' generate through the engine"),
    (dict(use_transformers_continuous_batching=True, bf16=True),
     r"use_transformers_continuous_batching=True with bf16/fp16 \(TRL casts the policy model in place.*or fp32"),
])
def test_generation_outside_the_engine_is_refused_at_construction(option: Dict[str, Any], message: str,
                                                                   tmp_path: Path, policy_dir: Path) -> None:
    args = _grpo_config(tmp_path, **{"bf16": False, **option})
    with pytest.raises(OffloadConfigError, match=rf"OffloadGRPOTrainer does not support {message}"):
        OffloadGRPOTrainer(_policy(policy_dir), _reward, args, train_dataset=_prompts(),  # positional, as TRL's
                           processing_class=_tokenizer())


def test_continuous_batching_in_fp32_generates_through_the_engine(tmp_path: Path, policy_dir: Path) -> None:
    """The other generation path TRL offers, without a cast: as the plain trainer."""
    batching = dict(use_transformers_continuous_batching=True, max_steps=2)
    plain = trl.GRPOTrainer(model=_policy(policy_dir), reward_funcs=_reward,
                            args=_grpo_config(tmp_path / "plain", **batching), train_dataset=_prompts(),
                            processing_class=_tokenizer())
    plain.train()
    ours = OffloadGRPOTrainer(model=_policy(policy_dir), reward_funcs=_reward,
                              args=_grpo_config(tmp_path / "ours", **batching), train_dataset=_prompts(),
                              processing_class=_tokenizer(), offload=dict(tier="cpu"))
    ours.train()
    _assert_same_logs(_logged(ours), _logged(plain))
    ours.engine.close()
