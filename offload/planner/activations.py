"""`ActivationUse`: what a training forward saved for its backward, measured, and what that means for the
device budget (`engine.plan` prints it once a training forward has run).

The plan's other rows are sizes known at `wrap()`; activations depend on the batch, so the engine measures
them in the saved-tensor hooks of a training forward (offload/scheduler/activations/meter.py) and the plan
shows the last measurement. See docs/design.md [Note: activations off the device].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional


@dataclass(frozen=True)
class ActivationUse:
    """Saved-tensor bytes of one training forward. The model's own weights are not counted: they are the plan's
    weight rows (streamed weights are saved as handles and fetched again)."""

    saved_bytes: int  # everything saved for the backward
    movable_bytes: int  # of it, the tensors activations="offload" sends to the swap file (the rest is small)
    moved_bytes: int  # what went to the swap file (0 with activations=None)
    largest_block_bytes: int  # the most one block saved in the forward (its layer's tensors: meter.py)
    tokens: Optional[int] = None  # elements of the forward's token input (input_ids), when it had one
    recomputed: bool = False  # activation checkpointing ran a block's forward again in the backward

    @property
    def offloaded(self) -> bool:
        return self.moved_bytes > 0

    @property
    def on_device_offloaded(self) -> int:
        """With activations="offload": the small tensors that stay, and about one block's set (the one computing,
        or the one whose backward runs: its tensors come back just before); never more than keeping them all (the
        block's small tensors are in both terms)."""
        return min(self.saved_bytes, self.saved_bytes - self.movable_bytes + self.largest_block_bytes)

    @property
    def on_device_bytes(self) -> int:
        """About what stays on the device at once: everything saved, or with activations="offload" what does not
        move and one block's set."""
        return self.on_device_offloaded if self.offloaded else self.saved_bytes

    def beyond_room(self, room: int, human: Callable[[Optional[int]], str]) -> Optional[str]:
        """The warning when these activations need more than the `room` the plan leaves them in the device budget
        (None: they fit): the budget is then exceeded by what torch allocates, which the engine cannot refuse."""
        need = self.on_device_bytes
        if need <= room:
            return None
        spill = ("" if self.offloaded else
                 "; or activations='offload' (tier='nvme'), which moves saved tensors of 1 MiB or more to the swap "
                 f"file ({human(self.movable_bytes)} of them here)")
        return (f"offload: the training forward saved {human(need)} of activations on the device, more than the "
                f"{human(room)} that device_memory leaves them beside the weights the plan keeps there: the device "
                f"goes {human(need - room)} over its budget (on a GPU, it may run out of memory). wrap(..., "
                f"activation_memory={need}) keeps that much free of weights (more of them stream){spill}. "
                "engine.plan shows the measurement.")

    def tokens_that_fit(self, room: int, offloaded: bool) -> Optional[int]:
        """About how many tokens per micro-batch `room` bytes of device memory hold the activations of, at the bytes
        per token measured (None without a token count)."""
        if not self.tokens:
            return None
        need = self.on_device_offloaded if offloaded else self.saved_bytes
        return int(max(room, 0) * self.tokens // max(need, 1))

    def lines(self, device_room: Optional[int], human: Callable[[Optional[int]], str]) -> List[str]:
        """The plan's activation lines (`device_room`: what the device budget leaves, None without a budget)."""
        per = "" if not self.tokens else f" ({human(self.saved_bytes // self.tokens)} a token)"
        tokens = "" if not self.tokens else f", {self.tokens:,} tokens"
        out = [f"activations (measured in the last training forward{tokens}): {human(self.saved_bytes)} saved for "
               f"the backward{per}, the largest block {human(self.largest_block_bytes)}"]
        if self.offloaded:
            out.append(f"  activations='offload': {human(self.moved_bytes)} to the swap file, "
                       f"{human(self.saved_bytes - self.movable_bytes)} stay on the device (tensors under 1 MiB); "
                       f"on the device at once about {human(self.on_device_offloaded)}")
        else:
            out.append(f"  activations=None: all of it stays on the device; activations='offload' would move "
                       f"{human(self.movable_bytes)} to the swap file, leaving about "
                       f"{human(self.on_device_offloaded)} on the device at once")
        if self.recomputed:
            out.append("  activation checkpointing: these are the checkpoints; each block's full set exists again "
                       "while its recompute and backward run (one block at a time)")
        if device_room is not None and self.tokens:
            kept, moved = self.tokens_that_fit(device_room, False), self.tokens_that_fit(device_room, True)
            recompute = " (and one block's recompute, not measured)" if self.recomputed else ""
            out.append(f"  the device room the plan leaves ({human(device_room)}) holds the activations{recompute} of "
                       f"about {kept:,} tokens per micro-batch kept, {moved:,} offloaded")
        return out
