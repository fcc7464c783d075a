"""One rank of tests/test_quantized_collectives.py: the quantized reduce-scatter (ZeRO++'s qgZ) against the exact
mean, in one level and in two (ranks numbered as `machines` machines of `world / machines` ranks)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])

from offload.distributed.data_parallel import DataParallel  # noqa: E402
from offload.distributed.quantized_gather import Int8Blocks  # noqa: E402


def main() -> None:
    out, machines = sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = world // machines
    dp = DataParallel(world, rank, local, rank % local, "test")
    dp.quantize_gradient_reduction(Int8Blocks())
    n = 3000  # not a multiple of the world or of a block
    shard = dp.shard_of(n)
    gen = torch.Generator().manual_seed(rank)
    full = torch.zeros(shard.padded)
    full[:n] = torch.randn(n, generator=gen) * torch.logspace(-2, 1, n)
    every = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(every, full)
    exact = torch.stack(every).mean(dim=0)[shard.lo:shard.hi]
    part = torch.empty(shard.size)
    dp.reduce_scatter_mean(full, shard, part)
    error = float((part[:shard.numel] - exact).abs().max())
    scale = float(torch.stack(every).abs().max())
    result = dict(rank=rank, two_levels=dp.reduces_in_two_levels, error=error, scale=scale,
                  changed=not torch.equal(part[:shard.numel], exact))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
