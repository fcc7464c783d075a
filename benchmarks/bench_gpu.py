"""One GPU, a ~1.1B Llama-style model: plain PyTorch, offload's cpu and nvme tiers and DeepSpeed ZeRO-3 with its
optimizer on the CPU, each step against the bound measured in the same run (issue 32; benchmarks/gpu_check.sh).

    python benchmarks/bench_gpu.py --out DIR [--swap-dir /var/tmp] [--time-limit 240]   # on a CUDA machine
    python benchmarks/bench_gpu.py --out DIR --rehearse     # the same code on the CPU: 2 tiny layers, seconds

The model is transformers' `LlamaForCausalLM` from a `LlamaConfig` (TinyLlama-1.1B's shape: hidden 2048, MLP 5632,
22 layers, 32 heads, 4 key/value heads, vocab 32000, untied head; SDPA attention; random weights), or without
transformers a Llama-like module of this file. One random batch of 4 x 2048 tokens, the same every step (the loss
falls: a check that each row trains). Each row runs in its own process, one after the other (a crash, an OOM or
a hang costs that row alone; peak GPU memory and peak RSS are the row's own):

- `plain`: PyTorch with everything on the GPU: fp32 weights, autocast bf16, torch.optim.AdamW(fused=True);
- `offload_cpu`, `offload_nvme`: `offload.wrap(tier=...)`, bf16 compute, fp32 master weights and Adam state on the
  host or in a swap file under `--swap-dir`, `device_memory` = half the bf16 weights (+ the largest gradient):
  the rest of the weights stream (the model's training state on a GPU is 16 B/param);
- `deepspeed`: ZeRO-3, bf16, `offload_optimizer` cpu (pinned), DeepSpeed's CPU Adam; when DeepSpeed imports, or
  `--prepare-deepspeed` installed it from `.peers/` and built its CPU Adam op beforehand (gpu_check.sh does that
  in the background while the tests run); skipped with the reason otherwise.

A step is forward, backward, step, zero_grad and a synchronize (offload's updates applied, the GPU idle); 2
warm-up steps then up to 5 timed, fewer when the row's time budget would not hold them (the table says how
many). The bound of DESIGN.md section 2, with every bandwidth measured by a probe process in the same run:
T_gpu = forward + backward of the bf16 model resident on the GPU; T_pcie = the row's bytes per step each way
(engine.stats()) / pinned copy bandwidth that way; T_cpu = trainable params x 30 B / DRAM copy bandwidth; T_nvme
= the row's disk bytes read / read bandwidth + written / write bandwidth (O_DIRECT, offload.measure.DiskProbe in
the swap directory). bound = max of the four (on a CPU device compute and Adam share the cores:
max(T_gpu + T_cpu, T_nvme), as benchmarks/bench_train.py); efficiency = bound / median step. Model TFLOP/s =
(6 N + 12 L d s) x tokens / step, N the parameters less the input embedding. Writes bench_gpu.{md,csv,json} and
rows/<row>.{log,json} under --out after every row, so a run stopped half-way keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import namedtuple
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ROWS = ("plain", "offload_cpu", "offload_nvme", "deepspeed")
LABELS = {
    "plain": "PyTorch, all on the GPU (AdamW fused, autocast bf16)",
    "offload_cpu": 'offload tier="cpu"',
    "offload_nvme": 'offload tier="nvme"',
    "deepspeed": "DeepSpeed ZeRO-3, offload_optimizer cpu",
}
# Seconds each part may take (GPU / rehearsal); the parent shrinks them to what is left of --time-limit.
BUDGETS = {"probe": (45, 60), "plain": (50, 60), "offload_cpu": (70, 60), "offload_nvme": (100, 60),
           "deepspeed": (90, 60)}
# The least seconds (GPU / rehearsal) a part is started with; the parent keeps them for the parts still to come.
LEAST = {"probe": (15, 5), "plain": (20, 5), "offload_cpu": (25, 5), "offload_nvme": (30, 5), "deepspeed": (40, 0)}
GPU_SHAPE = dict(vocab=32000, dim=2048, hidden=5632, layers=22, heads=32, kv_heads=4, seq=2048, batch=4)
TINY_SHAPE = dict(vocab=256, dim=64, hidden=128, layers=2, heads=4, kv_heads=2, seq=64, batch=2)
HP = dict(lr=1e-4, weight_decay=0.01)  # given to every rival explicitly (offload.wrap's defaults may change)
ADAM_BYTES = 30  # per param per step, bf16 compute (DESIGN.md section 2; offload.measure.ADAM_BYTES_PER_PARAM)
INJECT = "GPU_CHECK_INJECT_FAILURE"  # "bench:<row>" makes that row raise after its first step (tests)
COLUMNS = ["rival", "steps", "step_s", "min_s", "max_s", "tokens_per_s", "model_TFLOPs", "gpu_peak_GB",
           "host_peak_GB", "loss", "T_gpu_s", "T_pcie_s", "T_cpu_s", "T_nvme_s", "bound_s", "efficiency", "note"]


# ----- the model -----------------------------------------------------------------------------------------------
def build_model(shape: Dict[str, int], builtin: bool = False):
    """(model in fp32 on the current default device, its description)."""

    if not builtin:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as exc:
            print(f"transformers not importable ({exc}): the built-in Llama-like module instead", flush=True)
        else:
            config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["dim"],
                                 intermediate_size=shape["hidden"], num_hidden_layers=shape["layers"],
                                 num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                                 max_position_embeddings=max(2048, shape["seq"]), tie_word_embeddings=False)
            config._attn_implementation = "sdpa"
            model = LlamaForCausalLM(config).float()
            return model, "transformers LlamaForCausalLM (sdpa)"
    return LlamaLike(shape), "built-in Llama-like module"


def _builtin_classes():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class RMSNorm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight.to(x.dtype) * y.to(x.dtype)

    class Layer(nn.Module):
        """Pre-norm decoder layer: grouped-query causal attention (no rotary: not what is timed), SwiGLU MLP."""

        def __init__(self, s: Dict[str, int]) -> None:
            super().__init__()
            d, head = s["dim"], s["dim"] // s["heads"]
            self.heads, self.kv_heads = s["heads"], s["kv_heads"]
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
            self.q_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, s["kv_heads"] * head, bias=False)
            self.v_proj = nn.Linear(d, s["kv_heads"] * head, bias=False)
            self.gate_proj, self.up_proj = nn.Linear(d, s["hidden"], bias=False), nn.Linear(d, s["hidden"], bias=False)
            self.down_proj = nn.Linear(s["hidden"], d, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            h = self.input_layernorm(x)
            q = self.q_proj(h).view(b, t, self.heads, -1).transpose(1, 2)
            k, v = (p(h).view(b, t, self.kv_heads, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
            k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Model(nn.Module):
        def __init__(self, s: Dict[str, int]) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(s["vocab"], s["dim"])
            self.layers = nn.ModuleList(Layer(s) for _ in range(s["layers"]))
            self.norm = RMSNorm(s["dim"])
            self.lm_head = nn.Linear(s["dim"], s["vocab"], bias=False)

        def forward(self, input_ids, labels):
            x = self.embed_tokens(input_ids)
            for layer in self.layers:
                x = layer(x)
            logits = self.lm_head(self.norm(x)).float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
            return Output(loss)

    return Model


Output = namedtuple("Output", "loss")  # a tuple, so offload's hook on the root's outputs sees the loss


def LlamaLike(shape: Dict[str, int]):  # noqa: N802 - a constructor
    return _builtin_classes()(shape)


def model_flops_per_token(n_params: int, embed_params: int, shape: Dict[str, int]) -> float:
    return 6 * (n_params - embed_params) + 12 * shape["layers"] * shape["dim"] * shape["seq"]


# ----- measuring in a row's process ----------------------------------------------------------------------------
def peak_rss() -> int:
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Row:
    """What a row's process reports; written to its JSON file after every step."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.data = path, {"row": name, "status": "running", "warmup_s": [], "step_s": [], "losses": []}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_steps(row: Row, step, device: str, budget: float, started: float, warmup: int = 2, timed: int = 5,
              first_timed=None) -> None:
    """Up to `warmup` + `timed` steps within `budget` seconds from `started`: a step starts only when the median
    step so far still fits (the first timed step always runs; warm-ups give way to it when both would not fit).
    Each step's loss and seconds go into the row as it goes."""
    inject = f"bench:{row.data['row']}" in os.environ.get(INJECT, "").split(",")
    warm, steps = row.data["warmup_s"], row.data["step_s"]
    while len(steps) < timed:
        spent = time.monotonic() - started
        estimate = 1.2 * statistics.median(warm + steps) if warm or steps else 0.0
        if steps and spent + estimate > budget:
            row.data["note"] = f"{len(steps)} of {timed} timed steps fit the row's {budget:.0f} s"
            break
        is_warmup = len(warm) < warmup and not (warm and spent + estimate * (warmup - len(warm) + 1) > budget)
        if not is_warmup and not steps and first_timed is not None:
            first_timed()
        _sync(device)
        begin = time.perf_counter()
        loss = step()
        _sync(device)
        seconds = time.perf_counter() - begin
        row.data["losses"].append(float(loss))
        (warm if is_warmup else steps).append(seconds)
        row.save()
        print(f"  {row.data['row']} {'warm-up' if is_warmup else 'timed'} step: {seconds:.3f} s, loss "
              f"{float(loss):.4f}", flush=True)
        if inject:
            raise RuntimeError(f"injected failure in bench row {row.data['row']} ({INJECT})")
    row.data["warmup"] = len(warm)


