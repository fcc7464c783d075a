"""accelerate's own training loop over an engine, one process or several (`accelerate launch`).

The user's loop runs as written for torch's AdamW; only the model and the optimizer come from the engine::

    accelerator = Accelerator(gradient_accumulation_steps=2)  # under `accelerate launch`: the process group
    engine = offload.wrap(model, tier="nvme", nvme_path="/mnt/nvme/offload")  # after it: data-parallel
    model, optimizer, scheduler, loader = accelerator.prepare(engine.module, engine.optimizer, scheduler, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

With several processes accelerate's `prepare` would put the model in `DistributedDataParallel`. The engine does
that job itself (it averages each block's gradient over the ranks and steps its part of the optimizer state:
distributed/data_parallel.py), and DDP around it could not work (distributed/guard.py refuses it). So when an
engine is made while accelerate is imported, `adopt_accelerate()` gives `accelerate.Accelerator` two methods that
know engines' modules (once per process; every other model and every other call goes to accelerate's own):

- `prepare_model(engine.module)`: accelerate's own, so the model is registered for `save_state` and gets the
  autocast of `mixed_precision="bf16"`, but without device placement (the engine places the weights) and without
  DDP. Refused there, naming the fix: an engine made for another world size than the Accelerator's (made before
  the Accelerator started the process group), and `mixed_precision="fp16"` (its GradScaler cannot see the
  engine's gradients).
- `clip_grad_norm_(model.parameters(), max_norm)`: `engine.clip_grad_norm_(max_norm)`, torch's maths over the
  gradient averaged across the ranks (a collective, as DDP's clip over its averaged gradients); torch's own
  clip over the engine's gradients would measure this rank's only, and the engine refuses it.

Nothing else needs a change: `backward` divides the loss by the accumulation steps; `accumulate(model)` enters
the model's `no_sync`, which an engine's module does not have, and the engine's accumulation is exact without
being told which backward is the last (it keeps each block's sum until `step()`: leave `wrap()`'s
`grad_accumulation_steps` unset, or equal to the Accelerator's); the wrapped optimizer steps
and zeroes only on the last micro-batch; `gather_for_metrics` runs accelerate's collectives; `save_state` /
`load_state` call `model.state_dict()` and `optimizer.state_dict()` on every rank (torch's AdamW format, the
whole state on every rank: engine/torch_state.py) and write on the main process, so a state saved by 2 ranks
loads into 1 and back. docs/guide/distributed.md has the launch commands.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.errors import OffloadConfigError, OffloadError
from offload.scheduler.blocks.block import MARKER

_ADOPTED = "_offload_adopted"  # set on accelerate.Accelerator once its two methods know engines' modules
_LOADS_ENGINES = "_offload_loads_engines"  # set on an Accelerator once its load_state loads engines' weights
WEIGHTS_FILE = "model{}.safetensors"  # accelerate's save_state: model.safetensors, model_1.safetensors, ...


def adopt_accelerate() -> None:
    """Make `accelerate.Accelerator.prepare_model` and `.clip_grad_norm_` hand engines' modules to their engines
    (the module docstring), if accelerate is imported; idempotent. `wrap()` calls it: under `accelerate launch`
    the Accelerator starts the process group the engine needs, so accelerate is imported by then."""
    module = sys.modules.get("accelerate.accelerator")
    accelerator_class = getattr(module, "Accelerator", None)
    if accelerator_class is None or getattr(accelerator_class, _ADOPTED, False):
        return
    accelerator_class.prepare_model = _prepare_model(accelerator_class.prepare_model)
    accelerator_class.clip_grad_norm_ = _clip_grad_norm(accelerator_class.clip_grad_norm_)
    setattr(accelerator_class, _ADOPTED, True)


def engine_of(model: Any) -> Optional[Any]:
    """The live engine that wrapped `model` (an nn.Module, or None)."""
    mark = getattr(model, MARKER, None) if isinstance(model, nn.Module) else None
    return mark() if mark is not None else None


def _prepare_model(prepare_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare_model)
    def prepare_engine_module(self: Any, model: nn.Module, device_placement: Optional[bool] = None,
                              evaluation_mode: bool = False) -> Any:
        engine = engine_of(model)
        if engine is None:
            return prepare_model(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        _refuse_unmatched(self, engine)
        if not getattr(self, _LOADS_ENGINES, False):
            self.register_load_state_pre_hook(_load_engines_weights)
            setattr(self, _LOADS_ENGINES, True)
        # evaluation_mode: accelerate's registration and autocast, without its DDP (or other data-parallel wrapper)
        return prepare_model(self, model, device_placement=False, evaluation_mode=True)

    return prepare_engine_module


def _clip_grad_norm(clip_grad_norm_: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(clip_grad_norm_)
    def clip_through_engine(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        engine = _engine_clipping(self, parameters)
        if engine is None:
            return clip_grad_norm_(self, parameters, max_norm, norm_type)
        return engine.clip_grad_norm_(max_norm, norm_type)

    return clip_through_engine


def _load_engines_weights(models: List[Any], input_dir: str) -> None:
    """accelerate's `load_state` pre-hook: each engine's module among the prepared models gets its weights from its
    `model{_i}.safetensors` through the engine (streamed and sharded blocks too, whose parameters are placeholders
    that `model.load_state_dict` cannot write), and accelerate's own load then finds it done. Before the
    optimizer's state, as accelerate loads them. A state saved with `safe_serialization=False` (`.bin`) is left to
    accelerate's `model.load_state_dict`."""
    from offload.integrations.trainer_checkpoint import load_state_dict_file

    for index, model in enumerate(models):
        engine = engine_of(model)
        path = os.path.join(input_dir, WEIGHTS_FILE.format(f"_{index}" if index else ""))
        if engine is not None and os.path.isfile(path):
            load_state_dict_file(engine, model, path)
            models[index] = _Loaded()  # in its place, so the later models keep their files' numbers


