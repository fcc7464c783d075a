"""A model larger than the budgets, trained the ways people train: gradients wait on disk, exactly.

    python benchmarks/bench_spill.py                 # a 370M-parameter Llama (fp32: 1.4 GiB of weights), minutes
    python benchmarks/bench_spill.py --quick         # a 20M one, a smoke run

A Llama config (random weights, nothing downloaded) is saved with `save_pretrained` as shards. For each
configuration (defaults; clipping with 2 undeclared micro-batches; clipping with declared accumulation of 2)
two fresh processes train the same batches from those shards: plain PyTorch (`LlamaForCausalLM.from_pretrained`,
`torch.optim.AdamW`, `clip_grad_norm_` where clipping is on) and offload (the model built under accelerate's
`init_empty_weights()`, filled from the shards by `wrap(weights=...)`, nvme tier, fp32 on the CPU, `host_memory` and `device_memory`
256 MiB each). Printed per configuration: the largest loss difference, offload's peak RSS growth (VmHWM
after a reset, minus VmRSS before `wrap()`) against the budgets + 512 MiB, step times, and the gradient bytes
that went to disk and came back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_header, print_table  # noqa: E402

MIB = 1 << 20
CONFIGS = {  # name -> (max_grad_norm, micro-batches per step, declared grad_accumulation_steps)
    "defaults": (None, 1, None),
    "clipping, 2 undeclared micro-batches": (1.0, 2, None),
    "clipping, grad_accumulation_steps=2": (1.0, 2, 2),
}

_RUN = r'''
import json, sys, time, torch
torch.manual_seed(0)
kind, shards, swap, config_json, budget = sys.argv[1:6]
max_norm, micro, declared, steps, context = json.loads(config_json)
import transformers
from tests.proc_status import reset_peak, status

gen = torch.Generator().manual_seed(1)
batches = [[torch.randint(0, 32000, (1, context), generator=gen) for _ in range(micro)] for _ in range(steps)]
losses, seconds = [], []
if kind == "torch":
    model = transformers.LlamaForCausalLM.from_pretrained(shards, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=False)
    for step in batches:
        start = time.perf_counter()
        for ids in step:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - start)
    print(json.dumps(dict(losses=losses, seconds=seconds)))
else:
    import accelerate, offload
    config = transformers.AutoConfig.from_pretrained(shards)
    with accelerate.init_empty_weights():  # parameters on the meta device, the rotary buffers real
        model = transformers.LlamaForCausalLM(config)
    base = status("VmRSS")
    reset_peak()
    engine = offload.wrap(model, tier="nvme", nvme_path=swap, weights=shards, dtype=torch.float32, device="cpu",
                          lr=1e-4, weight_decay=0.0, host_memory=int(budget), device_memory=int(budget), max_grad_norm=max_norm,
                          grad_accumulation_steps=declared)
    for step in batches:
        start = time.perf_counter()
        for ids in step:
            loss = engine(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        seconds.append(time.perf_counter() - start)
    engine.synchronize()
    peak = status("VmHWM")
    stats = engine.stats()
    print(json.dumps(dict(losses=losses, seconds=seconds, growth=peak - base,
                          grads_on_disk=engine.plan.grads_on_disk, placement=engine.plan.grads_placement(),
                          to_disk=stats["bytes_grads_to_disk"], from_disk=stats["bytes_grads_from_disk"],
                          over_budget=stats["host_grad_over_budget_events"])))
    engine.close()
'''


def _run(kind: str, shards: str, swap: str, config: list, budget: int) -> dict:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", _RUN, kind, shards, swap, json.dumps(config), str(budget)],
                          cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--budget", default=256 * MIB, type=int, help="host_memory and device_memory, each")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    import torch
    import transformers

    if args.quick:
        dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4)
        args.budget = min(args.budget, 64 * MIB)
    else:
        dims = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16)
    config = transformers.LlamaConfig(vocab_size=32000, num_key_value_heads=dims["num_attention_heads"],
                                      max_position_embeddings=256, tie_word_embeddings=False, **dims)
    print(machine_header())
    with tempfile.TemporaryDirectory(prefix="offload-spill-") as work:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        shards = str(Path(work) / "shards")
        model.save_pretrained(shards, max_shard_size="200MB")
        del model
        print(f"Llama {params / 1e6:.0f}M parameters ({4 * params / 2**30:.2f} GiB of fp32 weights, gradients "
              f"{4 * params / 2**30:.2f} GiB), saved as shards; host_memory = device_memory = "
              f"{args.budget / MIB:.0f} MiB; {args.steps} steps, batch 1 x {args.context} tokens")
        rows = []
        for name, (max_norm, micro, declared) in CONFIGS.items():
            spec = [max_norm, micro, declared, args.steps, args.context]
            want = _run("torch", shards, work, spec, args.budget)
            swap = Path(work) / "swap"
            swap.mkdir(exist_ok=True)
            got = _run("offload", shards, str(swap), spec, args.budget)
            diff = max(abs(a - b) for a, b in zip(got["losses"], want["losses"]))
            bound = 2 * args.budget + 512 * MIB
            rows.append(dict(config=name, max_loss_diff=f"{diff:.2e}", within_1e5=str(diff <= 1e-5),
                             rss_growth_MiB=f"{got['growth'] / MIB:.0f}", bound_MiB=f"{bound / MIB:.0f}",
                             within_bound=str(got["growth"] <= bound),
                             torch_step_s=" ".join(f"{s:.1f}" for s in want["seconds"]),
                             offload_step_s=" ".join(f"{s:.1f}" for s in got["seconds"]),
                             grads_to_disk_GiB=f"{got['to_disk'] / 2**30:.2f}",
                             grads_from_disk_GiB=f"{got['from_disk'] / 2**30:.2f}",
                             over_budget=got["over_budget"]))
            print(f"{name}: gradients: {got['placement']}", flush=True)
            print(f"  losses torch {['%.6f' % v for v in want['losses']]}, offload "
                  f"{['%.6f' % v for v in got['losses']]}", flush=True)
    print_table(rows, ["config", "max_loss_diff", "within_1e5", "rss_growth_MiB", "bound_MiB", "within_bound",
                       "torch_step_s", "offload_step_s", "grads_to_disk_GiB", "grads_from_disk_GiB", "over_budget"])
    return 0 if all(r["within_1e5"] == "True" and r["within_bound"] == "True" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
