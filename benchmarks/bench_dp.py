"""Data-parallel training on several ranks: offload's data-parallel modes (replicated and sharded weights) against
torch DDP + AdamW (and DeepSpeed ZeRO-2 and ZeRO-3 with CPU offload where it imports).

    python benchmarks/bench_dp.py [--nproc 2 --layers 4 --dim 512 --vocab 4096 --context 128 --batch 8]
                                  [--rounds 4 --steps 5 --warmup 2] [--nvme-path DIR] [--quick]
                                  [--host-memory BYTES --device-memory BYTES]   # the "weights on disk" row's budgets
    python benchmarks/bench_dp.py --backend nccl --dtype bfloat16     # a GPU machine: rank r on cuda:LOCAL_RANK

Every rival trains the same model (the demo's GPT, tied embedding and output; built with seed 0 on every
rank) on the same token batches, each rank on its 1/nproc slice of the global batch of `--batch` sequences.
A launch is one `torchrun --standalone --nproc_per_node N` of this file in worker mode for one rival: it
builds the model, wraps it, runs `--warmup` untimed steps and `--steps` timed ones (forward, backward,
step, zero_grad; a barrier before each, outside the timing; step() returns with the updates applied), and
each rank writes a JSON of its results. Rivals are alternated round by round (`--rounds`), the order rotated
each round, so slow phases of a shared machine hit every rival. A step's time is the slowest rank's; the
table gives the median over all timed steps of all rounds with the p20-p80 and min-max spreads.

Rivals:
  offload cpu replicated   offload.wrap(tier="cpu", grad_accumulation_steps=1, shard_weights=False): every rank
                 keeps the whole compute weights; gradients reduce-scattered per block on the step worker during
                 backward, each rank steps its 1/N of the fp32 master weights and Adam moments, all-gathers the
                 new weights.
  offload nvme replicated  the same with the optimizer state in a swap file per rank under --nvme-path.
  offload cpu sharded      tier="cpu", shard_weights=True (ZeRO-3): each rank keeps 1/N of every block's weights
                 (its state part is the trainable elements of that part), all-gathered whole for each use (the
                 forward, and again for the backward's recomputation of what it needs); gradients
                 reduce-scattered as above; the update writes the rank's own part, nothing is gathered after it.
  offload nvme sharded     the same with the optimizer state in the rank's swap file.
  offload nvme sharded, weights on disk   tier="nvme", shard_weights=True, host_memory and device_memory small
                 (`--host-memory`, default 1.25x the whole model's compute-dtype weight bytes; `--device-memory`,
                 default 1.15x the largest block's weights plus the largest parameter's gradient, the least a
                 block's compute needs) so each rank's weight parts of some blocks live in its swap file; the
                 worker checks `engine.plan.disk_weight_blocks` is not empty and the row's note names them.
  torch DDP      DistributedDataParallel + torch.optim.AdamW(fused=True) (foreach where fused is refused on
                 this device: the row says so); every rank holds the whole optimizer state.
  DeepSpeed ZeRO-2  offload_optimizer {device: cpu} (DeepSpeed's CPU Adam), where `import deepspeed` works;
                 else the table says why it was skipped.
  DeepSpeed ZeRO-3  stage 3, offload_optimizer and offload_param {device: cpu}, where `import deepspeed` works.
The offload rows pass shard_weights explicitly, so the default (None: shard when the weights do not fit
host_memory) cannot change a row's mode; the worker checks `engine.plan.shard_world` matches the row.

Memory per rank: peak RSS is VmHWM of /proc/self/status, reset (clear_refs 5) after the imports, the process
group and the model are built, so `peak_rss` is the whole process's peak and `rss_growth` what the training
setup and steps added on top of that baseline. Optimizer state per rank: `engine.stats()
["optimizer_state_bytes"]` for offload (fp32 master + m + v of this rank's part: 12 B/param / N); the
tensors in `optimizer.state` for torch (m, v and step: 8 B/param, whole; the fp32 parameters are its
master weights and are not counted); DeepSpeed: its fp32 partition plus its CPU Adam's state. `swap_MB`:
the apparent size (st_size) of the files in the rank's swap directory (nvme_path/rank-<r>/) after the timed
steps: optimizer state, and the rank's weight parts where the plan puts weights on disk.

Collectives, measured: before wrap(), each rank's worker replaces torch.distributed's all_gather,
all_gather_into_tensor, reduce_scatter_tensor, reduce_scatter, all_reduce, broadcast, all_to_all_single (and
the object collectives, calls only) with wrappers that count calls and tensor bytes, then call the original;
offload calls them as `dist.<name>` at call time, so it goes through the wrappers. Only calls during the
timed steps count (the benchmark's own barrier has no payload). Each call's bytes are what one rank sends
under the bandwidth-optimal (ring) algorithm, from the sizes of the tensors the call was given:
all-gather (N-1)/N of the gathered whole, reduce-scatter (N-1)/N of the reduced whole, all-reduce 2(N-1)/N
of the tensor, broadcast the tensor (gloo's own algorithms may move more; the payload sizes are exact).
Columns, per step per rank: `gather_MB` (all_gather, all_gather_into_tensor), `reduce_MB` (reduce_scatter*,
all_reduce), `other_MB` (broadcast, all_to_all), `calls` (collective calls, all kinds), `comm_vs_ddp`
(the highest rank's total against DDP's). torch DDP reduces through its C++ reducer, which bypasses the
Python functions: its row's reduce_MB is COMPUTED, not measured, as 2(N-1)/N x the gradient bytes
(4 B per trainable fp32 parameter) per step, and says so; its calls are blank. DeepSpeed's rows count
what deepspeed.comm routes through torch.distributed's functions (unchecked here where it is not installed).

A failed launch is reported by the rank's exception (the whole output of torchrun is appended to the file
named by the environment variable BENCH_DP_LOG, where set); the benchmark then exits 1. DeepSpeed is
optional: where it does not import, or fails, its row says why and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_header, print_table, summarize  # noqa: E402

RIVALS = {  # key: label
    "offload-cpu": "offload cpu replicated (DP)",
    "offload-nvme": "offload nvme replicated (DP)",
    "offload-cpu-sharded": "offload cpu sharded (ZeRO-3)",
    "offload-nvme-sharded": "offload nvme sharded (ZeRO-3)",
    "offload-nvme-sharded-disk": "offload nvme sharded, weights on disk",
    "offload-cpu-sharded-qwz": "offload cpu sharded, quantized weight gathers (qwZ)",
    "offload-cpu-sharded-qgz": "offload cpu sharded, quantized gradient reduction (qgZ)",
    "offload-cpu-sharded-hpz": "offload cpu sharded, secondary partition per node (hpZ)",
    "offload-cpu-sharded-zpp": "offload cpu sharded, qwZ + hpZ + qgZ",
    "ddp": "torch DDP + AdamW",
    "deepspeed": "DeepSpeed ZeRO-2, CPU offload",
    "deepspeed-zero3": "DeepSpeed ZeRO-3, CPU offload",
}
OFFLOAD = {  # rival: (tier, shard_weights, small host and device budgets, ZeRO++ options)
    "offload-cpu": ("cpu", False, False, {}),
    "offload-nvme": ("nvme", False, False, {}),
    "offload-cpu-sharded": ("cpu", True, False, {}),
    "offload-nvme-sharded": ("nvme", True, False, {}),
    "offload-nvme-sharded-disk": ("nvme", True, True, {}),
    "offload-cpu-sharded-qwz": ("cpu", True, False, {"zero_quantized_weights": True}),
    "offload-cpu-sharded-qgz": ("cpu", True, False, {"zero_quantized_gradients": True}),
    "offload-cpu-sharded-hpz": ("cpu", True, False, {"zero_hpz_partition_size": "node"}),
    "offload-cpu-sharded-zpp": ("cpu", True, False, {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                                     "zero_hpz_partition_size": "node"}),
}
SHARDED_EXACT = "offload-cpu-sharded"  # what the ZeRO++ rows' bytes are compared with
TRAFFIC = ("bytes_weights_within_machine", "bytes_weights_across_machines", "bytes_grads_within_machine",
           "bytes_grads_across_machines")  # engine.stats(): what the collectives brought a rank
DEEPSPEED = ("deepspeed", "deepspeed-zero3")
REFERENCE = "ddp"


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) per node")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes: N torchrun launchers (--nnodes N --node_rank i) meeting on 127.0.0.1, as N "
                             "machines would; the traffic columns split what crosses between them")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="gloo: ranks on the CPU; nccl: rank r on cuda:LOCAL_RANK (needs CUDA)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split across the ranks")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per launch before the timed ones")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="offload's compute dtype; torch DDP keeps fp32 parameters under autocast to it")
    parser.add_argument("--rivals", default=",".join(RIVALS),
                        help=f"comma-separated subset of {', '.join(RIVALS)}")
    parser.add_argument("--nvme-path", default=None, help="directory for the nvme tier's swap files (default: tmp)")
    parser.add_argument("--host-memory", default=None,
                        help="host_memory per rank of the 'weights on disk' row (bytes or '64MB'; default 1.25x the "
                             "whole model's weight bytes)")
    parser.add_argument("--device-memory", default=None,
                        help="device_memory per rank of the 'weights on disk' row (default 1.15x the largest block's "
                             "weights plus the largest parameter's gradient)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 round of 2 steps (a smoke run)")
    parser.add_argument("--data", choices=["random", "markov"], default="random",
                        help="random tokens, or the demo's Markov chain (a loss that falls: for --plot)")
    parser.add_argument("--plot", default=None,
                        help="a PNG of every rival's loss per step (round 1, warm-up included), and each ZeRO++ row's "
                             "largest relative distance to exact sharded training after the first 20 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.vocab, args.context, args.batch = 2, 64, 512, 32, 4
        args.rounds, args.steps, args.warmup = 1, 2, 1
    if args.batch % (args.nproc * args.nnodes):
        parser.error(f"--batch {args.batch} must split evenly across the {args.nproc * args.nnodes} ranks")
    unknown = [r for r in args.rivals.split(",") if r not in RIVALS]
    if unknown:
        parser.error(f"unknown rivals {unknown}; choose from {list(RIVALS)}")
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            parser.error("--backend nccl needs CUDA, but torch.cuda.is_available() is False on this machine "
                         f"(torch {torch.__version__}); use --backend gloo to run the ranks on the CPU")
        if torch.cuda.device_count() < args.nproc:
            parser.error(f"--backend nccl puts each rank on its own GPU: --nproc {args.nproc} but "
                         f"{torch.cuda.device_count()} CUDA devices")
    return args


# ----- worker: one rank of one launch ----------------------------------------------------------------------
def make_batches(args: argparse.Namespace) -> List[tuple]:
    """The global batches of one launch (warm-up then timed), the same in every launch and on every rank: random
    tokens, or (`--data markov`) windows of the demo's Markov chain, whose loss falls (for the loss curves)."""
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.context)
    count = args.warmup + args.steps
    if getattr(args, "data", "random") == "markov":
        from offload.cli.demo_data import markov_tokens

        stream = torch.from_numpy(markov_tokens(count * args.batch * (args.context + 1), args.vocab).astype("int64"))
        windows = stream.view(count, args.batch, args.context + 1)
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
    return [(torch.randint(0, args.vocab, shape, generator=gen), torch.randint(0, args.vocab, shape, generator=gen))
            for _ in range(count)]


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) optimizer state."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def torch_adamw(params, lr: float, device: torch.device):
    """AdamW(fused=True) if this device runs it (one trial step on a scratch tensor), else foreach."""
    try:
        probe = torch.zeros(4, device=device, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        trial = torch.optim.AdamW([probe], lr=lr, fused=True)
        trial.step()
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError) as exc:
        note = f"foreach (fused unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True), note