class _Loaded:
    """What accelerate's load of the model weights (safetensors' `load_model`) finds where an engine's module was:
    nothing left to load."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Tuple[List[str], List[str]]:
        return [], []


def _refuse_unmatched(accelerator: Any, engine: Any) -> None:
    """What would train otherwise than the same loop over torch's AdamW, raised at `prepare` with the fix."""
    problems: List[str] = []
    processes = int(accelerator.num_processes)
    made_for = 1 if engine.data_parallel is None else engine.data_parallel.world
    if processes != made_for:
        problems.append(
            f"the Accelerator runs {processes} processes but the engine was made by offload.wrap() for {made_for} "
            "(its process group did not exist yet): make the Accelerator first, it starts the process group, then "
            "call offload.wrap(), so that the engine averages the gradients across the ranks")
    if getattr(accelerator, "scaler", None) is not None:
        problems.append(
            "mixed_precision='fp16' (its GradScaler scales the loss and unscales param.grad, which cannot see the "
            "engine's gradients): use mixed_precision='bf16', wrap(dtype=torch.bfloat16), or fp32")
    if problems:
        raise OffloadConfigError("accelerator.prepare(engine.module): " + "; ".join(problems))


def _engine_clipping(accelerator: Any, parameters: List[Any]) -> Optional[Any]:
    """The engine whose gradients `parameters` name, when the clip is its to make: all of its trainable parameters
    (what `model.parameters()` gives: `engine.clip_grad_norm_` clips the whole gradient, as torch's clip over them).
    None for parameters of no engine, and for part of a single-process engine's (torch's own clip reads them
    there); part of a data-parallel engine's, or several models' at once, raise."""
    given = {id(p) for p in parameters}
    engines = {id(e): e for e in (engine_of(m) for m in getattr(accelerator, "_models", ())) if e is not None}
    for engine in engines.values():
        module = engine.module
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        if not given & trainable:
            continue
        owned = {id(p) for p in module.parameters()}
        if trainable <= given <= owned:
            return engine
        if engine.data_parallel is None:
            return None
        raise OffloadError(
            "accelerator.clip_grad_norm_ over part of a data-parallel engine's parameters, or over another model's "
            "with them: the engine clips its whole gradient by its norm across the ranks; pass model.parameters() "
            "of the engine's module alone (or set offload.wrap(max_grad_norm=...))")
    return None


__all__ = ["adopt_accelerate", "engine_of"]
