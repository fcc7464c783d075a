"""The engine's saved-tensor hooks (activations="offload", streamed weights) keep torch's own checks
(offload/scheduler/activations/meter.py, docs/design.md [Note: saved tensors written in place]):

* a tensor saved for the backward and then written in place raises torch's "modified by an inplace operation"
  error at the backward, on every path of the hooks (kept on the device, spilled to the swap file, a streamed
  weight); torch checks versions only when no hooks are set, and before this the backward read the values written
  in place (a gradient twice the true one);
* a torch.func transform that refuses the hooks names offload, the setting that turned them on, and the fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offload

DIM = 64
SMALL, LARGE = 8, 8192  # rows of the activation written in place: 2 KiB stays on the device, 2 MiB spills
TORCH_TEXT = "one of the variables needed for gradient computation has been modified by an inplace operation"


class Layer(nn.Module):
    def __init__(self, write_weight: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.write_weight = write_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)  # saves the weight (for x's gradient)
        if self.write_weight:
            with torch.no_grad():
                self.lin.weight.mul_(2)  # into the weight saved just now
        return out


class Net(nn.Module):
    """Four layers; after the second, exp (which saves its result) and, if asked, a write into that result."""

    def __init__(self, write_activation: bool = False, write_weight: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(write_weight and i == 1) for i in range(4)])
        self.write_activation = write_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1:
                x = x.exp()
                if self.write_activation:
                    x.mul_(2)  # exp's backward would read 2 * exp(x): a gradient twice the true one
                x = x * 1.0
        return x.sum()


def _wrap(net: nn.Module, setting: str, tmp_path) -> offload.Engine:
    kw = dict(dtype=torch.float32, device="cpu", lr=1e-3, weight_decay=0.0)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if setting == "activations":
        return offload.wrap(net, "nvme", nvme_path=str(tmp_path), activations="offload", **kw)
    engine = offload.wrap(net, "cpu", device_memory=40_000, **kw)  # every layer streams
    assert engine.plan.streamed_blocks
    return engine


def _torch_error(rows: int, **net_kw) -> str:
    torch.manual_seed(0)
    net = Net(**net_kw)
    with pytest.raises(RuntimeError, match=TORCH_TEXT) as raised:
        net(torch.randn(rows, DIM) * 0.1).backward()
    return str(raised.value)


@pytest.mark.parametrize("setting, rows, net_kw, where", [
    ("activations", SMALL, dict(write_activation=True), "kept on the device by activations='offload'"),
    ("activations", LARGE, dict(write_activation=True), "written to the swap file by activations='offload'"),
    ("activations", SMALL, dict(write_weight=True), "a weight of the model that stays on the device"),
    ("stream", SMALL, dict(write_activation=True), "kept on the device under the hooks that are on while weights "
                                                   "stream"),
    ("stream", LARGE, dict(write_activation=True), "kept on the device under the hooks"),
    ("stream", SMALL, dict(write_weight=True), "the weight 'layers.1.lin.weight' of block 'layers.1', which streams "
                                               "under device_memory"),
])
def test_a_saved_tensor_written_in_place_raises_as_in_torch(tmp_path, setting, rows, net_kw, where):
    """Before: no error, and the backward read the written values (the gradient came out 2x the true one)."""
    want = _torch_error(rows, **net_kw)
    torch.manual_seed(0)
    engine = _wrap(Net(**net_kw), setting, tmp_path)
    with pytest.raises(RuntimeError, match=TORCH_TEXT) as raised:
        engine(torch.randn(rows, DIM) * 0.1).backward()
    got = str(raised.value)
    # torch's words for which tensor and which versions: "[torch.FloatTensor [8, 64]], which is output 0 of Exp,
    # is at version 1; expected version 0 instead."
    tensor = want[want.index("["):want.index("]]") + 2]
    versions = want[want.index(" is at version"):want.index(" instead.")]
    assert tensor in got and versions in got, (got, want)
    if "write_activation" in net_kw:
        assert "which is output 0 of Exp," in got
    assert "offload" in got and where in got, got
    engine.close()


@pytest.mark.parametrize("setting", ["activations", "stream"])
def test_writes_torch_allows_still_train_exactly(tmp_path, setting):
    """In-place writes torch accepts (into a tensor nothing saved yet; a relu_ whose result is saved after its own
    write) raise nothing, and training is the run without the hooks (no activations offloaded, no streaming)."""
    class Allowed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                h = layer(x)
                h.add_(1.0)  # not saved by anything yet (addmm saves its inputs, not its output)
                x = torch.relu_(h) * 0.5  # relu_ saves its result at the version after its own write
            return (x * x).sum()

    def train(engine: offload.Engine, rows: int):
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            loss = engine(torch.randn(rows, DIM, generator=gen))
            loss.backward()
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        weights = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.close()
        return losses, weights

    for rows in (SMALL, LARGE):
        torch.manual_seed(0)
        want = train(offload.wrap(Allowed(), "cpu", dtype=torch.float32, device="cpu", lr=1e-3, weight_decay=0.0),
                     rows)
        torch.manual_seed(0)
        got = train(_wrap(Allowed(), setting, tmp_path / f"{rows}"), rows)
        assert got[0] == want[0]
        assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


class Jacobian(nn.Module):
    """A forward that calls torch.func.jacrev (refused under saved-tensor hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1:
                x = x + torch.func.jacrev(lambda y: (y.sin() * y).sum())(x.detach())
        return x.sum()


@pytest.mark.parametrize("setting, because, fix", [
    ("activations", "activations='offload' sends the tensors saved for the backward to the swap file",
     "activations=None"),
    ("stream", "stream under device_memory", "give device_memory room for the whole model"),
])
def test_a_func_transform_refusing_the_hooks_names_offload_and_the_setting(tmp_path, setting, because, fix):
    """Before: torch's "don't yet support saved tensor hooks" alone, naming neither offload nor the setting."""
    torch.manual_seed(0)
    x = torch.randn(4, DIM)
    Jacobian()(x).backward()  # plain torch: no hooks, it works
    engine = _wrap(Jacobian(), setting, tmp_path)
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks") as inside:
        engine(x)
    message = str(inside.value)
    assert "inside the wrapped model's forward" in message and because in message and fix in message, message
    if setting == "stream":
        assert "'layers.0'" in message
    # around the model: the transform encloses the forward, and the hooks are refused as the forward starts
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks") as around:
        torch.func.grad(engine)(x)
    message = str(around.value)
    assert "runs inside a torch.func transform" in message and because in message and fix in message, message
    engine.close()


def test_without_the_hooks_func_transforms_run_in_the_forward():
    """With activations kept and no block streaming, the engine sets no saved-tensor hooks: jacrev in the forward
    runs as in plain torch."""
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    want = Jacobian()(x)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = offload.wrap(Jacobian(), "cpu", dtype=torch.float32, device="cpu", lr=1e-3, weight_decay=0.0)
    loss = engine(x)
    assert loss.item() == want.item()
    loss.backward()
    engine.step()
    engine.close()
