"""`python -m offload demo`: train a small GPT on the nvme tier for a few steps and show how close to the
hardware bound it runs.

    python -m offload demo                       # 20 steps, about 15 s on 2 cores
    python -m offload demo --nvme-path /mnt/nvme --steps 50 --dim 512

It prints the placement plan, the loss and step time of every step (a tqdm bar), then the bound of
DESIGN.md section 2 measured in the same run (offload.measure): a plain forward+backward of the same model
(T_compute), a DRAM copy (T_cpu), O_DIRECT reads and writes in the swap directory (T_read, T_write), and
`efficiency = bound / step`. The tokens come from a Markov chain over 16 ids (cli/demo_data.py), written
as a token file in `--out` and read by `offload.data.TokenWindows`, so the loss falls smoothly toward the
chain's entropy; the loss curve lands in `--out/loss.png` (with matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from offload.cli.demo_data import DEMO_TOKENS, SUCCESSOR_PROBABILITIES
from offload.cli.options import byte_size, non_negative_finite_float, positive_int
from offload.optim.moment_format import MomentFormat

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HEADS = 4  # DemoGPT's attention heads: --dim is split among them
SUCCESSORS = len(SUCCESSOR_PROBABILITIES)  # each token of the demo's Markov chain has these


class DemoLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class DemoGPT(nn.Module):
    """A GPT-style model with tied embedding and output; `forward(idx, targets)` returns the loss."""

    def __init__(self, vocab: int, dim: int, layers: int, context: int, heads: int = HEADS) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.h = nn.ModuleList(DemoLayer(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.h:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def inputs_and_targets(window: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A (batch, context + 1) window as the model's tokens and their next-token targets."""
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m offload demo", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def model_width(text: str) -> int:
    """`--dim`: a multiple of HEADS."""
    value = _integer(text)
    if value is None or value < HEADS or value % HEADS:
        raise argparse.ArgumentTypeError(f"must be a multiple of {HEADS} (the demo's {HEADS} attention heads), "
                                         f">= {HEADS}, got {text!r}")
    return value


def vocabulary(text: str) -> int:
    """`--vocab`: room for the Markov chain's successors."""
    value = _integer(text)
    if value is None or value < SUCCESSORS:
        raise argparse.ArgumentTypeError(f"must be an integer >= {SUCCESSORS} (the demo's Markov chain gives each "
                                         f"token {SUCCESSORS} successors), got {text!r}")
    return value


def context_length(text: str) -> int:
    """`--context`: a window of context + 1 tokens must fit the demo's token file."""
    value = _integer(text)
    if value is None or not 1 <= value < DEMO_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {DEMO_TOKENS - 1}] (a window of context + 1 "
                                         f"tokens of the demo's {DEMO_TOKENS}-token file), got {text!r}")
    return value


def existing_directory(text: str) -> str:
    """`--nvme-path`: the swap file's temporary directory is made inside it."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be an existing directory (the swap file's temporary directory is "
                                         f"made inside it), got {text!r}")
    return text


def output_directory(text: str) -> str:
    """`--out`: a directory, made if missing."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a directory for the token file and loss.png (made if missing); "
                                         f"{text!r} is a file")
    return text


