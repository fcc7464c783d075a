"""Hugging Face models larger than RAM: `from_pretrained(dir, **wrap_options)`.

The model is built from the directory's `config.json` on the meta device (`accelerate.init_empty_weights()`:
parameters take no memory, buffers computed in `__init__` such as rotary frequencies stay real), tied as
transformers ties it, and handed to `offload.wrap(model, weights=dir, ...)`, which fills each block from the
shards as it is placed. So the model never exists whole in memory: the buffers hold what the plan puts
there (but see the note on the shards' mapped file pages). See docs/design.md [Note: Hugging Face models].

Also `OffloadTrainer` and `OffloadTrainerMixin` (offload/integrations/hf_trainer.py, imported on first access):
transformers.Trainer, or any subclass of it such as TRL's SFTTrainer, training through an offload engine
(docs/design.md [Note: the Hugging Face Trainer]).

Needs `pip install transformers accelerate` (or `pip install "offload[hf]"`); `import offload` never imports
this module.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from offload._system import unmap_large_allocations
from offload.api import wrap
from offload.engine.engine import Engine
from offload.errors import OffloadConfigError
from offload.integrations.requirements import require_transformers
from offload.policy import Tier, bounds_host_memory
from offload.scheduler.torch_internals import own_parameters

if TYPE_CHECKING:  # at run time transformers comes from _require, which names the install command when missing
    from transformers import PreTrainedModel



def __getattr__(name: str) -> Any:
    """`OffloadTrainer` and `OffloadTrainerMixin`, imported on first use: they need transformers.Trainer, and this
    module must import without transformers."""
    if name in ("OffloadTrainer", "OffloadTrainerMixin"):
        from offload.integrations import hf_trainer
        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_pretrained(
    path: Union[str, "os.PathLike[str]"],
    *,
    model_class: Optional[Any] = None,
    init: Union[None, str, Callable[[nn.Module], None]] = None,
    config: Optional[Any] = None,
    **wrap_options: Any,
) -> Engine:
    """A Hugging Face model from `path`, wrapped for training without ever being whole in memory.

    Args:
        path: a local directory as `save_pretrained` writes it (`config.json` and `model.safetensors` or
            shards with `model.safetensors.index.json`), or a hub id already in the local Hugging Face cache
            (nothing is downloaded: `huggingface-cli download <id>` first).
        model_class: the class to build, e.g. `transformers.AutoModelForSequenceClassification` or
            `LlamaForCausalLM` (default `AutoModelForCausalLM`). The checkpoint's tensor names must be those of
            this class's `state_dict()`.
        init: train from the config alone, without reading any weights: `"hf"` initializes each module as
            transformers does (`model._init_weights`), a function `init(module)` as `offload.wrap`'s `init`.
            Unset (the default), the weights come from `path` (or from `weights=`).
        config: a transformers config to use instead of `path`'s `config.json` (it is copied, not changed).
        **wrap_options: `offload.wrap`'s options (`tier`, `nvme_path`, `dtype`, `host_memory`, ...). `dtype`
            is the compute dtype as in `wrap`: the model is built in float32, so master weights, Adam state and
            normalization layers stay fp32 and the other weights take `dtype` block by block.

    Raises:
        MissingDependencyError: transformers or accelerate is missing (an OffloadConfigError and ImportError).
        OffloadConfigError: no config or weights at `path`, or names/shapes that do not match the model (listed,
            before any memory or swap file is allocated).
    """
    transformers, accelerate = require_transformers()
    if init is not None and wrap_options.get("weights") is not None:
        raise OffloadConfigError("pass init= (train from the config) or weights= (a checkpoint), not both")
    directory = _local_directory(path) if config is None or init is None else None
    if config is None:
        assert directory is not None
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise OffloadConfigError(f"{directory!r} holds no config.json: pass a directory that save_pretrained "
                                     "wrote, or config=")
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    else:
        config = copy.deepcopy(config)  # _from_config sets its dtype
    if bounds_host_memory(Tier.parse(wrap_options.get("tier", "cpu")), wrap_options.get("host_memory")):
        unmap_large_allocations()  # building the model frees chunks of MiBs, which would stay resident in the heap
    model = build_empty(config, model_class)
    if init is not None:
        return wrap(model, init=_hf_init(model) if init == "hf" else _checked_init(init), **wrap_options)
    weights = wrap_options.pop("weights", None)
    weights = directory if weights is None else weights
    try:
        return wrap(model, weights=weights, **wrap_options)
    except OffloadConfigError as error:
        hint = _mismatch_hint(model, weights, str(error))
        if hint:
            raise OffloadConfigError(f"{error} ({hint})") from error
        raise


def build_empty(config: Any, model_class: Optional[Any] = None) -> nn.Module:
    """The model `config` describes, its parameters on the meta device in float32, its buffers real, tied
    weights tied (`lm_head.weight is model.embed_tokens.weight` when `config.tie_word_embeddings`)."""
    transformers, accelerate = require_transformers()
    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    make = getattr(cls, "from_config", None)  # the Auto classes
    if make is None:
        make = getattr(cls, "_from_config", None)  # a model class (PreTrainedModel)
    if make is None:
        raise OffloadConfigError(f"model_class={cls!r} is neither a transformers Auto class nor a PreTrainedModel")
    with accelerate.init_empty_weights():
        model = _call_with_dtype(make, config, torch.float32)
    # Tied after the context: init_empty_weights re-creates every parameter assigned inside it (its
    # register_parameter hook), so a tie made there is two parameters. transformers ties on load; the meta
    # model needs it now, or the checkpoint's one copy of a tied weight leaves the other name missing.
    model.tie_weights()
    return model


def _call_with_dtype(make: Callable[..., PreTrainedModel], config: Any, dtype: torch.dtype) -> PreTrainedModel:
    try:
        return make(config, dtype=dtype)  # transformers >= 4.56
    except TypeError as error:
        if "dtype" not in str(error):
            raise
        return make(config, torch_dtype=dtype)  # older releases


def _local_directory(path: Union[str, "os.PathLike[str]"]) -> str:
    """`path` itself when it is a directory; else the local cache's snapshot of the hub id `path`."""
    text = os.fspath(path)
    if os.path.isdir(text):
        return os.path.abspath(text)
    if os.path.exists(text):
        raise OffloadConfigError(f"{text!r} is a file: pass the directory save_pretrained wrote")
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise OffloadConfigError(f"{text!r} does not exist (a local directory, or a hub id in the local cache)")
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(text, local_files_only=True))  # never downloads
    except Exception as error:  # LocalEntryNotFoundError and friends
        raise OffloadConfigError(f"{text!r} is not a local directory, nor a hub id in the local Hugging Face cache "
                                 f"({type(error).__name__}); offload downloads nothing: "
                                 f"`huggingface-cli download {text}` first, or pass its directory") from error


