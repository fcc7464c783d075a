"""`python -m offload estimate`: memory per tier for a model size and budgets, before buying or wrapping.

    python -m offload estimate --params 7e9 --host-memory 64GB --device-memory 24GB
    python -m offload estimate --layers 32 --dim 4096 --vocab 32000 --tier nvme --blocks
    python -m offload estimate --params 70e9 --host-memory 128GB --device-memory 24GB --tier nvme \
        --grad-accumulation-steps 1
    python -m offload estimate --params 7e9 --host-memory 12GB --device-memory 12GB --tier nvme --disk 50GB
    python -m offload estimate --params 7e9 --host-memory 17GB --device-memory 2GB --tier nvme --disk 50GB \
        --moments int8 --max-grad-norm --disk-weights master

Runs the same planner `offload.wrap` runs, on blocks described by sizes instead of a model: a GPT config
gives one block per layer (12 d^2 + 13 d parameters) plus the embeddings; `--params N` is split into
`--layers` equal blocks (32 by default) with no embedding. Budgets the plan cannot meet are reported
with the planner's own message.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from offload.cli.activation_estimate import describe
from offload.cli.options import byte_size, positive_int
from offload.distributed.quantized_gather import Int8Blocks
from offload.errors import OffloadConfigError
from offload.optim.moment_format import MomentFormat, moment_nbytes
from offload.planner.place import make_plan, shards_weights, spec_of
from offload.planner.plan import BlockSpec, GradFlow, Location, Plan, grads_may_rest
from offload.planner.plan import human_bytes as _human
from offload.planner.ring import ring_size_for
from offload.policy import DiskWeights, Tier, parse_bytes

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts per block of a model to estimate, in forward order: (block name, parameters) or (block
    name, parameters, parameters of its largest tensor); without the third, a third of the block (a transformer
    layer's MLP matrix, 4 d^2 of 12 d^2), for the device's room for autograd's largest gradient."""

    blocks: Sequence[tuple]

    @property
    def params(self) -> int:
        return sum(block[1] for block in self.blocks)

    def largest_tensors(self) -> List[int]:
        return [block[2] if len(block) > 2 else -(-block[1] // 3) for block in self.blocks]

    @staticmethod
    def gpt(layers: int, dim: int, vocab: int, context: int) -> "ModelShape":
        """A GPT with tied embedding/output: wte, wpe, `layers` transformer layers, final LayerNorm."""
        layer = 12 * dim * dim + 13 * dim  # qkv, proj, fc, out with biases, two LayerNorms
        blocks = [("wte", vocab * dim, vocab * dim), ("wpe", context * dim, context * dim)]
        blocks += [(f"h.{i}", layer, 4 * dim * dim) for i in range(layers)] + [("ln_f", 2 * dim, dim)]
        return ModelShape(tuple(blocks))

    @staticmethod
    def uniform(params: int, layers: int) -> "ModelShape":
        each, extra = divmod(int(params), layers)
        return ModelShape(tuple((f"block.{i}", each + (1 if i < extra else 0)) for i in range(layers)))


def estimate(shape: ModelShape, tier: Tier, dtype: torch.dtype, device_memory: Optional[int],
             host_memory: Optional[int], flow: Optional[GradFlow] = None,
             moments: MomentFormat = MomentFormat.FP32, world: int = 1, shard_weights: Optional[bool] = None,
             disk_weights: DiskWeights = DiskWeights.AUTO, disk_room: Optional[int] = None,
             activation_room: int = 0) -> Plan:
    """The plan `offload.wrap` would make for a model of this shape (all parameters trainable); `flow`: when the
    gradients are consumed (declared accumulation, clipping), which decides where the nvme tier keeps them;
    `moments`: how the Adam moments are kept (wrap's `moments=`); `world`: data-parallel ranks, the plan one rank's,
    with `shard_weights` as wrap takes it (None: sharded when the whole weights do not fit host memory);
    `disk_weights`: weights on disk as a copy or read from the master (wrap's), AUTO deciding on `disk_room`, the
    free disk (None: not given, copies); `activation_room`: wrap's `activation_memory`."""
    if world > 1 and tier is not Tier.GPU and shard_weights is None:
        shard_weights = shards_weights(
            lambda: estimate(shape, tier, dtype, device_memory, host_memory, flow, moments, world, False,
                             disk_weights, disk_room, activation_room))
    sharded = world > 1 and tier is not Tier.GPU and bool(shard_weights)
    itemsize = dtype.itemsize
    specs: List[BlockSpec] = [spec_of(block[0], block[1] * itemsize, [(block[1], dtype)], tier, largest * itemsize,
                                      moments, world, -(-block[1] // world) * itemsize if sharded else None)
                              for block, largest in zip(shape.blocks, shape.largest_tensors())]
    largest_record = max(-(-block[1] // world) for block in shape.blocks)
    ring = ring_size_for(largest_record, moments) if tier is Tier.NVME else None
    flow = flow or GradFlow(itemsize=itemsize)
    flow = dataclasses.replace(flow, rests_in_moments=grads_may_rest(tier, flow.clipping, moments, world, dtype))
    # clipping speculates (wrap's speculative_clipping=True) where the budgets leave room for the shadows
    plan = make_plan(specs, tier, device_memory, host_memory, ring, flow, world if sharded else 1,
                     speculate=flow.clipping, disk_room=disk_room, disk_weights=disk_weights,
                     activation_room=activation_room)
    if world > 1 and not sharded and plan.disk_weight_blocks:
        raise OffloadConfigError("shard_weights=False keeps every block's weights in each rank's host memory, but "
                                 f"host_memory leaves {len(plan.disk_weight_blocks)} blocks' weights on disk")
    return plan


def _summary(plan: Plan) -> str:
    disk_weights = len(plan.disk_weight_blocks)
    streamed = len(plan.streamed_blocks)
    line = (f"device {_human(plan.bytes_on(Location.DEVICE)):>10}  host {_human(plan.bytes_on(Location.HOST)):>10}  "
            f"disk {_human(plan.bytes_on(Location.DISK)):>10}  streamed blocks {streamed}"
            + (f" ({disk_weights} from disk)" if disk_weights else ""))
    if plan.tier is Tier.NVME:
        line += f"\n           gradients: {plan.grads_placement()}"
        line += f"\n           staging ring: {plan.ring_placement()}"
    if plan.speculation:
        line += f"\n           speculative clipping: {plan.speculation}"
    if plan.disk_weights:
        line += f"\n           disk-resident weights: {plan.disk_weights}"
    if plan.shard_world > 1:
        line += (f"\n           weights sharded: each rank keeps 1/{plan.shard_world} of every block's, gathered whole "
                 "on the device for each use")
    return line


def _collectives_line(args: argparse.Namespace, plan: Plan, params: int, dtype: torch.dtype, world: int) -> str:
    """What one rank's collectives move per step (the payload: each peer's part once), with the ZeRO++ options
    given: the weight gathers (sharded: a forward's and a backward's), the gradients' reduce-scatter, and hpZ's
    host memory."""
    codes = Int8Blocks()
    others = (world - 1) / world
    quantized = codes.packed_nbytes(params) / params  # bytes an element as int8 blocks
    itemsize = dtype.itemsize
    grads = others * params * (quantized if getattr(args, "zero_quantized_gradients", False) else itemsize)
    line = f"collectives per rank and step: gradients {_human(int(grads))}"
    if plan.shard_world > 1:
        gather = others * params * (quantized if getattr(args, "zero_quantized_weights", False) else itemsize)
        line += f", weight gathers {_human(int(2 * gather))} (forward and backward)"
        size = getattr(args, "zero_hpz_partition_size", 1)
        if size > 1:
            line += (f"; hpZ: the backward's within groups of {size} ranks, its parts up to "
                     f"{_human(-(-params // size) * itemsize)} of host memory a rank")
    return line


def _moments_line(moments: MomentFormat, params: int) -> str:
    """What the moments format does to the disk: bytes of state per parameter against fp32 moments', and the
    model whose fp32-moment state would take the same disk space."""
    mine, fp32 = (4 * params + 2 * moment_nbytes(m, params) for m in (moments, MomentFormat.FP32))
    line = f"optimizer state in the swap file: {mine / params:.2f} B/param with {moments.value} moments"
    if moments is MomentFormat.FP32:
        others = ", ".join(f"{m.value}: {(4 * params + 2 * moment_nbytes(m, params)) / params:.2f}"
                           for m in MomentFormat if m is not MomentFormat.FP32)
        return line + f" ({others}; choose with --moments)"
    count = params * fp32 / mine
    shown = f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"
    return (line + f", {mine / fp32:.2f}x of fp32's {fp32 / params:.0f}: the disk that holds this model's state with "
            f"fp32 moments holds a {shown}-parameter model's with {moments.value}, and each step moves that much less")


def disk_bytes(plan: Plan) -> int:
    """What the swap file needs for this plan, speculation's shadow copies apart (the plan gives them only the
    room that is left: without it those blocks wait for the global norm instead)."""
    return plan.bytes_on(Location.DISK) - sum(b.shadow_disk_bytes for b in plan.blocks)


def _per_param_lines(shape: ModelShape, dtype: torch.dtype, device_memory: Optional[int], host_memory: Optional[int],
                     flow: GradFlow, world: int, shard: Optional[bool], disk: Optional[int]) -> List[str]:
    """nvme tier: what one parameter costs on disk and in memory with each moments format and each way of keeping
    the weights the budgets leave on disk (a copy, or read from the fp32 master) under these budgets, and, given
    the free `disk`, the largest model of this many blocks that it and the budgets hold, against the classic 16
    bytes a parameter of mixed-precision training (2 weights + 2 gradients + 12 optimizer)."""
    lines = ["bytes per parameter (nvme tier, these budgets; disk-resident weights kept as a copy, or read from the "
             "fp32 master):"]
    for moments in MomentFormat:
        for weights in (DiskWeights.COPY, DiskWeights.MASTER):
            label = f"  moments={moments.value:<4} weights={weights.value:<6}"
            try:
                plan = estimate(shape, Tier.NVME, dtype, device_memory, host_memory, flow, moments, world, shard,
                                weights)
            except OffloadConfigError as exc:
                lines.append(f"{label} does not fit: {exc}")
                continue
            memory = plan.bytes_on(Location.DEVICE) + plan.bytes_on(Location.HOST)
            line = f"{label} disk {disk_bytes(plan) / shape.params:5.2f} B, memory {memory / shape.params:5.2f} B"
            if disk is not None:
                found = largest_params(shape, dtype, device_memory, host_memory, flow, moments, world, shard, disk,
                                       weights)
                if found is None:
                    line += f"; no model of {len(shape.blocks)} blocks fits {_human(disk)} of disk"
                else:
                    largest, used = found
                    there = used.bytes_on(Location.DEVICE) + used.bytes_on(Location.HOST)
                    line += (f"; the largest model on {_human(disk)} of disk: {_count(largest)} parameters, "
                             f"{largest * 16 / (disk + there):.2f}x (disk + its {_human(there)} of memory) / 16 B")
            lines.append(line)
    return lines


def largest_params(shape: ModelShape, dtype: torch.dtype, device_memory: Optional[int], host_memory: Optional[int],
                   flow: GradFlow, moments: MomentFormat, world: int, shard: Optional[bool],
                   disk: int, disk_weights: DiskWeights = DiskWeights.COPY) -> Optional[Tuple[int, Plan]]:
    """The most parameters (to 1 in 10,000), in as many equal blocks as `shape` has, whose plan fits the budgets
    and `disk`, with that plan; None: none does. The disk a plan needs grows with the parameters: a bisection."""
    blocks = len(shape.blocks)

    def plan_within(params: int) -> Optional[Plan]:
        try:
            plan = estimate(ModelShape.uniform(params, blocks), Tier.NVME, dtype, device_memory, host_memory, flow,
                            moments, world, shard, disk_weights)
        except OffloadConfigError:
            return None
        return plan if disk_bytes(plan) <= disk else None

    best: Optional[Tuple[int, Plan]] = None
    low, high = 0, blocks
    while (plan := plan_within(high)) is not None and high < 1 << 50:
        best, low, high = (high, plan), high, 2 * high
    while high - low > max(low // 10000, 1):
        middle = (low + high) // 2
        plan = plan_within(middle)
        if plan is None:
            high = middle
        else:
            best, low = (middle, plan), middle
    return best


def _count(params: float) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload estimate", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def parameter_count(text: str) -> float:
    """`--params`: a finite number >= 1, e.g. 7e9 (the count is truncated to an integer)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1 (a parameter count such as 7e9), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=parameter_count, default=None, help="total parameters, e.g. 7e9")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="transformer layers (blocks for --params; default 32)")
    parser.add_argument("--dim", type=positive_int, default=None, help="model width of a GPT config")
    parser.add_argument("--vocab", type=positive_int, default=32000, help="vocabulary of a GPT config")
    parser.add_argument("--context", type=positive_int, default=2048, help="context length of a GPT config")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype of the weights")
    parser.add_argument("--tier", choices=[t.value for t in Tier] + ["all"], default="all")
    parser.add_argument("--device-memory", type=byte_size, default=None, help="device budget, e.g. 24GB")
    parser.add_argument("--host-memory", type=byte_size, default=None, help="host budget, e.g. 64GB")
    parser.add_argument("--activation-memory", type=byte_size, default=None,
                        help="device bytes kept free of weights for the activations, as offload.wrap("
                             "activation_memory=...): within --device-memory")
    parser.add_argument("--grad-accumulation-steps", type=positive_int, default=None,
                        help="declared as in offload.wrap: without --max-grad-norm the nvme tier's updates consume "
                             "the gradients during the last backward, so none goes to disk")
    parser.add_argument("--max-grad-norm", action="store_true",
                        help="clipping on: gradients wait for the global norm (on disk when they do not fit)")
    parser.add_argument("--moments", choices=[m.value for m in MomentFormat], default=MomentFormat.FP32.value,
                        help="how the Adam moments are kept, as offload.wrap(moments=...): int8 and bf16 shrink the "
                             "state (on the nvme tier, the swap file and the bytes each step moves)")
    parser.add_argument("--world-size", type=positive_int, default=1,
                        help="data-parallel ranks (torchrun): the plan and budgets are one rank's, each keeping 1/N "
                             "of the optimizer state")
    parser.add_argument("--shard-weights", choices=["auto", "on", "off"], default="auto",
                        help="with --world-size: each rank keeps 1/N of the weights (on), all of them (off), or "
                             "what the budgets need (auto), as offload.wrap(shard_weights=True/False/None)")
    parser.add_argument("--zero-quantized-weights", action="store_true",
                        help="wrap's zero_quantized_weights (ZeRO++'s qwZ, sharded weights): the gathers' bytes")
    parser.add_argument("--zero-quantized-gradients", action="store_true",
                        help="wrap's zero_quantized_gradients (ZeRO++'s qgZ): the gradient reduce-scatter's bytes")
    parser.add_argument("--zero-hpz-partition-size", type=positive_int, default=1,
                        help="wrap's zero_hpz_partition_size (ZeRO++'s hpZ, sharded weights): its host memory")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per sequence: also estimate the activations (a GPT config: --layers, --dim)")
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch (--seq-len)")
    parser.add_argument("--heads", type=positive_int, default=None, help="attention heads (default: --dim / 128)")
    parser.add_argument("--eager-attention", action="store_true",
                        help="attention saves its s x s scores (no fused/flash kernel; CPU training with dropout)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing per layer: only each layer's input is kept (--seq-len)")
    parser.add_argument("--disk", type=byte_size, default=None,
                        help="free disk for the swap file, e.g. 50GB: the nvme tier's largest model it and the "
                             "budgets hold, for each moments format")
    parser.add_argument("--disk-weights", choices=[d.value for d in DiskWeights], default=DiskWeights.AUTO.value,
                        help="nvme tier, weights the budgets leave on disk: a copy of their own, read from the fp32 "
                             "master (no disk, 4 B/param read per fetch), or auto (master when the copies would not "
                             "fit --disk), as offload.wrap(disk_weights=...)")
    parser.add_argument("--blocks", action="store_true", help="print the per-block plan table too")


def _usage_error(message: str) -> int:
    print(f"python -m offload estimate: error: {message}", file=sys.stderr)
    return 2


def _budget(value: object, what: str) -> Optional[int]:
    """The parser gives byte counts already (`byte_size`); a Namespace built by hand may hold strings."""
    return value if value is None or isinstance(value, int) else parse_bytes(value, what)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    if (args.params is None) == (args.dim is None):
        return _usage_error("give either --params N, or a GPT config with --layers and --dim (and --vocab, --context)")
    layers = 32 if args.layers is None else args.layers
    if args.dim is not None:
        shape = ModelShape.gpt(layers, args.dim, args.vocab, args.context)
    else:
        if int(args.params) < layers:
            return _usage_error(f"--params {args.params:g} is fewer parameters than blocks (--layers {layers}); "
                                f"give --params >= --layers")
        shape = ModelShape.uniform(int(args.params), layers)
    dtype = DTYPES[args.dtype]
    try:
        device_memory = _budget(args.device_memory, "--device-memory")
        host_memory = _budget(args.host_memory, "--host-memory")
        activation_room = _budget(getattr(args, "activation_memory", None), "--activation-memory") or 0
    except (OffloadConfigError, OverflowError) as exc:
        return _usage_error(str(exc))
    if activation_room and device_memory is None:
        return _usage_error("--activation-memory keeps room within --device-memory: give --device-memory too")
    seq_len = getattr(args, "seq_len", None)
    if seq_len is not None and args.dim is None:
        return _usage_error("--seq-len estimates a GPT config's activations: give --layers and --dim (and --heads)")
    tiers = list(Tier) if args.tier == "all" else [Tier.parse(args.tier)]
    count = _count(shape.params)
    print(f"model: {count} parameters in {len(shape.blocks)} blocks, compute dtype {args.dtype}; "
          f"budgets: device {_human(device_memory) if device_memory else 'none'}, "
          f"host {_human(host_memory) if host_memory else 'none'}")
    fits_any = False
    flow = GradFlow(getattr(args, "grad_accumulation_steps", None), bool(getattr(args, "max_grad_norm", False)),
                    dtype.itemsize)
    moments = MomentFormat.parse(getattr(args, "moments", MomentFormat.FP32.value))
    world = getattr(args, "world_size", 1)
    shard = {"auto": None, "on": True, "off": False}[getattr(args, "shard_weights", "auto")]
    disk_weights = DiskWeights.parse(getattr(args, "disk_weights", None))
    disk = _budget(getattr(args, "disk", None), "--disk")
    if world > 1:
        print(f"per rank of {world} data-parallel ranks (each keeps 1/{world} of the optimizer state)")
    for tier in tiers:
        try:
            plan = estimate(shape, tier, dtype, device_memory, host_memory, flow, moments, world, shard,
                            disk_weights if tier is Tier.NVME else DiskWeights.AUTO, disk, activation_room)
        except OffloadConfigError as exc:
            print(f"tier={tier.value:<5} does not fit: {exc}")
            continue
        fits_any = True
        print(f"tier={tier.value:<5} {_summary(plan)}")
        if tier is Tier.NVME:
            print("           " + _moments_line(moments, shape.params))
            per_param = _per_param_lines(shape, dtype, device_memory, host_memory, flow, world, shard, disk)
            print("\n".join("           " + line for line in per_param))
        if world > 1:
            print("           " + _collectives_line(args, plan, shape.params, dtype, world))
        if seq_len is not None:
            room = None if device_memory is None else device_memory - plan.bytes_on(Location.DEVICE)
            lines = describe(layers, args.dim, getattr(args, "heads", None) or max(args.dim // 128, 1), seq_len,
                             getattr(args, "micro_batch", 1), dtype.itemsize, bool(getattr(args, "checkpointing", False)),
                             room, _human, fused_attention=not getattr(args, "eager_attention", False))
            print("\n".join("           " + line for line in lines.split("\n")))
        if args.blocks:
            print(plan)
    return 0 if fits_any else 1


__all__ = ["ModelShape", "estimate", "main"]
