"""A forward whose order changes costs speed, never correctness or a hang (issue 3, NEEDS.md P17).

Each step of these runs has a data-dependent branch (a layer skipped for some batches), a second forward
under no_grad (a reference model's pass, as in RLHF), a `generate()` loop with a growing context every
other step, and a backward with `retain_graph=True` followed by a second backward of the same graph. The
engine must match plain PyTorch with torch.optim.AdamW (fp32, CPU) on every tier, with weights streamed
under a small device budget and with weights on disk.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F

import offload
from tests.models import TinyGPT, make_batches, one_intraop_thread

TOL = 1e-5
STEPS = 4
LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1

_threads = pytest.fixture(autouse=True, scope="module")(one_intraop_thread)


class BranchingGPT(TinyGPT):
    """TinyGPT whose second layer runs only for batches with an even token sum, with a `generate()`."""

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for i, layer in enumerate(self.h):
            if i == 2 and int(idx.sum()) % 2 == 1:
                continue  # a data-dependent branch: the recorded block order does not hold for this batch
            x = layer(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        for _ in range(new_tokens):
            idx = torch.cat([idx, self.logits(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


def _train(step_fn, batches, reference_batch, prompt):
    """The same loop for both sides; `step_fn` is plain AdamW's or the engine's step + zero_grad."""

    def run(model, optimizer_step):
        losses, generated = [], []
        for step, ((idx, tgt),) in enumerate(batches):
            loss = model(idx, tgt)
            loss.backward(retain_graph=True)  # the same graph twice: the gradients add up
            loss.backward()
            losses.append(loss.item())
            with torch.no_grad():
                losses.append(model(*reference_batch).item())  # a second forward in the step
            optimizer_step()
            if step % 2 == 0:
                generated.append(model.generate(prompt, 6))
        return losses, generated

    return run


def _run_engine(model, batches, reference_batch, prompt, tier, **budgets):
    nvme_path = tempfile.mkdtemp(prefix="offload-test-") if tier == "nvme" else None
    engine = offload.wrap(model, tier=tier, nvme_path=nvme_path, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          dtype=torch.float32, device="cpu", **budgets)

    def step():
        engine.step()
        engine.zero_grad()

    with engine:
        losses, generated = _train(step, batches, reference_batch, prompt)(model, step)
        state = engine.state_dict()
        stats = dict(engine.stats(), disk_weight_blocks=len(engine.plan.disk_weight_blocks))
    return losses, generated, state, stats


@pytest.mark.parametrize("tier,budgets", [
    ("gpu", {}),
    ("cpu", {}),
    ("nvme", {}),
    ("cpu", {"device_memory": 80_000}),                                  # layers streamed from the host
    ("nvme", {"device_memory": 80_000, "host_memory": 300 << 10}),        # streamed weights on disk too
], ids=["gpu", "cpu", "nvme", "cpu-streamed", "nvme-weights-on-disk"])
def test_changed_order_second_forward_generate_and_retain_graph_match_adamw(tier, budgets):
    torch.manual_seed(0)
    model = BranchingGPT()
    initial_fc = model.h[0].fc.weight.detach().clone()
    twin = copy.deepcopy(model)
    twin.lm_head.weight = twin.wte.weight
    batches = make_batches(STEPS, 1)
    reference_batch = make_batches(1, 1, seed=7)[0][0]
    prompt = reference_batch[0][:2, :5]
    assert len({int(idx.sum()) % 2 for ((idx, _t),) in batches}) == 2, "both branches must be taken"

    params = [p for p in twin.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)

    def reference_step():
        optimizer.step()
        optimizer.zero_grad()

    ref_losses, ref_generated = _train(reference_step, batches, reference_batch, prompt)(twin, reference_step)
    ref_state = twin.state_dict()
    losses, generated, state, stats = _run_engine(model, batches, reference_batch, prompt, tier, **budgets)

    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(generated, ref_generated))
    for name, ref in ref_state.items():
        diff = (state[name] - ref).abs().max().item()
        assert diff <= TOL, f"{name}: max abs diff {diff}"
    assert (ref_state["h.0.fc.weight"] - initial_fc).abs().max() > 1e-3  # the weights moved
    if budgets:
        assert stats["block_evictions"] > 0  # the budget really made blocks stream
    if "host_memory" in budgets:
        assert stats["disk_weight_blocks"] > 0  # and weights really lived on disk
    assert stats["steps"] == STEPS



@pytest.mark.parametrize("tier,budgets", [("cpu", {}), ("cpu", {"device_memory": 80_000})], ids=["cpu", "cpu-streamed"])
def test_torch_compile_of_the_wrapped_model_gives_the_eager_losses(tier, budgets):
    """NEEDS.md P18: `torch.compile(engine.module)` works; dynamo breaks the graph at the engine's hooks (each
    module owning parameters), so the losses are the eager engine's. aot_eager keeps the test fast; it runs
    the same capture and autograd as inductor without generating kernels."""

    def losses(compiled: bool):
        torch.manual_seed(0)
        model = TinyGPT()
        with offload.wrap(model, tier=tier, lr=LR, weight_decay=WD, dtype=torch.float32, device="cpu",
                          **budgets) as engine:
            forward = torch.compile(engine.module, backend="aot_eager") if compiled else engine
            out = []
            for ((idx, tgt),) in make_batches(STEPS, 1):
                loss = forward(idx, tgt)
                loss.backward()
                engine.step()
                engine.zero_grad()
                out.append(loss.item())
            return out, engine.state_dict()

    torch._dynamo.reset()
    eager, eager_state = losses(False)
    compiled, compiled_state = losses(True)
    torch._dynamo.reset()
    assert compiled == eager
    assert all(torch.equal(compiled_state[k], eager_state[k]) for k in eager_state)