def child(config: Dict, name: str, result: Path, budget: float) -> int:
    """One row (or the probe) in this process; its JSON file says what it measured."""
    started = time.monotonic()
    row = Row(result, name)
    try:
        if name == "probe":
            probe(config, row)
        else:
            train_row(config, name, row, budget, started)
        row.data["status"] = "ok"
        code = 0
    except SkipRow as exc:
        row.data.update(status="skipped", reason=str(exc))
        code = 0
    except Exception as exc:  # noqa: BLE001 - reported in the table and the summary, then the exit code
        traceback.print_exc()
        oom = type(exc).__name__ == "OutOfMemoryError"
        row.data["status"] = "skipped" if (oom and name == "plain") else "failed"
        row.data["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        code = 0 if row.data["status"] == "skipped" else 1
    row.data["host_peak_bytes"] = peak_rss()
    row.data["seconds"] = time.monotonic() - started
    row.save()
    return code


def probe(config: Dict, row: Row) -> None:
    """The bandwidths and T_gpu of the bound: DRAM copy, pinned copies each way, disk, forward + backward."""
    import torch

    from offload.measure import DiskProbe, dram_bandwidth

    device, cuda = config["device"], config["device"].startswith("cuda")
    n = (1 << 30) // 4 if cuda else (64 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dram_bandwidth(src, dst)
    row.data["dram_Bps"] = statistics.median(dram_bandwidth(src, dst) for _ in range(3))
    del src, dst
    if cuda:
        host = torch.empty(n, pin_memory=True)
        dev = torch.empty(n, device=device)
        for key, copy in (("h2d_Bps", lambda: dev.copy_(host, non_blocking=True)),
                          ("d2h_Bps", lambda: host.copy_(dev, non_blocking=True))):
            samples = []
            for _ in range(4):
                torch.cuda.synchronize()
                start = time.perf_counter()
                copy()
                torch.cuda.synchronize()
                samples.append(4 * n / (time.perf_counter() - start))
            row.data[key] = statistics.median(samples[1:])
        del host, dev
    disk = DiskProbe(config["swap_dir"], sample_bytes=(256 << 20) if cuda else (8 << 20), samples=3)
    try:
        for _ in range(3):
            disk.sample()
        measured = disk.result()
        row.data.update(disk_read_Bps=measured.read, disk_write_Bps=measured.write, disk_backend=measured.backend,
                        disk_direct=measured.direct)
    finally:
        disk.close()
    row.save()
    torch.manual_seed(0)
    with torch.device(device):
        model, _ = build_model(config["shape"], config["builtin"])
    model.to(torch.bfloat16)
    ids = batch(config)

    def fwd_bwd():
        loss = forward(model, ids)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    run_steps(row, fwd_bwd, device, budget=math.inf, started=time.monotonic(), warmup=1, timed=config["probe_steps"])
    row.data["T_gpu_s"] = statistics.median(row.data["step_s"])


def batch(config: Dict):
    import torch

    gen = torch.Generator().manual_seed(1)
    shape = config["shape"]
    return torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=gen).to(config["device"])


