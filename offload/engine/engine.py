"""The Engine: the user's model with its parameters in flat per-block buffers and AdamW run per block.

Setup and the public API only. Forward and backward are the model's own; hooks (scheduler/phases/hooks.py)
call the step's phases (scheduler/phases/), which make each block's weights ready before use, move each
gradient off the device as autograd produces it, and run each block's update on a background worker, so
`step()` may return before all blocks are updated: the next use of a block waits for that block only. The
Engine reaches the step only through `StepPipeline`'s methods. docs/design.md starts with a map of the
layers and the path of one gradient.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn

from offload._system import usable_cores
from offload.checkpoint import load_checkpoint, save_checkpoint
from offload.checkpoint.load_weights import Read, load_weights
from offload.checkpoint.sharded import save_parts
from offload.distributed.agreement import ranks_agree_at_wrap
from offload.distributed.data_parallel import DataParallel
from offload.distributed.guard import refuse_data_parallel_wrapper
from offload.engine.checkpoints import EngineCheckpoints
from offload.engine.release import EngineRelease
from offload.engine.torch_state import TorchStyleState
from offload.errors import OffloadConfigError, OffloadError
from offload.param_groups import optimizer_groups
from offload.planner.plan import Plan
from offload.policy import OffloadPolicy
from offload.scheduler.blocks.block import MARKER, Block, build_blocks, mixed_dtype_hint, param_owners
from offload.scheduler.records.block_record import BlockRecord
from offload.scheduler.setup.assemble import assemble
from offload.scheduler.setup.initial_weights import InitialWeights, choose
from offload.scheduler.setup.placement import plan_and_open
from offload.trace import PhaseObserver, Tracer


class Engine:
    """Trains `module` with AdamW, its optimizer state placed per `policy`. Made by `offload.wrap`.

    Use it as the model (`loss = engine(batch)`), call `loss.backward()`, `engine.step()`,
    `engine.zero_grad()`. `engine.module` is the user's model (parameter identity kept), `engine.optimizer` a
    torch Optimizer whose `param_groups` changes take effect, `engine.plan` the placement table. `save` and
    `load` work on its `CheckpointTarget` adapter (engine/checkpoints.py).
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
        with ranks_agree_at_wrap(dp, policy, module):  # the same model and options on every rank, else all raise
            self.blocks: List[Block] = build_blocks(module, policy.dtype, allow_meta=True)
            initial = initial if initial is not None else choose(module, None, None)
            initial.check(module, self.blocks)  # names, shapes, meta buffers: before any memory or file
        # in model.parameters() order, as torch.optim.AdamW(model.parameters()) numbers them in its state dict
        in_blocks = {s.param for b in self.blocks for s in b.slots if s.trainable}
        trainable = [p for p in module.parameters() if p in in_blocks]
        names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        groups = optimizer_groups(policy.param_groups, trainable, names)
        tracer = Tracer()
        self._plan, tiers = plan_and_open(self.blocks, policy, tracer, dp)
        cores = usable_cores() // (1 if dp is None else dp.local_world)  # the ranks of one machine share its cores
        threads = max(1, cores // 2) if policy.device.type == "cpu" else max(1, cores)
        try:
            self._pipeline = assemble(self.blocks, module, policy, self._plan, tiers, tracer, groups, initial,
                                      threads, dp)
        except BaseException:
            tiers.close()  # nothing of a failed wrap() stays on disk
            raise
        self.optimizer = self._pipeline.optimizer
        self._checkpoints = EngineCheckpoints(module, policy, self.optimizer, self._pipeline)
        self._pipeline.optimizer.keep_state_with(TorchStyleState(self._checkpoints, dp))
        self._hooks = self._pipeline.attach_hooks(module, param_owners(module))
        mark = weakref.ref(self)
        setattr(module, MARKER, mark)
        self._release = EngineRelease(self._pipeline, self._hooks, self.blocks, module, mark)
        # [Note: an engine dropped without close()] last: released as close() would when collected. Not at
        # interpreter exit: the worker and the swap store stop and delete on their own then, without the
        # cost of bringing every streamed weight back into a model about to vanish.
        self._dropped = weakref.finalize(self, self._release.dropped)
        self._dropped.atexit = False

    @property
    def plan(self) -> Plan:
        """Where each block's weights and state live; once a training forward has run, with what it saved for its
        backward (activations, measured) and how many tokens per micro-batch the device room holds."""
        use = self._pipeline.activation_use()
        return self._plan if use is None else dataclasses.replace(self._plan, activations=use)

    @property
    def records(self) -> List[BlockRecord]:
        """Each block's runtime record, by block index (`engine.blocks[i]`'s is `engine.records[i]`): for tests and
        measurements that look inside; empty once closed."""
        return self._pipeline.records

    @property
    def weights_sharded(self) -> bool:
        """Whether each data-parallel rank keeps a part of the weights (`shard_weights`): reading them outside a
        forward (state_dict, save, save_pretrained) is then a collective that every rank makes."""
        return self._plan.shard_world > 1

    # ----- training ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward."""
        self._pipeline.check_usable()
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as exc:
            hint = mixed_dtype_hint(exc, self.policy.dtype, self.policy.device, self.blocks)
            if hint is None:
                raise
            raise OffloadError(hint) from exc

    def step(self) -> Optional[float]:
        """Apply AdamW to every block (through `engine.optimizer.step()`, so LR schedulers see it). Returns the
        global gradient norm before clipping that `max_grad_norm` clipped with (as `clip_grad_norm_` returns
        it, for logging; also `stats()["grad_norm"]`), None without `max_grad_norm`."""
        self.optimizer.step()
        return self._pipeline.grad_norm() if self.policy.max_grad_norm is not None else None

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
        self._pipeline.synchronize()

    def state_dict(self, names: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
        """The model's state dict as full, real CPU tensors (copies), with all updates applied; `names`: only
        these entries (a streamed block is read from its home only when it holds one of them)."""
        self.synchronize()
        with self._pipeline.engine_reads():
            entries = self.module.state_dict(keep_vars=True)
        if names is not None:
            wanted = set(names)
            unknown = sorted(wanted - set(entries))
            if unknown:
                raise OffloadConfigError(f"engine.state_dict(names=...): {', '.join(map(repr, unknown[:5]))} "
                                         "not in module.state_dict(); pass names of its entries")
            entries = {k: v for k, v in entries.items() if k in wanted}
        needed = {id(v) for v in entries.values()}
        streamed = {}  # values read from the groups' homes: streamed blocks', and with `names` every group's
        streamed_blocks = set(self._plan.streamed_blocks)
        for block in self.blocks:
            if names is None and block.name not in streamed_blocks:
                continue
            for group in block.groups:
                if not any(id(slot.param) in needed for slot in group.slots):
                    continue
                host = self._checkpoints.group_weights(group)
                for slot in group.slots:
                    streamed[id(slot.param)] = host[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return {k: (streamed[id(v)] if id(v) in streamed else v.detach()).to("cpu", copy=True)
                for k, v in entries.items()}

    def load_weights(self, reads: Mapping[str, Read]) -> int:
        """New weights for the entries named (state-dict name -> (source, name in it): a checkpoint file's, read
        block by block) on every tier and with streamed blocks, the Adam state kept, as `model.load_state_dict`
        keeps torch AdamW's; returns how many entries were loaded (checkpoint/load_weights.py). For integrations
        that load a format of their own (the Trainer's `checkpoint-N`, accelerate's `save_state`)."""
        return load_weights(self._checkpoints, reads)

    def step_counts(self) -> Dict[str, int]:
        """`steps` and `skipped_steps` as a checkpoint keeps them."""
        return self._checkpoints.checkpoint_counters()

    def restore_step_counts(self, steps: int, skipped_steps: int) -> None:
        """A checkpoint's step counts (an integration's own format: `engine.load` restores them itself)."""
        self._checkpoints.restore_counters({"steps": steps, "skipped_steps": skipped_steps})

    def reading_module_state(self) -> ContextManager[None]:
        """Within it, `module.state_dict()` returns the parameters' views as they are, without the copies it
        makes otherwise (streamed blocks' entries then read through, each bringing its block in for that read).
        For code that reads the entries' names, or their values one at a time, as PEFT's `save_pretrained`
        does."""
        return self._pipeline.engine_reads()

    def stats(self) -> Dict[str, float]:
        """Counters since `wrap()`: steps, skipped steps, block updates (and how many ran during backward, how many
        speculatively with clipping, and of those how many `step()` kept or redid),
        bytes moved per link, seconds in forward and backward, seconds spent updating (worker) and waiting
        for updates (training thread), the nvme ring's disk waits, device-tier bytes; under several processes,
        the bytes the collectives brought this rank (`bytes_weights_*`, `bytes_grads_*`), from ranks on this
        machine and on others."""
        out = self._pipeline.stats()
        if self.data_parallel is not None:  # what the collectives brought, within and across machines
            out.update(self.data_parallel.traffic)
        return out

    def add_observer(self, observer: PhaseObserver) -> Callable[[], None]:
        """Tell `observer.on_span(name, detail, start, end)` of every span the engine runs (step(), each
        block's update and the waits for it, disk waits; offload/trace.py); returns its remover."""
        return self._pipeline.add_observer(observer)

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
                return save_parts(self._checkpoints, self.data_parallel, path, _stateful(scheduler, data), rng,
                                  progress)
            return save_checkpoint(self._checkpoints, path, stateful=_stateful(scheduler, data), rng=rng,
                                   progress=progress)

    def save_pretrained(self, path: str, max_shard_size: Any = "5GB", *, progress: Optional[bool] = None) -> str:
        """Export the trained weights for `from_pretrained`, as transformers' `save_pretrained` lays them out:
        `model.safetensors`, or shards of at most `max_shard_size` (an int or "5GB", "500MB") with
        `model.safetensors.index.json`, plus `config.json` when the module is a Hugging Face model. Each
        tensor keeps the dtype it has in the engine; names are `module.state_dict()`'s, a tied weight is
        stored once. Streams one flat group at a time; each shard appears whole or not at all. No optimizer
        state: that is `save`. Data-parallel: rank 0 writes; with sharded weights its reads are gathers, so every
        rank calls this (as `save`). Returns the directory's absolute path (checkpoint/export.py)."""
        from offload.checkpoint.export import export_pretrained, take_part_in_export

        self._pipeline.check_open()
        if self.data_parallel is not None and self.data_parallel.rank != 0:
            if self.weights_sharded:
                with self._pipeline.engine_reads():
                    take_part_in_export(self._checkpoints, max_shard_size)
            else:
                self.synchronize()
            return os.path.abspath(os.fspath(path))  # rank 0 writes
        with self._pipeline.engine_reads():  # the exporter reads module.state_dict() for the names
            return export_pretrained(self._checkpoints, path, max_shard_size, progress)

    def load(self, path: str, *, scheduler: Any = None, data: Any = None, rng: bool = False,
             progress: Optional[bool] = None) -> dict:
        """Load a checkpoint saved by any tier (keyed by parameter names); training then continues exactly as
        it would have. Damaged or missing files raise OffloadIntegrityError naming the file and block, and
        leave the engine as it was: every tensor is verified in a first pass before anything changes."""
        self._pipeline.check_open()
        if self.data_parallel is None:
            with self._pipeline.replacing_state():
                return load_checkpoint(self._checkpoints, path, stateful=_stateful(scheduler, data), rng=rng,
                                       progress=progress)
        failure: Optional[BaseException] = None
        manifest: dict = {}
        try:
            with self._pipeline.replacing_state():
                manifest = load_checkpoint(self._checkpoints, path, stateful=_stateful(scheduler, data), rng=rng,
                                           progress=progress)
        except Exception as exc:  # noqa: BLE001 - raised below, after every rank knows
            failure = exc
        failed = [(rank, err) for rank, err in enumerate(self.data_parallel.all_gather_object(
            None if failure is None else f"{type(failure).__name__}: {failure}")) if err is not None]
        if failure is not None:
            raise failure
        if failed:  # another rank could not load: this one would train on with other weights than it
            error = OffloadError(f"rank {failed[0][0]} failed to load checkpoint {path!r} ({failed[0][1]}); "
                                 "every rank must load the same checkpoint: fix that and load again")
            self._pipeline.mark_inconsistent(error)
            raise error
        return manifest

    # ----- end ---------------------------------------------------------------------------------------
    def close(self, restore_weights: bool = True) -> None:
        """Finish pending updates, remove every hook, bring streamed weights back and free the optimizer
        state: the module stays usable as a plain PyTorch model with its trained weights. Idempotent.
        An update that failed and was not reported yet, or an I/O error met while closing, is raised once,
        after the cleanup: the hooks, the swap file and the model's mark are gone even then. An engine
        dropped without close() is released the same way when it is collected (errors then warn).
        `restore_weights=False` leaves the streamed blocks' parameters as the placeholders they are while
        training: for a model larger than RAM, which cannot come back whole (save a checkpoint first)."""
        self._dropped.detach()
        self._release.close(restore_weights)

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
