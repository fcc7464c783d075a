"""The nvme staging ring's slots, and the order of the I/O over them.

`SlotPool`: `depth` host buffers leased once from the StagingPool, their free list, and the lock and
condition variable that guard it. It only hands out free slots and takes them back; it calls nobody.

`WriteOrder`: the ring's writes in flight and the rules that order everything else after them. Two paths
move bytes through the slots: optimizer-state chunks (disk_ring.py: `announce`, `load`, `store`) and
disk-resident compute weights (record_moves.py). Both take their slots, wait for the disk and meet write errors
through this one object, so each rule is written once:

- a read of a range waits for the in-flight write of that range of the same record (`wait_for_writes_of`; a
  read issued ahead is not issued at all while one is in flight, `take_ahead_locked`). The records are the
  swap file's (`RecordKind`): a group's parked gradient and its state are different bytes, so a gradient parking
  after a speculative update does not wait for that update's state writes (it did, behind the disk's queue:
  3 s of the worker's time a step at 1.2B);
- a slot is reused only after its write has completed: a write keeps its slot until it is retired (waited
  for, then unregistered and the slot given back, `retire`); `take` retires the oldest write when no slot
  is free, and `reap` retires the completed ones without blocking;
- reads ahead never take the last free slot (`take_ahead_locked` keeps `KEEP_FOR_LOAD`), so the worker's
  next `load` always finds a free slot or a write to retire: no deadlock when the announced order and the
  update order differ;
- a free slot may still hold the bytes of the state chunk it last wrote (`SlotPool.clean`): a later load of that
  chunk takes the slot instead of reading the disk. Handing the slot out for anything else forgets it first
  (`pop_free_locked` hands out slots that hold nothing before the longest-held one), a new write of the chunk
  forgets it, and `drain` forgets every one (whoever changes the swap file itself drains first). See
  docs/design.md [Note: clean chunks].
- an error of a write reaped on the training thread is kept (`deferring_errors`) and raised on the worker
  (`raise_deferred`, at its next `load` or `drain`), where it fails an update instead of escaping a hook.

Why the rules sit with the slots and not with either path: each one decides when a slot may be handed out
or when a slot's bytes are current, under the pool's one lock; so neither path reaches into the other, and
the pool needs no callback into the ring to free a slot (`WriteOrder.take` does that).

Thread safety: `SlotPool.lock` guards the free list, the writes in flight and the deferred error (one lock,
so a path can take a slot and register what it holds in one step). Methods named `*_locked` expect the
caller to hold it; the others take it themselves, and never wait on I/O under it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Deque, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from offload.errors import OffloadConfigError
from offload.io.future import IOFuture, wait_all
from offload.optim.moment_format import (
    Moment,
    MomentFormat,
    QuantizedMoment,
    code_nbytes,
    moment_from_bytes,
    scale_count,
    slice_moment,
)
from offload.planner.ring import RingSlots, min_ring_bytes, slot_layout
from offload.tiers.disk import RecordKind
from offload.trace import Tracer

if TYPE_CHECKING:
    from offload.scheduler.blocks.block import FlatGroup
    from offload.tiers.host import HostBuffer, StagingPool

KEEP_FOR_LOAD = 1  # free slots a read ahead leaves: the one the worker's next `load` may need


SlotSections = Tuple[Tensor, Moment, Moment]  # master (fp32), exp_avg, exp_avg_sq in the ring's moment format


@dataclass
class Slot:
    index: int
    buffer: "HostBuffer"
    raw: Tensor  # all of the slot's bytes
    sections: SlotSections  # `chunk_numel` elements each
    moments: MomentFormat
    weights_offset: int  # where the compute-weight area starts (after the sections, 4 KiB-aligned)
    cuts: Dict[Tuple[int, Optional[int]], SlotSections] = field(default_factory=dict)  # `cut`'s views by size
    holds: Optional["CleanChunk"] = None  # while free: the chunk whose live bytes on disk it still holds

    def weights(self, dtype: torch.dtype, numel: int) -> Tensor:
        """The slot's compute-weight area (after the three sections) as `numel` elements of `dtype`."""
        start = self.weights_offset
        itemsize = dtype.itemsize
        return self.raw[start:start + numel * itemsize].view(dtype)

    def cut(self, numel: int, scales: Optional[int] = None) -> SlotSections:
        """The three sections' first `numel` elements: a chunk of that many elements in this slot (the cuts of
        the sizes a record's chunks have are made once). `scales`: an int8 chunk's blocks (default: one run)."""
        cut = self.cuts.get((numel, scales))
        if cut is None:
            master, exp_avg, exp_avg_sq = self.sections
            cut = self.cuts[(numel, scales)] = (master[:numel], _moment_prefix(exp_avg, self.moments, numel, scales),
                                                _moment_prefix(exp_avg_sq, self.moments, numel, scales))
        return cut