def forward(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out.loss if hasattr(out, "loss") else out[0]


def train_row(config: Dict, name: str, row: Row, budget: float, started: float) -> None:
    import torch

    device, cuda = config["device"], config["device"].startswith("cuda")
    if name == "deepspeed" and not cuda:
        raise SkipRow("DeepSpeed ZeRO-3 needs a CUDA device (rehearsal on the CPU)")
    torch.manual_seed(0)
    with torch.device(device if cuda else "cpu"):  # random init on the GPU is fast; the same weights every row
        model, described = build_model(config["shape"], config["builtin"])
    params = sum(p.numel() for p in model.parameters())
    embed = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).weight.numel()
    row.data.update(model=described, params=params, embed_params=embed, label=LABELS[name])
    ids = batch(config)
    engine = None
    # bf16 compute: plain PyTorch's way, and offload's with a model whose norms keep fp32 weights (HF's RMSNorm
    # multiplies its fp32 weight into the activations)
    autocast = torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16)
    if name == "plain":
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=cuda)

        def step():
            with autocast:
                loss = forward(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif name.startswith("offload"):
        import offload

        model.to("cpu")
        if cuda:
            torch.cuda.empty_cache()
        weights = 2 * params  # bf16
        largest = 2 * max(p.numel() for p in model.parameters())
        device_memory = weights // 2 + largest  # half the weights stream; room for autograd's largest gradient
        tier = name.split("_")[1]
        engine = offload.wrap(model, tier=tier, nvme_path=config["swap_dir"] if tier == "nvme" else None, **HP,
                              dtype=torch.bfloat16, device=device, device_memory=device_memory,
                              grad_accumulation_steps=1)
        row.data["device_memory"] = device_memory
        print(engine.plan, flush=True)

        def step():
            with autocast:
                loss = forward(engine, ids)
            loss.backward()
            engine.step()
            engine.zero_grad()
            engine.synchronize()
            return loss.detach()
    else:
        engine, step = deepspeed_engine(config, model, ids)
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peaks from here: the model's build is not what is compared
        row.data["gpu_after_setup_bytes"] = torch.cuda.memory_allocated()
    counters = []  # engine.stats() before the first timed step

    def first_timed():
        if name.startswith("offload"):
            counters.append(engine.stats())

    warmup, timed = config["steps"]
    run_steps(row, step, device, budget, started, warmup=warmup, timed=timed, first_timed=first_timed)
    before = counters[0] if counters else None
    if name.startswith("offload") and before is not None:
        after, timed = engine.stats(), len(row.data["step_s"])
        for key in ("bytes_host_to_device", "bytes_device_to_host", "bytes_disk_read", "bytes_disk_written"):
            row.data[key + "_per_step"] = (after[key] - before[key]) / timed
        row.data["engine_device_peak_bytes"] = after["device_peak_bytes"]
    if cuda:
        row.data["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        row.data["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    if name.startswith("offload"):
        engine.close()


class SkipRow(Exception):
    """A row that cannot run here, with the reason."""


def deepspeed_engine(config: Dict, model, ids):
    """DeepSpeed ZeRO-3 with the optimizer (and its state) on the CPU, one process."""
    import deepspeed  # type: ignore[import-not-found]

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    ds_config = deepspeed_config(config["shape"]["batch"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step():
        loss = forward(engine, ids)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return engine, step


def deepspeed_config(micro_batch: int) -> Dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": HP["lr"], "weight_decay": HP["weight_decay"],
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


# ----- DeepSpeed from .peers, ahead of time ----------------------------------------------------------------------
def prepare_deepspeed(peers: Path, target: Path, result: Path) -> int:
    """Install DeepSpeed and its missing dependencies from `peers` into `target` (no registry) and build its CPU
    Adam op once; writes {"ok", "reason", "pythonpath", "torch_extensions_dir", "seconds"} to `result`."""
    started = time.monotonic()
    out: Dict[str, object] = {"ok": False, "pythonpath": "", "torch_extensions_dir": str(target / "torch_extensions")}
    env = dict(os.environ, DS_BUILD_OPS="0", TORCH_EXTENSIONS_DIR=str(out["torch_extensions_dir"]))

    def importable(pythonpath: str) -> subprocess.CompletedProcess:
        code = ("import deepspeed, torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; "
                "DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))]); print('deepspeed', deepspeed.__version__)")
        run_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p))
        return subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True)

    try:
        check = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True)
        if check.returncode != 0:
            files = [str(p) for p in sorted(peers.glob("*.whl")) if not p.name.startswith("torchao")]  # not needed
            files += sorted(str(p) for p in peers.glob("deepspeed-*"))
            if not any("deepspeed" in Path(f).name for f in files):
                out["reason"] = f"DeepSpeed is not installed and {peers}/ holds no deepspeed package"
                return 0
            print(f"installing {len(files)} packages from {peers}/ into {target}", flush=True)
            install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                      "--no-build-isolation", "--target", str(target), *files], env=env,
                                     capture_output=True, text=True)
            print(install.stdout[-3000:], install.stderr[-3000:], flush=True)
            if install.returncode != 0:
                out["reason"] = "pip install from .peers failed: " + _last_line(install.stderr)
                return 1
            out["pythonpath"] = str(target)
        print("building DeepSpeed's CPU Adam op (first use)", flush=True)
        built = importable(str(out["pythonpath"]))
        print(built.stdout[-3000:], built.stderr[-5000:], flush=True)
        if built.returncode != 0:
            out["reason"] = "DeepSpeedCPUAdam did not build or load: " + _last_line(built.stderr)
            return 1
        out["ok"], out["reason"] = True, built.stdout.strip().splitlines()[-1]
        return 0
    finally:
        out["seconds"] = time.monotonic() - started
        result.write_text(json.dumps(out, indent=1))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


