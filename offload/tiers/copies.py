"""Every device<->host copy goes through here, so streams and events live in one place.

On a CPU compute device these are plain synchronous copies (a no-op scheduling layer): no stream, no event.
On CUDA, weight uploads and gradient downloads run non_blocking between pinned host buffers and the device
on two side streams, each copy handed over as an event that its reader waits for:

- `upload(key, dst, src)`: host -> device on the H2D stream, after the compute stream's work issued so far
  (the destination may be memory the compute stream used until now). The compute stream waits for it in
  `use_upload(key)`, called before the block's forward reads the weights; the host waits for it in
  `release_source(key)`, called before the update worker overwrites the source.
- `GradDownloads.put`: device -> host on the D2H stream, after the compute stream's work issued so far (the
  gradient was produced there). `GradDownloads.settle`, called before anything reads the host gradient,
  waits for the copies and runs the host adds of accumulated gradients.

Device tensors a side stream reads or writes are marked with `record_stream`, so the caching allocator does
not hand their memory out again (a freed gradient, an evicted block) before the copy is done.
`to_device` stays synchronous on every device: its callers reuse the source right after (disk ring slots).
See docs/design.md [Note: CUDA streams].
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Protocol, Tuple

import torch
from torch import Tensor


class CopyEvent(Protocol):
    """What a copy on a side stream hands over (torch.cuda.Event; a fake one in the CPU tests)."""

    def synchronize(self) -> None: ...


class SideStreams(Protocol):
    """The copy streams of one device: `CudaSideStreams`, or a fake in the CPU tests."""

    def h2d(self, dst: Tensor, src: Tensor) -> CopyEvent: ...

    def d2h(self, dst: Tensor, src: Tensor) -> CopyEvent: ...

    def compute_wait(self, event: CopyEvent) -> None: ...

    def synchronize(self) -> None: ...


class CudaSideStreams:
    """One H2D and one D2H stream; each copy starts after the compute (current) stream's work issued so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._h2d = torch.cuda.Stream(device)  # uploads of weights
        self._d2h = torch.cuda.Stream(device)  # downloads of gradients

    def h2d(self, dst: Tensor, src: Tensor) -> CopyEvent:
        return self._copy(self._h2d, dst, src, dst)

    def d2h(self, dst: Tensor, src: Tensor) -> CopyEvent:
        return self._copy(self._d2h, dst, src, src)

    def _copy(self, side: "torch.cuda.Stream", dst: Tensor, src: Tensor, on_device: Tensor) -> CopyEvent:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        side.wait_event(ready)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        on_device.record_stream(side)  # its memory is not reused before the copy is done
        done = torch.cuda.Event()
        done.record(side)
        return done

    def compute_wait(self, event: CopyEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def synchronize(self) -> None:
        self._h2d.synchronize()
        self._d2h.synchronize()


def side_streams_for(device: torch.device) -> Optional[SideStreams]:
    """The side streams copies to and from `device` use; None (synchronous copies) for the CPU."""
    return CudaSideStreams(device) if device.type == "cuda" else None


class CopyContext:
    """Copies between the compute device and the host for one engine; counts the bytes on each link and the
    copies issued on side streams (`async_copies`, 0 on a CPU device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.async_copies = 0
        self._streams = side_streams_for(device)
        self._uploads: Dict[str, CopyEvent] = {}  # key -> event of the last upload under that key
        self._lock = threading.Lock()  # the update worker waits on uploads while the training thread issues them

    @property
    def is_async(self) -> bool:
        """Whether copies run on side streams (CUDA): their readers must wait for their events."""
        return self._streams is not None

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A host buffer side-stream copies read or write: pinned when the device is CUDA."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.device.type == "cuda")

    def to_device(self, dst: Tensor, src: Tensor) -> None:
        """Upload `src` (host) into `dst` (device), synchronously: `src` may be reused when this returns."""
        with torch.profiler.record_function("offload::h2d"):
            dst.copy_(src)
        if self.device.type != "cpu" or dst.data_ptr() != src.data_ptr():
            self.bytes_to_device += src.numel() * src.element_size()

    def upload(self, key: str, dst: Tensor, src: Tensor) -> None:
        """Upload `src` (pinned host) into `dst` (device); asynchronous on CUDA. Before the compute reads `dst`
        call `use_upload(key)`; before the host overwrites `src`, `release_source(key)`."""
        if self._streams is None:
            self.to_device(dst, src)
            return
        with torch.profiler.record_function("offload::h2d"):
            event = self._streams.h2d(dst, src)
        with self._lock:
            self._uploads[key] = event
            self.async_copies += 1
            self.bytes_to_device += src.numel() * src.element_size()

    def use_upload(self, key: str) -> None:
        """The compute stream waits for the last upload under `key` (nothing to do when copies are synchronous)."""
        with self._lock:
            event = self._uploads.get(key)
        if event is not None:
            assert self._streams is not None
            self._streams.compute_wait(event)

    def release_source(self, key: str) -> None:
        """Block until the last upload under `key` has read its source (any thread)."""
        with self._lock:
            event = self._uploads.get(key)
        if event is not None:
            event.synchronize()

    def download(self, dst: Tensor, src: Tensor) -> CopyEvent:
        """Issue a copy of `src` (device) into `dst` (pinned host) on the D2H stream; CUDA only. `dst` may be
        read once the returned event is synchronized (GradDownloads does this)."""
        assert self._streams is not None, "downloads on side streams need a CUDA device"
        with torch.profiler.record_function("offload::d2h"):
            event = self._streams.d2h(dst, src)
        with self._lock:
            self.async_copies += 1
        return event

    def synchronize(self) -> None:
        """Wait for every copy issued on a side stream (before host reads or frees of anything they touch)."""
        if self._streams is not None:
            self._streams.synchronize()


_Pending = Tuple[CopyEvent, Optional[Tensor], Optional[Tensor]]  # (event, accumulator range, staged copy)


class GradDownloads:
    """One flat group's gradient downloads still in flight on the D2H stream, and the host adds waiting on them.

    The first gradient of a range since `zero_grad` is copied straight into the group's accumulator; a later
    one into the same range of a pinned staging buffer (allocated at the first accumulation), to be added
    into the accumulator by `settle`. `settle` (any thread; GradHome.finish_downloads calls it before every read of its
    gradient) waits for the copies in the order they were issued and runs the adds. A staging range is not
    written again while its add is pending (a parameter firing twice settles first)."""

    def __init__(self, copies: CopyContext, numel: int, dtype: torch.dtype) -> None:
        self._copies = copies
        self._numel = numel
        self._dtype = dtype
        self._staging: Optional[Tensor] = None
        self._pending: List[_Pending] = []
        self._staged_offsets: set = set()
        self._lock = threading.Lock()

    def new_accumulator(self) -> Tensor:
        """A zeroed host gradient accumulator for the group, which `put` may write into (pinned on CUDA)."""
        return self._copies.empty_host(self._numel, self._dtype).zero_()

    @property
    def pending(self) -> int:
        """Copies issued and not settled yet."""
        return len(self._pending)

    def put(self, target: Tensor, offset: int, source: Tensor, accumulate: bool) -> None:
        """Download `source` (device, flat) into `target` (`grad[offset:offset + n]` of the group): a copy, or
        with `accumulate` an add that `settle` completes."""
        if accumulate and offset in self._staged_offsets:
            self.finish_downloads()  # its staging range still holds a gradient not yet added
        with self._lock:
            if not accumulate:
                self._pending.append((self._copies.download(target, source), None, None))
                return
            if self._staging is None:
                self._staging = self._copies.empty_host(self._numel, self._dtype)
            staged = self._staging[offset:offset + target.numel()]
            self._pending.append((self._copies.download(staged, source), target, staged))
            self._staged_offsets.add(offset)

    def finish_downloads(self) -> None:
        """Wait for every download issued so far and finish the pending adds: the accumulator is then final."""
        with self._lock:
            while self._pending:
                event, target, staged = self._pending[0]
                event.synchronize()
                if target is not None:
                    assert staged is not None
                    target.add_(staged)
                self._pending.pop(0)
            self._staged_offsets.clear()
