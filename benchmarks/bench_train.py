"""End-to-end training step: offload tiers against plain PyTorch AdamW, with the bound measured in-run.

    python benchmarks/bench_train.py [--layers 6 --dim 256 --vocab 4096 --context 128 --batch 4] [--quick]

Rivals run in one process, interleaved round by round on their own copies of one model and the same token
batches. A sample is `--steps` consecutive training steps (forward, backward, step, zero_grad) ending with
all updates applied, divided by the step count. In the same rounds we time the plain forward+backward
(T_compute), a DRAM copy (bandwidth) and O_DIRECT writes and reads of fresh regions of a file in the swap
directory (offload.measure.DiskProbe). On a machine without a GPU compute and the CPU Adam share cores and
DRAM, and reads and writes share the disk, so each row's bound is max(T_compute + T_cpu, T_read + T_write)
with T_cpu = trainable params x bytes/param / DRAM bandwidth and T_read, T_write = that row's disk bytes
per step / disk bandwidth (DESIGN.md section 2); efficiency = bound / step.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_csv, machine_header, print_table, summarize  # noqa: E402

import offload  # noqa: E402
from offload.cli.demo import DemoGPT  # noqa: E402
from offload.measure import DiskProbe, dram_bandwidth, step_bound  # noqa: E402

# The model of `python -m offload demo`: a GPT-style stack with tied embedding and output.
GPT = DemoGPT


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="training steps per timed sample")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--nvme-path", default=None, help="directory for the nvme tier's swap file (default: tmp)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 2 rounds (a smoke run)")
    parser.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32",
                        help="how the offload engines keep the Adam moments (torch AdamW keeps fp32)")
    parser.add_argument("--clipping", choices=["nvme", "cpu"], default=None,
                        help="speculative clipping's rows (issue 35) on that tier: a GPT-2 of 8 x 1024 (vocab 8192), "
                             "fp32, 2 x 64 tokens, grad_accumulation_steps=1: no clipping, and max_grad_norm=1.0 "
                             "with norms far below it and far above it, with and without speculation")
    parser.add_argument("--tiny", action="store_true",
                        help="the shape of nanoGPT's character-level example (2 layers, width 64, vocab 96, 4 x 64 "
                             "tokens, fp32, one thread): what a small model pays per step for the engine (issue 34)")
    args = parser.parse_args(argv)
    if args.clipping:
        clipping_rows(args)
        return
    if args.quick:
        args.layers, args.dim, args.vocab, args.context, args.batch, args.rounds, args.steps = 2, 64, 512, 32, 2, 2, 1
    if args.tiny:
        args.layers, args.dim, args.vocab, args.context, args.batch, args.dtype = 2, 64, 96, 64, 4, "float32"
        args.rounds, args.steps = max(args.rounds, 15), max(args.steps, 10)
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = GPT(args.vocab, args.dim, args.layers, args.context, heads=4)
    n_trainable = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.context), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.context), generator=gen)) for _ in range(args.steps)]
    tokens = args.batch * args.context

    def twin():
        model = copy.deepcopy(base)
        model.lm_head.weight = model.wte.weight
        return model.to(dtype)

    compute_model = twin()
    torch_model = twin()
    hp = dict(lr=1e-4, weight_decay=0.01)  # torch AdamW's weight decay, offload given the same explicitly
    torch_opt = torch.optim.AdamW(torch_model.parameters(), **hp)
    engine_hp = dict(hp, moments=args.moments)
    engines: Dict[str, offload.Engine] = {}
    if not args.tiny:
        engines["offload gpu tier"] = offload.wrap(twin(), tier="gpu", dtype=dtype, device="cpu", **engine_hp)
    engines["offload cpu tier, GA declared"] = offload.wrap(twin(), tier="cpu", dtype=dtype, device="cpu", **engine_hp,
                                                            grad_accumulation_steps=1)
    engines["offload cpu tier, GA unset"] = offload.wrap(twin(), tier="cpu", dtype=dtype, device="cpu", **engine_hp)
    swap_dir = tempfile.mkdtemp(prefix="offload-bench-", dir=args.nvme_path)
    engines["offload nvme tier, GA declared"] = offload.wrap(
        twin(), tier="nvme", nvme_path=swap_dir, dtype=dtype, device="cpu", **engine_hp, grad_accumulation_steps=1)
    if args.tiny:  # as a new user writes it (accumulation not declared), and declared
        engines["offload nvme tier, GA unset"] = offload.wrap(
            twin(), tier="nvme", nvme_path=swap_dir, dtype=dtype, device="cpu", **engine_hp)
    else:
        engines["offload cpu tier, GA unset, overlap_step"] = offload.wrap(twin(), tier="cpu", dtype=dtype,
                                                                          device="cpu", **engine_hp, overlap_step=True)
        weight_bytes = sum(p.numel() for p in base.parameters()) * torch.empty((), dtype=dtype).element_size()
        # half the weights, and the room the device keeps for autograd's largest gradient (docs/design.md
        # [Note: the nvme memory bound])
        half = weight_bytes // 2 + max(p.numel() for p in base.parameters()) * torch.empty((), dtype=dtype).element_size()
        engines["offload cpu tier, weights streamed (budget 50%)"] = offload.wrap(
            twin(), tier="cpu", dtype=dtype, device="cpu", **engine_hp, grad_accumulation_steps=1, device_memory=half)
        # host_memory: the gradients, a ring and 9 MiB of the 11.6 MiB streamed weights: the rest live on disk
        engines["offload nvme tier, weights on disk (device 50%)"] = offload.wrap(
            twin(), tier="nvme", nvme_path=swap_dir, dtype=dtype, device="cpu", **engine_hp, grad_accumulation_steps=1,
            device_memory=half, host_memory=weight_bytes + (12 << 20))

    def compute_only():
        for idx, tgt in batches:
            compute_model(idx, tgt).backward()
            compute_model.zero_grad()

    def torch_step():
        for idx, tgt in batches:
            torch_model(idx, tgt).backward()
            torch_opt.step()
            torch_opt.zero_grad()

    def engine_step(engine):
        def run():
            for idx, tgt in batches:
                engine(idx, tgt).backward()
                engine.step()
                engine.zero_grad()
            engine.synchronize()
        return run

    rivals: Dict[str, Callable[[], None]] = {"fwd+bwd only (T_compute)": compute_only, "torch AdamW": torch_step}
    rivals.update({name: engine_step(e) for name, e in engines.items()})
    copy_buffers = (torch.ones(32 * 2**20), torch.empty(32 * 2**20))
    probe = DiskProbe(swap_dir, sample_bytes=(8 if args.quick else 64) << 20, samples=args.rounds)
    samples: Dict[str, List[float]] = {name: [] for name in rivals}
    bandwidths, before, after = interleaved(rivals, engines, samples, args, copy_buffers, probe)
    disk = probe.result()
    probe.close()
    os.rmdir(swap_dir)

    bw = summarize(bandwidths)[0]
    t_compute = summarize(samples["fwd+bwd only (T_compute)"])[0]
    steps_measured = args.rounds * args.steps

    def per_step(name: str, key: str) -> float:
        return (after[name][key] - before[name][key]) / steps_measured

    compute_bound = step_bound(t_compute, n_trainable, dtype, bw)
    t_torch = summarize(samples["torch AdamW"])[0]
    rows = []
    for name, values in samples.items():
        median, p20, p80 = summarize(values)
        row = dict(rival=name, step_ms=median * 1e3, p20_p80_ms=f"{p20 * 1e3:.1f}-{p80 * 1e3:.1f}",
                   tokens_per_s=tokens / median, vs_torch=t_torch / median)
        bound = compute_bound
        if name in engines:
            row["d2h_MB_step"] = per_step(name, "bytes_device_to_host") / 1e6
            row["h2d_MB_step"] = per_step(name, "bytes_host_to_device") / 1e6
            row["device_peak_MB"] = after[name]["device_peak_bytes"] / 1e6
            read, written = per_step(name, "bytes_disk_read"), per_step(name, "bytes_disk_written")
            row["disk_MB_step"] = (read + written) / 1e6
            bound = step_bound(t_compute, n_trainable, dtype, bw, read, written, disk)
            if "nvme_io_wait_seconds" in after[name]:
                row["io_wait_ms"] = per_step(name, "nvme_io_wait_seconds") * 1e3
            row["update_ms"] = per_step(name, "update_seconds") * 1e3
        if name != "fwd+bwd only (T_compute)":
            row["bound_ms"] = bound.seconds * 1e3
            row["efficiency"] = bound.efficiency(median)
        rows.append(row)
    print(machine_header())
    print(f"GPT layers={args.layers} dim={args.dim} vocab={args.vocab} context={args.context} batch={args.batch} "
          f"dtype={args.dtype} moments={args.moments} | {n_trainable / 1e6:.2f}M params | {args.rounds} rounds x "
          f"{args.steps} steps | "
          f"native core: {offload.native_available()}")
    print(f"bound = max(T_compute + T_cpu, T_read + T_write): T_compute {t_compute * 1e3:.1f} ms, T_cpu "
          f"{compute_bound.t_cpu * 1e3:.1f} ms (DRAM {bw / 1e9:.1f} GB/s measured); disk read {disk.read / 1e9:.2f} "
          f"GB/s, write {disk.write / 1e9:.2f} GB/s measured ({disk.backend}, O_DIRECT {disk.direct}) in {swap_dir}")
    columns = ["rival", "step_ms", "p20_p80_ms", "tokens_per_s", "vs_torch", "d2h_MB_step", "h2d_MB_step",
               "device_peak_MB", "disk_MB_step", "io_wait_ms", "update_ms", "bound_ms", "efficiency"]
    print_table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows], columns)
    if not args.quick and args.moments == "fp32":  # results/bench_train.csv has no moments column: fp32 rows only
        append_csv("bench_train", [dict(r, layers=args.layers, dim=args.dim, dtype=args.dtype) for r in rows])


Stats = Dict[str, Dict[str, float]]


def interleaved(rivals: Dict[str, Callable[[], None]], engines: Dict[str, offload.Engine],
                samples: Dict[str, List[float]], args: argparse.Namespace, copy_buffers: tuple, probe: DiskProbe,
                after_warm_up: Callable[[], None] = lambda: None) -> "tuple[List[float], Stats, Stats]":
    """One warm-up run of each rival, then `args.rounds` rounds: a DRAM and a disk sample, then each rival's
    `args.steps` steps, timed into `samples`. (DRAM bandwidths, the engines' stats before and after the rounds); the
    engines are closed."""
    for run in rivals.values():  # warm-up: first-step allocations, profiles
        run()
    after_warm_up()
    bandwidths: List[float] = []
    before = {name: e.stats() for name, e in engines.items()}
    for _ in tqdm(range(args.rounds), desc="rounds", disable=args.quick or args.tiny):
        bandwidths.append(dram_bandwidth(*copy_buffers))
        probe.sample()
        for name, run in rivals.items():
            start = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - start) / args.steps)
    after = {name: e.stats() for name, e in engines.items()}
    for engine in engines.values():
        engine.close()
    return bandwidths, before, after


# ----- speculative clipping (issue 35) -------------------------------------------------------------------------
BELOW, ABOVE = 1e-3, 1e3  # the loss scales that put the global norm far below max_grad_norm=1.0, and far above it


def clipping_rows(args: argparse.Namespace) -> None:
    """Each offload rival trains its own copy of one model on the same batches, interleaved round by round with
    torch AdamW and the model's forward+backward alone; the loss is scaled so that the norm stays far below
    max_grad_norm=1.0 (every step clips by exactly 1: speculation kept) or far above it (every step clips:
    speculation dropped once, then not tried). "today's clipping" is `speculative_clipping=False`: every update
    after the global norm (one engine for both scales: the same work either way)."""
    if args.quick:
        args.layers, args.dim, args.vocab, args.context, args.batch, args.rounds, args.steps = 2, 64, 512, 32, 2, 2, 1
    else:
        args.layers, args.dim, args.vocab, args.context, args.batch = 8, 1024, 8192, 64, 2
        args.rounds, args.steps = max(args.rounds, 4), max(args.steps, 2)
    torch.manual_seed(0)
    base = GPT(args.vocab, args.dim, args.layers, args.context, heads=16 if args.dim >= 1024 else 4)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.context), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.context), generator=gen)) for _ in range(args.steps)]

    def twin() -> torch.nn.Module:
        model = copy.deepcopy(base)
        model.lm_head.weight = model.wte.weight
        return model

    swap_dir = tempfile.mkdtemp(prefix="offload-bench-clip-", dir=args.nvme_path)
    tier = dict(tier=args.clipping, nvme_path=swap_dir if args.clipping == "nvme" else None, device="cpu",
                lr=1e-4, weight_decay=0.01, grad_accumulation_steps=1)
    engines = {"no clipping": offload.wrap(twin(), **tier),
               "speculative, norms below": offload.wrap(twin(), **tier, max_grad_norm=1.0, speculative_clipping=True),
               "speculative, clips every step": offload.wrap(twin(), **tier, max_grad_norm=1.0,
                                                             speculative_clipping=True),
               "today's clipping": offload.wrap(twin(), **tier, max_grad_norm=1.0, speculative_clipping=False)}
    compute_model, torch_model = twin(), twin()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-4, weight_decay=0.01)
    norms: Dict[str, List[float]] = {}

    def engine_run(name: str, scale: float) -> Callable[[], None]:
        engine = engines[name]

        def run() -> None:
            for idx, tgt in batches:
                (engine(idx, tgt) * scale).backward()
                norm = engine.step()  # None without clipping
                if norm is not None:
                    norms.setdefault(label, []).append(float(norm))
                engine.zero_grad()
            engine.synchronize()
        label = f"offload {args.clipping}, {name}" + ("" if name != "today's clipping" else
                                                      (", norms below" if scale == BELOW else ", clips every step"))
        return run

    def compute_only() -> None:
        for idx, tgt in batches:
            compute_model(idx, tgt).backward()
            compute_model.zero_grad()

    def torch_step() -> None:
        for idx, tgt in batches:
            torch_model(idx, tgt).backward()
            torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
            torch_opt.step()
            torch_opt.zero_grad()

    kind = args.clipping
    rivals: Dict[str, Callable[[], None]] = {
        "fwd+bwd only (T_compute)": compute_only, "torch AdamW + clip_grad_norm_": torch_step,
        f"offload {kind}, no clipping": engine_run("no clipping", 1.0),
        f"offload {kind}, speculative, norms below": engine_run("speculative, norms below", BELOW),
        f"offload {kind}, today's clipping, norms below": engine_run("today's clipping", BELOW),
        f"offload {kind}, speculative, clips every step": engine_run("speculative, clips every step", ABOVE),
        f"offload {kind}, today's clipping, clips every step": engine_run("today's clipping", ABOVE)}
    engine_of = {f"offload {kind}, no clipping": "no clipping",
                 f"offload {kind}, speculative, norms below": "speculative, norms below",
                 f"offload {kind}, speculative, clips every step": "speculative, clips every step"}
    copy_buffers = (torch.ones(32 * 2**20), torch.empty(32 * 2**20))
    probe = DiskProbe(swap_dir, sample_bytes=(8 if args.quick else 64) << 20, samples=args.rounds)
    samples: Dict[str, List[float]] = {name: [] for name in rivals}
    bandwidths, before, after = interleaved(rivals, engines, samples, args, copy_buffers, probe,
                                            after_warm_up=norms.clear)
    disk = probe.result()
    probe.close()
    shutil.rmtree(swap_dir, ignore_errors=True)
    bw = summarize(bandwidths)[0]
    t_compute = summarize(samples["fwd+bwd only (T_compute)"])[0]
    medians = {name: summarize(values)[0] for name, values in samples.items()}
    reference = {f"offload {kind}, speculative, norms below": f"offload {kind}, no clipping",
                 f"offload {kind}, speculative, clips every step": f"offload {kind}, today's clipping, clips every step"}
    rows = []
    for name, values in samples.items():
        median, p20, p80 = summarize(values)
        row: Dict[str, object] = dict(rival=name, step_ms=median * 1e3, p20_p80_ms=f"{p20 * 1e3:.0f}-{p80 * 1e3:.0f}",
                                      vs_torch=medians["torch AdamW + clip_grad_norm_"] / median)
        if name in norms:
            row["grad_norm"] = summarize(norms[name])[0]
        if name in reference:
            row["ratio"] = f"{median / medians[reference[name]]:.3f} x {reference[name].split(', ', 1)[1]}"
        if name in engine_of:
            steps = args.rounds * args.steps
            stats = {k: (after[engine_of[name]][k] - before[engine_of[name]][k]) / steps
                     for k in ("bytes_disk_read", "bytes_disk_written", "speculative_updates",
                               "committed_speculations")}
            row["disk_MB_step"] = (stats["bytes_disk_read"] + stats["bytes_disk_written"]) / 1e6
            row["kept/speculated"] = f"{stats['committed_speculations']:.1f}/{stats['speculative_updates']:.1f}"
            bound = step_bound(t_compute, n_params, torch.float32, bw, stats["bytes_disk_read"],
                               stats["bytes_disk_written"], disk)
            row["efficiency"] = bound.efficiency(median)
        rows.append(row)
    print(machine_header())
    print(f"GPT layers={args.layers} dim={args.dim} vocab={args.vocab} context={args.context} batch={args.batch} "
          f"fp32 | {n_params / 1e6:.1f}M params | {args.rounds} rounds x {args.steps} steps | grad_accumulation_steps=1 "
          f"| max_grad_norm=1.0, loss x {BELOW:g} (norms below) or x {ABOVE:g} (clips every step)")
    print(f"DRAM {bw / 1e9:.1f} GB/s; disk read {disk.read / 1e9:.2f} GB/s, write {disk.write / 1e9:.2f} GB/s measured "
          f"({disk.backend}, O_DIRECT {disk.direct})")
    columns = ["rival", "step_ms", "p20_p80_ms", "vs_torch", "grad_norm", "ratio", "kept/speculated", "disk_MB_step",
               "efficiency"]
    print_table([{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows], columns)
    if not args.quick:
        append_csv("bench_train_clipping", [dict(r, tier=kind) for r in rows])


if __name__ == "__main__":
    main()
