"""Fused CPU Adam vs torch AdamW (foreach, fused, fused + bf16 copy) and DeepSpeed's CPU Adam, against the
in-place DRAM bandwidth bound measured in the same run.

    python benchmarks/bench_adam.py            # 100M and 500M parameters, 1 thread and all cores (~3 min)
    python benchmarks/bench_adam.py --quick    # a few seconds (smoke test)

Every rival updates the same flat fp32 buffers (params are views into them, the torch and DeepSpeed optimizer
states are the same m and v), one step each, interleaved round by round, so they see the same memory.
Bytes per parameter are what each mode must move at least: fp32 mode reads p, m, v, g (16) and writes
p, m, v (12) = 28; engine mode reads p, m, v + a bf16 grad (14) and writes p, m, v + the bf16 copy (14) = 28;
torch fused + copy moves 28 + 6 (re-read p, write bf16) = 34; the compressed-moment kernels (engine mode, bf16 g in,
bf16 copy out) move p 8 + g 2 + out 2 + m and v read and written: bf16 8 (= 20), int8 4 + the scales 1/16 (= 16.06).
The "+ CRCs" rows also return the CRC-32C of each piece they write (crcs=..., the swap file's seals): computed from
caches in the same pass, no DRAM bytes added, so their bound is the same (the fp32 ones write `out` plainly, which
reads its lines first: 2 bytes more). "then CRCs read back" is the engine step followed by crc32c of each piece on
one thread, what the nvme tier did for fp32 moments before the step computed them. The "resting" row is
the speculative update of exact clipping (adam_step_resting: the engine step that also checks, element by element,
that the gradient can be rebuilt from the moments it wrote; issue 35): engine mode's bytes. The "avx512bw" rows
run the AVX-512 F/BW kernel (the only AVX-512 moment kernel before the VBMI one) on CPUs that have both. `bound` =
bytes / in-place bandwidth, where the bandwidth comes from the fp32 step's traffic (read p, m, v, g; write p, m, v)
in one pass with the same threads; efficiency = bound / time.

    python benchmarks/bench_adam.py --rivals moments,fused --sizes 500e6 --threads all --rounds 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

from benchmarks.common import append_csv, machine_header, print_table, summarize  # noqa: E402
from offload import _native  # noqa: E402
from offload._system import mem_available, usable_cores  # noqa: E402
from offload.optim import CPUAdam, adam_step_flat  # noqa: E402
from offload.optim.functional import (  # noqa: E402
    CRC_PIECES,
    adam_step_resting,
    crcs_read_back,
    resting_supported,
)
from offload.optim.moment_format import zeros_moment  # noqa: E402
from offload.optim.moments import adam_step_moments  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BYTES_PER_PARAM = {"fp32": 28, "engine": 28, "torch+copy": 34, "bf16 moments": 20, "int8 moments": 16 + 16 / 256}
BYTES_NEEDED_PER_PARAM = 34  # p, m, v, g32 (16) + g16, out16 (4) + torch foreach temporaries (~8) + moments (6)


class Buffers:
    """Flat buffers shared by every rival, and the parameter list (a 4096x4096-style mix) viewing them."""

    def __init__(self, numel: int, big: int) -> None:
        self.p = torch.randn(numel) * 0.02
        self.m = torch.zeros(numel)
        self.v = torch.zeros(numel)
        self.g32 = torch.randn(numel) * 1e-3
        self.g16 = self.g32.to(torch.bfloat16)
        self.out16 = torch.empty(numel, dtype=torch.bfloat16)
        self.moments = {fmt: (zeros_moment(fmt, numel), zeros_moment(fmt, numel)) for fmt in ("bf16", "int8")}
        self.crcs = torch.zeros(len(CRC_PIECES), dtype=torch.uint32)
        self.params: list[torch.nn.Parameter] = []
        offset = 0
        for shape in _layout(numel, big):
            count = 1
            for d in shape:
                count *= d
            param = torch.nn.Parameter(self.p[offset:offset + count].view(shape))
            param.grad = self.g32[offset:offset + count].view(shape)
            self.params.append(param)
            offset += count

    def share_state(self, opt: torch.optim.Optimizer, step_as_tensor: bool) -> None:
        """Point the optimizer's state at our m and v, so no rival allocates its own."""
        offset = 0
        for param in self.params:
            n = param.numel()
            opt.state[param] = {
                "step": torch.tensor(0.0) if step_as_tensor else 0,
                "exp_avg": self.m[offset:offset + n].view(param.shape),
                "exp_avg_sq": self.v[offset:offset + n].view(param.shape),
            }
            offset += n


