"""What the step worker runs for a block: its update and its gradient norms (offload/scheduler/worker/)."""