# ----- the parent: rows one after the other, the table ---------------------------------------------------------
def bound_of(row: Dict, probe: Dict, cuda: bool) -> Dict[str, float]:
    """T_gpu, T_pcie, T_cpu, T_nvme and the bound for one row (seconds), from the probe's bandwidths."""
    t_gpu = probe.get("T_gpu_s", math.nan)
    parts = {"T_gpu_s": t_gpu, "T_pcie_s": 0.0, "T_cpu_s": 0.0, "T_nvme_s": 0.0}
    name = row["row"]
    if name != "plain":
        parts["T_cpu_s"] = row.get("params", 0) * ADAM_BYTES / probe.get("dram_Bps", math.nan)
    if name.startswith("offload"):
        if cuda:
            parts["T_pcie_s"] = max(row.get("bytes_host_to_device_per_step", 0) / probe.get("h2d_Bps", math.nan),
                                    row.get("bytes_device_to_host_per_step", 0) / probe.get("d2h_Bps", math.nan))
        read, written = row.get("bytes_disk_read_per_step", 0), row.get("bytes_disk_written_per_step", 0)
        if read or written:
            parts["T_nvme_s"] = (read / probe.get("disk_read_Bps", math.nan)
                                 + written / probe.get("disk_write_Bps", math.nan))
    elif name == "deepspeed" and cuda:  # the least it moves: bf16 gradients down, bf16 weights up
        parts["T_pcie_s"] = max(2 * row.get("params", 0) / probe.get("h2d_Bps", math.nan),
                                2 * row.get("params", 0) / probe.get("d2h_Bps", math.nan))
    if cuda:
        parts["bound_s"] = max(parts.values())
    else:  # compute and the CPU Adam share the cores; reads and writes share the disk
        parts["bound_s"] = max(t_gpu + parts["T_cpu_s"], parts["T_nvme_s"])
    return parts