def _integer(text: str) -> Optional[int]:
    try:
        return int(text)
    except ValueError:
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag is checked here, so a bad value is an argparse error naming it and its range."""
    parser.add_argument("--steps", type=positive_int, default=20, help="training steps (>= 1)")
    parser.add_argument("--layers", type=positive_int, default=8, help="transformer layers (>= 1)")
    parser.add_argument("--dim", type=model_width, default=384, help=f"model width (a multiple of {HEADS})")
    parser.add_argument("--vocab", type=vocabulary, default=4096, help=f"vocabulary (>= {SUCCESSORS})")
    parser.add_argument("--context", type=context_length, default=128,
                        help=f"tokens per sequence (1 to {DEMO_TOKENS - 1})")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per step (>= 1)")
    parser.add_argument("--lr", type=non_negative_finite_float, default=1e-3, help="learning rate (>= 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--nvme-path", type=existing_directory, default=None,
                        help="directory for the swap file (default: a temp dir)")
    parser.add_argument("--host-memory", type=byte_size, default=None, help="host budget, e.g. 512MB")
    parser.add_argument("--device-memory", type=byte_size, default=None,
                        help="device budget, e.g. 64MB (weights stream beyond it)")
    parser.add_argument("--activation-memory", type=byte_size, default=None,
                        help="of --device-memory, bytes kept free of weights for the activations (offload.wrap's "
                             "activation_memory)")
    parser.add_argument("--out", type=output_directory, default="offload-demo",
                        help="directory for the token file and loss.png (made if missing)")
    parser.add_argument("--moments", choices=[m.value for m in MomentFormat], default="fp32",
                        help="how the Adam moments are kept (offload.wrap's moments=): fp32 (exact), bf16, int8")
    parser.add_argument("--data-backend", choices=["auto", "dali", "numpy"], default="auto",
                        help="offload.data reader (auto: DALI when installed)")


def _measure_bound(model: nn.Module, batches: List[Any], swap_dir: str, trainable: int, dtype: torch.dtype,
                   disk_read: float, disk_written: float, rounds: int = 3) -> Any:
    """T_compute, DRAM and disk bandwidth sampled round by round, then the step bound."""
    from offload.measure import DiskProbe, dram_bandwidth, step_bound

    probe = DiskProbe(swap_dir, sample_bytes=32 << 20, samples=rounds)
    src, dst = torch.ones(16 << 20), torch.empty(16 << 20)
    computes, drams = [], []
    try:
        for r in range(rounds):
            idx, tgt = batches[r % len(batches)]
            start = time.perf_counter()
            model(idx, tgt).backward()
            computes.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            drams.append(dram_bandwidth(src, dst))
            probe.sample()
        disk = probe.result()
    finally:
        probe.close()
    bound = step_bound(statistics.median(computes), trainable, dtype, statistics.median(drams),
                       disk_read, disk_written, disk)
    return bound, disk, statistics.median(drams)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    import offload
    from offload.cli.demo_data import chain_entropy, write_demo_tokens
    from offload.cli.doctor import report
    from offload.cli.loss_curve import save_loss_curve
    from offload.data import TokenWindows

    # what this machine can use (`python -m offload doctor`), for the disk the swap file goes to: the demo's
    # efficiency reads against it, and the set-up command saves a second start of Python and torch
    print(report(Path(args.nvme_path or tempfile.gettempdir())))
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    model = DemoGPT(args.vocab, args.dim, args.layers, args.context)
    reference = copy.deepcopy(model).to(dtype)  # for T_compute: the same model without offload
    reference.lm_head.weight = reference.wte.weight
    trainable = sum(p.numel() for p in model.parameters())
    token_file = write_demo_tokens(args.out, args.vocab)
    made_dir = args.nvme_path is None
    swap_dir = tempfile.mkdtemp(prefix="offload-demo-", dir=args.nvme_path)
    try:
        engine = offload.wrap(model, tier="nvme", nvme_path=swap_dir, lr=args.lr, weight_decay=0.0, dtype=dtype,
                              device="cpu", grad_accumulation_steps=1, host_memory=args.host_memory,
                              device_memory=args.device_memory, moments=getattr(args, "moments", "fp32"),
                              activation_memory=getattr(args, "activation_memory", None))
        with engine:
            print(f"DemoGPT: {trainable / 1e6:.1f}M parameters, {args.layers} layers, dim {args.dim}, vocab "
                  f"{args.vocab}, {args.batch}x{args.context} tokens per step, {args.dtype}; swap in {swap_dir}")
            print(engine.plan)
            at_wrap = engine.stats()  # wrap() wrote the initial state once: not part of a step
            with TokenWindows(token_file, args.context, args.batch, seed=0, backend=args.data_backend) as windows:
                print(f"data: {windows}")
                step_times, losses, batches = _train(engine, windows, args.steps, tqdm)
            engine.synchronize()
            stats = engine.stats()
        read = (stats["bytes_disk_read"] - at_wrap["bytes_disk_read"]) / len(step_times)
        written = (stats["bytes_disk_written"] - at_wrap["bytes_disk_written"]) / len(step_times)
        bound, disk, dram = _measure_bound(reference, batches, swap_dir, trainable, dtype, read, written)
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True) if made_dir else _remove_empty(swap_dir)
    steady = step_times[1:] or step_times
    step = statistics.median(steady)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; median step {step * 1e3:.1f} ms "
          f"({args.batch * args.context / step:.0f} tokens/s) after the first")
    print(f"bound = max(T_compute + T_cpu, T_read + T_write) = max({bound.t_compute * 1e3:.1f} + "
          f"{bound.t_cpu * 1e3:.1f}, {bound.t_read * 1e3:.1f} + {bound.t_write * 1e3:.1f}) ms = "
          f"{bound.seconds * 1e3:.1f} ms ({bound.limited_by}); DRAM {dram / 1e9:.1f} GB/s, disk read "
          f"{disk.read / 1e9:.2f} GB/s, write {disk.write / 1e9:.2f} GB/s ({disk.backend}, O_DIRECT {disk.direct})")
    curve = save_loss_curve(losses, os.path.join(args.out, "loss.png"), f"offload demo: DemoGPT "
                            f"{trainable / 1e6:.1f}M on the nvme tier", floor=chain_entropy())
    print(f"loss curve: {curve}" if curve else "loss curve: pip install matplotlib to get loss.png")
    print(f"efficiency = bound / step = {bound.efficiency(step):.2f}; disk I/O wait in updates "
          f"{stats.get('nvme_io_wait_seconds', 0.0) / len(losses) * 1e3:.1f} ms/step")
    per_step = {k: (stats[k] - at_wrap.get(k, 0.0)) / len(losses) * 1e3
                for k in ("forward_seconds", "backward_seconds", "update_seconds", "wait_seconds")}
    print(f"per step: forward {per_step['forward_seconds']:.1f} ms, backward {per_step['backward_seconds']:.1f} ms "
          f"(training thread); updates {per_step['update_seconds']:.1f} ms (worker, overlapped); the forward "
          f"waited {per_step['wait_seconds']:.1f} ms for pending updates")
    return 0


def _train(engine: Any, windows: Any, steps: int, tqdm: Any) -> Tuple[List[float], List[float], list]:
    """Run the steps; each step's time is start-to-start, so updates still running (and reading the batch)
    count where they block. Returns the step times, the losses and the first batches (for the bound)."""
    step_times: List[float] = []
    losses: List[float] = []
    first: List[Tuple[torch.Tensor, torch.Tensor]] = []
    bar = tqdm(itertools.islice(windows, steps), desc="nvme demo", unit="step", total=steps)
    last = time.perf_counter()
    for i, window in enumerate(bar):
        idx, tgt = inputs_and_targets(window)
        if len(first) < 3:
            first.append((idx, tgt))
        loss = engine(idx, tgt)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
        bar.set_postfix(loss=f"{losses[-1]:.3f}", step_ms=f"{step_times[-1] * 1e3:.0f}")
        tqdm.write(f"step {i + 1:3d}  loss {losses[-1]:.4f}  {step_times[-1] * 1e3:7.1f} ms")
    return step_times, losses, first


def _remove_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:
        pass


def main(argv: Optional[List[str]] = None) -> int:
    return run(_parse(argv))


__all__ = ["DemoGPT", "inputs_and_targets", "main"]