def deepspeed_state_bytes(ds_engine) -> int:
    zero = ds_engine.optimizer
    total = tensor_bytes(getattr(zero, "single_partition_of_fp32_groups", []))  # ZeRO-1/2
    total += tensor_bytes(getattr(zero, "fp32_partitioned_groups_flat", []))  # ZeRO-3
    inner = getattr(zero, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        total += tensor_bytes(dict(inner.state))
    return total


class CollectiveMeter:
    """Counts the collectives a rank calls through torch.distributed's module functions: calls, and the bytes one
    rank sends under the ring algorithm (see the module docstring), by kind. Installed on the module before
    wrap(); the engine's step worker and training thread both call through it (a lock keeps the counts)."""

    KIND = {"all_gather": "gather", "all_gather_into_tensor": "gather", "reduce_scatter_tensor": "reduce",
            "reduce_scatter": "reduce", "all_reduce": "reduce", "broadcast": "other", "all_to_all_single": "other",
            "all_gather_object": "other", "broadcast_object_list": "other"}

    def __init__(self, dist, world: int) -> None:
        import threading

        self.dist, self.world = dist, world
        self.lock = threading.Lock()
        self.counting = False
        self.bytes = {"gather": 0.0, "reduce": 0.0, "other": 0.0}
        self.calls = 0

    def install(self) -> None:
        for name in self.KIND:
            original = getattr(self.dist, name, None)
            if original is not None:
                setattr(self.dist, name, self._counting(name, original))

    def start(self) -> None:
        with self.lock:
            self.counting = True
            self.bytes = dict.fromkeys(self.bytes, 0.0)
            self.calls = 0

    def stop(self) -> dict:
        with self.lock:
            self.counting = False
            return dict(self.bytes, calls=self.calls)

    def _counting(self, name: str, original):
        kind = self.KIND[name]

        def counted(*args, **kwargs):
            if self.counting:
                sent = self._sent(name, args, kwargs)
                with self.lock:
                    self.bytes[kind] += sent
                    self.calls += 1
            return original(*args, **kwargs)
        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    def _sent(self, name: str, args: tuple, kwargs: dict) -> float:
        """Bytes one rank sends for this call under the ring algorithm, from the tensors it was given."""
        n = self.world
        share = (n - 1) / n
        first = args[0] if args else next(iter(kwargs.values()), None)
        second = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input"))
        if name == "all_gather":  # (outputs: list, input): the gathered whole is the outputs
            return share * tensor_bytes(list(first))
        if name == "all_gather_into_tensor":  # (output, input)
            return share * tensor_bytes(first)
        if name == "reduce_scatter_tensor":  # (output, input): the reduced whole is the input
            return share * tensor_bytes(second)
        if name == "reduce_scatter":  # (output, inputs: list)
            return share * tensor_bytes(list(second))
        if name == "all_reduce":
            return 2 * share * tensor_bytes(first)
        if name in ("broadcast", "all_to_all_single"):
            return float(tensor_bytes(first))
        return 0.0  # object collectives: pickled sizes are not seen here; their calls are counted


def disk_budgets(args: argparse.Namespace, model: torch.nn.Module, dtype: torch.dtype) -> tuple:
    """host_memory and device_memory of the 'weights on disk' row: the options, else small enough that each rank
    keeps some blocks' weight parts in its swap file (see the module docstring)."""
    size = dtype.itemsize
    params = list(model.parameters())
    whole = sum(p.numel() for p in params) * size
    largest_param = max(p.numel() for p in params) * size
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in model.h] + [model.wte.weight.numel()]
    host = args.host_memory if args.host_memory else int(1.25 * whole)
    device = args.device_memory if args.device_memory else int(1.15 * (max(blocks) * size + largest_param))
    return host, device


