"""finetune.py's fine-tuning through the Hugging Face Trainer: `OffloadTrainer` keeps the Trainer's loop, LR
schedule, logging and `checkpoint-N` directories, and trains the model through an offload engine.

    python examples/finetune_trainer.py --make-tiny --out runs/tiny-trainer
    python examples/finetune_trainer.py --model llama-dir/ --text corpus.txt --out runs/ft --resume

Same flags, data and tiny model as finetune.py (examples/_common.py); the checkpoints are the Trainer's
(OUT/checkpoints/checkpoint-N: optimizer.pt and scheduler.pt too, which a plain transformers.Trainer resumes
as well) and so is the loss log (trainer_state.json), which a resumed run continues.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, Iterator, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/ is not a package
import _common  # noqa: E402


class WindowRows(torch.utils.data.IterableDataset):
    """TokenWindows' batches as single rows: the Trainer's dataloader batches per_device_train_batch_size of
    them again, so with that set to the windows' batch size it sees exactly finetune.py's micro-batches. A
    resumed Trainer skips the batches already trained on by reading them again (`ignore_data_skip=False`): the
    windows are a function of the seed and the batch number, so that replays the same stream."""

    def __init__(self, tokens: str, seq_len: int, batch_size: int, seed: int) -> None:
        from offload.data import open_token_files

        open_token_files(tokens, seq_len + 1)  # a bad token file fails here, not inside the dataloader
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        from offload.data import TokenWindows

        with TokenWindows(self.tokens, self.seq_len, self.batch_size, seed=self.seed) as windows:
            for batch in windows:  # endless: the Trainer stops at max_steps
                for row in batch:  # (seq_len + 1,) int64
                    # HF causal LMs shift labels internally: the whole window is input and label (finetune.py).
                    yield {"input_ids": row, "labels": row}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_common_arguments(parser)
    return parser.parse_args(argv)


def build_trainer(args: argparse.Namespace, model_dir: str, tokens: str) -> Any:
    """OffloadTrainer over the model built on the meta device (`build_empty`): the engine fills it block by
    block from `model_dir`'s shards (`offload=dict(weights=...)`), so it is never whole in memory either."""
    from transformers import AutoConfig, AutoTokenizer, TrainingArguments

    from offload.integrations.transformers import OffloadTrainer, build_empty

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = build_empty(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    nvme_path = args.nvme_path or os.path.join(args.out, "swap")
    os.makedirs(nvme_path, exist_ok=True)
    training_args = TrainingArguments(
        output_dir=os.path.join(args.out, "checkpoints"), max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.accum,
        learning_rate=_common.peak_lr(args), weight_decay=0.01, lr_scheduler_type="cosine",
        warmup_steps=args.warmup, max_grad_norm=args.max_grad_norm, bf16=args.dtype == "bfloat16",
        logging_steps=1, save_strategy="steps", save_steps=args.save_every, report_to="none", seed=args.seed,
        dataloader_num_workers=0, use_cpu=not torch.cuda.is_available())  # bf16 on a CPU needs use_cpu
    offload = dict(tier="nvme", nvme_path=nvme_path, weights=model_dir, dtype=getattr(torch, args.dtype),
                   host_memory=args.host_memory, device_memory=args.device_memory)
    return OffloadTrainer(model=model, args=training_args, processing_class=tokenizer,
                          train_dataset=WindowRows(tokens, args.seq_len, args.micro_batch, args.seed),
                          offload=offload)


def losses(log_history: List[Dict[str, Any]]) -> List[Dict[str, float]]:
    """The per-step training losses the Trainer logged (logging_steps=1), resumed steps included."""
    return [{"step": h["step"], "loss": h["loss"], "lr": h.get("learning_rate", 0.0),
             "grad_norm": h.get("grad_norm", 0.0)} for h in log_history if "loss" in h]


def main(argv: Optional[List[str]] = None) -> int:
    from transformers.trainer_utils import get_last_checkpoint

    args = parse_args(argv)
    model_dir, tokens, texts = _common.prepare(args)
    trainer = build_trainer(args, model_dir, tokens)
    print(trainer.engine.plan)
    checkpoints = trainer.args.output_dir
    last = get_last_checkpoint(checkpoints) if args.resume and os.path.isdir(checkpoints) else None
    if args.resume:
        print(f"resumed from {last}" if last else f"--resume: no checkpoint under {checkpoints} yet, starting at 0")
    result = trainer.train(resume_from_checkpoint=last)
    history = losses(trainer.state.log_history)
    _common.write_json(os.path.join(args.out, "history.json"), history)
    if history:
        print(f"loss: step {history[0]['step']} {history[0]['loss']:.4f} -> "
              f"step {history[-1]['step']} {history[-1]['loss']:.4f}")
    samples_per_s = result.metrics.get("train_samples_per_second", 0.0)
    print(f"{samples_per_s * args.seq_len:,.0f} tokens/s over the run")
    _common.plot_losses(history, os.path.join(args.out, "loss.png"), "finetune_trainer.py (OffloadTrainer)")
    _common.print_stats(trainer.engine.stats())
    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # engine.save_pretrained + the tokenizer (processing_class)
    trainer.engine.close()
    _common.show_export(args, model_dir, final, texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
