"""The Engine: the user's model with its parameters in flat per-block buffers and AdamW run per block.

Setup and the public API only. Forward and backward are the model's own; hooks (scheduler/hooks.py) call
the step's phases (scheduler/pipeline.py), which make each block's weights ready before use, move each
gradient off the device as autograd produces it, and run each block's update on a background worker, so
`step()` may return before all blocks are updated: the next use of a block waits for that block only.
docs/design.md starts with a map of the layers and the path of one gradient.
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from offload._system import usable_cores
from offload.checkpoint import load_checkpoint, save_checkpoint
from offload.checkpoint.sharded import save_parts
from offload.distributed.data_parallel import DataParallel
from offload.distributed.guard import refuse_data_parallel_wrapper
from offload.engine.release import EngineRelease
from offload.scheduler.blocks.wrapped_mark import MARKER
from offload.errors import OffloadConfigError, OffloadError
from offload.param_groups import optimizer_groups
from offload.planner import Plan
from offload.policy import OffloadPolicy
from offload.scheduler.blocks.block import Block, FlatGroup, build_blocks, mixed_dtype_hint, param_owners
from offload.scheduler.phases.hooks import HookSet
from offload.scheduler.setup.initial_weights import InitialWeights, choose
from offload.scheduler.phases.pipeline import StepPipeline
from offload.scheduler.setup.placement import materialize, plan_and_open
from offload.scheduler.records.runtime import GroupState
from offload.trace import PhaseObserver, Tracer

class Engine:
    """Trains `module` with AdamW, its optimizer state placed per `policy`. Made by `offload.wrap`.

    Use it as the model (`loss = engine(batch)`), call `loss.backward()`, `engine.step()`,
    `engine.zero_grad()`. `engine.module` is the user's model (parameter identity kept), `engine.optimizer` a
    torch Optimizer whose `param_groups` changes take effect, `engine.plan` the placement table. It is the
    `offload.checkpoint.target.CheckpointTarget` that `save` and `load` work on.
    """

    def __init__(self, module: nn.Module, policy: OffloadPolicy, initial: Optional[InitialWeights] = None) -> None:
        if not isinstance(module, nn.Module):
            raise OffloadConfigError(f"offload.wrap needs a torch.nn.Module, got {type(module).__name__}")
        refuse_data_parallel_wrapper(module)
        _refuse_wrapped(module)
        # several processes under torch.distributed: train data-parallel (data_parallel.py)
        self.data_parallel: Optional[DataParallel] = DataParallel.from_environment()
        dp = self.data_parallel
        self.module = module
        self.policy = policy
        self.blocks: List[Block] = build_blocks(module, policy.dtype, allow_meta=True)
        initial = initial if initial is not None else choose(module, None, None)
        initial.check(module, self.blocks)  # names, shapes, meta buffers: before any memory or file
        trainable = [s.param for b in self.blocks for s in b.slots if s.trainable]
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        groups = optimizer_groups(policy.param_groups, trainable, names)
        tracer = Tracer()
        self.plan: Plan
        self.plan, tiers = plan_and_open(self.blocks, policy, tracer, dp)
        try:
            materialize(self.blocks, module, self.plan, policy, tiers,
                        {p: i for i, g in enumerate(groups) for p in g["params"]}, initial, dp)
            if tiers.ring is not None:
                tiers.ring.drain()
        except BaseException:
            tiers.close()  # nothing of a failed wrap() stays on disk
            raise
        cores = usable_cores() // (1 if dp is None else dp.local_world)  # the ranks of one machine share its cores
        self._pipeline = StepPipeline(self.blocks, module, policy, tiers, tracer,
                                      max(1, cores // 2) if policy.device.type == "cpu" else max(1, cores), groups, dp)
        self.optimizer = self._pipeline.optimizer
        self._hooks = HookSet()
        self._hooks.attach(module, self.blocks, param_owners(module), self._pipeline)
        mark = weakref.ref(self)
        setattr(module, MARKER, mark)
        self._release = EngineRelease(self._pipeline, self._hooks, self.blocks, module, mark)
        # [Note: an engine dropped without close()] last: released as close() would when collected. Not at
        # interpreter exit: the worker and the swap store stop and delete on their own then, without the
        # cost of bringing every streamed weight back into a model about to vanish.
        self._dropped = weakref.finalize(self, self._release.dropped)
        self._dropped.atexit = False

    # ----- training ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The wrapped model's forward."""
        self._pipeline.check_open()
        self._pipeline.worker.raise_if_failed()
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as exc:
            hint = mixed_dtype_hint(exc, self.policy.dtype, self.policy.device, self.blocks)
            if hint is None:
                raise
            raise OffloadError(hint) from exc

    def step(self) -> None:
        """Apply AdamW to every block (through `engine.optimizer.step()`, so LR schedulers see it)."""
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients, as `torch.optim.Optimizer.zero_grad`."""
        self.optimizer.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the gradients the engine holds (torch's own cannot see them:
        `param.grad` is a stand-in that raises when read). Call it between backward and `step()`; returns the
        total norm before clipping, as torch's does. `foreach` is accepted for torch's signature and unused."""
        return torch.tensor(self._pipeline.clip_grad_norm(max_norm, norm_type, error_if_nonfinite))

    def synchronize(self) -> None:
        """Wait for every pending block update, so that the module's weights are the current ones."""
        self._pipeline.check_open()
        self._pipeline.synchronize()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The model's state dict as full, real CPU tensors (copies), with all updates applied."""
        self.synchronize()
        streamed = {}
        for block in self.blocks:
            if block.runtime is not None and block.runtime.streamed:
                for group in block.groups:
                    host = self.group_weights(group)
                    for slot in group.slots:
                        streamed[id(slot.param)] = host[slot.offset:slot.offset + slot.numel].view(slot.shape)
        with self._pipeline.engine_reads():
            entries = self.module.state_dict(keep_vars=True)
        return {k: (streamed[id(v)] if id(v) in streamed else v.detach()).to("cpu", copy=True)
                for k, v in entries.items()}

    def stats(self) -> Dict[str, float]:
        """Counters since `wrap()`: steps, skipped steps, block updates (and how many ran during backward),
        bytes moved per link, seconds in forward and backward, seconds spent updating (worker) and waiting
        for updates (training thread), the nvme ring's disk waits, device-tier bytes."""
        return self._pipeline.stats()

    def add_observer(self, observer: PhaseObserver) -> Callable[[], None]:
        """Tell `observer.on_span(name, detail, start, end)` of every span the engine runs (step(), each
        block's update and the waits for it, disk waits; scheduler/trace.py); returns its remover."""
        return self._pipeline.tracer.add(observer)

    # ----- checkpoints (offload.checkpoint.target.CheckpointTarget) ------------------------------------
    def save(self, path: str, *, scheduler: Any = None, data: Any = None, rng: bool = False,
             progress: Optional[bool] = None) -> str:
        """Save weights (`model.safetensors`, readable without offload), optimizer state, step counters and,
        when given, the LR scheduler's, the data stream's (`data`: an `offload.data.TokenWindows` or anything
        with state_dict/load_state_dict) and the RNG states into directory `path`, atomically: a kill at any
        moment leaves the previous checkpoint or the new one. Streams one flat group at a time."""
        self._pipeline.check_open()
        with self._pipeline.engine_reads():  # the writer reads module.state_dict() for the entries' names
            if self.data_parallel is not None:  # every rank its part, committed together (checkpoint/sharded.py)
                return save_parts(self, self.data_parallel, path, _stateful(scheduler, data), rng, progress)
            return save_checkpoint(self, path, stateful=_stateful(scheduler, data), rng=rng, progress=progress)

    def save_pretrained(self, path: str, max_shard_size: Any = "5GB", *, progress: Optional[bool] = None) -> str:
        """Export the trained weights for `from_pretrained`, as transformers' `save_pretrained` lays them out:
        `model.safetensors`, or shards of at most `max_shard_size` (an int or "5GB", "500MB") with
        `model.safetensors.index.json`, plus `config.json` when the module is a Hugging Face model. Each
        tensor keeps the dtype it has in the engine; names are `module.state_dict()`'s, a tied weight is
        stored once. Streams one flat group at a time; each shard appears whole or not at all. No optimizer
        state: that is `save`. Data-parallel: rank 0 writes (every rank holds the same weights). Returns the directory's absolute path (checkpoint/export.py)."""
        from offload.checkpoint.export import export_pretrained

        self._pipeline.check_open()
        if self.data_parallel is not None and self.data_parallel.rank != 0:
            self.synchronize()
            return os.path.abspath(os.fspath(path))  # every rank holds the same weights: rank 0 writes them
        with self._pipeline.engine_reads():  # the exporter reads module.state_dict() for the names
            return export_pretrained(self, path, max_shard_size, progress)

    def load(self, path: str, *, scheduler: Any = None, data: Any = None, rng: bool = False,
             progress: Optional[bool] = None) -> dict:
        """Load a checkpoint saved by any tier (keyed by parameter names); training then continues exactly as
        it would have. Damaged or missing files raise OffloadIntegrityError naming the file and block, and
        leave the engine as it was: every tensor is verified in a first pass before anything changes."""
        self._pipeline.check_open()
        if self.data_parallel is None:
            with self._pipeline.replacing_state():
                return load_checkpoint(self, path, stateful=_stateful(scheduler, data), rng=rng, progress=progress)
        failure: Optional[BaseException] = None
        manifest: dict = {}
        try:
            with self._pipeline.replacing_state():
                manifest = load_checkpoint(self, path, stateful=_stateful(scheduler, data), rng=rng, progress=progress)
        except Exception as exc:  # noqa: BLE001 - raised below, after every rank knows
            failure = exc
        failed = [(rank, err) for rank, err in enumerate(self.data_parallel.all_gather_object(
            None if failure is None else f"{type(failure).__name__}: {failure}")) if err is not None]
        if failure is not None:
            raise failure
        if failed:  # another rank could not load: this one would train on with other weights than it
            error = OffloadError(f"rank {failed[0][0]} failed to load checkpoint {path!r} ({failed[0][1]}); "
                                 "every rank must load the same checkpoint: fix that and load again")
            self.mark_inconsistent(error)
            raise error
        return manifest

    def checkpoint_groups(self) -> Iterator[Tuple[Block, FlatGroup, Optional[GroupState]]]:
        self.synchronize()
        self._pipeline.weights.adopt_all()  # the saved master weights are the ones the model holds
        for block in self.blocks:
            assert block.runtime is not None
            for runtime in block.runtime.groups:
                yield block, runtime.group, runtime.state

    def group_weights(self, group: FlatGroup) -> torch.Tensor:
        assert group.runtime is not None
        return group.runtime.home.host_weights()

    def set_group_weights(self, group: FlatGroup, flat: torch.Tensor) -> None:
        assert group.runtime is not None
        with torch.no_grad():
            group.runtime.replace_weights(flat)
        assert group.runtime.block.runtime is not None
        group.runtime.block.runtime.needs_push = False  # the device has the new weights, or fetches them

    def prepare_for_load(self) -> None:
        self._pipeline.tracker.end_step()
        self._pipeline.reset_step()  # first: the load replaces whatever a step in progress did
        self.zero_grad()

    def mark_inconsistent(self, exc: BaseException) -> None:
        self._pipeline.worker.fail(exc)

    def checkpoint_counters(self) -> Dict[str, int]:
        stats = self.stats()
        return {"steps": int(stats["steps"]), "skipped_steps": int(stats["skipped_steps"])}

    def restore_counters(self, counters: Dict[str, int]) -> None:
        self._pipeline.restore_counters(counters["steps"], counters["skipped_steps"])

    # ----- end ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish pending updates, remove every hook, bring streamed weights back and free the optimizer
        state: the module stays usable as a plain PyTorch model with its trained weights. Idempotent.
        An update that failed and was not reported yet, or an I/O error met while closing, is raised once,
        after the cleanup: the hooks, the swap file and the model's mark are gone even then. An engine
        dropped without close() is released the same way when it is collected (errors then warn)."""
        self._dropped.detach()
        self._release.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine(tier={self.policy.tier.value}, blocks={len(self.blocks)}, device={self.policy.device})"


def _stateful(scheduler: Any, data: Any) -> Dict[str, Any]:
    """The objects saved and loaded beside the engine through their state_dict(), by keyword."""
    given = {"scheduler": scheduler, "data": data}
    for kind, obj in given.items():
        if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise OffloadConfigError(f"{kind}={type(obj).__name__} has no state_dict()/load_state_dict(); pass an "
                                     f"object that has both (an LR scheduler, an offload.data.TokenWindows)")
    return {kind: obj for kind, obj in given.items() if obj is not None}


def _refuse_wrapped(module: nn.Module) -> None:
    """A model (or a sub-module) already wrapped by a live engine is refused. An engine dropped but still in
    an uncollected reference cycle is not live: one collection releases it (and removes its mark) first."""
    for collected in (False, True):
        wrapped = [(name, sub) for name, sub in module.named_modules()
                   if getattr(sub, MARKER, None) is not None and getattr(sub, MARKER)() is not None]
        if not wrapped:
            return
        if not collected:
            gc.collect()
    name, sub = wrapped[0]
    what = "this model is" if sub is module else f"its sub-module {name!r} is"
    raise OffloadConfigError(f"{what} already wrapped by an offload engine; call engine.close() on that engine "
                             "before wrapping again (wrap the outer model only)")


__all__ = ["Engine"]
