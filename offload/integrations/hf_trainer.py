"""`OffloadTrainer`: the Hugging Face `transformers.Trainer`, training through an offload engine.

The Trainer keeps its loop, data, logging, callbacks and `checkpoint-N` directories; the engine replaces the
optimizer, the gradient clipping, the optimizer/scheduler checkpoint and the weight export. Which Trainer
hooks are overridden, and why: docs/design.md [Note: the Hugging Face Trainer].
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, ContextManager, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn

from offload.api import wrap
from offload.engine.engine import Engine
from offload.errors import OffloadConfigError, OffloadError
from offload.integrations.transformers import _require

transformers, _accelerate = _require()  # MissingDependencyError naming the install command when either is missing
# The bases, from the module _require returned: Any to mypy, so the overrides are not tied to one release's
# annotations (the tests run them against the installed transformers)
Trainer: Any = transformers.Trainer
TrainerCallback: Any = transformers.TrainerCallback

CHECKPOINT_SUBDIR = "offload"  # engine.save's directory inside the Trainer's checkpoint-N
TRAINING_ARGS_FILE = "training_args.bin"  # as the Trainer names it
ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch.optim.AdamW: the maths the engine runs
FROM_ARGS = {  # offload.wrap options the Trainer's arguments decide; given in offload= they would disagree
    "lr": "learning_rate", "betas": "adam_beta1 / adam_beta2", "eps": "adam_epsilon",
    "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm",
    "grad_accumulation_steps": "gradient_accumulation_steps", "device": "use_cpu (or CUDA_VISIBLE_DEVICES)",
    "param_groups": "weight_decay (biases and norms are excluded as the Trainer excludes them)",
}


class OffloadTrainer(Trainer):
    """`transformers.Trainer` whose model trains through `offload.wrap(model, **offload)`.

    Args:
        model, args, ...: as `transformers.Trainer`. The model is wrapped once, here; `trainer.engine` is the engine.
        offload: `offload.wrap`'s options (`tier`, `nvme_path`, `host_memory`, `device_memory`, `dtype`,
            `weights`, ...). The AdamW hyperparameters, clipping, gradient accumulation, weight-decay groups and
            device come from `TrainingArguments`, as the Trainer's own AdamW would take them. `dtype` defaults
            to the model's own (fp32 stays fp32; mixed precision is `TrainingArguments(bf16=True)`).

    Raises:
        OffloadConfigError: a Trainer option that would train differently through the engine (`optimizers=`,
            `optimizer_cls_and_kwargs=`, `model_init=`, an optimizer other than AdamW, fp16, DeepSpeed, FSDP,
            several GPUs in one process, ...), naming what to use instead.
    """

    optimizer: Optional[torch.optim.Optimizer]  # the Trainer's; here engine.optimizer, prepared by accelerate

    def __init__(self, model: Optional[nn.Module] = None, args: Any = None, *more: Any,
                 offload: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        if isinstance(model, Engine):
            raise OffloadConfigError("OffloadTrainer(model=...) takes the model, not an engine: it wraps the model "
                                     "itself; pass offload.wrap's options as offload=dict(tier=..., ...)")
        options = _checked_options(offload)
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
            raise OffloadConfigError("OffloadTrainer does not support " + "; ".join(problems))

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
        """`engine.optimizer`, prepared by accelerate without device placement (which would read its
        `state_dict()`, kept off torch's format); the Trainer's LR scheduler then drives it."""
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
            raise OffloadError("the gradient norm was asked for before OffloadTrainer wrapped the model")
        if max_norm not in (math.inf, engine.policy.max_grad_norm):
            raise OffloadError(f"clip_grad_norm_(max_norm={max_norm}) under OffloadTrainer: the engine clips to "
                               f"TrainingArguments.max_grad_norm={self.args.max_grad_norm}; set that instead")
        return engine.clip_grad_norm_(math.inf, norm_type)  # scale 1: only measures

    # ----- checkpoints ------------------------------------------------------------------------------------
    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[Dict[str, Any]] = None) -> None:
        """The weights as the Trainer's `_save` lays them out, read from the engine: a `peft.PeftModel` through
        its own `save_pretrained` (the adapter files) given the engine's values of the entries it keeps, any
        other model through `engine.save_pretrained` (streamed, one flat group at a time: `model.state_dict()`
        is refused while blocks stream); then the processing class and the args."""
        if state_dict is not None:
            raise OffloadError("OffloadTrainer saves the engine's weights; a state_dict cannot be passed")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        assert self.engine is not None
        if _is_peft_model(self.model):
            os.makedirs(output_dir, exist_ok=True)
            state = _peft_state_dict(self.engine, self.model)
            with _engine_reads(self.engine):
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
        if checkpoint is None:
            return
        assert self.engine is not None
        self.engine.load(_engine_checkpoint(checkpoint), scheduler=self.lr_scheduler)

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


class _ZeroEngineGrads(TrainerCallback):
    """`engine.zero_grad()` after each optimizer step, where the Trainer calls `model.zero_grad()`: that clears
    `.grad`, which the engine notices only at the next gradient, so a checkpoint saved right after the step
    would still count gradients as pending (and an nvme gradient window would not be given back yet)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.engine.zero_grad()


def _is_peft_model(model: nn.Module) -> bool:
    """A `peft.PeftModel`, which the Trainer saves with its own `save_pretrained` (the adapter only)."""
    if not transformers.utils.is_peft_available():
        return False
    import peft

    return isinstance(model, peft.PeftModel)


def _peft_state_dict(engine: Engine, model: nn.Module) -> Dict[str, torch.Tensor]:
    """The entries of `model.state_dict()` that its `save_pretrained` keeps (per adapter, as
    `get_peft_model_state_dict` selects them: by name and module), with the engine's current values. The
    selection runs first on shape-only meta tensors, so only the flat groups holding the kept entries are read
    (a LoRA adapter of a model larger than memory is small). A PEFT method that computes what it saves from the
    values gets the whole state dict (`engine.state_dict()`)."""
    from peft import get_peft_model_state_dict

    with _engine_reads(engine):
        entries = model.state_dict(keep_vars=True)  # streamed blocks' parameters: placeholders, for their names
        skeleton = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in entries.items()}
        name_of = {id(t): name for name, t in skeleton.items()}
        kept: Optional[List[Any]] = None
        try:
            with warnings.catch_warnings():  # the real save repeats them
                warnings.simplefilter("ignore")
                kept = [v for adapter in model.peft_config  # type: ignore[union-attr]
                        for v in get_peft_model_state_dict(model, state_dict=skeleton, adapter_name=adapter).values()]
        except (RuntimeError, NotImplementedError):  # an operation on the meta tensors' values
            pass
    if kept is None or not all(id(v) in name_of for v in kept):  # computed from the values: give them all
        return engine.state_dict()
    return _current_values(engine, {name_of[id(v)]: entries[name_of[id(v)]] for v in kept})


