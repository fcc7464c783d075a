"""One rank of tests/test_rank_agreement.py and tests/test_dp_spilled_micro_batches.py, started by torchrun.

`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/rank_agreement_child.py <repo> <out> <case.json>`.
One case a launch. The process group gets the case's `timeout` (seconds), so that a rank left waiting fails in
seconds, not in gloo's 30 minutes. Each rank writes `<out>/<name>-rank<r>.json`: what happened (`wrapped`,
`error` with its type and message, losses, the engine's group timeouts), and rank 0 the final weights to
`<out>/<name>.pt` when training finished.

A case: `model` (TinyGPT's keyword arguments), `options` (offload.wrap's, dtype by name), `rank1` (rank 1's
overrides: `model`, `options`, `dtype` of the model), `steps`, `micro`, and `alone` (what rank 0 does by itself
after the first step: "state_dict", "save_pretrained", "eval_no_grad", "eval"; rank 1 goes on training, or with
`other="barrier"` waits at a barrier of the default group).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])

import offload  # noqa: E402
from tests.models import TinyGPT, make_batches  # noqa: E402


def part(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tensor.shape[0] // world
    return tensor[rank * per:(rank + 1) * per]


def options_of(case: dict, rank: int, out: str) -> dict:
    options = dict(case.get("options", {}))
    if rank == 1:
        options.update(case.get("rank1", {}).get("options", {}))
    if isinstance(options.get("dtype"), str):
        options["dtype"] = getattr(torch, options["dtype"])
    if options.get("tier") == "nvme":
        options["nvme_path"] = os.path.join(out, f"swap-{case['name']}")
        os.makedirs(options["nvme_path"], exist_ok=True)
    return options


def model_of(case: dict, rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = dict(case.get("model", {}))
    if rank == 1:
        kwargs.update(case.get("rank1", {}).get("model", {}))
    model = TinyGPT(**kwargs)
    if rank == 1 and case.get("rank1", {}).get("dtype"):
        model = model.to(getattr(torch, case["rank1"]["dtype"]))
    return model


def alone(engine, what: str, batch, out: str, name: str):
    """Rank 0's call that the other ranks do not make."""
    if what == "state_dict":
        return len(engine.state_dict())
    if what == "save_pretrained":
        return engine.save_pretrained(os.path.join(out, f"export-{name}"))
    idx, tgt = batch
    if what == "eval_no_grad":
        with torch.no_grad():
            return float(engine(idx, tgt))
    if what == "eval":  # eval mode, gradients on: pairs with the other rank's training forward, then goes astray
        engine.module.eval()
        try:
            return float(engine(idx, tgt).detach())
        finally:
            engine.module.train()
    raise AssertionError(what)


def run(case: dict, out: str, report: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = offload.wrap(model_of(case, rank), **options_of(case, rank, out))
    report["wrapped"] = True
    dp = engine.data_parallel
    report["timeouts"] = [_timeout_of(dp.group), _timeout_of(dp.gather_group)]
    losses = []
    for step_index, step in enumerate(make_batches(case.get("steps", 2), case.get("micro", 1))):
        if case.get("alone") and step_index == 1:
            if rank == 0:
                report["alone_result"] = str(alone(engine, case["alone"], (part(step[0][0], rank, world),
                                                                             part(step[0][1], rank, world)),
                                                   out, case["name"]))
            elif case.get("other") == "barrier":
                dist.barrier()
        for idx, tgt in step:
            loss = engine(part(idx, rank, world), part(tgt, rank, world))
            (loss / len(step)).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        engine.step()
        engine.zero_grad()
    report["losses"] = losses
    report["plan"] = dict(grads_on_disk=engine.plan.grads_on_disk, shard_world=engine.plan.shard_world,
                          parked_grads=[b.grad_parks for b in engine.plan.blocks])
    report["stats"] = {k: v for k, v in engine.stats().items() if "grads" in k or "speculat" in k}
    state = engine.state_dict()
    engine.close()
    if rank == 0:
        torch.save(state, os.path.join(out, f"{case['name']}.pt"))


def _timeout_of(group) -> float:
    from offload.scheduler.torch_internals import group_timeout

    timeout = group_timeout(group)
    return -1.0 if timeout is None else timeout.total_seconds()


def main() -> None:
    out = sys.argv[2]
    case = json.loads(open(sys.argv[3]).read())
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=case.get("timeout", 120)))
    rank = dist.get_rank()
    report: dict = {"wrapped": False}
    try:
        run(case, out, report)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report.update(error=type(exc).__name__, message=str(exc), traceback=traceback.format_exc()[-3000:])
    with open(os.path.join(out, f"{case['name']}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    os._exit(0)  # an engine left in a failed collective is not closed: its groups may not be usable


if __name__ == "__main__":
    main()
