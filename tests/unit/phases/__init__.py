"""The hooks that call the phases, on a model of their own (offload/scheduler/phases/)."""
