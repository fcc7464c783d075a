"""accelerate's own loop over an engine under `accelerate launch` with 2 processes (issue 37, item 1).

accelerate's `prepare` puts a model in DistributedDataParallel when several processes run; for an engine's module
it now leaves the gradient reduction to the engine (offload/integrations/accelerate.py). The user's loop,
unchanged from the one over torch's AdamW (tests/accelerate_launch_child.py: `prepare(model, optimizer,
scheduler, loader)`, `accumulate(model)` over 2 micro-batches, `backward`, `clip_grad_norm_` that clips,
`gather_for_metrics`, `save_state` at step 3), trains as that loop does under DDP: gathered losses, clip norms
and final weights within 1e-5 on the cpu and nvme tiers with replicated and sharded weights, the ranks
bit-identical; `load_state` of its state continues exactly on 2 ranks, and in 1 process as the torch loop does
from DDP's state. One launch runs every case (start-up is the slow part). In this process, one process: the
refusals at `prepare`, `load_state` into streamed blocks, and `mixed_precision="bf16"` (accelerate's autocast).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist

import offload
from offload.errors import OffloadConfigError
from tests.models import TinyGPT, one_intraop_thread

accelerate = pytest.importorskip("accelerate", reason="needs accelerate: pip install -e '.[hf]'")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parent.parent
CHILD = ROOT / "tests" / "accelerate_launch_child.py"
LAUNCH_SECONDS = 400
TOL = 1e-5
SAVE_AT = 3
CONFIGS = ["cpu", "nvme", "cpu-sharded", "nvme-sharded"]
_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not in this build")


def _engine_case(name: str, **more: Any) -> Dict[str, Any]:
    tier, _, sharded = name.partition("-")
    return dict(name=name, engine=True, tier=tier, shard=bool(sharded), **more)


def _run(command: List[str], out: Path, cases: List[Dict[str, Any]]) -> None:
    spec = out / f"cases-{len(list(out.glob('cases-*')))}.json"
    spec.write_text(json.dumps(cases))
    done = subprocess.run(command + [str(CHILD), str(ROOT), str(out), str(spec)], capture_output=True, text=True,
                          timeout=LAUNCH_SECONDS, cwd=out)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-8000:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case: one `accelerate launch` of 2 processes (gloo on the CPU: `--multi_gpu` is its launcher of
    several local processes, `Accelerator(cpu=True)` in the script), then one process loading their states."""
    out = tmp_path_factory.mktemp("accelerate-launch")
    cases = [dict(name="ddp", engine=False, save="ddp-state", save_at=SAVE_AT)]
    for config in CONFIGS:
        cases.append(_engine_case(config, save=f"{config}-state", save_at=SAVE_AT))
        cases.append(_engine_case(f"{config}", load=f"{config}-state", load_at=SAVE_AT) | {"name": f"{config}-resumed"})
    cases.append(_engine_case("cpu", clip_part=True) | {"name": "clip-part"})
    _run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"], out, cases)
    one = [dict(name="ddp-into-1", engine=False, load="ddp-state", load_at=SAVE_AT)]
    one += [_engine_case(c, load=f"{c}-state", load_at=SAVE_AT) | {"name": f"{c}-into-1"} for c in ("cpu", "nvme-sharded")]
    _run([sys.executable], out, one)
    return out


def _result(runs: Path, name: str) -> Dict[str, Any]:
    return torch.load(runs / f"{name}.pt", weights_only=False)


def _assert_same(got: Dict[str, Any], want: Dict[str, Any], tol: float) -> None:
    assert len(got["losses"]) == len(want["losses"]) and len(got["norms"]) == len(want["norms"])
    loss_diff = max(abs(a - b) for g, w in zip(got["losses"], want["losses"]) for a, b in zip(g, w))
    norm_diff = max(abs(a - b) for a, b in zip(got["norms"], want["norms"]))
    assert loss_diff <= tol and norm_diff <= tol, (loss_diff, norm_diff)
    for key, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, atol=tol, rtol=0, msg=key)


