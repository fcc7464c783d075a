"""Saving a `peft.PeftModel` trained through an engine, as the Trainer saves it (the adapter files, by the model's
own `save_pretrained`), reading only the flat groups that hold the entries it keeps. Used by `OffloadTrainerMixin._save`
(hf_trainer.py); docs/design.md [Note: the Hugging Face Trainer].
"""

from __future__ import annotations

import warnings
from typing import Any, ContextManager, Dict, List, Mapping, Optional

import torch
from torch import nn

from offload.engine.engine import Engine
from offload.integrations.requirements import require_transformers

transformers, _accelerate = require_transformers()


def is_peft_model(model: nn.Module) -> bool:
    """A `peft.PeftModel`, which the Trainer saves with its own `save_pretrained` (the adapter only)."""
    if not transformers.utils.is_peft_available():
        return False
    import peft

    return isinstance(model, peft.PeftModel)


def peft_state_dict(engine: Engine, model: nn.Module) -> Dict[str, torch.Tensor]:
    """The entries of `model.state_dict()` that its `save_pretrained` keeps (per adapter, as
    `get_peft_model_state_dict` selects them: by name and module), with the engine's current values. The
    selection runs first on shape-only meta tensors, so only the flat groups holding the kept entries are read
    (a LoRA adapter of a model larger than memory is small). A PEFT method that computes what it saves from the
    values gets the whole state dict (`engine.state_dict()`)."""
    from peft import get_peft_model_state_dict

    with engine_reads(engine):
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
    return current_values(engine, {name_of[id(v)]: entries[name_of[id(v)]] for v in kept})


def engine_reads(engine: Engine) -> ContextManager[None]:
    """`module.state_dict()` allowed while blocks stream, as `engine.save_pretrained` allows it to itself: PEFT
    reads state-dict names (of the model, and of each `modules_to_save` copy inside `save_pretrained`), whose
    values it then takes from the state dict given to it."""
    return engine.reading_module_state()


def current_values(engine: Engine, wanted: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """CPU copies of the engine's current values of these entries (every update applied), read one flat
    group at a time and only from the groups holding one (`engine.state_dict(names=...)`)."""
    return engine.state_dict(names=list(wanted))
