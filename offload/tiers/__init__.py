"""The places training state lives: the device (a budget on CPU), host memory (staging pool) and disk (swap files)."""
