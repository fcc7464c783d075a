"""`OffloadTrainerMixin` and `OffloadTrainer`: a Hugging Face `transformers.Trainer` (or any subclass of it, such as
TRL's `SFTTrainer`), training through an offload engine.

The Trainer keeps its loop, data, loss, logging, callbacks and `checkpoint-N` directories; the engine replaces the
optimizer, the gradient clipping, the optimizer/scheduler checkpoint and the weight export. The overrides live
in the mixin, each calling `super()`, so it goes before any Trainer subclass:
`class OffloadSFTTrainer(OffloadTrainerMixin, trl.SFTTrainer)`; `OffloadTrainer` is the mixin on
`transformers.Trainer`. Which hooks are overridden, and why: docs/design.md [Note: the Hugging Face Trainer].
"""

from __future__ import annotations

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
from offload.integrations.transformers import _require

transformers, _accelerate = _require()  # MissingDependencyError naming the install command when either is missing
# The bases, from the module _require returned: Any to mypy, so the overrides are not tied to one release's
# annotations (the tests run them against the installed transformers)
Trainer: Any = transformers.Trainer
TrainerCallback: Any = transformers.TrainerCallback

CHECKPOINT_SUBDIR = "offload"  # engine.save's directory inside the Trainer's checkpoint-N
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
    and a class between the mixin and the Trainer that overrides one of those gets a RuntimeWarning::

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
            several GPUs in one process, ...), naming what to use instead; also at class definition, a class
            that puts the mixin after a Trainer class.
    """

    optimizer: Optional[torch.optim.Optimizer]  # the Trainer's; here engine.optimizer, prepared by accelerate

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_mro(cls)

    def __init__(self, model: Any = None, args: Any = None, *more: Any,
                 offload: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        name = type(self).__name__
        if not isinstance(self, Trainer):
            raise OffloadConfigError(f"{name} has OffloadTrainerMixin but no transformers.Trainer to mix it into: "
                                     f"class {name}(OffloadTrainerMixin, transformers.Trainer) (or a subclass of it)")
        if isinstance(model, Engine):
            raise OffloadConfigError(f"{name}(model=...) takes the model, not an engine: it wraps the model "
                                     "itself; pass offload.wrap's options as offload=dict(tier=..., ...)")
        options = _checked_options(offload, name)
        self.engine: Optional[Engine] = None
        super().__init__(model, args, *more, **kwargs)
        self._refuse_unsupported()
        self.engine = self._wrap(self.model, options)
        self._refuse_unloadable_best_model()
        self.add_callback(_ZeroEngineGrads(self.engine))

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

    def _refuse_unloadable_best_model(self) -> None:
        """`load_best_model_at_end` loads the best checkpoint's `offload/` through `engine.load`; without it
        (`save_only_model`) only the Trainer's `model.load_state_dict` is left, which cannot write streamed
        blocks (their parameters are placeholders): refused now rather than after the last step."""
        assert self.engine is not None
        streamed = self.engine.plan.streamed_blocks
        if self.args.load_best_model_at_end and self.args.save_only_model and streamed:
            self.engine.close()
            raise OffloadConfigError(
                f"load_best_model_at_end with save_only_model=True while blocks stream (first: {streamed[0]!r}): "
                "the best weights would be loaded by model.load_state_dict, which cannot write streamed blocks; set "
                "save_only_model=False (the best checkpoint's offload/ is then loaded with engine.load), or give "
                "device_memory room for the whole model")

    def _wrap(self, model: nn.Module, options: Dict[str, Any]) -> Engine:
        """The engine with the AdamW the Trainer's `create_optimizer` would build: its hyperparameters, its
        two weight-decay groups (biases and norms without decay), clipping and accumulation from `args`."""
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
                    param_groups=[g for g in groups if g["params"]], device=args.device, dtype=dtype, **options)

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
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:  # as the Trainer falls back
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (master weights, Adam moments and steps, the LR scheduler) in `offload/`
        inside `checkpoint-N`: engine.save replaces its whole directory atomically. Data-parallel: every rank
        saves its part of the optimizer state (the Trainer calls this on every rank)."""
        assert self.engine is not None
        if self.args.should_save or self.engine.data_parallel is not None:
            assert self.engine is not None
            self.engine.save(os.path.join(output_dir, CHECKPOINT_SUBDIR), scheduler=self.lr_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Checks the checkpoint only: its weights come back with the optimizer state, in one verified
        `engine.load`, once the scheduler exists (`_load_optimizer_and_scheduler`)."""
        _engine_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """`engine.load(checkpoint-N/offload)`, then `super()`: the Trainer's own load finds no `optimizer.pt` or
        `scheduler.pt` there and loads nothing, and a subclass's override still runs (TRL's GRPOTrainer reads
        its entropy controller's state after calling it)."""
        if checkpoint is not None:
            assert self.engine is not None
            self.engine.load(_engine_checkpoint(checkpoint), scheduler=self.lr_scheduler)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        """The best checkpoint's weights into the engine through `engine.load(checkpoint-N/offload)`, exact on
        every tier and with streamed blocks (the Trainer's `model.load_state_dict` / `load_adapter` cannot write
        those). It brings back that checkpoint's Adam state with its weights (the plain Trainer keeps the last
        step's moments); the hyperparameters stay as the LR scheduler left them. A `save_only_model`
        checkpoint has no `offload/`: the Trainer's own load then (refused at construction when blocks stream)."""
        assert self.engine is not None and self.state.best_model_checkpoint is not None
        path = os.path.join(self.state.best_model_checkpoint, CHECKPOINT_SUBDIR)
        if not os.path.isdir(path):
            super()._load_best_model()
            return
        groups = self.engine.optimizer.param_groups
        hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        self.engine.load(path)
        for group, kept in zip(groups, hyperparameters):
            group.update(kept)


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


def _checked_options(offload: Optional[Mapping[str, Any]], trainer: str) -> Dict[str, Any]:
    options = dict(offload or {})
    clashes = [f"{key!r} (set TrainingArguments {FROM_ARGS[key]})" for key in options if key in FROM_ARGS]
    if clashes:
        raise OffloadConfigError("offload= cannot set " + ", ".join(clashes) + f": {trainer} takes them from "
                                 "TrainingArguments, as the Trainer's own optimizer would")
    return options


def _floating_dtype(model: nn.Module) -> torch.dtype:
    """The model's own dtype (its first floating parameter's), so a float32 model computes in float32."""
    dtypes: List[torch.dtype] = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return dtypes[0] if dtypes else torch.float32


def _engine_checkpoint(checkpoint: str) -> str:
    path = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
    if not os.path.isdir(path):
        raise OffloadConfigError(
            f"{checkpoint!r} holds no {CHECKPOINT_SUBDIR}/ engine checkpoint (written by OffloadTrainer or another "
            "OffloadTrainerMixin class unless save_only_model=True, or by a plain Trainer): resume_from_checkpoint "
            "needs one; to start "
            "from its weights only, load them into the model (or offload=dict(weights=...)) and train without resuming")
    return path


__all__ = ["OffloadTrainer", "OffloadTrainerMixin"]
