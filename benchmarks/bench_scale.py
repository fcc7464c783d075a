"""The largest model this machine trains: a Llama-style model whose training state is >= 1.5x this machine's RAM,
built on the meta device, initialized block by block by offload, trained a few steps on the nvme tier.

    python benchmarks/bench_scale.py                      # ~2.5B parameters (40 GB of training state), minutes
    python benchmarks/bench_scale.py --params-target 4e9 --host-memory 3GB --device-memory 3GB --nvme-path /mnt/nvme
    python benchmarks/bench_scale.py --quick              # ~100M parameters, a smoke run of < 1 minute
    python benchmarks/bench_scale.py --max-grad-norm 1.0  # clipping: the gradients wait on disk for the norm
    python benchmarks/bench_scale.py --moments int8       # int8 Adam moments: half the state on disk
    python benchmarks/bench_scale.py --params-target 1.2e9 --clipping-rounds 2   # speculative clipping (issue 35):
        # no clipping, and max_grad_norm=1.0 with norms below it and above it, in separate processes, interleaved
    python benchmarks/bench_scale.py --params-target auto --moments int8 --max-grad-norm 1.0 --min-free-disk 5GB
        # the largest model this machine's free disk and RAM hold, by the planner (issue 36), printing the arithmetic

The model is transformers' `LlamaForCausalLM` from a `LlamaConfig` (hidden 2560, MLP 6912, 20 heads, vocab
32000, untied head, layers chosen to reach `--params-target`), built under `accelerate.init_empty_weights()`
(parameters on the meta device, the rotary buffers real) and initialized by `offload.wrap(..., init=
model._init_weights)` as each block is placed; without transformers/accelerate (or with `--builtin`) a small
Llama-like module of this file (RMSNorm, SwiGLU MLP, attention without rotary) built under
`torch.device("meta")` and initialized by its modules' `reset_parameters()`. The model never exists whole in
memory: training state = 16 B/param (fp32 master, Adam m and v in the swap file; bf16 weights and gradients);
with `--moments bf16` 12, with `--moments int8` 10.03 (wrap's `moments=`: the swap file and each step's disk
traffic shrink by the moments' bytes).

Measured in one process: peak RSS (VmHWM, reset after the imports and the disk probe's buffer) against
`host_memory + device_memory`; each step's time (forward, backward, `step()`, `zero_grad()`, then
`synchronize()`) and disk bytes (engine.stats()); the disk bound T_read + T_write of those bytes at the
O_DIRECT bandwidths `offload.measure.DiskProbe` measured in the swap directory between steps; efficiency =
bound / step; each step's process CPU time (`cpu_s`: both cores' work, compute and updates alike) and the update
worker's time in block updates, with the disk waits inside them apart (`worker_s`, `worker_disk_s`: what an
update costs besides the disk, e.g. clipping's norms and checks), and that worker's CPU time (`worker_cpu_s`:
what it takes from the cores the backward computes on). Also what `python -m offload estimate`
(offload.cli.estimate.estimate) predicts per tier for the same blocks and budgets, against the plan `wrap()` made
and the swap file it allocated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import namedtuple
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, machine_header, print_table  # noqa: E402

import offload  # noqa: E402
from offload.cli.estimate import ModelShape, disk_bytes, estimate  # noqa: E402
from offload.measure import DiskProbe, dram_bandwidth  # noqa: E402
from offload.optim.moment_format import MomentFormat, moment_nbytes
from offload.planner.plan import GradFlow, Location
from offload.planner.plan import human_bytes as human
from offload.policy import DiskWeights, Tier, parse_bytes  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # a progress bar is a nicety
    tqdm = None

GB = 1e9
def state_bytes_per_param(moments: MomentFormat) -> float:
    """fp32 master 4 + Adam m and v in the moments' format + bf16 weight 2 + bf16 gradient 2."""
    return 8 + 2 * moment_nbytes(moments, 1 << 20) / (1 << 20)


# ----- the model -----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class Layer(nn.Module):
    """Pre-norm decoder layer: causal attention (no rotary: positions are not what is measured), SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.post_attention_layernorm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


Output = namedtuple("Output", "loss")  # a tuple, so the engine's hook on the root's outputs sees the loss


class LlamaLike(nn.Module):
    """Llama's parameter layout (embed_tokens, layers, norm, untied lm_head) in plain torch."""

    def __init__(self, vocab: int, dim: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, hidden, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x)).float()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return Output(loss)


def layer_params(dim: int, hidden: int) -> int:
    return 4 * dim * dim + 3 * dim * hidden + 2 * dim


def model_params(vocab: int, dim: int, hidden: int, layers: int) -> int:
    return 2 * vocab * dim + layers * layer_params(dim, hidden) + dim


def layers_for(target: float, vocab: int, dim: int, hidden: int) -> int:
    """The fewest layers that reach `target` parameters (at least 1)."""
    return max(1, math.ceil((target - 2 * vocab * dim - dim) / layer_params(dim, hidden)))


def build(args: argparse.Namespace) -> Tuple[nn.Module, Optional[object], str]:
    """(the model on the meta device, its init function or None for reset_parameters(), its description)."""
    if not args.builtin:
        try:
            import accelerate
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as exc:
            print(f"# transformers/accelerate not importable ({exc}): the built-in Llama-like module instead")
        else:
            config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                 num_key_value_heads=args.heads, tie_word_embeddings=False,
                                 max_position_embeddings=max(2048, args.context))
            with accelerate.init_empty_weights():  # parameters on meta, buffers (rotary inv_freq) real
                model = LlamaForCausalLM(config)
            described = "transformers LlamaForCausalLM (init_empty_weights, init=model._init_weights)"
            return model, model._init_weights, described
    with torch.device("meta"):
        model = LlamaLike(args.vocab, args.dim, args.hidden, args.layers, args.heads)
    return model, None, "built-in Llama-like module (torch.device('meta'), init by reset_parameters())"


