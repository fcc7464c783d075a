"""How often a low-precision gradient can be recovered exactly from Adam's old and new fp32 first moment.

Issue 35 measured at 1.2B: exact clipping with speculation keeps every gradient until the global norm is known
(2.4 GiB of bf16 gradients in a 3 GB `host_memory`), and that, not the updates, is what leaves the nvme ring too
small. But the speculative update itself writes what a redo would need: AdamW's first moment is
m' = lerp(m, g, 1 - beta1) in fp32 (torch's order, which offload's kernels follow), so g = (m' - beta1 m) / (1 -
beta1) up to fp32 rounding, a few ulps of max(|m|, |m'|). A bf16 gradient carries 8 significant bits: rounded to
bf16, the reconstruction is g itself unless |g| is tiny against |m|. This script trains a small GPT in bf16 with
fp32 masters and moments (as offload's bf16 compute keeps them) and counts, step by step, the elements whose bf16
gradient the reconstruction misses (computed in fp32 and in float64, and by the rebuild offload runs since:
fma(m' - m, 1/(1 - beta1), m) with zeros kept exact, csrc/adam/grad_rebuild.h), and the same for fp32 gradients
(24 bits: expected to fail). The misses are what a design that releases the gradients after the speculative update would
have to keep (index and value) for an exact redo.

    python benchmarks/grad_from_moments.py [--steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_header, print_table  # noqa: E402
from offload import _native  # noqa: E402
from offload.cli.demo import DemoGPT  # noqa: E402
from offload.optim.functional import rebuild_gradient  # noqa: E402

BETA1, BETA2, LR, EPS, WEIGHT_DECAY = 0.9, 0.999, 3e-4, 1e-8, 0.01


def misses(m_old: torch.Tensor, m_new: torch.Tensor, grad: torch.Tensor, wide: bool) -> int:
    """Elements whose gradient (in its own dtype) the first moments do not give back exactly: (m' - beta1 m) /
    (1 - beta1) in fp32, or (`wide`) in float64."""
    old, new = (m_old.double(), m_new.double()) if wide else (m_old, m_new)
    recovered = ((new - BETA1 * old) / (1 - BETA1)).to(grad.dtype)
    bits = torch.int16 if grad.dtype == torch.bfloat16 else torch.int32
    return int((recovered.view(bits) != grad.view(bits)).sum())


def rebuild_misses(m_old: torch.Tensor, m_new: torch.Tensor, grad: torch.Tensor) -> Optional[int]:
    """The same for the rebuild offload runs (csrc/adam/grad_rebuild.h, exact zeros): bf16 and fp16 only, and
    only with the native core built (None otherwise)."""
    if _native._C is None or grad.dtype not in (torch.bfloat16, torch.float16):
        return None
    out = torch.empty_like(grad)
    rebuild_gradient(m_old.contiguous(), m_new.contiguous(), BETA1, out, None)
    return int((out.view(torch.int16) != grad.view(torch.int16)).sum())


def run(grad_dtype: torch.dtype, steps: int, sizes: Dict[str, int], report: List[int]) -> List[Dict[str, object]]:
    """Train with AdamW kept by hand (fp32 master, m, v; the model's weights and gradients in `grad_dtype`)."""
    torch.manual_seed(0)
    vocab, context = sizes["vocab"], sizes["context"]
    model = DemoGPT(vocab, sizes["dim"], sizes["layers"], context).to(grad_dtype)
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    m = [torch.zeros_like(x) for x in master]
    v = [torch.zeros_like(x) for x in master]
    base = torch.randint(0, vocab, (context + 1,))
    rows = []
    for step in range(1, steps + 1):
        shifts = torch.randint(0, context + 1, (sizes["batch"],))
        idx = torch.stack([torch.roll(base, int(s)) for s in shifts])  # a learnable sequence, 10% noise tokens
        idx = torch.where(torch.rand(idx.shape) < 0.1, torch.randint(0, vocab, idx.shape), idx)
        for p in params:
            p.grad = None
        loss = model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        loss.backward()
        counts = {"fp32": 0, "f64": 0, "offload": 0, "zero": 0, "n": 0}
        native = True
        for p, mp, vp, mw in zip(params, m, v, master):
            grad = p.grad
            assert grad is not None
            g = grad.float()
            m_new = mp.lerp(g, 1 - BETA1)
            counts["fp32"] += misses(mp, m_new, grad, wide=False)
            counts["f64"] += misses(mp, m_new, grad, wide=True)
            rebuilt = rebuild_misses(mp, m_new, grad)
            native = native and rebuilt is not None
            counts["offload"] += rebuilt or 0
            counts["zero"] += int((grad == 0).sum())
            counts["n"] += grad.numel()
            mp.copy_(m_new)
            vp.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
            denom = (vp.sqrt() / (1 - BETA2 ** step) ** 0.5).add_(EPS)
            mw.mul_(1 - LR * WEIGHT_DECAY).addcdiv_(mp, denom, value=-LR / (1 - BETA1 ** step))
            with torch.no_grad():
                p.copy_(mw)
        if step in report or step == steps:
            n = counts["n"]
            rows.append({"gradients": str(grad_dtype).replace("torch.", ""), "step": step,
                         "loss": f"{loss.item():.3f}", "missed (fp32 maths)": f"{counts['fp32'] / n:.2e}",
                         "missed (float64)": f"{counts['f64'] / n:.2e}",
                         "missed (offload's rebuild)": f"{counts['offload'] / n:.2e}" if native else "-",
                         "zero gradients": f"{counts['zero'] / n:.1e}",
                         "kept a step at 1.2B (fp32 maths, 6 B each)":
                             f"{1.2e9 * counts['fp32'] / n * 6 / 2**20:.2f} MiB"})
    return rows


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="a tiny model and 3 steps (a smoke run)")
    args = parser.parse_args(argv)
    sizes = dict(vocab=2048, dim=256, layers=4, context=64, batch=8)
    if args.quick:
        sizes, args.steps = dict(vocab=256, dim=64, layers=2, context=16, batch=2), 3
    start = time.perf_counter()
    report = [1, 2, 5, 10, 20, 30, 40]
    rows = run(torch.bfloat16, args.steps, sizes, report) + run(torch.float32, args.steps, sizes, report)
    print(machine_header())
    print(f"DemoGPT vocab={sizes['vocab']} dim={sizes['dim']} layers={sizes['layers']} context={sizes['context']} "
          f"batch={sizes['batch']}; AdamW lr={LR} wd={WEIGHT_DECAY}, fp32 masters and moments; "
          "recovered g = (m' - beta1 m) / (1 - beta1), rounded to the gradient's dtype")
    print_table(rows, list(rows[0]))
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
