"""Integrations with other libraries, each in its own module, imported only when asked for.

- `offload.integrations.transformers`: `from_pretrained(dir, **wrap_options)`, a Hugging Face model built on
  the meta device and filled block by block from its shards, `OffloadTrainer`, transformers.Trainer training
  through an engine, and `OffloadTrainerMixin`, the same for any Trainer subclass (TRL's SFTTrainer, ...:
  `class OffloadSFTTrainer(OffloadTrainerMixin, SFTTrainer)`; DPOTrainer and GRPOTrainer too) (needs
  `pip install transformers accelerate`).
- `offload.integrations.accelerate`: accelerate's own loop (`accelerator.prepare(engine.module, engine.optimizer,
  ...)`, `clip_grad_norm_`, `save_state` / `load_state`) over an engine, under `accelerate launch` with several
  processes too: `wrap()` hooks it in when accelerate is imported.

Nothing here is imported by `import offload`, and this package imports no optional dependency itself.
"""