# ----- measuring -------------------------------------------------------------------------------------------------
def proc_status(key: str) -> Optional[int]:
    """A /proc/self/status memory line in bytes (VmRSS, VmHWM), None where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return proc_status("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: `5` to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    return proc_status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def allocated_bytes(directory: str) -> int:
    """Bytes the engine's files under `directory` take on disk (allocated blocks of the preallocated swap file)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if name.startswith("offload-probe-"):
                continue  # DiskProbe's file, not the engine's
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class WorkerTime:
    """Seconds a step's update worker spends in block updates, and within them waiting for the disk (told by the
    engine's spans): what an update costs apart from the disk, e.g. clipping's norms and checks. A disk wait
    counts when it ended inside an update on the same thread (other threads' waits, a fetch's, are not the
    worker's)."""

    def __init__(self) -> None:
        self.updates = 0.0
        self.disk_waits = 0.0
        self.cpu = 0.0
        self._waits: Dict[int, List[Tuple[float, float]]] = {}  # per thread, the disk waits since its last update
        self._cpu_at: Dict[int, float] = {}  # per thread, its CPU time when its last update ended

    def on_span(self, name: str, detail: str, start: float, end: float) -> None:
        thread = threading.get_ident()
        if name == "disk wait":
            self._waits.setdefault(thread, []).append((start, end))
        elif name == "update":
            self.updates += end - start
            self.disk_waits += sum(b - a for a, b in self._waits.pop(thread, []) if a >= start)
            now = time.thread_time()  # this span ends on the thread that ran the update
            if thread in self._cpu_at:
                self.cpu += now - self._cpu_at[thread]
            self._cpu_at[thread] = now

    def take(self) -> Tuple[float, float, float]:
        """(update seconds, disk wait seconds within them, the updating threads' CPU seconds between the ends of
        their updates: norms and parking included) since the last take."""
        taken = (self.updates, self.disk_waits, self.cpu)
        self.updates = self.disk_waits = self.cpu = 0.0
        return taken


class Progress:
    """One bar per step: decoder layers entering forward, then block updates finishing (told by the engine)."""

    def __init__(self, layers: List[nn.Module], updates_per_step: int) -> None:
        self.bar = None
        self.total = len(layers) + updates_per_step
        self._handles = [m.register_forward_pre_hook(self._tick) for m in layers]

    def start(self, step: int, steps: int) -> None:
        if tqdm is not None:
            self.bar = tqdm(total=self.total, desc=f"step {step}/{steps} (layers fwd + block updates)",
                            unit="", leave=False, file=sys.stderr)

    def _tick(self, *_args) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_span(self, name: str, detail: str, start: float, end: float) -> None:
        if name == "update":
            self._tick()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def counting_init(init, total: int, label: str):
    """`init` (or reset_parameters()) with a progress bar over the modules it initializes."""
    bar = tqdm(total=total, desc=label, unit="module", leave=False, file=sys.stderr) if tqdm is not None else None

    def run(module: nn.Module) -> None:
        if init is not None:
            init(module)
        else:
            module.reset_parameters()
        if bar is not None:
            bar.update(1)

    return run, bar


def init_check(model: nn.Module) -> str:
    """What initialization gave the first embedding and the final norm (when their blocks are resident)."""
    parts = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight") or name in ("model.norm.weight", "norm.weight"):
                if not bool(torch.isfinite(param).all()):
                    parts.append(f"{name} not resident")
                else:
                    value = param.float()
                    parts.append(f"{name} mean {value.mean():.4f} std {value.std():.4f}")
    return "; ".join(parts) + " (wrap() checked every parameter finite)"


def deepspeed_line() -> str:
    try:
        import deepspeed  # type: ignore[import-not-found]
    except ImportError:
        return ("DeepSpeed: not installed on this machine (no ZeRO-Infinity rival here; the GPU issue compares "
                "with it where it is installed)")
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return (f"DeepSpeed: installed but not importable ({type(exc).__name__}: {str(exc)[:80]}): "
                "no ZeRO-Infinity rival")
    return (f"DeepSpeed {deepspeed.__version__}: installed, but ZeRO-Infinity needs a CUDA device: not run here "
            "(the GPU issue compares with it)")


def estimate_plan(blocks: List[tuple], device_memory: int, host_memory: int, clipping: bool,
                  moments: MomentFormat = MomentFormat.FP32, disk_weights: DiskWeights = DiskWeights.AUTO,
                  activation_room: int = 0):
    """What `python -m offload estimate` predicts for these blocks and budgets and this run's gradient flow
    (grad_accumulation_steps declared, clipping as asked), weights on disk kept as the run kept them."""
    shape = ModelShape(tuple(blocks))
    try:
        plan = estimate(shape, Tier.NVME, torch.bfloat16, device_memory, host_memory, GradFlow(1, clipping, 2),
                        moments, disk_weights=disk_weights, activation_room=activation_room)
        return plan, True, None
    except Exception as exc:  # noqa: BLE001 - OffloadConfigError: the estimate refuses; reported
        return None, True, f"{type(exc).__name__}: {exc}"


