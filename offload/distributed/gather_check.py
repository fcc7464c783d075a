"""Sharded weights: each gather is announced before it is issued, so ranks whose gathers went out of step raise,
on every rank and naming what each was doing, instead of pairing the wrong tensors.

Under `shard_weights` every forward, backward, `engine.state_dict()`, `save` and `save_pretrained` gathers the
weights: each is a collective. A rank that makes one alone (an evaluation or a save under `if rank == 0:`) pairs its
gathers with whatever the others gather next; gloo aborts the process (SIGABRT, "Received data size doesn't match")
when the sizes differ, and mixes blocks when they do not. So before each gather the ranks all-gather a header of
five integers (the gathers made so far, the group's layout key, its size, a read of the weights or a use, and
whether a backward runs) on a gloo group; any difference raises `OffloadError` on every rank, after a second
exchange of what each rank is doing (its outermost offload call: `engine.state_dict()`, a forward, ...), and every
later gather of the engine raises it again (nothing pairs any more). A forward made by one rank alone pairs with
the others' next forward (the same gathers; the streamer gathers under no_grad, so an evaluation's grad mode is
not seen) and goes apart at their backward. A rank left alone in the header (the others never gather) warns
after a minute (half the group's timeout when shorter) that it waits and why, and raises naming its call at the
process group's timeout. See docs/design.md [Note: sharded weights].
"""

from __future__ import annotations

import os
import sys
import warnings
import zlib
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from offload.errors import OffloadError
from offload.scheduler.torch_internals import group_timeout, is_backward

READ, USE = 1, 2  # the whole weights read on the host (state_dict, save, export), or gathered for compute
_WARN_AFTER = timedelta(seconds=60)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COLLECTIVES = ("Under shard_weights each rank keeps a part of the weights, so every forward, backward, "
                "engine.state_dict(), engine.save() and engine.save_pretrained() gathers them from all ranks: each "
                "is a collective that every rank must make, in the same order (an evaluation or a save under "
                "`if rank == 0:` is the usual cause: make the call on every rank; save_pretrained writes on rank 0 "
                "only)")


class GatherCheck:
    """The header exchange before each gather of one engine's sharded weights, on `group` (gloo)."""

    def __init__(self, world: int, rank: int, group: object) -> None:
        self.world = world
        self.rank = rank
        self.group = group
        self.gathers = 0  # announced so far: the same count on every rank while they agree
        self.failure: Optional[str] = None  # the ranks went out of step (or one was left alone): no gather pairs
        timeout = group_timeout(group)
        self.timeout = timeout
        self.warn_after = _WARN_AFTER if timeout is None else min(_WARN_AFTER, timeout / 2)

    def announce(self, key: str, numel: int, kind: int) -> None:
        """Before a gather of the group `key` (`numel` elements) for `kind`: raise unless every rank announces the
        same gather."""
        if self.failure is not None:
            raise OffloadError(self.failure)
        mine = torch.tensor([self.gathers, zlib.crc32(key.encode()), numel, kind, int(is_backward())],
                            dtype=torch.int64)
        every = torch.empty(self.world * mine.numel(), dtype=torch.int64)
        self._exchange(every, mine, key, kind)
        self.gathers += 1
        rows = every.view(self.world, -1).tolist()
        if any(row != rows[0] for row in rows):
            self._raise_out_of_step(key, kind, rows)

    def _exchange(self, every: torch.Tensor, mine: torch.Tensor, key: str, kind: int) -> None:
        """The header's all-gather; a wait longer than `warn_after` warns, a failure (the group's timeout, a rank
        gone) raises naming this rank's call."""
        try:
            work = dist.all_gather_into_tensor(every, mine, group=self.group, async_op=True)
            assert work is not None
            try:
                work.wait(self.warn_after)
            except RuntimeError:  # still waiting: say why, then wait on (gloo keeps the operation)
                warnings.warn(f"offload: rank {self.rank} has waited {self.warn_after} for the other ranks to gather "
                              f"block {_block(key)!r} with it for {doing(kind)}; if they never make this call, it "
                              f"waits until the process group's timeout ({self.timeout}). {_COLLECTIVES}",
                              RuntimeWarning, stacklevel=2)
                sys.stderr.flush()
                work.wait()
        except RuntimeError as exc:
            self.failure = (f"rank {self.rank} waited in {doing(kind)} for the other ranks to gather block "
                            f"{_block(key)!r} with it, and they did not ({_first_line(exc)}: the process group's "
                            f"timeout is {self.timeout}). {_COLLECTIVES}")
            raise OffloadError(self.failure) from exc

    def _raise_out_of_step(self, key: str, kind: int, rows: List[List[int]]) -> None:
        mine = f"{doing(kind)} (block {_block(key)!r}, gather {rows[self.rank][0] + 1})"
        every: List[Optional[str]] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        sides = "; ".join(f"rank {rank}: {what}" for rank, what in enumerate(every))
        backward = [row[4] for row in rows]
        hint = (" A forward against a backward: a rank made a forward the others did not." if any(backward)
                and not all(backward) else "")
        self.failure = f"the data-parallel ranks' weight gathers went out of step ({sides}).{hint} {_COLLECTIVES}"
        raise OffloadError(self.failure)


def doing(kind: int) -> str:
    """What this rank is doing, in the user's words: its outermost call into offload when that is a method of the
    engine other than its forward, else a forward or a backward."""
    outer = None
    frame = sys._getframe(1)
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
            outer = frame.f_code
        frame = frame.f_back  # type: ignore[assignment]
    name = getattr(outer, "co_qualname", getattr(outer, "co_name", "")) if outer is not None else ""
    if name.startswith("Engine.") and not name.startswith("Engine.__"):
        return f"engine.{name.split('.', 1)[1]}()"
    if kind == READ:
        return f"a read of the whole weights ({name or 'outside a forward'})"
    return "a backward" if is_backward() else "a forward"


def _block(key: str) -> str:
    return key.rsplit("/", 1)[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