def table_row(row: Dict, probe: Dict, shape: Dict[str, int], cuda: bool) -> Dict[str, str]:
    out = {"rival": LABELS.get(row["row"], row["row"])}
    status = row.get("status", "failed")
    steps = row.get("step_s", [])
    if status != "ok" or not steps:
        out["steps"] = "0"
        out["note"] = (f"{status.upper()}: {row.get('error', row.get('reason', 'no timed step'))}")[:160]
        return out
    median = statistics.median(steps)
    tokens = shape["batch"] * shape["seq"]
    flops = model_flops_per_token(row["params"], row["embed_params"], shape) * tokens
    losses = row.get("losses", [])
    out.update(steps=f"{len(steps)}+{row.get('warmup', 2)}", step_s=f"{median:.3f}", min_s=f"{min(steps):.3f}",
               max_s=f"{max(steps):.3f}", tokens_per_s=f"{tokens / median:.0f}",
               model_TFLOPs=f"{flops / median / 1e12:.1f}" if cuda else f"{flops / median / 1e12:.4f}",
               host_peak_GB=f"{row.get('host_peak_bytes', 0) / 1e9:.1f}",
               loss=f"{losses[0]:.3f}->{losses[-1]:.3f}" if losses else "")
    if "gpu_peak_bytes" in row:
        out["gpu_peak_GB"] = f"{row['gpu_peak_bytes'] / 1e9:.1f}"
    bound = bound_of(row, probe, cuda)
    for key, value in bound.items():
        out[key] = f"{value:.3f}"
    out["efficiency"] = f"{bound['bound_s'] / median:.2f}"
    out["note"] = row.get("note", "")
    return out