def _moment_prefix(moment: Moment, moments: MomentFormat, numel: int, scales: Optional[int]) -> Moment:
    """A slot moment's first `numel` elements and (int8) first `scales` scales."""
    if scales is None or not isinstance(moment, QuantizedMoment):
        return slice_moment(moment, moments, 0, numel)
    if scales > moment.scales.numel():
        raise OffloadConfigError(f"a chunk of {numel} elements in {scales} int8 blocks does not fit a slot of "
                                 f"{moment.scales.numel()} scales")
    return QuantizedMoment(moment.codes[:numel], moment.scales[:scales])


def _moment_at(raw: Tensor, offset: int, moments: MomentFormat, chunk: int) -> Moment:
    """A moment of `chunk` elements viewing the slot's bytes from `offset`: codes, then int8 scales."""
    codes = code_nbytes(moments, chunk)
    scales = 4 * scale_count(moments, chunk)
    return moment_from_bytes(moments, chunk, raw[offset:offset + codes],
                             raw[offset + codes:offset + codes + scales] if scales else None)


ChunkKey = Tuple[str, int]  # (a group's layout key, a chunk's first element)


@dataclass(frozen=True)
class CleanChunk:
    """A state chunk whose bytes on disk (its group's live record, elements [start, stop)) a free slot holds."""

    key: ChunkKey
    stop: int


Records = FrozenSet[RecordKind]
# What a state chunk's I/O moves: its three sections, and its compute weights when they live on disk (they move
# with the chunk, disk_ring.py).
CHUNK_RECORDS: Records = frozenset({RecordKind.STATE, RecordKind.WEIGHTS})
STATE_RECORD: Records = frozenset({RecordKind.STATE})  # a master's or a first moment's read (no weights)


@dataclass
class InFlight:
    """I/O of elements [start, stop) of a group's `records` in flight over one slot: a chunk's read or write.
    `clean`: a write of the live record's state chunk whose slot, once the write is done, still holds the chunk's
    bytes."""

    slot: Slot
    group: "FlatGroup"
    records: Records
    start: int
    stop: int
    futures: List[IOFuture]
    clean: Optional[CleanChunk] = None

    def overlaps(self, group: "FlatGroup", records: Records, start: int, stop: int) -> bool:
        """Whether it moves any of elements [start, stop) of any of the group's `records`."""
        return self.group is group and not self.records.isdisjoint(records) and self.start < stop and start < self.stop


