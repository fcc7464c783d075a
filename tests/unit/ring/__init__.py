"""The nvme ring on its own: its slots, its write ordering and its weight moves (offload/scheduler/ring/)."""
