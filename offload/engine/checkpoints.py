"""`EngineCheckpoints`: the `CheckpointTarget` (checkpoint/target.py) of one engine, an adapter.

The checkpoint code reads and replaces an engine's state through these names only; they are not methods of
the user-facing `Engine`, whose API stays what users call. Made by the Engine, holding what the checkpoint
code needs of it: the module, the policy, the optimizer, the blocks and the step's narrow face.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from offload.checkpoint.target import GroupStateView
from offload.policy import OffloadPolicy
from offload.scheduler.blocks.block import Block, FlatGroup
from offload.scheduler.phases.pipeline import StepPipeline


class EngineCheckpoints:
    def __init__(self, module: nn.Module, policy: OffloadPolicy, optimizer: torch.optim.Optimizer,
                 pipeline: StepPipeline) -> None:
        self.module = module
        self.policy = policy
        self.optimizer = optimizer
        self._pipeline = pipeline

    def checkpoint_groups(self) -> Iterator[Tuple[Block, FlatGroup, Optional[GroupStateView]]]:
        self._pipeline.synchronize()
        self._pipeline.keep_all_writes()  # the saved master weights are the ones the model holds
        for record in self._pipeline.records:
            for group in record.groups:
                yield record.block, group.group, group.state

    def group_weights(self, group: FlatGroup) -> torch.Tensor:
        return self._pipeline.group_record(group).home.host_weights()

    @property
    def weights_gathered(self) -> bool:
        return self._pipeline.weights_sharded

    def set_group_weights(self, group: FlatGroup, flat: torch.Tensor) -> None:
        self._pipeline.replace_group_weights(group, flat)

    def prepare_for_load(self) -> None:
        self._pipeline.prepare_for_load()

    def mark_inconsistent(self, exc: BaseException) -> None:
        self._pipeline.mark_inconsistent(exc)

    def checkpoint_counters(self) -> Dict[str, int]:
        return self._pipeline.counters()

    def restore_counters(self, counters: Dict[str, int]) -> None:
        self._pipeline.restore_counters(counters["steps"], counters["skipped_steps"])
