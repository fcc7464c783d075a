"""Where a group's compute weights live (the weight homes), the streamer's budget, LRU and pins, and the
read-through parameters (offload/scheduler/weights/)."""
