"""Data-parallel mode under torchrun (2 processes, gloo): exact against one process on the whole batch.

Each rank gets half of every batch; the engine averages the gradients, steps its part of the optimizer
state, gathers the weights. With fp32 on the CPU the losses and weights must equal those of one process
with plain AdamW on the whole batch (within 1e-5; the averaged half-batch gradients differ from the
full-batch one in rounding only), and every rank must hold bit-identical weights after every step.
The ranks run in tests/dp_child.py; one torchrun launch runs several cases (start-up is the slow part).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from tests.models import TinyGPT, make_batches

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_SECONDS = 300

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this build")


def run_ranks(tmp_path: Path, cases: List[dict], nproc: int = 2) -> subprocess.CompletedProcess:
    """One torchrun launch (a free port: --standalone) running `cases` on `nproc` ranks."""
    spec = tmp_path / f"cases-{len(list(tmp_path.glob('cases-*')))}.json"
    spec.write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), str(ROOT / "tests" / "dp_child.py"), str(ROOT), str(tmp_path), str(spec)],
                          capture_output=True, text=True, timeout=LAUNCH_SECONDS, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])
    return done


def reference(case: dict) -> Dict[str, object]:
    """One process, plain torch.optim.AdamW, the whole batch, rank 0's start weights."""
    torch.manual_seed(0)
    model = TinyGPT()
    for name, param in model.named_parameters():  # dp_child.freeze
        if name.startswith(tuple(case.get("freeze", ()))):
            param.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=case.get("lr", 1e-2), weight_decay=case.get("weight_decay", 0.0),
                            foreach=False)
    losses = []
    for step in make_batches(case["steps"], case["micro"], batch=case.get("batch", 4), seed=case.get("seed", 0)):
        for idx, tgt in step:
            loss = model(idx, tgt)
            (loss / len(step)).backward()
            losses.append(float(loss.detach()))
        max_norm: Optional[float] = case.get("max_grad_norm", case.get("clip_by_call"))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": model.state_dict()}


def assert_matches(name: str, result: dict, expected: dict) -> None:
    """Bit-identical ranks; the engine's weights within 1e-6 of DDP + AdamW on the same halves (the same
    arithmetic: gradients averaged across ranks), and losses and weights within 1e-5 of one process on the
    whole batch (the average of two half-batch gradients differs from the whole-batch one in rounding,
    which Adam magnifies where a gradient is itself rounding noise: at lr 1e-2 DDP differs by 6e-5 too)."""
    assert all(result["agree"]), f"{name}: ranks' weights differ after steps {result['agree']}"
    diffs = [abs(a - b) for a, b in zip(result["losses"], expected["losses"])]
    assert len(result["losses"]) == len(expected["losses"]) and max(diffs) < 1e-5, (name, diffs)
    for key, value in expected["weights"].items():
        err = (result["weights"][key].float() - value.float()).abs().max().item()
        assert err < 1e-5, (name, key, err)
        if result["ddp_weights"] is not None:
            err = (result["weights"][key].float() - result["ddp_weights"][key].float()).abs().max().item()
            assert err < 1e-6, (name, "against DDP", key, err)


CASES = [
    dict(name="cpu", tier="cpu", steps=4, micro=1, ddp=True, torch_state=True),
    dict(name="cpu-clip-accum", tier="cpu", steps=4, micro=2, max_grad_norm=0.5, grad_accumulation_steps=2,
         lr=1e-3, ddp=True),
    dict(name="cpu-accum-early", tier="cpu", steps=4, micro=2, grad_accumulation_steps=2, weight_decay=0.1,
         lr=1e-3, ddp=True),
    dict(name="cpu-clip-call", tier="cpu", steps=3, micro=2, clip_by_call=0.3, lr=1e-3, ddp=True),
    dict(name="nvme-clip-accum", tier="nvme", steps=4, micro=2, max_grad_norm=0.5, grad_accumulation_steps=2,
         lr=1e-3, ddp=True, torch_state=True),
    dict(name="nvme", tier="nvme", steps=4, micro=1),
]


def test_two_ranks_train_exactly_as_one_process_on_the_whole_batch(tmp_path):
    run_ranks(tmp_path, CASES)
    for case in CASES:
        result = torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)
        assert_matches(case["name"], result, reference(case))
        if case.get("torch_state"):
            assert_torch_state(tmp_path, case["name"], result["ddp_optimizer"])


