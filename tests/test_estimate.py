"""`python -m offload estimate`: the planner's memory per tier for a model size, without a model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from offload.__main__ import main
from offload.cli.estimate import ModelShape, estimate
from offload.optim.functional import torch_norm_order
from offload.optim.moment_format import MomentFormat
from offload.planner.plan import GradFlow, Location
from offload.policy import Tier


def test_gpt_shape_counts_parameters():
    shape = ModelShape.gpt(layers=2, dim=64, vocab=512, context=32)
    layer = 12 * 64 * 64 + 13 * 64
    assert shape.params == 512 * 64 + 32 * 64 + 2 * layer + 2 * 64
    assert ModelShape.uniform(1000, 3).params == 1000


def test_nvme_estimate_keeps_state_on_disk_and_host_within_budget():
    shape = ModelShape.uniform(int(1e9), 16)
    host = 3 << 30
    plan = estimate(shape, Tier.NVME, torch.bfloat16, device_memory=1 << 30, host_memory=host)
    assert plan.bytes_on(Location.DISK) >= 12 * int(1e9)  # fp32 master + m + v, and weights spilled there
    assert plan.bytes_on(Location.HOST) <= host
    assert plan.disk_weight_blocks  # 2 GB of weights do not fit next to 2 GB of gradients in 3 GiB


@pytest.mark.parametrize("host", [60 << 20, 14 << 30, 64 << 30])
def test_the_same_host_memory_keeps_over_one_and_a_half_times_the_int8_elements_in_flight(host):
    """The ring is sized in host bytes, its slots in elements: int8 moments (~10 B an element in a slot) keep >=
    1.5x the elements of fp32 ones (16 B) in flight within the same ring budget; the slots never exceed it.
    Budgets: the least ring (4 slots), a budget-bound ring (hundreds of 32 MiB slots), a read-ahead ring."""
    shape = ModelShape.uniform(int(7e9), 32) if host > 1 << 30 else ModelShape.uniform(int(4e6), 4)
    plans = {m: estimate(shape, Tier.NVME, torch.bfloat16, None, host, moments=m)
             for m in (MomentFormat.FP32, MomentFormat.INT8)}
    for plan in plans.values():
        assert plan.ring_slots is not None and plan.ring_slots.nbytes <= plan.ring_bytes
        assert plan.bytes_on(Location.HOST) <= host
    fp32, int8 = (plans[m].ring_slots for m in (MomentFormat.FP32, MomentFormat.INT8))
    assert int8.in_flight_numel >= 1.5 * fp32.in_flight_numel, (fp32, int8)
    assert re.search(r"staging ring: \d+ slots x [\d.]+ MiB, [\d.]+[KM] elements each at 10\.0\d B \(int8 moments",
                     str(plans[MomentFormat.INT8])), str(plans[MomentFormat.INT8])


def test_cli_reports_each_tier_and_what_does_not_fit(capsys):
    assert main(["estimate", "--params", "7e9", "--host-memory", "64GB", "--device-memory", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "tier=gpu   does not fit" in out and "tier=cpu   does not fit" in out
    assert "tier=nvme  device" in out
    assert main(["estimate", "--layers", "2", "--dim", "64", "--tier", "cpu", "--blocks"]) == 0
    assert "offload plan (tier=cpu)" in capsys.readouterr().out
    assert main(["estimate"]) == 2


POSITIVE_COUNT = "must be a finite number >= 1 (a parameter count such as 7e9)"
POSITIVE_INT = "must be an integer >= 1"
BYTE_SIZE = "must be a byte size > 0 such as 24GB, 512MiB or 4G"


@pytest.mark.parametrize("argv, message", [
    (["--params", "0"], f"argument --params: {POSITIVE_COUNT}, got '0'"),
    (["--params=-5"], f"argument --params: {POSITIVE_COUNT}, got '-5'"),
    (["--params", "0.5"], f"argument --params: {POSITIVE_COUNT}, got '0.5'"),
    (["--params", "nan"], f"argument --params: {POSITIVE_COUNT}, got 'nan'"),
    (["--params", "inf"], f"argument --params: {POSITIVE_COUNT}, got 'inf'"),
    (["--params", "1e9", "--layers", "0"], f"argument --layers: {POSITIVE_INT}, got '0'"),
    (["--dim", "64", "--layers", "0"], f"argument --layers: {POSITIVE_INT}, got '0'"),
    (["--dim", "64", "--layers=-3"], f"argument --layers: {POSITIVE_INT}, got '-3'"),
    (["--dim=-64"], f"argument --dim: {POSITIVE_INT}, got '-64'"),
    (["--dim", "64", "--vocab=-5"], f"argument --vocab: {POSITIVE_INT}, got '-5'"),
    (["--dim", "64", "--context", "0"], f"argument --context: {POSITIVE_INT}, got '0'"),
    (["--params", "1e9", "--host-memory", "inf"], f"argument --host-memory: {BYTE_SIZE}"),
    (["--params", "1e9", "--host-memory", "nan"], f"argument --host-memory: {BYTE_SIZE}"),
    (["--params", "1e9", "--host-memory=-5GB"], f"argument --host-memory: {BYTE_SIZE}"),
    (["--params", "1e9", "--device-memory", "0"], f"argument --device-memory: {BYTE_SIZE}"),
    (["--params", "1e9", "--device-memory", "9" * 400], f"argument --device-memory: {BYTE_SIZE}"),
])
def test_cli_rejects_a_bad_number_at_parse_time(capsys, argv, message):
    """Zero, negative, nan and inf sizes: an argparse error naming the option, the value and what is valid
    (exit code 2), never a plan of negative bytes or a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "python -m offload estimate: error:" in captured.err
    assert "tier=" not in captured.out


