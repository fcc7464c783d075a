"""One rank of tests/test_launchers.py: an offload training script as users write one for any launcher.

`<launcher> tests/launcher_child.py [--local-rank=N | --local_rank=N] <repo> <out>`: reads the legacy launchers'
`--local-rank` / `--local_rank` argument with argparse (as torch.distributed.launch's documentation asks of a
script), starts the process group from the environment the launcher set (`init_process_group("gloo")`), wraps
TinyGPT and trains 3 steps of 2 micro-batches with clipping, each rank on its half of every batch. Rank 0 writes
`<out>/result.pt`: every rank's (rank, world, local rank, local world, what said it, the argument) as the
engine found them, the averaged losses and the final weights, and whether the ranks' weights are bit-identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

# the repository: the first argument that is no option (deepspeed puts --local_rank=N before the script's own)
sys.path.insert(0, next(arg for arg in sys.argv[1:] if not arg.startswith("--")))

import offload  # noqa: E402
from tests.models import TinyGPT, make_batches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repo")
    parser.add_argument("out")
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    engine = offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu", lr=1e-2, max_grad_norm=0.5)
    dp = engine.data_parallel
    assert dp is not None
    found = dict(rank=dp.rank, world=dp.world, local_rank=dp.local_rank, local_world=dp.local_world, place=dp.place,
                 argument=args.local_rank)
    per = 4 // dp.world
    losses = []
    for step in make_batches(3, 2):
        for idx, tgt in step:
            part = slice(dp.rank * per, (dp.rank + 1) * per)
            loss = engine(idx[part], tgt[part])
            (loss / len(step)).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / dp.world)
        engine.step()
        engine.zero_grad()
    weights = engine.state_dict()
    flat = torch.cat([v.reshape(-1).float() for v in weights.values()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    agree = bool(torch.equal(flat.view(torch.int32), first.view(torch.int32)))
    everyone = [None] * dp.world
    dist.all_gather_object(everyone, dict(found, agree=agree))
    engine.close()
    if dp.rank == 0:
        torch.save({"found": everyone, "losses": losses, "weights": weights}, os.path.join(args.out, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
