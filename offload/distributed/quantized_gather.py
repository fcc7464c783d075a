"""ZeRO++'s quantized weight communication (qwZ, Wang et al. 2023): under sharded weights, each rank's part is
sent as int8 codes with one fp32 scale per block of `BLOCK` elements, and every rank decodes every part into
the compute dtype: 1.06 bytes an element on the wire instead of 2 (bf16) or 4 (fp32).

Only the gathers that feed compute are quantized (a block's forward and backward); reads of the weights
(`state_dict`, `save`, `save_pretrained`) gather them exactly, and the fp32 master weights and the update never
see a code. Every rank decodes the same bytes, so every rank computes with the same weights, its own part included.
"""

from __future__ import annotations

import torch
from torch import Tensor

# elements sharing one scale: 256 kept a 200-step run within 2.5% of exact sharded training's loss, 64 within 0.7%
# (`bench_dp.py --plot`, a GPT of 2 x 128), for 6% more bytes
BLOCK = 64
_LEVELS = 127  # symmetric: codes -127..127, so that x and -x encode alike


class Int8Blocks:
    """Block-wise absmax int8: scale = max|x| / 127 over each block, code = round(x / scale)."""

    block = BLOCK

    def packed_nbytes(self, numel: int) -> int:
        """Bytes of one part of `numel` elements on the wire: its codes, then its blocks' fp32 scales."""
        return numel + 4 * self.blocks(numel)

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encode(self, part: Tensor) -> Tensor:
        """`part` (any float dtype, 1-D) as the packed uint8 bytes `decode` reads."""
        numel = part.numel()
        blocks = self.blocks(numel)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=part.device)
        padded[:numel].copy_(part)
        values = padded.view(blocks, self.block)
        scales = values.abs().amax(dim=1) / _LEVELS
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(values / divisor[:, None]).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
        packed = torch.empty(self.packed_nbytes(numel), dtype=torch.uint8, device=part.device)
        packed[:numel].copy_(codes.view(-1)[:numel].view(torch.uint8))
        packed[numel:].copy_(scales.view(torch.uint8))
        return packed

    def decode(self, packed: Tensor, numel: int, out: Tensor) -> None:
        """Write the `numel` elements `packed` holds into `out` (its dtype: the compute dtype)."""
        if numel == 0:
            return
        blocks = self.blocks(numel)
        codes = torch.zeros(blocks * self.block, dtype=torch.int8, device=packed.device)
        codes[:numel].copy_(packed[:numel].view(torch.int8))
        scales = packed[numel:numel + 4 * blocks].clone().view(torch.float32)
        values = codes.view(blocks, self.block).to(torch.float32) * scales[:, None]
        out.copy_(values.view(-1)[:numel])

    def describe(self) -> str:
        return f"int8 blocks of {self.block} with an fp32 scale each"
