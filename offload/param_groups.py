"""`offload.wrap(..., param_groups=[...])`: AdamW options per group of parameters, as torch.optim takes them.

The common case is weight decay on matrices only: `[{"params": no_decay, "weight_decay": 0.0}]`. Groups are
parsed once into `GroupOptions` (known keys, valid numbers) at `wrap()`; the engine then checks membership
against the model (every listed parameter is the model's and is listed once) and puts every trainable
parameter not listed into a last group with `wrap()`'s own options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from offload.errors import OffloadConfigError

GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class GroupOptions:
    """One user group: its parameters (the model's own objects) and the options it overrides."""

    params: Tuple[nn.Parameter, ...]
    options: Tuple[Tuple[str, Any], ...]


def parse_param_groups(groups: Optional[Sequence[Dict[str, Any]]]) -> Tuple[GroupOptions, ...]:
    """Validate the user's list of dicts; None means one group with `wrap()`'s options."""
    if groups is None:
        return ()
    if isinstance(groups, dict) or not isinstance(groups, (list, tuple)):
        raise OffloadConfigError("param_groups must be a list of dicts like [{'params': [...], 'weight_decay': 0.0}]")
    parsed = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise OffloadConfigError(f"param_groups[{i}] must be a dict with a 'params' list")
        unknown = sorted(set(group) - {"params", *GROUP_KEYS})
        if unknown:
            raise OffloadConfigError(f"param_groups[{i}] has unknown option(s) {', '.join(map(repr, unknown))}; "
                                     f"valid: params, {', '.join(GROUP_KEYS)}")
        params = group["params"]
        params = (params,) if isinstance(params, nn.Parameter) else tuple(params)
        if not all(isinstance(p, nn.Parameter) for p in params):
            raise OffloadConfigError(f"param_groups[{i}]['params'] must hold the model's nn.Parameter objects")
        options = []
        for key in GROUP_KEYS:
            if key in group:
                options.append((key, _checked(i, key, group[key])))
        parsed.append(GroupOptions(params, tuple(options)))
    return tuple(parsed)


def _checked(index: int, key: str, value: Any) -> Any:
    where = f"param_groups[{index}][{key!r}]"
    if key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise OffloadConfigError(f"{where} must be a pair (beta1, beta2), got {value!r}")
        for beta in value:
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
                raise OffloadConfigError(f"{where} must hold numbers in [0, 1), got {value!r}")
        return (float(value[0]), float(value[1]))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise OffloadConfigError(f"{where} must be a number >= 0, got {value!r}")
    return float(value)


def optimizer_groups(groups: Tuple[GroupOptions, ...], trainable: Iterable[nn.Parameter],
                     names: Dict[int, str]) -> List[Dict[str, Any]]:
    """torch.optim-style groups over the model's trainable parameters: the user's groups in order (frozen
    parameters in them dropped, as AdamW never updates them), then one with every trainable parameter not
    listed. `names` (id -> qualified name) makes the errors say which parameter is wrong."""
    trainable = list(trainable)
    trainable_ids = {id(p) for p in trainable}
    seen: Dict[int, int] = {}
    out: List[Dict[str, Any]] = []
    for i, group in enumerate(groups):
        params = []
        for p in group.params:
            if id(p) not in names:
                raise OffloadConfigError(f"param_groups[{i}] lists a parameter of shape {tuple(p.shape)} that is not "
                                         "in the wrapped model (build the groups from model.named_parameters())")
            if id(p) in seen:
                raise OffloadConfigError(f"parameter {names[id(p)]!r} is in param_groups[{seen[id(p)]}] and "
                                         f"param_groups[{i}]; list each parameter once")
            seen[id(p)] = i
            if id(p) in trainable_ids:
                params.append(p)
        out.append(dict(group.options, params=params))
    rest = [p for p in trainable if id(p) not in seen]
    if rest or not out:
        out.append({"params": rest})
    return out
