"""Data-parallel training on several ranks: offload's data-parallel mode against torch DDP + AdamW (and
DeepSpeed ZeRO-2 with CPU offload where it imports).

    python benchmarks/bench_dp.py [--nproc 2 --layers 4 --dim 512 --vocab 4096 --context 128 --batch 8]
                                  [--rounds 4 --steps 5 --warmup 2] [--nvme-path DIR] [--quick]
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
  offload cpu    offload.wrap(tier="cpu", grad_accumulation_steps=1): gradients reduce-scattered per block on
                 the step worker during backward, each rank steps its 1/N of the fp32 master weights and
                 Adam moments, all-gathers the new weights.
  offload nvme   the same with the optimizer state in a swap file per rank under --nvme-path.
  torch DDP      DistributedDataParallel + torch.optim.AdamW(fused=True) (foreach where fused is refused on
                 this device: the row says so); every rank holds the whole optimizer state.
  DeepSpeed      ZeRO stage 2, offload_optimizer {device: cpu} (DeepSpeed's CPU Adam), where `import
                 deepspeed` works; else the table says why it was skipped.

Memory per rank: peak RSS is VmHWM of /proc/self/status, reset (clear_refs 5) after the imports, the process
group and the model are built, so `peak_rss` is the whole process's peak and `rss_growth` what the training
setup and steps added on top of that baseline. Optimizer state per rank: `engine.stats()
["optimizer_state_bytes"]` for offload (fp32 master + m + v of this rank's part: 12 B/param / N); the
tensors in `optimizer.state` for torch (m, v and step: 8 B/param, whole; the fp32 parameters are its
master weights and are not counted); DeepSpeed: its fp32 partition plus its CPU Adam's state.

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
    "offload-cpu": "offload cpu tier (DP)",
    "offload-nvme": "offload nvme tier (DP)",
    "ddp": "torch DDP + AdamW",
    "deepspeed": "DeepSpeed ZeRO-2, CPU offload",
}
REFERENCE = "ddp"


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) on this machine")
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
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds of 2 steps (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.vocab, args.context, args.batch = 2, 64, 512, 32, 4
        args.rounds, args.steps, args.warmup = 2, 2, 1
    if args.batch % args.nproc:
        parser.error(f"--batch {args.batch} must split evenly across --nproc {args.nproc} ranks")
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
    """The global batches of one launch (warm-up then timed), the same in every launch and on every rank."""
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.context)
    return [(torch.randint(0, args.vocab, shape, generator=gen), torch.randint(0, args.vocab, shape, generator=gen))
            for _ in range(args.warmup + args.steps)]


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
    total = tensor_bytes(getattr(zero, "single_partition_of_fp32_groups", []))
    inner = getattr(zero, "optimizer", None)
    if inner is not None and hasattr(inner, "state"):
        total += tensor_bytes(dict(inner.state))
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
    if args.worker.startswith("offload"):
        options = dict(dtype=dtype, device=device, lr=args.lr, weight_decay=0.0, grad_accumulation_steps=1)
        if args.worker == "offload-nvme":
            engine = offload.wrap(model, tier="nvme", nvme_path=args.swap, **options)
        else:
            engine = offload.wrap(model, tier="cpu", **options)

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
    elif args.worker == "deepspeed":
        import deepspeed  # type: ignore[import-not-found]

        config = {"train_micro_batch_size_per_gpu": per, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
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
    for i, (idx, tgt) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss = train_step(idx, tgt)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        losses.append(loss.detach().float().reshape(()))
        if i >= args.warmup:
            times.append(elapsed)
    peak_rss = status("VmHWM")
    state = state_bytes()
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    mean_losses = torch.stack(losses).to(device)
    dist.all_reduce(mean_losses)  # the global batch's loss per step (the mean of the ranks' halves)
    mean_losses = (mean_losses / world).cpu().tolist()
    if close is not None:
        close()
    result = dict(rival=args.worker, round=args.round, rank=rank, world=world, step_seconds=times,
                  losses=mean_losses, baseline_rss=baseline_rss, peak_rss=peak_rss, peak_reset=CAN_RESET_PEAK,
                  state_bytes=state, params=n_params, note=note, device_peak=device_peak,
                  threads=torch.get_num_threads())
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
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               str(Path(__file__).resolve()), "worker", spec]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")  # a crashing rank prints its stacks
    # cwd: torchrun must not start inside torch's site-packages; the temp dir is neutral
    done = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=600, env=env)
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
        written = [os.path.join(out, f"{rival}-round{round_}-rank{r}.json") for r in range(args.nproc)]
        if all(os.path.exists(path) for path in written):
            # every rank measured and wrote its result before the process group went down: the failure is in
            # the exit (a rare gloo shutdown abort seen once in ~65 launches); keep the measurement, say so
            print(f"bench_dp: {rival} round {round_} exited abnormally after every rank wrote its result "
                  f"({reason}); its measurement is kept", file=sys.stderr)
            return None
        return reason
    return None


def fmt_ranks(values: List[float], scale: float = 1e-6) -> str:
    return " / ".join(f"{v * scale:.0f}" for v in values)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1])
        return 0
    args = parse(argv)
    rivals = args.rivals.split(",")
    skipped: Dict[str, str] = {}
    if "deepspeed" in rivals:
        reason = deepspeed_skip_reason()
        if reason is not None:
            skipped["deepspeed"] = f"skipped: {reason}"
            rivals.remove("deepspeed")
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
                if error is not None and rival == "deepspeed":  # an optional rival: its failure is a skip
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
        losses = {round(d["losses"][-1], 5) for d in results[rival]}
        median, p20, p80 = summarize(steps)
        summary[rival] = dict(step=median, peak=max(peak), state=max(state))
        row = dict(rival=label, step_ms=f"{median * 1e3:.1f}", p20_p80_ms=f"{p20 * 1e3:.1f}-{p80 * 1e3:.1f}",
                   min_max_ms=f"{min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f}",
                   peak_rss_MB=fmt_ranks(peak), rss_growth_MB=fmt_ranks(growth),
                   state_MB=" / ".join(f"{s / 1e6:.1f}" for s in state),
                   state_B_param=f"{max(state) / n_params:.2f}",
                   last_loss=" ".join(f"{v:.4f}" for v in sorted(losses)))
        if results[rival][0]["device_peak"] is not None:
            row["device_peak_MB"] = fmt_ranks([_median_of(runs, "device_peak", k) for k in ranks])
        rows.append(row)
        if results[rival][0]["note"]:
            notes.append(f"{label}: {'torch.optim.AdamW ' if rival == 'ddp' else ''}{results[rival][0]['note']}")
    if REFERENCE in summary:
        ref = summary[REFERENCE]
        for row in rows:
            key = next((k for k, v in RIVALS.items() if v == row["rival"]), None)
            if key in summary:
                row["step_vs_ddp"] = f"{summary[key]['step'] / ref['step']:.2f}x"
                row["rss_vs_ddp"] = f"{summary[key]['peak'] / ref['peak']:.2f}x"
                row["state_vs_ddp"] = f"{summary[key]['state'] / ref['state']:.2f}x"

    print(machine_header())
    threads = next((d[0]["threads"] for d in results.values() if d), "?")
    print(f"# {args.nproc} ranks, backend {args.backend}, {threads} torch thread(s) per rank; GPT layers={args.layers} "
          f"dim={args.dim} vocab={args.vocab} context={args.context}, global batch {args.batch} "
          f"({args.batch // args.nproc} per rank), dtype={args.dtype}, lr={args.lr}"
          + (f" | {n_params / 1e6:.2f}M params" if n_params else ""))
    print(f"# {args.rounds} rounds (one torchrun launch per rival per round, order rotated) x {args.steps} timed "
          f"steps after {args.warmup} warm-up; step = the slowest rank; {time.perf_counter() - began:.0f} s in all")
    print("# per-rank columns read rank 0 / rank 1 ...; peak RSS = VmHWM reset after imports+model (baseline); "
          "ratios are rival / DDP (step median, highest rank's peak RSS, highest rank's state)")
    for note in dict.fromkeys(notes):
        print(f"# {note}")
    for rival, why in skipped.items():
        print(f"# {RIVALS[rival]}: {why}")
    columns = ["rival", "step_ms", "p20_p80_ms", "min_max_ms", "step_vs_ddp", "peak_rss_MB", "rss_growth_MB",
               "rss_vs_ddp", "state_MB", "state_B_param", "state_vs_ddp", "last_loss"]
    if any("device_peak_MB" in r for r in rows):
        columns.append("device_peak_MB")
    columns.append("note")
    print_table(rows, columns)
    if failed:
        print(f"FAILED rivals: {failed}", file=sys.stderr)
        return 1
    return 0


def _median_of(runs: List[dict], key: str, rank: int) -> float:
    """The median of `key` over one rank's runs."""
    return summarize([d[key] for d in runs if d["rank"] == rank])[0]


if __name__ == "__main__":
    sys.exit(main())