class SlotPool:
    """`depth` slots leased once from `pool` (their total is at most `ring_bytes`), handed out and taken back. A
    slot holds as many elements as its bytes allow in the ring's moment format (`RingSlots.fit`: about 1.6x as
    many with int8 moments as with fp32 ones). Which slot is free to hand out is `WriteOrder`'s business: take
    slots through it."""

    def __init__(self, pool: "StagingPool", ring_bytes: int, depth: int,
                 moments: MomentFormat = MomentFormat.FP32) -> None:
        fitted = RingSlots.fit(ring_bytes, depth, moments)
        if fitted.chunk_numel <= 0:
            raise OffloadConfigError(
                f"the nvme staging ring needs at least {min_ring_bytes(depth, moments)} bytes of host_memory, got "
                f"{ring_bytes}; raise host_memory")
        chunk, slot_bytes = fitted.chunk_numel, fitted.slot_bytes
        layout = slot_layout(moments, chunk)
        assert fitted.nbytes <= ring_bytes, "the slots never take more host memory than the ring's budget"
        self.chunk_numel = chunk
        self.slot_bytes = slot_bytes  # each slot's, all of them used: sections, then the compute weights' room
        self.depth = depth
        self.slots: List[Slot] = []
        for index in range(depth):
            buffer = pool.lease(slot_bytes)
            raw = buffer.view(torch.uint8, (slot_bytes,))
            sections = (raw[layout.master:layout.master + 4 * chunk].view(torch.float32),
                        _moment_at(raw, layout.exp_avg, moments, chunk), _moment_at(raw, layout.exp_avg_sq, moments, chunk))
            self.slots.append(Slot(index, buffer, raw, sections, moments, layout.weights))
        self.free: List[Slot] = list(self.slots)  # guarded by `lock`
        self.clean: Dict[ChunkKey, Slot] = {}  # free slots holding a chunk's live bytes, oldest first
        self.lock = threading.Lock()
        self._slot_returned = threading.Condition(self.lock)

    def close(self) -> None:
        """Let go of the slots when every one is free (nothing reads or writes into them): their leases go back
        to the staging pool now, whatever still refers to this pool. Slots in use are kept (I/O may target
        them); they go with the pool."""
        with self.lock:
            if len(self.free) == len(self.slots):
                self.forget_clean_locked()
                self.free.clear()
                self.slots.clear()

    def pop_free_locked(self) -> Optional[Slot]:
        """A free slot, or None when none is; raises once the pool is closed. Slots that hold no clean chunk go
        first, then the one that has held its chunk longest (which it forgets: the caller will change its
        bytes). The caller holds `lock`."""
        if not self.slots:
            raise OffloadConfigError("the nvme staging ring is closed")
        if not self.free:
            return None
        for index in range(len(self.free) - 1, -1, -1):
            if self.free[index].holds is None:
                return self.free.pop(index)
        slot = next(iter(self.clean.values()))
        self._forget_locked(slot)
        self.free.remove(slot)
        return slot

    def pop_clean_locked(self, key: ChunkKey, stop: int) -> Optional[Slot]:
        """The free slot holding the live bytes of chunk `key` (ending at `stop`), taken off the free list, or
        None. The caller holds `lock`."""
        slot = self.clean.get(key)
        if slot is None or slot.holds is None or slot.holds.stop != stop:
            return None
        self._forget_locked(slot)
        self.free.remove(slot)
        return slot

    def forget_clean_locked(self, key: Optional[ChunkKey] = None) -> None:
        """The swap file's bytes of chunk `key` (of every chunk: None) are about to change or may have: no free
        slot stands for them any more. The caller holds `lock`."""
        for slot in [s for k, s in self.clean.items() if key is None or k == key]:
            self._forget_locked(slot)

    def _forget_locked(self, slot: Slot) -> None:
        if slot.holds is not None:
            self.clean.pop(slot.holds.key, None)
            slot.holds = None

    def wait_for_return_locked(self, timeout: float) -> None:
        """Wait (releasing `lock`, which the caller holds) until a slot is given back, at most `timeout` s."""
        self._slot_returned.wait(timeout=timeout)

    def give_back(self, slot: Slot) -> None:
        with self.lock:
            self.give_back_locked(slot)

    def give_back_locked(self, slot: Slot, holds: Optional[CleanChunk] = None) -> None:
        """`give_back` for a caller that holds `lock`; `holds`: the slot's bytes are that chunk's live bytes on
        disk (its write just completed), for a later load to take instead of reading them."""
        if holds is not None:
            self.forget_clean_locked(holds.key)
            slot.holds = holds
            self.clean[holds.key] = slot
        self.free.append(slot)
        self._slot_returned.notify_all()

    def slot_of(self, tensor: Tensor) -> Slot:
        """The slot whose first section `tensor` starts (a chunk's master section, as `Slot.cut` made it)."""
        for slot in self.slots:
            if slot.sections[0].data_ptr() == tensor.data_ptr():
                return slot
        raise ValueError("not a view of a ring slot")


