"""Memory tiers: the compute device (a budget), host memory and disk."""