def assert_torch_state(tmp_path: Path, name: str, ddp_optimizer: dict) -> None:
    """engine.optimizer.state_dict() data-parallel: the whole state on every rank, bit-identical across the
    ranks, torch AdamW's under DDP within 1e-6, and loaded into a fresh engine it comes back unchanged."""
    ranks = [torch.load(tmp_path / f"{name}-optimizer-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(rank["round_trip_equal"] for rank in ranks), name
    ours = ranks[0]["state_dict"]
    assert ours["state"].keys() == ddp_optimizer["state"].keys() == ranks[1]["state_dict"]["state"].keys()
    for index, entry in ddp_optimizer["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], ranks[1]["state_dict"]["state"][index][key]), (name, key)
            err = (ours["state"][index][key] - value).abs().max().item()
            assert err < 1e-6, (name, index, key, err)


def test_two_ranks_keep_int8_moments_of_their_own_parts(tmp_path):
    """moments="int8" data-parallel: each rank quantizes its own part (blocks counted from its part's start),
    the ranks stay bit-identical, the run tracks fp32 AdamW on the whole batch, and the torch-style state (the
    decoded fp32 moments, gathered) loads back into a fresh engine unchanged."""
    cases = [dict(name=f"{tier}-int8", tier=tier, steps=4, micro=1, moments="int8", torch_state=True)
             for tier in ("cpu", "nvme")]
    run_ranks(tmp_path, cases)
    expected = reference(cases[0])
    for case in cases:
        result = torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)
        assert all(result["agree"]), case["name"]
        diffs = [abs(a - b) for a, b in zip(result["losses"], expected["losses"])]
        assert result["losses"] != expected["losses"] and max(diffs) < 0.05 * expected["losses"][-1], diffs
        ranks = [torch.load(tmp_path / f"{case['name']}-optimizer-rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert all(rank["round_trip_equal"] for rank in ranks), case["name"]
    cpu, nvme = (torch.load(tmp_path / f"{c['name']}.pt", weights_only=False) for c in cases)
    assert cpu["losses"] == nvme["losses"], "the same codes on both tiers"


def test_each_rank_keeps_half_of_the_optimizer_state(tmp_path):
    """engine.stats()['optimizer_state_bytes'] is this rank's part: about half of one process's."""
    import offload

    torch.manual_seed(0)
    engine = offload.wrap(TinyGPT(), tier="cpu", dtype=torch.float32, device="cpu")
    whole = engine.stats()["optimizer_state_bytes"]
    engine.close()
    case = dict(name="stats", tier="cpu", steps=1, micro=1)
    run_ranks(tmp_path, [case])
    part = torch.load(tmp_path / "stats.pt", weights_only=False)["stats"]["optimizer_state_bytes"]
    assert whole == 12 * sum(p.numel() for p in TinyGPT().parameters() if p.requires_grad)
    assert whole / 2 <= part <= whole / 2 + 12 * 2 * 16, (part, whole)  # + at most one padding element per group


def test_ddp_around_the_engine_and_torch_clipping_one_ranks_gradients_are_refused_on_every_rank(tmp_path):
    run_ranks(tmp_path, [dict(name="ddp", misuse="ddp"), dict(name="clip", misuse="torch_clip")])
    for rank in (0, 1):
        message = (tmp_path / f"ddp-rank{rank}.txt").read_text()
        assert "inside DistributedDataParallel" in message and "trains data-parallel itself" in message, message
        message = (tmp_path / f"clip-rank{rank}.txt").read_text()
        assert "not their average across the ranks" in message and "engine.clip_grad_norm_" in message, message


def optimizer_tensors(directory: Path) -> Dict[str, torch.Tensor]:
    """Every `<kind>/<param>` optimizer tensor of a checkpoint, whole, whether one process or several ranks
    saved it (read with offload's own readers, checksums verified; the masters wherever the checkpoint keeps them,
    [Note: master weights stored once])."""
    from offload.checkpoint.manifest import read_manifest
    from offload.checkpoint.reader import master_weights
    from offload.checkpoint.sharded import PartsReader
    from offload.checkpoint.tensor_file import TensorFileReader

    manifest = read_manifest(str(directory))
    shapes = {p["name"]: p["shape"] for b in manifest["blocks"] for g in b["groups"] for p in g["params"]
              if p["trainable"]}
    names = [f"{kind}/{name}" for kind in ("exp_avg", "exp_avg_sq") for name in shapes]
    if manifest.get("optimizer_parts"):
        reader = PartsReader(str(directory), manifest, {})
    else:
        info = manifest["files"]["optimizer.safetensors"]
        reader = TensorFileReader(str(directory / "optimizer.safetensors"), info["checksums"], manifest["checksum"], {})
    out = {}
    with reader:
        for name in names:
            numel = 1
            for d in shapes[name.split("/", 1)[1]]:
                numel *= d
            out[name] = torch.empty(numel)
            reader.read_at(name, 0, out[name])
    out.update({f"master/{name}": value.reshape(-1) for name, value in master_weights(str(directory)).items()})
    return out


def train_one_process(tier: str, steps: range, tmp_path: Path, load: Optional[Path] = None,
                      save: Optional[Path] = None, lr: float = 1e-3, moments: str = "fp32"):
    """The single-process engine on the whole batch for `steps` of the batches; returns (losses, weights)."""
    import offload

    torch.manual_seed(0)
    options = dict(tier=tier, dtype=torch.float32, device="cpu", lr=lr, moments=moments)
    if tier == "nvme":
        options["nvme_path"] = str(tmp_path)
    engine = offload.wrap(TinyGPT(), **options)
    if load is not None:
        engine.load(str(load))
    losses = []
    batches = make_batches(steps.stop, 1)
    for i in steps:
        (idx, tgt), = batches[i]
        loss = engine(idx, tgt)
        loss.backward()
        losses.append(float(loss.detach()))
        engine.step()
        engine.zero_grad()
    if save is not None:
        engine.save(str(save))
    weights = engine.state_dict()
    engine.close()
    return losses, weights


def test_checkpoints_move_between_world_sizes_exactly(tmp_path):
    """Saved by 2 ranks (each its part, one directory), loaded by 2 on another tier and by 1; saved by 1,
    loaded by 2: the optimizer state arrives bit for bit, and training continues as it would have."""
    lr = 1e-3
    run_ranks(tmp_path, [
        dict(name="through", tier="cpu", steps=4, micro=1, lr=lr, save="ck-two", save_at=2),
        dict(name="resumed", tier="nvme", steps=4, micro=1, lr=lr, load="ck-two", skip=2),
    ])
    through = torch.load(tmp_path / "through.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert resumed["losses"] == through["losses"][2:] and all(resumed["agree"])
    for name, value in through["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name

    parts = sorted(p.name for p in (tmp_path / "ck-two").iterdir())
    assert parts == ["manifest.json", "model.safetensors", "optimizer-00000-of-00002.safetensors",
                     "optimizer-00001-of-00002.safetensors"]
    # 2 -> 1: the single process holds exactly the state the ranks saved, and continues
    losses, _ = train_one_process("nvme", range(2, 4), tmp_path, load=tmp_path / "ck-two",
                                  save=tmp_path / "ck-two-one", lr=lr)
    assert max(abs(a - b) for a, b in zip(losses, through["losses"][2:])) < 1e-5
    two, one = optimizer_tensors(tmp_path / "ck-two"), optimizer_tensors(tmp_path / "ck-two-one")
    # what a single process loads, saved again at once (no step between): the ranks' parts, bit for bit
    train_one_process("cpu", range(2, 2), tmp_path, load=tmp_path / "ck-two", save=tmp_path / "ck-reload")
    reloaded = optimizer_tensors(tmp_path / "ck-reload")
    assert two.keys() == reloaded.keys() == one.keys()
    for name in two:
        assert torch.equal(two[name], reloaded[name]), name

    # 1 -> 2: a single process's checkpoint loads into 2 ranks, which save it back unchanged, and continue
    single_losses, _ = train_one_process("cpu", range(0, 2), tmp_path, save=tmp_path / "ck-one", lr=lr)
    rest, _ = train_one_process("cpu", range(2, 4), tmp_path, load=tmp_path / "ck-one", lr=lr)
    run_ranks(tmp_path, [
        dict(name="from-one", tier="cpu", steps=4, micro=1, lr=lr, load="ck-one", skip=2, save="ck-one-two",
             save_at=2),
    ])
    from_one = torch.load(tmp_path / "from-one.pt", weights_only=False)
    assert max(abs(a - b) for a, b in zip(from_one["losses"], rest)) < 1e-5
    saved, back = optimizer_tensors(tmp_path / "ck-one"), optimizer_tensors(tmp_path / "ck-one-two")
    for name in saved:
        assert torch.equal(saved[name], back[name]), name


def test_an_int8_checkpoint_of_one_process_loads_into_two_ranks_reencoded_with_a_warning(tmp_path):
    """A single process's int8 checkpoint holds each parameter's codes in blocks counted from its first element;
    two ranks cut some parameters between them, so their blocks start elsewhere: the codes are decoded and encoded
    again in the ranks' blocks, with a warning on every rank, and training continues close to the single
    process (rounded, not exact)."""
    lr = 1e-3
    train_one_process("cpu", range(0, 2), tmp_path, save=tmp_path / "ck-int8", lr=lr, moments="int8")
    rest, _ = train_one_process("cpu", range(2, 4), tmp_path, load=tmp_path / "ck-int8", lr=lr, moments="int8")
    run_ranks(tmp_path, [dict(name="int8-from-one", tier="cpu", steps=4, micro=1, lr=lr, moments="int8",
                              load="ck-int8", skip=2, load_warnings=True)])
    result = torch.load(tmp_path / "int8-from-one.pt", weights_only=False)
    assert all(result["agree"])
    assert max(abs(a - b) for a, b in zip(result["losses"], rest)) < 0.01 * rest[0], (result["losses"], rest)
    for rank in (0, 1):
        message = (tmp_path / f"int8-from-one-load-rank{rank}.txt").read_text()
        assert "stored in other quantization blocks" in message, message


def optimizer_file_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("optimizer-*.safetensors"))


def test_compressed_moments_of_two_ranks_are_stored_as_kept_and_resume_exactly(tmp_path):
    """bf16 and int8 moments data-parallel: each rank's file holds its part of them as the engine keeps them (bf16
    values; int8 codes with the scales of its blocks, which start at the part's first element), so two ranks resume
    bit for bit (on another tier too), and an int8 run's optimizer files are <= 0.3x an fp32 run's (0.29x: TinyGPT's
    headers and partial blocks). One process loads them: bf16 values as they are, int8 codes decoded and encoded
    again in its blocks, with a warning; fp32 parts load into int8 ranks converted, with the warning."""
    from offload.checkpoint.manifest import read_manifest
    from offload.checkpoint.tensor_file import TensorFileReader

    lr = 1e-3
    cases = []
    for fmt in ("fp32", "bf16", "int8"):
        cases += [dict(name=f"through-{fmt}", tier="cpu", steps=4, micro=1, lr=lr, moments=fmt, save=f"ck-{fmt}",
                       save_at=2),
                  dict(name=f"resumed-{fmt}", tier="nvme", steps=4, micro=1, lr=lr, moments=fmt, load=f"ck-{fmt}",
                       skip=2)]
    # fp32 parts (as every version wrote them before) into int8 ranks: converted, with the warning
    cases.append(dict(name="fp32-into-int8", tier="cpu", steps=4, micro=1, lr=lr, moments="int8", load="ck-fp32",
                      skip=2, load_warnings=True))
    run_ranks(tmp_path, cases)
    converted = torch.load(tmp_path / "fp32-into-int8.pt", weights_only=False)["losses"]
    fp32 = torch.load(tmp_path / "through-fp32.pt", weights_only=False)["losses"][2:]
    assert converted != fp32 and max(abs(a - b) for a, b in zip(converted, fp32)) < 0.01 * fp32[0], (converted, fp32)
    for rank in (0, 1):
        message = (tmp_path / f"fp32-into-int8-load-rank{rank}.txt").read_text()
        assert "saved with moments='fp32'" in message and "converted" in message, message
    for fmt in ("fp32", "bf16", "int8"):
        through = torch.load(tmp_path / f"through-{fmt}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed-{fmt}.pt", weights_only=False)
        assert resumed["losses"] == through["losses"][2:] and all(resumed["agree"]), fmt
        for name, value in through["weights"].items():
            assert torch.equal(resumed["weights"][name], value), (fmt, name)
        manifest = read_manifest(str(tmp_path / f"ck-{fmt}"))
        assert manifest["version"] == (3 if fmt == "fp32" else 4), manifest["version"]
        info = manifest["files"]["optimizer-00001-of-00002.safetensors"]
        reader = TensorFileReader(str(tmp_path / f"ck-{fmt}" / "optimizer-00001-of-00002.safetensors"),
                                  info["checksums"], manifest["checksum"], {})
        with reader:
            dtypes = {name.split("/", 1)[0]: reader.dtype_of(name) for name in reader.entries}
        expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[fmt]
        assert dtypes["exp_avg"] == dtypes["exp_avg_sq"] == expected, dtypes
        assert ("exp_avg_scales" in dtypes) == (fmt == "int8"), dtypes
    ratio = optimizer_file_bytes(tmp_path / "ck-int8") / optimizer_file_bytes(tmp_path / "ck-fp32")
    assert ratio <= 0.3, ratio

    # 2 -> 1: bf16 values load as they are (the single process continues as the ranks did, to rounding);
    # int8 codes are decoded and encoded again in whole-parameter blocks, with a warning
    bf16 = torch.load(tmp_path / "through-bf16.pt", weights_only=False)["losses"][2:]
    losses, _ = train_one_process("cpu", range(2, 4), tmp_path, load=tmp_path / "ck-bf16", lr=lr, moments="bf16")
    assert max(abs(a - b) for a, b in zip(losses, bf16)) < 1e-5, (losses, bf16)
    int8 = torch.load(tmp_path / "through-int8.pt", weights_only=False)["losses"][2:]
    with pytest.warns(RuntimeWarning, match="stored in other quantization blocks"):
        losses, _ = train_one_process("cpu", range(2, 4), tmp_path, load=tmp_path / "ck-int8", lr=lr,
                                      moments="int8")
    assert max(abs(a - b) for a, b in zip(losses, int8)) < 0.01 * int8[0], (losses, int8)


def test_a_rank_that_fails_to_save_switches_nothing(tmp_path):
    """Rank 1's disk fills while it writes its part: every rank raises naming rank 1, and the checkpoint
    saved before is still the one under the name, complete."""
    run_ranks(tmp_path, [
        dict(name="first", tier="cpu", steps=1, micro=1, save="ck"),
        dict(name="second", tier="cpu", steps=2, micro=1, save="ck", fail_rank=1),
    ])
    for rank in (0, 1):
        message = (tmp_path / f"second-rank{rank}.txt").read_text()
        assert "rank 1 could not write its part" in message and "nothing was switched" in message, message
    from offload.checkpoint.manifest import read_manifest

    assert read_manifest(str(tmp_path / "ck"))["step"] == 1
    assert not list(tmp_path.glob("ck.tmp-*"))
    optimizer_tensors(tmp_path / "ck")  # every part there, checksums verified


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's loss is NaN at step 2: with clipping (the global norm decides) and without (each block
    decides), every rank skips that step together and the ranks stay bit-identical; the run then equals
    one that never had step 2's batch."""
    cases = [dict(name="nan-clip", tier="cpu", steps=3, micro=1, max_grad_norm=1.0, nan_at=[1, 1], lr=1e-3),
             dict(name="nan-blocks", tier="nvme", steps=3, micro=1, nan_at=[1, 1], lr=1e-3)]
    run_ranks(tmp_path, cases)
    for case in cases:
        result = torch.load(tmp_path / f"{case['name']}.pt", weights_only=False)
        assert all(result["agree"]), case["name"]
        assert result["stats"]["skipped_steps"] == 1, (case["name"], result["stats"]["skipped_steps"])
        assert result["stats"]["optimizer_state_bytes"] > 0
        batches = make_batches(3, 1)  # the same batches with step 2 left out
        torch.manual_seed(0)
        model = TinyGPT()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=False)
        for i in (0, 2):
            (idx, tgt), = batches[i]
            model(idx, tgt).backward()
            if case.get("max_grad_norm"):
                torch.nn.utils.clip_grad_norm_(params, case["max_grad_norm"])
            opt.step()
            opt.zero_grad()
        for name, value in model.state_dict().items():
            err = (result["weights"][name].float() - value).abs().max().item()
            assert err < 1e-5, (case["name"], name, err)