def _layout(numel: int, big: int) -> list[tuple[int, ...]]:
    """Big square matrices each followed by small tensors (biases, norms), the remainder as one vector."""
    shapes: list[tuple[int, ...]] = []
    left = numel
    smalls = [(big,), (big,), (3 * big // 4 + 5,)]
    while left >= big * big + sum(s[0] for s in smalls):
        shapes.append((big, big))
        shapes.extend(smalls)
        left -= big * big + sum(s[0] for s in smalls)
    if left:
        shapes.append((left,))
    return shapes


def _deepspeed_adam(params):
    """DeepSpeed's CPU Adam when installed and its op builds, else (None, reason)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return None, f"not installed ({type(exc).__name__})"
    try:
        return DeepSpeedCPUAdam(params, adamw_mode=True, **HP), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"failed to build ({type(exc).__name__}: {exc})"[:80]


def _rivals(buf: Buffers, threads: int, with_deepspeed: bool) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """name -> one optimizer step; and name -> reason for rivals that cannot run."""
    step = {"n": 0}
    flat = dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"],
                weight_decay=HP["weight_decay"], adamw=True, num_threads=threads)

    def ours_fp32():
        step["n"] += 1
        adam_step_flat(buf.p, buf.g32, buf.m, buf.v, step=step["n"], **flat)

    def ours_engine():
        step["n"] += 1
        adam_step_flat(buf.p, buf.g16, buf.m, buf.v, step=step["n"], out=buf.out16, **flat)

    def ours_engine_crcs():
        step["n"] += 1
        adam_step_flat(buf.p, buf.g16, buf.m, buf.v, step=step["n"], out=buf.out16, crcs=buf.crcs, **flat)

    def ours_engine_then_crcs():
        """What the nvme tier did before the fp32 step computed them: the step, then each piece read back."""
        ours_engine()
        crcs_read_back(buf.crcs, (buf.p, buf.m, None, buf.v, None, buf.out16))

    def ours_resting(crcs=False):
        def run():
            step["n"] += 1
            adam_step_resting(buf.p, buf.g16, buf.m, buf.v, step=step["n"], lr=flat["lr"], beta1=flat["beta1"],
                              beta2=flat["beta2"], eps=flat["eps"], weight_decay=flat["weight_decay"], out=buf.out16,
                              num_threads=threads, capacity=buf.p.numel() // 4096 + 256,  # the engine's (adamw.py)
                              crcs=buf.crcs if crcs else None)
        return run

    def ours_moments(fmt, crcs=False):
        def run():
            step["n"] += 1
            m, v = buf.moments[fmt]
            adam_step_moments(buf.p, buf.g16, m, v, fmt, step=step["n"], out=buf.out16,
                              crcs=buf.crcs if crcs else None, **flat)
        return run

    native = _native._C

    def ours_moments_isa(fmt, isa):
        """The native step of one kernel variant, called as adam_step_moments calls the best one for this CPU."""
        def addresses(m):
            return (m.codes.data_ptr(), m.scales.data_ptr()) if fmt == "int8" else (m.data_ptr(), 0)

        def run():
            step["n"] += 1
            (mc, ms), (vc, vs) = (addresses(m) for m in buf.moments[fmt])
            native.adam_moments_step(
                buf.p.data_ptr(), buf.g16.data_ptr(), 1, mc, ms, vc, vs, 1 if fmt == "bf16" else 2, buf.p.numel(),
                buf.out16.data_ptr(), 1, step["n"], flat["lr"], flat["beta1"], flat["beta2"], flat["eps"],
                flat["weight_decay"], True, 1.0, threads, None, isa)
        return run

    cpu_adam = CPUAdam(buf.params, num_threads=threads, **HP)
    buf.share_state(cpu_adam, step_as_tensor=True)
    foreach = torch.optim.AdamW(buf.params, foreach=True, **HP)
    buf.share_state(foreach, step_as_tensor=True)
    fused = torch.optim.AdamW(buf.params, fused=True, **HP)
    buf.share_state(fused, step_as_tensor=True)

    def fused_and_copy():
        fused.step()
        buf.out16.copy_(buf.p)

    rivals = {
        "offload flat, fp32 grads": ours_fp32,
        "offload flat, engine (bf16 g in, bf16 copy out)": ours_engine,
        "offload flat, engine + CRCs": ours_engine_crcs,
        "offload flat, engine, then CRCs read back": ours_engine_then_crcs,
        "offload flat, engine, resting (speculative clipping)": ours_resting(),
        "offload flat, engine, resting + CRCs": ours_resting(crcs=True),
        "offload bf16 moments, engine": ours_moments("bf16"),
        "offload bf16 moments + CRCs, engine": ours_moments("bf16", crcs=True),
        "offload int8 moments, engine": ours_moments("int8"),
        "offload int8 moments + CRCs, engine": ours_moments("int8", crcs=True),
        "offload CPUAdam (per tensor, fp32)": cpu_adam.step,
        "torch AdamW foreach": foreach.step,
        "torch AdamW fused": fused.step,
        "torch AdamW fused + bf16 copy": fused_and_copy,
    }
    if native is not None and "avx512bw" in native.moment_isas() and native.moment_isas()[0] != "avx512bw":
        rivals["offload bf16 moments, engine, avx512bw kernel"] = ours_moments_isa("bf16", "avx512bw")
        rivals["offload int8 moments, engine, avx512bw kernel"] = ours_moments_isa("int8", "avx512bw")
    missing = {}
    if not resting_supported(torch.bfloat16):
        for name in ("offload flat, engine, resting (speculative clipping)", "offload flat, engine, resting + CRCs"):
            del rivals[name]
            missing[name] = "needs the native core (offload._C)"
    if with_deepspeed:
        ds, why = _deepspeed_adam(buf.params)
        if ds is not None:
            buf.share_state(ds, step_as_tensor=False)
            rivals["DeepSpeed CPUAdam (fp32)"] = ds.step
        else:
            missing["DeepSpeed CPUAdam (fp32)"] = why
    else:
        missing["DeepSpeed CPUAdam (fp32)"] = "skipped (--quick or --no-deepspeed)"
    return rivals, missing


def _bandwidth_probe(buf: Buffers, threads: int) -> Callable[[], None]:
    """The fp32 step's traffic (read p, m, v, g; write p, m, v: 28 B/param) in one pass, values unchanged."""
    native = _native._C
    pool = native.ThreadPool(threads) if native is not None else None

    def probe():
        if native is not None:
            native.memory_traffic_probe(buf.p.data_ptr(), buf.m.data_ptr(), buf.v.data_ptr(), buf.g32.data_ptr(),
                                        buf.p.numel(), threads, pool)
        else:
            for t in (buf.p, buf.m, buf.v):
                t.mul_(1.0)

    return probe


def _mode(name: str) -> str:
    for fmt in ("bf16", "int8"):
        if f"{fmt} moments" in name:
            return f"{fmt} moments"
    if "engine" in name:
        return "engine"
    if "copy" in name:
        return "torch+copy"
    return "fp32"


ALWAYS = ("torch AdamW fused", "torch AdamW fused + bf16 copy")  # the baselines every row is compared with


def run_size(numel: int, big: int, threads: int, rounds: int, with_deepspeed: bool,
             only: tuple[str, ...] = ()) -> list[dict]:
    torch.set_num_threads(threads)
    buf = Buffers(numel, big)
    rivals, missing = _rivals(buf, threads, with_deepspeed)
    if only:
        rivals = {k: f for k, f in rivals.items() if k in ALWAYS or any(word in k for word in only)}
        missing = {k: why for k, why in missing.items() if any(word in k for word in only)}
    timed = {"in-place bandwidth probe": _bandwidth_probe(buf, threads), **rivals}
    samples: dict[str, list[float]] = {name: [] for name in timed}
    names = list(timed)
    for r in range(rounds + 1):  # round 0 warms up (first touch, lazy init, DeepSpeed's first call)
        order = names[r % len(names):] + names[:r % len(names)]  # rotate so drift spreads over every rival
        for name in order:
            t0 = time.perf_counter()
            timed[name]()
            elapsed = time.perf_counter() - t0
            if r > 0:
                samples[name].append(elapsed)
    probe_median, _, _ = summarize(samples.pop("in-place bandwidth probe"))
    bandwidth = 28 * numel / probe_median
    fused_median = summarize(samples["torch AdamW fused"])[0]
    fused_copy_median = summarize(samples["torch AdamW fused + bf16 copy"])[0]
    rows = []
    for name, s in samples.items():
        med, p20, p80 = summarize(s)
        mode = _mode(name)
        bound = BYTES_PER_PARAM[mode if mode != "torch+copy" else "fp32"] * numel / bandwidth
        engine_like = mode not in ("fp32", "torch+copy")  # bf16 copy out: compared with fused + copy
        baseline = fused_copy_median if engine_like else fused_median
        rows.append(dict(
            size=f"{numel / 1e6:.0f}M", threads=threads, rival=name, ms=f"{med * 1e3:.1f}",
            p20_p80=f"{p20 * 1e3:.1f}-{p80 * 1e3:.1f}", Gparams_s=f"{numel / med / 1e9:.2f}",
            GB_s=f"{BYTES_PER_PARAM[mode] * numel / med / 1e9:.1f}",
            B_param=f"{BYTES_PER_PARAM[mode]:g}", bound_ms=f"{bound * 1e3:.1f}",
            vs_torch=f"{baseline / med:.2f}x" + (" (vs fused+copy)" if engine_like else ""),
            bound_eff=f"{bound / med:.2f}",
            _csv=dict(kernel="adam", provider=name, mode=mode, metric="step_time", unit="s", x=numel,
                      p20=p20, p50=med, p80=p80, threads=threads, bandwidth_GBps=bandwidth / 1e9),
        ))
    rows.append(dict(size=f"{numel / 1e6:.0f}M", threads=threads, rival="in-place DRAM bound (measured)",
                     ms=f"{28 * numel / bandwidth * 1e3:.1f}", GB_s=f"{bandwidth / 1e9:.1f}", bound_eff="1.00",
                     Gparams_s=f"{bandwidth / 28 / 1e9:.2f}"))
    for name, why in missing.items():
        rows.append(dict(size=f"{numel / 1e6:.0f}M", threads=threads, rival=name, ms=why))
    del rivals, buf
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2M parameters, 2 rounds, no DeepSpeed: a smoke test")
    parser.add_argument("--sizes", default="100e6,500e6", help="parameter counts, comma-separated")
    parser.add_argument("--threads", default="1,all", help="thread counts, comma-separated ('all' = usable cores)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--no-csv", action="store_true")
    parser.add_argument("--rivals", default="", help="comma-separated words: only the rows whose name holds one (and "
                                                      "torch fused, fused + copy), e.g. 'moments'")
    args = parser.parse_args(argv)
    only = tuple(w.strip() for w in args.rivals.split(",") if w.strip())
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    big, rounds, with_ds = 4096, args.rounds, not args.no_deepspeed
    if args.quick:
        sizes, big, rounds, with_ds = [2_000_000], 512, 2, False
    threads = sorted({usable_cores() if t == "all" else int(t) for t in args.threads.split(",")})

    print(machine_header())
    print(f"# adamw lr={HP['lr']} wd={HP['weight_decay']}; rounds={rounds} (+1 warm-up), interleaved; "
          f"bytes/param: fp32 28, engine 28, torch fused+copy 34, bf16 moments 20, int8 moments 16.06")
    rows = []
    for numel in sizes:
        avail = mem_available()
        if avail is not None and numel * BYTES_NEEDED_PER_PARAM > 0.85 * avail:
            print(f"# skipping {numel / 1e6:.0f}M: needs ~{numel * BYTES_NEEDED_PER_PARAM / 2**30:.1f} GiB, "
                  f"{avail / 2**30:.1f} GiB available")
            continue
        for t in threads:
            rows += run_size(numel, big, t, rounds, with_ds, only)
    print_table(rows, ["size", "threads", "rival", "ms", "p20_p80", "Gparams_s", "GB_s", "B_param", "bound_ms", "vs_torch",
                       "bound_eff"])
    if not args.no_csv and not args.quick:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        append_csv("adam", [dict(r["_csv"], timestamp=stamp) for r in rows if "_csv" in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