def mem_available() -> int:
    """MemAvailable of /proc/meminfo (the RAM other processes leave), else all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return ram_bytes()


def model_blocks(args: argparse.Namespace, layers: int) -> List[tuple]:
    """The engine's blocks of the Llama (the embedding, each layer, the final norm, the head) as the estimate
    takes them: (name, parameters, parameters of the largest tensor)."""
    vocab, dim = args.vocab, args.dim
    return ([("embed_tokens", vocab * dim, vocab * dim)]
            + [(f"layers.{i}", layer_params(dim, args.hidden), dim * args.hidden) for i in range(layers)]
            + [("norm", dim, dim), ("lm_head", vocab * dim, vocab * dim)])


def saved_activation_bytes(args: argparse.Namespace, layers: int) -> int:
    """What a training forward of this Llama with `layers` layers saves for its backward, counted as the engine's
    meter counts it (each tensor once, the parameters apart; engine.plan's activations), on a real model of that
    many layers whose weights are left uninitialized (the bytes do not depend on them), computing in bf16 with
    fp32 norms as wrap(dtype=torch.bfloat16) casts them, under the run's autocast, on one batch of the run's shape."""
    from offload.scheduler.blocks.block import is_norm_layer

    model, _, _ = build(argparse.Namespace(**{**vars(args), "layers": layers}))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                param.zero_()
                if not is_norm_layer(module):
                    setattr(module, name, nn.Parameter(param.to(torch.bfloat16)))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in weights:
            seen.add((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return tensor

    ids = torch.zeros((1, args.context), dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids) if hasattr(model, "config") else model(ids, ids)
    return sum(nbytes for _, nbytes in seen)


def activations_per_layers(args: argparse.Namespace) -> Tuple[int, int]:
    """(bytes saved outside the layers, bytes per layer): from the models of one and two layers, built and run in a
    child process, so that their memory is not in this one's RSS baseline (nor reused under it)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        one, two = pool.submit(saved_activation_bytes, args, 1).result(), pool.submit(saved_activation_bytes, args,
                                                                                     2).result()
    return one - (two - one), two - one


def auto_size(args: argparse.Namespace, ram: int, free: int, min_free: int, moments: MomentFormat,
              device_memory: int) -> Optional[Tuple[int, int, int, int, List[str]]]:
    """`--params-target auto`: the most layers of this width whose plan (the planner's own, `estimate`) fits this
    machine: its swap file within the free disk less `min_free` (weights on disk read from the master when copies
    would not fit: wrap's disk_weights auto), the budgets within min(80% of RAM, MemAvailable - 2 GiB), the rest
    left for the process's baseline, the 512 MiB over the budgets a run may take, and the other processes. Host
    memory is every bf16 gradient's 2 B/param (+ 1 GiB: with clipping none then waits on disk), or all the cap
    leaves when they do not fit: the planner then keeps what it can of them whole beside the window and the rest
    wait on disk, so the model grows with the disk too. The device budget is
    `device_memory` for the weights streaming through it and the activations a forward of the run's batch saves
    (measured: `activations_per_layers`), kept free of weights by wrap's activation_memory. (layers, host_memory,
    device budget, activation_memory, the arithmetic's lines); None: not even one layer fits."""
    available = mem_available()
    cap = min(int(0.8 * ram), available - (2 << 30))
    room = free - min_free
    clipping = args.max_grad_norm is not None
    act_base, act_layer = activations_per_layers(args)

    def plan_for(layers: int):
        params = model_params(args.vocab, args.dim, args.hidden, layers)
        activations = act_base + layers * act_layer
        device = device_memory + activations
        # every gradient (bf16), 1 GiB for the ring, streamed weights, the norm's copy; else what the cap leaves
        host = min(2 * params + (1 << 30), cap - device)
        if host <= 0:
            return None
        try:
            plan = estimate(ModelShape(tuple(model_blocks(args, layers))), Tier.NVME, torch.bfloat16, device,
                            host, GradFlow(1, clipping, 2), moments, disk_weights=DiskWeights.AUTO, disk_room=room,
                            activation_room=activations)
        except Exception:  # noqa: BLE001 - OffloadConfigError: the budgets cannot hold it
            return None
        if disk_bytes(plan) > room:
            return None
        return plan, host, device, activations

    low, high = 0, 1
    while plan_for(high) is not None:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if plan_for(middle) is not None else (low, middle)
    if low == 0:
        return None
    found = plan_for(low)
    assert found is not None
    plan, host, device, activations = found
    params = model_params(args.vocab, args.dim, args.hidden, low)
    memory = plan.bytes_on(Location.DEVICE) + plan.bytes_on(Location.HOST)
    weights = ("read from the fp32 master (disk_weights auto: the copies would not fit)" if plan.master_weight_blocks
               else "kept as a copy" if plan.disk_weight_blocks else "none on disk")
    lines = [
        f"auto size: RAM {ram / GB:.1f} GB (MemAvailable {available / GB:.1f} GB); free disk {free / GB:.1f} GB, "
        f"--min-free-disk {min_free / GB:.1f} GB kept: {room / GB:.1f} GB for the swap file; budgets within "
        f"min(0.8 x RAM, MemAvailable - 2 GiB) = {cap / GB:.1f} GB",
        f"  the planner, per parameter ({moments.value} moments, {'clipping, ' if clipping else ''}weights on disk "
        f"{weights}): disk {disk_bytes(plan) / params:.2f} B, memory {memory / params:.2f} B (gradients: "
        f"{plan.grads_placement().split(': about')[0]}; the ring, streamed weights)",
        f"  largest: {low} layers x {args.dim} = {params:,} parameters ({params / 1e9:.3f}B): swap file "
        f"{disk_bytes(plan) / GB:.1f} of {room / GB:.1f} GB; budgets host {host / GB:.1f} + device "
        f"{device / GB:.2f} = {(host + device) / GB:.1f} of {cap / GB:.1f} GB; {low + 1} layers do not fit",
        f"  device: {device_memory / GB:.1f} GB for the weights and {activations / GB:.2f} GB kept for the activations "
        f"(activation_memory): a forward of 1 x {args.context} tokens saves {act_layer / 1e6:.2f} MB a layer and "
        f"{act_base / 1e6:.1f} MB outside them (measured on models of one and two layers)",
        f"  params / ((RAM + free disk) / 16 B) = {params / 1e9:.3f}B / (({ram / GB:.1f} + {free / GB:.1f}) GB / 16 B"
        f" = {(ram + free) / 16 / 1e9:.2f}B) = {params * 16 / (ram + free):.2f}",
    ]
    return low, host, device, activations, lines