def _hf_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """`model._init_weights(module)`, as transformers initializes a new model module by module; then a norm layer
    it left alone gets weight 1 and bias 0 (transformers 5's rule; before 5 the norms kept the ones and zeros
    their `__init__` wrote, which a meta model does not have)."""

    def init(module: nn.Module) -> None:
        model._init_weights(module)  # type: ignore[operator]
        if type(module).__name__.endswith("Norm"):
            with torch.no_grad():
                for key, value in (("weight", 1.0), ("bias", 0.0)):
                    param = own_parameters(module).get(key)
                    if param is not None and param.is_floating_point() and bool(param.isnan().all()):
                        param.fill_(value)

    return init


def _checked_init(init: Any) -> Callable[[nn.Module], None]:
    if not callable(init):
        raise OffloadConfigError(f"init must be 'hf' (transformers' own initialization) or a function of one "
                                 f"module, got {init!r}")
    return init


def _mismatch_hint(model: nn.Module, weights: Any, message: str) -> str:
    """Why a checkpoint that transformers would load does not match: a base-model prefix added or dropped,
    or a model type whose checkpoints transformers converts on load."""
    if "does not match the model" not in message:
        return ""
    from offload.checkpoint.weight_source import WeightSource

    try:
        stored = WeightSource(weights).names()
    except Exception:
        return ""
    wanted = list(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "") or ""
    hints = []
    if prefix:
        dotted = prefix + "."
        if stored and all(n.startswith(dotted) for n in stored) and not any(n.startswith(dotted) for n in wanted):
            hints.append(f"the checkpoint's names start with {dotted!r}, the model's do not: it holds a model with a "
                         "head; pass the model_class it was saved from (e.g. AutoModelForCausalLM)")
        elif wanted and any(n.startswith(dotted) for n in wanted) and not any(n.startswith(dotted) for n in stored):
            hints.append(f"the model's names start with {dotted!r}, the checkpoint's do not: it holds the base model "
                         "(transformers adds the prefix on load, offload reads names as stored); pass "
                         "model_class=transformers.AutoModel or re-save it with the head")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        converted = model_type is not None and get_checkpoint_conversion_mapping(model_type)
    except Exception:
        converted = None
    if converted:
        hints.append(f"transformers converts {model_type!r} checkpoints on load (renamed or fused tensors); offload "
                     "reads tensors as stored, so such a checkpoint must first be re-saved by this transformers")
    return "; ".join(hints)