def write_outputs(out: Path, header: List[str], probe: Dict, rows: List[Dict], shape, cuda: bool) -> List[Dict]:
    table = [table_row(r, probe, shape, cuda) for r in rows]
    with open(out / "bench_gpu.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    lines = ["```", *"\n".join(header).splitlines(), "```"]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.get(c, "").replace("|", "/") for c in COLUMNS) + " |" for r in table]
    (out / "bench_gpu.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "bench_gpu.json").write_text(json.dumps({"header": header, "probe": probe, "rows": rows}, indent=1))
    return table


def run_child(config_path: Path, out: Path, name: str, budget: float, env: Optional[Dict[str, str]] = None) -> Dict:
    result = out / "rows" / f"{name}.json"
    log = out / "rows" / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--config", str(config_path),
           "--result", str(result), "--budget-s", f"{budget:.0f}"]
    print(f"\n== {name}: up to {budget:.0f} s", flush=True)
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=budget + 15)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    text = log.read_text(encoding="utf-8", errors="replace")
    print(text, end="", flush=True)
    data = json.loads(result.read_text()) if result.exists() else {"row": name}
    if code is None:
        data.update(status="failed", error=f"timed out after {time.monotonic() - started:.0f} s "
                                           f"(budget {budget:.0f} s)")
    elif code != 0 and data.get("status") in (None, "running", "ok"):
        data.update(status="failed", error=f"exit code {code}: {_last_line(text)}")
    if data.get("status") == "failed":
        data["log_tail"] = text.strip().splitlines()[-25:]
    return data


