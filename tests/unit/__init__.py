"""Unit tests: one seam of the engine at a time, without an engine."""