def test_cli_rejects_fewer_parameters_than_blocks(capsys):
    assert main(["estimate", "--params", "10", "--layers", "32"]) == 2
    captured = capsys.readouterr()
    assert "--params 10 is fewer parameters than blocks (--layers 32)" in captured.err
    assert "tier=" not in captured.out


def test_python_m_offload_estimate_nan_is_a_usage_error_not_a_traceback():
    result = subprocess.run([sys.executable, "-m", "offload", "estimate", "--params", "nan"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"argument --params: {POSITIVE_COUNT}, got 'nan'" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_70b_on_a_24gb_device_with_128gb_of_host_fits_on_nvme_in_every_gradient_flow(capsys):
    """All 140 GB of bf16 gradients do not fit 128 GB of host memory; a window of three blocks' does (issue
    "larger than RAM"), and gradients that must wait (clipping, undeclared accumulation) wait on disk (issue
    "larger than RAM the way people train"), except those the host budget holds whole beside the window (issue
    36: the disk, not the RAM, bounds the model). Before, clipping was refused: "the gradient accumulators need
    130.4 GiB"."""
    argv = ["estimate", "--params", "70e9", "--host-memory", "128GB", "--device-memory", "24GB", "--tier", "nvme"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("gradients: a window of 12.2 GiB in host memory, 24.4 GiB of 130.4 GiB on disk (records in the swap "
            "file for 6 of 32 blocks; the other 105.9 GiB stay whole in host memory beside the window)") in out, out
    assert "48.9 GiB written and read back per step" in out and "fast path" in out
    assert main(argv + ["--grad-accumulation-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "gradients: a window of 12.2 GiB (of 130.4 GiB; the fast path" in out and "on disk" not in out
    assert main(argv + ["--grad-accumulation-steps", "4", "--max-grad-norm"]) == 0
    out = capsys.readouterr().out
    # the fp32 copy for clipping's norms (4.1 GiB) holds a block's gradient where the norm is taken in place
    taken_in_place = torch_norm_order() is not None
    spilled = "24.4 GiB of 130.4 GiB on disk (records in the swap file for 6" if taken_in_place else \
        "28.5 GiB of 130.4 GiB on disk (records in the swap file for 7"
    assert spilled + " of 32 blocks" in out, out
    # clipping speculates where there is room: every block streams from disk (host memory holds gradients), so
    # the shadows of the state and of the weights are all in the swap file (free disk not measured here)
    assert "speculative clipping: 32 of 32 blocks update during the last backward into shadows (900.5 GiB disk)" \
        in out, out


def test_the_gradient_window_survives_a_device_budget():
    """The device budget's in-flight room once overwrote the gradient window's size in the planner."""
    shape = ModelShape.uniform(int(70e9), 32)
    plan = estimate(shape, Tier.NVME, torch.bfloat16, 24 * 10**9, 128 * 10**9, GradFlow(1, False, 2))
    largest = max(b.grad_bytes for b in plan.blocks)
    assert plan.grad_window_bytes == 3 * largest
    assert plan.bytes_on(Location.HOST) <= 128 * 10**9


def test_activations_of_the_issues_long_context_example(capsys):
    """Hidden 8192, 80 layers, 32K tokens, checkpointing per layer: the checkpoints are 40 GiB (issue 26's
    figure), and with activations='offload' the device keeps about one layer's recompute."""
    argv = ["estimate", "--layers", "80", "--dim", "8192", "--seq-len", "32768", "--checkpointing", "--tier", "nvme",
            "--device-memory", "24GB", "--host-memory", "128GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "512.0 MiB a layer, 40.0 GiB in all" in out
    assert "activations='offload': about 8.5 GiB on the device, 40.0 GiB through the swap file" in out


def test_offloading_activations_fits_more_tokens_than_keeping_them():
    from offload.cli.activation_estimate import estimate_activations, tokens_that_fit

    room = 20 << 30
    kept = tokens_that_fit(room, 32, 4096, 32, 4096, 2, checkpointing=False, offloaded=False, fused_attention=True)
    offloaded = tokens_that_fit(room, 32, 4096, 32, 4096, 2, checkpointing=False, offloaded=True, fused_attention=True)
    assert offloaded >= 16 * kept > 0
    one = estimate_activations(32, 4096, 32, 4096, 1, 2, checkpointing=False, fused_attention=False)
    assert one.per_layer == 4096 * (34 * 4096 + 5 * 32 * 4096) and one.total == 32 * one.per_layer


def test_seq_len_needs_a_gpt_config(capsys):
    assert main(["estimate", "--params", "7e9", "--seq-len", "2048"]) == 2
    assert "--seq-len estimates a GPT config's activations" in capsys.readouterr().err


def test_a_ranks_plan_holds_its_part_of_the_state_and_shards_weights_that_do_not_fit(capsys):
    """--world-size N: the plan is one rank's (1/N of the optimizer state, the whole gradient); weights that do not
    fit a rank's host memory are sharded (each rank keeps 1/N), as wrap(shard_weights=None) decides; refused when
    sharding is turned off."""
    shape = ModelShape.gpt(24, 2048, 32000, 2048)
    one = estimate(shape, Tier.NVME, torch.bfloat16, 24 << 30, None)
    two = estimate(shape, Tier.NVME, torch.bfloat16, 24 << 30, None, world=2)
    state = [sum(b.state_bytes for b in plan.blocks) for plan in (one, two)]
    assert abs(state[1] - state[0] / 2) <= 0.01 * state[0] and two.shard_world == 1
    weights = shape.params * 2
    small = estimate(shape, Tier.NVME, torch.bfloat16, 2 << 30, weights // 2, world=4)
    assert small.shard_world == 4 and small.bytes_on(Location.HOST) <= weights // 2
    assert sum(b.weight_bytes for b in small.blocks) <= weights / 4 + 64 * 4096
    with pytest.raises(Exception, match="shard_weights=False"):
        estimate(shape, Tier.NVME, torch.bfloat16, 2 << 30, weights // 2, world=4, shard_weights=False)
    assert main(["estimate", "--layers", "24", "--dim", "2048", "--tier", "nvme", "--device-memory", "2GB",
                 "--host-memory", str(weights // 2), "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "per rank of 4 data-parallel ranks" in out and "weights sharded: each rank keeps 1/4" in out


def test_cli_gives_the_collectives_bytes_with_and_without_the_zero_plus_plus_options(capsys):
    """Under several ranks: each rank's gradient and weight-gather bytes per step (bf16: 2 bytes an element; as
    ZeRO++'s int8 blocks 1 + 4/64), and hpZ's host memory."""
    base = ["estimate", "--params", "7e9", "--layers", "32", "--world-size", "4", "--shard-weights", "on",
            "--host-memory", "64GB", "--tier", "cpu"]
    assert main(base) == 0
    exact = capsys.readouterr().out
    assert "collectives per rank and step: gradients 9.8 GiB, weight gathers 19.6 GiB" in exact
    assert main(base + ["--zero-quantized-weights", "--zero-quantized-gradients", "--zero-hpz-partition-size", "2"]) == 0
    quantized = capsys.readouterr().out
    assert "gradients 5.2 GiB, weight gathers 10.4 GiB" in quantized
    assert "hpZ: the backward's within groups of 2 ranks, its parts up to 6.5 GiB of host memory a rank" in quantized


def test_the_largest_model_a_disk_holds_per_moments_format(capsys):
    """`--disk`: each moments format's bytes a parameter on disk and in memory, and the largest model (of as many
    blocks) whose plan fits the budgets and that disk: the plan just above it needs more disk than given."""
    from offload.cli.estimate import disk_bytes, largest_params

    flow, disk = GradFlow(1, True, 2), 40 * 10**9
    assert main(["estimate", "--params", "1e9", "--layers", "16", "--tier", "nvme", "--host-memory", "4GB",
                 "--device-memory", "4GB", "--grad-accumulation-steps", "1", "--max-grad-norm", "--disk", "40GB"]) == 0
    out = capsys.readouterr().out
    found = {}
    for moments in MomentFormat:
        line = re.search(rf"moments={moments.value}\s+weights=copy\s+disk\s+([\d.]+) B, memory\s+([\d.]+) B; the largest model "
                         rf"on 37.3 GiB of disk: ([\d.]+)B parameters", out)
        assert line, out
        found[moments] = float(line.group(3)) * 1e9
        largest, plan = largest_params(ModelShape.uniform(int(1e9), 16), torch.bfloat16, 4 * 10**9, 4 * 10**9, flow,
                                       moments, 1, None, disk)
        assert disk_bytes(plan) <= disk < disk_bytes(estimate(ModelShape.uniform(int(largest * 1.001), 16),
                                                             Tier.NVME, torch.bfloat16, 4 * 10**9, 4 * 10**9, flow,
                                                             moments))
        assert abs(largest - found[moments]) / largest < 0.01
        assert float(line.group(1)) * 1e9 == pytest.approx(disk_bytes(estimate(
            ModelShape.uniform(int(1e9), 16), Tier.NVME, torch.bfloat16, 4 * 10**9, 4 * 10**9, flow, moments)), rel=1e-3)
    assert found[MomentFormat.FP32] < found[MomentFormat.BF16] < found[MomentFormat.INT8]


def test_activation_memory_in_the_estimate_is_wraps_and_needs_a_device_budget(capsys):
    """--activation-memory keeps device room free of weights as wrap(activation_memory=) does: fewer weights stay
    on the device, the plan says what it keeps; without --device-memory it is a usage error."""
    shape = ModelShape.uniform(int(2e9), 16)
    flow = GradFlow(1, True, 2)
    plain = estimate(shape, Tier.NVME, torch.bfloat16, 3 << 30, 8 << 30, flow)
    kept = estimate(shape, Tier.NVME, torch.bfloat16, 3 << 30, 8 << 30, flow, activation_room=1 << 30)
    assert kept.bytes_on(Location.DEVICE) < plain.bytes_on(Location.DEVICE) and kept.device_room >= 1 << 30
    assert kept.norm_scratch_bytes == plain.norm_scratch_bytes  # clipping bf16 gradients: their fp32 copy, if any
    argv = ["estimate", "--params", "2e9", "--layers", "16", "--tier", "nvme", "--host-memory", "8GB",
            "--device-memory", "3GB", "--dtype", "bf16", "--max-grad-norm", "--blocks"]
    assert main(argv + ["--activation-memory", "1GiB"]) == 0
    assert "free of weights for the activations (activation_memory)" in capsys.readouterr().out
    assert main(["estimate", "--params", "2e9", "--activation-memory", "1GiB"]) == 2
    assert "--activation-memory keeps room within --device-memory" in capsys.readouterr().err