def parent(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    import torch
    from common import machine_header, print_table

    device = args.device or ("cpu" if args.rehearse else "cuda")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available to torch: nothing to measure", file=sys.stderr)
        return 1
    shape = dict(TINY_SHAPE if args.rehearse else GPU_SHAPE)
    for key in shape:
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    swap_root = args.swap_dir or tempfile.gettempdir()
    swap_dir = tempfile.mkdtemp(prefix="offload-bench-gpu-", dir=swap_root)
    config = {"device": device, "shape": shape, "swap_dir": swap_dir, "builtin": args.builtin,
              "steps": (1, 2) if args.rehearse else (2, 5), "probe_steps": 2 if args.rehearse else 3}
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config, indent=1))
    limit = args.time_limit
    gpu = torch.cuda.get_device_name(0) if cuda else "none (rehearsal on the CPU)"
    header = [machine_header(),
              f"# GPU: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}; swap directory {swap_root}",
              f"# Llama-style: layers {shape['layers']}, hidden {shape['dim']}, MLP {shape['hidden']}, heads "
              f"{shape['heads']} (kv {shape['kv_heads']}), vocab {shape['vocab']}; batch {shape['batch']} x "
              f"{shape['seq']} tokens; bf16 compute; lr {HP['lr']}, weight decay {HP['weight_decay']}",
              "# bound = max(T_gpu, T_pcie, T_cpu, T_nvme) measured in this run (benchmarks/bench_gpu.py); "
              "efficiency = bound / median step; steps = timed + warm-up"]
    print("\n".join(header), flush=True)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"unknown rows {unknown}: choose from {ROWS}", file=sys.stderr)
        return 2
    index = 1 if args.rehearse else 0
    ds_reason, ds_env = deepspeed_ready(args, cuda) if "deepspeed" in rows else ("", None)

    def budget_for(name: str, later: List[str]) -> float:
        later = [r for r in later if not (r == "deepspeed" and ds_reason)]
        left = limit - (time.monotonic() - started) - sum(LEAST[r][index] for r in later)
        return min(BUDGETS[name][index], left)

    probe_budget = budget_for("probe", rows)
    probe = run_child(config_path, out, "probe", probe_budget) if probe_budget >= LEAST["probe"][index] else {}
    if probe.get("status") != "ok":
        print(f"the probe did not finish: bounds are missing ({probe.get('error', 'no time')})", flush=True)
    results: List[Dict] = []
    failed = probe.get("status") == "failed"
    for i, name in enumerate(rows):
        budget = budget_for(name, rows[i + 1:])
        env = None
        data: Dict = {"row": name}
        if name == "deepspeed":
            env = ds_env
            if ds_reason:
                data.update(status="skipped", reason=ds_reason)
        if "status" not in data and budget < max(LEAST[name][index], 1):
            data.update(status="skipped", reason=f"{budget:.0f} s left of the bench's {limit:.0f} s "
                                                 f"(needs {LEAST[name][index]} s)")
        if "status" not in data:
            data = run_child(config_path, out, name, budget, env)
        else:
            print(f"\n== {name}: skipped: {data['reason']}", flush=True)
        failed |= data.get("status") == "failed"
        results.append(data)
        _clear(swap_dir)  # a row that crashed leaves its swap file: not for the next row's disk
        write_outputs(out, header, probe, results, shape, cuda)
    table = write_outputs(out, header, probe, results, shape, cuda)
    print()
    print("\n".join(header))
    if probe.get("status") == "ok":
        bw = ", ".join(f"{k} {probe[k] / 1e9:.1f} GB/s" for k in ("dram_Bps", "h2d_Bps", "d2h_Bps", "disk_read_Bps",
                                                                  "disk_write_Bps") if k in probe)
        print(f"# probe: T_gpu {probe['T_gpu_s']:.3f} s; {bw}")
    print_table(table, COLUMNS)
    for name in ("config.json",):
        (out / name).unlink(missing_ok=True)
    _clear(swap_dir)
    shutil.rmtree(swap_dir, ignore_errors=True)
    print(f"wrote {out / 'bench_gpu.md'}, bench_gpu.csv, bench_gpu.json; {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


def _clear(directory: str) -> None:
    for path in Path(directory).iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def deepspeed_ready(args: argparse.Namespace, cuda: bool):
    """(why DeepSpeed cannot run or "", the environment its row runs in)."""
    if not cuda:
        return "DeepSpeed ZeRO-3 needs a CUDA device (rehearsal on the CPU)", None
    env = dict(os.environ)
    if args.deepspeed_prep:
        prep_path = Path(args.deepspeed_prep)
        if not prep_path.exists():
            return "DeepSpeed's install and op build did not finish in time (gpu_check.sh stopped it)", None
        prep = json.loads(prep_path.read_text())
        if not prep.get("ok"):
            return f"DeepSpeed not ready: {prep.get('reason')}", None
        env["TORCH_EXTENSIONS_DIR"] = prep["torch_extensions_dir"]
        if prep.get("pythonpath"):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (prep["pythonpath"], env.get("PYTHONPATH", "")) if p)
        return "", env
    check = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True)
    if check.returncode != 0:
        return f"DeepSpeed not importable: {_last_line(check.stderr)}", None
    return "", env


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "bench_gpu"), help="output folder")
    parser.add_argument("--rehearse", action="store_true", help="the CPU, a 2-layer tiny model, short budgets")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --rehearse)")
    parser.add_argument("--swap-dir", default=None, help="where the nvme row's swap file goes (a local disk)")
    parser.add_argument("--time-limit", type=float, default=300, help="seconds for the whole bench")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--builtin", action="store_true", help="the built-in Llama-like module, not transformers'")
    parser.add_argument("--deepspeed-prep", default=None, help="the JSON --prepare-deepspeed wrote")
    for key in GPU_SHAPE:
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None)
    parser.add_argument("--prepare-deepspeed", nargs=3, metavar=("PEERS", "TARGET", "RESULT"), default=None,
                        help="install DeepSpeed from PEERS into TARGET and build its CPU Adam op; RESULT: JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_deepspeed:
        peers, target, result = args.prepare_deepspeed
        return prepare_deepspeed(Path(peers), Path(target), Path(result))
    if args.child:
        config = json.loads(Path(args.config).read_text())
        return child(config, args.child, Path(args.result), args.budget_s)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
