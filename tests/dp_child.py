"""One rank of the data-parallel tests (tests/test_data_parallel.py), started by torchrun.

`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dp_child.py <repo> <out> <cases.json>`.
Each case trains TinyGPT data-parallel, every rank on its part of each batch, checks after every step
that the ranks' weights are bit-identical, and (rank 0) writes the losses, weights and stats to
`<out>/<case name>.pt`. Rank 1 starts from other weights: the engine must start every rank from rank 0's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])

import offload  # noqa: E402
from offload.errors import OffloadError  # noqa: E402
from tests.models import TinyGPT, make_batches  # noqa: E402


def rank_part(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = tensor.shape[0] // world
    return tensor[rank * per:(rank + 1) * per]


def weights_agree(engine) -> bool:
    """Every rank's weights equal rank 0's, bit for bit."""
    flat = torch.cat([v.detach().reshape(-1).float() for v in engine.state_dict().values()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    return bool(torch.equal(flat.view(torch.int32), first.view(torch.int32)))


def train(case: dict, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0 if rank == 0 else 1000 + rank)
    model = TinyGPT()
    freeze(model, case)
    options = dict(tier=case["tier"], dtype=torch.float32, device="cpu", lr=case.get("lr", 1e-2),
                   weight_decay=case.get("weight_decay", 0.0))  # the reference's (torch AdamW given it too)
    if case["tier"] == "nvme":
        options["nvme_path"] = os.path.join(out, f"swap-{case['name']}")
        os.makedirs(options["nvme_path"], exist_ok=True)
    for key in ("max_grad_norm", "grad_accumulation_steps", "weight_decay", "moments", "shard_weights", "host_memory",
                "device_memory", "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"):
        if key in case:
            options[key] = case[key]
    load = case.get("load")
    if case.get("expect_error"):  # refused at wrap() on every rank: each notes the message
        try:
            offload.wrap(model, **options)
        except offload.OffloadConfigError as exc:
            with open(os.path.join(out, f"{case['name']}-rank{rank}.txt"), "w") as f:
                f.write(str(exc))
            return
        raise AssertionError(f"{case['name']}: wrap() was not refused")
    engine = offload.wrap(model, **options)
    if load:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load(os.path.join(out, load))
        if case.get("load_warnings"):  # what the load warned, for the test to read
            with open(os.path.join(out, f"{case['name']}-load-rank{rank}.txt"), "w") as f:
                f.write("\n".join(str(w.message) for w in caught))
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    batches = make_batches(case["steps"], case["micro"], batch=case.get("batch", 4), seed=case.get("seed", 0))
    losses, agree = [], []
    done = case.get("skip", 0)
    for step in batches[done:]:
        if case.get("save_at") == done:
            engine.save(os.path.join(out, case["save"]))
        for idx, tgt in step:
            loss = engine(rank_part(idx, rank, world), rank_part(tgt, rank, world))
            if tuple(case.get("nan_at") or ()) == (done, rank):  # one rank's gradients non-finite at this step
                loss = loss * float("nan")
            (loss / len(step)).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        if case.get("clip_by_call"):
            engine.clip_grad_norm_(case["clip_by_call"])
        engine.step()
        engine.zero_grad()
        agree.append(weights_agree(engine))
        done += 1
    if case.get("save") and case.get("save_at", done) == done:
        if case.get("fail_rank") is None:
            engine.save(os.path.join(out, case["save"]))
        else:
            save_failing(engine, case, out)
            engine.close()
            return
    if case.get("torch_state"):
        torch_state_round_trip(engine, options, case, out)
    if case.get("drop"):  # dropped without close(): released by the collector, each rank on its own
        import gc

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del engine
            gc.collect()
        with open(os.path.join(out, f"{case['name']}-rank{rank}.txt"), "w") as f:
            f.write("\n".join(str(w.message) for w in caught))
        return
    if case.get("export"):  # every rank calls it, as engine.save (sharded weights: its reads are gathers)
        engine.save_pretrained(os.path.join(out, case["export"]))
    state = engine.state_dict()
    stats = engine.stats()
    plan = dict(shard_world=engine.plan.shard_world, disk=list(engine.plan.disk_weight_blocks),
                swap_bytes=dist_all(swap_bytes(options.get("nvme_path"), rank)),
                shadow_bytes=sum(b.shadow_disk_bytes for b in engine.plan.blocks))  # speculative clipping's
    engine.close()
    ddp, ddp_optimizer = train_ddp(case) if case.get("ddp") else (None, None)
    if rank == 0:
        torch.save({"losses": losses, "agree": agree, "weights": state, "stats": stats, "ddp_weights": ddp,
                    "ddp_optimizer": ddp_optimizer, "plan": plan}, os.path.join(out, f"{case['name']}.pt"))


def freeze(model, case: dict) -> None:
    """The parameters named by the case's `freeze` prefixes stop training (partially frozen blocks)."""
    for name, param in model.named_parameters():
        if name.startswith(tuple(case.get("freeze", ()))):
            param.requires_grad_(False)