class WriteOrder:
    """The writes in flight over `slots` and the ordering rules of the module docstring; every wait for the
    disk goes through `wait`, which times it (`io_wait_seconds`) as a "disk wait" span of `tracer`."""

    def __init__(self, slots: SlotPool, tracer: Optional[Tracer] = None) -> None:
        self._slots = slots
        self._lock = slots.lock
        self._tracer = tracer or Tracer()
        self._writes: Deque[InFlight] = collections.deque()  # oldest first; guarded by the lock
        self._deferred: Optional[BaseException] = None  # a write error met on the training thread
        self.io_wait_seconds = 0.0

    # ----- slots -------------------------------------------------------------------------------------
    def take(self) -> Slot:
        """A slot for I/O the caller needs now: a free one, else the oldest write's once it has completed
        (always possible: reads ahead leave `KEEP_FOR_LOAD` slots free or held by writes). Raises a failed
        write's error (its slot is back either way)."""
        while True:
            with self._lock:
                slot = self._slots.pop_free_locked()
                if slot is not None:
                    return slot
                oldest = self._writes[0] if self._writes else None
                if oldest is None:  # only reads ahead (or borrowers) hold slots: wait for one to come back
                    self._slots.wait_for_return_locked(timeout=1.0)
                    continue
            self.retire(oldest)

    def take_ahead_locked(self, count: int, group: "FlatGroup", records: Records, start: int, stop: int,
                          keep: int = KEEP_FOR_LOAD) -> Optional[List[Slot]]:
        """`count` free slots for reads ahead of elements [start, stop) of the group's `records`, or None: while a
        write of the range is in flight (read it once the write is done), or when taking them would leave fewer than
        `keep` slots free. The caller holds the lock and registers what it submits before releasing it."""
        if len(self._slots.free) < count + keep or self.writing_locked(group, records, start, stop):
            return None
        return [slot for slot in (self._slots.pop_free_locked() for _ in range(count)) if slot is not None]

    # ----- writes in flight ------------------------------------------------------------------------
    def register_locked(self, write: InFlight) -> None:
        """A write just submitted (the caller holds the lock since before it submitted: no read ahead sees the
        range without its write); it keeps its slot until retired."""
        self._writes.append(write)

    def writing_locked(self, group: "FlatGroup", records: Records, start: int, stop: int) -> bool:
        """Whether a write of elements [start, stop) of the group's `records` is in flight; the caller holds the
        lock."""
        return any(w.overlaps(group, records, start, stop) for w in self._writes)

    def in_flight(self) -> int:
        """How many writes are registered (submitted and not yet retired)."""
        with self._lock:
            return len(self._writes)

    def wait_for_writes_of(self, group: "FlatGroup", records: Records, start: int, stop: int) -> None:
        """Before a read of elements [start, stop) of the group's `records` (or a write that must land after
        the last one): retire the writes of that range in flight, so the read sees the last write of it."""
        with self._lock:
            overlapping = [w for w in self._writes if w.overlaps(group, records, start, stop)]
        for write in overlapping:
            self.retire(write)

    def retire(self, write: InFlight) -> None:
        """Wait for a write, then unregister it and give its slot back; raises its error after.
        [Note: a write stays registered until it is done] Reads ahead on another thread check the writes for
        overlaps: a write taken off the list while still in flight would let them read the chunk's old bytes.
        Exactly one thread unregisters an entry (by identity, under the lock), and only that one gives the slot
        back."""
        done = False
        try:
            self.wait(write.futures)
            done = True
        finally:
            with self._lock:
                index = next((i for i, w in enumerate(self._writes) if w is write), None)
                if index is not None:
                    del self._writes[index]
                    clean = done and not self.writing_locked(write.group, write.records, write.start, write.stop)
                    self._slots.give_back_locked(write.slot, write.clean if clean else None)

    def reap(self) -> None:
        """Retire the writes that have completed (oldest first, never blocking); a failed write raises here,
        in whichever thread reaps it (on the training thread, inside `deferring_errors`)."""
        while True:
            with self._lock:
                if not self._writes or not all(f.done() for f in self._writes[0].futures):
                    return
                oldest = self._writes[0]
            self.retire(oldest)

    def retire_all(self) -> None:
        """Wait for every write in flight, giving their slots back; raise the first error after all are done."""
        first: Optional[BaseException] = None
        while True:
            with self._lock:
                if not self._writes:
                    break
                oldest = self._writes[0]
            try:
                self.retire(oldest)
            except BaseException as exc:  # noqa: B902 - re-raised below, after the other writes are done
                first = first or exc
        if first is not None:
            raise first

    # ----- errors met on the training thread -------------------------------------------------------
    @contextlib.contextmanager
    def deferring_errors(self) -> Iterator[None]:
        """For the training thread (announcements, prefetches): an error raised inside (a write reaped there,
        a read ahead that failed to submit) is kept for the worker's next `raise_deferred`, so it fails an
        update (which poisons the engine) instead of escaping from a hook in the middle of scheduling a step.
        Of several, the first is kept."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - kept and raised on the worker
            with self._lock:
                self._deferred = self._deferred or exc

    def reap_or_defer(self) -> bool:
        """`reap` on the training thread: False when it met an error (kept for the worker)."""
        with self.deferring_errors():
            self.reap()
            return True
        return False

    def raise_deferred(self) -> None:
        """On the worker: raise (once) the error the training thread kept, if any."""
        with self._lock:
            error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    # ----- waits -------------------------------------------------------------------------------------
    def wait(self, futures: List[IOFuture]) -> None:
        """Wait for every request of a piece of I/O, then raise the first error: a slot is handed back only
        when the kernel no longer reads into or writes from it, even when one of its requests failed."""
        begin = time.perf_counter()
        try:
            with self._tracer.span("disk wait"):
                wait_all(futures)
        finally:
            self.io_wait_seconds += time.perf_counter() - begin
