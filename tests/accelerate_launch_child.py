"""accelerate's own loop under `accelerate launch` (tests/test_accelerate_launch.py): one process of it.

`accelerate launch --multi_gpu --num_processes 2 tests/accelerate_launch_child.py <repo> <out> <cases.json>`
(or plain `python` for one process). Each case runs the loop a user writes for torch's AdamW: `prepare(model,
optimizer, scheduler, loader)`, `accumulate(model)` over 2 micro-batches a step, `backward`, `clip_grad_norm_`
on the last micro-batch, a LambdaLR, `gather_for_metrics` of the loss, `save_state` at a step boundary and, in a
later case, `load_state` and the rest. `engine` false is the reference: torch.optim.AdamW, which accelerate puts
in DistributedDataParallel with several processes. Rank 0 writes `<out>/<name>.pt`: the gathered losses, the
clip norms, the final weights, and whether every rank's weights are bit-identical to rank 0's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])

import accelerate  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import offload  # noqa: E402
from tests.models import TinyGPT  # noqa: E402

LR, WD, MAX_NORM, ACCUMULATE, STEPS, PER_RANK = 1e-2, 0.1, 0.5, 2, 6, 2
SAMPLES = STEPS * ACCUMULATE * PER_RANK * 2  # two ranks' worth; one process takes 2 x PER_RANK a micro-batch


def dataset() -> TensorDataset:
    tokens = torch.randint(0, 64, (SAMPLES, 17), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def weights_agree(weights: dict) -> bool:
    """Every rank's weights equal rank 0's, bit for bit."""
    if not dist.is_initialized():
        return True
    flat = torch.cat([v.reshape(-1).float() for v in weights.values()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    return bool(torch.equal(flat.view(torch.int32), first.view(torch.int32)))


def run(accelerator: accelerate.Accelerator, case: dict, out: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    engine, streamed = None, []
    if case["engine"]:
        options = dict(tier=case["tier"], dtype=torch.float32, device="cpu", lr=LR, weight_decay=WD,
                       shard_weights=case.get("shard", False))
        options.update(case.get("options", {}))
        if case["tier"] == "nvme":
            options["nvme_path"] = os.path.join(out, f"swap-{case['name']}")
            os.makedirs(options["nvme_path"], exist_ok=True)
        engine = offload.wrap(model, **options)
        model, optimizer, streamed = engine.module, engine.optimizer, list(engine.plan.streamed_blocks)
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                                      foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.5 * step))
    batch = PER_RANK * (2 if accelerator.num_processes == 1 else 1)  # one process: both ranks' samples
    loader = DataLoader(dataset(), batch_size=batch, shuffle=False)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    wrapped = type(model).__name__
    done = 0
    if case.get("load"):
        accelerator.load_state(os.path.join(out, case["load"]))
        done = case["load_at"]
        loader = accelerator.skip_first_batches(loader, done * ACCUMULATE)
    losses, norms = [], []
    if case.get("clip_part"):  # part of a data-parallel engine's parameters: refused on every rank
        accelerator.backward(model(*next(iter(loader))))
        try:
            accelerator.clip_grad_norm_(list(model.parameters())[:2], MAX_NORM)
        except offload.OffloadError as exc:
            norms.append(str(exc))
        optimizer.zero_grad()
        loader = []
    for micro, (idx, tgt) in enumerate(loader):
        if case.get("save") and micro == (case["save_at"] - done) * ACCUMULATE:
            accelerator.save_state(os.path.join(out, case["save"]))
        with accelerator.accumulate(model):
            loss = model(idx, tgt)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather_for_metrics(loss.detach()[None]).tolist())
    if engine is not None:
        weights = engine.state_dict()
        engine.close()
    else:
        weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    agree = weights_agree(weights)
    accelerator.free_memory()
    if accelerator.is_main_process:
        torch.save({"losses": losses, "norms": norms, "weights": weights, "agree": agree, "wrapped": wrapped,
                    "streamed": streamed, "world": accelerator.num_processes}, os.path.join(out, f"{case['name']}.pt"))
    accelerator.wait_for_everyone()


def main() -> None:
    out, cases = sys.argv[2], json.loads(open(sys.argv[3]).read())
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    for case in cases:
        run(accelerator, case, out)


if __name__ == "__main__":
    main()
