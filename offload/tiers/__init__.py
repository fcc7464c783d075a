"""The places training state lives: the device, host memory (staging pool) and disk (swap files)."""