pytestmark = [needs_gloo]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_accelerates_loop_trains_as_ddp_with_torch_adamw(runs: Path, config: str) -> None:
    want, got = _result(runs, "ddp"), _result(runs, config)
    assert want["wrapped"] == "DistributedDataParallel" and want["world"] == 2  # the reference ran under DDP
    assert got["wrapped"] == "TinyGPT"  # prepare left the engine's module to the engine
    assert got["agree"] and want["agree"]  # every rank's weights bit-identical to rank 0's
    assert min(want["norms"]) > 0.5  # accelerator.clip_grad_norm_(..., 0.5) clipped at every step
    assert len(got["losses"]) == 12 and all(len(pair) == 2 for pair in got["losses"])  # gathered from both ranks
    _assert_same(got, want, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_load_state_on_two_ranks_continues_exactly(runs: Path, config: str) -> None:
    whole, resumed = _result(runs, config), _result(runs, f"{config}-resumed")
    assert resumed["agree"]
    _assert_same(resumed, {**whole, "losses": whole["losses"][2 * SAVE_AT:], "norms": whole["norms"][SAVE_AT:]}, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu", "nvme-sharded"])
def test_a_state_saved_by_two_ranks_loads_into_one_process(runs: Path, config: str) -> None:
    """One process on both ranks' samples per micro-batch, from the 2-rank state, as the torch loop from DDP's
    (accelerate steps the schedule once per step in one process, twice under 2: both sides alike)."""
    want, got = _result(runs, "ddp-into-1"), _result(runs, f"{config}-into-1")
    assert got["world"] == 1 and len(got["norms"]) == SAVE_AT
    _assert_same(got, want, TOL)


@pytest.mark.slow
def test_clipping_part_of_a_data_parallel_engine_is_refused(runs: Path) -> None:
    (message,) = _result(runs, "clip-part")["norms"]
    assert "part of a data-parallel engine's parameters" in message and "model.parameters()" in message


# ----- one process: what prepare refuses, the streamed blocks' load_state, bf16's autocast ----------------------
@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """accelerate's process-wide state (its AcceleratorState and GradientState singletons) afresh, before and after."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_prepare_refuses_what_would_train_otherwise(fresh_accelerate: None) -> None:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    with offload.wrap(TinyGPT(), tier="cpu", device="cpu") as engine:
        other_world = types.SimpleNamespace(num_processes=2, scaler=None)
        with pytest.raises(OffloadConfigError, match=r"runs 2 processes but the engine was made by offload.wrap\(\) "
                                                     r"for 1 .*make the Accelerator first"):
            accelerate.Accelerator.prepare_model(other_world, engine.module)
        fp16 = types.SimpleNamespace(num_processes=1, scaler=object())
        with pytest.raises(OffloadConfigError, match=r"mixed_precision='fp16'.*use mixed_precision='bf16'"):
            accelerate.Accelerator.prepare_model(fp16, engine.module)
        assert accelerator.prepare(engine.module) is engine.module  # one process: as is, registered
        assert accelerator._models == [engine.module]
    plain = TinyGPT()
    assert accelerator.prepare(plain) is plain  # another model: accelerate's own prepare (one process: no DDP)


def test_streamed_blocks_save_and_load_state_exactly(tmp_path: Path, fresh_accelerate: None) -> None:
    """Blocks streamed under a device budget hold placeholders that `model.load_state_dict` cannot write: their
    weights come through the engine in accelerate's load pre-hook (before: load_state raised)."""
    from tests.accelerate_launch_child import run
    from tests.test_engine_streaming import BUDGET

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    options = dict(device_memory=BUDGET)
    run(accelerator, dict(name="plain", engine=False), str(tmp_path))
    run(accelerator, dict(_engine_case("cpu", save="state", save_at=SAVE_AT), options=options), str(tmp_path))
    run(accelerator, dict(_engine_case("cpu", load="state", load_at=SAVE_AT), name="resumed", options=options),
        str(tmp_path))
    plain, whole, resumed = (_result(tmp_path, name) for name in ("plain", "cpu", "resumed"))
    assert whole["streamed"] == ["h.0", "h.1", "h.2"]
    _assert_same(whole, plain, TOL)
    _assert_same(resumed, {**whole, "losses": whole["losses"][2 * SAVE_AT:], "norms": whole["norms"][SAVE_AT:]}, 0.0)


def test_bf16_mixed_precision_runs_the_engine_under_accelerates_autocast(tmp_path: Path,
                                                                        fresh_accelerate: None) -> None:
    """`Accelerator(mixed_precision="bf16")`: prepare keeps its autocast around the engine's module (fp32 weights,
    bf16 matmuls), as around the plain model."""
    from tests.accelerate_launch_child import dataset, run

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision="bf16")
    run(accelerator, dict(name="plain", engine=False), str(tmp_path))
    run(accelerator, _engine_case("cpu"), str(tmp_path))
    plain, ours = _result(tmp_path, "plain"), _result(tmp_path, "cpu")
    _assert_same(ours, plain, TOL)
    torch.manual_seed(0)
    with torch.no_grad():
        fp32 = TinyGPT()(*next(iter(torch.utils.data.DataLoader(dataset(), batch_size=4))))
    assert abs(plain["losses"][0][0] - float(fp32)) > 1e-4  # the autocast did change the arithmetic
