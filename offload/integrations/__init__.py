"""Integrations with other libraries, each in its own module, imported only when asked for.

- `offload.integrations.transformers`: `from_pretrained(dir, **wrap_options)`, a Hugging Face model built on
  the meta device and filled block by block from its shards, `OffloadTrainer`, transformers.Trainer training
  through an engine, and `OffloadTrainerMixin`, the same for any Trainer subclass (TRL's SFTTrainer, ...:
  `class OffloadSFTTrainer(OffloadTrainerMixin, SFTTrainer)`) (needs `pip install transformers accelerate`).

Nothing here is imported by `import offload`, and this package imports no optional dependency itself.
"""