def swap_bytes(nvme_path, rank: int) -> int:
    """Bytes of this rank's swap directory (its files' allocated size), 0 without one."""
    if not nvme_path:
        return 0
    directory = os.path.join(nvme_path, f"rank-{rank}")
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def dist_all(value):
    """Every rank's value, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def torch_state_round_trip(engine, options: dict, case: dict, out: str) -> None:
    """Each rank's engine.optimizer.state_dict() (a collective: the whole state on every rank), and whether a
    fresh engine loading it gives it back unchanged (each rank taking its part)."""
    rank = dist.get_rank()
    saved = engine.optimizer.state_dict()
    if "nvme_path" in options:
        options = dict(options, nvme_path=options["nvme_path"] + "-fresh")
        os.makedirs(options["nvme_path"], exist_ok=True)
    fresh = offload.wrap(TinyGPT(), **options)
    fresh.optimizer.load_state_dict(saved)
    again = fresh.optimizer.state_dict()
    fresh.close()
    same = again["param_groups"] == saved["param_groups"] and all(
        torch.equal(again["state"][k][n], v) for k, entry in saved["state"].items() for n, v in entry.items())
    torch.save({"state_dict": saved, "round_trip_equal": same and again["state"].keys() == saved["state"].keys()},
               os.path.join(out, f"{case['name']}-optimizer-rank{rank}.pt"))


def save_failing(engine, case: dict, out: str) -> None:
    """engine.save with rank `fail_rank`'s disk full while it writes its part; each rank notes its error."""
    import offload.checkpoint.sharded as sharded

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if dist.get_rank() == case["fail_rank"] and case.get("fail_in") == "weights":  # its 3rd tensor of the model file
        from offload.checkpoint.tensor_file import TensorFileWriter

        write, calls = TensorFileWriter.write, [0]

        def third_fails(self, name, tensor):
            calls[0] += 1
            if calls[0] == 3:
                disk_full()
            return write(self, name, tensor)

        TensorFileWriter.write = third_fails
    elif dist.get_rank() == case["fail_rank"]:
        sharded._write_part_file = disk_full
    try:
        engine.save(os.path.join(out, case["save"]))
        message = "saved"
    except OffloadError as exc:
        message = str(exc)
    with open(os.path.join(out, f"{case['name']}-rank{dist.get_rank()}.txt"), "w") as f:
        f.write(message)


def train_ddp(case: dict) -> tuple:
    """The same run with torch's DistributedDataParallel and torch.optim.AdamW: the reference for the
    arithmetic of data parallelism (gradients averaged across the ranks). Its weights and optimizer state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=case.get("lr", 1e-2), weight_decay=case.get("weight_decay", 0.0),
                            foreach=False)
    max_norm = case.get("max_grad_norm", case.get("clip_by_call"))
    for step in make_batches(case["steps"], case["micro"], batch=case.get("batch", 4), seed=case.get("seed", 0)):
        for i, (idx, tgt) in enumerate(step):
            sync = model.no_sync() if i + 1 < len(step) else contextlib.nullcontext()
            with sync:
                (model(rank_part(idx, rank, world), rank_part(tgt, rank, world)) / len(step)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, opt.state_dict()


def misuse(case: dict, out: str) -> None:
    """Refused on every rank: DDP around the engine's module (at the forward); torch's clip_grad_norm_ over
    this rank's own gradients (not their average across the ranks)."""
    model = TinyGPT()
    engine = offload.wrap(model, tier="cpu", dtype=torch.float32, device="cpu")
    (idx, tgt), = make_batches(1, 1)[0]
    message = ""
    try:
        if case["misuse"] == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(engine.module)
            ddp(idx, tgt).backward()
        else:
            engine(idx, tgt).backward()
            torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)
    except OffloadError as exc:
        message = str(exc)
    engine.close()
    with open(os.path.join(out, f"{case['name']}-rank{dist.get_rank()}.txt"), "w") as f:
        f.write(message)


def main() -> None:
    out = sys.argv[2]
    cases = json.loads(open(sys.argv[3]).read())
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    dist.init_process_group("gloo")
    try:
        for case in cases:
            (misuse if case.get("misuse") else train)(case, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