# ----- the run ---------------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-target", default=None,
                        help="parameters to reach: the fewest layers that do (default 2.5e9: 30 layers, 2.54B); "
                             "'auto': the largest model the free disk and RAM hold, by the planner (budgets chosen "
                             "too: every gradient in host memory), printing the arithmetic")
    parser.add_argument("--host-memory", default=None, help="offload host_memory budget (default 3GB)")
    parser.add_argument("--device-memory", default=None,
                        help="offload device_memory budget; the device is this CPU's RAM here (default 3GB)")
    parser.add_argument("--nvme-path", default=None, help="directory for the swap file (default: the temp dir)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence (batch 1)")
    parser.add_argument("--dim", type=int, default=2560)
    parser.add_argument("--hidden", type=int, default=6912, help="MLP width")
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--min-free-disk", default=None,
                        help="refuse a run that would leave less free disk (default 10GB; 1GB with --quick)")
    parser.add_argument("--builtin", action="store_true", help="the built-in Llama-like module, not transformers'")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="clip to this global norm: every gradient waits for it (on disk: docs/design.md "
                             "[Note: gradients on disk])")
    parser.add_argument("--loss-scale", type=float, default=1.0,
                        help="multiply the loss before backward: the gradients and their global norm scale with it, "
                             "which puts the norm below or above --max-grad-norm (the update is the same either way "
                             "below it, Adam being scale-free up to eps)")
    parser.add_argument("--no-speculation", action="store_true",
                        help="speculative_clipping=False: every update waits for the global norm (before issue 35)")
    parser.add_argument("--clipping-rounds", type=int, default=None,
                        help="run this many interleaved rounds of three runs, each its own process: no clipping, "
                             "--max-grad-norm 1.0 with the loss x 1e-3 (norms below it: speculation kept) and x 1e3 "
                             "(clipping fires every step), and print each run's steps and the efficiencies' medians")
    parser.add_argument("--result-json", default=None, help=argparse.SUPPRESS)  # a child of --clipping-rounds
    parser.add_argument("--moments", choices=[m.value for m in MomentFormat], default="fp32",
                        help="how the Adam moments are kept (offload.wrap's moments=): fp32 (exact), bf16, int8")
    parser.add_argument("--size-only", action="store_true",
                        help="with --params-target auto: print the sizing arithmetic and stop (no swap file, no steps)")
    parser.add_argument("--quick", action="store_true",
                        help="~100M parameters (hidden 768), budgets 250MB + 200MB: a smoke run (< 1 min)")
    args = parser.parse_args(argv)
    if args.clipping_rounds:
        return clipping_rounds(args, argv if argv is not None else sys.argv[1:])
    if args.quick:  # weights on device, host and disk
        args.dim, args.hidden, args.heads = 768, 2048, 6
        defaults = dict(params_target=1e8, host_memory="250MB", device_memory="200MB")
    else:
        defaults = dict(params_target=2.5e9, host_memory="3GB", device_memory="3GB")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    auto = args.params_target == "auto"
    if auto and args.device_memory == "3GB":
        args.device_memory = "2GB"  # the layers' room to stream; host memory is sized from the model
    device_memory = parse_bytes(args.device_memory, "--device-memory")
    min_free = parse_bytes(args.min_free_disk or ("1GB" if args.quick else "10GB"), "--min-free-disk")
    moments = MomentFormat.parse(args.moments)
    per_param = state_bytes_per_param(moments)
    ram = ram_bytes()
    base_dir = args.nvme_path or tempfile.gettempdir()
    free_before = shutil.disk_usage(base_dir).free
    sizing: List[str] = []
    activation_memory: Optional[int] = None  # auto: the activations' room in device_memory
    if auto:
        sized = auto_size(args, ram, free_before, min_free, moments, device_memory)
        if sized is None:
            print("not run: no model of this width fits the free disk and the RAM", file=sys.stderr)
            return 2
        args.layers, host_memory, device_memory, activation_memory, sizing = sized
        args.host_memory = str(host_memory)
        # the shadows would fill the disk --min-free-disk keeps free (the plan gives them whatever is left)
        args.no_speculation = True
        sizing.append("  speculative clipping off (speculative_clipping=False): its shadows would take the disk "
                      "--min-free-disk keeps free; every update waits for the global norm (exact, serial)")
        print("\n".join(sizing), flush=True)
        if args.size_only:
            return 0
    else:
        args.params_target = float(args.params_target)
        args.layers = layers_for(args.params_target, args.vocab, args.dim, args.hidden)
    host_memory = parse_bytes(args.host_memory, "--host-memory")
    n_params = model_params(args.vocab, args.dim, args.hidden, args.layers)
    state_bytes = int(per_param * n_params)

    # The swap file: 12 B/param of state, plus the bf16 weights the plan puts on disk (at most 2 B/param) and,
    # clipping, the bf16 gradients' records (2 B/param); auto: the planner's own bytes, checked already.
    disk_per_param = per_param - 2 + (2 if args.max_grad_norm is not None else 0)
    disk_need = int(disk_per_param * n_params) + (1 << 30)
    if not auto and free_before - disk_need < min_free:
        fits = (free_before - min_free - (1 << 30)) / disk_per_param
        print(f"not run: ~{disk_need / GB:.1f} GB of swap for {n_params / 1e9:.2f}B parameters would leave "
              f"{(free_before - disk_need) / GB:.1f} GB free in {base_dir} (< --min-free-disk {min_free / GB:.0f} GB); "
              f"--params-target {max(fits, 0):.3g} fits", file=sys.stderr)
        return 2

    header = machine_header()
    print(header)
    if sizing:
        print("\n".join(sizing))
    print(f"# {deepspeed_line()}")
    malloc_env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")]
    if malloc_env:
        print(f"# glibc malloc tuned by the environment: {' '.join(malloc_env)}")
    torch.manual_seed(0)
    model, init, described = build(args)
    assert sum(p.numel() for p in model.parameters()) == n_params, "parameter count formula is off"
    modules_to_init = sum(1 for m in model.modules() if any(p is not None for p in m._parameters.values()))
    print(f"model: {described}; hidden {args.dim}, MLP {args.hidden}, {args.heads} heads, {args.layers} layers, "
          f"vocab {args.vocab}, untied head: {n_params:,} parameters ({n_params / 1e9:.3f}B)")
    print(f"training state {state_bytes / GB:.1f} GB at {per_param:.4g} B/param ({moments.value} moments) = "
          f"{state_bytes / ram:.2f}x this machine's RAM ({ram / GB:.1f} GB); budgets: host_memory "
          f"{human(host_memory)}, device_memory {human(device_memory)} (device = CPU RAM here)")

    swap_dir = tempfile.mkdtemp(prefix="offload-scale-", dir=args.nvme_path)
    try:
        probe_bytes = (32 if args.quick else 256) << 20
        probe = DiskProbe(swap_dir, sample_bytes=probe_bytes, samples=args.steps + 2)
        copy_buffers = (torch.ones(32 * 2**20), torch.empty(32 * 2**20))
        bandwidths = sorted(dram_bandwidth(*copy_buffers) for _ in range(5))
        dram = bandwidths[2]
        del copy_buffers
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, args.vocab, (1, args.context), generator=gen) for _ in range(args.steps)]
        probe.sample()

        rss_base = current_rss()
        hwm_reset = reset_peak_rss()
        init_fn, init_bar = counting_init(init, modules_to_init, "wrap: placing and initializing blocks")
        t0 = time.perf_counter()
        engine = offload.wrap(model, tier="nvme", nvme_path=swap_dir, dtype=torch.bfloat16, device="cpu", lr=1e-4,
                              weight_decay=0.0,
                              host_memory=host_memory, device_memory=device_memory, grad_accumulation_steps=1,
                              max_grad_norm=args.max_grad_norm, init=init_fn, moments=moments,
                              speculative_clipping=not args.no_speculation, activation_memory=activation_memory)
        wrap_seconds = time.perf_counter() - t0
        if init_bar is not None:
            init_bar.close()
        swap_allocated = allocated_bytes(swap_dir)
        peak_wrap = peak_rss()
        reset_peak_rss()  # from here: the training steps' peak
        plan = engine.plan
        print(f"wrap(): {wrap_seconds:.1f} s ({n_params / wrap_seconds / 1e6:.0f}M params/s initialized and written); "
              f"swap file {swap_allocated / GB:.2f} GB allocated in {swap_dir}")
        print(f"plan: device {human(plan.bytes_on(Location.DEVICE))}, host {human(plan.bytes_on(Location.HOST))} "
              f"(gradients {human(plan.host_grad_bytes)}, ring "
              f"{human(plan.ring_bytes)}), disk {human(plan.bytes_on(Location.DISK))}; weights: "
              f"{sum(b.weights is Location.DEVICE for b in plan.blocks)} blocks on device, "
              f"{sum(b.weights is Location.HOST for b in plan.blocks)} on host, {len(plan.disk_weight_blocks)} on disk "
              f"(of {len(plan.blocks)})")
        print(f"gradients: {plan.grads_placement()}")
        if plan.disk_weights:
            print(f"weights on disk: {plan.disk_weights}")
        if plan.speculation:
            print(f"speculative clipping: {plan.speculation}")

        print(f"init check: {init_check(model)}")

        layer_list = [m for name, m in model.named_modules() if name.rsplit(".", 2)[-2:-1] == ["layers"]]
        progress = Progress(layer_list, len(engine.blocks))
        remove_observer = engine.add_observer(progress)
        worker_time = WorkerTime()
        remove_worker_time = engine.add_observer(worker_time)
        losses: List[float] = []
        norms: List[Optional[float]] = []
        stats_per_step = []
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)  # norms stay fp32: a bf16 Linear after them needs it
        for step, ids in enumerate(batches, 1):
            before = engine.stats()
            progress.start(step, args.steps)
            worker_time.take()
            start, cpu_start = time.perf_counter(), time.process_time()
            with autocast:
                loss = engine(input_ids=ids, labels=ids).loss
            (loss * args.loss_scale if args.loss_scale != 1.0 else loss).backward()
            norm = engine.step()  # the global norm it clipped with; None without clipping
            norms.append(None if norm is None else float(norm))
            engine.zero_grad()
            engine.synchronize()
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            progress.stop()
            after = engine.stats()
            losses.append(loss.detach().item())
            delta = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
            stats_per_step.append((seconds, cpu_seconds, worker_time.take(), delta))
            probe.sample()  # between steps: the disk's bandwidth in this run, this directory, this hour
            print(f"step {step}: {seconds:.1f} s, loss {losses[-1]:.4f}", file=sys.stderr)
        remove_observer()
        remove_worker_time()
        progress.remove()
        peak_steps = peak_rss()
        peak = max(peak_wrap, peak_steps)
        disk = probe.result()
        final_stats = engine.stats()

        # ----- what the estimate says, against the plan wrap() made and the file it allocated ----------------------
        blocks = [(b.name, sum(g.trainable_numel for g in b.groups),
                   max((s.numel for g in b.groups for s in g.trainable_slots), default=0)) for b in engine.blocks]
        clipping = args.max_grad_norm is not None
        kept = DiskWeights.MASTER if plan.master_weight_blocks else DiskWeights.COPY
        room = activation_memory or 0
        est, windowed, refused = estimate_plan(blocks, device_memory, host_memory, clipping, moments, kept, room)
        uniform_est, _, uniform_refused = estimate_plan(list(ModelShape.uniform(n_params, len(blocks)).blocks),
                                                        device_memory, host_memory, clipping, moments, kept, room)
        activations_used = engine.plan.activations  # measured in the last training forward
        engine.close(restore_weights=not auto)  # auto: a model larger than RAM cannot come back whole
        leftovers = [n for n in os.listdir(swap_dir) if not n.startswith("offload-probe-")]
        probe.close()
        os.rmdir(swap_dir)

        # ----- the tables ---------------------------------------------------------------------------------------------
        rows = []
        for step, (seconds, cpu_seconds, (worker_s, worker_disk_s, worker_cpu_s), d) in enumerate(stats_per_step, 1):
            read, written = d.get("bytes_disk_read", 0), d.get("bytes_disk_written", 0)
            t_read, t_write = read / disk.read, written / disk.write
            rows.append(dict(step=step, step_s=seconds, cpu_s=cpu_seconds, worker_s=worker_s,
                             worker_disk_s=worker_disk_s, worker_cpu_s=worker_cpu_s, loss=losses[step - 1],
                             disk_read_GB=read / GB, disk_written_GB=written / GB, read_B_per_param=read / n_params,
                             grads_to_disk_GB=d.get("bytes_grads_to_disk", 0) / GB,
                             grads_from_disk_GB=d.get("bytes_grads_from_disk", 0) / GB,
                             T_read_s=t_read, T_write_s=t_write, bound_s=t_read + t_write,
                             efficiency=(t_read + t_write) / seconds, forward_s=d.get("forward_seconds", 0.0),
                             backward_s=d.get("backward_seconds", 0.0), update_s=d.get("update_seconds", 0.0),
                             wait_s=d.get("wait_seconds", 0.0),
                             io_wait_s=d.get("nvme_io_wait_seconds", 0.0),
                             chunks_moved=d.get("nvme_chunks_moved", 0), chunks_read_ahead=d.get("nvme_chunks_read_ahead", 0),
                             chunks_clean=d.get("nvme_chunks_clean", 0),
                             early_updates=d.get("early_block_updates", 0),
                             grad_norm=norms[step - 1] if norms[step - 1] is not None else "",
                             speculated=d.get("speculative_updates", 0),
                             kept=d.get("committed_speculations", 0),
                             fetches=d.get("block_fetches", 0)))
        capacity = (ram + free_before) / per_param
        t_cpu = n_params * 30 / dram
        mem_bound = host_memory + device_memory
        summary = [
            dict(quantity="parameters", value=f"{n_params:,} ({n_params / 1e9:.3f}B)",
                 against=f"{args.layers} layers x {args.dim}, vocab {args.vocab}"),
            dict(quantity=f"training state ({per_param:.4g} B/param)", value=f"{state_bytes / GB:.1f} GB",
                 against=f"{state_bytes / ram:.2f}x RAM ({ram / GB:.1f} GB)"),
            dict(quantity="peak RSS, whole process (VmHWM)", value=f"{peak / GB:.2f} GB",
                 against=f"host_memory + device_memory = {mem_bound / GB:.2f} GB"),
            dict(quantity="peak RSS growth over baseline", value=f"{(peak - rss_base) / GB:.2f} GB",
                 against=f"{(peak - rss_base) / mem_bound:.2f}x the budgets (baseline {rss_base / GB:.2f} GB: imports, "
                         f"meta model, probe buffer{'' if hwm_reset else '; VmHWM not reset'})"),
            dict(quantity="  peak growth in wrap() / in the steps",
                 value=f"{(peak_wrap - rss_base) / GB:.2f} / {(peak_steps - rss_base) / GB:.2f} GB",
                 against=f"plan: device {plan.bytes_on(Location.DEVICE) / GB:.2f} + host "
                         f"{plan.bytes_on(Location.HOST) / GB:.2f} GB"),
            dict(quantity="swap file allocated", value=f"{swap_allocated / GB:.2f} GB",
                 against=f"plan's disk bytes {plan.bytes_on(Location.DISK) / GB:.2f} GB"),
            dict(quantity="wrap() (init + first swap write)", value=f"{wrap_seconds:.1f} s", against=""),
            dict(quantity="disk bandwidth (DiskProbe, median)",
                 value=f"read {disk.read / GB:.2f}, write {disk.write / GB:.2f} GB/s",
                 against=f"{len(probe.reads)} samples of {probe_bytes >> 20} MiB, {disk.backend}, "
                         f"O_DIRECT {disk.direct}"),
            dict(quantity="T_cpu (Adam, 30 B/param / DRAM)", value=f"{t_cpu:.1f} s",
                 against=f"DRAM {dram / GB:.1f} GB/s measured"),
            dict(quantity=f"params / ((RAM + free disk) / {per_param:.4g} B)", value=f"{n_params / capacity:.2f}",
                 against=f"{capacity / 1e9:.2f}B params = ({ram / GB:.1f} + {free_before / GB:.1f} GB) / "
                         f"{per_param:.4g} B"),
            dict(quantity="params / ((RAM + free disk) / 16 B)", value=f"{n_params * 16 / (ram + free_before):.2f}",
                 against=f"{(ram + free_before) / 16 / 1e9:.2f}B params = ({ram / GB:.1f} + {free_before / GB:.1f} GB)"
                         " / 16 B (free disk at start)"),
            dict(quantity="peak RSS, whole / growth, vs budgets + 512 MiB",
                 value=f"{peak / GB:.2f} / {(peak - rss_base) / GB:.2f} GB",
                 against=f"{(mem_bound + (512 << 20)) / GB:.2f} GB: whole process "
                         f"{'within' if peak <= mem_bound + (512 << 20) else 'OVER'}, growth "
                         f"{'within' if peak - rss_base <= mem_bound + (512 << 20) else 'OVER'}"),
            dict(quantity="activations saved by a forward (engine.plan)",
                 value=human(None if activations_used is None else activations_used.saved_bytes),
                 against=(f"activation_memory {human(activation_memory)} (measured before wrap(), on models of one "
                          "and two layers)" if activation_memory else "no activation_memory: what the weights leave")
                         + f"; device room the plan leaves {human(plan.device_room)}"),
            dict(quantity="over-budget events (device, host grads)",
                 value=f"{final_stats.get('device_over_budget_events', 0)}, "
                       f"{final_stats.get('host_grad_over_budget_events', 0)}",
                 against=f"host grad peak {final_stats.get('host_grad_bytes_peak', 0) / GB:.2f} GB, device peak "
                         f"{final_stats.get('device_peak_bytes', 0) / GB:.2f} GB"),
        ]
        print()
        print_table(summary, ["quantity", "value", "against"])
        print()
        columns = ["step", "step_s", "cpu_s", "worker_cpu_s", "loss", "disk_read_GB", "disk_written_GB",
                   "grads_to_disk_GB", "grads_from_disk_GB",
                   "T_read_s", "T_write_s", "bound_s",
                   "efficiency", "forward_s", "backward_s", "wait_s", "update_s", "io_wait_s", "chunks_moved",
                   "chunks_read_ahead", "chunks_clean", "early_updates", "grad_norm", "speculated", "kept", "fetches"]
        print_table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows], columns)

        # ----- estimate vs plan ----------------------------------------------------------------------------------
        print()
        flag = " --grad-accumulation-steps 1" + (" --max-grad-norm" if clipping else "") + f" --moments {moments.value}"
        print(f"python -m offload estimate --params {n_params} --layers {len(blocks)} --tier nvme --dtype bf16 "
              f"--host-memory {host_memory} --device-memory {device_memory}{flag}  (uniform blocks), and "
              f"offload.cli.estimate.estimate() on this model's {len(blocks)} blocks"
              )
        est_rows = []
        verdicts = []
        for label, plan_est, why in (("estimate(), this model's blocks", est, refused),
                                     ("estimate --params (uniform blocks)", uniform_est, uniform_refused)):
            if plan_est is None:
                est_rows.append(dict(source=label, device="refused", host="", disk=str(why)[:160]))
                verdicts.append(f"{label}: refused")
                continue
            cells, off = dict(source=label), []
            for loc in Location:
                e, p = plan_est.bytes_on(loc), plan.bytes_on(loc)
                if loc is Location.DISK and args.no_speculation:
                    e = disk_bytes(plan_est)  # estimate() speculates with clipping: its shadows apart
                ok = abs(e - p) <= 0.1 * p or abs(e - p) < (1 << 20)  # within 10% (or 1 MiB: fp32 norms vs bf16)
                if not ok:
                    off.append(loc.value)
                change = f"{'+' if e >= p else ''}{(e - p) / max(p, 1) * 100:.1f}%{'' if ok else ' !'}"
                cells[loc.value] = f"{human(e)} ({change})"
            est_rows.append(cells)
            verdicts.append(f"{label}: {'every tier within 10%' if not off else 'NOT within 10% on ' + ', '.join(off)}")
        est_rows.append(dict(source="wrap()'s plan", **{loc.value: human(plan.bytes_on(loc)) for loc in Location}))
        est_rows.append(dict(source="measured", device=f"peak {human(final_stats.get('device_peak_bytes', 0))}",
                             host=f"RSS growth {human(peak - rss_base)}", disk=f"swap file {human(swap_allocated)}"))
        print_table(est_rows, ["source", "device", "host", "disk"])
        print("bytes per tier against wrap()'s plan: " + "; ".join(verdicts))
        if leftovers:
            print(f"WARNING: files left in the swap directory after close(): {leftovers}")
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(dict(rows=rows, rss_growth_GB=(peak - rss_base) / GB), f)
        print(f"swap directory {swap_dir} removed")

        if not args.quick:
            append_csv("bench_scale", [dict(r, params=n_params, disk_weights=kept.value, layers=args.layers, dim=args.dim,
                                            host_memory=host_memory, device_memory=device_memory,
                                            peak_rss_GB=peak / GB, rss_growth_GB=(peak - rss_base) / GB,
                                            disk_read_GBps=disk.read / GB, disk_write_GBps=disk.write / GB,
                                            wrap_s=wrap_seconds, model=described.split(" (")[0],
                                            max_grad_norm=args.max_grad_norm, moments=moments.value,
                                            loss_scale=args.loss_scale, speculation=not args.no_speculation,
                                            malloc_env=" ".join(malloc_env)) for r in rows])
        return 0
    finally:  # an error midway must not strand a 30+ GB swap file (the engine's and the probe's files live here)
        shutil.rmtree(swap_dir, ignore_errors=True)