def _mb(value) -> str:
    """A budget (bytes, or a string like '64MB') in MB."""
    from offload.policy import parse_bytes

    return f"{(parse_bytes(value, 'budget') or 0) / 1e6:.1f} MB"


def swap_bytes(directory: str) -> int:
    """The apparent size of the files under `directory` (0 where it does not exist)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def worker(spec_path: str) -> None:
    """One rank of one launch: `bench_dp.py worker SPEC.json` under torchrun (SPEC: the launcher's options
    plus worker, round, out, swap; a file, as options after the script would clash with torchrun's own)."""
    import warnings

    import torch.distributed as dist

    import offload
    from offload._system import usable_cores
    from offload.cli.demo import DemoGPT
    from tests.proc_status import CAN_RESET_PEAK, reset_peak, status

    warnings.simplefilter("ignore", UserWarning)
    with open(spec_path) as f:
        args = argparse.Namespace(**json.load(f))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("bench_dp worker: --backend nccl needs CUDA (torch.cuda.is_available() is False)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, usable_cores() // local_world))  # the ranks of this machine share its cores
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = DemoGPT(args.vocab, args.dim, args.layers, args.context, heads=4)
    n_params = sum(p.numel() for p in model.parameters())
    per = args.batch // world
    batches = [(i[rank * per:(rank + 1) * per].to(device), t[rank * per:(rank + 1) * per].to(device))
               for i, t in make_batches(args)]
    dist.barrier()
    baseline_rss = status("VmRSS")
    if CAN_RESET_PEAK:
        reset_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    note = ""
    close = None
    traffic_of = None  # offload's rows: what its collectives brought, within and across machines
    swap_dir: Optional[str] = None
    collectives: Optional[dict] = None  # computed, not measured (DDP)
    meter = CollectiveMeter(dist, world)
    meter.install()  # before wrap(): the engine calls dist.<name> at call time
    if args.worker in OFFLOAD:
        tier, sharded, small, zero_plus_plus = OFFLOAD[args.worker]
        zero_plus_plus = {k: local_world if v == "node" else v for k, v in zero_plus_plus.items()}  # hpZ: a node
        options = dict(dtype=dtype, device=device, lr=args.lr, weight_decay=0.0, grad_accumulation_steps=1,
                       shard_weights=sharded, **zero_plus_plus)  # explicit: None could shard the replicated rows
        if small:
            host, room = disk_budgets(args, model, dtype)
            options.update(host_memory=host, device_memory=room)
        if tier == "nvme":
            options["nvme_path"] = args.swap
            swap_dir = os.path.join(args.swap, f"rank-{rank}")  # data-parallel: each rank's own directory
        engine = offload.wrap(model, tier=tier, **options)
        plan = engine.plan

        def traffic() -> Dict[str, float]:
            stats = engine.stats()
            return {key: stats[key] for key in TRAFFIC}

        traffic_of = traffic
        if plan.shard_world != (world if sharded else 1):
            raise SystemExit(f"bench_dp worker: {args.worker} asked shard_weights={sharded} but the plan's "
                             f"shard_world is {plan.shard_world}")
        if small:
            if not plan.disk_weight_blocks:
                raise SystemExit(f"bench_dp worker: {args.worker}: host_memory={options['host_memory']} "
                                 f"device_memory={options['device_memory']} keep every block's weights off disk "
                                 "(engine.plan.disk_weight_blocks is empty); lower --host-memory")
            note = (f"weights on disk: {','.join(plan.disk_weight_blocks)} (host_memory "
                    f"{_mb(options['host_memory'])}, device_memory {_mb(options['device_memory'])} per rank)")

        def train_step(idx, tgt):
            loss = engine(idx, tgt)
            loss.backward()
            engine.step()
            engine.zero_grad()
            return loss

        def state_bytes() -> int:
            return int(engine.stats()["optimizer_state_bytes"])
        close = engine.close
    elif args.worker == "ddp":
        model = model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None)
        opt, note = torch_adamw(ddp.parameters(), args.lr, device)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        collectives = dict(gather=0.0, reduce=2 * (world - 1) / world * grad_bytes, other=0.0, calls=None)

        def train_step(idx, tgt):
            if dtype == torch.float32:
                loss = ddp(idx, tgt)
            else:
                with torch.autocast(device.type, dtype=dtype):
                    loss = ddp(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        def state_bytes() -> int:
            return tensor_bytes(dict(opt.state))
    elif args.worker in DEEPSPEED:
        import deepspeed  # type: ignore[import-not-found]

        zero: dict = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        if args.worker == "deepspeed-zero3":
            zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        config = {"train_micro_batch_size_per_gpu": per, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
                  "zero_optimization": zero}
        if dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        ds_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                             dist_init_required=False)
        note = f"DeepSpeed {deepspeed.__version__}"

        def train_step(idx, tgt):
            loss = ds_engine(idx, tgt)
            ds_engine.backward(loss)
            ds_engine.step()
            return loss

        def state_bytes() -> int:
            return deepspeed_state_bytes(ds_engine)
    else:
        raise SystemExit(f"bench_dp worker: unknown rival {args.worker}")

    times: List[float] = []
    losses: List[torch.Tensor] = []
    traffic_before: Dict[str, float] = {}
    for i, (idx, tgt) in enumerate(batches):
        dist.barrier()
        if i == args.warmup:
            meter.start()  # the timed steps' collectives (the barrier above moves no payload)
            traffic_before = traffic_of() if traffic_of else {}
        start = time.perf_counter()
        loss = train_step(idx, tgt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        losses.append(loss.detach().float().reshape(()))
        if i >= args.warmup:
            times.append(elapsed)
    counted = meter.stop()
    moved = ({k: (v - traffic_before[k]) / max(1, len(times)) for k, v in traffic_of().items()}
             if traffic_of else None)
    peak_rss = status("VmHWM")
    state = state_bytes()
    swapped = swap_bytes(swap_dir) if swap_dir is not None else None
    if collectives is None:  # measured over the timed steps: per step
        per_step = {k: v / max(1, len(times)) for k, v in counted.items()}
        per_step["computed"] = False
    else:  # computed per step
        per_step = dict(collectives, computed=True)
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    mean_losses = torch.stack(losses).to(device)
    dist.all_reduce(mean_losses)  # the global batch's loss per step (the mean of the ranks' halves)
    mean_losses = (mean_losses / world).cpu().tolist()
    if close is not None:
        close()
    result = dict(rival=args.worker, round=args.round, rank=rank, world=world, step_seconds=times,
                  losses=mean_losses, baseline_rss=baseline_rss, peak_rss=peak_rss, peak_reset=CAN_RESET_PEAK,
                  state_bytes=state, params=n_params, note=note, device_peak=device_peak,
                  threads=torch.get_num_threads(), swap_bytes=swapped, collectives=per_step, traffic=moved,
                  local_world=local_world)
    with open(os.path.join(args.out, f"{args.worker}-round{args.round}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ----- launcher ---------------------------------------------------------------------------------------------
def deepspeed_skip_reason() -> Optional[str]:
    """Why DeepSpeed cannot be a rival here, or None where `import deepspeed` works."""
    try:
        import deepspeed  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return "not installed on this machine (`import deepspeed` fails)"
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"installed but not importable ({type(exc).__name__}: {str(exc)[:80]})"
    return None


def launch(args: argparse.Namespace, rival: str, round_: int, out: str, swap_root: str) -> Optional[str]:
    """One torchrun launch of `rival`; None on success, else the reason it failed."""
    swap = tempfile.mkdtemp(prefix=f"{rival}-", dir=swap_root)
    spec = os.path.join(out, f"{rival}-round{round_}.spec.json")
    with open(spec, "w") as f:
        json.dump(dict(vars(args), worker=rival, round=round_, out=out, swap=swap), f)
    script = [str(Path(__file__).resolve()), "worker", spec]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
    if args.nnodes == 1:
        commands = [run + ["--standalone"] + script]
    else:  # one launcher per node, as on N machines (static rendezvous: ranks numbered node by node)
        port = _free_port()
        commands = [run + ["--nnodes", str(args.nnodes), "--node_rank", str(node), "--master_addr", "127.0.0.1",
                           "--master_port", str(port)] + script for node in range(args.nnodes)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")  # a crashing rank prints its stacks
    # cwd: torchrun must not start inside torch's site-packages; the temp dir is neutral
    launchers = [subprocess.Popen(c, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for c in commands]
    outputs = [p.communicate(timeout=600) for p in launchers]
    done = subprocess.CompletedProcess(commands[0], max(abs(p.returncode) for p in launchers),
                                       "".join(o for o, _ in outputs), "".join(e for _, e in outputs))
    shutil.rmtree(swap, ignore_errors=True)
    if done.returncode != 0:
        if os.environ.get("BENCH_DP_LOG"):
            with open(os.environ["BENCH_DP_LOG"], "a") as f:
                f.write(done.stderr + done.stdout)
        # the ranks' own exception (torchrun prefixes it "[rankN]: "), not torchrun's ChildFailedError after it;
        # else a rank's abort message, else torchrun's root-cause summary
        raised = re.findall(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Exit)\b:?.*)$", done.stderr, re.M)
        raised = [line for line in raised if "ChildFailedError" not in line and "elastic" not in line]
        raised += re.findall(r"^.*(?:terminate called|Fatal Python error|Segmentation fault).*$", done.stderr, re.M)
        cause = done.stderr.split("Root Cause", 1)[-1]
        codes = re.findall(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*", cause, re.S)
        summary = "; ".join(f"rank {r} exit code {c}" for r, c in codes[:1])
        first = raised[0].strip() if raised else f"exit status {done.returncode}"
        reason = (first + (f" ({summary})" if summary else ""))[:200]
        written = [os.path.join(out, f"{rival}-round{round_}-rank{r}.json") for r in range(args.nproc * args.nnodes)]
        if all(os.path.exists(path) for path in written):
            # every rank measured and wrote its result before the process group went down: the failure is in
            # the exit (a rare gloo shutdown abort seen once in ~65 launches); keep the measurement, say so
            print(f"bench_dp: {rival} round {round_} exited abnormally after every rank wrote its result "
                  f"({reason}); its measurement is kept", file=sys.stderr)
            return None
        return reason
    return None


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fmt_ranks(values: List[float], scale: float = 1e-6, fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(v * scale) for v in values)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1])
        return 0
    args = parse(argv)
    rivals = args.rivals.split(",")
    skipped: Dict[str, str] = {}
    if any(r in DEEPSPEED for r in rivals):
        reason = deepspeed_skip_reason()
        if reason is not None:
            for rival in [r for r in rivals if r in DEEPSPEED]:
                skipped[rival] = f"skipped: {reason}"
                rivals.remove(rival)
    out = tempfile.mkdtemp(prefix="offload-bench-dp-")
    swap_root = tempfile.mkdtemp(prefix="offload-bench-dp-swap-", dir=args.nvme_path)
    failed: Dict[str, str] = {}
    began = time.perf_counter()
    try:
        for r in range(args.rounds):
            order = rivals[r % len(rivals):] + rivals[:r % len(rivals)]  # rotated: no rival always runs first
            for rival in order:
                if rival in failed or rival in skipped:
                    continue
                t0 = time.perf_counter()
                error = launch(args, rival, r, out, swap_root)
                print(f"round {r + 1}/{args.rounds} {RIVALS[rival]}: "
                      f"{'ok' if error is None else 'FAILED: ' + error} ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
                if error is not None and rival in DEEPSPEED:  # an optional rival: its failure is a skip
                    skipped[rival] = f"skipped: it failed here ({error})"
                elif error is not None:
                    failed[rival] = error
        results: Dict[str, List[dict]] = {rival: [] for rival in rivals}
        for path in sorted(Path(out).glob("*-rank*.json")):
            data = json.loads(path.read_text())
            results[data["rival"]].append(data)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(swap_root, ignore_errors=True)

    rows = []
    summary: Dict[str, dict] = {}
    n_params = None
    notes: List[str] = []
    for rival in [r for r in rivals if r not in skipped] + list(skipped):
        label = RIVALS[rival]
        if rival in skipped or rival in failed:
            rows.append(dict(rival=label, step_ms="skipped" if rival in skipped else "failed",
                             note=skipped.get(rival, "").replace("skipped: ", "") or failed.get(rival)))
            continue
        per_round: Dict[int, List[dict]] = {}
        for data in results[rival]:
            per_round.setdefault(data["round"], []).append(data)
        steps: List[float] = []  # the slowest rank's time of each timed step
        ranks = sorted({d["rank"] for d in results[rival]})
        for datas in per_round.values():
            steps += [max(ts) for ts in zip(*(d["step_seconds"] for d in datas))]
        runs = results[rival]
        peak = [_median_of(runs, "peak_rss", k) for k in ranks]
        growth = [_median_of(runs, "peak_rss", k) - _median_of(runs, "baseline_rss", k) for k in ranks]
        state = [_median_of(runs, "state_bytes", k) for k in ranks]
        n_params = results[rival][0]["params"]
        swapped = [d["swap_bytes"] for d in runs]
        coll = {kind: [_median_of_collective(runs, kind, k) for k in ranks]
                for kind in ("gather", "reduce", "other", "calls")}
        computed = results[rival][0]["collectives"]["computed"]
        losses = {round(d["losses"][-1], 5) for d in results[rival]}
        median, p20, p80 = summarize(steps)
        comm = max(sum(coll[kind][i] for kind in ("gather", "reduce", "other")) for i in range(len(ranks)))
        summary[rival] = dict(step=median, peak=max(peak), state=max(state), comm=comm)
        mark = " (computed)" if computed else ""
        row = dict(rival=label, step_ms=f"{median * 1e3:.1f}", p20_p80_ms=f"{p20 * 1e3:.1f}-{p80 * 1e3:.1f}",
                   min_max_ms=f"{min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f}",
                   peak_rss_MB=fmt_ranks(peak), rss_growth_MB=fmt_ranks(growth),
                   state_MB=" / ".join(f"{s / 1e6:.1f}" for s in state),
                   state_B_param=f"{max(state) / n_params:.2f}",
                   swap_MB="-" if any(v is None for v in swapped) else fmt_ranks(
                       [_median_of(runs, "swap_bytes", k) for k in ranks], fmt="{:.1f}"),
                   gather_MB=fmt_ranks(coll["gather"], fmt="{:.1f}") + mark,
                   reduce_MB=fmt_ranks(coll["reduce"], fmt="{:.1f}") + mark,
                   other_MB=fmt_ranks(coll["other"], fmt="{:.2f}") + mark,
                   calls="" if computed else fmt_ranks(coll["calls"], scale=1.0),
                   last_loss=" ".join(f"{v:.4f}" for v in sorted(losses)))
        if results[rival][0].get("traffic"):  # offload's own count, per step per rank: within and across machines
            within = [_median_of_traffic(runs, k, "within") for k in ranks]
            across = [_median_of_traffic(runs, k, "across") for k in ranks]
            weights_across = [_median_of_traffic(runs, k, "across", "weights") for k in ranks]
            weights = [_median_of_traffic(runs, k, "", "weights") for k in ranks]
            summary[rival].update(across=max(across), weights=max(weights), weights_across=max(weights_across))
            row.update(within_MB=fmt_ranks(within, fmt="{:.2f}"), across_MB=fmt_ranks(across, fmt="{:.2f}"),
                       weights_MB=fmt_ranks(weights, fmt="{:.2f}"))
        if results[rival][0]["note"] and rival in OFFLOAD:
            row["note"] = results[rival][0]["note"]
        if results[rival][0]["device_peak"] is not None:
            row["device_peak_MB"] = fmt_ranks([_median_of(runs, "device_peak", k) for k in ranks])
        rows.append(row)
        if results[rival][0]["note"] and rival not in OFFLOAD:
            notes.append(f"{label}: {'torch.optim.AdamW ' if rival == 'ddp' else ''}{results[rival][0]['note']}")
    if REFERENCE in summary:
        ref = summary[REFERENCE]
        for row in rows:
            key = next((k for k, v in RIVALS.items() if v == row["rival"]), None)
            if key in summary:
                row["step_vs_ddp"] = f"{summary[key]['step'] / ref['step']:.2f}x"
                row["rss_vs_ddp"] = f"{summary[key]['peak'] / ref['peak']:.2f}x"
                row["state_vs_ddp"] = f"{summary[key]['state'] / ref['state']:.2f}x"
                if ref["comm"]:
                    row["comm_vs_ddp"] = f"{summary[key]['comm'] / ref['comm']:.2f}x"

    if SHARDED_EXACT in summary and "across" in summary[SHARDED_EXACT]:
        exact = summary[SHARDED_EXACT]
        for row in rows:
            key = next((k for k, v in RIVALS.items() if v == row["rival"]), None)
            if key in summary and "across" in summary[key]:
                if exact["across"]:
                    row["across_vs_sharded"] = f"{summary[key]['across'] / exact['across']:.2f}x"
                if exact["weights"]:
                    row["weights_vs_sharded"] = f"{summary[key]['weights'] / exact['weights']:.2f}x"

    print(machine_header())
    threads = next((d[0]["threads"] for d in results.values() if d), "?")
    world = args.nproc * args.nnodes
    print(f"# {world} ranks ({args.nnodes} node(s) of {args.nproc}), backend {args.backend}, {threads} torch thread(s) "
          f"per rank; GPT layers={args.layers} dim={args.dim} vocab={args.vocab} context={args.context}, global batch "
          f"{args.batch} ({args.batch // world} per rank), dtype={args.dtype}, lr={args.lr}"
          + (f" | {n_params / 1e6:.2f}M params" if n_params else ""))
    print(f"# {args.rounds} rounds (one torchrun launch per rival per round, order rotated) x {args.steps} timed "
          f"steps after {args.warmup} warm-up; step = the slowest rank; {time.perf_counter() - began:.0f} s in all")
    print("# per-rank columns read rank 0 / rank 1 ...; peak RSS = VmHWM reset after imports+model (baseline); "
          "ratios are rival / DDP (step median, highest rank's peak RSS, highest rank's state, highest rank's "
          "collective bytes)")
    print("# swap_MB: the files in the rank's swap directory after the timed steps; gather/reduce/other_MB: bytes a "
          "rank sends per step (ring algorithm) in the collectives counted at torch.distributed's functions, calls: "
          "collective calls per step; DDP's are computed, 2(N-1)/N x its gradient bytes (its C++ reducer bypasses "
          "the functions)")
    print("# within/across_MB: bytes offload's collectives brought a rank per step from ranks on its own node and on "
          "other nodes (engine.stats(), what each call moved); weights_MB: of those, the weights'; *_vs_sharded: "
          "the highest rank's against exact sharded weights (the ZeRO++ rows)")
    for note in dict.fromkeys(notes):
        print(f"# {note}")
    for rival, why in skipped.items():
        print(f"# {RIVALS[rival]}: {why}")
    columns = ["rival", "step_ms", "p20_p80_ms", "min_max_ms", "step_vs_ddp", "peak_rss_MB", "rss_growth_MB",
               "rss_vs_ddp", "state_MB", "state_B_param", "state_vs_ddp", "swap_MB", "gather_MB", "reduce_MB",
               "other_MB", "calls", "comm_vs_ddp", "within_MB", "across_MB", "across_vs_sharded", "weights_MB",
               "weights_vs_sharded", "last_loss"]
    if any("device_peak_MB" in r for r in rows):
        columns.append("device_peak_MB")
    columns.append("note")
    print_table(rows, columns)
    if args.plot:
        plot_losses(args, results, skipped, failed)
    if failed:
        print(f"FAILED rivals: {failed}", file=sys.stderr)
        return 1
    return 0


def plot_losses(args: argparse.Namespace, results: Dict[str, List[dict]], skipped: Dict[str, str],
                failed: Dict[str, str]) -> None:
    """Each rival's loss curve (round 1, rank 0's record of the global batch's loss) into `args.plot`, and the
    ZeRO++ rows' largest relative distance to exact sharded training after the first 20 steps."""
    curves = {rival: next(d["losses"] for d in runs if d["round"] == 0 and d["rank"] == 0)
              for rival, runs in results.items() if runs and rival not in skipped and rival not in failed}
    exact = curves.get(SHARDED_EXACT)
    if exact is not None:
        for rival, losses in curves.items():
            if rival != SHARDED_EXACT and OFFLOAD.get(rival, (None,) * 4)[3]:
                tail = [abs(a - b) / abs(b) for a, b in zip(losses[20:], exact[20:])]
                print(f"# {RIVALS[rival]}: loss within {max(tail, default=0.0):.2%} of exact sharded training at "
                      f"every step after the first 20 ({len(losses)} steps; last {losses[-1]:.4f} vs {exact[-1]:.4f})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot: pip install matplotlib to get the picture")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rival, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=RIVALS[rival], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    world = args.nproc * args.nnodes
    ax.set_title(f"bench_dp: {world} ranks on {args.nnodes} node(s), {args.data} data, {args.dtype}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"# loss curves: {args.plot}")


def _median_of(runs: List[dict], key: str, rank: int) -> float:
    """The median of `key` over one rank's runs."""
    return summarize([d[key] for d in runs if d["rank"] == rank])[0]


def _median_of_traffic(runs: List[dict], rank: int, where: str, what: str = "") -> float:
    """The median over one rank's runs of the bytes offload's collectives brought it per step: `where` "within"
    or "across" machines ("" both), of `what` ("weights", "grads"; "" both)."""
    return summarize([sum(v for k, v in d["traffic"].items() if where in k and what in k)
                      for d in runs if d["rank"] == rank])[0]


def _median_of_collective(runs: List[dict], kind: str, rank: int) -> float:
    """The median over one rank's runs of a collective count per step (0 where not counted: DDP's calls)."""
    return summarize([d["collectives"][kind] or 0.0 for d in runs if d["rank"] == rank])[0]


if __name__ == "__main__":
    sys.exit(main())
