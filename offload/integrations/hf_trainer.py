"""`OffloadTrainerMixin` and `OffloadTrainer`: a Hugging Face `transformers.Trainer` (or any subclass of it, such as
TRL's `SFTTrainer`), training through an offload engine.

The Trainer keeps its loop, data, loss, logging, callbacks and `checkpoint-N` directories; the engine replaces the
optimizer, the gradient clipping and the weight export, and writes and reads the optimizer state in the Trainer's
own files (trainer_checkpoint.py), so either trainer resumes the other's checkpoints. The overrides live
in the mixin, each calling `super()`, so it goes before any Trainer subclass:
`class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer)`; `OffloadTrainer` is the mixin on
`transformers.Trainer`. Which hooks are overridden, and why: docs/design.md [Note: the Hugging Face Trainer].
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn

from offload.api import wrap
from offload.engine.engine import Engine
from offload.errors import OffloadConfigError, OffloadError
from offload.integrations.hf_peft import engine_reads, is_peft_model, peft_state_dict
from offload.integrations.requirements import require_transformers
from offload.integrations.trainer_checkpoint import (
    is_engine_checkpoint,
    load_checkpoint_weights,
    load_optimizer_state,
    save_optimizer_state,
    stored_where,
    without_optimizer_files,
)

transformers, _accelerate = require_transformers()  # MissingDependencyError naming the install command when either is missing
# The bases, from the module require_transformers returned: Any to mypy, so the overrides are not tied to one release's
# annotations (the tests run them against the installed transformers)
Trainer: Any = transformers.Trainer
TrainerCallback: Any = transformers.TrainerCallback
# transformers' logging (TrainingArguments' log_level sets its level), under the name DeepSpeed's integration uses
logger = transformers.utils.logging.get_logger("transformers.integrations.offload")

CHECKPOINT_SUBDIR = "offload"  # inside the Trainer's checkpoint-N: what the engine adds (trainer_checkpoint.py)
TRAINING_ARGS_FILE = "training_args.bin"  # as the Trainer names it
# the mixin's overrides that do not call super(): the Trainer's would save, load or place what the engine holds
REPLACED = ("_move_model_to_device", "create_optimizer", "_save", "_save_optimizer_and_scheduler",
            "_load_from_checkpoint", "_load_best_model")
ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch.optim.AdamW: the maths the engine runs
FROM_ARGS = {  # offload.wrap options the Trainer's arguments decide; given in offload= they would disagree
    "lr": "learning_rate", "betas": "adam_beta1 / adam_beta2", "eps": "adam_epsilon",
    "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm",
    "grad_accumulation_steps": "gradient_accumulation_steps", "device": "use_cpu (or CUDA_VISIBLE_DEVICES)",
    "param_groups": "weight_decay (biases and norms are excluded as the Trainer excludes them)",
}


_TrainerBase: Any = object  # the mixin is a plain class at run time; to mypy (Any) it has the Trainer's attributes


class OffloadTrainerMixin(_TrainerBase):
    """Makes a `transformers.Trainer` subclass train its model through `offload.wrap(model, **offload)`.

    Mix it in first, before the Trainer class, so its overrides come before the Trainer's in the MRO. It overrides
    only the hooks that touch the optimizer, the gradients, the weights on disk and their placement, so the other
    class's own overrides (TRL's `compute_loss`, `training_step`, `log`, `_save_checkpoint`, ...) still run;
    `__init__` and the hooks that extend the Trainer's call `super()`, those that replace it (`REPLACED`) do not,
    and a class between the mixin and the Trainer that overrides one of those gets a RuntimeWarning. TRL's SFTTrainer,
    DPOTrainer (its reference model as TRL builds it, beside the engine) and GRPOTrainer (generation through the
    engine's module) train as the plain ones (tests/test_trl.py, tests/test_trl_dpo_grpo.py)::

        class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer):
            pass

        trainer = OffloadSFTTrainer(model=model, args=sft_config, train_dataset=ds, processing_class=tokenizer,
                                    offload=dict(tier="nvme", nvme_path="/mnt/nvme/offload"))

    Args:
        model, args, ...: as `transformers.Trainer`. The model is wrapped once, here; `trainer.engine` is the engine.
        offload: `offload.wrap`'s options (`tier`, `nvme_path`, `host_memory`, `device_memory`, `dtype`,
            `weights`, ...). The AdamW hyperparameters, clipping, gradient accumulation, weight-decay groups and
            device come from `TrainingArguments`, as the Trainer's own AdamW would take them. `dtype` defaults
            to the model's own (fp32 stays fp32; mixed precision is `TrainingArguments(bf16=True)`).

    Raises:
        OffloadConfigError: a Trainer option that would train differently through the engine (`optimizers=`,
            `optimizer_cls_and_kwargs=`, `model_init=`, an optimizer other than AdamW, fp16, DeepSpeed, FSDP,
            several GPUs in one process, TRL's `use_vllm` and continuous batching under bf16, ...), naming what to
            use instead; also at class definition, a class that puts the mixin after a Trainer class.
    """

    optimizer: Optional[torch.optim.Optimizer]  # the Trainer's; here engine.optimizer, prepared by accelerate

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_mro(cls)

    def __init__(self, *args: Any, offload: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        name = type(self).__name__
        if not isinstance(self, Trainer):
            raise OffloadConfigError(f"{name} has OffloadTrainerMixin but no transformers.Trainer to mix it into: "
                                     f"class {name}(OffloadTrainerMixin, transformers.Trainer) (or a subclass of it)")
        # the Trainer class's own arguments, passed on as given (DPOTrainer's second one is ref_model, not args)
        given = _bound(super().__init__, args, kwargs)
        if isinstance(given.get("model"), Engine):
            raise OffloadConfigError(f"{name}(model=...) takes the model, not an engine: it wraps the model "
                                     "itself; pass offload.wrap's options as offload=dict(tier=..., ...)")
        options = _checked_options(offload, name)
        _refuse_generation_outside_the_engine(given.get("args"), name)  # before TRL starts vLLM or builds anything
        self.engine: Optional[Engine] = None
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self.engine = self._wrap(self.model, options)
        self.add_callback(_ZeroEngineGrads(self.engine))
        self.add_callback(_LogPlan(self.engine))

    # ----- construction ---------------------------------------------------------------------------------
    def _refuse_unsupported(self) -> None:
        """Every Trainer option that would silently train otherwise than the Trainer with its AdamW does."""
        args = self.args
        problems = []
        if self.optimizer is not None or self.lr_scheduler is not None:
            problems.append("optimizers= (the engine is the optimizer: set learning_rate, adam_beta1/2, adam_epsilon "
                            "and weight_decay in TrainingArguments, the schedule with lr_scheduler_type, or override "
                            "create_scheduler)")
        if getattr(self, "optimizer_cls_and_kwargs", None) is not None:
            problems.append("optimizer_cls_and_kwargs= (the engine runs AdamW: use TrainingArguments' Adam options)")
        if self.model_init is not None:
            problems.append("model_init= (the model is wrapped once: pass model=)")
        optim = str(getattr(args.optim, "value", args.optim))  # an OptimizerNames enum
        if optim not in ADAMW:
            problems.append(f"optim={optim!r} (the engine runs AdamW: optim='adamw_torch')")
        if args.optim_args:
            problems.append("optim_args= (not read by the engine: use TrainingArguments' Adam options)")
        if args.fp16 or getattr(args, "fp16_full_eval", False) or getattr(args, "bf16_full_eval", False):
            problems.append("fp16 / fp16_full_eval / bf16_full_eval (fp16 needs a GradScaler, which cannot see the "
                            "engine's gradients, and full-eval casts the wrapped model: use bf16=True, or fp32)")
        if args.deepspeed or getattr(self, "is_deepspeed_enabled", False):
            problems.append("deepspeed (offload replaces DeepSpeed's ZeRO-Offload: drop the deepspeed config)")
        if args.fsdp or getattr(self, "is_fsdp_enabled", False):
            problems.append("fsdp (offload shards the optimizer state across torchrun's ranks itself: drop the "
                            "fsdp options)")
        if args.n_gpu > 1:
            problems.append(f"{args.n_gpu} GPUs in one process (nn.DataParallel cannot replicate the engine: "
                            "CUDA_VISIBLE_DEVICES=<one GPU>)")
        if args.auto_find_batch_size:
            problems.append("auto_find_batch_size (a retry would continue from a half-trained engine: set the "
                            "batch size)")
        if problems:
            raise OffloadConfigError(f"{type(self).__name__} does not support " + "; ".join(problems))

    def _wrap(self, model: nn.Module, options: Dict[str, Any]) -> Engine:
        """The engine with the AdamW the Trainer's `create_optimizer` would build: its hyperparameters, its
        two weight-decay groups (biases and norms without decay; both, an empty one too, so `optimizer.pt`
        groups and numbers the parameters as the plain Trainer's does), clipping and accumulation from `args`."""
        args = self.args
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        dtype = options.pop("dtype", None) or _floating_dtype(model)
        if dtype != torch.float32 and not args.bf16:
            raise OffloadConfigError(f"offload dtype={dtype} computes in low precision, where a norm's fp32 output "
                                     "meets a low-precision layer: set TrainingArguments(bf16=True) (the forward "
                                     "then runs under autocast), or dtype=torch.float32")
        clip = args.max_grad_norm if args.max_grad_norm else math.inf  # inf: the norm is logged, nothing clipped
        return wrap(model, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                    weight_decay=args.weight_decay, max_grad_norm=clip,
                    grad_accumulation_steps=args.gradient_accumulation_steps,
                    param_groups=groups, device=args.device, dtype=dtype, **options)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: `offload.wrap` places the weights on `args.device` (a model on the meta device, to be filled
        by `weights=`, cannot be moved; a wrapped one must not be)."""

    # ----- optimizer, clipping ----------------------------------------------------------------------------
    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """`engine.optimizer`, prepared by accelerate without device placement (which would round-trip the whole
        optimizer state through `state_dict()` / `load_state_dict()`); the Trainer's LR scheduler then drives it."""
        if self.optimizer is None:
            assert self.engine is not None
            self.optimizer = self.accelerator.prepare(self.engine.optimizer, device_placement=[False])
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with its `clip_grad_norm_` (the Trainer's only way to clip and to measure
        the gradient norm) going to the engine, which holds the gradients."""
        super().create_accelerator_and_postprocess()
        self.accelerator.clip_grad_norm_ = self._clip_grad_norm_through_engine
        self._prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = self._prepare_without_ddp

    def _prepare_without_ddp(self, model: nn.Module, device_placement: Optional[bool] = None,
                             evaluation_mode: bool = False) -> nn.Module:
        """accelerate's prepare_model for the engine's module: its autocast for bf16, but no device placement
        and no DistributedDataParallel (under torchrun the engine trains data-parallel itself, and DDP around
        it is refused)."""
        if self.engine is not None and model is self.engine.module:
            return self._prepare_model(model, device_placement=False, evaluation_mode=True)
        return self._prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _clip_grad_norm_through_engine(self, parameters: Iterable[Any], max_norm: float,
                                       norm_type: float = 2.0) -> torch.Tensor:
        """The total gradient norm before clipping, as torch.nn.utils.clip_grad_norm_ returns it. The clipping
        itself happens in `engine.step()` (wrap's `max_grad_norm` is `args.max_grad_norm`: the same scale,
        computed the same way, and blocks can take their norms during the last backward)."""
        engine = self.engine
        if engine is None:
            raise OffloadError(f"the gradient norm was asked for before {type(self).__name__} wrapped the model")
        if max_norm not in (math.inf, engine.policy.max_grad_norm):
            raise OffloadError(f"clip_grad_norm_(max_norm={max_norm}) under {type(self).__name__}: the engine clips to "
                               f"TrainingArguments.max_grad_norm={self.args.max_grad_norm}; set that instead")
        return engine.clip_grad_norm_(math.inf, norm_type)  # scale 1: only measures

    # ----- checkpoints ------------------------------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        """The Trainer's `save_model`; with sharded weights every rank must take part in the saving rank's reads of
        the weights (gathers), and transformers 4.x calls `_save` on the saving rank only: the others call it here."""
        self._save_ran = False
        super().save_model(output_dir, *args, **kwargs)
        if self.engine is not None and self.engine.weights_sharded and not self._save_ran:
            self._save(output_dir)

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[Dict[str, Any]] = None) -> None:
        """The weights as the Trainer's `_save` lays them out, read from the engine: a `peft.PeftModel` through
        its own `save_pretrained` (the adapter files) given the engine's values of the entries it keeps, any
        other model through `engine.save_pretrained` (streamed, one flat group at a time: `model.state_dict()`
        is refused while blocks stream); then the processing class and the args."""
        if state_dict is not None:
            raise OffloadError(f"{type(self).__name__} saves the engine's weights; a state_dict cannot be passed")
        self._save_ran = True
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        assert self.engine is not None
        if not self.args.should_save:
            if self.engine.weights_sharded:  # the saving rank's reads of the weights are gathers: take part
                if is_peft_model(self.model):
                    peft_state_dict(self.engine, self.model)
                else:
                    self.engine.save_pretrained(output_dir)
            return
        if is_peft_model(self.model):
            os.makedirs(output_dir, exist_ok=True)
            state = peft_state_dict(self.engine, self.model)
            with engine_reads(self.engine):
                self.model.save_pretrained(output_dir, state_dict=state)
        else:
            self.engine.save_pretrained(output_dir)
            _save_generation_config(self.model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:  # as the Trainer falls back
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """`optimizer.pt` (torch's AdamW format) and `scheduler.pt`, as the plain Trainer writes them, and in
        `offload/` only what the engine has beyond them (trainer_checkpoint.py: the fp32 master weights where the
        compute weights are not fp32; the engine's own checkpoint where the torch-format state does not fit, with
        an `optimizer.pt` stub that refuses to load). Data-parallel: every rank takes part (the Trainer calls this
        on every rank), rank 0 writes."""
        assert self.engine is not None
        if self.args.should_save or self.engine.data_parallel is not None:
            save_optimizer_state(self.engine, output_dir, self.lr_scheduler, writes=self.args.should_save)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """The checkpoint's weights into the engine (its `model.safetensors` or shards, or the PEFT adapter: an
        OffloadTrainer's or a plain Trainer's), keeping the Adam state for `_load_optimizer_and_scheduler`. A
        checkpoint whose `offload/` is a whole engine checkpoint loads there instead, weights and state in one
        verified `engine.load`."""
        assert self.engine is not None
        if not is_engine_checkpoint(resume_from_checkpoint):
            load_checkpoint_weights(self.engine, self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """`optimizer.pt` through `engine.optimizer.load_state_dict` (mapped from the file, not read into memory)
        with `offload/`'s master weights, and `scheduler.pt`; or `engine.load(checkpoint-N/offload)` for a whole
        engine checkpoint. Then `super()`, so a subclass's override still runs (TRL's GRPOTrainer reads its
        entropy controller's state after calling it), given the checkpoint without the files loaded here: the
        Trainer's own load then finds nothing to load again."""
        if checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.engine is not None
        if is_engine_checkpoint(checkpoint):
            self.engine.load(os.path.join(checkpoint, CHECKPOINT_SUBDIR), scheduler=self.lr_scheduler)
        elif not load_optimizer_state(self.engine, checkpoint, self.lr_scheduler):
            logger.warning(f"{checkpoint} holds no optimizer.pt (saved with save_only_model=True?): the weights are "
                           "resumed, AdamW's moments and the LR schedule start afresh, as in the plain Trainer")
        with without_optimizer_files(checkpoint) as view:
            super()._load_optimizer_and_scheduler(view)

    def _load_best_model(self) -> None:
        """The best checkpoint's weights into the engine, as the Trainer's `model.load_state_dict` /
        `load_adapter` loads them (the Adam state stays the last step's), on every tier and with streamed
        blocks, which those cannot write."""
        assert self.engine is not None and self.state.best_model_checkpoint is not None
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        load_checkpoint_weights(self.engine, self.model, best)


def _check_mro(cls: type) -> None:
    """A class with a Trainer class ahead of the mixin in its MRO (`class C(SFTTrainer, OffloadTrainerMixin)`)
    would run the Trainer's `__init__`, optimizer and saving instead of the mixin's: refused when it is defined.
    Ahead of the mixin may stand only classes that are no Trainer (other mixins) or already include it. Behind
    it, an override of a hook the mixin replaces without `super()` would never run: a warning names it."""
    mro = cls.__mro__
    at = mro.index(OffloadTrainerMixin)
    ahead = [c for c in mro[:at] if issubclass(c, Trainer) and not issubclass(c, OffloadTrainerMixin)]
    if ahead:
        raise OffloadConfigError(
            f"class {cls.__name__} puts {ahead[0].__name__} before OffloadTrainerMixin, so the Trainer's own __init__, "
            f"optimizer and saving would hide the mixin's and the model would not train through the engine: list the "
            f"mixin first, class {cls.__name__}(OffloadTrainerMixin, {ahead[0].__name__})")
    behind = mro[at + 1:mro.index(Trainer)] if Trainer in mro else ()
    skipped = [f"{c.__name__}.{name}" for c in behind for name in REPLACED if name in vars(c)]
    if skipped:
        warnings.warn(f"class {cls.__name__}: OffloadTrainerMixin replaces {', '.join(skipped)} without calling it "
                      "(the engine places, saves and loads the weights and the optimizer state), so that override "
                      "will not run", RuntimeWarning, stacklevel=3)


class OffloadTrainer(OffloadTrainerMixin, Trainer):
    """`transformers.Trainer` whose model trains through `offload.wrap(model, **offload)`: `OffloadTrainerMixin`
    (its arguments, refusals and overrides) on the Trainer itself."""


class _ZeroEngineGrads(TrainerCallback):
    """`engine.zero_grad()` after each optimizer step, where the Trainer calls `model.zero_grad()`: that clears
    `.grad`, which the engine notices only at the next gradient, so a checkpoint saved right after the step
    would still count gradients as pending (and an nvme gradient window would not be given back yet)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.engine.zero_grad()


class _LogPlan(TrainerCallback):
    """The engine's plan (where each block's weights and state live) and what the checkpoints will hold, at
    info level when training starts, as DeepSpeed logs its config."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logger.info(f"{self.engine.plan}\n{stored_where(self.engine)}")


def _bound(init: Any, args: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The Trainer class's `__init__` arguments by name (what the call would bind; {} where it cannot bind them:
    the class's own __init__ then raises as it would)."""
    try:
        return dict(inspect.signature(init).bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _refuse_generation_outside_the_engine(args: Any, trainer: str) -> None:
    """TRL's online trainers (GRPOTrainer, RLOOTrainer, ...) generate with the policy model: through the engine's
    module with transformers' `generate` (the engine brings streamed and sharded blocks in for each forward), which
    works. Two of their options would generate from the weights another way, refused here with what works."""
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append("use_vllm=True (vLLM generates from a second copy of the policy's weights on the GPU, which "
                        "offload's device budget does not count, refilled after each step by reading every "
                        "parameter, which is not verified through streamed or sharded blocks): use_vllm=False "
                        "generates with transformers' generate through the engine")
    if getattr(args, "use_transformers_continuous_batching", False) and (args.bf16 or args.fp16):
        problems.append("use_transformers_continuous_batching=True with bf16/fp16 (TRL casts the policy model in place "
                        "before each generation, model.to(torch.bfloat16), which would replace the engine's weights): "
                        "use_transformers_continuous_batching=False (the default generate), or fp32")
    if problems:
        raise OffloadConfigError(f"{trainer} does not support " + "; ".join(problems))


def _checked_options(offload: Optional[Mapping[str, Any]], trainer: str) -> Dict[str, Any]:
    options = dict(offload or {})
    clashes = [f"{key!r} (set TrainingArguments {FROM_ARGS[key]})" for key in options if key in FROM_ARGS]
    if clashes:
        raise OffloadConfigError("offload= cannot set " + ", ".join(clashes) + f": {trainer} takes them from "
                                 "TrainingArguments, as the Trainer's own optimizer would")
    return options


def _save_generation_config(model: nn.Module, output_dir: str) -> None:
    """`generation_config.json`, as `PreTrainedModel.save_pretrained` writes it beside `config.json` (the
    export writes the config only)."""
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and config is not None:
        config.save_pretrained(output_dir)


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The model's own dtype (its first floating parameter's), so a float32 model computes in float32."""
    dtypes: List[torch.dtype] = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return dtypes[0] if dtypes else torch.float32


__all__ = ["OffloadTrainer", "OffloadTrainerMixin"]
