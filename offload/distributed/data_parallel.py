"""Data-parallel training over torch.distributed: which rank owns which part of each flat group, and the
collectives a block's update runs (torch's own: gloo on the CPU, NCCL on a GPU; no transport of ours).

Every rank keeps the whole compute weights, unless they are sharded (`shard_weights`: each rank keeps a part of
every group, `weight_part`, gathered whole for each use by `gather_weights`; its state part is the trainable
elements of that part, so the update writes the rank's own weights and nothing is gathered after it). A group's trainable range `[0, n)` is cut into `world` equal
shards (the last padded); rank r owns `[r * shard, (r + 1) * shard) ∩ [0, n)`: its fp32 master weights and
Adam moments, and the averaged gradient of that range. A block's update, on the step worker:
`agree` (the ranks compare which block and step they are at: a mismatch raises instead of pairing the
wrong tensors), `union_of` (a parameter any rank has a gradient for is stepped on every rank),
`reduce_scatter_mean` (the gradient, averaged, lands on its owner), the AdamW step of the shard, then
`all_gather` (every rank gets every shard's new weights). All collectives of the worker run on their own
process group in the worker's submission order, which is the same on every rank (pipeline.py); the
training thread's few (the clipping norm) run while the worker is idle. See [Note: data-parallel mode].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from offload.distributed.gather_check import USE, GatherCheck
from offload.distributed.guard import warn_launched_without_process_group
from offload.distributed.launchers import local_place
from offload.distributed.quantized_gather import Int8Blocks
from offload.errors import OffloadError
from offload.scheduler.torch_internals import default_group_timeout


@dataclass(frozen=True)
class Shard:
    """This rank's part `[lo, hi)` of a flat group's `n` trainable elements: `size` elements per rank of
    `world` (the last ranks' parts may be short, or empty for a group smaller than the world)."""

    n: int
    size: int
    rank: int
    world: int

    @property
    def lo(self) -> int:
        return min(self.rank * self.size, self.n)

    @property
    def hi(self) -> int:
        return min((self.rank + 1) * self.size, self.n)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def padded(self) -> int:
        """Elements of a buffer every rank's part fits in: `world * size` (>= n)."""
        return self.size * self.world

    @staticmethod
    def whole(n: int) -> "Shard":
        """One process: the whole range."""
        return Shard(n, n, 0, 1)


@dataclass(frozen=True)
class SecondaryGroup:
    """The ranks `[first, first + size)` sharing hpZ's secondary partition (see `make_secondary_partition`)."""

    group: "dist.ProcessGroup"
    first: int
    size: int

    def part_of(self, n: int, rank: int) -> Shard:
        """This rank's secondary part of a group of `n` elements."""
        return Shard(n, -(-n // self.size) if n else 0, rank - self.first, self.size)


class DataParallel:
    """The process group this engine trains over, and this rank's place in it."""

    def __init__(self, world: int, rank: int, local_world: int, local_rank: Optional[int] = None,
                 place: str = "") -> None:
        self.world = world
        self.rank = rank
        self.local_world = local_world  # the ranks of this machine (they share its cores)
        self.local_rank = local_rank  # this rank's place among them, as its launcher said it (None: not said)
        self.place = place  # where the launcher said those (launchers.py), for messages
        # the engine's groups wait as long as the user's default group (init_process_group(timeout=)), not the
        # backend's default (gloo: 30 minutes), before a rank left alone in a collective fails
        timeout = default_group_timeout()
        ranks = list(range(world))
        # the worker's collectives get a group of their own: the training thread may use the default one
        self.group = dist.new_group(ranks, timeout=timeout)
        # sharded weights: the training thread's gathers, in forward order, beside the worker's (their own group)
        self.gather_group = dist.new_group(ranks, timeout=timeout)
        self.backend = dist.get_backend(self.group)
        # each gather announced first on a gloo group (gather_check.py): the gathers' own group where it is gloo
        self.gather_check = GatherCheck(world, rank, self.gather_group if self.backend == "gloo" else
                                        dist.new_group(ranks, timeout=timeout, backend="gloo"))
        self.weight_codes: Optional[Int8Blocks] = None  # zero_quantized_weights: the gathers for compute send these
        self.grad_codes: Optional[Int8Blocks] = None  # zero_quantized_gradients: the reduce-scatters send these
        # bytes this rank received from the others, by what moved and whether the sender is on another machine
        # (ranks numbered machine by machine, `local_world` each, as the launchers number them)
        self.traffic = {f"bytes_{what}_{where}": 0 for what in ("weights", "grads")
                        for where in ("within_machine", "across_machines")}
        self._levels: "Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]]" = None  # their two levels, if any
        self.secondary: Optional[SecondaryGroup] = None  # zero_hpz_partition_size: this rank's group

    def _received(self, what: str, senders: Sequence[int], nbytes: int) -> None:
        """Count `nbytes` received from each rank of `senders` other than this one."""
        machine = self.rank // self.local_world
        for rank in senders:
            if rank != self.rank:
                where = "within_machine" if rank // self.local_world == machine else "across_machines"
                self.traffic[f"bytes_{what}_{where}"] += nbytes

    def quantize_weight_gathers(self, codes: Int8Blocks) -> None:
        """The gathers that feed compute send each part as `codes` (ZeRO++'s qwZ, quantized_gather.py); reads of
        the weights stay exact."""
        self.weight_codes = codes

    def gathered_nbytes(self, part: Shard, itemsize: int, kind: int = USE) -> int:
        """Bytes one gather of a group brings to this rank from the others."""
        others = part.n - part.numel
        if self.weight_codes is None or kind != USE:
            return others * itemsize
        return (self.world - 1) * self.weight_codes.packed_nbytes(part.size)

    @staticmethod
    def from_environment() -> Optional["DataParallel"]:
        """A DataParallel when torch.distributed is initialized with more than one process, else None (with a
        warning when a launcher started this process as one of several: guard.py). The rank and world are the
        process group's; the local rank and local world size are the launcher's, however it says them
        (launchers.py: torchrun, accelerate launch, deepspeed, torch.distributed.launch, mpirun), the local world
        the whole world where none says it."""
        if not (dist.is_available() and dist.is_initialized()):
            warn_launched_without_process_group()
            return None
        world = dist.get_world_size()
        if world <= 1:
            return None
        place = local_place()
        local_world = place.local_world if place.local_world is not None else world
        return DataParallel(world, dist.get_rank(), max(1, local_world), place.local_rank, place.source)

    def shard_of(self, n: int) -> Shard:
        return Shard(n, -(-n // self.world) if n else 0, self.rank, self.world)

    def weight_part(self, numel: int) -> Shard:
        """Sharded weights: this rank's part of a flat group's `numel` elements (trainable and frozen alike)."""
        return self.shard_of(numel)

    def state_shard(self, trainable_numel: int, numel: int, partitioned: bool) -> Shard:
        """This rank's part of a group's trainable range. With sharded weights it is the trainable elements of
        its weight part (cut at `numel`'s shard size), so the update writes the rank's own weights and nothing
        is gathered after it; else the trainable range cut in equal parts."""
        if not partitioned:
            return self.shard_of(trainable_numel)
        return Shard(trainable_numel, self.weight_part(numel).size, self.rank, self.world)

    # ----- collectives of the step worker (self.group) -----------------------------------------------
    def agree(self, what: str, block_index: int, step: int) -> None:
        """Raise unless every rank is at the same block of the same step (the worker's queues diverged:
        pairing their tensors would average one block's gradient into another's)."""
        mine = torch.tensor([block_index, step], dtype=torch.int64)
        every = torch.empty(2 * self.world, dtype=torch.int64)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        rows = every.view(self.world, 2).tolist()
        if any(row != rows[0] for row in rows):
            raise OffloadError(
                f"data-parallel ranks disagree on the {what} they run: (block, step) per rank {rows}; every rank "
                "must run the same forward and backward structure (the same modules, the same number of "
                "backward calls per step, the same grad_accumulation_steps)")

    def union_of(self, flags: Sequence[bool]) -> List[bool]:
        """For each flag, whether any rank has it set."""
        if not flags:
            return []
        mine = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in mine.tolist()]

    def any_rank(self, flag: bool) -> bool:
        return self.union_of([flag])[0]

    def reduce_scatter_mean(self, full: Tensor, shard: Shard, out: Tensor) -> None:
        """`out` (shard.size elements) = the mean over ranks of `full[shard range]` (`full`: shard.padded
        elements, the same on every rank in layout)."""
        if self.grad_codes is not None:
            self._reduce_scatter_codes(self.grad_codes, full, shard, out)
            return
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=self.group)
        self._received("grads", range(self.world), out.nbytes)
        out.div_(self.world)

    def quantize_gradient_reduction(self, codes: Int8Blocks) -> None:
        """The gradients' reduce-scatter sends each rank's pieces as `codes` through all-to-alls (ZeRO++'s qgZ),
        summed in fp32 where they land; in two levels where the ranks span several machines (within each machine
        first, then one piece per machine across them), so what crosses machines is already a machine's sum.
        Every rank calls it at setup (it makes the two levels' groups)."""
        self.grad_codes = codes
        self._levels = self._node_groups()

    def make_secondary_partition(self, size: int) -> None:
        """ZeRO++'s hpZ: ranks in consecutive groups of `size` (a machine's, where `size` is the ranks per machine)
        keep a secondary part of each block they gathered, so that its next gathers stay within the group
        (`gather_secondary`). Every rank calls it at setup (it makes every group's process group)."""
        timeout = default_group_timeout()
        for first in range(0, self.world, size):  # every rank makes every group, in the same order
            group = dist.new_group(list(range(first, first + size)), timeout=timeout)
            if first <= self.rank < first + size:
                self.secondary = SecondaryGroup(group, first, size)

    def gather_secondary(self, full: Tensor, mine: Tensor, part: Shard) -> None:
        """`full` (the group's `part.n` elements) = every secondary part of the rank's group (`mine`: this rank's,
        `part.size` elements, the last one padded), gathered within the group: the backward's gathers of hpZ."""
        secondary = self.secondary
        assert secondary is not None
        pieces = [torch.empty_like(mine) for _ in range(secondary.size)]
        dist.all_gather(pieces, mine, group=secondary.group)
        self._received("weights", range(secondary.first, secondary.first + secondary.size), mine.nbytes)
        for index, piece in enumerate(pieces):
            lo, hi = min(index * part.size, part.n), min((index + 1) * part.size, part.n)
            if hi > lo:
                full[lo:hi].copy_(piece[:hi - lo])

    @property
    def reduces_in_two_levels(self) -> bool:
        """Whether the quantized reduce-scatter runs within each machine, then across machines."""
        return self._levels is not None

    def _node_groups(self) -> "Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]]":
        """(this machine's ranks, the ranks of this local rank on every machine) where the launcher numbered
        several machines' ranks contiguously (torchrun, accelerate, deepspeed do), else None: one level."""
        local, nodes = self.local_world, self.world // self.local_world
        numbered = local > 1 and nodes > 1 and self.world % local == 0 and self.local_rank == self.rank % local
        if not all(self.all_gather_object((numbered, local))[r] == (True, local) for r in range(self.world)):
            return None  # decided alike on every rank: the groups below are made by all or by none
        timeout = default_group_timeout()
        mine_within = mine_across = None
        for node in range(nodes):  # every rank makes every group, in the same order
            group = dist.new_group(list(range(node * local, (node + 1) * local)), timeout=timeout)
            if node == self.rank // local:
                mine_within = group
        for place in range(local):
            group = dist.new_group(list(range(place, self.world, local)), timeout=timeout)
            if place == self.rank % local:
                mine_across = group
        assert mine_within is not None and mine_across is not None
        return mine_within, mine_across

    def _reduce_scatter_codes(self, codes: Int8Blocks, full: Tensor, shard: Shard, out: Tensor) -> None:
        """`reduce_scatter_mean` with every piece sent as `codes` (see `quantize_gradient_reduction`)."""
        size = shard.size
        if self._levels is None:
            total = _exchange_codes(codes, full.view(self.world, size), self.group)
            self._received("grads", range(self.world), codes.packed_nbytes(size))
        else:  # rank = machine * local + place; piece j goes to rank j
            within, across = self._levels
            local, nodes = self.local_world, self.world // self.local_world
            machine, place = divmod(self.rank, local)
            by_place = full.view(nodes, local, size).transpose(0, 1).reshape(local, nodes * size)
            machine_sums = _exchange_codes(codes, by_place, within)  # my place's pieces of every machine
            self._received("grads", range(machine * local, (machine + 1) * local), codes.packed_nbytes(nodes * size))
            total = _exchange_codes(codes, machine_sums.view(nodes, size), across)
            self._received("grads", range(place, self.world, local), codes.packed_nbytes(size))
        out.copy_(total.div_(self.world))

    def all_gather(self, full: Tensor, mine: Tensor) -> None:
        """`full` (world * mine.numel() elements) = every rank's `mine`, in rank order (bytes: any dtype)."""
        dist.all_gather_into_tensor(_bytes(full), _bytes(mine), group=self.group)
        self._received("weights", range(self.world), mine.nbytes)

    # ----- collectives of the training thread ---------------------------------------------------------
    def gather_weights(self, full: Tensor, mine: Tensor, part: Shard, async_op: bool = False, key: str = "",
                       kind: int = USE) -> Optional[Callable[[], None]]:
        """`full` (the group's `part.n` elements) = every rank's part, `mine` this rank's (`part.numel` elements):
        sharded weights made whole for compute. On the training thread, in forward order (`gather_group`); the
        ranks' whole parts land in `full` directly, a short or empty last part through a padded buffer.
        `async_op`: started, not waited for; returns the function that completes it (before `full` is read).
        `key` (the flat group's layout key) and `kind` (`USE` or `READ`) are announced first: every rank must be
        making the same gather (gather_check.py), else all raise."""
        size = part.size
        if size == 0:
            return None
        self.gather_check.announce(key, part.n, kind)
        if self.weight_codes is not None and kind == USE:
            return self._gather_codes(self.weight_codes, full, mine, part, async_op)
        if mine.numel() == size:
            sent = mine
        else:
            sent = mine.new_zeros(size)
            sent[:mine.numel()].copy_(mine)
        outputs, short = [], []
        for rank in range(self.world):
            lo, hi = min(rank * size, part.n), min((rank + 1) * size, part.n)
            if hi - lo == size:
                outputs.append(full[lo:hi])
            else:
                outputs.append(full.new_empty(size))
                short.append((lo, hi, outputs[-1]))
        work = dist.all_gather([_bytes(out) for out in outputs], _bytes(sent), group=self.gather_group,
                               async_op=async_op)
        self._received("weights", range(self.world), sent.nbytes)
        buffers = (sent, outputs)  # alive until the gather that reads and writes them is done

        def finish() -> None:
            if work is not None:
                work.wait()
            for lo, hi, out in short:
                if hi > lo:
                    full[lo:hi].copy_(out[:hi - lo])
            assert buffers

        if async_op:
            return finish
        finish()
        return None

    def _gather_codes(self, codes: Int8Blocks, full: Tensor, mine: Tensor, part: Shard,
                      async_op: bool) -> Optional[Callable[[], None]]:
        """`gather_weights` with each rank's part sent as `codes` and decoded into `full` by every rank (its own
        part too: every rank then computes with the same weights)."""
        size = part.size
        if mine.numel() < size:  # a short last part: sent at the full part's length, as every rank's
            mine = torch.cat([mine, mine.new_zeros(size - mine.numel())])
        sent = codes.encode(mine)
        received = [torch.empty_like(sent) for _ in range(self.world)]
        work = dist.all_gather(received, sent, group=self.gather_group, async_op=async_op)
        self._received("weights", range(self.world), sent.nbytes)
        buffers = (sent, received)  # alive until the gather that reads and writes them is done

        def finish() -> None:
            if work is not None:
                work.wait()
            assert buffers
            for rank, packed in enumerate(received):
                lo, hi = min(rank * size, part.n), min((rank + 1) * size, part.n)
                if hi - lo == size:
                    codes.decode(packed, size, full[lo:hi])
                elif hi > lo:
                    decoded = full.new_empty(size)
                    codes.decode(packed, size, decoded)
                    full[lo:hi].copy_(decoded[:hi - lo])

        if async_op:
            return finish
        finish()
        return None

    # ----- collectives of the training thread (the worker is idle) -----------------------------------
    def sum_all(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return float(total.item())

    def sum_into_all(self, tensor: Tensor) -> None:
        """`tensor` becomes its sum over the ranks, on every rank (each rank's part of a whole, zeros elsewhere)."""
        if tensor.numel():
            dist.all_reduce(tensor, group=self.group)

    def broadcast_from_first(self, tensor: Tensor) -> None:
        """Rank 0's values into `tensor` on every rank (the start weights)."""
        if tensor.numel():
            dist.broadcast(_bytes(tensor) if tensor.dtype == torch.bool else tensor, src=0, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather_object(self, value: object) -> List[object]:
        out: List[object] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast_object(self, value: object) -> object:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def __repr__(self) -> str:
        return f"DataParallel(rank {self.rank} of {self.world}, {self.backend})"


def _bytes(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _exchange_codes(codes: Int8Blocks, pieces: Tensor, group: "dist.ProcessGroup") -> Tensor:
    """Row k of `pieces` (one per member of `group`, in group rank order) goes to member k as `codes`; returns the
    fp32 sum, in member order, of the rows the members sent this rank."""
    members, size = pieces.shape
    sent = torch.cat([codes.encode(piece) for piece in pieces])
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    nbytes = codes.packed_nbytes(size)
    total = torch.zeros(size, dtype=torch.float32, device=pieces.device)
    decoded = torch.empty(size, dtype=torch.float32, device=pieces.device)
    for member in range(members):
        codes.decode(received[member * nbytes:(member + 1) * nbytes], size, decoded)
        total.add_(decoded)
    return total
