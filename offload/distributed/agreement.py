"""wrap() refuses data-parallel ranks that disagree, on every rank, naming what differs and on which ranks.

The ranks pair their collectives one by one (the worker's per block, the gathers of sharded weights in forward
order), so ranks with another model, dtype or option would pair the wrong tensors (gloo aborts the process when
the sizes differ), wait for collectives the others never make (`max_grad_norm` on one rank: the norm's
all-reduce), or train other weights silently (another lr: each rank updates its own part of the state). At
`wrap()`, before anything is placed, `ranks_agree_at_wrap` all-gathers one small fingerprint a rank (the options
that must agree and a hash of the model's parameter and buffer names, shapes, dtypes and requires_grad; the
whole list only when the hashes differ) and raises `OffloadConfigError` on every rank with the differences. A rank
whose wrap() fails before that point still takes part, so the others raise naming it instead of waiting. Ranks
that compute on one GPU (no `torch.cuda.set_device(local_rank)`) are refused the same way, naming the local rank
each launcher gives (launchers.py). The
placement's own check (which blocks stream or sit on disk, the budgets: setup/placement.py) compares plans the
same way, with `refuse_differences`. See docs/design.md [Note: data-parallel mode].
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import socket
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload.errors import OffloadConfigError

if TYPE_CHECKING:
    from offload.distributed.data_parallel import DataParallel
    from offload.policy import OffloadPolicy

_SHOWN = 6  # differences named in a message
_PER_RANK = ("nvme_path", "device")  # may differ: each rank its own swap directory and device (its type must agree)
_SAME = ("Every rank must wrap the same model with the same options: the ranks pair their collectives block by "
         "block, and each updates its own part of the state (a rank with other options runs other collectives or "
         "trains other weights)")

Row = Tuple[str, str, str]  # (kind, name, what it is: dtype, shape, frozen)


@contextlib.contextmanager
def ranks_agree_at_wrap(dp: Optional["DataParallel"], policy: "OffloadPolicy", module: nn.Module) -> Iterator[None]:
    """Around the start of wrap() (the model cut into blocks, the start weights checked): afterwards, every rank
    compares its options and model with the others' (one all_gather_object), and all raise on any difference. A
    rank whose body failed reports its error to the others, which raise naming it; it re-raises its own."""
    if dp is None:
        yield
        return
    rows = model_rows(module)
    settings = policy_settings(policy, module)
    settings.update({" gpu": gpu_of(policy), " local rank": f"{dp.local_rank} ({dp.place})"})
    try:
        yield
    except Exception as exc:
        _compare(dp, settings, rows, f"{type(exc).__name__}: {exc}")
        raise
    _compare(dp, settings, rows, None)


def model_rows(module: nn.Module) -> List[Row]:
    """Every parameter (tied ones under each name) and buffer: what must be the same on every rank."""
    rows = [("parameter", name, _describe(p, p.requires_grad))
            for name, p in module.named_parameters(remove_duplicate=False)]
    rows += [("buffer", name, _describe(b, True)) for name, b in module.named_buffers(remove_duplicate=False)]
    return rows


def policy_settings(policy: "OffloadPolicy", module: nn.Module) -> Dict[str, str]:
    """wrap()'s options that must agree, as text: all but the swap directory and the device's index."""
    out = {f.name: _text(getattr(policy, f.name)) for f in dataclasses.fields(policy)
           if f.name not in _PER_RANK and f.name != "param_groups"}
    out["device"] = policy.device.type
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    out["param_groups"] = str(len(policy.param_groups))
    for i, group in enumerate(policy.param_groups):
        listed = [names.get(id(p), "(not in the model)") for p in group.params]
        out[f"param_groups[{i}]"] = f"{dict(group.options)} over {_short(listed)}"
    return out


def gpu_of(policy: "OffloadPolicy") -> str:
    """The GPU this rank computes on, as one identity across processes (its UUID: an index depends on each
    process's CUDA_VISIBLE_DEVICES), or "" on another device (or where CUDA does not say the UUID)."""
    if policy.device.type != "cuda":
        return ""
    index = policy.device.index if policy.device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"{uuid} (cuda:{index} of {socket.gethostname()})" if uuid is not None else ""


def shared_gpus(every: Sequence[Dict[str, str]]) -> Optional[str]:
    """Why the ranks cannot train where several compute on one GPU (each rank's `gpu_of` and local rank in
    `every`), naming the fix; None when each has its own."""
    ranks: Dict[str, List[int]] = {}
    for rank, theirs in enumerate(every):
        if theirs.get(" gpu"):
            ranks.setdefault(theirs[" gpu"], []).append(rank)
    shared = [(gpu, where) for gpu, where in ranks.items() if len(where) > 1]
    if not shared:
        return None
    gpu, where = shared[0]
    local = "; ".join(f"rank {r}: {every[r][' local rank']}" for r in where)
    return (f"{_ranks(where)} compute on the same GPU ({gpu}): each rank needs a GPU of its own. Call "
            "torch.cuda.set_device(local_rank) before offload.wrap(), or pass device=f'cuda:{local_rank}', with the "
            "local rank the launcher gives (the LOCAL_RANK variable of torchrun, accelerate launch, deepspeed and "
            "torch.distributed.launch, or the --local-rank / --local_rank argument of the legacy launchers; local "
            f"rank found by offload: {local})")


def refuse_differences(dp: "DataParallel", mine: Dict[str, str], what: str) -> None:
    """All-gather `mine` (name -> value as text) and raise on every rank naming each name whose value differs,
    with the ranks of each value."""
    every: List[Dict[str, str]] = list(dp.all_gather_object(mine))  # type: ignore[arg-type]
    differences = _differences(every)
    if differences:
        raise OffloadConfigError(f"the data-parallel ranks have different {what}: {'; '.join(differences)}. {_SAME}")


def _compare(dp: "DataParallel", settings: Dict[str, str], rows: List[Row], failure: Optional[str]) -> None:
    mine = dict(settings, **{" model": _digest(rows), " failure": failure or ""})
    every: List[Dict[str, str]] = list(dp.all_gather_object(mine))  # type: ignore[arg-type]
    failed = [(rank, theirs[" failure"]) for rank, theirs in enumerate(every) if theirs[" failure"]]
    if failed and failure is None:
        ranks = _ranks([rank for rank, _ in failed])
        raise OffloadConfigError(f"offload.wrap() failed on {ranks} ({failed[0][1]}); fix that and wrap again on every "
                                 "rank")
    if failed:
        return  # this rank raises its own error
    crowded = shared_gpus(every)
    if crowded is not None:
        raise OffloadConfigError(f"offload.wrap(): {crowded}")
    differences = _differences([{k: v for k, v in theirs.items() if not k.startswith(" ")} for theirs in every])
    if len({theirs[" model"] for theirs in every}) > 1:  # every rank knows: all exchange the whole lists
        everyone: List[List[Row]] = list(dp.all_gather_object(rows))  # type: ignore[arg-type]
        differences += _model_differences(everyone)
    if differences:
        shown = differences[:_SHOWN] + ([f"and {len(differences) - _SHOWN} more"] if len(differences) > _SHOWN else [])
        raise OffloadConfigError(f"offload.wrap() got different models or options on the data-parallel ranks: "
                                 f"{'; '.join(shown)}. {_SAME}")


def _differences(every: Sequence[Dict[str, str]]) -> List[str]:
    out = []
    for name in sorted(set().union(*every), key=lambda n: (n.startswith("param_groups"), n)):
        values = [theirs.get(name, "(none)") for theirs in every]
        if len(set(values)) > 1:
            out.append(f"{name}: {_by_value(values)}")
    return out


def _model_differences(everyone: List[List[Row]]) -> List[str]:
    by_rank = [{(kind, name): what for kind, name, what in rows} for rows in everyone]
    order: Dict[Tuple[str, str], None] = {}
    for rows in everyone:
        order.update(((kind, name), None) for kind, name, _ in rows)
    out = []
    for kind, name in order:
        values = [theirs.get((kind, name), "absent") for theirs in by_rank]
        if len(set(values)) > 1:
            out.append(f"{kind} {name!r} is {_by_value(values)}")
    return out


def _by_value(values: List[str]) -> str:
    """'a on rank 0, b on ranks 1-3', in order of the first rank of each value."""
    ranks: Dict[str, List[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on {_ranks(where)}" for value, where in ranks.items())


def _ranks(ranks: List[int]) -> str:
    spans: List[List[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _describe(tensor: torch.Tensor, trainable: bool) -> str:
    dtype = str(tensor.dtype).replace("torch.", "")
    return f"{dtype}{list(tensor.shape)}" + ("" if trainable else " (frozen)")


def _text(value: object) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    return repr(value) if isinstance(value, (float, int, tuple, type(None))) else str(value)


def _digest(rows: List[Row]) -> str:
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def _short(names: List[str]) -> str:
    return str(names) if len(names) <= 4 else f"{len(names)} parameters {names[:3]}..."
