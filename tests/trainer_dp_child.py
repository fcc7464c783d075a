"""One rank of the OffloadTrainer data-parallel test (tests/test_hf_trainer.py), started by torchrun.

`... trainer_dp_child.py <repo> <out> <tier> [<checkpoint to resume from>]`: trains the tiny Llama of
test_hf_trainer.py with OffloadTrainer, one sample per rank per micro-batch (the reference Trainer takes
both ranks' samples in one process), saving at step 3; rank 0 writes the logged (step, loss, grad_norm)
and the final weights to <out>/<run>.pt.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])

from pathlib import Path  # noqa: E402

from offload.integrations.transformers import OffloadTrainer  # noqa: E402
from tests.test_hf_trainer import _args, _dataset, _logged, _model, _offload  # noqa: E402


def main() -> None:
    out, tier = Path(sys.argv[2]), sys.argv[3]
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")  # as torchrun users do; the Trainer would start it too
    if tier.endswith("-4x"):  # transformers 4.x's save_model: _save on the saving rank only
        import transformers

        def save_model(self, output_dir=None, _internal_call=False):
            if self.args.should_save:
                self._save(output_dir if output_dir is not None else self.args.output_dir)

        transformers.Trainer.save_model = save_model
    rank = dist.get_rank()
    swap = out / f"swap-{tier}"
    args = _args(out / "run", per_device_train_batch_size=1, save_strategy="steps", save_steps=3)
    trainer = OffloadTrainer(model=_model(), args=args, train_dataset=_dataset(), offload=_offload(tier, swap.parent))
    assert trainer.engine is not None and trainer.engine.data_parallel is not None
    assert trainer.engine.weights_sharded == tier.startswith("nvme-sharded")
    trainer.train(resume_from_checkpoint=resume)
    weights = trainer.engine.state_dict()
    trainer.engine.close()
    if rank == 0:
        torch.save({"logs": _logged(trainer), "weights": weights},
                   out / ("resumed.pt" if resume else "trained.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
