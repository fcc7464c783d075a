"""Where a checkpoint keeps each trainable parameter's fp32 master weights: [Note: master weights stored once].

fp32 compute: the master is the fp32 weight that `model.safetensors` holds already, bit for bit (the engine settles
weights written through parameters into the master before a save), so the optimizer file leaves it out. bf16
compute: the bf16 weight is the master rounded to nearest even, so the master's low 16 bits (`master_low/<name>`)
and, for the rare exact ties, one bit more (`master_tie/<name>`, packed eight to a byte) give it back: 2.125 bytes
a parameter instead of 4. A save checks every piece against the weights as it streams (`MasterCheck`); a
parameter whose master does not come back bit for bit (a weight loaded from another compute dtype, a NaN payload)
is named, and the save writes that parameter's master in full (`master/<name>`), as before version 3.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
from torch import Tensor

FROM_WEIGHTS = "weights"  # the fp32 weight in model.safetensors is the master
FROM_BF16 = "bf16+low"  # the bf16 weight, master_low/<name> and master_tie/<name> give the master
TIE = 0x8000  # the low half of an exact tie between two bf16 numbers


def scheme_for(dtype: torch.dtype) -> Optional[str]:
    """How a group of compute weights of `dtype` recovers its masters; None: they are stored in full."""
    return {torch.float32: FROM_WEIGHTS, torch.bfloat16: FROM_BF16}.get(dtype)


def low_key(name: str) -> str:
    return f"master_low/{name}"


def tie_key(name: str) -> str:
    return f"master_tie/{name}"


def tie_bytes(numel: int) -> int:
    return -(-numel // 8)


def split_bf16(master: Tensor, weights: Tensor) -> Tuple[Tensor, Tensor, bool]:
    """(low halves as int16, the tie bits as bool, whether `join_bf16` gives `master` back bit for bit from them
    and `weights`). The high half is the weight's bits, or one less where the master was rounded up in magnitude:
    both signs order by magnitude as bit patterns, and a low half above 0x8000 always rounds up; at exactly 0x8000
    (ties to even) the weight alone cannot tell, so the tie bit says whether it was rounded up."""
    halves = master.contiguous().view(torch.int16).view(-1, 2)  # little-endian: [low, high] per element
    low, high = halves[:, 0], halves[:, 1]
    tie = (low.to(torch.int32) & 0xFFFF == TIE) & (high != weights.view(torch.int16))
    ok = torch.equal(join_bf16(weights, low, tie).view(torch.int32), master.view(torch.int32))
    return low.contiguous(), tie, ok


def join_bf16(weights: Tensor, low: Tensor, tie: Tensor) -> Tensor:
    """The fp32 masters that `weights` (bf16) and their low halves and tie bits encode (see `split_bf16`)."""
    unsigned = low.to(torch.int32) & 0xFFFF
    down = (unsigned > TIE) | tie
    high = ((weights.view(torch.int16).to(torch.int32) & 0xFFFF) - down.to(torch.int32)).to(torch.int16)
    return torch.stack((low, high), dim=1).reshape(-1).view(torch.float32)


def pack_bits(bits: Tensor) -> Tensor:
    """Bools, eight to a byte, the first in the lowest bit."""
    return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))


def unpack_bits(packed: Tensor, first: int, count: int) -> Tensor:
    """Bits [first, first + count) of bytes that hold bits [8 * k, ...) from their first one (first < 8)."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), bitorder="little")[first:first + count].astype(bool))


Put = Callable[[str, int, Tensor], None]  # (tensor name, its first element the data holds, data)


class MasterCheck:
    """A group's master pieces on their way into the optimizer file: written (`master/<name>`) where the layout
    stores them, else checked against the weights (`flat`, the group's compute weights on the host) and, for bf16,
    written as low halves and tie bits. Parameters that fail the check are added to `failed`: the save then
    writes them in full. Pieces of a parameter arrive in order."""

    def __init__(self, masters: Dict[str, str], flat: Optional[Tensor], put: Put, failed: Set[str]) -> None:
        self._masters = masters
        self._flat = flat
        self._put = put
        self.failed = failed
        self._ties: Dict[str, Tuple[int, List[Tensor]]] = {}  # name -> (bits already written, bits pending)

    def piece(self, name: str, numel: int, first: int, lo: int, master: Tensor, stored_from: int = 0) -> None:
        """Elements [first, first + len) of parameter `name` (`numel` of them in all; `lo`: the piece's first
        element in the group; `stored_from`: the parameter's first element the file holds, a rank's part)."""
        scheme = self._masters.get(name)
        if scheme is None:
            self._put(f"master/{name}", first - stored_from, master)
            return
        assert self._flat is not None, f"{name}: a master left out of the file is checked against the weights"
        weights = self._flat[lo:lo + master.numel()]
        if scheme == FROM_WEIGHTS:
            if not torch.equal(master.view(torch.int32), weights.view(torch.int32)):
                self.failed.add(name)
            return
        low, tie, ok = split_bf16(master, weights)
        if not ok:
            self.failed.add(name)
        self._put(low_key(name), first - stored_from, low)
        self._put_ties(name, numel - stored_from, first - stored_from, tie)

    def _put_ties(self, name: str, numel: int, first: int, tie: Tensor) -> None:
        """The tie bits, whole bytes as they fill (a piece may end inside a byte: its last bits wait)."""
        written, pending = self._ties.get(name, (0, []))
        bits = torch.cat([*pending, tie]) if pending else tie
        end = first + tie.numel()
        whole = len(bits) if end == numel else len(bits) // 8 * 8
        if whole:
            self._put(tie_key(name), written // 8, pack_bits(bits[:whole]))
        self._ties[name] = (written + whole, [bits[whole:]] if whole < len(bits) else [])
