"""Child processes for tests/test_checkpoint.py: resume in a new process, and a save killed mid-way.

`python -m tests.checkpoint_child resume <dir> <tier> <steps>`: wrap a fresh model, load <dir>/ckpt with
its scheduler and RNG state, train <steps> steps, save losses and weights to <dir>/resumed-<tier>.pt.
`python -m tests.checkpoint_child kill <dir> <pause_at>`: save a checkpoint at step 1, train a step, write
the expected weights of both, then save again with the <pause_at>-th os.fsync/os.rename call replaced by
"print PAUSED and sleep" (the parent then sends SIGKILL).
"""

from __future__ import annotations

import os
import sys
import time

import torch

import offload
from tests.devices import DEVICE, on_device
from tests.models import TinyGPT, make_batches
from tests.proc_status import reset_peak, status

LR, ACCUM = 3e-3, 2
BATCHES = make_batches(6, ACCUM, seed=3)


def make_engine(tier: str, directory: str, **options):
    torch.manual_seed(0)
    engine = offload.wrap(TinyGPT(), tier=tier, nvme_path=directory if tier == "nvme" else None, lr=LR,
                          weight_decay=0.1, dtype=torch.float32, device=DEVICE, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.8)
    return engine, scheduler


def train(engine, scheduler, steps):
    """`steps` optimizer steps of ACCUM micro-batches each; a little dropout noise from the global RNG so
    that RNG state matters for exact resume."""
    losses = []
    for step in steps:
        for idx, tgt in BATCHES[step]:
            idx, tgt = on_device(idx, tgt)
            noise = torch.rand(()) * 1e-3  # consumes the global RNG like dropout would
            loss = (engine(idx, tgt) + noise) / ACCUM
            loss.backward()
            losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        scheduler.step()
    return losses


def resume(directory: str, tier: str, steps: int) -> None:
    torch.set_num_threads(1)
    engine, scheduler = make_engine(tier, directory)
    engine.load(os.path.join(directory, "ckpt"), scheduler=scheduler, rng=True)
    start = engine.stats()["steps"]
    losses = train(engine, scheduler, range(int(start), int(start) + steps))
    torch.save({"losses": losses, "weights": engine.state_dict(), "lr": engine.optimizer.param_groups[0]["lr"]},
               os.path.join(directory, f"resumed-{tier}.pt"))
    engine.close()


def kill(directory: str, pause_at: int) -> None:
    torch.set_num_threads(1)
    engine, scheduler = make_engine("cpu", directory)
    path = os.path.join(directory, "ckpt")
    train(engine, scheduler, range(1))
    engine.save(path)
    torch.save(engine.state_dict(), os.path.join(directory, "expected-1.pt"))
    train(engine, scheduler, range(1, 2))
    torch.save(engine.state_dict(), os.path.join(directory, "expected-2.pt"))
    calls = [0]

    def pausing(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == pause_at:
                print("PAUSED", flush=True)
                time.sleep(600)
            return real(*args, **kwargs)
        return call

    os.fsync, os.rename = pausing(os.fsync), pausing(os.rename)
    engine.save(path)
    print("DONE", calls[0], flush=True)


RING_BYTES = 4 * 128 * 1024 * 16  # 4 slots of 128 Ki elements: the embedding's record is 32 chunks


def memory(directory: str) -> None:
    """Peak RSS growth of save and of load on the nvme tier, for a model whose embedding record is many
    ring chunks: prints the state's bytes, the largest record's, one chunk's, the largest group's weights
    and the growth of each phase."""
    from offload.planner.ring import min_ring_bytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=16384, dim=256, layers=4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = 4 * sum(p.numel() for p in trainable)
    # host_memory = gradients + ring + (ring - minimum): the planner gives the ring half of the spare
    engine = offload.wrap(model, tier="nvme", nvme_path=directory, dtype=torch.float32, device="cpu",
                          host_memory=grads + 2 * RING_BYTES - min_ring_bytes())
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1)
    train(engine, scheduler, range(1))
    engine.synchronize()
    groups = [(g, s) for _b, g, s in engine._checkpoints.checkpoint_groups()]
    state_bytes = 12 * sum(g.trainable_numel for g, s in groups if s is not None)
    record_bytes = max(12 * g.trainable_numel for g, s in groups if s is not None)
    chunk_bytes = 12 * int(engine.stats()["nvme_chunk_numel"])
    weight_bytes = max(g.nbytes for g, _s in groups)
    growth = {}
    for phase in ("save", "load"):
        reset_peak()
        before = status("VmRSS")
        if phase == "save":
            engine.save(os.path.join(directory, "ckpt"))
        else:
            engine.load(os.path.join(directory, "ckpt"))
        growth[phase] = status("VmHWM") - before
    print("MEMORY", state_bytes, record_bytes, chunk_bytes, weight_bytes, growth["save"], growth["load"], flush=True)
    engine.close()


if __name__ == "__main__":
    command, directory = sys.argv[1], sys.argv[2]
    if command == "memory":
        memory(directory)
    elif command == "resume":
        resume(directory, sys.argv[3], int(sys.argv[4]))
    else:
        kill(directory, int(sys.argv[3]))