CLIPPING_REGIMES = {"no clipping": [], "max_grad_norm=1.0, norms below (loss x 1e-3)":
                    ["--max-grad-norm", "1.0", "--loss-scale", "1e-3"],
                    "max_grad_norm=1.0, clips every step (loss x 1e3)": ["--max-grad-norm", "1.0", "--loss-scale", "1e3"]}


def clipping_rounds(args: argparse.Namespace, argv: List[str]) -> int:
    """Issue 35's comparison: each regime runs as its own process (its own swap file, its own peak RSS), round
    after round, so that the machine's drift falls on all three alike; the efficiency of steps 2.. (step 1 fills
    the ring and speculates for the first time) is summarized per regime as median and range."""
    passthrough: List[str] = []
    skip = False
    for arg in argv:  # the child gets this command line without the driver's own flags
        if skip:
            skip = False
            continue
        if arg.split("=")[0] in ("--clipping-rounds", "--max-grad-norm", "--loss-scale", "--result-json"):
            skip = "=" not in arg
            continue
        passthrough.append(arg)
    print(machine_header())
    print(f"# speculative clipping at scale: {args.clipping_rounds} rounds of {len(CLIPPING_REGIMES)} runs, each its "
          f"own process: bench_scale.py {' '.join(passthrough)} [+ the regime's flags]")
    results: Dict[str, List[dict]] = {name: [] for name in CLIPPING_REGIMES}
    with tempfile.TemporaryDirectory(prefix="offload-scale-rounds-") as scratch:
        for round_ in range(1, args.clipping_rounds + 1):
            for name, flags in CLIPPING_REGIMES.items():
                out = os.path.join(scratch, "result.json")
                command = [sys.executable, __file__, *passthrough, *flags, "--result-json", out]
                print(f"# round {round_}, {name}: {' '.join(command[1:])}", flush=True)
                done = subprocess.run(command, stdout=subprocess.DEVNULL)
                if done.returncode != 0:
                    print(f"round {round_}, {name}: the run failed (exit {done.returncode})", file=sys.stderr)
                    return done.returncode
                with open(out) as f:
                    result = json.load(f)
                for row in result["rows"]:
                    results[name].append(dict(row, round=round_, regime=name, rss_growth_GB=result["rss_growth_GB"]))
    rows = [r for runs in results.values() for r in runs]
    columns = ["regime", "round", "step", "step_s", "cpu_s", "worker_cpu_s", "worker_s", "worker_disk_s", "efficiency",
               "bound_s", "grad_norm", "speculated", "kept", "forward_s", "backward_s", "update_s", "wait_s",
               "disk_read_GB", "disk_written_GB", "rss_growth_GB"]
    print_table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows], columns)
    print()
    # Each process probes the disk once for its own efficiency, and on a virtual disk one probe differs from the
    # next by up to 40%: the pooled bound divides every run's bytes by the median bandwidths of all the processes'
    # probes, so that regimes moving the same bytes compare by their step times alone.
    probes = {(r["regime"], r["round"]): (r["disk_read_GB"] / r["T_read_s"], r["disk_written_GB"] / r["T_write_s"])
              for r in rows if r["T_read_s"] > 0 and r["T_write_s"] > 0}
    read_bw = statistics.median(p[0] for p in probes.values())
    write_bw = statistics.median(p[1] for p in probes.values())
    print(f"pooled bound: the median of {len(probes)} processes' probes, read {read_bw:.2f} GB/s, "
          f"write {write_bw:.2f} GB/s")
    summary = []
    base: Optional[Tuple[float, float]] = None
    for name, runs in results.items():
        later = [r for r in runs if r["step"] > 1]
        eff = sorted(r["efficiency"] for r in later)
        pooled = sorted((r["disk_read_GB"] / read_bw + r["disk_written_GB"] / write_bw) / r["step_s"] for r in later)
        median, pooled_median = statistics.median(eff), statistics.median(pooled)
        base = (median, pooled_median) if base is None else base
        summary.append(dict(regime=name, steps=len(eff), efficiency_median=f"{median:.3f}",
                            efficiency_range=f"{eff[0]:.3f}-{eff[-1]:.3f}",
                            step_s_median=f"{statistics.median(r['step_s'] for r in later):.2f}",
                            vs_no_clipping=f"{median - base[0]:+.3f}", pooled_bound_efficiency=f"{pooled_median:.3f}",
                            pooled_range=f"{pooled[0]:.3f}-{pooled[-1]:.3f}",
                            pooled_vs_no_clipping=f"{pooled_median - base[1]:+.3f}"))
    print_table(summary, ["regime", "steps", "efficiency_median", "efficiency_range", "step_s_median",
                          "vs_no_clipping", "pooled_bound_efficiency", "pooled_range", "pooled_vs_no_clipping"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
