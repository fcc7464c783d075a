"""One rank of the sharded-weights GPT-2 test (tests/test_sharded_weights.py, issue 27's first line), started by torchrun.

`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/sharded_gpt2_child.py <repo> <out> <json>`.
The model is built on the meta device and filled from the saved start weights block by block (`weights=`), so no
rank ever holds the whole model; each rank trains on its half of every batch with `shard_weights=True` on the nvme
tier with small budgets (its parts of the weights in its own swap file), and reports its losses, peak RSS growth
(from before the model exists) and swap directory size; rank 0 also the final weights.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])

import offload  # noqa: E402
from tests.proc_status import reset_peak, status  # noqa: E402


def main() -> None:
    out, spec = sys.argv[2], json.loads(open(sys.argv[3]).read())
    import transformers

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    batches = torch.load(spec["batches"])
    model_class = transformers.GPT2LMHeadModel  # its modules imported before the baseline: code, not training memory
    reset_peak()
    base = status("VmRSS")
    config = transformers.GPT2Config.from_pretrained(spec["weights"])
    with torch.device("meta"):
        model = model_class(config)
    swap = os.path.join(out, "swap")
    os.makedirs(swap, exist_ok=True)
    preadv, loaded = os.preadv, [0]

    def counted(fd, buffers, offset):  # the bytes wrap() reads of the start weights (weight_source.py reads by preadv)
        got = preadv(fd, buffers, offset)
        loaded[0] += got
        return got

    os.preadv = counted
    engine = offload.wrap(model, "nvme", nvme_path=swap, dtype=torch.float32, device="cpu", lr=spec["lr"],
                          max_grad_norm=1.0, host_memory=spec["host"], device_memory=spec["device"],
                          shard_weights=True, weights=spec["weights"])
    os.preadv = preadv
    marks = {"wrap": (status("VmHWM") - base, status("RssAnon"), status("RssFile"))}
    losses = []
    for ids in batches:
        part = ids[rank * ids.shape[0] // world:(rank + 1) * ids.shape[0] // world]
        loss = engine(input_ids=part, labels=part).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        marks[f"step{len(losses)}"] = (status("VmHWM") - base, status("RssAnon"), status("RssFile"))
    growth = status("VmHWM") - base
    directory = os.path.join(swap, f"rank-{rank}")
    swap_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}  # a gather: every rank takes part
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    result = dict(loaded=loaded[0], marks=marks, losses=losses, growth=growth, swap_bytes=swap_bytes,
                  shadow_bytes=sum(b.shadow_disk_bytes for b in engine.plan.blocks), shard_world=engine.plan.shard_world,
                  disk=list(engine.plan.disk_weight_blocks), agree=bool(torch.equal(flat, first)))
    engine.close()
    rows = [None] * world
    dist.all_gather_object(rows, result)
    if rank == 0:
        torch.save({"ranks": rows, "weights": state}, os.path.join(out, "result.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