def _engine_reads(engine: Engine) -> ContextManager[None]:
    """`module.state_dict()` allowed while blocks stream, as `engine.save_pretrained` allows it to itself: PEFT
    reads state-dict names (of the model, and of each `modules_to_save` copy inside `save_pretrained`), whose
    values it then takes from the state dict given to it."""
    return engine.reading_module_state()


def _current_values(engine: Engine, wanted: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """CPU copies of the engine's current values of these entries (every update applied), read one flat
    group at a time and only from the groups holding one (`engine.state_dict(names=...)`)."""
    return engine.state_dict(names=list(wanted))


def _checked_options(offload: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    options = dict(offload or {})
    clashes = [f"{key!r} (set TrainingArguments {FROM_ARGS[key]})" for key in options if key in FROM_ARGS]
    if clashes:
        raise OffloadConfigError("offload= cannot set " + ", ".join(clashes) + ": OffloadTrainer takes them from "
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
            f"{checkpoint!r} holds no {CHECKPOINT_SUBDIR}/ engine checkpoint (written by OffloadTrainer unless "
            "save_only_model=True, or by plain transformers.Trainer): resume_from_checkpoint needs one; to start "
            "from its weights only, load them into the model (or offload=dict(weights=...)) and train without resuming")
    return path


__all__ = ["OffloadTrainer"]
